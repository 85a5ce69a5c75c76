// Torch glue of fused_sgd_step_ on CUDA: the CPU op's maths (csrc/cpu/fused_sgd_step.cpp) as a
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
#include "../fused_sgd_step_checks.h"

namespace fedkernels {
namespace {

using namespace glue;

void fused_sgd_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList momentum_bufs,
                         const c10::List<c10::optional<at::Tensor>>& c_add,
                         const c10::List<c10::optional<at::Tensor>>& c_sub, const c10::List<bool>& gc_mask, double lr,
                         double momentum, double weight_decay, bool first_step, c10::string_view vector_policy,
                         int64_t min_fanin) {
  const c10::Device dev = params.empty() ? c10::Device(at::kCPU) : params[0].device();
  checks::fused_step_args(params, grads, momentum_bufs, c_add, c_sub, gc_mask, momentum, vector_policy, min_fanin, dev);
  const size_t n = params.size();
  const bool mom = momentum != 0.0;
  if (n == 0) return;
  TORCH_CHECK(dev.is_cuda(), "fused_sgd_step_: params[0] must be on a CUDA device here, got ", dev);
  std::vector<at::Tensor> P, G, Pgc, Ggc, Pother, Gother, bufs;
  std::vector<size_t> gc_idx, other_idx;
  for (size_t i = 0; i < n; ++i) {
    const auto& p = params[i];
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
    if (auto c = checks::fused_control(c_add, i)) {
      ca_d.push_back(D[i]);
      ca_t.push_back(*c);
    }
    if (auto c = checks::fused_control(c_sub, i)) {
      cs_d.push_back(D[i]);
      cs_t.push_back(*c);
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
