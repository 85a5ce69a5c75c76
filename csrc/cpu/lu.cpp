// Small dense linear algebra for FedECADO (spec fedecado.md sections 2.6, 5.3).
//
// lu_factor(A): LU with partial pivoting of A [n, n] or [B, n, n] (n <= kLuMaxN, lu_limits.h), LAPACK getf2
//   semantics: pivot = first index of max |a_ik| (lowest index on ties), 1-based int32 pivots as in
//   torch.linalg.lu_factor, info = first zero pivot (1-based) or 0; a zero pivot column is left
//   unscaled (no division by zero, no NaN). Computed in the input dtype. Batch in parallel.
// lu_solve(LU, piv, R): X = A^{-1} R for R [n, m] or [B, n, m] with many right-hand sides. One pass
//   over R and X: the m columns are streamed in blocks of 64 (float64) / 128 (float32) that stay in
//   L1 (row permutation applied on load, unit-lower forward and upper back substitution in the data's
//   precision, store), chunks of 4096 columns in parallel. Bytes = n*m*(in + out); n^2*m FMAs.
// arrowhead_solve(a, b, c, alpha, r0, R): the (K+1) x (K+1) arrowhead system
//     [alpha  b^T    ] [x]   [r0]
//     [c      diag(a)] [I] = [R ]       per column of r0 [m], R [K, m]
//   by the Schur complement on x (no fill-in): x = (r0 - sum_i b_i R_i / a_i) / (alpha - sum_i b_i c_i / a_i),
//   I_i = (R_i - c_i x) / a_i. FedECADO's backward-Euler matrix has alpha = 1, b_i = -dt, c_i = dt/L.
#include "common.h"
#include "../lu_checks.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <type_traits>
#include <vector>

