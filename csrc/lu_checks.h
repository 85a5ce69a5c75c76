// Argument rules of lu_factor, lu_solve and arrowhead_solve, written once for their CPU kernels
// (csrc/cpu/lu.cpp) and CUDA glue (csrc/cuda/lu_glue.cpp): the one check of the tensors' shapes,
// dtypes, devices and layouts, as one-line ValueErrors worded as the Python wrapper (fedkernels/ops/lu.py)
// words its other errors (it checks types and values first), and the host-side arrowhead coefficients
// both backends solve with.
#pragma once

#include <string>
#include <utility>

#include "checks.h"
#include "lu_limits.h"

namespace fedkernels {
namespace checks {

// Returns n. A: [n, n] or [B, n, n], float32/float64, 1 <= n <= kLuMaxN (the wrapper's rules; it names
// itself lu_factor or lu_factor_ex, the native op is lu_factor).
inline int64_t lu_factor_args(const at::Tensor& A) {
  const char* op = "lu_factor";
  TORCH_CHECK_VALUE((A.dim() == 2 || A.dim() == 3) && A.size(-1) == A.size(-2), op,
                    ": A must be a square [n, n] or batched [B, n, n] matrix, got shape ", py_shape(A.sizes()));
  TORCH_CHECK_VALUE(A.scalar_type() == at::kFloat || A.scalar_type() == at::kDouble, op,
                    ": A must be float32 or float64, got ", py_dtype(A.scalar_type()));
  const int64_t n = A.size(-1);
  TORCH_CHECK_VALUE(n >= 1 && n <= kLuMaxN, op, ": n must be in [1, ", kLuMaxN,
                    "] (small systems; use torch.linalg for larger), got ", n);
  return n;
}

// LU: [n, n] or [B, n, n] float; pivots: int32/int64 of LU's shape less the last dim; R: [n, m] or
// [B, n, m] float32/float64 with unit column stride; all on one device (pivots may also be on the
// host: the CUDA glue checks their range there). The wrapper's messages (op lu_solve, for
// lu_solve_out too), in its order.
struct LuSolveShape {
  bool batched;
  int64_t B, n, m;
};
inline LuSolveShape lu_solve_args(const at::Tensor& LU, const at::Tensor& piv, const at::Tensor& R) {
  const char* op = "lu_solve";
  TORCH_CHECK_VALUE((LU.dim() == 2 || LU.dim() == 3) && LU.size(-1) == LU.size(-2), op,
                    ": LU must be [n, n] or [B, n, n], got shape ", py_shape(LU.sizes()));
  LuSolveShape s;
  s.batched = LU.dim() == 3;
  s.n = LU.size(-1);
  s.B = s.batched ? LU.size(0) : 1;
  TORCH_CHECK_VALUE(LU.is_floating_point(), op, ": LU must have a floating dtype, got ", py_dtype(LU.scalar_type()));
  TORCH_CHECK_VALUE(piv.scalar_type() == at::kInt || piv.scalar_type() == at::kLong, op,
                    ": pivots must be int32 or int64, got ", py_dtype(piv.scalar_type()));
  const at::IntArrayRef want_piv = LU.sizes().slice(0, LU.dim() - 1);
  TORCH_CHECK_VALUE(piv.sizes() == want_piv, op, ": pivots must have shape ", py_shape(want_piv), ", got ",
                    py_shape(piv.sizes()));
  const bool r_ok = R.dim() == LU.dim() && R.size(-2) == s.n && (!s.batched || R.size(0) == s.B);
  TORCH_CHECK_VALUE(r_ok, op, ": R must be ",
                    s.batched ? "[" + std::to_string(s.B) + ", " + std::to_string(s.n) + ", m]"
                              : "[" + std::to_string(s.n) + ", m]",
                    ", got shape ", py_shape(R.sizes()));
  TORCH_CHECK_VALUE(R.scalar_type() == at::kFloat || R.scalar_type() == at::kDouble, op,
                    ": R must be float32 or float64, got ", py_dtype(R.scalar_type()));
  TORCH_CHECK_VALUE(LU.device() == R.device() && (piv.device() == R.device() || piv.device().is_cpu()), op,
                    ": LU, pivots and R must be on one device, got ", LU.device(), ", ", piv.device(), ", ", R.device());
  TORCH_CHECK_VALUE(R.size(-1) <= 1 || R.stride(-1) == 1, op, ": R must have unit column stride, got strides ",
                    py_shape(R.strides()), " (the fedkernels.ops wrapper copies it once)");
  s.m = R.size(-1);
  return s;
}

// out (lu_solve_out): a contiguous tensor of R's shape, dtype and device (checked after lu_solve_args).
inline void lu_solve_out_args(const at::Tensor& out, const at::Tensor& R) {
  TORCH_CHECK_VALUE(out.sizes() == R.sizes() && out.scalar_type() == R.scalar_type() && out.is_contiguous() &&
                        out.device() == R.device(),
                    "lu_solve: out must be a contiguous ", py_dtype(R.scalar_type()), " tensor of shape ",
                    py_shape(R.sizes()), " on ", R.device());
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
  const char* op = "arrowhead_solve";
  TORCH_CHECK_VALUE(R.dim() == 2, op, ": R must be a 2-D [K, m] tensor, got shape ", py_shape(R.sizes()));
  TORCH_CHECK_VALUE(R.scalar_type() == at::kFloat || R.scalar_type() == at::kDouble, op,
                    ": R must be float32 or float64, got ", py_dtype(R.scalar_type()));
  const int64_t K = R.size(0), m = R.size(1);
  for (const auto& tn : {std::make_pair(&a, "a"), std::make_pair(&b, "b"), std::make_pair(&c, "c")})
    TORCH_CHECK_VALUE(tn.first->dim() == 0 || (tn.first->dim() == 1 && tn.first->size(0) == K), op, ": ", tn.second,
                      " must be a scalar or a length-", K, " vector, got shape ", py_shape(tn.first->sizes()));
  vector_like(r0, m, R, R.device(), op, "r0");  // (the wrapper's wording names R "U")
  TORCH_CHECK_VALUE(m <= 1 || R.stride(1) == 1, op, ": R must have unit column stride, got strides ",
                    py_shape(R.strides()), " (the fedkernels.ops wrapper copies it once)");
  auto coef = [K](const at::Tensor& t) {  // (a scalar stands for K equal entries)
    std::vector<double> v = host_doubles(t);
    if (t.dim() == 0) v.assign(K, v[0]);
    return v;
  };
  const std::vector<double> av = coef(a), bv = coef(b);
  Arrowhead h{std::vector<double>(K), coef(c), std::vector<double>(K), alpha};
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
