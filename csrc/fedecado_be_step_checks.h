// Argument rules of fedecado_be_step, written once for its CPU kernel (csrc/cpu/fedecado_be_step.cpp) and its
// CUDA glue (csrc/cuda/fedecado_be_step_glue.cpp): the one check of the tensors' shapes, dtypes, devices and
// layouts (the Python wrapper checks types and values first), and the per-client coefficients both backends use.
#pragma once

#include <string>
#include <utility>

#include "checks.h"

namespace fedkernels {
namespace checks {

// The device as Python prints it ("cpu", "cuda:0").
inline std::string be_device(c10::Device d) { return d.str(); }

// U: [K, d] float32/float64 with unit column stride, on dev; Icur, Ik, I_out: [K, d] of U's dtype and
// device with unit column stride; xc, xc0, S_off: [d] of U's dtype and device; lte: contiguous float64 [2]
// on U's device; xc_out, I_out contiguous. One-line ValueErrors worded as the Python wrapper
// (fedkernels/ops/fedecado_be_step.py) words its other errors (lte is its lte_out), in its order.
inline void be_step_args(const at::Tensor& xc, const at::Tensor& Icur, const at::Tensor& xc0, const at::Tensor& U,
                         const at::Tensor& Ik, const c10::optional<at::Tensor>& S_off, const at::Tensor& xc_out,
                         const at::Tensor& I_out, const at::Tensor& lte, c10::Device dev) {
  const char* op = "fedecado_be_step";
  TORCH_CHECK_VALUE(U.dim() == 2, op, ": U must be a 2-D [K, d] tensor, got shape ", py_shape(U.sizes()));
  float_dtype(U, op, "U");
  const auto st = U.scalar_type();
  TORCH_CHECK_VALUE(st == at::kFloat || st == at::kDouble, op, ": U must be float32 or float64, got ", py_dtype(st));
  on_device(U, dev, op, "U", "U");
  TORCH_CHECK_VALUE(U.size(1) <= 1 || U.stride(1) == 1, op, ": U must have unit column stride, got strides ",
                    py_shape(U.strides()), " (the fedkernels.ops wrapper copies it once)");
  const int64_t K = U.size(0), d = U.size(1);
  auto mat = [&](const at::Tensor& m, const char* name) {
    TORCH_CHECK_VALUE(m.dim() == 2, op, ": ", name, " must be a 2-D [K, d] tensor, got shape ", py_shape(m.sizes()));
    float_dtype(m, op, name);
    TORCH_CHECK_VALUE(m.size(0) == K && m.size(1) == d, op, ": ", name, " must have shape [K, d] = [", K, ", ", d,
                      "] (the shape of U), got ", py_shape(m.sizes()));
    TORCH_CHECK_VALUE(m.scalar_type() == st && m.device() == U.device(), op, ": ", name, " must have U's dtype ",
                      py_dtype(st), " and device ", be_device(U.device()), ", got ", py_dtype(m.scalar_type()), " on ",
                      be_device(m.device()));
    TORCH_CHECK_VALUE(d <= 1 || m.stride(1) == 1, op, ": ", name, " must have unit column stride, got strides ",
                      py_shape(m.strides()), " (the fedkernels.ops wrapper copies it once)");
  };
  mat(Icur, "Icur");
  mat(Ik, "Ik");
  vector_like(xc, d, U, dev, op, "xc");
  vector_like(xc0, d, U, dev, op, "xc0");
  if (S_off.has_value()) vector_like(*S_off, d, U, dev, op, "S_off");
  TORCH_CHECK_VALUE(lte.dim() == 1 && lte.size(0) == 2 && lte.scalar_type() == at::kDouble && lte.device() == dev &&
                        lte.is_contiguous(),
                    op, ": lte_out must be a contiguous float64 tensor of shape [2] on ", be_device(dev));
  auto out = [&](const at::Tensor& t, const char* name, at::IntArrayRef shape, const char* want) {
    TORCH_CHECK_VALUE(t.sizes() == shape && t.scalar_type() == st && t.device() == dev && t.is_contiguous(), op, ": ",
                      name, " must be a contiguous ", py_dtype(st), " tensor of shape ", want, " on ", be_device(dev),
                      ", got ", py_shape(t.sizes()), " ", py_dtype(t.scalar_type()), " on ", be_device(t.device()));
  };
  const std::string wd = "[" + std::to_string(d) + "]", wkd = "[" + std::to_string(K) + ", " + std::to_string(d) + "]";
  out(xc_out, "xc_out", {d}, wd.c_str());
  out(I_out, "I_out", {K, d}, wkd.c_str());
}

// The outputs of the functional fedecado_be_step (its _out variant fills them): x' [d], I' [K, d], lte f64 [2].
// (U's rank, with be_step_args' message: the only rule read before it.)
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> be_step_outputs(const at::Tensor& U) {
  TORCH_CHECK_VALUE(U.dim() == 2, "fedecado_be_step: U must be a 2-D [K, d] tensor, got shape ", py_shape(U.sizes()));
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
  for (const auto& tn : {std::make_pair(&thn, "theta_new"), std::make_pair(&tho, "theta_old"),
                         std::make_pair(&inv_g, "inv_g")}) {
    const at::Tensor& t = *tn.first;
    TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == K, "fedecado_be_step: ", tn.second,
                      " must be a 1-D sequence of length K = ", K, " (one per client), got shape ", py_shape(t.sizes()));
    TORCH_CHECK_VALUE(t.is_floating_point(), "fedecado_be_step: ", tn.second, " must be a float tensor, got ",
                      py_dtype(t.scalar_type()));
  }
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
