// Host harness of the CUDA kernels' per-thread logic (tests/test_cuda_host.py builds and drives it).
// Compiled with g++ (no nvcc, no GPU): the FK_HD functions of csrc/cuda/*.cuh become plain inline
// functions, and this file emulates the kernels' thread grids around them. Protocol: one command
// per line on stdin, numbers as C99 hex floats (exact) or decimal integers; one answer line each.
//   wsum A V vec K d n alpha wide  U[K*d] coef[n] rows[n] base[d or empty: flag] -> out[d] | ERR
//   vecok u ld_bytes K out base                                                    -> 0/1
//   fits alpha c                                                                   -> 0/1
//   wfin x                                 -> wsum::finite<float>((float)x) wsum::finite<double>(x): 0/1 0/1
//   pivot k n col[n]                                                               -> warp_p block_p
//   lusolve n m LU[n*n] piv[n] R[n*m]                                              -> X[n*m]
//   arrow K m inv_den coef[3K] r0[m] R[K*m]                                        -> x[m] I[K*m]
//   finite V size u_off K d ld U[K*ld]       -> vec ok[K] (rows scanned as finite_kernel's blocks; ERR on a
//                                       column covered other than once or a misaligned vector load)
//   segment a b c                           -> g val (mn::segment)
//   gsmem N budget                          -> 1/0 (G in shared memory) and the bytes of lam, v, diag
//   minnorm N method init max_iter tol_rel tol_abs has_lam0 G[N*N] lam0[N if has_lam0]
//                                        -> it gap lam[N]: min_norm_kernel emulated (256 threads: per-thread
//                                           scan parts, warp butterflies, warps in index order; one warp
//                                           per row in the v recompute) around the mn:: functions
//   bestep A path nt K d has_s c dt inv_den coef[4K] xc[d] Icur[K*d] xc0[d] U[K*d] Ik[K*d] S[d if has_s]
//                                        -> x'[d] I'[K*d] max|dsum| max|e|: be_step_kernel emulated (path 0 registers,
//                                           1 shared-memory slots, 2 recompute; nt threads, 3 blocks grid-stride)
//   besmem K acc_bytes budget              -> nt bytes (be::smem_threads / smem_bytes)
//   gramplan k K d sym eb                  -> path_r tile kp Kp pairs part_cols nparts ws_bytes
//   gram eb k K d sym rows[k if !sym] U[K*d] -> parts G[k*K] (gram emulated: plan, path R per thread + block
//                                           reduction, or path T's loader slots, warp tiles and fragments through
//                                           an mma.m8n8k4 built from the PTX layout; then the part reduction).
//                                           ERR on a slot, tile or output element covered other than once
//   gramred n ws[n]                        -> the final reduction of one element over n parts
//   kstats eb K d U[K*d] p[K]               -> nparts TW dot[K] nsq[K] nbar: kstats_parts emulated (ks::plan; per
//                                           tile, phase 1's threads over (column, row group), phase 2's warps
//                                           over rows and lanes over columns, the butterfly warp sum), then
//                                           kstats_final's part sums. ERR on an element of U read other than
//                                           once per phase
//   select mode K d lo hi U[K*d]            -> out[d]: select_kernel's columns through sel:: (mode 0:
//                                           order_mean(lo, hi); 1: closest_mean(beta = lo)) and the rows'
//                                           finite flags ok[K] (as the kernel stores them)
//   gcplan n rows[n] cols[n]         -> items, then per tensor: path and how often each row was covered
//                                       (emulating every block's gc::item and the per-path row loops)
// wsum emulates weighted_sum_kernel: every (block, thread, element) through wsum::col, the staged
// coefficient (A)(alpha*coef[i]) or NaN for a bad row, wsum::accumulate in row order, then base.
// A = 4 (float accumulation, data given as float: fp16/bf16 values are exact in float) or 8.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

