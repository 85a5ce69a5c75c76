// weighted_sum: out = base + alpha * sum_i coef[i] * U[rows[i]], one pass over the selected rows.
//
// Each thread owns a 16-byte group of columns (float4 / 8 x half / 2 x double) when every row,
// base and out are 16-byte aligned, otherwise single columns (coalesced scalar path); see
// weighted_sum.cuh (wsum::col, wsum::vec_ok). The coefficients (alpha * coef[i], rounded once to
// the accumulation type) and row pointers are staged in shared memory in batches of 256 rows.
// out (and base) have U's dtype, or for fp16/bf16 U a wider fp32/fp64 (the CPU op's rule, csrc/
// weighted_sum_checks.h): each thread then loads its V = 16 / sizeof(U's type) columns of U in one
// 16-byte load and writes them to out as V * sizeof(out's type) / 16 16-byte stores.
// Accumulation type as the CPU op: out's (float for fp16/bf16/fp32 out, double for fp64 out), and
// double for any out when some |alpha * coef[i]| does not fit in float (each block checks all
// coefficients first: one __syncthreads_or over n values). An element of U converts exactly to the
// accumulation type, so a wide out gives the bits of summing U converted to out's dtype. Each output element accumulates the
// rows in index order with fma: deterministic. An out-of-range rows entry contributes NaN (no
// device assert, no read outside U). out may alias base: every element of base is read by the
// thread that writes the same element of out, before the write.
// ok != nullptr (weighted_sum_screened): ok[i] (set to true by the caller) becomes false when row
// rows[i] holds a NaN/Inf. The screen rides inside the pass: each block votes on its accumulators
// being finite; only a block with a non-finite one re-reads its columns of the n rows (rare: a bad
// row or an overflow). Bytes moved: as weighted_sum, plus those re-read blocks.
// sigma > 0 (weighted_sum_noised): each output element also gets sigma * N(seed, counter, offset + j) in its
// write (gaussian_noise.cuh's normal and add_noise, the CPU kernel's functions: the same noise bits).
// Host-tested (weighted_sum.cuh, tests/test_weighted_sum.py's host cases): see weighted_sum.cuh (columns per thread,
// tails, accumulation-type rule, NaN for bad rows, row order). Only a GPU run checks
// (tests/test_weighted_sum.py's cuda cases, tests/test_weighted_sum_wide.py): the shared-memory staging between barriers, the
// 16-byte loads, the wide out's 16-byte pieces (load_vec_rw / store_vec), the launch.
#include <type_traits>

#include "common.cuh"
#include "weighted_sum.cuh"
#include "gaussian_noise.cuh"