namespace fedkernels {
namespace {

template <typename T>
void getf2(T* a, int64_t n, int32_t* piv, int32_t* info) {
  *info = 0;
  for (int64_t k = 0; k < n; ++k) {
    int64_t p = k;
    T best = std::abs(a[k * n + k]);
    for (int64_t i = k + 1; i < n; ++i) {
      const T v = std::abs(a[i * n + k]);
      if (v > best) { best = v; p = i; }
    }
    piv[k] = (int32_t)(p + 1);
    if (a[p * n + k] != T(0)) {
      if (p != k)
        for (int64_t j = 0; j < n; ++j) std::swap(a[k * n + j], a[p * n + j]);
      const T d = a[k * n + k];
      for (int64_t i = k + 1; i < n; ++i) a[i * n + k] /= d;
    } else if (*info == 0) {
      *info = (int32_t)(k + 1);
    }
    for (int64_t i = k + 1; i < n; ++i) {
      const T l = a[i * n + k];
      if (l == T(0)) continue;
      T* ai = a + i * n;
      const T* ak = a + k * n;
      for (int64_t j = k + 1; j < n; ++j) ai[j] -= l * ak[j];
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lu_factor_cpu(const at::Tensor& A) {
  const int64_t n = checks::lu_factor_args(A);
  const bool batched = A.dim() == 3;
  const int64_t B = batched ? A.size(0) : 1;
  auto LU = A.contiguous().clone();
  auto piv = at::empty(batched ? std::vector<int64_t>{B, n} : std::vector<int64_t>{n}, A.options().dtype(at::kInt));
  auto info = at::empty(batched ? std::vector<int64_t>{B} : std::vector<int64_t>{}, A.options().dtype(at::kInt));
  AT_DISPATCH_FLOATING_TYPES(A.scalar_type(), "lu_factor_cpu", [&] {
    scalar_t* a = LU.data_ptr<scalar_t>();
    for (int64_t i = 0; i < B * n * n; ++i)
      TORCH_CHECK(std::isfinite((double)a[i]), "lu_factor: A must be finite, got ", (double)a[i], " in matrix ",
                  i / (n * n), " at [", (i / n) % n, ", ", i % n, "]");
    int32_t* pp = piv.data_ptr<int32_t>();
    int32_t* ip = info.data_ptr<int32_t>();
    const int64_t grain = std::max<int64_t>(1, 4096 / (n * n));
    at::parallel_for(0, B, grain, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) getf2<scalar_t>(a + b * n * n, n, pp + b * n, ip + b);
    });
  });
  return {LU, piv, info};
}

// Solve columns [c0, c0 + C) of one system; R and X are row-major with row strides. The columns
// go through in blocks of W: the n x W block lives in L1 (a stack array), the permuted rows are
// loaded once, the unit-lower forward and upper back substitutions run on W-wide vectors of the
// compute type A (float64 for float64 data, float32 for float32 data: twice the SIMD width where the
// substitution is compute-bound; U's diagonal applied as a precomputed reciprocal), and the block is
// stored once.
template <typename A> struct Block;
template <> struct Block<double> { static constexpr int64_t W = 64; };   // 8 AVX-512 / 16 AVX2 vectors
template <> struct Block<float> { static constexpr int64_t W = 128; };   // the same 512 bytes per row

template <typename T, typename A>
inline void solve_block(const A* __restrict__ lu, const A* __restrict__ inv_d, const int64_t* perm,
                        int64_t n, const T* R, int64_t rs, T* X, int64_t xs, int64_t c, int64_t w,
                        A* __restrict__ x /* n x W */) {
  constexpr int64_t W = Block<A>::W;
  for (int64_t i = 0; i < n; ++i) {
    const T* src = R + perm[i] * rs + c;
    A* xi = x + i * W;
    if (w == W) {
      for (int64_t l = 0; l < W; ++l) xi[l] = static_cast<A>(src[l]);
    } else {
      for (int64_t l = 0; l < W; ++l) xi[l] = l < w ? static_cast<A>(src[l]) : A(0);
    }
  }
  A acc[W];  // row i of the block, kept in registers across the j loop
  for (int64_t i = 1; i < n; ++i) {
    A* xi = x + i * W;
    const A* li = lu + i * n;
    for (int64_t q = 0; q < W; ++q) acc[q] = xi[q];
    for (int64_t j = 0; j < i; ++j) {
      const A l = li[j];
      const A* xj = x + j * W;
      for (int64_t q = 0; q < W; ++q) acc[q] -= l * xj[q];
    }
    for (int64_t q = 0; q < W; ++q) xi[q] = acc[q];
  }
  for (int64_t i = n - 1; i >= 0; --i) {
    A* xi = x + i * W;
    const A* ui = lu + i * n;
    for (int64_t q = 0; q < W; ++q) acc[q] = xi[q];
    for (int64_t j = i + 1; j < n; ++j) {
      const A u = ui[j];
      const A* xj = x + j * W;
      for (int64_t q = 0; q < W; ++q) acc[q] -= u * xj[q];
    }
    const A r = inv_d[i];
    for (int64_t q = 0; q < W; ++q) xi[q] = acc[q] * r;
    T* dst = X + i * xs + c;
    if (w == W) {
      for (int64_t l = 0; l < W; ++l) dst[l] = static_cast<T>(xi[l]);
    } else {
      for (int64_t l = 0; l < w; ++l) dst[l] = static_cast<T>(xi[l]);
    }
  }
}

template <typename T, typename A>
void solve_chunk(const A* lu, const A* inv_d, const int64_t* perm, int64_t n, const T* R, int64_t rs,
                 T* X, int64_t xs, int64_t c0, int64_t C) {
  constexpr int64_t W = Block<A>::W;
  alignas(64) A x[64 * W];
  for (int64_t c = c0; c < c0 + C; c += W)
    solve_block<T, A>(lu, inv_d, perm, n, R, rs, X, xs, c, std::min(W, c0 + C - c), x);
}

void lu_solve_into(const at::Tensor& LU, const at::Tensor& piv, const at::Tensor& R, at::Tensor& X);

at::Tensor lu_solve_cpu(const at::Tensor& LU, const at::Tensor& piv, const at::Tensor& R) {
  auto X = at::empty(R.sizes(), R.options());
  lu_solve_into(LU, piv, R, X);
  return X;
}

void lu_solve_out_cpu(const at::Tensor& LU, const at::Tensor& piv, const at::Tensor& R, at::Tensor out) {
  checks::lu_solve_args(LU, piv, R);  // (the inputs' rules first, as the wrapper orders them)
  checks::lu_solve_out_args(out, R);
  lu_solve_into(LU, piv, R, out);
}

void lu_solve_into(const at::Tensor& LU, const at::Tensor& piv, const at::Tensor& R, at::Tensor& X) {
  const checks::LuSolveShape sh = checks::lu_solve_args(LU, piv, R);
  const bool batched = sh.batched;
  const int64_t n = sh.n, B = sh.B, m = sh.m;
  if (m == 0) return;
  auto lu64 = LU.to(at::kDouble).contiguous();
  auto p32 = piv.to(at::kInt).contiguous();
  const double* lup = lu64.data_ptr<double>();
  const int32_t* pp = p32.data_ptr<int32_t>();
  // Row permutation of each system: perm[i] = source row of row i after the LAPACK swaps.
  std::vector<int64_t> perm(B * n);
  std::vector<double> inv_d(B * n);
  for (int64_t b = 0; b < B; ++b) {
    int64_t* pr = perm.data() + b * n;
    for (int64_t i = 0; i < n; ++i) pr[i] = i;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = (int64_t)pp[b * n + i] - 1;
      TORCH_CHECK(p >= i && p < n, "lu_solve: pivots[", i, "] = ", p + 1, " out of range [", i + 1, ", ", n, "]");
      std::swap(pr[i], pr[p]);
    }
    for (int64_t i = 0; i < n; ++i) {
      const double dii = lup[b * n * n + i * n + i];
      TORCH_CHECK(dii != 0.0, "lu_solve: U[", i, ", ", i, "] = 0 in system ", b, " (singular factor)");
      inv_d[b * n + i] = 1.0 / dii;
    }
  }
  const int64_t C = 4096;  // columns per parallel task (a multiple of both block widths)
  const int64_t nchunks = (m + C - 1) / C;
  const int64_t rb = batched ? R.stride(0) : 0, rs = R.stride(-2);
  const int64_t xb = batched ? X.stride(0) : 0, xs = X.stride(-2);
  const int64_t grain = std::max<int64_t>(1, (32 * 1024) / (n * std::min(C, m)));
  // float32 data: substitution in float32 (the factor rounded once), float64 data: in float64
  std::vector<float> lu32, inv_d32;
  if (R.scalar_type() == at::kFloat) {
    lu32.assign(lup, lup + B * n * n);
    inv_d32.assign(inv_d.begin(), inv_d.end());
  }
  AT_DISPATCH_FLOATING_TYPES(R.scalar_type(), "lu_solve_cpu", [&] {
    using A = scalar_t;
    const A* lua = std::is_same<A, float>::value ? reinterpret_cast<const A*>(lu32.data())
                                                  : reinterpret_cast<const A*>(lup);
    const A* inva = std::is_same<A, float>::value ? reinterpret_cast<const A*>(inv_d32.data())
                                                   : reinterpret_cast<const A*>(inv_d.data());
    const scalar_t* r = R.data_ptr<scalar_t>();
    scalar_t* x = X.data_ptr<scalar_t>();
    at::parallel_for(0, B * nchunks, grain, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t b = t / nchunks, c0 = (t % nchunks) * C;
        solve_chunk<scalar_t, A>(lua + b * n * n, inva + b * n, perm.data() + b * n, n, r + b * rb, rs,
                                 x + b * xb, xs, c0, std::min(C, m - c0));
      }
    });
  });
}

