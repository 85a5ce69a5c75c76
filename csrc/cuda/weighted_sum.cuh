// Per-thread logic of the weighted_sum CUDA kernel (weighted_sum.cu), shared with the host tests.
//
// Host-tested (tests/cuda_host/, against fedkernels.reference): the accumulation-type choice
// (wsum_fits_float, the CPU op's rule), the vector/scalar path choice (wsum_vec_ok), the column
// ownership of every thread (wsum_col: every column exactly once, tails when d is not a multiple
// of the vector width), the treatment of an out-of-range row (a NaN contribution, never a read
// outside U), the summation order (rows in index order, one fma per row and element) and the
// finiteness test of the screen (wsum::finite).
// Only a GPU run checks: the shared-memory staging of coefficients and row pointers between the
// barriers, the 16-byte vector loads/stores, the launch configuration and the screen's block-wide
// vote (__syncthreads_or) and rescan.
#pragma once

#include <cmath>
#include <cstdint>

#include "hd.h"

namespace fedkernels {
namespace cuda {
namespace wsum {

constexpr int kThreads = 256;

// The CPU op (csrc/cpu/weighted_sum.cpp) accumulates fp16/bf16/fp32 data in float unless some
// |alpha * coef[i]| does not fit in float (> 3e38, or NaN): then the whole sum runs in double.
FK_HD bool fits_float(double alpha, double c) {
  const double v = alpha * c;
  return (v < 0 ? -v : v) <= 3.0e38;  // false for NaN
}

// Vector path: U's base, every row start (row stride in bytes a multiple of 16, or one row),
// base and out 16-byte aligned. Addresses as integers so the host tests can pass any value.
FK_HD bool vec_ok(uintptr_t u, int64_t ld_bytes, int64_t K, uintptr_t out, uintptr_t base /* 0: none */) {
  const bool rows = (ld_bytes % 16) == 0 || K <= 1;
  return (u % 16) == 0 && rows && (out % 16) == 0 && (base % 16) == 0;
}

// Columns per block: kThreads threads x V elements.
FK_HD int64_t num_blocks(int64_t d, int V) { return (d + (int64_t)kThreads * V - 1) / ((int64_t)kThreads * V); }

// Column of element e (0 <= e < V) of thread tid in block b: contiguous V-groups on the vector path
// (thread tid owns [b*kThreads*V + tid*V, +V)), strided on the scalar path (coalesced single loads).
FK_HD int64_t col(int64_t b, int tid, int e, int V, bool vec) {
  const int64_t col0 = b * (int64_t)kThreads * V;
  return vec ? col0 + (int64_t)tid * V + e : col0 + (int64_t)e * kThreads + tid;
}

// Row index check: an entry outside [0, K) contributes NaN (the Python wrapper and the glue
// validate host rows; device-resident rows cannot be checked without a host sync).
FK_HD bool row_ok(int64_t r, int64_t K) { return r >= 0 && r < K; }

// The screen of weighted_sum_screened: x * 0 is 0 for finite x, NaN for NaN/Inf. A chunk of
// columns whose accumulators are all finite has only finite values in every selected row (c * Inf,
// c * NaN and 0 * Inf are never finite, and nothing brings a sum back from NaN/Inf); a block with a
// non-finite accumulator (a bad row, or an overflow of finite values) rescans its rows one by one.
template <typename A> FK_HD bool finite(A x) { return x * A(0) == A(0); }

// One row's contribution to one accumulator, in the kernel's order.
template <typename A> FK_HD A accumulate(A acc, A c, A x) {
#if defined(__CUDA_ARCH__)
  return fma(c, x, acc);
#else
  return std::fma(c, x, acc);
#endif
}

}  // namespace wsum
}  // namespace cuda
}  // namespace fedkernels

// ---- launchers (csrc/cuda/weighted_sum.cu), called by the torch glue csrc/cuda/weighted_sum_glue.cpp. They
// need the CUDA runtime headers: the host tests (tests/cuda_host, no CUDA) define FEDKERNELS_HD_ONLY.
#ifndef FEDKERNELS_HD_ONLY
#include "launch.h"

namespace fedkernels {
namespace cuda {

// ---- weighted_sum: out = base + alpha * sum_i coef[i] * U[rows[i]] -----------------------------
// coef: device float64 [n]; rows: device int64 [n] or nullptr (n == K, rows 0..K-1); base: [d] or
// nullptr; out: [d] of dtype out_dt (dt, or Float32/Float64 for a Float16/BFloat16 U; any other pair:
// cudaErrorInvalidValue), may alias base; base has out_dt. Accumulation: out_dt's (fp32 for
// fp16/bf16/fp32, fp64 for fp64), fp64 for every dtype when some |alpha * coef[i]| > 3e38 (the CPU
// op's rule). wide: 1 / 0 when the
// caller knows (host coefficients), -1 to let every block decide from coef. Each output element
// sums the rows in index order. ok: nullptr, or [n] bool set to true by the caller, where the
// kernel writes false for each selected row holding a NaN/Inf (weighted_sum_screened).
// sigma > 0 (weighted_sum_noised): out[j] also gets sigma * N(seed, counter, offset + j) (gaussian_noise.cuh) in
// its write, with gnoise::add_noise's rounding in the accumulation type; sigma = 0: no noise, weighted_sum.
cudaError_t weighted_sum(const void* U, DType dt, int64_t K, int64_t d, int64_t ld, const double* coef,
                         const int64_t* rows, int64_t n, const void* base, double alpha, int wide, void* out,
                         DType out_dt, bool* ok, cudaStream_t stream, double sigma = 0.0, uint64_t seed = 0,
                         uint64_t counter = 0, uint64_t offset = 0);

}  // namespace cuda
}  // namespace fedkernels
#endif  // FEDKERNELS_HD_ONLY
