// Host harness commands of gram (csrc/cuda/gram.cuh), driven by tests/test_gram.py.
// Protocol: see harness.h; one line in, one line out:
//   gramplan k K d sym eb                  -> path_r tile kp Kp pairs part_cols nparts ws_bytes
//   gram eb k K d sym rows[k if !sym] U[K*d] -> parts G[k*K] (gram emulated: plan, path R per thread + block
//                                           reduction, or path T's loader slots, warp tiles and fragments through
//                                           an mma.m8n8k4 built from the PTX layout; then the part reduction).
//                                           ERR on a slot, tile or output element covered other than once
//   gramred n ws[n]                        -> the final reduction of one element over n parts
#include "harness.h"

#include "gram.cuh"

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

FK_HOST_COMMAND(gramplan) {
  const long long k = ri(in), K = ri(in), d = ri(in), sym = ri(in), eb = ri(in);
  const gm::Plan pl = gm::plan(k, K, d, sym != 0, (int)eb);
  std::printf("%d %d %lld %lld %lld %lld %lld %lld\n", pl.path_r ? 1 : 0, pl.tile, (long long)pl.kp, (long long)pl.Kp,
              (long long)pl.pairs, (long long)pl.part_cols, (long long)pl.nparts,
              (long long)gm::workspace_bytes(pl));
}

FK_HOST_COMMAND(gram) {
  gram_cmd(in);
}

FK_HOST_COMMAND(gramred) {
  const long long n = ri(in);
  std::vector<double> w(n);
  for (auto& x : w) x = rd(in);
  double part[gm::kRedWarps];
  for (int q = 0; q < gm::kRedWarps; ++q) part[q] = gm::red_partial(w.data(), n, 1, 0, q);
  std::printf("ok");
  put(gm::red_combine(part));
  std::printf("\n");
}
