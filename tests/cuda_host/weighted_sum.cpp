// Host harness commands of weighted_sum (csrc/cuda/weighted_sum.cuh), driven by tests/test_weighted_sum.py.
// Protocol: see harness.h; one line in, one line out:
//   wsum A V vec K d n alpha wide  U[K*d] coef[n] rows[n] base[d or empty: flag] -> out[d] | ERR
//   vecok u ld_bytes K out base                                                    -> 0/1
//   fits alpha c                                                                   -> 0/1
//   wfin x                                 -> wsum::finite<float>((float)x) wsum::finite<double>(x): 0/1 0/1
// wsum emulates weighted_sum_kernel: every (block, thread, element) through wsum::col, the staged
// coefficient (A)(alpha*coef[i]) or NaN for a bad row, wsum::accumulate in row order, then base.
// A = 4 (float accumulation, data given as float: fp16/bf16 values are exact in float) or 8.
#include "harness.h"

#include "weighted_sum.cuh"

template <typename A>
static bool wsum_emulate(int V, bool vec, long long K, long long d, long long n, double alpha, int wide,
                         const std::vector<double>& U, const std::vector<double>& coef, const std::vector<long long>& rows,
                         const std::vector<double>* base, std::vector<double>& out) {
  std::vector<int> hits(d, 0);
  const long long blocks = wsum::num_blocks(d, V);
  (void)wide;
  for (long long b = 0; b < blocks; ++b)
    for (int tid = 0; tid < wsum::kThreads; ++tid)
      for (int e = 0; e < V; ++e) {
        const long long j = wsum::col(b, tid, e, V, vec);
        if (j >= d) continue;
        ++hits[j];
        A acc = A(0);
        for (long long i = 0; i < n; ++i) {
          const long long r = rows.empty() ? i : rows[i];
          const bool ok = wsum::row_ok(r, K);
          const A c = ok ? static_cast<A>(alpha * coef[i]) : static_cast<A>(NAN);
          const A x = static_cast<A>(U[(ok ? r : 0) * d + j]);
          acc = wsum::accumulate(acc, c, x);
        }
        if (base) acc = static_cast<A>((*base)[j]) + acc;
        out[j] = static_cast<double>(acc);
      }
  for (long long j = 0; j < d; ++j)
    if (hits[j] != 1) return false;
  return true;
}

FK_HOST_COMMAND(fits) {
  const double a = rd(in), c = rd(in);
  std::printf("%d\n", wsum::fits_float(a, c) ? 1 : 0);
}

FK_HOST_COMMAND(wfin) {
  const double x = rd(in);
  std::printf("%d %d\n", wsum::finite<float>((float)x) ? 1 : 0, wsum::finite<double>(x) ? 1 : 0);
}

FK_HOST_COMMAND(vecok) {
  const long long u = ri(in), ldb = ri(in), K = ri(in), o = ri(in), b = ri(in);
  std::printf("%d\n", wsum::vec_ok((uintptr_t)u, ldb, K, (uintptr_t)o, (uintptr_t)b) ? 1 : 0);
}

FK_HOST_COMMAND(wsum) {
  const int A = (int)ri(in), V = (int)ri(in), vec = (int)ri(in);
  const long long K = ri(in), d = ri(in), n = ri(in);
  const double alpha = rd(in);
  const int wide = (int)ri(in);
  std::vector<double> U(K * d), coef(n), base;
  std::vector<long long> rows;
  for (auto& x : U) x = rd(in);
  for (auto& x : coef) x = rd(in);
  const int has_rows = (int)ri(in);
  if (has_rows) {
    rows.resize(n);
    for (auto& x : rows) x = ri(in);
  }
  const int has_base = (int)ri(in);
  if (has_base) {
    base.resize(d);
    for (auto& x : base) x = rd(in);
  }
  // the kernel's accumulation type: the data's unless some coefficient does not fit in float
  bool w = A == 8;
  if (!w) {
    if (wide >= 0) {
      w = wide == 1;
    } else {
      for (long long i = 0; i < n; ++i) w = w || !wsum::fits_float(alpha, coef[i]);
    }
  }
  std::vector<double> out(d);
  const bool ok = w ? wsum_emulate<double>(V, vec, K, d, n, alpha, wide, U, coef, rows, has_base ? &base : nullptr, out)
                    : wsum_emulate<float>(V, vec, K, d, n, alpha, wide, U, coef, rows, has_base ? &base : nullptr, out);
  if (!ok) {
    std::printf("ERR column coverage\n");
    return;
  }
  std::printf("%d", w ? 1 : 0);
  for (double v : out) put(v);
  std::printf("\n");
}
