// min_norm: minimum-norm point of the convex hull of K vectors, given their Gram matrix G.
//
//   lam = argmin_{lam in simplex} lam^T G lam
//
// All work is in float64 on the symmetrised Gram matrix (G + G^T)/2. Methods:
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
#include "common.h"
#include "../min_norm_checks.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>

namespace fedkernels {
namespace {

// min over gamma in [0,1] of |gamma u + (1-gamma) w|^2 with a=|u|^2, b=<u,w>, c=|w|^2.
inline void segment(double a, double b, double c, double& gamma, double& value) {
  const double den = a - 2.0 * b + c;
  if (!(den > 0.0)) gamma = 0.5;
  else gamma = std::min(1.0, std::max(0.0, (c - b) / den));
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
  const double* G;
  std::vector<double> lam, v;
  double q = 0.0;
  explicit State(int64_t K_, const double* G_) : K(K_), G(G_), lam(K_, 0.0), v(K_, 0.0) {}
  void recompute() {
    for (int64_t i = 0; i < K; ++i) {
      const double* gi = G + i * K;
      double s = 0.0;
      for (int64_t j = 0; j < K; ++j) s += gi[j] * lam[j];
      v[i] = s;
    }
    refresh_q();
  }
  void refresh_q() {
    double s = 0.0;
    for (int64_t i = 0; i < K; ++i) s += lam[i] * v[i];
    q = s;
  }
  int64_t argmin_v() const {
    int64_t t = 0;
    for (int64_t i = 1; i < K; ++i)
      if (v[i] < v[t]) t = i;
    return t;
  }
};

enum class Method { Away, Pairwise, FW, CodeCompat };

Method parse_method(const std::string& m) {
  if (m == "away") return Method::Away;
  if (m == "pairwise") return Method::Pairwise;
  if (m == "fw") return Method::FW;
  if (m == "code_compat") return Method::CodeCompat;
  TORCH_CHECK(false, "min_norm: method must be one of 'away', 'pairwise', 'fw', 'code_compat', got '", m, "'");
}

// Best pair init (code_compat uses the authors' segment solve and strict '<' against 1e8 -> inf).
void init_best_pair(State& s, bool code) {
  const int64_t K = s.K;
  const double* G = s.G;
  double best = std::numeric_limits<double>::infinity();
  int64_t bi = 0, bj = 1;
  double bg = 0.5;
  for (int64_t i = 0; i < K; ++i)
    for (int64_t j = i + 1; j < K; ++j) {
      double g, val;
      if (code) segment_code(G[i * K + i], G[i * K + j], G[j * K + j], g, val);
      else segment(G[i * K + i], G[i * K + j], G[j * K + j], g, val);
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
// Frank-Wolfe's slow tail on ill-conditioned G. Costs O(|S|^3) per face solve.
void polish(State& s, double gdiag_max) {
  const int64_t K = s.K;
  const double* G = s.G;
  std::vector<int64_t> S;
  std::vector<double> x, g, r, p, Gp;
  for (int64_t round = 0; round < K; ++round) {
    S.clear();
    for (int64_t i = 0; i < K; ++i)
      if (s.lam[i] > 0.0) S.push_back(i);
    const int64_t n = (int64_t)S.size();
    if (n <= 1) return;
    x.assign(n, 0.0); g.assign(n, 0.0); r.assign(n, 0.0); p.assign(n, 0.0); Gp.assign(n, 0.0);
    for (int64_t a = 0; a < n; ++a) x[a] = s.lam[S[a]];
    auto matvec = [&](const std::vector<double>& in, std::vector<double>& out) {
      for (int64_t a = 0; a < n; ++a) {
        const double* ga = G + S[a] * K;
        double acc = 0.0;
        for (int64_t b = 0; b < n; ++b) acc += ga[S[b]] * in[b];
        out[a] = acc;
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
  s.recompute();
  int64_t it = 0;
  for (;; ++it) {
    if (it > 0 && it % 64 == 0) {
      if (use_polish && method != Method::FW) polish(s, gdiag_max);
      s.recompute();
    }
    // FW vertex t (argmin v) and away vertex a (argmax v over the support); smallest index on ties.
    int64_t t = 0, a = -1;
    for (int64_t i = 0; i < K; ++i) {
      if (v[i] < v[t]) t = i;
      if (lam[i] > 0.0 && (a < 0 || v[i] > v[a])) a = i;
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
    s.refresh_q();
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
                                                            const c10::optional<at::Tensor>& lam0) {
  const int64_t K = checks::min_norm_args(Gin, max_iter, tol_rel, tol_abs, init_sv, lam0);
  const Method method = parse_method(std::string(method_sv));
  const std::string init(init_sv);

  auto G64 = Gin.to(at::kDouble).contiguous();
  const double* gp = G64.data_ptr<double>();
  std::vector<double> G(K * K);
  for (int64_t i = 0; i < K; ++i)
    for (int64_t j = 0; j < K; ++j) {
      const double x = gp[i * K + j];
      TORCH_CHECK(std::isfinite(x), "min_norm: G must be finite, got ", x, " at [", i, ", ", j, "]");
      G[i * K + j] = 0.5 * (x + gp[j * K + i]);
    }
  double gdiag_max = 0.0;
  for (int64_t i = 0; i < K; ++i) gdiag_max = std::max(gdiag_max, std::abs(G[i * K + i]));

  State s(K, G.data());
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
    } else if (method == Method::CodeCompat || init == "best_pair") {
      init_best_pair(s, method == Method::CodeCompat);
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

TORCH_LIBRARY_IMPL(fedkernels, CPU, m) { m.impl("min_norm", &min_norm_cpu); }

}  // namespace fedkernels
