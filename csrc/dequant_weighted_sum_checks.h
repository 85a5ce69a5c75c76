// Tensor rules of dequant_weighted_sum, written once for its CPU kernel (csrc/cpu/dequant_weighted_sum.cpp) and
// its CUDA glue (csrc/cuda/dequant_weighted_sum_glue.cpp): shapes, dtypes, devices and layouts, each a one-line
// ValueError in the Python wrapper's words (fedkernels/ops/dequant_weighted_sum.py checks types and values
// only). The float32/float64 result rule (base, out_dtype) serves sparse_weighted_sum too.
#pragma once

#include "checks.h"

namespace fedkernels {
namespace checks {

inline bool dequant_code_dtype_ok(at::ScalarType s) { return s == at::kChar || s == at::kFloat8_e4m3fn; }

// Number of scale blocks of a row of d codes in blocks of `block` (the last one may be short).
inline int64_t dequant_blocks(int64_t d, int64_t block) { return block > 0 ? (d + block - 1) / block : 0; }

// The result's dtype, float32 or float64: base's when given (then out_dtype, if given, must agree), else
// out_dtype, else `dflt`. base: contiguous [d] on `dev` (the device of "the rows").
inline at::ScalarType float_result(const c10::optional<at::Tensor>& base, c10::optional<at::ScalarType> out_dtype,
                                   at::ScalarType dflt, int64_t d, c10::Device dev, const char* op) {
  const auto f32_f64 = [](at::ScalarType s) { return s == at::kFloat || s == at::kDouble; };
  TORCH_CHECK_VALUE(!out_dtype.has_value() || f32_f64(*out_dtype), op,
                    ": out_dtype must be torch.float32 or torch.float64, got ", py_dtype(*out_dtype));
  if (!base.has_value()) return out_dtype.value_or(dflt);
  const auto st = base->scalar_type();
  TORCH_CHECK_VALUE(base->dim() == 1 && base->size(0) == d, op, ": base must be a 1-D tensor of length ", d,
                    ", got shape ", py_shape(base->sizes()));
  TORCH_CHECK_VALUE(f32_f64(st), op, ": base must be float32 or float64 (the result's dtype), got ", py_dtype(st));
  TORCH_CHECK_VALUE(!out_dtype.has_value() || *out_dtype == st, op, ": out_dtype ", py_dtype(*out_dtype),
                    " differs from base's dtype ", py_dtype(st));
  TORCH_CHECK_VALUE(base->device() == dev, op, ": base is on ", base->device(), " but the rows are on ", dev);
  TORCH_CHECK_VALUE(base->is_contiguous(), op, ": base must be contiguous (the fedkernels.ops wrapper copies it once)");
  return st;
}

// Q: [K, d] int8 / float8_e4m3fn codes with unit column stride; block >= 1; scales: [K, ceil(d / block)] float32
// with unit column stride; rows: optional 1-D indices; coef: one float per selected row; base / out_dtype:
// float_result. Checked in the wrapper's order.
struct DequantArgs {
  int64_t n;               // number of selected rows
  at::ScalarType result;   // the result's dtype
};
inline DequantArgs dequant_weighted_sum_args(
    const at::Tensor& Q, const at::Tensor& scales, const at::Tensor& coef, int64_t block,
    const c10::optional<at::Tensor>& base, const c10::optional<at::Tensor>& rows,
    c10::optional<at::ScalarType> out_dtype, c10::Device dev) {
  const char* op = "dequant_weighted_sum";
  TORCH_CHECK_VALUE(Q.dim() == 2, op, ": Q must be a 2-D [K, d] tensor of codes, got shape ", py_shape(Q.sizes()));
  TORCH_CHECK_VALUE(dequant_code_dtype_ok(Q.scalar_type()), op, ": Q must hold int8 or float8_e4m3fn codes, got ",
                    py_dtype(Q.scalar_type()));
  on_device(Q, dev, op, "Q", "Q");
  check_rowmajor(Q, op, "Q");
  TORCH_CHECK_VALUE(block >= 1, op, ": block must be an int >= 1 (columns per scale), got ", block);
  const int64_t K = Q.size(0), d = Q.size(1), nb = dequant_blocks(d, block);
  TORCH_CHECK_VALUE(scales.dim() == 2 && scales.size(0) == K && scales.size(1) == nb, op,
                    ": scales must be [K, ceil(d / block)] = [", K, ", ", nb, "] (one per row and block of ", block,
                    "), got shape ", py_shape(scales.sizes()));
  TORCH_CHECK_VALUE(scales.scalar_type() == at::kFloat, op, ": scales must be float32, got ",
                    py_dtype(scales.scalar_type()));
  on_device(scales, dev, op, "scales", "Q");
  check_rowmajor(scales, op, "scales");
  index_rows(rows, dev, op, "Q");
  const int64_t n = rows.has_value() ? rows->numel() : K;
  coef_vector(coef, n, dev, op, "Q");
  return {n, float_result(base, out_dtype, at::kFloat, d, dev, op)};
}

}  // namespace checks
}  // namespace fedkernels
