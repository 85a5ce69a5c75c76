// Argument rules of gc_project_ / gc_project, written once for its CPU kernel (csrc/cpu/gc_project.cpp) and its
// CUDA glue (csrc/cuda/gc_project_glue.cpp): cheap last-line checks (the Python wrapper validates first),
// and the row view of a tensor that both backends use.
#pragma once

#include "checks.h"

namespace fedkernels {
namespace checks {

// Returns center (vector_policy == "center"). Every tensor defined, float16/bfloat16/float32/float64, on dev.
inline bool gc_args(at::TensorList tensors, c10::string_view policy, int64_t min_fanin, c10::Device dev) {
  TORCH_CHECK(policy == "skip" || policy == "center", "gc_project: vector_policy must be 'skip' or 'center', got '",
              std::string(policy), "'");
  TORCH_CHECK(min_fanin >= 1, "gc_project: min_fanin must be >= 1, got ", min_fanin);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    TORCH_CHECK(t.defined(), "gc_project: tensors[", i, "] is undefined");
    TORCH_CHECK(t.device() == dev, "gc_project: tensors[", i, "] is on ", t.device(), ", expected ", dev);
    TORCH_CHECK(is_float4(t.scalar_type()), "gc_project: tensors[", i,
                "] must be float16, bfloat16, float32 or float64, got ", t.scalar_type());
  }
  return policy == "center";
}

// gc_project's row view: dim >= 2 -> rows = size(0), M = numel / rows; 1-D -> one row with
// "center", unchanged with "skip"; 0-D, empty and M < min_fanin unchanged (returns false).
inline bool gc_row_shape(const at::Tensor& t, bool center, int64_t min_fanin, int64_t& rows, int64_t& M) {
  if (t.dim() == 0 || t.numel() == 0) return false;
  if (t.dim() == 1) {
    if (!center) return false;
    rows = 1;
    M = t.numel();
  } else {
    rows = t.size(0);
    M = t.numel() / rows;
  }
  return M >= min_fanin;
}

// True when row r of t is the dense span [data + r*M, data + (r+1)*M).
inline bool gc_rows_dense(const at::Tensor& t, int64_t rows, int64_t M) {
  if (t.is_contiguous()) return true;
  if (!t.is_non_overlapping_and_dense()) return false;
  return rows == 1 || t.stride(0) == M;
}

}  // namespace checks
}  // namespace fedkernels