namespace fedkernels {
namespace cuda {
namespace {

using namespace detail;
using wsum::kThreads;

// weighted_sum_noised's noise (sigma == 0: none).
struct Noise {
  double sigma;
  uint64_t seed, counter, offset;  // column j draws N(seed, counter, offset + j)
};

// N elements of O at a 16-byte aligned p (N * sizeof(O) a multiple of 16), in 16-byte pieces: the
// epilogue's base/out access when out is wider than U (N = U's vector width). For O == U's type
// this is one 16-byte access, as load16_rw / store16.
template <typename O, int N, typename A>
__device__ __forceinline__ void load_vec_rw(const O* p, A (&v)[N]) {
  static_assert((N * sizeof(O)) % 16 == 0, "whole 16-byte pieces");
  constexpr int P = (int)(N * sizeof(O) / 16), E = 16 / (int)sizeof(O);
#pragma unroll
  for (int q = 0; q < P; ++q) {
    uint4 raw = reinterpret_cast<const uint4*>(p)[q];
    const O* e = reinterpret_cast<const O*>(&raw);
#pragma unroll
    for (int i = 0; i < E; ++i) v[q * E + i] = static_cast<A>(to_float(e[i]));
  }
}
template <typename O, int N, typename A>
__device__ __forceinline__ void store_vec(O* p, const A (&v)[N]) {
  static_assert((N * sizeof(O)) % 16 == 0, "whole 16-byte pieces");
  constexpr int P = (int)(N * sizeof(O) / 16), E = 16 / (int)sizeof(O);
#pragma unroll
  for (int q = 0; q < P; ++q) {
    uint4 raw;
    O* e = reinterpret_cast<O*>(&raw);
#pragma unroll
    for (int i = 0; i < E; ++i) e[i] = from_acc<O>(v[q * E + i]);
    reinterpret_cast<uint4*>(p)[q] = raw;
  }
}

template <typename T, typename O, typename A, bool VEC>
__device__ __forceinline__ void wsum_body(const T* __restrict__ U, int64_t K, int64_t d, int64_t ld,
                                          const double* __restrict__ coef, const int64_t* __restrict__ rows, int64_t n,
                                          const O* base, double alpha, O* out, A* cs, const T** rp, bool* ok,
                                          Noise nz) {
  constexpr int V = Vec16<T>::n;
  const int tid = threadIdx.x;
  const int64_t b = blockIdx.x;
  A acc[V];
#pragma unroll
  for (int e = 0; e < V; ++e) acc[e] = A(0);

  const int64_t jv = wsum::col(b, tid, 0, V, true);
  const bool full = VEC && jv + V <= d;

  for (int64_t i0 = 0; i0 < n; i0 += kThreads) {
    const int nb = (int)(n - i0 < kThreads ? n - i0 : kThreads);
    __syncthreads();
    if (tid < nb) {
      const int64_t r = rows ? rows[i0 + tid] : i0 + tid;
      const bool ok = wsum::row_ok(r, K);
      // A bad row reads row 0 with a NaN coefficient: the output is NaN, never a plausible value.
      cs[tid] = ok ? static_cast<A>(alpha * coef[i0 + tid]) : static_cast<A>(NAN);
      rp[tid] = U + (ok ? r : 0) * ld;
    }
    __syncthreads();
    if (full) {
      int i = 0;
      for (; i + 4 <= nb; i += 4) {
        A x0[V], x1[V], x2[V], x3[V];
        load16<T, A>(rp[i] + jv, x0);
        load16<T, A>(rp[i + 1] + jv, x1);
        load16<T, A>(rp[i + 2] + jv, x2);
        load16<T, A>(rp[i + 3] + jv, x3);
        const A c0 = cs[i], c1 = cs[i + 1], c2 = cs[i + 2], c3 = cs[i + 3];
#pragma unroll
        for (int e = 0; e < V; ++e) {
          acc[e] = wsum::accumulate(acc[e], c0, x0[e]);
          acc[e] = wsum::accumulate(acc[e], c1, x1[e]);
          acc[e] = wsum::accumulate(acc[e], c2, x2[e]);
          acc[e] = wsum::accumulate(acc[e], c3, x3[e]);
        }
      }
      for (; i < nb; ++i) {
        A x0[V];
        load16<T, A>(rp[i] + jv, x0);
        const A c0 = cs[i];
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] = wsum::accumulate(acc[e], c0, x0[e]);
      }
    } else {  // scalar path, or the tail of the last block on the vector path
      for (int i = 0; i < nb; ++i) {
        const A c0 = cs[i];
        const T* p = rp[i];
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const int64_t j = wsum::col(b, tid, e, V, VEC);
          if (j < d) acc[e] = wsum::accumulate(acc[e], c0, static_cast<A>(to_float(__ldg(p + j))));
        }
      }
    }
  }

  if (ok) {  // the screen (weighted_sum_screened): block-uniform vote, rescan only on a bad block
    bool fin = true;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const int64_t j = wsum::col(b, tid, e, V, VEC);
      if (j < d) fin = fin && wsum::finite(acc[e]);
    }
    if (__syncthreads_or(!fin)) {
      for (int64_t i = 0; i < n; ++i) {
        const int64_t r = rows ? rows[i] : i;
        bool rf = wsum::row_ok(r, K);
        if (rf) {
          const T* p = U + r * ld;
#pragma unroll
          for (int e = 0; e < V; ++e) {
            const int64_t j = wsum::col(b, tid, e, V, VEC);
            if (j < d) rf = rf && wsum::finite(static_cast<A>(to_float(p[j])));
          }
        }
        if (!rf) ok[i] = false;  // every writer writes false: a benign race
      }
    }
  }

