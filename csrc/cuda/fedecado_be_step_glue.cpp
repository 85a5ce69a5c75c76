// Torch glue of fedecado_be_step / fedecado_be_step_out (kernel: fedecado_be_step.cu).
#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "glue.h"

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
void be_check_mat(const at::Tensor& m, const at::Tensor& U, const char* name) {
  TORCH_CHECK(m.dim() == 2 && m.size(0) == U.size(0) && m.size(1) == U.size(1), "fedecado_be_step: ", name,
              " must be [K, d] = ", U.sizes(), ", got ", m.sizes());
  TORCH_CHECK(m.size(1) <= 1 || m.stride(1) == 1, "fedecado_be_step: ", name, " must have unit column stride");
  TORCH_CHECK(m.scalar_type() == U.scalar_type(), "fedecado_be_step: ", name, " must have dtype ", U.scalar_type());
  check_cuda(m, U, "fedecado_be_step", name);
}

void be_check_vec(const at::Tensor& v, const at::Tensor& U, const char* name) {
  TORCH_CHECK(v.dim() == 1 && v.size(0) == U.size(1), "fedecado_be_step: ", name, " must be 1-D of length d = ",
              U.size(1), ", got ", v.sizes());
  TORCH_CHECK(v.scalar_type() == U.scalar_type(), "fedecado_be_step: ", name, " must have dtype ", U.scalar_type());
  check_cuda(v, U, "fedecado_be_step", name);
}

void be_step_out_cuda(const at::Tensor& xc, const at::Tensor& Icur, const at::Tensor& xc0, const at::Tensor& U,
                      const at::Tensor& Ik, const c10::optional<at::Tensor>& S_off, const at::Tensor& theta_new,
                      const at::Tensor& theta_old, const at::Tensor& inv_g, double dt, double L, at::Tensor xc_out,
                      at::Tensor I_out, at::Tensor lte) {
  TORCH_CHECK(U.dim() == 2, "fedecado_be_step: U must be 2-D [K, d], got ", U.dim(), "-D");
  TORCH_CHECK(U.is_cuda(), "fedecado_be_step: U must be a CUDA tensor here, got ", U.device());
  TORCH_CHECK(U.scalar_type() == at::kFloat || U.scalar_type() == at::kDouble,
              "fedecado_be_step: U must be float32 or float64, got ", U.scalar_type());
  TORCH_CHECK(U.size(1) <= 1 || U.stride(1) == 1, "fedecado_be_step: U must have unit column stride");
  const int64_t K = U.size(0), d = U.size(1);
  be_check_mat(Icur, U, "Icur");
  be_check_mat(Ik, U, "Ik");
  be_check_mat(I_out, U, "I_out");
  be_check_vec(xc, U, "xc");
  be_check_vec(xc0, U, "xc0");
  be_check_vec(xc_out, U, "xc_out");
  if (S_off.has_value()) be_check_vec(*S_off, U, "S_off");
  TORCH_CHECK(xc_out.is_contiguous() && I_out.is_contiguous(), "fedecado_be_step: xc_out and I_out must be contiguous");
  TORCH_CHECK(lte.dim() == 1 && lte.size(0) == 2 && lte.scalar_type() == at::kDouble && lte.is_contiguous(),
              "fedecado_be_step: lte must be a contiguous float64 tensor of shape [2]");
  check_cuda(lte, U, "fedecado_be_step", "lte");
  TORCH_CHECK(std::isfinite(dt) && dt > 0, "fedecado_be_step: dt must be finite and > 0, got ", dt);
  TORCH_CHECK(std::isfinite(L) && L > 0, "fedecado_be_step: L must be finite and > 0, got ", L);
  for (const at::Tensor* t : {&theta_new, &theta_old, &inv_g}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == K && t->is_floating_point(),
                "fedecado_be_step: theta_new, theta_old and inv_g must be 1-D float tensors of length K = ", K,
                ", got shape ", t->sizes());
    check_host_or_device(*t, U, "fedecado_be_step", "theta_new/theta_old/inv_g");
  }
  const std::vector<double> thn = small_to_host(theta_new), tho = small_to_host(theta_old), igc = small_to_host(inv_g);
  const double *pn = thn.data(), *po = tho.data(), *pg = igc.data();
  const double c = dt / L;
  std::vector<double> h(std::max<int64_t>(4 * K, 1));
  double s = 0.0;
  for (int64_t i = 0; i < K; ++i) {
    TORCH_CHECK(std::isfinite(pn[i]) && std::isfinite(po[i]), "fedecado_be_step: theta_new[", i, "] and theta_old[", i,
                "] must be finite");
    TORCH_CHECK(std::isfinite(pg[i]) && pg[i] >= 0, "fedecado_be_step: inv_g[", i, "] = ", pg[i],
                " must be finite and >= 0");
    h[i] = pn[i];
    h[K + i] = pn[i] - po[i];
    h[2 * K + i] = pg[i];
    h[3 * K + i] = 1.0 / (1.0 + c * pg[i]);
    s += h[3 * K + i];
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
                                      coef.data_ptr<double>(), K, d, c, dt, 1.0 / (1.0 + dt * c * s), 0.5 * dt,
                                      0.5 * dt / L, xc_out.data_ptr(), I_out.data_ptr(), lte.data_ptr<double>(),
                                      to_dtype(U.scalar_type(), "fedecado_be_step", "U"),
                                      stream()));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> be_step_cuda(const at::Tensor& xc, const at::Tensor& Icur,
                                                            const at::Tensor& xc0, const at::Tensor& U,
                                                            const at::Tensor& Ik, const c10::optional<at::Tensor>& S_off,
                                                            const at::Tensor& theta_new, const at::Tensor& theta_old,
                                                            const at::Tensor& inv_g, double dt, double L) {
  TORCH_CHECK(U.dim() == 2, "fedecado_be_step: U must be 2-D [K, d], got ", U.dim(), "-D");
  c10::cuda::CUDAGuard guard(U.device());
  auto xo = at::empty({U.size(1)}, U.options());
  auto Io = at::empty({U.size(0), U.size(1)}, U.options());
  auto lte = at::empty({2}, U.options().dtype(at::kDouble));
  be_step_out_cuda(xc, Icur, xc0, U, Ik, S_off, theta_new, theta_old, inv_g, dt, L, xo, Io, lte);
  return {xo, Io, lte};
}
}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CUDA, m) {
  m.impl("fedecado_be_step", &be_step_cuda);
  m.impl("fedecado_be_step_out", &be_step_out_cuda);
}

}  // namespace fedkernels
