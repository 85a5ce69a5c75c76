// Argument rules of sparse_weighted_sum, written once for its CPU kernel (csrc/cpu/sparse_weighted_sum.cpp)
// and its CUDA glue (csrc/cuda/sparse_weighted_sum_glue.cpp): cheap last-line checks (the Python wrapper
// validates first, including the index values, and names the argument).
#pragma once

#include "checks.h"

namespace fedkernels {
namespace checks {

// The result's dtype: base's when given (then out_dtype, if given, must agree), else out_dtype, else float64
// for float64 values and float32 otherwise.
inline at::ScalarType sparse_out_dtype(const at::Tensor& val, const c10::optional<at::Tensor>& base,
                                       c10::optional<at::ScalarType> out_dtype, const char* op) {
  const at::ScalarType dflt = val.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::ScalarType st = base.has_value() ? base->scalar_type() : out_dtype.value_or(dflt);
  TORCH_CHECK(st == at::kFloat || st == at::kDouble, op, ": the result must be Float or Double, got ", st);
  TORCH_CHECK(!out_dtype.has_value() || *out_dtype == st, op, ": out_dtype ", *out_dtype, " differs from base's ", st);
  return st;
}

// idx: contiguous 1-D Int/Long [nnz]; val: contiguous 1-D float [nnz]; offsets: 1-D Long [K + 1] on the host,
// non-decreasing from 0 to nnz (list k is idx/val[offsets[k]:offsets[k + 1]]); coef: 1-D float [n]; d >= 0;
// base: contiguous [d]. Returns K.
inline int64_t sparse_weighted_sum_args(const at::Tensor& idx, const at::Tensor& val, const at::Tensor& offsets,
                                        const at::Tensor& coef, int64_t d, const c10::optional<at::Tensor>& base,
                                        c10::Device dev) {
  const char* op = "sparse_weighted_sum";
  TORCH_CHECK(idx.dim() == 1 && idx.is_contiguous(), op, ": idx must be a contiguous 1-D tensor, got shape ", idx.sizes());
  TORCH_CHECK(idx.scalar_type() == at::kInt || idx.scalar_type() == at::kLong, op, ": idx must be Int or Long, got ",
              idx.scalar_type());
  TORCH_CHECK(val.dim() == 1 && val.is_contiguous() && val.numel() == idx.numel(), op,
              ": val must be a contiguous 1-D tensor of idx's length ", idx.numel(), ", got shape ", val.sizes());
  TORCH_CHECK(is_float4(val.scalar_type()), op, ": val must be float16, bfloat16, float32 or float64, got ",
              val.scalar_type());
  on_device(idx, dev, op, "idx");
  on_device(val, dev, op, "val");
  TORCH_CHECK(offsets.dim() == 1 && offsets.numel() >= 1 && offsets.scalar_type() == at::kLong && offsets.device().is_cpu(),
              op, ": offsets must be a 1-D Long host tensor of length K + 1, got ", offsets.sizes(), " ",
              offsets.scalar_type(), " on ", offsets.device());
  auto off = offsets.contiguous();
  const int64_t* o = off.data_ptr<int64_t>();
  const int64_t K = off.numel() - 1;
  TORCH_CHECK(o[0] == 0 && o[K] == idx.numel(), op, ": offsets must run from 0 to nnz = ", idx.numel(), ", got ", o[0],
              " .. ", o[K]);
  for (int64_t k = 0; k < K; ++k)
    TORCH_CHECK(o[k] <= o[k + 1], op, ": offsets must be non-decreasing, got offsets[", k, "] = ", o[k], " > ", o[k + 1]);
  TORCH_CHECK(d >= 0, op, ": d must be >= 0, got ", d);
  TORCH_CHECK(coef.dim() == 1 && coef.is_floating_point(), op, ": coef must be a 1-D float tensor, got ", coef.sizes(), " ",
              coef.scalar_type());
  if (base.has_value()) {
    TORCH_CHECK(base->dim() == 1 && base->size(0) == d && base->is_contiguous(), op,
                ": base must be a contiguous 1-D tensor of length ", d, ", got shape ", base->sizes());
    on_device(*base, dev, op, "base");
  }
  return K;
}

}  // namespace checks
}  // namespace fedkernels
