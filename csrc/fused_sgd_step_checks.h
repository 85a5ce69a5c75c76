// Argument rules of fused_sgd_step_, written once for its CPU kernel (csrc/cpu/fused_sgd_step.cpp) and its
// CUDA glue (csrc/cuda/fused_sgd_step_glue.cpp): cheap last-line checks (the Python wrapper validates first).
#pragma once

#include "checks.h"

namespace fedkernels {
namespace checks {

inline void fused_step_args(at::TensorList params, at::TensorList grads, at::TensorList momentum_bufs,
                            const c10::List<c10::optional<at::Tensor>>& c_add,
                            const c10::List<c10::optional<at::Tensor>>& c_sub, const c10::List<bool>& gc_mask,
                            double momentum, c10::string_view vector_policy, int64_t min_fanin) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n, "fused_sgd_step_: grads has ", grads.size(), " tensors, expected ", n);
  TORCH_CHECK(momentum == 0.0 || momentum_bufs.size() == n, "fused_sgd_step_: momentum_bufs has ",
              momentum_bufs.size(), " tensors, expected ", n, " (momentum != 0)");
  TORCH_CHECK(c_add.size() == 0 || c_add.size() == n, "fused_sgd_step_: c_add has ", c_add.size(),
              " entries, expected 0 or ", n);
  TORCH_CHECK(c_sub.size() == 0 || c_sub.size() == n, "fused_sgd_step_: c_sub has ", c_sub.size(),
              " entries, expected 0 or ", n);
  TORCH_CHECK(gc_mask.size() == 0 || gc_mask.size() == n, "fused_sgd_step_: gc_mask has ", gc_mask.size(),
              " entries, expected 0 or ", n);
  TORCH_CHECK(vector_policy == "skip" || vector_policy == "center",
              "fused_sgd_step_: vector_policy must be 'skip' or 'center', got '", std::string(vector_policy), "'");
  TORCH_CHECK(min_fanin >= 1, "fused_sgd_step_: min_fanin must be >= 1, got ", min_fanin);
}

// params[i]: defined, contiguous, float, on dev.
inline void fused_param(const at::Tensor& p, size_t i, c10::Device dev) {
  TORCH_CHECK(p.defined() && p.device() == dev && p.is_contiguous(), "fused_sgd_step_: params[", i,
              "] must be a contiguous tensor on ", dev);
  TORCH_CHECK(is_float4(p.scalar_type()), "fused_sgd_step_: params[", i,
              "] must be float16, bfloat16, float32 or float64, got ", p.scalar_type());
}

// grads[i], momentum_bufs[i], c_add[i], c_sub[i]: params[i]'s shape, dtype and device, contiguous.
inline void fused_like(const at::Tensor& t, const at::Tensor& p, const char* name, size_t i) {
  TORCH_CHECK(t.defined(), "fused_sgd_step_: ", name, "[", i, "] is undefined");
  TORCH_CHECK(t.sizes() == p.sizes(), "fused_sgd_step_: ", name, "[", i, "] has shape ", t.sizes(),
              ", expected the shape of params[", i, "] ", p.sizes());
  TORCH_CHECK(t.scalar_type() == p.scalar_type(), "fused_sgd_step_: ", name, "[", i, "] has dtype ", t.scalar_type(),
              ", expected ", p.scalar_type());
  TORCH_CHECK(t.device() == p.device(), "fused_sgd_step_: ", name, "[", i, "] must be on ", p.device(), ", got ",
              t.device());
  TORCH_CHECK(t.is_contiguous(), "fused_sgd_step_: ", name, "[", i, "] must be contiguous");
}

// c_add[i] / c_sub[i]: absent (empty list, None or undefined) or checked like params[i].
inline c10::optional<at::Tensor> fused_control(const c10::List<c10::optional<at::Tensor>>& l, size_t i,
                                               const at::Tensor& p, const char* name) {
  if (l.size() == 0) return c10::nullopt;
  c10::optional<at::Tensor> c = l.get(i);
  if (!c.has_value() || !c->defined()) return c10::nullopt;
  fused_like(*c, p, name, i);
  return c;
}

}  // namespace checks
}  // namespace fedkernels
