// Torch glue of fedecado_be_step / fedecado_be_step_out (kernel: fedecado_be_step.cu).
#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "glue.h"
#include "fedecado_be_step.cuh"
#include "../fedecado_be_step_checks.h"

namespace fedkernels {
namespace {

using namespace glue;

// ---- fedecado_be_step ------------------------------------------------------------------------------
// Schemas: fedecado_be_step(xc, Icur, xc0, U, Ik, S_off?, theta_new, theta_old, inv_g, float dt,
//   float L) -> (x' [d], I' [K, d], lte f64 [2]) and fedecado_be_step_out(..., xc_out, I_out, lte).
// Same rules as csrc/cpu/fedecado_be_step.cpp: fp32/fp64 tensors on one CUDA device; theta_new,
// theta_old, inv_g: float tensors of length K, host (CPU) ones validated here without a sync
// (device ones cost a device-to-host copy); the coefficient table goes to the device as kernel
// arguments (glue.h upload_bytes). lte stays on the device.
void be_step_out_cuda(const at::Tensor& xc, const at::Tensor& Icur, const at::Tensor& xc0, const at::Tensor& U,
                      const at::Tensor& Ik, const c10::optional<at::Tensor>& S_off, const at::Tensor& theta_new,
                      const at::Tensor& theta_old, const at::Tensor& inv_g, double dt, double L, at::Tensor xc_out,
                      at::Tensor I_out, at::Tensor lte) {
  checks::be_step_args(xc, Icur, xc0, U, Ik, S_off, xc_out, I_out, lte, U.device());
  TORCH_CHECK(U.is_cuda(), "fedecado_be_step: U must be a CUDA tensor here, got ", U.device());
  const int64_t K = U.size(0), d = U.size(1);
  for (const at::Tensor* t : {&theta_new, &theta_old, &inv_g})
    checks::host_or_on(*t, U.device(), "fedecado_be_step", "theta_new/theta_old/inv_g", "U");
  const checks::BeCoefs cf = checks::be_step_coefs(theta_new, theta_old, inv_g, K, dt, L);
  std::vector<double> h(std::max<int64_t>(4 * K, 1));  // the table of the fedecado_be_step launcher (fedecado_be_step.cuh)
  for (int64_t i = 0; i < K; ++i) {
    h[i] = cf.thn[i];
    h[K + i] = cf.dth[i];
    h[2 * K + i] = cf.ig[i];
    h[3 * K + i] = cf.inv_a[i];
  }
  c10::cuda::CUDAGuard guard(U.device());
  // kernel-argument upload: capture-safe, no per-call staging buffer
  auto coef = upload_bytes(h.data(), h.size() * sizeof(double), U.device()).view(at::kDouble);
  auto xcc = xc.contiguous(), xc0c = xc0.contiguous();
  at::Tensor Sc;
  if (S_off.has_value()) Sc = S_off->contiguous();
  const int64_t ld_i = K > 1 ? Icur.stride(0) : d, ld_u = K > 1 ? U.stride(0) : d, ld_k = K > 1 ? Ik.stride(0) : d;
  C10_CUDA_CHECK(fk::fedecado_be_step(xcc.data_ptr(), Icur.data_ptr(), ld_i, xc0c.data_ptr(), U.data_ptr(), ld_u,
                                      Ik.data_ptr(), ld_k, Sc.defined() ? Sc.data_ptr() : nullptr,
                                      coef.data_ptr<double>(), K, d, cf.c, dt, cf.inv_den, 0.5 * dt,
                                      0.5 * dt / L, xc_out.data_ptr(), I_out.data_ptr(), lte.data_ptr<double>(),
                                      to_dtype(U.scalar_type(), "fedecado_be_step", "U"),
                                      stream()));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> be_step_cuda(const at::Tensor& xc, const at::Tensor& Icur,
                                                            const at::Tensor& xc0, const at::Tensor& U,
                                                            const at::Tensor& Ik, const c10::optional<at::Tensor>& S_off,
                                                            const at::Tensor& theta_new, const at::Tensor& theta_old,
                                                            const at::Tensor& inv_g, double dt, double L) {
  c10::cuda::CUDAGuard guard(U.device());
  auto outs = checks::be_step_outputs(U);
  be_step_out_cuda(xc, Icur, xc0, U, Ik, S_off, theta_new, theta_old, inv_g, dt, L, std::get<0>(outs),
                   std::get<1>(outs), std::get<2>(outs));
  return outs;
}
}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CUDA, m) {
  m.impl("fedecado_be_step", &be_step_cuda);
  m.impl("fedecado_be_step_out", &be_step_out_cuda);
}

}  // namespace fedkernels
