// Argument rules of gc_project_ / gc_project, written once for its CPU kernel (csrc/cpu/gc_project.cpp) and its
// CUDA glue (csrc/cuda/gc_project_glue.cpp): the one check of the tensors' dtypes and devices (the Python
// wrapper checks the types and options first), and the row view of a tensor that both backends use.
#pragma once

#include <string>

#include "checks.h"

namespace fedkernels {
namespace checks {

// Returns center (vector_policy == "center"). `op` is "gc_project_" or "gc_project". Every tensor
// defined and float16/bfloat16/float32/float64, then all on one device (tensors[0]'s): one-line
// ValueErrors worded as the Python wrapper (fedkernels/ops/gc_project.py) words its other errors.
inline bool gc_args(at::TensorList tensors, c10::string_view policy, int64_t min_fanin, const char* op) {
  TORCH_CHECK(policy == "skip" || policy == "center", op, ": vector_policy must be 'skip' or 'center', got '",
              std::string(policy), "'");
  TORCH_CHECK(min_fanin >= 1, op, ": min_fanin must be an int >= 1, got ", min_fanin);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    TORCH_CHECK_VALUE(t.defined(), op, ": tensors[", i, "] is undefined");
    if (!is_float4(t.scalar_type())) float_dtype(t, op, ("tensors[" + std::to_string(i) + "]").c_str());
  }
  for (size_t i = 1; i < tensors.size(); ++i)
    TORCH_CHECK_VALUE(tensors[i].device() == tensors[0].device(), op,
                      ": all tensors must be on one device; tensors[0] is on ", tensors[0].device(), ", tensors[", i,
                      "] on ", tensors[i].device());
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
