// Helpers shared by the per-op argument rules (csrc/<op>_checks.h), which the CPU kernel
// (csrc/cpu/<op>.cpp) and the CUDA glue (csrc/cuda/<op>_glue.cpp) of each op call.
//
// The one place an op's tensors are checked. Each op checks its tensor arguments' shapes, dtypes,
// devices and layouts here, in C++, for every caller: the Python wrapper in fedkernels.ops, a
// direct torch.ops.fedkernels call, a torch.compile graph. A failed check raises a ValueError
// (TORCH_CHECK_VALUE) of one line that names the op, the argument, the value and what was
// expected, spelled as Python spells them: shapes as tuples ("(2, 3)"), dtypes as "torch.float32".
// The Python wrappers check what only Python sees: argument types, and values (ranges,
// finiteness) before any work. The host-side reading of small arguments lives here too.
// Torch-side only (ATen / c10 headers): the plain CUDA files csrc/cuda/*.cu never include it.
//
// Device rule: every function that checks devices takes the device the op runs on (`dev`): at::kCPU
// in the CPU kernels, the first tensor argument's device in the CUDA glue. Small host-side vectors
// (coefficients, rows) are checked by the caller (CPU: on the CPU; CUDA: host or the op's device).
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/string_view.h>

#include <cctype>
#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace fedkernels {
namespace checks {

// A shape as Python prints a tuple of ints: "()", "(3,)", "(2, 3)".
inline std::string py_shape(at::IntArrayRef s) {
  std::string r = "(";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i) r += ", ";
    r += std::to_string(s[i]);
  }
  return r + (s.size() == 1 ? ",)" : ")");
}

// A dtype as Python prints it: "torch.float32", "torch.bfloat16", "torch.int64".
inline std::string py_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kBool: return "torch.bool";
    case at::kByte: return "torch.uint8";
    case at::kChar: return "torch.int8";
    case at::kShort: return "torch.int16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kComplexFloat: return "torch.complex64";
    case at::kComplexDouble: return "torch.complex128";
    default: {
      std::string n = c10::toString(t);
      for (auto& ch : n) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
      return "torch." + n;
    }
  }
}

inline bool is_float4(at::ScalarType st) {
  return st == at::kFloat || st == at::kDouble || st == at::kHalf || st == at::kBFloat16;
}

// `t` is on `dev`, the device the op runs on (that of `like_name`, U unless named).
inline void on_device(const at::Tensor& t, c10::Device dev, const char* op, const char* name,
                      const char* like_name = "U") {
  TORCH_CHECK_VALUE(t.device() == dev, op, ": ", name, " is on ", t.device(), " but ", like_name, " is on ", dev);
}

// One of the four float dtypes the kernels take.
inline void float_dtype(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK_VALUE(is_float4(t.scalar_type()), op, ": ", name,
                    " must have a floating dtype (float16, bfloat16, float32, float64), got ",
                    py_dtype(t.scalar_type()));
}

// `v` has the dtype of `like` (named `like_name`).
inline void same_dtype(const at::Tensor& v, const at::Tensor& like, const char* op, const char* name,
                       const char* like_name = "U") {
  TORCH_CHECK_VALUE(v.scalar_type() == like.scalar_type(), op, ": ", name, " must have dtype ",
                    py_dtype(like.scalar_type()), " (the dtype of ", like_name, "), got ", py_dtype(v.scalar_type()));
}

// A 2-D float [K, d] matrix on `dev` with unit column stride and rows that do not overlap (the
// Python wrappers copy a matrix without them once; a direct call must pass one).
inline void matrix(const at::Tensor& U, c10::Device dev, const char* op, const char* name = "U") {
  TORCH_CHECK_VALUE(U.dim() == 2, op, ": ", name, " must be a 2-D [K, d] tensor, got shape ", py_shape(U.sizes()));
  float_dtype(U, op, name);
  on_device(U, dev, op, name, name);
  TORCH_CHECK_VALUE(U.size(1) <= 1 || U.stride(1) == 1, op, ": ", name,
                    " must have unit column stride, got strides ", py_shape(U.strides()),
                    " (the fedkernels.ops wrapper copies it once)");
}

// A 1-D tensor of `length` elements with the dtype of `like` (named `like_name`), on `dev`.
inline void vector_like(const at::Tensor& v, int64_t length, const at::Tensor& like, c10::Device dev, const char* op,
                        const char* name, const char* like_name = "U") {
  TORCH_CHECK_VALUE(v.dim() == 1 && v.size(0) == length, op, ": ", name, " must be a 1-D tensor of length ", length,
                    ", got shape ", py_shape(v.sizes()));
  same_dtype(v, like, op, name, like_name);
  on_device(v, dev, op, name, like_name);
}

// A small vector (rows, coef, per-client scalars) is on the host or on `dev` (the CUDA glue moves a host
// one there).
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

// The CUDA kernels read whole rows: a matrix's rows must not overlap (the wrappers copy an expanded
// matrix once).
inline void rows_apart(const at::Tensor& U, const char* op, const char* name = "U") {
  TORCH_CHECK_VALUE(U.size(0) <= 1 || U.stride(0) >= U.size(1), op, ": ", name, " rows must not overlap, got strides ",
                    py_shape(U.strides()), " (the fedkernels.ops wrapper copies it once)");
}

// A small 1-D float tensor (on the host or a device) read as float64 on the host (exact widening).
inline std::vector<double> host_doubles(const at::Tensor& t) {
  auto h = t.to(at::kCPU, at::kDouble).contiguous();
  const double* p = h.data_ptr<double>();
  return std::vector<double>(p, p + h.numel());
}

}  // namespace checks

// The row-major rule alone (shape and layout, no dtype or device): kept for the ops whose rules
// read it before their own dtype checks.
inline void check_rowmajor(const at::Tensor& U, const char* op, const char* name) {
  TORCH_CHECK_VALUE(U.dim() == 2, op, ": ", name, " must be a 2-D [K, d] tensor, got shape ",
                    checks::py_shape(U.sizes()));
  TORCH_CHECK_VALUE(U.size(1) <= 1 || U.stride(1) == 1, op, ": ", name, " must have unit column stride, got strides ",
                    checks::py_shape(U.strides()), " (the fedkernels.ops wrapper copies it once)");
}

}  // namespace fedkernels
