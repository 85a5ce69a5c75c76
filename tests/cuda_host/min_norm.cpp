// Host harness commands of min_norm (csrc/cuda/min_norm.cuh), driven by tests/test_min_norm.py.
// Protocol: see harness.h; one line in, one line out:
//   segment a b c                           -> g val (mn::segment)
//   gsmem N budget                          -> 1/0 (G in shared memory) and the bytes of lam, v, diag
//   minnorm N method init max_iter tol_rel tol_abs has_lam0 G[N*N] lam0[N if has_lam0]
//                                        -> it gap lam[N]: min_norm_kernel emulated (256 threads: per-thread
//                                           scan parts, warp butterflies, warps in index order; one warp
//                                           per row in the v recompute) around the mn:: functions
#include "harness.h"

#include "min_norm.cuh"

// ---- min_norm emulation -------------------------------------------------------------------------------
// block_reduce(sum): per-thread values, warp butterflies, warps added in index order
static double block_sum(const std::vector<double>& per_thread) {
  double r = 0.0;
  for (int w = 0; w < mn::kWarps; ++w) {
    double x[32];
    for (int l = 0; l < 32; ++l) x[l] = per_thread[w * 32 + l];
    const double s = butterfly(x);
    r = w == 0 ? s : r + s;
  }
  return r;
}
static void recompute_v(const std::vector<double>& Gs, long long N, const std::vector<double>& lam,
                        std::vector<double>& v) {
  for (long long i = 0; i < N; ++i) {
    double x[32];
    for (int l = 0; l < 32; ++l) x[l] = mn::row_partial(Gs.data() + i * N, lam.data(), N, l);
    v[i] = butterfly(x);
  }
}
static void scan(long long N, const std::vector<double>& lam, const std::vector<double>& v, mn::Arg& t, mn::Arg& a,
                 double& q) {
  std::vector<double> part(mn::kThreads);
  t = mn::Arg{INFINITY, N, 0.0};
  a = mn::Arg{-INFINITY, N, 0.0};
  for (int tid = 0; tid < mn::kThreads; ++tid) {
    mn::Arg m1, m2;
    mn::scan_thread(tid, N, lam.data(), v.data(), m1, m2, part[tid]);
    if (mn::better_min(m1, t)) t = m1;  // a total order: any combination order gives the same winner
    if (mn::better_max(m2, a)) a = m2;
  }
  q = block_sum(part);
}
static void minnorm(std::istream& in) {
  const long long N = ri(in);
  const int method = (int)ri(in), init = (int)ri(in);
  const long long max_iter = ri(in);
  const double tol_rel = rd(in), tol_abs = rd(in);
  const int has_lam0 = (int)ri(in);
  std::vector<double> G(N * N), lam0(has_lam0 ? N : 0), Gs(N * N), lam(N, 0.0), v(N), dg(N);
  for (auto& x : G) x = rd(in);
  for (auto& x : lam0) x = rd(in);
  for (long long i = 0; i < N; ++i)
    for (long long j = 0; j < N; ++j) Gs[i * N + j] = 0.5 * (G[i * N + j] + G[j * N + i]);
  double dmax = 0.0;
  for (long long i = 0; i < N; ++i) {
    dg[i] = Gs[i * N + i];
    dmax = std::fmax(dmax, std::fabs(dg[i]));
  }
  bool done = false;
  if (N == 1) {
    lam[0] = 1.0;
    done = true;
  }
  if (!done && has_lam0) {
    std::vector<double> part(mn::kThreads, 0.0);
    for (int tid = 0; tid < mn::kThreads; ++tid)
      for (long long i = tid; i < N; i += mn::kThreads) {
        const double x = lam0[i];
        lam[i] = (x > 0.0 && std::isfinite(x)) ? x : 0.0;
        part[tid] += lam[i];
      }
    const double s = block_sum(part);
    if (s > 0.0 && std::isfinite(s)) {
      for (long long i = 0; i < N; ++i) lam[i] /= s;
      done = true;
    } else {
      for (long long i = 0; i < N; ++i) lam[i] = 0.0;
    }
  }
  if (!done && init == 1) {
    mn::Arg m{INFINITY, N, 0.0};
    for (long long i = 0; i < N; ++i)
      if (mn::better_min(mn::Arg{dg[i], i, 0.0}, m)) m = mn::Arg{dg[i], i, 0.0};
    lam[m.i < N ? m.i : 0] = 1.0;
    done = true;
  }
  if (!done) {  // best pair: thread (warp, lane) scans i = warp + 8m, j = i + 1 + lane + 32n
    mn::Arg best{INFINITY, N * N, 0.5};
    for (int warp = 0; warp < mn::kWarps; ++warp)
      for (int lane = 0; lane < 32; ++lane) {
        double bv = INFINITY, bg = 0.5;
        long long bi = N, bj = N;
        for (long long i = warp; i < N; i += mn::kWarps)
          for (long long j = i + 1 + lane; j < N; j += 32) {
            double g, val;
            mn::segment(dg[i], Gs[i * N + j], dg[j], g, val);
            if (mn::pair_better(val, i, j, bv, bi, bj)) {
              bv = val;
              bi = i;
              bj = j;
              bg = g;
            }
          }
        const mn::Arg c{bv, bi < N ? bi * N + bj : N * N, bg};
        if (mn::better_min(c, best)) best = c;
      }
    if (best.i < N * N) {
      lam[best.i / N] = best.x;
      lam[best.i % N] = 1.0 - best.x;
    } else {
      lam[0] = 0.5;
      lam[1] = 0.5;
    }
  }
  recompute_v(Gs, N, lam, v);
  long long it = 0;
  for (;; ++it) {
    if (it > 0 && it % mn::kRecompute == 0) recompute_v(Gs, N, lam, v);
    mn::Arg t, a;
    double q;
    scan(N, lam, v, t, a, q);
    const double gap = q - t.v;
    if (mn::converged(gap, q, tol_rel, tol_abs, dmax)) break;
    if (it >= max_iter) break;
    const bool has_a = a.i < N;
    const mn::Step st = mn::plan(method, N, q, gap, t, a, dg[t.i], has_a ? dg[a.i] : 0.0, has_a ? Gs[a.i * N + t.i] : 0.0);
    if (st.kind == mn::kStop) break;
    const double* gt = Gs.data() + t.i * N;
    const double* ga = has_a ? Gs.data() + a.i * N : gt;
    for (long long i = 0; i < N; ++i) mn::update(st, i, lam[i], v[i], gt[i], ga[i]);
  }
  recompute_v(Gs, N, lam, v);
  mn::Arg t, a;
  double q;
  scan(N, lam, v, t, a, q);
  std::printf("%lld", it);
  put(q - t.v);
  for (double x : lam) put(x);
  std::printf("\n");
}

FK_HOST_COMMAND(segment) {
  const double a = rd(in), b = rd(in), c = rd(in);
  double g, val;
  mn::segment(a, b, c, g, val);
  std::printf("ok");
  put(g);
  put(val);
  std::printf("\n");
}

FK_HOST_COMMAND(gsmem) {
  const long long N = ri(in), budget = ri(in);
  std::printf("%d %lld\n", mn::g_in_smem(N, (size_t)budget) ? 1 : 0, (long long)mn::vec_smem_bytes(N));
}

FK_HOST_COMMAND(minnorm) {
  minnorm(in);
}
