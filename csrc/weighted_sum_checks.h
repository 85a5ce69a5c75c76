// Tensor rules of weighted_sum and weighted_sum_screened (and of weighted_sum_noised, which shares their
// arguments), written once for the CPU kernel (csrc/cpu/weighted_sum.cpp) and the CUDA glue
// (csrc/cuda/weighted_sum_glue.cpp): shapes, dtypes, devices and layouts, each a one-line ValueError
// in the Python wrapper's words (fedkernels/ops/weighted_sum.py checks types and values only).
#pragma once

#include "checks.h"

#include <string>

namespace fedkernels {
namespace checks {

// The dtypes out (and base) may have for U of dtype u: u itself, and for fp16/bf16 U also fp32 and
// fp64 (a half-precision update summed into a wider model; accumulated in out's dtype).
inline bool weighted_sum_out_dtype_ok(at::ScalarType u, at::ScalarType o) {
  if (o == u) return true;
  return (u == at::kHalf || u == at::kBFloat16) && (o == at::kFloat || o == at::kDouble);
}

// out / base: 1-D of length d on `dev`, of one of U's result dtypes (weighted_sum_out_dtype_ok), or with
// `out` given (base) exactly out's dtype.
inline void weighted_sum_result(const at::Tensor& v, const at::Tensor& U, c10::Device dev, const char* op,
                                const char* name, const at::Tensor* out) {
  const int64_t d = U.size(1);
  TORCH_CHECK_VALUE(v.dim() == 1 && v.size(0) == d, op, ": ", name, " must be a 1-D tensor of length ", d,
                    ", got shape ", py_shape(v.sizes()));
  on_device(v, dev, op, name);
  if (out != nullptr) {
    same_dtype(v, *out, op, name, "out");
    return;
  }
  const auto u = U.scalar_type();
  const bool half = u == at::kHalf || u == at::kBFloat16;
  TORCH_CHECK_VALUE(weighted_sum_out_dtype_ok(u, v.scalar_type()), op, ": ", name, " must have dtype ", py_dtype(u),
                    " (the dtype of U)", half ? " or a wider torch.float32 / torch.float64" : "", ", got ",
                    py_dtype(v.scalar_type()));
}

// U: [K, d] float matrix (unit column stride); rows: optional 1-D indices; coef: one float per selected row;
// out (nullptr for the functional forms): contiguous [d] of U's dtype or, for fp16/bf16 U, fp32/fp64;
// base: contiguous [d] of out's dtype (of U's result dtypes without out). Checked in the wrapper's order.
// Returns n, the number of selected rows.
inline int64_t weighted_sum_args(const at::Tensor& U, const at::Tensor& coef, const c10::optional<at::Tensor>& base,
                                  const c10::optional<at::Tensor>& rows, const at::Tensor* out, c10::Device dev,
                                  const char* op) {
  matrix(U, dev, op);
  index_rows(rows, dev, op);
  const int64_t n = rows.has_value() ? rows->numel() : U.size(0);
  coef_vector(coef, n, dev, op);
  if (out != nullptr) {
    weighted_sum_result(*out, U, dev, op, "out", nullptr);
    TORCH_CHECK_VALUE(out->is_contiguous(), op, ": out must be contiguous");
  }
  if (base.has_value()) {
    weighted_sum_result(*base, U, dev, op, "base", out);
    TORCH_CHECK_VALUE(base->is_contiguous(), op, ": base must be contiguous (the fedkernels.ops wrapper copies it once)");
  }
  return n;
}

// The output of the functional forms (their _out variants fill it), after weighted_sum_args: [d] on U's
// device, of base's dtype when base is given, else U's.
inline at::Tensor weighted_sum_output(const at::Tensor& U, const c10::optional<at::Tensor>& base) {
  return at::empty({U.size(1)}, U.options().dtype(base.has_value() ? base->scalar_type() : U.scalar_type()));
}

}  // namespace checks
}  // namespace fedkernels