// the per-thread logic only: the launcher sections of the .cuh files need the CUDA runtime headers
#define FEDKERNELS_HD_ONLY
#include "fedecado_be_step.cuh"
#include "finite_rows.cuh"
#include "gc_project.cuh"
#include "gram.cuh"
#include "kstats.cuh"
#include "lu.cuh"
#include "min_norm.cuh"
#include "select.cuh"
#include "weighted_sum.cuh"

using namespace fedkernels::cuda;

static double rd(std::istream& in) {
  std::string s;
  in >> s;
  return std::strtod(s.c_str(), nullptr);
}
static long long ri(std::istream& in) {
  long long v;
  in >> v;
  return v;
}
static void put(double v) { std::printf(" %a", v); }

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

// ---- min_norm emulation -------------------------------------------------------------------------------
// warp_sum: butterfly x_l + x_{l^o} for o = 16..1 (every lane ends with lane 0's value)
static double butterfly(double x[32]) {
  for (int o = 16; o > 0; o >>= 1) {
    double y[32];
    for (int l = 0; l < 32; ++l) y[l] = x[l] + x[l ^ o];
    for (int l = 0; l < 32; ++l) x[l] = y[l];
  }
  return x[0];
}
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

// ---- fedecado_be_step emulation ------------------------------------------------------------------------
template <typename A>
static bool bestep_emulate(int path, int nt, long long K, long long d, bool has_s, double c_, double dt_,
                           double inv_den_, const std::vector<double>& coef, const std::vector<double>& xc,
                           const std::vector<double>& Icur, const std::vector<double>& xc0, const std::vector<double>& U,
                           const std::vector<double>& Ik, const std::vector<double>& S, std::vector<double>& xo,
                           std::vector<double>& Io, double& mc_out, double& me_out) {
  const A c = (A)c_, dt = (A)dt_, inv_den = (A)inv_den_;
  auto thn = [&](long long i) { return (A)coef[i]; };
  auto dth = [&](long long i) { return (A)coef[K + i]; };
  auto ig = [&](long long i) { return (A)coef[2 * K + i]; };
  auto ia = [&](long long i) { return (A)coef[3 * K + i]; };
  const long long grid = 3;
  std::vector<int> hits(d, 0);
  std::vector<A> slots(path == 1 ? be::smem_bytes(K, sizeof(A), nt) / sizeof(A) : 0);
  std::vector<int> owner(slots.size(), -1);
  bool ok = true;
  A mc = A(0), me = A(0);
  for (long long b = 0; b < grid; ++b)
    for (int tid = 0; tid < nt; ++tid)
      for (long long j = be::first_col(b, tid, nt); j < d; j += be::col_step(grid, nt)) {
        ++hits[j];
        const A x0 = (A)xc0[j];
        std::vector<A> r(K), q(K);
        A acc = A(0), sI = A(0);
        auto client = [&](long long i, A& rv, A& qv, A& icv) {
          icv = (A)Icur[i * d + j];
          be::rhs(x0, (A)U[i * d + j], icv, (A)Ik[i * d + j], thn(i), dth(i), ig(i), c, rv, qv);
        };
        for (long long i = 0; i < K; ++i) {
          A rv, qv, icv;
          client(i, rv, qv, icv);
          if (path == 0) {
            r[i] = rv;
            q[i] = qv;
          } else if (path == 1) {
            for (int w = 0; w < 2; ++w) {
              const long long sl = be::slot(w, i, tid, K, nt);
              if (sl < 0 || sl >= (long long)slots.size() || (owner[sl] != -1 && owner[sl] != tid)) ok = false;
              else owner[sl] = tid;
            }
            if (ok) {
              slots[be::slot(0, i, tid, K, nt)] = rv;
              slots[be::slot(1, i, tid, K, nt)] = qv;
            }
          }
          acc += ia(i) * rv;
          sI += icv;
        }
        const A xcj = (A)xc[j];
        const A x = be::x_new(xcj, has_s, has_s ? (A)S[j] : A(0), dt, acc, inv_den);
        const A xs = x;  // the stored value: A is the data type here (float for fp32, double for fp64)
        xo[j] = (double)xs;
        const A dx = xs - xcj;
        A sIn = A(0);
        for (long long i = 0; i < K; ++i) {
          A rv, qv, icv;
          if (path == 0) {
            rv = r[i];
            qv = q[i];
          } else if (path == 1) {
            if (!ok) break;
            rv = slots[be::slot(0, i, tid, K, nt)];
            qv = slots[be::slot(1, i, tid, K, nt)];
          } else {
            client(i, rv, qv, icv);
          }
          const A In = be::flow(rv, c, x, ia(i));
          Io[i * d + j] = (double)In;
          sIn += In;
          me = std::fmax(me, be::err(qv, ig(i), In, dx));
        }
        mc = std::fmax(mc, be::abs_nan_inf(sIn - sI));
      }
  for (int h : hits) ok = ok && h == 1;
  mc_out = (double)mc;
  me_out = (double)me;
  return ok;
}

