// dequant_weighted_sum: out = base + alpha * sum_i coef[i] * scales[rows[i], j / block] * Q[rows[i], j] (int8 or
// float8 e4m3fn codes), one pass over the codes, and the rows' flags (non-finite scale, NaN code) from it.
//
// A pre-pass over the selected rows' scales sets one int when some finite alpha coef_i scale exceeds float32's
// range (the CPU op's rule: then the sum accumulates in float64); the main kernel reads it (no host sync).
// Main kernel: one column per thread, rows in the order given, acc = fma(w, x, acc) with w = alpha coef_i scale
// rounded once: each output element is the CPU op's fma chain (the same bits when both use the same
// accumulation type). A thread whose accumulator is not finite rescans its column's rows and writes false
// into ok for a row with a non-finite scale or a NaN code (every writer writes false: a benign race).
// Bytes moved: n d code bytes, n ceil(d / block) scales (twice: pre-pass and pass, mostly from L2), d of base and
// of out. Only a GPU run checks (tests/test_dequant_weighted_sum.py's cuda cases): the launch and the rescan.
#include "common.cuh"
#include "dequant_weighted_sum.cuh"

namespace fedkernels {
namespace cuda {
namespace {

using namespace detail;
using dq::kThreads;

__global__ void dq_wide_kernel(const float* __restrict__ S, int64_t lds, int64_t nb, const double* __restrict__ ac,
                               const int64_t* __restrict__ rows, int64_t n, int* wide) {
  const int64_t total = n * nb;
  bool over = false;
  for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < total; e += (int64_t)gridDim.x * blockDim.x) {
    const int64_t i = e / nb, b = e % nb, r = rows ? rows[i] : i;
    over |= dq::overflows_float(ac[i] * (double)S[r * lds + b]);
  }
  if (over) atomicOr(wide, 1);
}

template <int CODE> __device__ __forceinline__ float code_value(const void* q, int64_t off) {
  if (CODE == 0) return (float)static_cast<const int8_t*>(q)[off];
  return dq::e4m3(static_cast<const uint8_t*>(q)[off]);
}

template <int CODE, typename O, typename A>
__device__ __forceinline__ void dq_body(const void* Q, int64_t d, int64_t ldq, const float* S, int64_t lds,
                                        int64_t block, const double* ac, const int64_t* rows, int64_t n, const O* base,
                                        O* out, bool* ok) {
  const int64_t j = dq::col(blockIdx.x, threadIdx.x);
  if (j >= d) return;
  const int64_t b = j / block;
  A acc = A(0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = rows ? __ldg(rows + i) : i;
    const A w = static_cast<A>(__ldg(ac + i) * (double)__ldg(S + r * lds + b));
    acc = fma(w, static_cast<A>(code_value<CODE>(Q, r * ldq + j)), acc);
  }
  if (!(acc * A(0) == A(0))) {     // rare: a bad row, or an overflow of finite values
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = rows ? rows[i] : i;
      const float s = S[r * lds + b];
      const bool bad = !(s * 0.0f == 0.0f) || (CODE == 1 && dq::e4m3_nan(static_cast<const uint8_t*>(Q)[r * ldq + j]));
      if (bad) ok[i] = false;
    }
  }
  out[j] = static_cast<O>(base ? static_cast<A>(base[j]) + acc : acc);
}

template <int CODE, typename O>
__global__ void __launch_bounds__(kThreads)
    dq_kernel(const void* Q, int64_t d, int64_t ldq, const float* S, int64_t lds, int64_t block, const double* ac,
              const int64_t* rows, int64_t n, const O* base, O* out, bool* ok, const int* wide) {
  if (sizeof(O) == sizeof(double) || *wide)
    dq_body<CODE, O, double>(Q, d, ldq, S, lds, block, ac, rows, n, base, out, ok);
  else
    dq_body<CODE, O, float>(Q, d, ldq, S, lds, block, ac, rows, n, base, out, ok);
}

template <int CODE, typename O>
cudaError_t launch(const void* Q, int64_t d, int64_t ldq, const float* S, int64_t lds, int64_t block, const double* ac,
                   const int64_t* rows, int64_t n, const void* base, void* out, bool* ok, const int* wide,
                   cudaStream_t stream) {
  const int64_t blocks = dq::num_blocks(d);
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  dq_kernel<CODE, O><<<(unsigned)blocks, kThreads, 0, stream>>>(Q, d, ldq, S, lds, block, ac, rows, n,
                                                                 static_cast<const O*>(base), static_cast<O*>(out), ok,
                                                                 wide);
  return cudaGetLastError();
}

}  // namespace

cudaError_t dequant_weighted_sum(const void* Q, int code, int64_t K, int64_t d, int64_t ldq, const float* scales,
                                 int64_t lds, int64_t block, const double* ac, const int64_t* rows, int64_t n,
                                 const void* base, void* out, bool out_f64, bool* ok, int* workspace,
                                 cudaStream_t stream) {
  (void)K;
  if (d <= 0) return cudaSuccess;
  cudaError_t e = cudaMemsetAsync(workspace, 0, sizeof(int), stream);
  if (e != cudaSuccess) return e;
  const int64_t nb = (d + block - 1) / block;
  if (!out_f64 && n > 0) {
    const int64_t total = n * nb, grid = (total + kThreads - 1) / kThreads;
    dq_wide_kernel<<<(unsigned)(grid < 1024 ? (grid > 0 ? grid : 1) : 1024), kThreads, 0, stream>>>(
        scales, lds, nb, ac, rows, n, workspace);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
  }
  if (code == 0)
    return out_f64 ? launch<0, double>(Q, d, ldq, scales, lds, block, ac, rows, n, base, out, ok, workspace, stream)
                   : launch<0, float>(Q, d, ldq, scales, lds, block, ac, rows, n, base, out, ok, workspace, stream);
  if (code == 1)
    return out_f64 ? launch<1, double>(Q, d, ldq, scales, lds, block, ac, rows, n, base, out, ok, workspace, stream)
                   : launch<1, float>(Q, d, ldq, scales, lds, block, ac, rows, n, base, out, ok, workspace, stream);
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace fedkernels
