// weighted_sum: out = base + alpha * sum_i coef[i] * U[rows[i]], one pass over the selected rows.
//
// Each thread owns a 16-byte group of columns (float4 / 8 x half / 2 x double) when every row,
// base and out are 16-byte aligned, otherwise single columns (coalesced scalar path). The
// coefficients (alpha * coef[i], rounded once to the accumulation type as on the CPU) and row
// pointers are staged in shared memory in batches of 256 rows. Each output element accumulates
// the rows in index order with fma: deterministic. out may alias base: every element of base is
// read by the thread that writes the same element of out, before the write.
#include "common.cuh"

#include <cassert>

namespace fedkernels {
namespace cuda {
namespace {

using namespace detail;

constexpr int kThreads = 256;

template <typename T, bool VEC>
__global__ void __launch_bounds__(kThreads)
    wsum_kernel(const T* __restrict__ U, int64_t K, int64_t d, int64_t ld, const double* __restrict__ coef,
                const int64_t* __restrict__ rows, int64_t n, const T* base, double alpha, T* out) {
  using A = typename Acc<T>::type;
  constexpr int V = Vec16<T>::n;
  __shared__ A cs[kThreads];
  __shared__ const T* rp[kThreads];

  const int tid = threadIdx.x;
  const int64_t col0 = (int64_t)blockIdx.x * (kThreads * V);
  A acc[V];
#pragma unroll
  for (int e = 0; e < V; ++e) acc[e] = A(0);

  // VEC: this thread's columns are [jv, jv + V); scalar: col0 + e * kThreads + tid.
  const int64_t jv = col0 + (int64_t)tid * V;
  const bool full = VEC && jv + V <= d;

  for (int64_t i0 = 0; i0 < n; i0 += kThreads) {
    const int nb = (int)(n - i0 < kThreads ? n - i0 : kThreads);
    __syncthreads();
    if (tid < nb) {
      const int64_t r = rows ? rows[i0 + tid] : i0 + tid;
      const bool ok = r >= 0 && r < K;
      assert(ok && "weighted_sum: rows entry out of range");
      cs[tid] = ok ? static_cast<A>(alpha * coef[i0 + tid]) : A(0);
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
          acc[e] = fma(c0, x0[e], acc[e]);
          acc[e] = fma(c1, x1[e], acc[e]);
          acc[e] = fma(c2, x2[e], acc[e]);
          acc[e] = fma(c3, x3[e], acc[e]);
        }
      }
      for (; i < nb; ++i) {
        A x0[V];
        load16<T, A>(rp[i] + jv, x0);
        const A c0 = cs[i];
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] = fma(c0, x0[e], acc[e]);
      }
    } else if (VEC) {  // tail of the last block: fewer than V columns left for this thread
      for (int i = 0; i < nb; ++i) {
        const A c0 = cs[i];
#pragma unroll
        for (int e = 0; e < V; ++e)
          if (jv + e < d) acc[e] = fma(c0, static_cast<A>(to_float(rp[i][jv + e])), acc[e]);
      }
    } else {
      for (int i = 0; i < nb; ++i) {
        const A c0 = cs[i];
        const T* p = rp[i];
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const int64_t j = col0 + (int64_t)e * kThreads + tid;
          if (j < d) acc[e] = fma(c0, static_cast<A>(to_float(__ldg(p + j))), acc[e]);
        }
      }
    }
  }

  if (full) {
    if (base) {
      A b[V];
      load16_rw<T, A>(base + jv, b);
#pragma unroll
      for (int e = 0; e < V; ++e) acc[e] = b[e] + acc[e];
    }
    store16<T, A>(out + jv, acc);
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const int64_t j = VEC ? jv + e : col0 + (int64_t)e * kThreads + tid;
      if (j < d) {
        A v = acc[e];
        if (base) v = static_cast<A>(to_float(base[j])) + v;
        out[j] = from_acc<T>(v);
      }
    }
  }
}

}  // namespace

cudaError_t weighted_sum(const void* U, DType dt, int64_t K, int64_t d, int64_t ld, const double* coef,
                         const int64_t* rows, int64_t n, const void* base, double alpha, void* out,
                         cudaStream_t stream) {
  if (d <= 0) return cudaSuccess;
  return dispatch(dt, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int V = Vec16<T>::n;
    const T* u = static_cast<const T*>(U);
    const T* b = static_cast<const T*>(base);
    T* o = static_cast<T*>(out);
    const bool vec = aligned16(u) && ((ld * (int64_t)sizeof(T)) % 16 == 0 || K <= 1) && aligned16(o) &&
                     (b == nullptr || aligned16(b));
    const int64_t blocks = (d + (int64_t)kThreads * V - 1) / ((int64_t)kThreads * V);
    if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
    if (vec)
      wsum_kernel<T, true><<<(unsigned)blocks, kThreads, 0, stream>>>(u, K, d, ld, coef, rows, n, b, alpha, o);
    else
      wsum_kernel<T, false><<<(unsigned)blocks, kThreads, 0, stream>>>(u, K, d, ld, coef, rows, n, b, alpha, o);
    return cudaGetLastError();
  });
}

}  // namespace cuda
}  // namespace fedkernels
