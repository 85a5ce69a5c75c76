// Tensor rules of weighted_sum and weighted_sum_screened (and of weighted_sum_noised, which shares their
// arguments), written once for the CPU kernel (csrc/cpu/weighted_sum.cpp) and the CUDA glue
// (csrc/cuda/weighted_sum_glue.cpp): shapes, dtypes, devices and layouts, each a one-line ValueError
// in the Python wrapper's words (fedkernels/ops/weighted_sum.py checks types and values only).
// The host-vector rules (rows, coef) serve dequant_weighted_sum and sparse_weighted_sum too.
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

// A small host vector (rows, coef) is on the host or on `dev` (the CUDA glue moves a host one there).
inline void host_or_on(const at::Tensor& t, c10::Device dev, const char* op, const char* name, const char* like_name) {
  TORCH_CHECK_VALUE(t.device().is_cpu() || t.device() == dev, op, ": ", name, " is on ", t.device(), " but ",
                    like_name, " is on ", dev);
}

// rows (optional): 1-D integer row indices (their range is checked where they are read: row_list,
// rows_to_device).
inline void index_rows(const c10::optional<at::Tensor>& rows, c10::Device dev, const char* op,
                       const char* like_name = "U") {
  if (!rows.has_value()) return;
  TORCH_CHECK_VALUE(rows->dim() == 1, op, ": rows must be a 1-D sequence of row indices, got shape ",
                    py_shape(rows->sizes()));
  const auto st = rows->scalar_type();
  TORCH_CHECK_VALUE(rows->numel() == 0 || !(at::isFloatingType(st) || at::isComplexType(st) || st == at::kBool), op,
                    ": rows must hold integer row indices, got dtype ", py_dtype(st));
  host_or_on(*rows, dev, op, "rows", like_name);
}

// coef: n float coefficients, one per selected row.
inline void coef_vector(const at::Tensor& coef, int64_t n, c10::Device dev, const char* op,
                        const char* like_name = "U") {
  TORCH_CHECK_VALUE(coef.dim() == 1 && coef.size(0) == n, op, ": coef must be a 1-D tensor of length ", n,
                    " (one per selected row), got shape ", py_shape(coef.sizes()));
  float_dtype(coef, op, "coef");
  host_or_on(coef, dev, op, "coef", like_name);
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

// The CUDA kernels read whole rows: a matrix's rows must not overlap (the wrappers copy such a matrix once).
inline void rows_apart(const at::Tensor& U, const char* op, const char* name = "U") {
  TORCH_CHECK_VALUE(U.size(0) <= 1 || U.stride(0) >= U.size(1), op, ": ", name, " rows must not overlap, got strides ",
                    py_shape(U.strides()), " (the fedkernels.ops wrapper copies it once)");
}

// The output of the functional forms (their _out variants fill it), after weighted_sum_args: [d] on U's
// device, of base's dtype when base is given, else U's.
inline at::Tensor weighted_sum_output(const at::Tensor& U, const c10::optional<at::Tensor>& base) {
  return at::empty({U.size(1)}, U.options().dtype(base.has_value() ? base->scalar_type() : U.scalar_type()));
}

}  // namespace checks
}  // namespace fedkernels
