// Argument rules of weighted_sum, written once for its CPU kernel (csrc/cpu/weighted_sum.cpp) and its
// CUDA glue (csrc/cuda/weighted_sum_glue.cpp): cheap last-line checks (the Python wrapper validates first).
#pragma once

#include "checks.h"

namespace fedkernels {
namespace checks {

// coef: 1-D float of length n (one per selected row); out (and base): contiguous 1-D of length d, U's dtype.
inline void weighted_sum_args(const at::Tensor& U, const at::Tensor& coef, int64_t n,
                              const c10::optional<at::Tensor>& base, const at::Tensor& out, c10::Device dev) {
  check_rowmajor(U, "weighted_sum", "U");
  on_device(U, dev, "weighted_sum", "U");
  const int64_t d = U.size(1);
  TORCH_CHECK(coef.dim() == 1 && coef.numel() == n, "weighted_sum: coef must be 1-D of length ", n,
              " (one per selected row), got shape ", coef.sizes());
  TORCH_CHECK(coef.is_floating_point(), "weighted_sum: coef must be a float tensor, got ", coef.scalar_type());
  TORCH_CHECK(out.dim() == 1 && out.size(0) == d && out.is_contiguous() && out.scalar_type() == U.scalar_type(),
              "weighted_sum: out must be a contiguous 1-D tensor of length ", d, " and dtype ", U.scalar_type());
  on_device(out, dev, "weighted_sum", "out");
  if (base.has_value()) {
    TORCH_CHECK(base->dim() == 1 && base->size(0) == d && base->is_contiguous() && base->scalar_type() == U.scalar_type(),
                "weighted_sum: base must be a contiguous 1-D tensor of length ", d, " and dtype ", U.scalar_type());
    on_device(*base, dev, "weighted_sum", "base");
  }
}

// The output of the functional weighted_sum (its _out variant fills it): [d] of U's dtype and device.
inline at::Tensor weighted_sum_output(const at::Tensor& U) {
  TORCH_CHECK(U.dim() == 2, "weighted_sum: U must be 2-D [K, d], got ", U.dim(), "-D");
  return at::empty({U.size(1)}, U.options());
}

}  // namespace checks
}  // namespace fedkernels
