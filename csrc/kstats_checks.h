// Argument rules of kstats, written once for its CPU kernel (csrc/cpu/kstats.cpp) and its CUDA glue
// (csrc/cuda/kstats_glue.cpp): cheap last-line checks (the Python wrapper validates first).
#pragma once

#include "checks.h"

namespace fedkernels {
namespace checks {

// U: [K, d] with unit column stride on `dev`; p: 1-D float of length K (one weight per row).
inline void kstats_args(const at::Tensor& U, const at::Tensor& p, c10::Device dev) {
  check_rowmajor(U, "kstats", "U");
  on_device(U, dev, "kstats", "U");
  TORCH_CHECK(is_float4(U.scalar_type()), "kstats: U must be float16, bfloat16, float32 or float64, got ",
              U.scalar_type());
  TORCH_CHECK(p.dim() == 1 && p.numel() == U.size(0), "kstats: p must be 1-D of length K=", U.size(0),
              " (one weight per row), got shape ", p.sizes());
  TORCH_CHECK(p.is_floating_point(), "kstats: p must be a float tensor, got ", p.scalar_type());
}

}  // namespace checks
}  // namespace fedkernels