  if (full) {
    if (base) {
      A bv[V];
      load_vec_rw<O, V, A>(base + jv, bv);
#pragma unroll
      for (int e = 0; e < V; ++e) acc[e] = bv[e] + acc[e];
    }
    if (nz.sigma != 0) {
#pragma unroll
      for (int e = 0; e < V; ++e)
        acc[e] = gnoise::add_noise(acc[e], nz.sigma, gnoise::normal(nz.seed, nz.counter, nz.offset + (uint64_t)(jv + e)));
    }
    store_vec<O, V, A>(out + jv, acc);
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const int64_t j = wsum::col(b, tid, e, V, VEC);
      if (j < d) {
        A v = acc[e];
        if (base) v = static_cast<A>(to_float(base[j])) + v;
        if (nz.sigma != 0) v = gnoise::add_noise(v, nz.sigma, gnoise::normal(nz.seed, nz.counter, nz.offset + (uint64_t)j));
        out[j] = from_acc<O>(v);
      }
    }
  }
}

// wide: 1 = accumulate in double, 0 = in out's accumulation type, -1 = decide here from coef.
template <typename T, typename O, bool VEC>
__global__ void __launch_bounds__(kThreads)
    wsum_kernel(const T* __restrict__ U, int64_t K, int64_t d, int64_t ld, const double* __restrict__ coef,
                const int64_t* __restrict__ rows, int64_t n, const O* base, double alpha, O* out, int wide, bool* ok,
                Noise nz) {
  __shared__ double cs[kThreads];
  __shared__ const T* rp[kThreads];
  if (wide < 0) {
    bool bad = false;
    for (int64_t i = threadIdx.x; i < n; i += kThreads) bad |= !wsum::fits_float(alpha, coef[i]);
    wide = __syncthreads_or(bad) ? 1 : 0;
  }
  using A = typename Acc<O>::type;
  if (wide == 0 || sizeof(A) == sizeof(double))
    wsum_body<T, O, A, VEC>(U, K, d, ld, coef, rows, n, base, alpha, out, reinterpret_cast<A*>(cs), rp, ok, nz);
  else
    wsum_body<T, O, double, VEC>(U, K, d, ld, coef, rows, n, base, alpha, out, cs, rp, ok, nz);
}

template <typename T, typename O>
cudaError_t launch(const void* U, int64_t K, int64_t d, int64_t ld, const double* coef, const int64_t* rows,
                   int64_t n, const void* base, double alpha, int wide, void* out, bool* ok, cudaStream_t stream,
                   Noise nz) {
  constexpr int V = Vec16<T>::n;
  const T* u = static_cast<const T*>(U);
  const O* b = static_cast<const O*>(base);
  O* o = static_cast<O*>(out);
  const bool vec = wsum::vec_ok(reinterpret_cast<uintptr_t>(u), ld * (int64_t)sizeof(T), K,
                                reinterpret_cast<uintptr_t>(o), reinterpret_cast<uintptr_t>(b));
  const int64_t blocks = wsum::num_blocks(d, V);
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  if (vec)
    wsum_kernel<T, O, true><<<(unsigned)blocks, kThreads, 0, stream>>>(u, K, d, ld, coef, rows, n, b, alpha, o, wide, ok, nz);
  else
    wsum_kernel<T, O, false><<<(unsigned)blocks, kThreads, 0, stream>>>(u, K, d, ld, coef, rows, n, b, alpha, o, wide, ok, nz);
  return cudaGetLastError();
}

}  // namespace

cudaError_t weighted_sum(const void* U, DType dt, int64_t K, int64_t d, int64_t ld, const double* coef,
                         const int64_t* rows, int64_t n, const void* base, double alpha, int wide, void* out,
                         DType out_dt, bool* ok, cudaStream_t stream, double sigma, uint64_t seed,
                         uint64_t counter, uint64_t offset) {
  if (d <= 0) return cudaSuccess;
  const Noise nz{sigma, seed, counter, offset};
  return dispatch(dt, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (out_dt == dt) return launch<T, T>(U, K, d, ld, coef, rows, n, base, alpha, wide, out, ok, stream, nz);
    if constexpr (std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>) {  // a wider out
      if (out_dt == DType::Float32) return launch<T, float>(U, K, d, ld, coef, rows, n, base, alpha, wide, out, ok, stream, nz);
      if (out_dt == DType::Float64) return launch<T, double>(U, K, d, ld, coef, rows, n, base, alpha, wide, out, ok, stream, nz);
    }
    return cudaErrorInvalidValue;  // the glue's checks (csrc/weighted_sum_checks.h) allow nothing else
  });
}

}  // namespace cuda
}  // namespace fedkernels
