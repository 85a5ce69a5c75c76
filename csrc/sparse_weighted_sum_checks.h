// Tensor rules of sparse_weighted_sum, written once for its CPU kernel (csrc/cpu/sparse_weighted_sum.cpp) and its
// CUDA glue (csrc/cuda/sparse_weighted_sum_glue.cpp): shapes, dtypes, devices and layouts, each a one-line
// ValueError in the Python wrapper's words (fedkernels/ops/sparse_weighted_sum.py checks types and values,
// including the index values, first). The offsets' values are read here too: the kernels index with them.
#pragma once

#include "checks.h"
#include "dequant_weighted_sum_checks.h"

namespace fedkernels {
namespace checks {

struct SparseArgs {
  int64_t K;               // number of lists (offsets has K + 1 entries)
  int64_t n;               // number of selected lists
  at::ScalarType result;   // the result's dtype
};

// idx: contiguous 1-D int32/int64 [nnz]; val: contiguous 1-D float [nnz] on idx's device; d >= 0; offsets: 1-D
// int64 [K + 1] on the host, non-decreasing from 0 to nnz (list k is idx/val[offsets[k]:offsets[k + 1]]); rows:
// optional 1-D indices; coef: one float per selected list; base / out_dtype: float_result (default: float64 for
// float64 values, else float32). Checked in the wrapper's order.
inline SparseArgs sparse_weighted_sum_args(const at::Tensor& idx, const at::Tensor& val, const at::Tensor& offsets,
                                           const at::Tensor& coef, int64_t d, const c10::optional<at::Tensor>& base,
                                           const c10::optional<at::Tensor>& rows,
                                           c10::optional<at::ScalarType> out_dtype, c10::Device dev) {
  const char* op = "sparse_weighted_sum";
  const auto ist = idx.scalar_type();
  TORCH_CHECK_VALUE(idx.dim() == 1 && (ist == at::kInt || ist == at::kLong), op,
                    ": idx must be a 1-D int32/int64 tensor, got shape ", py_shape(idx.sizes()), " ", py_dtype(ist));
  TORCH_CHECK_VALUE(val.dim() == 1 && val.numel() == idx.numel(), op, ": val must be a 1-D tensor of idx's length ",
                    idx.numel(), ", got shape ", py_shape(val.sizes()));
  float_dtype(val, op, "val");
  on_device(idx, dev, op, "idx", "idx");
  on_device(val, dev, op, "val", "idx");
  TORCH_CHECK_VALUE(d >= 0, op, ": d must be an int >= 0 (the dense length), got ", d);
  TORCH_CHECK_VALUE(offsets.dim() == 1 && offsets.numel() >= 1, op,
                    ": offsets must be a 1-D sequence of K + 1 list starts, got shape ", py_shape(offsets.sizes()));
  const auto ost = offsets.scalar_type();
  TORCH_CHECK_VALUE(!(at::isFloatingType(ost) || at::isComplexType(ost) || ost == at::kBool), op,
                    ": offsets must hold integers, got ", py_dtype(ost));
  TORCH_CHECK_VALUE(ost == at::kLong, op, ": offsets must hold int64 list starts (the fedkernels.ops wrapper converts "
                    "them), got ", py_dtype(ost));
  TORCH_CHECK_VALUE(offsets.device().is_cpu(), op, ": offsets must be on the host (cpu; the fedkernels.ops wrapper "
                    "copies them there), got ", offsets.device());
  TORCH_CHECK_VALUE(idx.is_contiguous(), op, ": idx must be contiguous (the fedkernels.ops wrapper copies it once)");
  TORCH_CHECK_VALUE(val.is_contiguous(), op, ": val must be contiguous (the fedkernels.ops wrapper copies it once)");
  auto off = offsets.contiguous();
  const int64_t* o = off.data_ptr<int64_t>();
  const int64_t K = off.numel() - 1;
  TORCH_CHECK(o[0] == 0 && o[K] == idx.numel(), op, ": offsets must run from 0 to nnz = ", idx.numel(), ", got ", o[0],
              " .. ", o[K]);
  for (int64_t k = 0; k < K; ++k)
    TORCH_CHECK(o[k] <= o[k + 1], op, ": offsets must be non-decreasing, got offsets[", k, "] = ", o[k], " > ", o[k + 1]);
  index_rows(rows, dev, op, "idx");
  const int64_t n = rows.has_value() ? rows->numel() : K;
  coef_vector(coef, n, dev, op, "idx");
  const auto dflt = val.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return {K, n, float_result(base, out_dtype, dflt, d, dev, op)};
}

}  // namespace checks
}  // namespace fedkernels