// ---- gram emulation ------------------------------------------------------------------------------------
struct GramEmu {
  long long k, K, d;
  bool sym;
  const std::vector<long long>& rows;
  const std::vector<double>& U;
  gm::Plan pl;
  std::vector<double> ws;
  std::vector<int> written;  // per part and element: how often written
  bool ok = true;
  long long urow(long long ia) const {  // -1 none, -2 bad
    if (ia >= k) return -1;
    const long long r = sym ? ia : rows[ia];
    return (r < 0 || r >= K) ? -2 : r;
  }
  void put_ws(long long part, long long i, long long j, double v) {
    const long long e = (part * pl.kp + i) * pl.Kp + j;
    ws[e] = v;
    ++written[e];
  }
  void path_r() {
    const long long ti = gm::ceil_div(k, gm::kTileR), tj = gm::ceil_div(K, gm::kTileR);
    for (long long p = 0; p < pl.pairs; ++p)
      for (long long part = 0; part < pl.nparts; ++part) {
        int64_t I, J;
        gm::pair_of(p, ti, tj, sym, I, J);
        const bool diag = sym && I == J;
        const long long c0 = part * pl.part_cols, c1 = std::min(d, c0 + pl.part_cols);
        static double acc[gm::kThreadsR][8][8];
        for (int tid = 0; tid < gm::kThreadsR; ++tid) {
          for (auto& a : acc[tid])
            for (auto& x : a) x = 0.0;
          for (long long c = gm::r_first_col(c0, tid); c < c1; c += gm::kStepR) {
            double a[8], b[8];
            for (int r = 0; r < 8; ++r) {
              const long long ua = urow(I * 8 + r);
              a[r] = ua >= 0 ? U[ua * d + c] : 0.0;
              const long long jb = J * 8 + r;
              b[r] = jb < K ? U[jb * d + c] : 0.0;
            }
            for (int i = 0; i < 8; ++i)
              for (int j = diag ? i : 0; j < 8; ++j) acc[tid][i][j] = std::fma(a[i], diag ? a[j] : b[j], acc[tid][i][j]);
          }
        }
        for (int i = 0; i < 8; ++i)
          for (int j = 0; j < 8; ++j) {
            double s = 0.0;
            for (int w = 0; w < gm::kThreadsR / 32; ++w) {
              double x[32];
              for (int l = 0; l < 32; ++l) x[l] = acc[w * 32 + l][i][j];
              const double ws_ = butterfly(x);
              s = w == 0 ? ws_ : s + ws_;
            }
            const long long ia = I * 8 + i;
            put_ws(part, ia, J * 8 + j, urow(ia) == -2 ? NAN : s);
          }
      }
  }
  template <int EB, bool DIAG>
  void path_t() {
    using St = gm::Stage<EB, DIAG>;
    const long long ti = gm::ceil_div(k, gm::kTileT), tj = gm::ceil_div(K, gm::kTileT);
    const long long nd = gm::num_diag_pairs(K, sym);
    const long long nblocks = DIAG ? nd : pl.pairs - nd;
    std::vector<double> X(St::rows * St::ld);
    std::vector<int> cover(St::rows * St::ld);
    for (long long blk = 0; blk < nblocks; ++blk)
      for (long long part = 0; part < pl.nparts; ++part) {
        int64_t I = blk, J = blk;
        if (!DIAG) gm::offdiag_pair(blk, ti, tj, sym, I, J);
        if (I > J && sym) ok = false;
        std::vector<long long> srow(St::rows);
        for (int r = 0; r < St::rows; ++r) {
          if (r < gm::kTileT) {
            srow[r] = urow(I * gm::kTileT + r);
          } else {
            const long long jb = J * gm::kTileT + (r - gm::kTileT);
            srow[r] = jb < K ? jb : -1;
          }
        }
        const long long nI = k - I * gm::kTileT, nJ = K - J * gm::kTileT;
        const long long c0 = part * pl.part_cols, c1 = std::min(d, c0 + pl.part_cols);
        static double acc[gm::kWarpsT][32][gm::kWarpTiles][gm::kWarpTiles][2];
        for (auto& a : acc)
          for (auto& b : a)
            for (auto& c : b)
              for (auto& e : c) e[0] = e[1] = 0.0;
        const double* Bp = DIAG ? X.data() : X.data() + gm::kTileT * St::ld;
        for (long long s0 = c0; s0 < c1; s0 += St::cols) {
          std::fill(cover.begin(), cover.end(), 0);
          for (int tid = 0; tid < gm::kThreadsT; ++tid)
            for (int q = 0; q < St::slots; ++q) {
              int r, cc;
              gm::load_slot(tid, q, St::cols, r, cc);
              if (r < 0 || r >= St::rows || cc < 0 || cc >= St::cols) {
                ok = false;
                continue;
              }
              const long long c = s0 + cc, u = srow[r];
              X[r * St::ld + cc] = (c < c1 && u >= 0) ? U[u * d + c] : 0.0;
              ++cover[r * St::ld + cc];
            }
          for (int r = 0; r < St::rows; ++r)
            for (int cc = 0; cc < St::cols; ++cc) ok = ok && cover[r * St::ld + cc] == 1;
          for (int w = 0; w < gm::kWarpsT; ++w)
            for (int kk = 0; kk < St::cols / 4; ++kk)
              for (int m = 0; m < gm::kWarpTiles; ++m)
                for (int n = 0; n < gm::kWarpTiles; ++n) {
                  const int a = gm::warp_row_tile(w, m), b = gm::warp_col_tile(w, n);
                  if (!gm::tile_active(a, b, nI, nJ, DIAG)) continue;
                  // mma.m8n8k4 as the PTX ISA lays it out: A[lane/4][lane%4], B[lane%4][lane/4],
                  // C[lane/4][2 (lane%4) + v]; D = A B + C, the 4 products added in k order here
                  double A[8][4], B[4][8], C[8][8];
                  for (int l = 0; l < 32; ++l) {
                    A[l / 4][l % 4] = X[gm::frag_index(a, kk, l, St::ld)];
                    B[l % 4][l / 4] = Bp[gm::frag_index(b, kk, l, St::ld)];
                    for (int v = 0; v < 2; ++v) C[l / 4][2 * (l % 4) + v] = acc[w][l][m][n][v];
                  }
                  for (int r = 0; r < 8; ++r)
                    for (int c = 0; c < 8; ++c) {
                      double t = C[r][c];
                      for (int q = 0; q < 4; ++q) t = std::fma(A[r][q], B[q][c], t);
                      C[r][c] = t;
                    }
                  for (int l = 0; l < 32; ++l)
                    for (int v = 0; v < 2; ++v) acc[w][l][m][n][v] = C[l / 4][2 * (l % 4) + v];
                }
        }
        for (int w = 0; w < gm::kWarpsT; ++w)
          for (int m = 0; m < gm::kWarpTiles; ++m)
            for (int n = 0; n < gm::kWarpTiles; ++n) {
              const int a = gm::warp_row_tile(w, m), b = gm::warp_col_tile(w, n);
              if (!gm::tile_active(a, b, nI, nJ, DIAG)) continue;
              for (int l = 0; l < 32; ++l)
                for (int v = 0; v < 2; ++v) {
                  int r, c;
                  gm::acc_pos(l, v, r, c);
                  const int lr = a * 8 + r;
                  put_ws(part, I * gm::kTileT + lr, J * gm::kTileT + b * 8 + c,
                         srow[lr] == -2 ? NAN : acc[w][l][m][n][v]);
                }
            }
      }
  }
  std::vector<double> reduce() {
    std::vector<double> G(k * K, -12345.0);
    for (long long i = 0; i < k; ++i)
      for (long long j = 0; j < K; ++j) {
        if (sym && i > j) continue;
        for (long long p = 0; p < pl.nparts; ++p) ok = ok && written[(p * pl.kp + i) * pl.Kp + j] == 1;
        double part[gm::kRedWarps];
        for (int w = 0; w < gm::kRedWarps; ++w) part[w] = gm::red_partial(ws.data(), pl.nparts, pl.kp * pl.Kp, i * pl.Kp + j, w);
        const double t = gm::red_combine(part);
        G[i * K + j] = t;
        if (sym && i != j) G[j * K + i] = t;
      }
    return G;
  }
};

