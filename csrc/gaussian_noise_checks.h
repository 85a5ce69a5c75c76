// Argument rules of add_gaussian_noise_ and weighted_sum_noised, written once for their CPU kernels
// (csrc/cpu/gaussian_noise.cpp) and their CUDA glue (csrc/cuda/gaussian_noise_glue.cpp): cheap
// last-line checks (the Python wrappers validate first).
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
  TORCH_CHECK(x.is_contiguous(), "add_gaussian_noise_: x must be contiguous");
  TORCH_CHECK(is_float4(x.scalar_type()), "add_gaussian_noise_: x must be float16, bfloat16, float32 or float64, got ",
              x.scalar_type());
  on_device(x, dev, "add_gaussian_noise_", "x");
  noise_args(sigma, seed, counter, offset, "add_gaussian_noise_");
}

}  // namespace checks
}  // namespace fedkernels
