// Torch glue of lu_factor, lu_solve, lu_solve_out and arrowhead_solve (kernels: lu.cu).
// Schemas (csrc/fedkernels.cpp):
//   lu_factor(Tensor A) -> (LU, pivots int32 1-based, info int32), A [n, n] or [B, n, n], n <= kLuMaxN (csrc/lu_limits.h).
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
#include "lu.cuh"
#include "../lu_checks.h"

namespace fedkernels {
namespace {

using namespace glue;

std::tuple<at::Tensor, at::Tensor, at::Tensor> lu_factor_cuda(const at::Tensor& A) {
  const int64_t n = checks::lu_factor_args(A);
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
  const checks::LuSolveShape sh = checks::lu_solve_args(LU, pivots, R);
  const int64_t n = sh.n, B = sh.B, m = sh.m;
  TORCH_CHECK(n >= 1 && n <= kLuMaxN, "lu_solve: n must be in [1, ", kLuMaxN, "] on CUDA, got ", n);
  checks::host_or_on(pivots, LU.device(), "lu_solve", "pivots", "LU");
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
  checks::lu_solve_args(LU, pivots, R);  // (the inputs' rules first, as the wrapper orders them)
  checks::lu_solve_out_args(out, R);
  lu_solve_into(LU, pivots, R, out);
}

std::tuple<at::Tensor, at::Tensor> arrowhead_solve_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c,
                                                        double alpha, const at::Tensor& r0, const at::Tensor& R) {
  for (const at::Tensor* t : {&a, &b, &c}) checks::host_or_on(*t, R.device(), "arrowhead_solve", "a/b/c", "R");
  const checks::Arrowhead h = checks::arrowhead_args(a, b, c, alpha, r0, R);
  const int64_t K = R.size(0), m = R.size(1);
  std::vector<double> coef(std::max<int64_t>(3 * K, 1));  // the table of the arrowhead_solve launcher (lu.cuh)
  for (int64_t i = 0; i < K; ++i) {
    coef[i] = h.ba[i];
    coef[K + i] = h.c[i];
    coef[2 * K + i] = h.inv_a[i];
  }
  c10::cuda::CUDAGuard guard(R.device());
  auto x = at::empty({m}, R.options());
  auto I = at::empty({K, m}, R.options());
  if (m == 0) return {x, I};
  auto tab = upload_bytes(coef.data(), coef.size() * sizeof(double), R.device());
  auto r0c = r0.contiguous();
  C10_CUDA_CHECK(fk::arrowhead_solve(static_cast<const double*>(tab.data_ptr()), K, m, 1.0 / h.den, r0c.data_ptr(),
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
