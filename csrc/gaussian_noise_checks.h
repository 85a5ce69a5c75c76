// Argument rules of add_gaussian_noise_, weighted_sum_noised (whose tensors follow weighted_sum's rules,
// csrc/weighted_sum_checks.h) and the generator's test hooks, written once for their CPU kernels
// (csrc/cpu/gaussian_noise.cpp) and their CUDA glue (csrc/cuda/gaussian_noise_glue.cpp, weighted_sum_glue.cpp).
// Tensors: one-line ValueErrors in the Python wrapper's words (fedkernels/ops/gaussian_noise.py checks the
// scalars first; noise_args is the last line for a direct call).
#pragma once

#include <cmath>

#include "checks.h"

namespace fedkernels {
namespace checks {

// sigma: finite and >= 0; seed, counter, offset: non-negative 64-bit integers (read as uint64).
inline void noise_args(double sigma, int64_t seed, int64_t counter, int64_t offset, const char* op) {
  TORCH_CHECK(std::isfinite(sigma) && sigma >= 0, op, ": sigma must be finite and >= 0, got ", sigma);
  TORCH_CHECK(seed >= 0, op, ": seed must be >= 0, got ", seed);
  TORCH_CHECK(counter >= 0, op, ": counter must be >= 0, got ", counter);
  TORCH_CHECK(offset >= 0, op, ": offset must be >= 0, got ", offset);
}

// x: contiguous float16/bfloat16/float32/float64 on `dev` (noised in place, flat index = column).
inline void add_gaussian_noise_args(const at::Tensor& x, double sigma, int64_t seed, int64_t counter, int64_t offset,
                                    c10::Device dev) {
  const char* op = "add_gaussian_noise_";
  float_dtype(x, op, "x");
  TORCH_CHECK_VALUE(x.is_contiguous(), op, ": x must be contiguous (it is written in place)");
  on_device(x, dev, op, "x", "x");
  noise_args(sigma, seed, counter, offset, op);
}

// philox4x32_10's counters: an int64 [n, 4] tensor (each entry a uint32 word).
inline void philox_counters(const at::Tensor& ctr) {
  TORCH_CHECK_VALUE(ctr.dim() == 2 && ctr.size(1) == 4 && ctr.scalar_type() == at::kLong,
                    "philox4x32_10: ctr must be an int64 tensor of shape (n, 4), got shape ", py_shape(ctr.sizes()),
                    " and dtype ", py_dtype(ctr.scalar_type()));
}

}  // namespace checks
}  // namespace fedkernels
