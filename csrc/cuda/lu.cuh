// Per-lane logic of the LU CUDA kernels (lu.cu), shared with the host tests.
//
// Pivot choice: the CPU op (csrc/cpu/lu.cpp, getf2) scans i = k+1..n-1 keeping the first i with
// |a_ik| > best, starting from best = |a_kk|. With NaN that is: a NaN diagonal keeps row k; a NaN
// below the diagonal never wins; otherwise the largest |a_ik|, ties to the smallest i. pivot_key /
// pivot_better encode exactly that as a strict total order on (rank, value, index) with no NaN
// compared, so any reduction tree (warp butterfly, strided scan + butterfly) gives the same
// pivot on every lane, and the pivot is always in [k, n).
// Host-tested (tests/cuda_host/): pivot_key / pivot_better against the sequential getf2 scan with
// NaN, +-inf, ties and zeros, through an emulation of the 32-lane butterfly; solve_column (the
// per-thread permuted forward/back substitution of lu_solve) and arrowhead_column against the
// float64 reference. Only a GPU run checks: the shuffles themselves, the shared-memory staging
// and barriers of the block kernels, and the launch configuration.
#pragma once

#include <cstdint>

#include <cmath>

#include "hd.h"
#include "../lu_limits.h"

namespace fedkernels {
namespace cuda {
namespace lu {

constexpr int kMaxN = fedkernels::kLuMaxN;  // largest n of the CUDA LU kernels (csrc/lu_limits.h)

struct PivotKey {
  int rank;  // 2: NaN diagonal (keeps row k), 1: a number, 0: NaN below the diagonal, -1: not a candidate
  double v;  // |a_ik| for rank 1, else 0
  int i;
};

FK_HD PivotKey pivot_key(double a_ik, int i, int k, int n) {
  PivotKey p;
  p.i = i;
  p.v = 0.0;
  if (i < k || i >= n) {
    p.rank = -1;
  } else if (a_ik != a_ik) {
    p.rank = i == k ? 2 : 0;
  } else {
    p.rank = 1;
    p.v = a_ik < 0 ? -a_ik : a_ik;
  }
  return p;
}

// True when a is chosen over b.
FK_HD bool pivot_better(const PivotKey& a, const PivotKey& b) {
  if (a.rank != b.rank) return a.rank > b.rank;
  if (a.v != b.v) return a.v > b.v;
  return a.i < b.i;
}

// Row permutation of the LAPACK pivots (1-based, applied in order): perm[i] = source row of row i.
// An out-of-range pivot (the glue checks host pivots; device pivots cannot be checked without a
// sync) makes the whole permutation invalid: returns false and the caller writes NaN.
FK_HD bool permutation(const int32_t* piv, int n, int* perm) {
  bool ok = true;
  for (int i = 0; i < n; ++i) perm[i] = i;
  for (int k = 0; k < n; ++k) {
    const int p = piv[k] - 1;
    if (p < k || p >= n) {
      ok = false;
      continue;
    }
    const int t = perm[k];
    perm[k] = perm[p];
    perm[p] = t;
  }
  return ok;
}

// One right-hand side: x = U^{-1} L^{-1} (P^T r), in place on x[0..n) (x holds r[perm[i]]), n <= NMAX.
// lu(i, j) reads the factor. Forward substitution with the unit lower triangle, then back
// substitution dividing by the diagonal, each sum in increasing j (fma). The loops run to the
// compile-time NMAX with `i < n` guards, so x stays in registers on the GPU (no local memory).
template <int NMAX, typename F>
FK_HD void solve_column(const F& lu, int n, double (&x)[NMAX]) {
  FK_UNROLL
  for (int i = 1; i < NMAX; ++i) {
    if (i < n) {
      double acc = x[i];
      FK_UNROLL
      for (int j = 0; j < i; ++j) acc = fma(-lu(i, j), x[j], acc);
      x[i] = acc;
    }
  }
  FK_UNROLL
  for (int i = NMAX - 1; i >= 0; --i) {
    if (i < n) {
      double acc = x[i];
      FK_UNROLL
      for (int j = i + 1; j < NMAX; ++j)
        if (j < n) acc = fma(-lu(i, j), x[j], acc);
      x[i] = acc / lu(i, i);
    }
  }
}

// Arrowhead system, one column: coef = (b_i / a_i, c_i, 1 / a_i) for i < K (3K values); r(i) reads
// R[i, col]. Returns x and writes I_i through put(i, value). Same order and operations as the
// CPU op (csrc/cpu/lu.cpp arrowhead_solve_cpu).
template <typename Rd, typename Put>
FK_HD double arrowhead_column(const double* coef, int64_t K, double r0, double inv_den, const Rd& r, const Put& put) {
  double acc = r0;
  for (int64_t i = 0; i < K; ++i) acc -= coef[i] * r(i);
  acc *= inv_den;
  for (int64_t i = 0; i < K; ++i) put(i, (r(i) - coef[K + i] * acc) * coef[2 * K + i]);
  return acc;
}

}  // namespace lu
}  // namespace cuda
}  // namespace fedkernels

// ---- launchers (csrc/cuda/lu.cu), called by the torch glue csrc/cuda/lu_glue.cpp. They
// need the CUDA runtime headers: the host tests (tests/cuda_host, no CUDA) define FEDKERNELS_HD_ONLY.
#ifndef FEDKERNELS_HD_ONLY
#include "launch.h"

namespace fedkernels {
namespace cuda {

// ---- lu_factor / lu_solve (FedECADO dense path, fedecado.md §5.3(b)) ---------------------------
// A: [B, n, n] row-major, LU written to `LU` (may alias A); piv: int32 [B, n] 1-based (LAPACK
// getrf: first index of max |a_ik| on ties, zero pivot -> info = k+1 (first occurrence), no
// division, factorisation continues). info: int32 [B]. n <= kLuMaxN (warp per matrix for n <= 32,
// block per matrix with the matrix in shared memory above).
cudaError_t lu_factor_batched(const void* A, void* LU, DType dt, int64_t B, int64_t n, int32_t* piv, int32_t* info,
                              cudaStream_t stream);
// X = A^{-1} R for each batch entry, with A = P L U from lu_factor_batched (LU given in float64;
// arithmetic in float64). R, X: [B, n, m] of dtype dt (float32/float64; X may alias R). The m
// right-hand sides are streamed: one thread per column, the factor and the permutation in shared
// memory. A zero U diagonal gives Inf/NaN (the caller checks it where a host sync is acceptable).
cudaError_t lu_solve(const double* LU, const int32_t* piv, const void* R, void* X, DType dt, int64_t B, int64_t n,
                     int64_t m, cudaStream_t stream);

// ---- arrowhead_solve: [[alpha, b^T], [c, diag(a)]] [x; I] = [r0; R] per column -----------------
// coef: device float64 [3K] = (b_i / a_i, c_i, 1 / a_i), inv_den = 1 / (alpha - sum_i b_i c_i / a_i)
// (computed and checked on the host, as the CPU op). r0, x: [m]; R: [K, m] with row stride ld_r;
// I: [K, m] contiguous. One thread per column, float64 arithmetic, rows in index order (the CPU
// op's order): x = (r0 - sum_i (b_i/a_i) R_i) * inv_den, I_i = (R_i - c_i x) / a_i.
cudaError_t arrowhead_solve(const double* coef, int64_t K, int64_t m, double inv_den, const void* r0, const void* R,
                            int64_t ld_r, void* x, void* I, DType dt, cudaStream_t stream);

}  // namespace cuda
}  // namespace fedkernels
#endif  // FEDKERNELS_HD_ONLY
