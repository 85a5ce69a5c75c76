// Per-thread logic of the min_norm CUDA kernel (min_norm.cu), shared with the host tests.
//
// Host-tested (tests/cuda_host/, against fedkernels.reference.min_norm and the CPU op with
// polish=False): the segment line search of the best-pair init (segment), the lexicographic pair
// and arg-min/arg-max orders (pair_better, better_min, better_max), the stopping rule (converged),
// the choice and length of every Frank-Wolfe step (plan: plain FW, away, pairwise, with the exact
// line search and the drop step) and the per-entry update of lam and v = G lam (update), the
// per-thread part of the fused scan (scan_thread) and the per-lane part of the v recompute
// (row_partial), all driven by an emulation of the block (256 threads, warp butterflies, warps in
// index order) and of the shared/global placement of G (g_in_smem).
// Only a GPU run checks: the shuffles, the barriers and the double-buffered scratch, the copy of G
// into shared memory and the launch. The device may contract a * b + c into one fma where the
// host does not: results agree to rounding, not bit for bit.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "hd.h"

namespace fedkernels {
namespace cuda {
namespace mn {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kRecompute = 64;  // v = G lam recomputed from lam every 64 iterations (drift control)

FK_HD double dmin(double a, double b) { return a < b ? a : (b < a ? b : (a == a ? a : b)); }
FK_HD double dmax(double a, double b) { return a > b ? a : (b > a ? b : (a == a ? a : b)); }

// Shared memory of the solver block besides G: lam, v and the diagonal [3N] doubles.
FK_HD size_t vec_smem_bytes(int64_t N) { return size_t(3 * N) * sizeof(double); }
// G (symmetrised, N x N float64) lives in shared memory when it fits next to lam, v and the
// diagonal within the per-block budget (the device's opt-in limit minus the static scratch);
// otherwise it stays in global memory (the workspace) and rows are read through L1/L2.
FK_HD bool g_in_smem(int64_t N, size_t budget) {
  return N > 0 && size_t(N) * size_t(N) * sizeof(double) + vec_smem_bytes(N) <= budget;
}

// min over gamma in [0, 1] of |gamma u + (1 - gamma) w|^2 with a = |u|^2, b = <u, w>, c = |w|^2
// (the CPU op's segment; den <= 0 or NaN -> gamma = 1/2).
FK_HD void segment(double a, double b, double c, double& g, double& val) {
  const double den = a - 2.0 * b + c;
  g = 0.5;
  if (den > 0.0) g = dmin(1.0, dmax(0.0, (c - b) / den));
  val = g * g * a + 2.0 * g * (1.0 - g) * b + (1.0 - g) * (1.0 - g) * c;
}

// Best pair: smallest value, ties -> lexicographically smallest (i, j). NaN values never win.
FK_HD bool pair_better(double val, int64_t i, int64_t j, double bv, int64_t bi, int64_t bj) {
  return val < bv || (val == bv && (i < bi || (i == bi && j < bj)));
}

// Key of the arg-reductions: value v, index i, payload x (lam_i). Ties -> smallest index.
struct Arg {
  double v;
  int64_t i;
  double x;
};
FK_HD bool better_min(const Arg& a, const Arg& b) { return a.v < b.v || (a.v == b.v && a.i < b.i); }
FK_HD bool better_max(const Arg& a, const Arg& b) { return a.v > b.v || (a.v == b.v && a.i < b.i); }

// Stop: gap <= tol_rel * q + tol_abs * max_i |G_ii| (a NaN gap stops too).
FK_HD bool converged(double gap, double q, double tol_rel, double tol_abs, double gdiag_max) {
  return !(gap > tol_rel * q + tol_abs * gdiag_max);
}

// One thread's part of the fused scan over the entries it owns (i = tid, tid + kThreads, ...):
// FW vertex (argmin v), away vertex (argmax v over lam > 0, payload lam) and its share of q = lam . v.
FK_HD void scan_thread(int tid, int64_t N, const double* lam, const double* v, Arg& mn, Arg& mx, double& part) {
  mn = Arg{INFINITY, N, 0.0};
  mx = Arg{-INFINITY, N, 0.0};
  part = 0.0;
  for (int64_t i = tid; i < N; i += kThreads) {
    const Arg c{v[i], i, lam[i]};
    if (better_min(c, mn)) mn = c;
    if (lam[i] > 0.0 && better_max(c, mx)) mx = c;
    part = fma(lam[i], v[i], part);
  }
}

// Lane `lane`'s part of (G lam)_i from row i of the symmetric G: j = lane, lane + 32, ... in
// increasing j, entries with lam_j = 0 skipped (as the CPU op's sums of zeros); a warp butterfly
// then adds the 32 parts.
FK_HD double row_partial(const double* row, const double* lam, int64_t N, int lane) {
  double s = 0.0;
  for (int64_t j = lane; j < N; j += 32) {
    const double lj = lam[j];
    if (lj != 0.0) s = fma(lj, row[j], s);
  }
  return s;
}

// One Frank-Wolfe iteration's step (same rules as csrc/cpu/min_norm.cpp solve_fw).
enum StepKind : int { kStop = 0, kFwFull = 1, kFw = 2, kAway = 3, kPairwise = 4 };
struct Step {
  int kind;
  double g;     // step length (gamma)
  double gmax;  // away / pairwise: the drop-step length (the vertex leaves the support)
  int64_t t, a;
};

// method: 0 = plain FW, 1 = away steps, 2 = pairwise. t: FW vertex (v_t, index), a: away vertex
// (v_a, index, lam_a; a.i >= N when the support is empty). dg_t = G_tt, dg_a = G_aa, g_ta = G_ta.
FK_HD Step plan(int method, int64_t N, double q, double gap, const Arg& t, const Arg& a, double dg_t, double dg_a,
                double g_ta) {
  Step s{kStop, 0.0, 0.0, t.i, a.i};
  bool fw_step = true;
  if (method == 1) fw_step = a.i >= N || gap >= a.v - q || a.x >= 1.0;
  if (method == 2) {  // pairwise: move mass from a to t
    if (a.i >= N || a.i == t.i) return s;
    const double slope = a.v - t.v;
    if (!(slope > 0.0)) return s;
    const double den = dg_t - 2.0 * g_ta + dg_a;
    s.gmax = a.x;
    s.g = den > 0.0 ? dmin(s.gmax, slope / den) : s.gmax;
    if (s.g > 0.0) s.kind = kPairwise;
    return s;
  }
  if (fw_step) {
    const double den = q - 2.0 * t.v + dg_t;
    s.g = den > 0.0 ? dmin(1.0, gap / den) : 1.0;
    if (s.g > 0.0) s.kind = s.g >= 1.0 ? kFwFull : kFw;
    return s;
  }
  // away step from vertex a
  s.gmax = a.x / (1.0 - a.x);
  const double den = q - 2.0 * a.v + dg_a;
  s.g = den > 0.0 ? dmin(s.gmax, (a.v - q) / den) : s.gmax;
  if (s.g > 0.0) s.kind = kAway;
  return s;
}

// Entry i of lam and v after step s; gt_i = G_ti, ga_i = G_ai (read only for the kinds that use them).
FK_HD void update(const Step& s, int64_t i, double& lam_i, double& v_i, double gt_i, double ga_i) {
  switch (s.kind) {
    case kPairwise:
      if (i == s.t) lam_i += s.g;
      if (i == s.a) lam_i = s.g >= s.gmax ? 0.0 : lam_i - s.g;
      v_i += s.g * (gt_i - ga_i);
      break;
    case kFwFull:
      lam_i = i == s.t ? 1.0 : 0.0;
      v_i = gt_i;
      break;
    case kFw: {
      const double om = 1.0 - s.g;
      lam_i = om * lam_i + (i == s.t ? s.g : 0.0);
      v_i = om * v_i + s.g * gt_i;
      break;
    }
    case kAway: {
      const double op = 1.0 + s.g;
      lam_i = i == s.a ? (s.g >= s.gmax ? 0.0 : op * lam_i - s.g) : op * lam_i;
      v_i = op * v_i - s.g * ga_i;
      break;
    }
    default:
      break;
  }
}

}  // namespace mn
}  // namespace cuda
}  // namespace fedkernels

