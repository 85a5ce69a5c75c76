// Argument rules of dequant_weighted_sum, written once for its CPU kernel (csrc/cpu/dequant_weighted_sum.cpp)
// and its CUDA glue (csrc/cuda/dequant_weighted_sum_glue.cpp): cheap last-line checks (the Python wrapper
// validates first and names the argument).
#pragma once

#include "checks.h"

namespace fedkernels {
namespace checks {

inline bool dequant_code_dtype_ok(at::ScalarType s) { return s == at::kChar || s == at::kFloat8_e4m3fn; }

// Number of scale blocks of a row of d codes in blocks of `block` (the last one may be short).
inline int64_t dequant_blocks(int64_t d, int64_t block) { return block > 0 ? (d + block - 1) / block : 0; }

// The result's dtype: base's when given (then out_dtype, if given, must agree), else out_dtype, else float32.
inline at::ScalarType dequant_out_dtype(const c10::optional<at::Tensor>& base, c10::optional<at::ScalarType> out_dtype,
                                        const char* op) {
  at::ScalarType st = base.has_value() ? base->scalar_type() : out_dtype.value_or(at::kFloat);
  TORCH_CHECK(st == at::kFloat || st == at::kDouble, op, ": the result must be Float or Double, got ", st);
  TORCH_CHECK(!out_dtype.has_value() || *out_dtype == st, op, ": out_dtype ", *out_dtype, " differs from base's ", st);
  return st;
}

// Q: [K, d] int8 / float8_e4m3fn codes with unit column stride; scales: [K, ceil(d / block)] float32 with unit
// column stride; coef: 1-D float of length n (one per selected row); base: contiguous [d] of the result's dtype.
inline void dequant_weighted_sum_args(const at::Tensor& Q, const at::Tensor& scales, const at::Tensor& coef, int64_t block,
                                      int64_t n, const c10::optional<at::Tensor>& base, c10::Device dev) {
  const char* op = "dequant_weighted_sum";
  check_rowmajor(Q, op, "Q");
  on_device(Q, dev, op, "Q");
  TORCH_CHECK(dequant_code_dtype_ok(Q.scalar_type()), op, ": Q must be Char (int8) or Float8_e4m3fn, got ",
              Q.scalar_type());
  TORCH_CHECK(block >= 1, op, ": block must be >= 1, got ", block);
  const int64_t K = Q.size(0), d = Q.size(1), nb = dequant_blocks(d, block);
  check_rowmajor(scales, op, "scales");
  on_device(scales, dev, op, "scales");
  TORCH_CHECK(scales.scalar_type() == at::kFloat, op, ": scales must be Float, got ", scales.scalar_type());
  TORCH_CHECK(scales.size(0) == K && scales.size(1) == nb, op, ": scales must be [", K, ", ", nb,
              "] (one per row and block), got ", scales.sizes());
  TORCH_CHECK(coef.dim() == 1 && coef.numel() == n, op, ": coef must be 1-D of length ", n,
              " (one per selected row), got shape ", coef.sizes());
  TORCH_CHECK(coef.is_floating_point(), op, ": coef must be a float tensor, got ", coef.scalar_type());
  if (base.has_value()) {
    TORCH_CHECK(base->dim() == 1 && base->size(0) == d && base->is_contiguous(), op,
                ": base must be a contiguous 1-D tensor of length ", d, ", got shape ", base->sizes());
    on_device(*base, dev, op, "base");
  }
}

}  // namespace checks
}  // namespace fedkernels
