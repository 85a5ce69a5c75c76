// select: per-column order_mean (median, trimmed mean) and closest_mean (Bulyan) on the GPU; the maths
// is csrc/cpu/select.cpp's, the per-column logic select.cuh's (sel::, tested on the host).
//
// One thread per column (grid-stride), reading the column's k selected values of U (coalesced across
// the warp's adjacent columns) through the rank logic of sel::: O(k^2) loads per column, served from L1/L2
// after the first; no per-thread array, no shared memory, no atomics. The row flags: a thread that reads
// a NaN/Inf in row i stores ok[i] = false (every such store writes the same value: the flags do not depend
// on the schedule). The output is rounded once from float64 (to float for fp16/bf16/fp32 U). Sums in row
// order (the CPU kernel adds in ascending order: the bits may differ by the order of the float64 adds; the
// median of odd k, a single value, is the same). An out-of-range entry of a device `rows` reads NaN.
// What only a GPU run checks: the launch, the coalescing, the speed (not measured; O(k^2) per column).
// Compile-checked only (nvcc, sm_90); tests/test_select.py's cuda cases check it on a GPU.
#include "common.cuh"
#include "select.cuh"

#include <cmath>

namespace fedkernels {
namespace cuda {
namespace {

using namespace detail;

template <typename T, bool closest, typename O>
__global__ void __launch_bounds__(sel::kThreads)
    select_kernel(const T* __restrict__ U, int64_t K, int64_t d, int64_t ld, const int64_t* __restrict__ rows, int64_t k,
                  int64_t lo, int64_t hi, O* __restrict__ out, bool* __restrict__ ok) {
  for (int64_t j = blockIdx.x * (int64_t)sel::kThreads + threadIdx.x; j < d; j += (int64_t)gridDim.x * sel::kThreads) {
    auto x = [&](int64_t i) -> double {
      const int64_t r = rows ? rows[i] : i;
      return (r >= 0 && r < K) ? to_double(U[r * ld + j]) : NAN;
    };
    for (int64_t i = 0; i < k; ++i) {
      const double v = x(i);
      if (v - v != 0.0) ok[i] = false;
    }
    const double m = closest ? sel::closest_mean_col(x, k, lo) : sel::order_mean_col(x, k, lo, hi);
    out[j] = static_cast<O>(m);
  }
}

template <bool closest>
cudaError_t launch(const void* U, DType dt, int64_t K, int64_t d, int64_t ld, const int64_t* rows, int64_t k,
                   int64_t lo, int64_t hi, void* out, bool* ok, cudaStream_t stream) {
  if (k <= 0 || d <= 0) return cudaSuccess;
  const unsigned blocks = (unsigned)sel::num_blocks(d);
  return dispatch(dt, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (sizeof(T) == 8)
      select_kernel<T, closest, double><<<blocks, sel::kThreads, 0, stream>>>(
          static_cast<const T*>(U), K, d, ld, rows, k, lo, hi, static_cast<double*>(out), ok);
    else
      select_kernel<T, closest, float><<<blocks, sel::kThreads, 0, stream>>>(
          static_cast<const T*>(U), K, d, ld, rows, k, lo, hi, static_cast<float*>(out), ok);
    return cudaGetLastError();
  });
}

}  // namespace

cudaError_t order_mean(const void* U, DType dt, int64_t K, int64_t d, int64_t ld, const int64_t* rows, int64_t k,
                       int64_t lo, int64_t hi, void* out, bool* ok, cudaStream_t stream) {
  return launch<false>(U, dt, K, d, ld, rows, k, lo, hi, out, ok, stream);
}

cudaError_t closest_mean(const void* U, DType dt, int64_t K, int64_t d, int64_t ld, const int64_t* rows, int64_t k,
                         int64_t beta, void* out, bool* ok, cudaStream_t stream) {
  return launch<true>(U, dt, K, d, ld, rows, k, beta, 0, out, ok, stream);
}

}  // namespace cuda
}  // namespace fedkernels
