// Argument rules of server_opt_step_, written once for its CPU kernel (csrc/cpu/server_opt_step.cpp) and
// its CUDA glue (csrc/cuda/server_opt_step_glue.cpp): the one check of the tensors' shapes, dtypes,
// devices and layouts (the Python wrapper checks the types, the rule and the hyper-parameters first).
#pragma once

#include <string>
#include <utility>

#include "checks.h"

namespace fedkernels {
namespace checks {

// The rule's code for the kernels (0 adam, 1 yogi, 2 adagrad: fedkernels::cuda::so::Rule).
inline int server_opt_rule(c10::string_view rule) {
  if (rule == "adam") return 0;
  if (rule == "yogi") return 1;
  if (rule == "adagrad") return 2;
  TORCH_CHECK(false, "server_opt_step_: rule must be 'adam', 'yogi' or 'adagrad', got '", std::string(rule), "'");
  return -1;
}

// x: [d] float; io, m, v: [d] on x's device; io of x's dtype; m, v float32 or float64 (one dtype;
// float64 when x is float64); all contiguous: one-line ValueErrors worded as the Python wrapper
// (fedkernels/ops/server_opt_step.py) words its other errors, in its order. Then x apart from io, m
// and v (io, m, v are written while x is read; the wrapper names the pair that shares memory).
inline void server_opt_args(const at::Tensor& io, const at::Tensor& m, const at::Tensor& v, const at::Tensor& x) {
  const char* op = "server_opt_step_";
  TORCH_CHECK_VALUE(x.dim() == 1, op, ": x must be a 1-D [d] tensor, got shape ", py_shape(x.sizes()));
  float_dtype(x, op, "x");
  const int64_t d = x.numel();
  const std::pair<const at::Tensor*, const char*> state[] = {{&io, "io"}, {&m, "m"}, {&v, "v"}};
  for (const auto& tn : state) {
    const at::Tensor& t = *tn.first;
    TORCH_CHECK_VALUE(t.dim() == 1 && t.numel() == d, op, ": ", tn.second, " must be a 1-D tensor of length d=", d,
                      " (len(x)), got shape ", py_shape(t.sizes()));
    on_device(t, x.device(), op, tn.second, "x");
  }
  same_dtype(io, x, op, "io", "x");
  TORCH_CHECK_VALUE((m.scalar_type() == at::kFloat || m.scalar_type() == at::kDouble) &&
                        v.scalar_type() == m.scalar_type(),
                    op, ": m and v must both be float32 or both float64, got ", py_dtype(m.scalar_type()), " and ",
                    py_dtype(v.scalar_type()));
  TORCH_CHECK_VALUE(x.scalar_type() != at::kDouble || m.scalar_type() == at::kDouble, op,
                    ": m and v must be float64 for a float64 model, got ", py_dtype(m.scalar_type()));
  for (const auto& tn : {std::make_pair(&io, "io"), std::make_pair(&m, "m"), std::make_pair(&v, "v"),
                         std::make_pair(&x, "x")})
    TORCH_CHECK_VALUE(tn.first->is_contiguous(), op, ": ", tn.second,
                      " must be contiguous (the fedkernels.ops wrapper copies it once)");
  if (d > 0) {
    const void* xp = x.data_ptr();
    TORCH_CHECK(xp != io.data_ptr() && xp != m.data_ptr() && xp != v.data_ptr(), op,
                ": x must not share memory with io, m or v");
    TORCH_CHECK(io.data_ptr() != m.data_ptr() && io.data_ptr() != v.data_ptr() && m.data_ptr() != v.data_ptr(), op,
                ": io, m and v must be distinct tensors");
  }
}

}  // namespace checks
}  // namespace fedkernels
