// Torch glue of min_norm (kernel: min_norm.cu). lam0 may be a host tensor or on G's device.
#include <string>
#include <tuple>

#include <ATen/ops/outer.h>

#include "glue.h"
#include "min_norm.cuh"
#include "../min_norm_checks.h"

namespace fedkernels {
namespace {

using namespace glue;

// Schema (csrc/cpu/min_norm.cpp): min_norm(Tensor G, int max_iter, float tol_rel, float tol_abs,
// str method, str init, bool polish, Tensor? lam0, Tensor? scale) -> (lam [K] f64, iterations i64 [], gap f64 [])
// scale (host or G's device): the kernel gets s_i s_j (G + G^T)/2, made here by ATen ops on the device
// (exactly symmetric: s_i s_j = s_j s_i, so the kernel's own (G + G^T)/2 leaves it unchanged); the same bits
// as the CPU solver's scaled symmetrising pass.
// On CUDA: methods fw, away, pairwise; polish=True is rejected for away/pairwise (the face polish
// is host-only) and code_compat is host-only. Outputs stay on the device (no sync); G finiteness
// and lam0 validity are not checked here (that would need a sync): ops.min_norm solves on the host,
// where the CPU solve checks G and the wrapper lam0.
std::tuple<at::Tensor, at::Tensor, at::Tensor> min_norm_cuda(const at::Tensor& G, int64_t max_iter, double tol_rel,
                                                             double tol_abs, c10::string_view method,
                                                             c10::string_view init, bool polish,
                                                             const c10::optional<at::Tensor>& lam0,
                                                             const c10::optional<at::Tensor>& scale) {
  const int64_t N = checks::min_norm_args(G, max_iter, tol_rel, tol_abs, init, lam0, scale);
  TORCH_CHECK(N <= fk::kMinNormMaxN, "min_norm: the CUDA solver supports K <= ", fk::kMinNormMaxN, ", got ", N);
  int meth = -1;
  if (method == "fw") meth = 0;
  else if (method == "away") meth = 1;
  else if (method == "pairwise") meth = 2;
  TORCH_CHECK(meth >= 0, "min_norm: method on CUDA must be one of 'away', 'pairwise', 'fw' (code_compat runs on the "
              "CPU), got '", std::string(method), "'");
  TORCH_CHECK(!polish || meth == 0, "min_norm: polish=True is implemented on the CPU only; on CUDA pass polish=False");
  c10::cuda::CUDAGuard guard(G.device());
  auto g = G.to(at::kDouble).contiguous();
  if (scale.has_value()) {
    auto s = small_to_device(*scale, at::kDouble, G.device());
    g = g.add(g.t()).mul_(0.5).mul_(at::outer(s, s)).contiguous();
  }
  at::Tensor l0;
  if (lam0.has_value()) {
    l0 = small_to_device(*lam0, at::kDouble, G.device());
  }
  auto opts = G.options().dtype(at::kDouble);
  auto lam = at::empty({N}, opts);
  auto iters = at::empty({}, opts.dtype(at::kLong));
  auto gap = at::empty({}, opts);
  auto ws = at::empty({(int64_t)fk::min_norm_workspace_bytes(N)}, opts.dtype(at::kByte));
  C10_CUDA_CHECK(fk::min_norm(g.data_ptr<double>(), N, l0.defined() ? l0.data_ptr<double>() : nullptr, meth,
                              init == "min_diag" ? 1 : 0, max_iter, tol_rel, tol_abs, lam.data_ptr<double>(),
                              iters.data_ptr<int64_t>(), gap.data_ptr<double>(), ws.data_ptr(),
                              stream()));
  return {lam, iters, gap};
}
}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CUDA, m) { m.impl("min_norm", &min_norm_cuda); }

}  // namespace fedkernels
