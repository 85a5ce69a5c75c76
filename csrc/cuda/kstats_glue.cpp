// Torch glue of kstats (kernel: kstats.cu). Schema: kstats(Tensor U, Tensor p) -> (dot [K] f64, nsq [K]
// f64, nbar [] f64, ok [K] bool). p may be a host tensor (the Python wrapper passes it so) or on U's device.
#include <tuple>

#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>

#include "glue.h"
#include "kstats.cuh"
#include "../kstats_checks.h"

namespace fedkernels {
namespace {

using namespace glue;

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> kstats_cuda(const at::Tensor& U, const at::Tensor& p) {
  checks::kstats_args(U, p, U.device());
  checks::rows_apart(U, "kstats");
  c10::cuda::CUDAGuard guard(U.device());
  const int64_t K = U.size(0), d = U.size(1);
  const auto f64 = U.options().dtype(at::kDouble);
  auto dot = at::zeros({K}, f64), nsq = at::zeros({K}, f64), nbar = at::zeros({}, f64);
  auto ok = at::ones({K}, U.options().dtype(at::kBool));
  if (K == 0 || d == 0) return {dot, nsq, nbar, ok};
  const auto dt = to_dtype(U.scalar_type(), "kstats", "U");
  auto pd = small_to_device(p, at::kDouble, U.device());
  auto ws = at::empty({(int64_t)fk::kstats_workspace_bytes(K, d, dt)}, U.options().dtype(at::kByte));
  C10_CUDA_CHECK(fk::kstats(U.data_ptr(), dt, K, d, row_stride(U), pd.data_ptr<double>(), dot.data_ptr<double>(),
                            nsq.data_ptr<double>(), nbar.data_ptr<double>(), ok.data_ptr<bool>(), ws.data_ptr(),
                            stream()));
  return {dot, nsq, nbar, ok};
}

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CUDA, m) { m.impl("kstats", &kstats_cuda); }

}  // namespace fedkernels
