// Argument rules shared by the CPU kernels (csrc/cpu/*.cpp) and the CUDA glue (csrc/cuda/*_glue.cpp),
// each written once: the cheap last-line TORCH_CHECKs on shapes, dtypes and devices (the Python
// wrappers in fedkernels.ops validate values first and name the argument), and the host-side
// reading of small arguments that both backends interpret the same way (the arrowhead and
// FedECADO coefficient tables, gc_project's row view). Torch-side only (ATen / c10 headers): the
// plain CUDA files csrc/cuda/*.cu never include it.
//
// Device rule: every function that checks devices takes the device the op runs on (`dev`): at::kCPU
// in the CPU kernels, the first tensor argument's device in the CUDA glue. Small host-side vectors
// (coefficients, rows) are checked by the caller (CPU: on the CPU; CUDA: host or the op's device).
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/string_view.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace fedkernels {

// A 2-D matrix accepted by the streaming kernels: unit stride along columns, any row stride.
inline void check_rowmajor(const at::Tensor& U, const char* op, const char* name) {
  TORCH_CHECK(U.dim() == 2, op, ": ", name, " must be 2-D [K, d], got ", U.dim(), "-D");
  TORCH_CHECK(U.size(1) <= 1 || U.stride(1) == 1, op, ": ", name,
              " must have unit column stride (the Python wrapper makes it so)");
}

namespace checks {

inline void on_device(const at::Tensor& t, c10::Device dev, const char* op, const char* name) {
  TORCH_CHECK(t.device() == dev, op, ": ", name, " must be on ", dev, ", got ", t.device());
}

inline bool is_float4(at::ScalarType st) {
  return st == at::kFloat || st == at::kDouble || st == at::kHalf || st == at::kBFloat16;
}

// A small 1-D float tensor (on the host or a device) read as float64 on the host (exact widening).
inline std::vector<double> host_doubles(const at::Tensor& t) {
  auto h = t.to(at::kCPU, at::kDouble).contiguous();
  const double* p = h.data_ptr<double>();
  return std::vector<double>(p, p + h.numel());
}

// ---- weighted_sum ---------------------------------------------------------------------------------
// coef: 1-D float of length n (one per selected row); out (and base): contiguous 1-D of length d, U's dtype.
inline void weighted_sum_args(const at::Tensor& U, const at::Tensor& coef, int64_t n,
                              const c10::optional<at::Tensor>& base, const at::Tensor& out, c10::Device dev) {
  check_rowmajor(U, "weighted_sum", "U");
  on_device(U, dev, "weighted_sum", "U");
  const int64_t d = U.size(1);
  TORCH_CHECK(coef.dim() == 1 && coef.numel() == n, "weighted_sum: coef must be 1-D of length ", n,
              " (one per selected row), got shape ", coef.sizes());
  TORCH_CHECK(coef.is_floating_point(), "weighted_sum: coef must be a float tensor, got ", coef.scalar_type());
  TORCH_CHECK(out.dim() == 1 && out.size(0) == d && out.is_contiguous() && out.scalar_type() == U.scalar_type(),
              "weighted_sum: out must be a contiguous 1-D tensor of length ", d, " and dtype ", U.scalar_type());
  on_device(out, dev, "weighted_sum", "out");
  if (base.has_value()) {
    TORCH_CHECK(base->dim() == 1 && base->size(0) == d && base->is_contiguous() && base->scalar_type() == U.scalar_type(),
                "weighted_sum: base must be a contiguous 1-D tensor of length ", d, " and dtype ", U.scalar_type());
    on_device(*base, dev, "weighted_sum", "base");
  }
}

// The output of the functional weighted_sum (its _out variant fills it): [d] of U's dtype and device.
inline at::Tensor weighted_sum_output(const at::Tensor& U) {
  TORCH_CHECK(U.dim() == 2, "weighted_sum: U must be 2-D [K, d], got ", U.dim(), "-D");
  return at::empty({U.size(1)}, U.options());
}

// ---- min_norm -------------------------------------------------------------------------------------
// Returns K. method is checked by each backend (the CUDA solver has no code_compat / polish).
inline int64_t min_norm_args(const at::Tensor& G, int64_t max_iter, double tol_rel, double tol_abs,
                             c10::string_view init, const c10::optional<at::Tensor>& lam0) {
  TORCH_CHECK(G.dim() == 2 && G.size(0) == G.size(1), "min_norm: G must be a square [K, K] matrix, got shape ",
              G.sizes());
  TORCH_CHECK(at::isFloatingType(G.scalar_type()), "min_norm: G must have a floating dtype, got ", G.scalar_type());
  const int64_t K = G.size(0);
  TORCH_CHECK(K >= 1, "min_norm: G must be at least 1 x 1");
  TORCH_CHECK(max_iter >= 0, "min_norm: max_iter must be >= 0, got ", max_iter);
  TORCH_CHECK(tol_rel >= 0.0 && tol_abs >= 0.0, "min_norm: tolerances must be >= 0");
  TORCH_CHECK(init == "best_pair" || init == "min_diag", "min_norm: init must be 'best_pair' or 'min_diag', got '",
              std::string(init), "'");
  if (lam0.has_value())
    TORCH_CHECK(lam0->dim() == 1 && lam0->size(0) == K, "min_norm: lam0 must be a 1-D tensor of length ", K,
                ", got shape ", lam0->sizes());
  return K;
}

// ---- lu_factor / lu_solve / arrowhead_solve ---------------------------------------------------------
constexpr int64_t kLuMaxN = 64;  // small dense systems (FedECADO's K + 1); csrc/cuda/lu.cuh lu::kMaxN

// Returns n.
inline int64_t lu_factor_args(const at::Tensor& A) {
  TORCH_CHECK(A.dim() == 2 || A.dim() == 3, "lu_factor: A must be [n, n] or [B, n, n], got shape ", A.sizes());
  const int64_t n = A.size(-1);
  TORCH_CHECK(A.size(-2) == n, "lu_factor: A must be square, got shape ", A.sizes());
  TORCH_CHECK(n >= 1 && n <= kLuMaxN, "lu_factor: n must be in [1, ", kLuMaxN, "] (small systems), got ", n);
  TORCH_CHECK(A.scalar_type() == at::kFloat || A.scalar_type() == at::kDouble,
              "lu_factor: A must be float32 or float64, got ", A.scalar_type());
  return n;
}

struct LuSolveShape {
  bool batched;
  int64_t B, n, m;
};
inline LuSolveShape lu_solve_args(const at::Tensor& LU, const at::Tensor& piv, const at::Tensor& R) {
  TORCH_CHECK(LU.dim() == 2 || LU.dim() == 3, "lu_solve: LU must be [n, n] or [B, n, n], got ", LU.sizes());
  LuSolveShape s;
  s.batched = LU.dim() == 3;
  s.n = LU.size(-1);
  s.B = s.batched ? LU.size(0) : 1;
  TORCH_CHECK(LU.size(-2) == s.n, "lu_solve: LU must be square, got ", LU.sizes());
  TORCH_CHECK(LU.is_floating_point(), "lu_solve: LU must have a floating dtype, got ", LU.scalar_type());
  TORCH_CHECK(R.dim() == LU.dim() && R.size(-2) == s.n && (!s.batched || R.size(0) == s.B),
              "lu_solve: R must be [n, m] (or [B, n, m] for batched LU) with n = ", s.n, ", got ", R.sizes());
  TORCH_CHECK(piv.dim() == LU.dim() - 1 && piv.size(-1) == s.n && (!s.batched || piv.size(0) == s.B),
              "lu_solve: pivots must be [n] (or [B, n]), got ", piv.sizes());
  TORCH_CHECK(!piv.is_floating_point() && piv.scalar_type() != at::kBool && !piv.is_complex(),
              "lu_solve: pivots must hold integers, got ", piv.scalar_type());
  TORCH_CHECK(R.scalar_type() == at::kFloat || R.scalar_type() == at::kDouble,
              "lu_solve: R must be float32 or float64, got ", R.scalar_type());
  TORCH_CHECK(R.size(-1) <= 1 || R.stride(-1) == 1, "lu_solve: R must have unit column stride");
  s.m = R.size(-1);
  return s;
}

inline void lu_solve_out_args(const at::Tensor& out, const at::Tensor& R) {
  TORCH_CHECK(out.sizes() == R.sizes() && out.scalar_type() == R.scalar_type() && out.is_contiguous(),
              "lu_solve_out: out must be a contiguous tensor of R's shape and dtype");
}

// [[alpha, b^T], [c, diag(a)]]: the per-row coefficients b_i / a_i, c_i, 1 / a_i and the Schur
// complement den = alpha - sum_i b_i c_i / a_i (rows in index order), a_i finite and nonzero, den
// finite and nonzero. Both backends solve with exactly these numbers.
struct Arrowhead {
  std::vector<double> ba, c, inv_a;
  double den;
};
inline Arrowhead arrowhead_args(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, double alpha,
                                const at::Tensor& r0, const at::Tensor& R) {
  TORCH_CHECK(R.dim() == 2, "arrowhead_solve: R must be [K, m], got ", R.sizes());
  const int64_t K = R.size(0), m = R.size(1);
  TORCH_CHECK(a.dim() == 1 && a.size(0) == K && b.dim() == 1 && b.size(0) == K && c.dim() == 1 && c.size(0) == K,
              "arrowhead_solve: a, b, c must be 1-D of length K = ", K);
  TORCH_CHECK(r0.dim() == 1 && r0.size(0) == m, "arrowhead_solve: r0 must be [m] with m = ", m, ", got ", r0.sizes());
  TORCH_CHECK(r0.scalar_type() == R.scalar_type(), "arrowhead_solve: r0 and R must have the same dtype");
  TORCH_CHECK(R.scalar_type() == at::kFloat || R.scalar_type() == at::kDouble,
              "arrowhead_solve: R must be float32 or float64, got ", R.scalar_type());
  TORCH_CHECK(m <= 1 || R.stride(1) == 1, "arrowhead_solve: R must have unit column stride");
  const std::vector<double> av = host_doubles(a), bv = host_doubles(b);
  Arrowhead h{std::vector<double>(K), host_doubles(c), std::vector<double>(K), alpha};
  for (int64_t i = 0; i < K; ++i) {
    TORCH_CHECK(av[i] != 0.0 && std::isfinite(av[i]), "arrowhead_solve: a[", i, "] = ", av[i],
                " must be finite and nonzero");
    h.inv_a[i] = 1.0 / av[i];
    h.ba[i] = bv[i] / av[i];
    h.den -= bv[i] * h.c[i] / av[i];
  }
  TORCH_CHECK(h.den != 0.0 && std::isfinite(h.den), "arrowhead_solve: singular system (Schur complement ", h.den, ")");
  return h;
}

// ---- fedecado_be_step -------------------------------------------------------------------------------
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

// ---- gc_project -------------------------------------------------------------------------------------
// Returns center (vector_policy == "center"). Every tensor defined, float16/bfloat16/float32/float64, on dev.
inline bool gc_args(at::TensorList tensors, c10::string_view policy, int64_t min_fanin, c10::Device dev) {
  TORCH_CHECK(policy == "skip" || policy == "center", "gc_project: vector_policy must be 'skip' or 'center', got '",
              std::string(policy), "'");
  TORCH_CHECK(min_fanin >= 1, "gc_project: min_fanin must be >= 1, got ", min_fanin);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    TORCH_CHECK(t.defined(), "gc_project: tensors[", i, "] is undefined");
    TORCH_CHECK(t.device() == dev, "gc_project: tensors[", i, "] is on ", t.device(), ", expected ", dev);
    TORCH_CHECK(is_float4(t.scalar_type()), "gc_project: tensors[", i,
                "] must be float16, bfloat16, float32 or float64, got ", t.scalar_type());
  }
  return policy == "center";
}

// gc_project's row view: dim >= 2 -> rows = size(0), M = numel / rows; 1-D -> one row with
// "center", unchanged with "skip"; 0-D, empty and M < min_fanin unchanged (returns false).
inline bool gc_row_shape(const at::Tensor& t, bool center, int64_t min_fanin, int64_t& rows, int64_t& M) {
  if (t.dim() == 0 || t.numel() == 0) return false;
  if (t.dim() == 1) {
    if (!center) return false;
    rows = 1;
    M = t.numel();
  } else {
    rows = t.size(0);
    M = t.numel() / rows;
  }
  return M >= min_fanin;
}

// True when row r of t is the dense span [data + r*M, data + (r+1)*M).
inline bool gc_rows_dense(const at::Tensor& t, int64_t rows, int64_t M) {
  if (t.is_contiguous()) return true;
  if (!t.is_non_overlapping_and_dense()) return false;
  return rows == 1 || t.stride(0) == M;
}

// ---- fused_sgd_step_ --------------------------------------------------------------------------------
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
