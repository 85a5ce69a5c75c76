// min_norm: minimum-norm point of the convex hull of K vectors, given their Gram matrix G.
//
//   lam = argmin_{lam in simplex} lam^T G lam
//
// All work is in float64 on the symmetrised Gram matrix (G + G^T)/2, or, with the optional `scale` s ([K],
// finite, > 0), on S = s_i s_j (G + G^T)/2 (= D G D with D = diag(s): FedAWARE's normalised Gram with
// s_i = 1 / ||m_i||, made in the same pass instead of two N x N divides by the caller). Methods:
//   away      Frank-Wolfe with away steps (default; linear convergence on the simplex)
//   pairwise  pairwise Frank-Wolfe (mass moves from the worst support vertex to the best vertex)
//   fw        plain Frank-Wolfe with exact line search (spec fedaware.md section 2.6)
//   code_compat  the authors' MinNormSolver FW: 0.999/0.001 corner nudges, stop when
//             ||lam_new - lam||_1 < 1e-5 and return the previous iterate, G lam recomputed each step.
// Stop (all but code_compat): FW duality gap q - min_i (G lam)_i <= tol_rel * q + tol_abs * max_i G_ii.
// v = G lam is maintained incrementally and recomputed from scratch every 64 iterations (drift).
// With polish=true, away and pairwise also run a face solve (see polish()) every 64 iterations
// and when max_iter is reached: exact minimisation over the current support's affine hull, which
// removes the slow linear-rate tail on ill-conditioned G (K in the hundreds, rank-deficient G).
// Ties are broken toward the smallest index everywhere, so results are deterministic.
// lam0 (optional) is a warm start that replaces the init (normalised to sum 1).
// Returns (lam [K] float64, iterations int64 scalar, gap float64 scalar); the gap is recomputed
// exactly (v = G lam) at the returned lam.
//
// Cost (s = support size, n = a polished face's size): G read once and (G + G^T)/2 written once
// (8 K^2 bytes each way, tile by tile, finiteness checked in the same pass; `scale` adds two multiplies
// per entry in that pass, no extra bytes but the [K] scale); the best_pair init's
// O(K^2/2) segment solves in that same pass (vectorised, on the tiles' rows of the upper triangle);
// O(K) per iteration (the vertex scan, the step) and O(s) for q; a recompute of v = G lam O(s K) (the
// support's rows of G: G is symmetric); a face solve gathers G_SS once (n^2) and costs O(n^2) per CG
// step. 1 thread, 2-core CPU (min of runs): K = 1000, d = 76 (FedAWARE's Gram, origin in the hull,
// s = 123, 128 iterations) 3.0 ms; K = 1000, d = 2000 (384 iterations) 5.3 ms; K = 100 0.16-0.19 ms,
// against 12.3, 30.6 and 0.43 ms with v = G lam recomputed row by row (O(K^2)) and (G + G^T)/2 read
// with a K stride. What is left at K = 1000: (G + G^T)/2 ~1.1 ms (memory bound: ~2x a copy of G), best_pair
// ~0.5 ms (compute: a division per pair).
// Determinism: every sum has a fixed order (v_i over j ascending, CG column sums over the face's
// indices ascending); one build gives the same bits for the same G at any thread count (the solve
// is single-threaded). Products are fused into their sums where the build target has FMA.
#include "common.h"
#include "../min_norm_checks.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <tuple>

