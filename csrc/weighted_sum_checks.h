// Argument rules of weighted_sum, written once for its CPU kernel (csrc/cpu/weighted_sum.cpp) and its
// CUDA glue (csrc/cuda/weighted_sum_glue.cpp): cheap last-line checks (the Python wrapper validates first).
#pragma once

#include "checks.h"

namespace fedkernels {
namespace checks {

// The dtypes out (and base) may have for U of dtype u: u itself, and for fp16/bf16 U also fp32 and
// fp64 (a half-precision update summed into a wider model; accumulated in out's dtype).
inline bool weighted_sum_out_dtype_ok(at::ScalarType u, at::ScalarType o) {
  if (o == u) return true;
  return (u == at::kHalf || u == at::kBFloat16) && (o == at::kFloat || o == at::kDouble);
}

// coef: 1-D float of length n (one per selected row); out (and base): contiguous 1-D of length d, of
// U's dtype or (fp16/bf16 U) fp32/fp64; base has out's dtype.
inline void weighted_sum_args(const at::Tensor& U, const at::Tensor& coef, int64_t n,
                              const c10::optional<at::Tensor>& base, const at::Tensor& out, c10::Device dev) {
  check_rowmajor(U, "weighted_sum", "U");
  on_device(U, dev, "weighted_sum", "U");
  const int64_t d = U.size(1);
  TORCH_CHECK(coef.dim() == 1 && coef.numel() == n, "weighted_sum: coef must be 1-D of length ", n,
              " (one per selected row), got shape ", coef.sizes());
  TORCH_CHECK(coef.is_floating_point(), "weighted_sum: coef must be a float tensor, got ", coef.scalar_type());
  TORCH_CHECK(out.dim() == 1 && out.size(0) == d && out.is_contiguous(),
              "weighted_sum: out must be a contiguous 1-D tensor of length ", d, ", got shape ", out.sizes());
  TORCH_CHECK(weighted_sum_out_dtype_ok(U.scalar_type(), out.scalar_type()), "weighted_sum: out must have dtype ",
              U.scalar_type(), " (U's) or, for a Half/BFloat16 U, Float or Double; got ", out.scalar_type());
  on_device(out, dev, "weighted_sum", "out");
  if (base.has_value()) {
    TORCH_CHECK(base->dim() == 1 && base->size(0) == d && base->is_contiguous() && base->scalar_type() == out.scalar_type(),
                "weighted_sum: base must be a contiguous 1-D tensor of length ", d, " and dtype ", out.scalar_type(),
                " (out's)");
    on_device(*base, dev, "weighted_sum", "base");
  }
}

// The output of the functional weighted_sum (its _out variant fills it): [d] on U's device, of base's
// dtype when base is given (U's, or a wider one for fp16/bf16 U: checked by weighted_sum_args), else U's.
inline at::Tensor weighted_sum_output(const at::Tensor& U, const c10::optional<at::Tensor>& base) {
  TORCH_CHECK(U.dim() == 2, "weighted_sum: U must be 2-D [K, d], got ", U.dim(), "-D");
  TORCH_CHECK(!base.has_value() || weighted_sum_out_dtype_ok(U.scalar_type(), base->scalar_type()),
              "weighted_sum: base must have dtype ", U.scalar_type(),
              " (U's) or, for a Half/BFloat16 U, Float or Double; got ", base->scalar_type());
  return at::empty({U.size(1)}, U.options().dtype(base.has_value() ? base->scalar_type() : U.scalar_type()));
}

}  // namespace checks
}  // namespace fedkernels
