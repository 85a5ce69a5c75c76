// sparse_weighted_sum: out = base + sum_i alpha coef_i scatter(list rows_i) over CSR-like index/value lists,
// deterministic without atomics (sparse_weighted_sum.cuh: tiles, runs of equal indices), and each list's
// NaN/Inf flag from the same pass. An entry outside [0, d) or a list out of order is never read or written
// outside the buffers (entries are used only inside the tile being built); the Python wrapper refuses both.
// Bytes moved: the selected lists' entries once (plus a binary search per tile and list), d of base and out.
// Only a GPU run checks (tests/test_sparse_weighted_sum.py's cuda cases): barriers, shared memory, launch.
#include "common.cuh"
#include "sparse_weighted_sum.cuh"

namespace fedkernels {
namespace cuda {
namespace {

using namespace detail;
using sp::kThreads;
using sp::kTile;

template <typename I, typename T, typename O, typename A>
__global__ void __launch_bounds__(kThreads)
    sp_kernel(const I* __restrict__ idx, const T* __restrict__ val, const int64_t* __restrict__ lo,
              const int64_t* __restrict__ hi, const double* __restrict__ w, int64_t n, int64_t d, const O* base, O* out,
              bool* ok) {
  __shared__ A acc[kTile];
  const int64_t j0 = blockIdx.x * kTile, j1 = j0 + kTile < d ? j0 + kTile : d;
  for (int64_t j = threadIdx.x; j < kTile; j += kThreads) acc[j] = A(0);
  __syncthreads();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t a = lo[i], b = hi[i];
    const int64_t p0 = sp::lower_bound(idx, a, b, j0), p1 = sp::lower_bound(idx, p0, b, j1);
    const A wi = static_cast<A>(w[i]);
    A z = A(0);
    for (int64_t p = p0 + threadIdx.x; p < p1; p += kThreads) {
      if (!sp::run_start(idx, p0, p)) continue;
      const int64_t j = (int64_t)idx[p];
      if (j < j0 || j >= j1) continue;            // only where the list breaks its order
      A s = acc[j - j0];
      for (int64_t q = p; q < p1 && idx[q] == idx[p]; ++q) {
        const A v = static_cast<A>(to_float(val[q]));
        s = fma(wi, v, s);
        z += v * A(0);
      }
      acc[j - j0] = s;
    }
    if (!(z == A(0))) ok[i] = false;             // every writer writes false: a benign race
    __syncthreads();
  }
  for (int64_t j = j0 + threadIdx.x; j < j1; j += kThreads) {
    const A v = acc[j - j0];
    out[j] = static_cast<O>(base ? static_cast<A>(base[j]) + v : v);
  }
}

template <typename I, typename T, typename O, typename A>
cudaError_t launch(const void* idx, const void* val, const int64_t* lo, const int64_t* hi, const double* w, int64_t n,
                   int64_t d, const void* base, void* out, bool* ok, cudaStream_t stream) {
  const int64_t tiles = sp::num_tiles(d);
  if (tiles > 0x7fffffff) return cudaErrorInvalidConfiguration;
  sp_kernel<I, T, O, A><<<(unsigned)tiles, kThreads, 0, stream>>>(
      static_cast<const I*>(idx), static_cast<const T*>(val), lo, hi, w, n, d, static_cast<const O*>(base),
      static_cast<O*>(out), ok);
  return cudaGetLastError();
}

}  // namespace

cudaError_t sparse_weighted_sum(const void* idx, bool idx64, const void* val, DType dt, const int64_t* lo,
                                const int64_t* hi, const double* w, int64_t n, int64_t d, const void* base, void* out,
                                bool out_f64, bool wide, bool* ok, cudaStream_t stream) {
  if (d <= 0) return cudaSuccess;
  return dispatch(dt, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const auto by_idx = [&](auto o_tag, auto a_tag) {
      using O = typename decltype(o_tag)::type;
      using A = typename decltype(a_tag)::type;
      return idx64 ? launch<int64_t, T, O, A>(idx, val, lo, hi, w, n, d, base, out, ok, stream)
                   : launch<int32_t, T, O, A>(idx, val, lo, hi, w, n, d, base, out, ok, stream);
    };
    if (out_f64) return by_idx(TypeTag<double>{}, TypeTag<double>{});
    if (wide) return by_idx(TypeTag<float>{}, TypeTag<double>{});
    return by_idx(TypeTag<float>{}, TypeTag<float>{});
  });
}

}  // namespace cuda
}  // namespace fedkernels
