// Argument rules of fedecado_be_step, written once for its CPU kernel (csrc/cpu/fedecado_be_step.cpp) and its
// CUDA glue (csrc/cuda/fedecado_be_step_glue.cpp): cheap last-line checks (the Python wrapper validates first),
// and the per-client coefficients both backends use.
#pragma once

#include "checks.h"

namespace fedkernels {
namespace checks {

// xc, xc0, S_off, xc_out: 1-D of length d; Icur, Ik, I_out: [K, d] with unit column stride; all of U's
// dtype (float32 / float64) and on dev; xc_out and I_out contiguous; lte: contiguous float64 [2] on dev.
inline void be_step_args(const at::Tensor& xc, const at::Tensor& Icur, const at::Tensor& xc0, const at::Tensor& U,
                         const at::Tensor& Ik, const c10::optional<at::Tensor>& S_off, const at::Tensor& xc_out,
                         const at::Tensor& I_out, const at::Tensor& lte, c10::Device dev) {
  const char* op = "fedecado_be_step";
  check_rowmajor(U, op, "U");
  const auto st = U.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kDouble, "fedecado_be_step: U must be float32 or float64, got ", st);
  on_device(U, dev, op, "U");
  const int64_t K = U.size(0), d = U.size(1);
  auto mat = [&](const at::Tensor& m, const char* name) {
    check_rowmajor(m, op, name);
    TORCH_CHECK(m.size(0) == K && m.size(1) == d, "fedecado_be_step: ", name, " must be [K, d] = [", K, ", ", d,
                "], got ", m.sizes());
    TORCH_CHECK(m.scalar_type() == st, "fedecado_be_step: ", name, " must have dtype ", st, ", got ", m.scalar_type());
    on_device(m, dev, op, name);
  };
  auto vec = [&](const at::Tensor& v, const char* name) {
    TORCH_CHECK(v.dim() == 1 && v.size(0) == d, "fedecado_be_step: ", name, " must be 1-D of length d = ", d,
                ", got shape ", v.sizes());
    TORCH_CHECK(v.scalar_type() == st, "fedecado_be_step: ", name, " must have dtype ", st, " (the dtype of U), got ",
                v.scalar_type());
    on_device(v, dev, op, name);
  };
  mat(Icur, "Icur");
  mat(Ik, "Ik");
  vec(xc, "xc");
  vec(xc0, "xc0");
  if (S_off.has_value()) vec(*S_off, "S_off");
  vec(xc_out, "xc_out");
  mat(I_out, "I_out");
  TORCH_CHECK(xc_out.is_contiguous() && I_out.is_contiguous(), "fedecado_be_step: xc_out and I_out must be contiguous");
  TORCH_CHECK(lte.dim() == 1 && lte.size(0) == 2 && lte.scalar_type() == at::kDouble && lte.is_contiguous(),
              "fedecado_be_step: lte must be a contiguous float64 tensor of shape [2], got ", lte.sizes(), " ",
              lte.scalar_type());
  on_device(lte, dev, op, "lte");
}

// The outputs of the functional fedecado_be_step (its _out variant fills them): x' [d], I' [K, d], lte f64 [2].
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> be_step_outputs(const at::Tensor& U) {
  TORCH_CHECK(U.dim() == 2, "fedecado_be_step: U must be 2-D [K, d], got ", U.dim(), "-D");
  return {at::empty({U.size(1)}, U.options()), at::empty({U.size(0), U.size(1)}, U.options()),
          at::empty({2}, U.options().dtype(at::kDouble))};
}

// Per-client coefficients (c = dt / L, a_i = 1 + c inv_g_i, inv_den = 1 / (1 + dt c sum_i 1 / a_i),
// the sum in client order), from host or device tensors of length K; dt, L finite and > 0,
// theta finite, inv_g finite and >= 0.
struct BeCoefs {
  std::vector<double> thn, dth, ig, inv_a;
  double c = 0, dt = 0, inv_den = 1;
};
inline BeCoefs be_step_coefs(const at::Tensor& thn, const at::Tensor& tho, const at::Tensor& inv_g, int64_t K,
                             double dt, double L) {
  TORCH_CHECK(std::isfinite(dt) && dt > 0, "fedecado_be_step: dt must be finite and > 0, got ", dt);
  TORCH_CHECK(std::isfinite(L) && L > 0, "fedecado_be_step: L must be finite and > 0, got ", L);
  for (const at::Tensor* p : {&thn, &tho, &inv_g})
    TORCH_CHECK(p->dim() == 1 && p->size(0) == K && p->is_floating_point(),
                "fedecado_be_step: theta_new, theta_old and inv_g must be 1-D float tensors of length K = ", K,
                ", got shape ", p->sizes());
  BeCoefs cf;
  cf.thn = host_doubles(thn);
  const std::vector<double> to = host_doubles(tho);
  cf.ig = host_doubles(inv_g);
  cf.c = dt / L;
  cf.dt = dt;
  cf.dth.resize(K);
  cf.inv_a.resize(K);
  double s = 0.0;
  for (int64_t i = 0; i < K; ++i) {
    TORCH_CHECK(std::isfinite(cf.thn[i]) && std::isfinite(to[i]), "fedecado_be_step: theta_new[", i, "] = ", cf.thn[i],
                " and theta_old[", i, "] = ", to[i], " must be finite");
    TORCH_CHECK(std::isfinite(cf.ig[i]) && cf.ig[i] >= 0, "fedecado_be_step: inv_g[", i, "] = ", cf.ig[i],
                " must be finite and >= 0");
    cf.dth[i] = cf.thn[i] - to[i];
    cf.inv_a[i] = 1.0 / (1.0 + cf.c * cf.ig[i]);
    s += cf.inv_a[i];
  }
  cf.inv_den = 1.0 / (1.0 + dt * cf.c * s);
  return cf;
}

}  // namespace checks
}  // namespace fedkernels