static void gram_cmd(std::istream& in) {
  const int eb = (int)ri(in);
  const long long k0 = ri(in), K = ri(in), d = ri(in);
  const bool sym = ri(in) != 0;
  const long long k = sym ? K : k0;
  std::vector<long long> rows(sym ? 0 : k);
  for (auto& r : rows) r = ri(in);
  std::vector<double> U(K * d);
  for (auto& x : U) x = rd(in);
  GramEmu g{k, K, d, sym, rows, U, gm::plan(k, K, d, sym, eb)};
  g.ws.assign(g.pl.nparts * g.pl.kp * g.pl.Kp, 0.0);
  g.written.assign(g.ws.size(), 0);
  if (g.pl.path_r) {
    g.path_r();
  } else {
    if (eb == 8) {
      if (sym) g.path_t<8, true>();
      g.path_t<8, false>();
    } else if (eb == 4) {
      if (sym) g.path_t<4, true>();
      g.path_t<4, false>();
    } else {
      if (sym) g.path_t<2, true>();
      g.path_t<2, false>();
    }
  }
  const std::vector<double> G = g.reduce();
  if (!g.ok) {
    std::printf("ERR gram coverage\n");
    return;
  }
  std::printf("%lld", (long long)g.pl.nparts);
  for (double v : G) put(v);
  std::printf("\n");
}

