// Argument rules of lu_factor, lu_solve and arrowhead_solve, written once for their CPU kernels
// (csrc/cpu/lu.cpp) and CUDA glue (csrc/cuda/lu_glue.cpp): cheap last-line checks (the Python
// wrapper validates first), and the host-side arrowhead coefficients both backends solve with.
#pragma once

#include "checks.h"
#include "lu_limits.h"

namespace fedkernels {
namespace checks {

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

}  // namespace checks
}  // namespace fedkernels
