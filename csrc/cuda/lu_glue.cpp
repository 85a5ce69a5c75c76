// Torch glue of lu_factor, lu_solve, lu_solve_out and arrowhead_solve (kernels: lu.cu).
// Schemas (csrc/fedkernels.cpp):
//   lu_factor(Tensor A) -> (LU, pivots int32 1-based, info int32), A [n, n] or [B, n, n], n <= 64.
//   lu_solve(Tensor LU, Tensor pivots, Tensor R) -> X;  lu_solve_out(LU, pivots, R, out) -> ()
//   arrowhead_solve(Tensor a, Tensor b, Tensor c, float alpha, Tensor r0, Tensor R) -> (x, I)
// Not checked on the device (each would need a host sync): finiteness of A (the CPU op rejects a
// non-finite A), zero U diagonals in lu_solve (Inf/NaN result). Pivots on the host are range-checked
// here as on the CPU; device pivots out of range give NaN columns. arrowhead_solve's a, b, c are
// read on the host (host tensors: no sync) to check a_i != 0 and the Schur complement, as the CPU op.
#include <cmath>
#include <tuple>
#include <vector>

#include "glue.h"

namespace fedkernels {
namespace {

using namespace glue;

std::tuple<at::Tensor, at::Tensor, at::Tensor> lu_factor_cuda(const at::Tensor& A) {
  TORCH_CHECK(A.dim() == 2 || A.dim() == 3, "lu_factor: A must be [n, n] or [B, n, n], got shape ", A.sizes());
  const int64_t n = A.size(-1);
  TORCH_CHECK(A.size(-2) == n, "lu_factor: A must be square, got shape ", A.sizes());
  TORCH_CHECK(n >= 1 && n <= fk::kLuMaxN, "lu_factor: n must be in [1, ", fk::kLuMaxN, "] (small systems), got ", n);
  TORCH_CHECK(A.scalar_type() == at::kFloat || A.scalar_type() == at::kDouble,
              "lu_factor: A must be float32 or float64, got ", A.scalar_type());
  c10::cuda::CUDAGuard guard(A.device());
  const bool batched = A.dim() == 3;
  const int64_t B = batched ? A.size(0) : 1;
  auto a = A.contiguous();
  auto LU = at::empty(A.sizes(), A.options());
  auto piv = at::empty(batched ? std::vector<int64_t>{B, n} : std::vector<int64_t>{n}, A.options().dtype(at::kInt));
  auto info = at::empty(batched ? std::vector<int64_t>{B} : std::vector<int64_t>{}, A.options().dtype(at::kInt));
  if (B == 0) return {LU, piv, info};
  C10_CUDA_CHECK(fk::lu_factor_batched(a.data_ptr(), LU.data_ptr(), to_dtype(a.scalar_type(), "lu_factor", "A"), B, n,
                                       piv.data_ptr<int32_t>(), info.data_ptr<int32_t>(), stream()));
  return {LU, piv, info};
}

void lu_solve_into(const at::Tensor& LU, const at::Tensor& pivots, const at::Tensor& R, at::Tensor& X) {
  TORCH_CHECK(LU.dim() == 2 || LU.dim() == 3, "lu_solve: LU must be [n, n] or [B, n, n], got ", LU.sizes());
  const bool batched = LU.dim() == 3;
  const int64_t n = LU.size(-1), B = batched ? LU.size(0) : 1;
  TORCH_CHECK(LU.size(-2) == n, "lu_solve: LU must be square, got ", LU.sizes());
  TORCH_CHECK(n >= 1 && n <= fk::kLuMaxN, "lu_solve: n must be in [1, ", fk::kLuMaxN, "] on CUDA, got ", n);
  TORCH_CHECK(R.dim() == LU.dim() && R.size(-2) == n && (!batched || R.size(0) == B),
              "lu_solve: R must be [n, m] (or [B, n, m] for batched LU) with n = ", n, ", got ", R.sizes());
  TORCH_CHECK(pivots.dim() == LU.dim() - 1 && pivots.size(-1) == n && (!batched || pivots.size(0) == B),
              "lu_solve: pivots must be [n] (or [B, n]), got ", pivots.sizes());
  TORCH_CHECK(!pivots.is_floating_point() && pivots.scalar_type() != at::kBool,
              "lu_solve: pivots must be an integer tensor, got ", pivots.scalar_type());
  TORCH_CHECK(R.scalar_type() == at::kFloat || R.scalar_type() == at::kDouble,
              "lu_solve: R must be float32 or float64, got ", R.scalar_type());
  TORCH_CHECK(LU.is_floating_point(), "lu_solve: LU must have a floating dtype, got ", LU.scalar_type());
  check_cuda(R, LU, "lu_solve", "R");
  check_cuda(X, LU, "lu_solve", "out");
  check_host_or_device(pivots, LU, "lu_solve", "pivots");
  c10::cuda::CUDAGuard guard(LU.device());
  if (pivots.device().is_cpu()) {
    auto h = pivots.to(at::kInt).contiguous();
    const int32_t* p = h.data_ptr<int32_t>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < n; ++i) {
        const int64_t q = p[b * n + i];
        TORCH_CHECK(q >= i + 1 && q <= n, "lu_solve: pivots[", i, "] = ", q, " out of range [", i + 1, ", ", n, "]");
      }
  }
  const int64_t m = R.size(-1);
  if (m == 0 || B == 0) return;
  auto r = R.contiguous();
  auto lu = LU.to(at::kDouble).contiguous();
  auto pv = small_to_device(pivots.reshape({-1}), at::kInt, LU.device());
  C10_CUDA_CHECK(fk::lu_solve(lu.data_ptr<double>(), pv.data_ptr<int32_t>(), r.data_ptr(), X.data_ptr(),
                              to_dtype(r.scalar_type(), "lu_solve", "R"), B, n, m, stream()));
}

at::Tensor lu_solve_cuda(const at::Tensor& LU, const at::Tensor& pivots, const at::Tensor& R) {
  auto X = at::empty(R.sizes(), R.options());
  lu_solve_into(LU, pivots, R, X);
  return X;
}

// out may be R itself (each column is read completely before it is written).
void lu_solve_out_cuda(const at::Tensor& LU, const at::Tensor& pivots, const at::Tensor& R, at::Tensor out) {
  TORCH_CHECK(out.sizes() == R.sizes() && out.scalar_type() == R.scalar_type() && out.is_contiguous(),
              "lu_solve_out: out must be a contiguous tensor of R's shape and dtype");
  lu_solve_into(LU, pivots, R, out);
}

std::tuple<at::Tensor, at::Tensor> arrowhead_solve_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c,
                                                        double alpha, const at::Tensor& r0, const at::Tensor& R) {
  TORCH_CHECK(R.dim() == 2, "arrowhead_solve: R must be [K, m], got ", R.sizes());
  const int64_t K = R.size(0), m = R.size(1);
  TORCH_CHECK(a.dim() == 1 && a.size(0) == K && b.dim() == 1 && b.size(0) == K && c.dim() == 1 && c.size(0) == K,
              "arrowhead_solve: a, b, c must be 1-D of length K = ", K);
  TORCH_CHECK(r0.dim() == 1 && r0.size(0) == m, "arrowhead_solve: r0 must be [m] with m = ", m, ", got ", r0.sizes());
  TORCH_CHECK(r0.scalar_type() == R.scalar_type(), "arrowhead_solve: r0 and R must have the same dtype");
  TORCH_CHECK(R.scalar_type() == at::kFloat || R.scalar_type() == at::kDouble,
              "arrowhead_solve: R must be float32 or float64, got ", R.scalar_type());
  TORCH_CHECK(m <= 1 || R.stride(1) == 1, "arrowhead_solve: R must have unit column stride");
  check_cuda(r0, R, "arrowhead_solve", "r0");
  for (const at::Tensor* t : {&a, &b, &c}) check_host_or_device(*t, R, "arrowhead_solve", "a/b/c");
  const std::vector<double> av = small_to_host(a), bv = small_to_host(b), cv = small_to_host(c);
  std::vector<double> coef(std::max<int64_t>(3 * K, 1));
  double den = alpha;
  for (int64_t i = 0; i < K; ++i) {
    TORCH_CHECK(av[i] != 0.0 && std::isfinite(av[i]), "arrowhead_solve: a[", i, "] = ", av[i],
                " must be finite and nonzero");
    coef[i] = bv[i] / av[i];
    coef[K + i] = cv[i];
    coef[2 * K + i] = 1.0 / av[i];
    den -= bv[i] * cv[i] / av[i];
  }
  TORCH_CHECK(den != 0.0 && std::isfinite(den), "arrowhead_solve: singular system (Schur complement ", den, ")");
  c10::cuda::CUDAGuard guard(R.device());
  auto x = at::empty({m}, R.options());
  auto I = at::empty({K, m}, R.options());
  if (m == 0) return {x, I};
  auto tab = upload_bytes(coef.data(), coef.size() * sizeof(double), R.device());
  auto r0c = r0.contiguous();
  C10_CUDA_CHECK(fk::arrowhead_solve(static_cast<const double*>(tab.data_ptr()), K, m, 1.0 / den, r0c.data_ptr(),
                                     R.data_ptr(), K > 1 ? R.stride(0) : m, x.data_ptr(), I.data_ptr(),
                                     to_dtype(R.scalar_type(), "arrowhead_solve", "R"), stream()));
  return {x, I};
}

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CUDA, m) {
  m.impl("lu_factor", &lu_factor_cuda);
  m.impl("lu_solve", &lu_solve_cuda);
  m.impl("lu_solve_out", &lu_solve_out_cuda);
  m.impl("arrowhead_solve", &arrowhead_solve_cuda);
}

}  // namespace fedkernels