static void select_cmd(std::istream& in) {
  const long long mode = ri(in), K = ri(in), d = ri(in), lo = ri(in), hi = ri(in);
  std::vector<double> U(K * d);
  for (auto& x : U) x = rd(in);
  std::vector<int> ok(K, 1);
  std::printf("ok");
  for (long long j = 0; j < d; ++j) {   // one emulated thread per column
    auto x = [&](int64_t i) -> double { return U[i * d + j]; };
    for (long long i = 0; i < K; ++i)
      if (x(i) - x(i) != 0.0) ok[i] = 0;
    put(mode == 1 ? sel::closest_mean_col(x, K, lo) : sel::order_mean_col(x, K, lo, hi));
  }
  for (long long i = 0; i < K; ++i) std::printf(" %d", ok[i]);
  std::printf("\n");
}

static void kstats_cmd(std::istream& in) {
  const long long eb = ri(in), K = ri(in), d = ri(in);
  std::vector<double> U(K * d), p(K);
  for (auto& x : U) x = rd(in);
  for (auto& x : p) x = rd(in);
  const ks::Plan pl = ks::plan(K, d, eb);
  const int64_t stride = 2 * K + 1, TW = pl.TW, G = ks::mean_groups(TW);
  std::vector<double> part(pl.nparts * stride, 0.0);
  std::vector<int> c1(K * d, 0), c2(K * d, 0);
  for (int64_t b = 0; b < pl.nparts; ++b) {
    double* dot = part.data() + b * stride;
    for (int64_t ti = 0; ti < pl.tpp; ++ti) {
      const int64_t j0 = (b * pl.tpp + ti) * TW;
      if (j0 >= d) break;
      const bool first = ti == 0;
      double smean[ks::kThreads], mean[256];
      for (int t = 0; t < ks::kThreads; ++t) {
        const int64_t c = ks::mean_col(t, TW), g = ks::mean_group(t, TW);
        double s = 0.0;
        if (j0 + c < d)
          for (int64_t k = g; k < K; k += G) {
            s += p[k] * U[k * d + j0 + c];
            ++c1[k * d + j0 + c];
          }
        smean[t] = s;
      }
      for (int t = 0; t < TW; ++t) {
        double m = smean[t];
        for (int64_t q = 1; q < G; ++q) m += smean[q * TW + t];
        mean[t] = m;
      }
      for (int w = 0; w < ks::kWarps; ++w)
        for (int64_t k = ks::row_first(w); k < K; k += ks::kWarps) {
          double sd[32], sn[32];
          for (int l = 0; l < 32; ++l) {
            sd[l] = sn[l] = 0.0;
            for (int64_t j = l; j < TW; j += 32)
              if (j0 + j < d) {
                const double v = U[k * d + j0 + j];
                ++c2[k * d + j0 + j];
                sd[l] += v * mean[j];
                sn[l] += v * v;
              }
          }
          const double a = butterfly(sd), q = butterfly(sn);
          dot[k] = first ? a : dot[k] + a;
          dot[K + k] = first ? q : dot[K + k] + q;
        }
      double sm[32];
      for (int l = 0; l < 32; ++l) {
        sm[l] = 0.0;
        for (int64_t j = l; j < TW; j += 32) sm[l] += mean[j] * mean[j];
      }
      const double a = butterfly(sm);
      dot[2 * K] = first ? a : dot[2 * K] + a;
    }
  }
  for (int64_t i = 0; i < K * d; ++i)
    if (c1[i] != 1 || c2[i] != 1) {
      std::printf("ERR kstats coverage\n");
      return;
    }
  std::printf("%lld %lld", (long long)pl.nparts, (long long)TW);
  for (int64_t i = 0; i < 2 * K + 1; ++i) put(ks::parts_sum(part.data(), pl.nparts, stride, i));
  std::printf("\n");
}

