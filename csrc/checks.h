// Helpers shared by the per-op argument rules (csrc/<op>_checks.h), which the CPU kernel
// (csrc/cpu/<op>.cpp) and the CUDA glue (csrc/cuda/<op>_glue.cpp) of each op call: the cheap
// last-line TORCH_CHECKs on shapes, dtypes and devices (the Python wrappers in fedkernels.ops
// validate values first and name the argument) and the host-side reading of small arguments.
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

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace fedkernels {

// A 2-D matrix accepted by the streaming kernels: unit stride along columns, any row stride.
inline void check_rowmajor(const at::Tensor& U, const char* op, const char* name) {
  TORCH_CHECK(U.dim() == 2, op, ": ", name, " must be 2-D [K, d], got ", U.dim(), "-D");
  TORCH_CHECK(U.size(1) <= 1 || U.stride(1) == 1, op, ": ", name,
              " must have unit column stride (the Python wrapper makes it so)");
}

namespace checks {

inline void on_device(const at::Tensor& t, c10::Device dev, const char* op, const char* name) {
  TORCH_CHECK(t.device() == dev, op, ": ", name, " must be on ", dev, ", got ", t.device());
}

inline bool is_float4(at::ScalarType st) {
  return st == at::kFloat || st == at::kDouble || st == at::kHalf || st == at::kBFloat16;
}

// A small 1-D float tensor (on the host or a device) read as float64 on the host (exact widening).
inline std::vector<double> host_doubles(const at::Tensor& t) {
  auto h = t.to(at::kCPU, at::kDouble).contiguous();
  const double* p = h.data_ptr<double>();
  return std::vector<double>(p, p + h.numel());
}

}  // namespace checks
}  // namespace fedkernels
