// Per-thread logic of the dequant_weighted_sum CUDA kernel (dequant_weighted_sum.cu), then its launcher.
//
// One column per thread (coalesced 1-byte code loads across a warp), the rows in the order given, one fma
// per code with the weight alpha coef_i scale rounded once to the accumulation type: the CPU op's arithmetic
// (csrc/cpu/dequant_weighted_sum.cpp). Host-checkable here: the e4m3 conversion (every code), the column of a
// thread, the weight rule. Only a GPU run checks: the launch, the pre-pass's flag, the screen's rescan.
#pragma once

#include <cstdint>
#include <cstring>

#include "hd.h"

namespace fedkernels {
namespace cuda {
namespace dq {

constexpr int kThreads = 256;

FK_HD int64_t num_blocks(int64_t d) { return (d + kThreads - 1) / kThreads; }
FK_HD int64_t col(int64_t b, int tid) { return b * (int64_t)kThreads + tid; }

// float8 e4m3fn code -> float, exact (the CPU op's conversion: exponent rebiased, subnormals as 2^-6 (1 + m/8) - 2^-6).
FK_HD float e4m3(uint8_t b) {
  const uint32_t mag = b & 0x7Fu;
  const bool sub = (mag >> 3) == 0;
  float f = bits_float((mag << 20) + (sub ? (121u << 23) : (120u << 23))) - (sub ? 0.015625f : 0.0f);
  f = (b & 0x80u) ? -f : f;
  return mag == 0x7Fu ? __builtin_nanf("") : f;
}
FK_HD bool e4m3_nan(uint8_t b) { return (b & 0x7Fu) == 0x7Fu; }

// A finite weight that does not fit in float32 makes the whole sum accumulate in float64 (the CPU rule).
FK_HD bool overflows_float(double w) {
  const double a = w < 0 ? -w : w;
  return a > 3.0e38 && a <= 1.7976931348623157e308;
}

}  // namespace dq
}  // namespace cuda
}  // namespace fedkernels

#ifndef FEDKERNELS_HD_ONLY
#include "launch.h"

namespace fedkernels {
namespace cuda {

// out = base + sum_i ac[i] * scales[r_i, j / block] * Q[r_i, j] (ac = alpha coef, device float64 [n]; rows:
// device int64 [n] or nullptr for 0..K-1); code: 0 = int8, 1 = float8 e4m3fn; out (and base, or nullptr) float32
// (out_f64 = false) or float64; ok: [n] bool set to true by the caller, false written for each row with a
// non-finite scale or a NaN code. workspace: one int (the pre-pass's float64 flag).
cudaError_t dequant_weighted_sum(const void* Q, int code, int64_t K, int64_t d, int64_t ldq, const float* scales,
                                 int64_t lds, int64_t block, const double* ac, const int64_t* rows, int64_t n,
                                 const void* base, void* out, bool out_f64, bool* ok, int* workspace,
                                 cudaStream_t stream);

}  // namespace cuda
}  // namespace fedkernels
#endif  // FEDKERNELS_HD_ONLY