int main() {
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    if (cmd == "fits") {
      const double a = rd(in), c = rd(in);
      std::printf("%d\n", wsum::fits_float(a, c) ? 1 : 0);
    } else if (cmd == "wfin") {
      const double x = rd(in);
      std::printf("%d %d\n", wsum::finite<float>((float)x) ? 1 : 0, wsum::finite<double>(x) ? 1 : 0);
    } else if (cmd == "vecok") {
      const long long u = ri(in), ldb = ri(in), K = ri(in), o = ri(in), b = ri(in);
      std::printf("%d\n", wsum::vec_ok((uintptr_t)u, ldb, K, (uintptr_t)o, (uintptr_t)b) ? 1 : 0);
    } else if (cmd == "wsum") {
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
        continue;
      }
      std::printf("%d", w ? 1 : 0);
      for (double v : out) put(v);
      std::printf("\n");
    } else if (cmd == "pivot") {
      const int k = (int)ri(in), n = (int)ri(in);
      std::vector<double> col(n);
      for (auto& x : col) x = rd(in);
      // warp kernel: lane i holds row i (n <= 32), butterfly over 32 lanes
      int warp_p = -1;
      if (n <= 32) {
        lu::PivotKey lanes[32];
        for (int l = 0; l < 32; ++l) lanes[l] = lu::pivot_key(l < n ? col[l] : 0.0, l, k, n);
        for (int o = 16; o > 0; o >>= 1) {
          lu::PivotKey nxt[32];
          for (int l = 0; l < 32; ++l) {
            nxt[l] = lanes[l];
            if (lu::pivot_better(lanes[l ^ o], lanes[l])) nxt[l] = lanes[l ^ o];
          }
          for (int l = 0; l < 32; ++l) lanes[l] = nxt[l];
        }
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
      for (int o = 16; o > 0; o >>= 1) {
        lu::PivotKey nxt[32];
        for (int l = 0; l < 32; ++l) {
          nxt[l] = lanes[l];
          if (lu::pivot_better(lanes[l ^ o], lanes[l])) nxt[l] = lanes[l ^ o];
        }
        for (int l = 0; l < 32; ++l) lanes[l] = nxt[l];
      }
      int block_p = lanes[0].i;
      for (int l = 1; l < 32; ++l)
        if (lanes[l].i != block_p) block_p = -2;
      std::printf("%d %d\n", warp_p, block_p);
    } else if (cmd == "lusolve") {
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
    } else if (cmd == "arrow") {
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
    } else if (cmd == "finite") {
      // finite_kernel: V elements per 16-byte vector, element size `size`, U's base at byte address u_off
      const int V = (int)ri(in), size = (int)ri(in);
      const long long u_off = ri(in), K = ri(in), d = ri(in), ld = ri(in);
      std::vector<double> U(K * ld);
      for (auto& x : U) x = rd(in);
      const bool vec = fr::vec_ok((uintptr_t)u_off, ld * size, K);
      const long long nch = fr::num_chunks(d, V);
      std::vector<int> hits(K * d, 0);
      std::vector<int> ok(K, 1);
      bool misaligned = false;
      for (long long b = 0; b < K * nch; ++b) {
        int64_t row, j0;
        fr::block_span(b, nch, V, row, j0);
        bool any = false;
        for (int tid = 0; tid < fr::kThreads; ++tid) {
          if (vec && fr::full_chunk(j0, d, V)) {
            for (int u = 0; u < fr::kUnroll; ++u) {
              const long long j = fr::vec_col(j0, u, tid, V, 0);
              if ((u_off + (row * ld + j) * size) % 16 != 0) misaligned = true;
              for (int e = 0; e < V; ++e) {
                const long long jj = fr::vec_col(j0, u, tid, V, e);
                if (jj >= d) { misaligned = true; continue; }  // a vector past the row end
                ++hits[row * d + jj];
                any |= fr::bad(U[row * ld + jj]);
              }
            }
          } else {
            for (long long s = 0; s < (long long)V * fr::kUnroll; ++s) {
              const long long j = fr::scalar_col(j0, s, tid);
              if (j >= d) continue;
              ++hits[row * d + j];
              any |= fr::bad(U[row * ld + j]);
            }
          }
        }
        if (any) ok[row] = 0;  // __syncthreads_or, then thread 0 writes false
      }
      bool cover = true;
      for (int h : hits) cover = cover && h == 1;
      if (!cover || misaligned) {
        std::printf("ERR finite coverage=%d misaligned=%d\n", (int)cover, (int)misaligned);
        std::fflush(stdout);
        continue;
      }
      std::printf("%d", vec ? 1 : 0);
      for (int v : ok) std::printf(" %d", v);
      std::printf("\n");
    } else if (cmd == "segment") {
      const double a = rd(in), b = rd(in), c = rd(in);
      double g, val;
      mn::segment(a, b, c, g, val);
      std::printf("ok");
      put(g);
      put(val);
      std::printf("\n");
    } else if (cmd == "gsmem") {
      const long long N = ri(in), budget = ri(in);
      std::printf("%d %lld\n", mn::g_in_smem(N, (size_t)budget) ? 1 : 0, (long long)mn::vec_smem_bytes(N));
    } else if (cmd == "minnorm") {
      minnorm(in);
    } else if (cmd == "besmem") {
      const long long K = ri(in), ab = ri(in), budget = ri(in);
      const int nt = be::smem_threads(K, (int)ab, (size_t)budget);
      std::printf("%d %lld\n", nt, nt ? (long long)be::smem_bytes(K, (int)ab, nt) : 0LL);
    } else if (cmd == "bestep") {
      const int A = (int)ri(in), path = (int)ri(in), nt = (int)ri(in);
      const long long K = ri(in), d = ri(in);
      const int has_s = (int)ri(in);
      const double c = rd(in), dt = rd(in), inv_den = rd(in);
      std::vector<double> coef(4 * K), xc(d), Icur(K * d), xc0(d), U(K * d), Ik(K * d), S(has_s ? d : 0);
      for (auto* v : {&coef, &xc, &Icur, &xc0, &U, &Ik, &S})
        for (auto& x : *v) x = rd(in);
      std::vector<double> xo(d), Io(K * d);
      double mc = 0, me = 0;
      const bool ok = A == 4 ? bestep_emulate<float>(path, nt, K, d, has_s, c, dt, inv_den, coef, xc, Icur, xc0, U, Ik, S,
                                                     xo, Io, mc, me)
                             : bestep_emulate<double>(path, nt, K, d, has_s, c, dt, inv_den, coef, xc, Icur, xc0, U, Ik,
                                                      S, xo, Io, mc, me);
      if (!ok) {
        std::printf("ERR bestep coverage or slot ownership\n");
        std::fflush(stdout);
        continue;
      }
      std::printf("ok");
      for (double v : xo) put(v);
      for (double v : Io) put(v);
      put(mc);
      put(me);
      std::printf("\n");
    } else if (cmd == "gramplan") {
      const long long k = ri(in), K = ri(in), d = ri(in), sym = ri(in), eb = ri(in);
      const gm::Plan pl = gm::plan(k, K, d, sym != 0, (int)eb);
      std::printf("%d %d %lld %lld %lld %lld %lld %lld\n", pl.path_r ? 1 : 0, pl.tile, (long long)pl.kp, (long long)pl.Kp,
                  (long long)pl.pairs, (long long)pl.part_cols, (long long)pl.nparts,
                  (long long)gm::workspace_bytes(pl));
    } else if (cmd == "gram") {
      gram_cmd(in);
    } else if (cmd == "select") {
      select_cmd(in);
    } else if (cmd == "kstats") {
      kstats_cmd(in);
    } else if (cmd == "gramred") {
      const long long n = ri(in);
      std::vector<double> w(n);
      for (auto& x : w) x = rd(in);
      double part[gm::kRedWarps];
      for (int q = 0; q < gm::kRedWarps; ++q) part[q] = gm::red_partial(w.data(), n, 1, 0, q);
      std::printf("ok");
      put(gm::red_combine(part));
      std::printf("\n");
    } else if (cmd == "gcplan") {
      const long long n = ri(in);
      std::vector<GcTensor> t(n);
      for (auto& x : t) x.rows = ri(in);
      for (auto& x : t) x.cols = ri(in);
      const long long items = gc::plan(t.data(), n);
      std::vector<std::vector<int>> cover(n);
      for (long long i = 0; i < n; ++i) cover[i].assign(t[i].rows > 0 ? t[i].rows : 0, 0);
      for (long long b = 0; b < items; ++b) {  // one block per item
        int64_t ti, row0, nrows;
        gc::item(t.data(), n, b, ti, row0, nrows);
        if (t[ti].path == 0) {  // warp w handles rows row0 + rr * kWarps + w, rr < kRowsPerWarp
          for (int w = 0; w < gc::kWarps; ++w)
            for (int rr = 0; rr < gc::kRowsPerWarp; ++rr) {
              const int64_t r = row0 + (int64_t)rr * gc::kWarps + w;
              if (r >= row0 + nrows) break;
              ++cover[ti][r];
            }
        } else {
          ++cover[ti][row0];
        }
      }
      std::printf("%lld", items);
      for (long long i = 0; i < n; ++i) {
        int mn = 1 << 30, mx = 0;
        for (int c : cover[i]) {
          mn = c < mn ? c : mn;
          mx = c > mx ? c : mx;
        }
        if (cover[i].empty()) mn = mx = 1;
        std::printf(" %d:%d:%d", t[i].path, mn, mx);
      }
      std::printf("\n");
    } else if (!cmd.empty()) {
      std::printf("ERR unknown command %s\n", cmd.c_str());
    }
    std::fflush(stdout);
  }
  return 0;
}
