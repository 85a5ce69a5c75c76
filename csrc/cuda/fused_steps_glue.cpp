// Torch glue of fused_sgd_step_ on CUDA: the CPU op's maths (csrc/cpu/fused_steps.cpp) as a
// composition of torch _foreach ops (multi-tensor launches) and the gc_project CUDA kernel:
//   D_i  = GC_i(g_i) (gc_project, out of place: g is not modified) where gc_mask[i], else a copy of g_i
//   D_i += wd * p_i;  D_i += c_add[i];  D_i -= c_sub[i]           (same order as the CPU op)
//   buf_i = D_i (first step) or momentum * buf_i + D_i             (momentum != 0)
//   p_i -= lr * buf_i (lr * D_i without momentum)
// Bit-level difference to the CPU op (documented, tested with tolerances): the CPU op keeps d in
// fp32 registers through the whole update; here every intermediate is stored in the parameter's
// dtype (exact in fp64, ~1 ulp per step in fp32; fp16/bf16 round after every stage) and the row
// means of GC are reduced in gc_project's tree order. Bytes: about 13-17 N s against the CPU op's
// 5-7 N s (a fused CUDA kernel is a performance item for a GPU run to measure).
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_foreach_copy.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_foreach_sub.h>

#include <string>
#include <vector>

#include "glue.h"

namespace fedkernels {
namespace {

using namespace glue;

void check_like(const at::Tensor& t, const at::Tensor& p, const char* name, size_t i) {
  TORCH_CHECK(t.defined(), "fused_sgd_step_: ", name, "[", i, "] is undefined");
  TORCH_CHECK(t.sizes() == p.sizes(), "fused_sgd_step_: ", name, "[", i, "] has shape ", t.sizes(),
              ", expected the shape of params[", i, "] ", p.sizes());
  TORCH_CHECK(t.scalar_type() == p.scalar_type(), "fused_sgd_step_: ", name, "[", i, "] has dtype ", t.scalar_type(),
              ", expected ", p.scalar_type());
  TORCH_CHECK(t.device() == p.device(), "fused_sgd_step_: ", name, "[", i, "] must be on ", p.device(), ", got ",
              t.device());
  TORCH_CHECK(t.is_contiguous(), "fused_sgd_step_: ", name, "[", i, "] must be contiguous");
}

void fused_sgd_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList momentum_bufs,
                         const c10::List<c10::optional<at::Tensor>>& c_add,
                         const c10::List<c10::optional<at::Tensor>>& c_sub, const c10::List<bool>& gc_mask, double lr,
                         double momentum, double weight_decay, bool first_step, c10::string_view vector_policy,
                         int64_t min_fanin) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n, "fused_sgd_step_: grads has ", grads.size(), " tensors, expected ", n);
  const bool mom = momentum != 0.0;
  TORCH_CHECK(!mom || momentum_bufs.size() == n, "fused_sgd_step_: momentum_bufs has ", momentum_bufs.size(),
              " tensors, expected ", n, " (momentum != 0)");
  TORCH_CHECK(c_add.size() == 0 || c_add.size() == n, "fused_sgd_step_: c_add has ", c_add.size(),
              " entries, expected 0 or ", n);
  TORCH_CHECK(c_sub.size() == 0 || c_sub.size() == n, "fused_sgd_step_: c_sub has ", c_sub.size(),
              " entries, expected 0 or ", n);
  TORCH_CHECK(gc_mask.size() == 0 || gc_mask.size() == n, "fused_sgd_step_: gc_mask has ", gc_mask.size(),
              " entries, expected 0 or ", n);
  TORCH_CHECK(vector_policy == "skip" || vector_policy == "center",
              "fused_sgd_step_: vector_policy must be 'skip' or 'center', got '", std::string(vector_policy), "'");
  TORCH_CHECK(min_fanin >= 1, "fused_sgd_step_: min_fanin must be >= 1, got ", min_fanin);
  if (n == 0) return;
  const c10::Device dev = params[0].device();
  std::vector<at::Tensor> P, G, Pgc, Ggc, Pother, Gother, bufs;
  std::vector<size_t> gc_idx, other_idx;
  for (size_t i = 0; i < n; ++i) {
    const auto& p = params[i];
    TORCH_CHECK(p.defined() && p.device() == dev && p.is_contiguous(), "fused_sgd_step_: params[", i,
                "] must be a contiguous tensor on ", dev);
    to_dtype(p.scalar_type(), "fused_sgd_step_", "params");
    check_like(grads[i], p, "grads", i);
    if (mom) check_like(momentum_bufs[i], p, "momentum_bufs", i);
    if (gc_mask.size() && gc_mask.get(i)) {
      gc_idx.push_back(i);
      Pgc.push_back(p);
      Ggc.push_back(grads[i]);
    } else {
      other_idx.push_back(i);
      Pother.push_back(p);
      Gother.push_back(grads[i]);
    }
  }
  std::vector<at::Tensor> ca_d, ca_t, cs_d, cs_t;  // (D entry, c tensor) pairs, filled below
  c10::cuda::CUDAGuard guard(dev);
  // D in parameter order
  std::vector<at::Tensor> D(n);
  if (!Ggc.empty()) {
    static auto gc = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("fedkernels::gc_project", "")
                         .typed<std::vector<at::Tensor>(at::TensorList, c10::string_view, int64_t)>();
    auto Dgc = gc.call(Ggc, vector_policy, min_fanin);
    at::_foreach_add_(Dgc, Pgc, weight_decay);
    for (size_t q = 0; q < gc_idx.size(); ++q) D[gc_idx[q]] = Dgc[q];
  }
  if (!Gother.empty()) {
    auto Do = at::_foreach_add(Gother, Pother, weight_decay);
    for (size_t q = 0; q < other_idx.size(); ++q) D[other_idx[q]] = Do[q];
  }
  for (size_t i = 0; i < n; ++i) {
    if (c_add.size()) {
      c10::optional<at::Tensor> c = c_add.get(i);
      if (c.has_value() && c->defined()) {
        check_like(*c, params[i], "c_add", i);
        ca_d.push_back(D[i]);
        ca_t.push_back(*c);
      }
    }
    if (c_sub.size()) {
      c10::optional<at::Tensor> c = c_sub.get(i);
      if (c.has_value() && c->defined()) {
        check_like(*c, params[i], "c_sub", i);
        cs_d.push_back(D[i]);
        cs_t.push_back(*c);
      }
    }
    P.push_back(params[i]);
    if (mom) bufs.push_back(momentum_bufs[i]);
  }
  if (!ca_d.empty()) at::_foreach_add_(ca_d, ca_t);
  if (!cs_d.empty()) at::_foreach_sub_(cs_d, cs_t);
  if (mom) {
    if (first_step) {
      at::_foreach_copy_(bufs, D);
    } else {
      at::_foreach_mul_(bufs, momentum);
      at::_foreach_add_(bufs, D);
    }
    at::_foreach_add_(P, bufs, -lr);
  } else {
    at::_foreach_add_(P, D, -lr);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CUDA, m) { m.impl("fused_sgd_step_", &fused_sgd_step_cuda); }

}  // namespace fedkernels