std::tuple<at::Tensor, at::Tensor> arrowhead_solve_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c,
                                                       double alpha, const at::Tensor& r0, const at::Tensor& R) {
  const checks::Arrowhead h = checks::arrowhead_args(a, b, c, alpha, r0, R);
  const int64_t K = R.size(0), m = R.size(1);
  const std::vector<double>&ba = h.ba, &cv = h.c, &inv_a = h.inv_a;
  const double inv_den = 1.0 / h.den;
  auto x = at::empty({m}, R.options());
  auto I = at::empty({K, m}, R.options());
  auto r0c = r0.contiguous();
  const int64_t C = 1024, rs = R.stride(0);
  AT_DISPATCH_FLOATING_TYPES(R.scalar_type(), "arrowhead_solve_cpu", [&] {
    const scalar_t* rp = R.data_ptr<scalar_t>();
    const scalar_t* r0p = r0c.data_ptr<scalar_t>();
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* Ip = I.data_ptr<scalar_t>();
    at::parallel_for(0, (m + C - 1) / C, 1, [&](int64_t t0, int64_t t1) {
      double acc[C];
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t c0 = t * C, cl = std::min(C, m - c0);
        for (int64_t j = 0; j < cl; ++j) acc[j] = static_cast<double>(r0p[c0 + j]);
        for (int64_t i = 0; i < K; ++i) {
          const scalar_t* ri = rp + i * rs + c0;
          const double f = ba[i];
          for (int64_t j = 0; j < cl; ++j) acc[j] -= f * static_cast<double>(ri[j]);
        }
        for (int64_t j = 0; j < cl; ++j) {
          acc[j] *= inv_den;
          xp[c0 + j] = static_cast<scalar_t>(acc[j]);
        }
        for (int64_t i = 0; i < K; ++i) {
          const scalar_t* ri = rp + i * rs + c0;
          scalar_t* Ii = Ip + i * m + c0;
          const double ci = cv[i], ia = inv_a[i];
          for (int64_t j = 0; j < cl; ++j) Ii[j] = static_cast<scalar_t>((static_cast<double>(ri[j]) - ci * acc[j]) * ia);
        }
      }
    });
  });
  return {x, I};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fedkernels, m) {
  // Partial-pivoting LU of A [n, n] or [B, n, n] (n <= 64), LAPACK getf2 semantics:
  // (LU, pivots int32 1-based, info int32: first zero pivot (1-based) or 0).
  m.def("lu_factor(Tensor A) -> (Tensor, Tensor, Tensor)");
  // X = A^{-1} R from lu_factor's (LU, pivots); R [n, m] or [B, n, m], streamed over the m columns.
  m.def("lu_solve(Tensor LU, Tensor pivots, Tensor R) -> Tensor");
  m.def("lu_solve_out(Tensor LU, Tensor pivots, Tensor R, Tensor(a!) out) -> ()");
  // [[alpha, b^T], [c, diag(a)]] [x; I] = [r0; R] per column (Schur complement on x): (x [m], I [K, m]).
  m.def("arrowhead_solve(Tensor a, Tensor b, Tensor c, float alpha, Tensor r0, Tensor R) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fedkernels, CPU, m) {
  m.impl("lu_factor", &lu_factor_cpu);
  m.impl("lu_solve", &lu_solve_cpu);
  m.impl("lu_solve_out", &lu_solve_out_cpu);
  m.impl("arrowhead_solve", &arrowhead_solve_cpu);
}

}  // namespace fedkernels
