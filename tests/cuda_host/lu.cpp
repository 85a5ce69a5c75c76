// Host harness commands of lu (csrc/cuda/lu.cuh), driven by tests/test_lu.py.
// Protocol: see harness.h; one line in, one line out:
//   pivot k n col[n]                                                               -> warp_p block_p
//   lusolve n m LU[n*n] piv[n] R[n*m]                                              -> X[n*m]
//   arrow K m inv_den coef[3K] r0[m] R[K*m]                                        -> x[m] I[K*m]
#include "harness.h"

#include "lu.cuh"

// the kernels' pivot butterfly over 32 lanes: each lane keeps the better of its key and lane l ^ o's
static void pivot_butterfly(lu::PivotKey lanes[32]) {
  for (int o = 16; o > 0; o >>= 1) {
    lu::PivotKey nxt[32];
    for (int l = 0; l < 32; ++l) {
      nxt[l] = lanes[l];
      if (lu::pivot_better(lanes[l ^ o], lanes[l])) nxt[l] = lanes[l ^ o];
    }
    for (int l = 0; l < 32; ++l) lanes[l] = nxt[l];
  }
}

FK_HOST_COMMAND(pivot) {
  const int k = (int)ri(in), n = (int)ri(in);
  std::vector<double> col(n);
  for (auto& x : col) x = rd(in);
  // warp kernel: lane i holds row i (n <= 32), butterfly over 32 lanes
  int warp_p = -1;
  if (n <= 32) {
    lu::PivotKey lanes[32];
    for (int l = 0; l < 32; ++l) lanes[l] = lu::pivot_key(l < n ? col[l] : 0.0, l, k, n);
    pivot_butterfly(lanes);
    for (int l = 1; l < 32; ++l)
      if (lanes[l].i != lanes[0].i) warp_p = -2;  // lanes disagree
    if (warp_p == -1) warp_p = lanes[0].i;
  }
  // block kernel: lane t scans rows k + t, k + t + 32, ...; then the butterfly
  lu::PivotKey lanes[32];
  for (int t = 0; t < 32; ++t) {
    lanes[t] = lu::pivot_key(0.0, -1, k, n);
    for (int i = k + t; i < n; i += 32) {
      const lu::PivotKey c = lu::pivot_key(col[i], i, k, n);
      if (lu::pivot_better(c, lanes[t])) lanes[t] = c;
    }
  }
  pivot_butterfly(lanes);
  int block_p = lanes[0].i;
  for (int l = 1; l < 32; ++l)
    if (lanes[l].i != block_p) block_p = -2;
  std::printf("%d %d\n", warp_p, block_p);
}

FK_HOST_COMMAND(lusolve) {
  const int n = (int)ri(in);
  const long long m = ri(in);
  std::vector<double> LU(n * n), R(n * m);
  std::vector<int32_t> piv(n);
  for (auto& x : LU) x = rd(in);
  for (auto& x : piv) x = (int32_t)ri(in);
  for (auto& x : R) x = rd(in);
  std::vector<int> perm(n);
  const bool ok = lu::permutation(piv.data(), n, perm.data());
  std::vector<double> X(n * m);
  for (long long c = 0; c < m; ++c) {  // one thread per column
    double x[lu::kMaxN] = {};  // as lu_solve_kernel<T, 64>: guards at i < n
    for (int i = 0; i < n; ++i) x[i] = R[perm[i] * m + c];
    lu::solve_column<lu::kMaxN>([&](int i, int j) { return LU[i * n + j]; }, n, x);
    for (int i = 0; i < n; ++i) X[i * m + c] = ok ? x[i] : NAN;
  }
  std::printf("%d", ok ? 1 : 0);
  for (double v : X) put(v);
  std::printf("\n");
}

FK_HOST_COMMAND(arrow) {
  const long long K = ri(in), m = ri(in);
  const double inv_den = rd(in);
  std::vector<double> coef(3 * K), r0(m), R(K * m), x(m), I(K * m);
  for (auto& v : coef) v = rd(in);
  for (auto& v : r0) v = rd(in);
  for (auto& v : R) v = rd(in);
  for (long long c = 0; c < m; ++c)
    x[c] = lu::arrowhead_column(
        coef.data(), K, r0[c], inv_den, [&](long long i) { return R[i * m + c]; },
        [&](long long i, double v) { I[i * m + c] = v; });
  std::printf("ok");
  for (double v : x) put(v);
  for (double v : I) put(v);
  std::printf("\n");
}
