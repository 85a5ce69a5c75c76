// Torch glue of server_opt_step_ (kernel: server_opt_step.cu; schema and CPU kernel:
// csrc/cpu/server_opt_step.cpp). The step's scalars travel as kernel arguments (no host sync, no upload).
#include "glue.h"
#include "server_opt_step.cuh"
#include "../server_opt_step_checks.h"

namespace fedkernels {
namespace {

using namespace glue;

void server_opt_step_cuda(at::Tensor& io, at::Tensor& m, at::Tensor& v, const at::Tensor& x, c10::string_view rule,
                          double lr, double beta_1, double beta_2, double tau, bool from_model) {
  const int r = checks::server_opt_rule(rule);
  checks::server_opt_args(io, m, v, x);
  TORCH_CHECK(x.is_cuda(), "server_opt_step_: x must be a CUDA tensor here, got ", x.device());
  c10::cuda::CUDAGuard guard(io.device());
  if (io.numel() == 0) return;
  const double coef[6] = {beta_1, 1.0 - beta_1, beta_2, 1.0 - beta_2, lr, tau};
  C10_CUDA_CHECK(fk::server_opt_step(io.data_ptr(), m.data_ptr(), v.data_ptr(), x.data_ptr(),
                                     to_dtype(io.scalar_type(), "server_opt_step_", "io"),
                                     m.scalar_type() == at::kDouble, io.numel(), r, from_model, coef, stream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CUDA, m) { m.impl("server_opt_step_", &server_opt_step_cuda); }

}  // namespace fedkernels