// ---- launchers (csrc/cuda/min_norm.cu), called by the torch glue csrc/cuda/min_norm_glue.cpp. They
// need the CUDA runtime headers: the host tests (tests/cuda_host, no CUDA) define FEDKERNELS_HD_ONLY.
#ifndef FEDKERNELS_HD_ONLY
#include "launch.h"

namespace fedkernels {
namespace cuda {

// ---- min_norm: Frank-Wolfe min-norm point of the convex hull, on a float64 Gram matrix ---------
// One thread block, float64 throughout (fedaware.md §2.6; same rules as csrc/cpu/min_norm.cpp
// without its face polish and code_compat modes). G: device [N, N] float64, symmetrised into the
// workspace (min_norm_workspace_bytes(N)). method: 0 = plain FW, 1 = away steps, 2 = pairwise.
// lam0: device float64 [N] warm start or nullptr (normalised; a non-positive sum falls back to
// init). init: 0 = best pair, 1 = e_{argmin G_ii}. Stop: gap <= tol_rel * q + tol_abs * max|G_ii|.
// Outputs (device): lam [N], iterations (int64 scalar), gap (float64 scalar, exact at lam).
constexpr int kMinNormMaxN = 8192;
size_t min_norm_workspace_bytes(int64_t N);
cudaError_t min_norm(const double* G, int64_t N, const double* lam0, int method, int init, int64_t max_iter,
                     double tol_rel, double tol_abs, double* lam, int64_t* iterations, double* gap, void* workspace,
                     cudaStream_t stream);

}  // namespace cuda
}  // namespace fedkernels
#endif  // FEDKERNELS_HD_ONLY