namespace fedkernels {
namespace {

// min over gamma in [0,1] of |gamma u + (1-gamma) w|^2 with a=|u|^2, b=<u,w>, c=|w|^2.
inline void segment(double a, double b, double c, double& gamma, double& value) {
  const double den = a - 2.0 * b + c;
  const double r = (c - b) / den;  // unused when den <= 0 (computed anyway: BestPair::row's loop vectorises)
  gamma = den > 0.0 ? std::min(1.0, std::max(0.0, r)) : 0.5;
  value = gamma * gamma * a + 2.0 * gamma * (1.0 - gamma) * b + (1.0 - gamma) * (1.0 - gamma) * c;
}

// The authors' segment solve (MGDA MinNormSolver._min_norm_element_from2): weight on u.
inline void segment_code(double a, double b, double c, double& gamma, double& value) {
  if (b >= a) { gamma = 0.999; value = a; return; }
  if (b >= c) { gamma = 0.001; value = c; return; }
  gamma = -1.0 * ((b - c) / (a + c - 2.0 * b));
  value = c + gamma * (b - c);
}

struct State {
  int64_t K;
  const double* G;  // symmetric (the solver's (G + G^T)/2), row-major: column j is row j
  std::vector<double> lam, v;
  std::vector<int64_t> nz;  // lam's support (lam_i != 0), ascending, as the last recompute / scan found it
  double q = 0.0;
  explicit State(int64_t K_, const double* G_) : K(K_), G(G_), lam(K_, 0.0), v(K_, 0.0) { nz.reserve(K_); }
  // v = G lam as a sum of the support's columns: v_i = sum_{j ascending, lam_j != 0} G_ji lam_j, the terms
  // of the row-by-row dot product sum_j G_ij lam_j in its order (G symmetric; a zero lam_j would add +-0,
  // which leaves a sum that starts at +0 unchanged), O(|supp| K), read row by row (contiguous,
  // vectorised) instead of O(K^2) dependent adds. Each product is fused into its sum on an FMA target (a
  // row-by-row loop compiles into unfused products with a fused tail: other last bits).
  void recompute() {
    std::fill(v.begin(), v.end(), 0.0);
    nz.clear();
    double* vp = v.data();
    for (int64_t j = 0; j < K; ++j) {
      const double l = lam[j];
      if (l == 0.0) continue;
      nz.push_back(j);
      const double* gj = G + j * K;
      for (int64_t i = 0; i < K; ++i) vp[i] += gj[i] * l;
    }
    refresh_q(-1);
  }
  // q = lam' v over the support, ascending: the indices nz (lam_i != 0 before a step) and t (the one index
  // a step can make nonzero; -1: none), zero terms skipped. O(|supp|), not O(K).
  void refresh_q(int64_t t) {
    double s = 0.0;
    bool t_done = t < 0;
    for (const int64_t i : nz) {
      if (!t_done && t <= i) {
        if (t < i && lam[t] != 0.0) s += lam[t] * v[t];
        t_done = true;
      }
      if (lam[i] != 0.0) s += lam[i] * v[i];
    }
    if (!t_done && lam[t] != 0.0) s += lam[t] * v[t];
    q = s;
  }
  int64_t argmin_v() const {
    int64_t t = 0;
    for (int64_t i = 1; i < K; ++i)
      if (v[i] < v[t]) t = i;
    return t;
  }
};

// The default init's best vertex pair (fedaware.md 2.6): the least segment value over i < j, ties to the
// smallest (i, j) (the first in row-major order, as the plain double loop with a strict '<' finds it);
// (0, 1) with gamma 0.5 when no value is below +inf.
struct BestPair {
  double val = std::numeric_limits<double>::infinity();
  int64_t i = 0, j = 1;
  double gamma = 0.5;
  // pairs (i, j0 + c), c < n, from b_c = S_{i, j0+c}, a = S_ii and the diagonal dj_c = S_{j0+c, j0+c}: the
  // segments in one vectorised loop, the ordered scan only when the row's least value can win
  void row(int64_t i, int64_t j0, int64_t n, double a, const double* b, const double* dj) {
    alignas(64) double gam[32], v[32];
    double m = val;
    for (int64_t c = 0; c < n; ++c) segment(a, b[c], dj[c], gam[c], v[c]);
    for (int64_t c = 0; c < n; ++c) m = v[c] < m ? v[c] : m;
    if (!(m <= val)) return;
    for (int64_t c = 0; c < n; ++c)
      if (v[c] < val || (v[c] == val && (i < this->i || (i == this->i && j0 + c < j)))) {
        val = v[c]; this->i = i; j = j0 + c; gamma = gam[c];
      }
  }
};

// out = (X + X^T) / 2 by pairs of 32 x 32 tiles: X_JI is transposed into an L1 buffer, out_IJ is
// written row by row (vectorised) from X_IJ and that buffer, and out_JI as the transpose of out_IJ; a
// row-by-row pass instead reads X^T with a stride of K doubles (at K = 1000 a cache miss per entry).
// Bytes: X read once, out written once. 0.5 * (x + y) is commutative, so out is exactly symmetric with
// the bits of the plain loop. Entries that are not finite (in X, or x + y overflowing) are caught in
// the same pass (a per-column sum of out * 0); the first bad entry is then found row by row for the
// message. With `pair`, the best_pair init rides in the same pass, on out_IJ's rows while they are in L1.
void symmetrise(const double* X, int64_t K, const double* scale, double* out, BestPair* pair) {
  constexpr int64_t B = 32;
  alignas(64) double t[B * B];
  alignas(64) double ss[B];
  double chk[B] = {0.0};
  std::vector<double> diag;
  if (pair != nullptr) {
    diag.resize(K);
    for (int64_t i = 0; i < K; ++i)
      diag[i] = scale == nullptr ? 0.5 * (X[i * K + i] + X[i * K + i])
                                 : 0.5 * (X[i * K + i] + X[i * K + i]) * (scale[i] * scale[i]);
  }
  for (int64_t ib = 0; ib < K; ib += B) {
    const int64_t ni = std::min(B, K - ib);
    for (int64_t jb = ib; jb < K; jb += B) {
      const int64_t nj = std::min(B, K - jb);
      for (int64_t j = 0; j < nj; ++j) {  // t[i][j] = X[jb + j][ib + i]
        const double* xr = X + (jb + j) * K + ib;
        for (int64_t i = 0; i < ni; ++i) t[i * B + j] = xr[i];
      }
      for (int64_t i = 0; i < ni; ++i) {
        const double* xi = X + (ib + i) * K + jb;
        const double* ti = t + i * B;
        double* oi = out + (ib + i) * K + jb;
        if (scale == nullptr) {
          for (int64_t j = 0; j < nj; ++j) {
            const double m = 0.5 * (xi[j] + ti[j]);
            oi[j] = m;
            chk[j] += m * 0.0;
          }
        } else {  // s_i s_j (x + y) / 2: s_i s_j = s_j s_i (commutative), so out stays exactly symmetric
          const double si = scale[ib + i];
          for (int64_t j = 0; j < nj; ++j) ss[j] = si * scale[jb + j];
          for (int64_t j = 0; j < nj; ++j) {
            const double m = 0.5 * (xi[j] + ti[j]) * ss[j];
            oi[j] = m;
            chk[j] += m * 0.0;
          }
        }
        if (pair != nullptr) {  // pairs (ib + i, j) with j > ib + i in this tile
          const int64_t c0 = jb == ib ? i + 1 : 0;
          if (c0 < nj) pair->row(ib + i, jb + c0, nj - c0, diag[ib + i], oi + c0, diag.data() + jb + c0);
        }
      }
      if (jb == ib) continue;  // a diagonal tile is symmetric already
      for (int64_t j = 0; j < nj; ++j) {  // out[jb + j][ib + i] = out[ib + i][jb + j]
        double* oj = out + (jb + j) * K + ib;
        const double* src = out + ib * K + jb + j;
        for (int64_t i = 0; i < ni; ++i) oj[i] = src[i * K];
      }
    }
  }
  double c = 0.0;
  for (int64_t j = 0; j < B; ++j) c += chk[j];
  if (c == 0.0) return;
  for (int64_t i = 0; i < K * K; ++i)
    TORCH_CHECK_VALUE(std::isfinite(X[i]), "min_norm: G must be finite, got ", X[i], " at [", i / K, ", ", i % K,
                      "]");
  for (int64_t i = 0; i < K * K; ++i)
    TORCH_CHECK_VALUE(std::isfinite(out[i]), "min_norm: G: ", scale == nullptr ? "" : "s_i s_j ",
                      "(G + G^T) / 2 overflows at [", i / K, ", ", i % K,
                      "]: scale G down (the minimiser does not depend on the scale)");
}

enum class Method { Away, Pairwise, FW, CodeCompat };

Method parse_method(const std::string& m) {
  if (m == "away") return Method::Away;
  if (m == "pairwise") return Method::Pairwise;
  if (m == "fw") return Method::FW;
  if (m == "code_compat") return Method::CodeCompat;
  TORCH_CHECK(false, "min_norm: method must be one of 'away', 'pairwise', 'fw', 'code_compat', got '", m, "'");
}

// The authors' best pair init (code_compat): their segment solve and strict '<' against 1e8 -> inf.
// (The default best_pair init rides in symmetrise(): BestPair.)
void init_best_pair_code(State& s) {
  const int64_t K = s.K;
  const double* G = s.G;
  double best = std::numeric_limits<double>::infinity();
  int64_t bi = 0, bj = 1;
  double bg = 0.5;
  for (int64_t i = 0; i < K; ++i)
    for (int64_t j = i + 1; j < K; ++j) {
      double g, val;
      segment_code(G[i * K + i], G[i * K + j], G[j * K + j], g, val);
      if (val < best) { best = val; bi = i; bj = j; bg = g; }
    }
  s.lam[bi] = bg;
  s.lam[bj] = 1.0 - bg;
}

void init_min_diag(State& s) {
  int64_t t = 0;
  for (int64_t i = 1; i < s.K; ++i)
    if (s.G[i * s.K + i] < s.G[t * s.K + t]) t = i;
  s.lam[t] = 1.0;
}

// Face polish (active-set acceleration, used by away/pairwise when polish=true): minimise
// lam^T G lam over the affine hull of the current support S (sum fixed at 1) by projected
// conjugate gradients, then move from lam toward that minimiser as far as lam >= 0 allows
// (ratio test; ties -> smallest index); a blocking vertex leaves S and the face solve repeats.
// Every move is along a segment on which the convex objective does not increase, so q never
// rises; on a face whose minimiser is interior the result is exact to rounding, which removes
// Frank-Wolfe's slow tail on ill-conditioned G. G_SS is gathered once per face into a dense
// |S| x |S| block, whose products are column sums (contiguous, vectorised; fixed order): O(|S|^2)
// per CG step, at most |S| steps per face; the move's v = G lam is O(|S| K) (State::recompute).
void polish(State& s, double gdiag_max) {
  const int64_t K = s.K;
  const double* G = s.G;
  std::vector<int64_t> S;
  std::vector<double> x, g, r, p, Gp, GS;
  for (int64_t round = 0; round < K; ++round) {
    S.clear();
    for (int64_t i = 0; i < K; ++i)
      if (s.lam[i] > 0.0) S.push_back(i);
    const int64_t n = (int64_t)S.size();
    if (n <= 1) return;
    x.assign(n, 0.0); g.assign(n, 0.0); r.assign(n, 0.0); p.assign(n, 0.0); Gp.assign(n, 0.0);
    GS.resize(n * n);
    for (int64_t a = 0; a < n; ++a) {
      const double* ga = G + S[a] * K;
      double* da = GS.data() + a * n;
      for (int64_t b = 0; b < n; ++b) da[b] = ga[S[b]];
    }
    for (int64_t a = 0; a < n; ++a) x[a] = s.lam[S[a]];
    auto matvec = [&](const std::vector<double>& in, std::vector<double>& out) {  // out = G_SS in
      std::fill(out.begin(), out.end(), 0.0);
      double* o = out.data();
      for (int64_t b = 0; b < n; ++b) {
        const double w = in[b];
        const double* gb = GS.data() + b * n;  // column b of the symmetric G_SS
        for (int64_t a = 0; a < n; ++a) o[a] += gb[a] * w;
      }
    };
    auto project = [&](const std::vector<double>& in, std::vector<double>& out) {  // out = -(in - mean)
      double m = 0.0;
      for (int64_t a = 0; a < n; ++a) m += in[a];
      m /= (double)n;
      for (int64_t a = 0; a < n; ++a) out[a] = m - in[a];
    };
    matvec(x, g);
    project(g, r);
    p = r;
    double rr = 0.0;
    for (int64_t a = 0; a < n; ++a) rr += r[a] * r[a];
    const double stop = 1e-15 * std::max(gdiag_max, 1e-300);
    for (int64_t k = 0; k < n && rr > stop * stop; ++k) {
      matvec(p, Gp);
      double pGp = 0.0;
      for (int64_t a = 0; a < n; ++a) pGp += p[a] * Gp[a];
      if (!(pGp > 0.0)) break;
      const double alpha = rr / pGp;
      for (int64_t a = 0; a < n; ++a) { x[a] += alpha * p[a]; g[a] += alpha * Gp[a]; }
      project(g, r);
      double rr2 = 0.0;
      for (int64_t a = 0; a < n; ++a) rr2 += r[a] * r[a];
      const double beta = rr2 / rr;
      for (int64_t a = 0; a < n; ++a) p[a] = r[a] + beta * p[a];
      rr = rr2;
    }
    // Ratio test along x - lam_S.
    double tmax = 1.0;
    int64_t block = -1;
    for (int64_t a = 0; a < n; ++a) {
      const double dir = x[a] - s.lam[S[a]];
      if (dir < 0.0) {
        const double t = -s.lam[S[a]] / dir;
        if (t < tmax) { tmax = t; block = a; }
      }
    }
    if (!(tmax > 0.0)) return;
    // Only accept the move if it does not raise q (guards against CG rounding on singular faces).
    std::vector<double> old(s.lam);
    const double q_old = s.q;
    double sum = 0.0;
    for (int64_t a = 0; a < n; ++a) {
      double val = s.lam[S[a]] + tmax * (x[a] - s.lam[S[a]]);
      if (a == block || val < 0.0) val = 0.0;
      s.lam[S[a]] = val;
      sum += val;
    }
    for (int64_t a = 0; a < n; ++a) s.lam[S[a]] /= sum;
    s.recompute();
    if (s.q > q_old) {
      s.lam.swap(old);
      s.recompute();
      return;
    }
    if (block < 0) return;
  }
}

// Frank-Wolfe family (away / pairwise / fw). Returns iterations taken.
int64_t solve_fw(State& s, Method method, int64_t max_iter, double tol_rel, double tol_abs, double gdiag_max,
                 bool use_polish) {
  const int64_t K = s.K;
  const double* G = s.G;
  std::vector<double>& lam = s.lam;
  std::vector<double>& v = s.v;
  std::vector<int64_t>& nz = s.nz;
  s.recompute();
  int64_t it = 0;
  for (;; ++it) {
    if (it > 0 && it % 64 == 0) {
      if (use_polish && method != Method::FW) polish(s, gdiag_max);
      s.recompute();
    }
    // FW vertex t (argmin v) and away vertex a (argmax v over the support); smallest index on ties.
    int64_t t = 0, a = -1;
    nz.clear();
    for (int64_t i = 0; i < K; ++i) {
      if (v[i] < v[t]) t = i;
      if (lam[i] != 0.0) {
        nz.push_back(i);
        if (lam[i] > 0.0 && (a < 0 || v[i] > v[a])) a = i;
      }
    }
    const double q = s.q;
    const double gap = q - v[t];
    if (!(gap > tol_rel * q + tol_abs * gdiag_max)) break;
    if (it >= max_iter) {
      if (use_polish && method != Method::FW) polish(s, gdiag_max);
      break;
    }
    const double* gt = G + t * K;
    bool fw_step = true;
    if (method == Method::Away) {
      const double gap_away = v[a] - q;
      fw_step = gap >= gap_away || lam[a] >= 1.0;
    }
    if (method == Method::Pairwise) {
      if (a == t) break;
      const double* ga = G + a * K;
      const double slope = v[a] - v[t];  // -directional derivative / 2 along e_t - e_a
      if (!(slope > 0.0)) break;
      const double den = gt[t] - 2.0 * gt[a] + ga[a];
      const double gmax = lam[a];
      const double gamma = den > 0.0 ? std::min(gmax, slope / den) : gmax;
      if (!(gamma > 0.0)) break;
      lam[t] += gamma;
      if (gamma >= gmax) lam[a] = 0.0; else lam[a] -= gamma;
      for (int64_t i = 0; i < K; ++i) v[i] += gamma * (gt[i] - ga[i]);
    } else if (fw_step) {
      const double den = q - 2.0 * v[t] + gt[t];
      const double gamma = den > 0.0 ? std::min(1.0, gap / den) : 1.0;
      if (!(gamma > 0.0)) break;
      if (gamma >= 1.0) {
        for (int64_t i = 0; i < K; ++i) { lam[i] = 0.0; v[i] = gt[i]; }
        lam[t] = 1.0;
      } else {
        const double om = 1.0 - gamma;
        for (int64_t i = 0; i < K; ++i) { lam[i] *= om; v[i] = om * v[i] + gamma * gt[i]; }
        lam[t] += gamma;
      }
    } else {  // away step from vertex a
      const double* ga = G + a * K;
      const double gap_away = v[a] - q;
      const double gmax = lam[a] / (1.0 - lam[a]);
      const double den = q - 2.0 * v[a] + ga[a];
      const double gamma = den > 0.0 ? std::min(gmax, gap_away / den) : gmax;
      if (!(gamma > 0.0)) break;
      const double op = 1.0 + gamma;
      for (int64_t i = 0; i < K; ++i) { lam[i] *= op; v[i] = op * v[i] - gamma * ga[i]; }
      if (gamma >= gmax) lam[a] = 0.0; else lam[a] -= gamma;
    }
    s.refresh_q(t);
  }
  return it;
}

// The authors' FW (FedAWARE min_norm_solvers.find_min_norm_element_FW), iterations counted as
// loop passes. K < 3 returns the pair init.
int64_t solve_code_compat(State& s, int64_t max_iter) {
  const int64_t K = s.K;
  const double* G = s.G;
  if (K < 3) return 0;
  std::vector<double> nl(K);
  int64_t it = 0;
  for (; it < max_iter; ++it) {
    s.recompute();
    const int64_t t = s.argmin_v();
    const double v1v1 = s.q, v1v2 = s.v[t], v2v2 = G[t * K + t];
    double nc, nd;
    segment_code(v1v1, v1v2, v2v2, nc, nd);
    double change = 0.0;
    for (int64_t i = 0; i < K; ++i) nl[i] = nc * s.lam[i];
    nl[t] += 1.0 - nc;
    for (int64_t i = 0; i < K; ++i) change += std::abs(nl[i] - s.lam[i]);
    if (change < 1e-5) return it;  // the authors' iter_count: accepted updates
    s.lam.swap(nl);
  }
  return it;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> min_norm_cpu(const at::Tensor& Gin, int64_t max_iter, double tol_rel,
                                                            double tol_abs, c10::string_view method_sv,
                                                            c10::string_view init_sv, bool use_polish,
                                                            const c10::optional<at::Tensor>& lam0,
                                                            const c10::optional<at::Tensor>& scale) {
  const int64_t K = checks::min_norm_args(Gin, max_iter, tol_rel, tol_abs, init_sv, lam0, scale);
  const Method method = parse_method(std::string(method_sv));
  const std::string init(init_sv);

  auto G64 = Gin.to(at::kDouble).contiguous();
  std::unique_ptr<double[]> G(new double[K * K]);  // (uninitialised: symmetrise() writes every entry)
  const bool pair_init = K > 1 && !lam0.has_value() && method != Method::CodeCompat && init == "best_pair";
  BestPair pair;
  at::Tensor s64;
  if (scale.has_value()) {
    s64 = scale->to(at::kDouble).contiguous();
    const double* sp = s64.data_ptr<double>();
    for (int64_t i = 0; i < K; ++i)
      TORCH_CHECK_VALUE(std::isfinite(sp[i]) && sp[i] > 0.0, "min_norm: scale must be finite and > 0, got ", sp[i],
                        " at [", i, "]");
  }
  symmetrise(G64.data_ptr<double>(), K, s64.defined() ? s64.data_ptr<double>() : nullptr, G.get(),
             pair_init ? &pair : nullptr);
  double gdiag_max = 0.0;
  for (int64_t i = 0; i < K; ++i) gdiag_max = std::max(gdiag_max, std::abs(G[i * K + i]));

  State s(K, G.get());
  int64_t iters = 0;
  if (K == 1) {
    s.lam[0] = 1.0;
  } else {
    if (lam0.has_value()) {  // warm start: lam0 >= 0 with a positive sum, normalised here
      auto l64 = lam0->to(at::kDouble).contiguous();
      const double* lp = l64.data_ptr<double>();
      double sum = 0.0;
      for (int64_t i = 0; i < K; ++i) {
        TORCH_CHECK(std::isfinite(lp[i]) && lp[i] >= 0.0, "min_norm: lam0 must be finite and >= 0, got ", lp[i],
                    " at [", i, "]");
        sum += lp[i];
      }
      TORCH_CHECK(sum > 0.0, "min_norm: lam0 must have a positive sum");
      for (int64_t i = 0; i < K; ++i) s.lam[i] = lp[i] / sum;
    } else if (method == Method::CodeCompat) {
      init_best_pair_code(s);
    } else if (pair_init) {
      s.lam[pair.i] = pair.gamma;
      s.lam[pair.j] = 1.0 - pair.gamma;
    } else {
      init_min_diag(s);
    }
    if (method == Method::CodeCompat) iters = solve_code_compat(s, max_iter);
    else iters = solve_fw(s, method, max_iter, tol_rel, tol_abs, gdiag_max, use_polish);
  }
  s.recompute();
  const double gap = s.q - s.v[s.argmin_v()];

  auto opts = Gin.options().dtype(at::kDouble);
  auto lam = at::empty({K}, opts);
  std::copy(s.lam.begin(), s.lam.end(), lam.data_ptr<double>());
  auto it_t = at::empty({}, opts.dtype(at::kLong));
  it_t.data_ptr<int64_t>()[0] = iters;
  auto gap_t = at::empty({}, opts);
  gap_t.data_ptr<double>()[0] = gap;
  return {lam, it_t, gap_t};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fedkernels, m) {
  // lam = argmin_{lam in simplex} lam^T G lam on the symmetrised G (fp64). method: away | pairwise
  // | fw | code_compat; init: best_pair | min_diag; polish: face solves (away/pairwise); lam0: warm start;
  // scale s (optional, [K] > 0): solve on s_i s_j (G + G^T)/2 instead (FedAWARE's normalised Gram).
  // Returns (lam [K] f64, iterations i64 [], gap f64 []).
  m.def("min_norm(Tensor G, int max_iter=1000, float tol_rel=1e-12, float tol_abs=1e-15, str method=\"away\", str init=\"best_pair\", bool polish=True, Tensor? lam0=None, Tensor? scale=None) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fedkernels, CPU, m) { m.impl("min_norm", &min_norm_cpu); }

}  // namespace fedkernels
