// Argument rules of server_opt_step_, written once for its CPU kernel (csrc/cpu/server_opt_step.cpp) and
// its CUDA glue (csrc/cuda/server_opt_step_glue.cpp): cheap last-line checks (the Python wrapper
// validates first and names the argument).
#pragma once

#include <string>

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

// io, x: [d] of one float dtype; m, v: [d] float32 or float64 (one dtype; float64 when x is float64);
// all contiguous on dev; x apart from io, m and v (io, m, v are written while x is read).
inline void server_opt_args(const at::Tensor& io, const at::Tensor& m, const at::Tensor& v, const at::Tensor& x,
                            c10::Device dev) {
  const char* op = "server_opt_step_";
  const int64_t d = io.numel();
  TORCH_CHECK(io.dim() == 1, op, ": io must be 1-D [d], got shape ", io.sizes());
  TORCH_CHECK(is_float4(io.scalar_type()), op, ": io must be float16, bfloat16, float32 or float64, got ",
              io.scalar_type());
  TORCH_CHECK(x.dim() == 1 && x.numel() == d, op, ": x must be 1-D of length d=", d, ", got shape ", x.sizes());
  TORCH_CHECK(x.scalar_type() == io.scalar_type(), op, ": x must have io's dtype ", io.scalar_type(), ", got ",
              x.scalar_type());
  TORCH_CHECK(m.dim() == 1 && m.numel() == d, op, ": m must be 1-D of length d=", d, ", got shape ", m.sizes());
  TORCH_CHECK(v.dim() == 1 && v.numel() == d, op, ": v must be 1-D of length d=", d, ", got shape ", v.sizes());
  TORCH_CHECK(m.scalar_type() == at::kFloat || m.scalar_type() == at::kDouble, op,
              ": m must be float32 or float64, got ", m.scalar_type());
  TORCH_CHECK(v.scalar_type() == m.scalar_type(), op, ": v must have m's dtype ", m.scalar_type(), ", got ",
              v.scalar_type());
  TORCH_CHECK(io.scalar_type() != at::kDouble || m.scalar_type() == at::kDouble, op,
              ": m and v must be float64 for a float64 model (got ", m.scalar_type(), ")");
  for (const at::Tensor* t : {&io, &m, &v, &x}) {
    on_device(*t, dev, op, t == &io ? "io" : t == &m ? "m" : t == &v ? "v" : "x");
    TORCH_CHECK(t->is_contiguous(), op, ": ", t == &io ? "io" : t == &m ? "m" : t == &v ? "v" : "x",
                " must be contiguous (the Python wrapper makes it so)");
  }
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
