// Argument rules of fused_sgd_step_, written once for its CPU kernel (csrc/cpu/fused_sgd_step.cpp) and its
// CUDA glue (csrc/cuda/fused_sgd_step_glue.cpp): the one check of every tensor's dtype, shape, device and
// layout, as one-line ValueErrors worded as the Python wrapper (fedkernels/ops/fused_sgd_step.py) words
// its other errors. The wrapper checks the types (a list of tensors) and the hyper-parameters first.
#pragma once

#include <string>

#include "checks.h"

namespace fedkernels {
namespace checks {

// "{name}[{i}]" for the messages.
inline std::string fused_entry(const char* name, size_t i) { return std::string(name) + "[" + std::to_string(i) + "]"; }

// A tensor list `name` of the op has one entry per parameter (n).
inline void fused_len(size_t got, size_t n, const char* name) {
  TORCH_CHECK_VALUE(got == n, "fused_sgd_step_: ", name, " must have one entry per parameter (", n, "), got ", got);
}

// name[i] has params[i]'s shape, dtype and device, and is contiguous (the wrapper copies a
// non-contiguous one).
inline void fused_like(const at::Tensor& t, const at::Tensor& p, const char* name, size_t i) {
  TORCH_CHECK_VALUE(t.defined(), "fused_sgd_step_: ", name, "[", i, "] is undefined");
  TORCH_CHECK_VALUE(t.sizes() == p.sizes() && t.scalar_type() == p.scalar_type() && t.device() == p.device(),
                    "fused_sgd_step_: ", name, "[", i, "] must match params[", i, "] (shape ", py_shape(p.sizes()),
                    ", ", py_dtype(p.scalar_type()), ", ", p.device(), "), got shape ", py_shape(t.sizes()), ", ",
                    py_dtype(t.scalar_type()), ", ", t.device());
  TORCH_CHECK_VALUE(t.is_contiguous(), "fused_sgd_step_: ", name, "[", i,
                    "] must be contiguous (the fedkernels.ops wrapper copies it once)");
}

// Every tensor argument, in the wrapper's order: params (float, on dev = params[0]'s device,
// contiguous), then grads, momentum_bufs (when momentum != 0), c_add, c_sub (empty = none, else one
// tensor-or-None per parameter), each entry like params[i]; then the list of gc_mask and the options.
inline void fused_step_args(at::TensorList params, at::TensorList grads, at::TensorList momentum_bufs,
                            const c10::List<c10::optional<at::Tensor>>& c_add,
                            const c10::List<c10::optional<at::Tensor>>& c_sub, const c10::List<bool>& gc_mask,
                            double momentum, c10::string_view vector_policy, int64_t min_fanin, c10::Device dev) {
  const char* op = "fused_sgd_step_";
  const size_t n = params.size();
  for (size_t i = 0; i < n; ++i) {
    const auto& p = params[i];
    TORCH_CHECK_VALUE(p.defined(), op, ": params[", i, "] is undefined");
    if (!is_float4(p.scalar_type()) || p.device() != dev) {  // (the entry's name is built only to report it)
      const std::string name = fused_entry("params", i);
      float_dtype(p, op, name.c_str());
      on_device(p, dev, op, name.c_str(), "params[0]");
    }
    TORCH_CHECK_VALUE(p.is_contiguous(), op, ": params[", i,
                      "] must be contiguous (the fedkernels.ops wrapper copies it once)");
  }
  fused_len(grads.size(), n, "grads");
  for (size_t i = 0; i < n; ++i) fused_like(grads[i], params[i], "grads", i);
  if (momentum != 0.0) {
    fused_len(momentum_bufs.size(), n, "momentum_bufs");
    for (size_t i = 0; i < n; ++i) fused_like(momentum_bufs[i], params[i], "momentum_bufs", i);
  }
  const std::pair<const c10::List<c10::optional<at::Tensor>>*, const char*> controls[] = {{&c_add, "c_add"},
                                                                                        {&c_sub, "c_sub"}};
  for (const auto& cl : controls) {
    const auto& l = *cl.first;
    if (l.size() == 0) continue;
    fused_len(l.size(), n, cl.second);
    for (size_t i = 0; i < n; ++i) {
      const c10::optional<at::Tensor> c = l.get(i);
      if (c.has_value() && c->defined()) fused_like(*c, params[i], cl.second, i);
    }
  }
  TORCH_CHECK(gc_mask.size() == 0 || gc_mask.size() == n, op, ": gc_mask must have one entry per parameter (", n,
              "), got ", gc_mask.size());
  TORCH_CHECK(vector_policy == "skip" || vector_policy == "center", op, ": vector_policy must be 'skip' or 'center', got '",
              std::string(vector_policy), "'");
  TORCH_CHECK(min_fanin >= 1, op, ": min_fanin must be an int >= 1, got ", min_fanin);
}

// c_add[i] / c_sub[i]: absent (empty list, None or undefined) or the tensor (checked by fused_step_args).
inline c10::optional<at::Tensor> fused_control(const c10::List<c10::optional<at::Tensor>>& l, size_t i) {
  if (l.size() == 0) return c10::nullopt;
  c10::optional<at::Tensor> c = l.get(i);
  if (!c.has_value() || !c->defined()) return c10::nullopt;
  return c;
}

}  // namespace checks
}  // namespace fedkernels
