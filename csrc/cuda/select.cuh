// select: the per-column logic of csrc/cuda/select.cu (order_mean, closest_mean), shared with the host
// tests (tests/cuda_host), then the launchers' prototypes.
//
// One thread per column reads the column's k selected values through `x(i)` (i = 0..k-1, as float64)
// and never stores them: a value's place in the sorted order is its stable rank (the values below it,
// plus the equal ones in earlier rows), so the order statistics need O(k^2) comparisons and no per-thread
// array (fine for the k of federated rounds, tens of clients; GPU speed not measured).
#pragma once

#include <cmath>
#include <cstdint>

#include "hd.h"

namespace fedkernels {
namespace cuda {
namespace sel {

constexpr int kThreads = 256;

// The position of x(i) in the stable ascending order of x(0..k-1).
template <typename Get> FK_HD int64_t stable_rank(const Get& x, int64_t k, int64_t i) {
  const double v = x(i);
  int64_t r = 0;
  for (int64_t j = 0; j < k; ++j) {
    const double w = x(j);
    r += (w < v) || (w == v && j < i);
  }
  return r;
}

// The value at sorted position p (0 <= p < k; the values are not NaN).
template <typename Get> FK_HD double order_stat(const Get& x, int64_t k, int64_t p) {
  for (int64_t i = 0; i < k; ++i)
    if (stable_rank(x, k, i) == p) return x(i);
  return NAN;   // not reached for 0 <= p < k
}

// order_mean of one column: the sorted positions lo..hi-1, summed in float64 in row order, divided by
// hi - lo; NaN if a value is NaN (+-Inf are ordered values).
template <typename Get> FK_HD double order_mean_col(const Get& x, int64_t k, int64_t lo, int64_t hi) {
  for (int64_t i = 0; i < k; ++i)
    if (x(i) != x(i)) return NAN;
  double acc = 0.0;
  for (int64_t i = 0; i < k; ++i) {
    const int64_t r = stable_rank(x, k, i);
    if (r >= lo && r < hi) acc += x(i);
  }
  return acc / double(hi - lo);
}

// closest_mean of one column: the beta values closest to m = (x_a + x_{k//2}) / 2 (a = (k-1)//2, sorted
// positions; x_a / 2 + x_{k//2} / 2 where the sum overflows), distances |x - m| in float64, ties by the smaller value (then the earlier row: equal
// values, the same sum), summed in row order; NaN if a value is NaN or Inf.
template <typename Get> FK_HD double closest_mean_col(const Get& x, int64_t k, int64_t beta) {
  for (int64_t i = 0; i < k; ++i) {
    const double v = x(i);
    if (v - v != 0.0) return NAN;
  }
  const double xa = order_stat(x, k, (k - 1) / 2), xh = order_stat(x, k, k / 2), mm = (xa + xh) * 0.5;
  const double m = mm - mm == 0.0 ? mm : xa * 0.5 + xh * 0.5;   // not finite: the sum overflowed (near the fp64 max)
  double acc = 0.0;
  for (int64_t i = 0; i < k; ++i) {
    const double v = x(i), dv = std::fabs(v - m);
    int64_t r = 0;
    for (int64_t j = 0; j < k && r < beta; ++j) {
      const double w = x(j), dw = std::fabs(w - m);
      r += dw < dv || (dw == dv && (w < v || (w == v && j < i)));
    }
    if (r < beta) acc += v;
  }
  return acc / double(beta);
}

// The launch grid: one thread per column, blocks of kThreads, at most 65535 * 16 blocks (grid-stride).
FK_HD int64_t num_blocks(int64_t d) {
  const int64_t b = (d + kThreads - 1) / kThreads;
  return b < 65535 * 16 ? b : 65535 * 16;
}

}  // namespace sel
}  // namespace cuda
}  // namespace fedkernels

// ---- launchers (csrc/cuda/select.cu), called by the torch glue csrc/cuda/select_glue.cpp. They need the
// CUDA runtime headers: the host tests (tests/cuda_host, no CUDA) define FEDKERNELS_HD_ONLY.
#ifndef FEDKERNELS_HD_ONLY
#include "launch.h"

namespace fedkernels {
namespace cuda {

// out[j] = order_mean / closest_mean of column j over the rows rows[0..k) (nullptr: 0..K-1, k = K);
// out: float for fp16/bf16/fp32 U, double for fp64; ok[i] must hold true on entry and becomes false for
// a row with a NaN/Inf. rows: device int64 [k].
cudaError_t order_mean(const void* U, DType dt, int64_t K, int64_t d, int64_t ld, const int64_t* rows, int64_t k,
                       int64_t lo, int64_t hi, void* out, bool* ok, cudaStream_t stream);
cudaError_t closest_mean(const void* U, DType dt, int64_t K, int64_t d, int64_t ld, const int64_t* rows, int64_t k,
                         int64_t beta, void* out, bool* ok, cudaStream_t stream);

}  // namespace cuda
}  // namespace fedkernels
#endif  // FEDKERNELS_HD_ONLY
