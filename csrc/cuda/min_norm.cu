// min_norm: Frank-Wolfe min-norm point of the convex hull of N vectors given their Gram matrix
// (fedaware.md §2.6), in one thread block, float64 throughout, no host synchronisation.
//
//  1. Gs = (G + G^T) / 2. When Gs fits in shared memory next to lam, v and the diagonal
//     (mn::g_in_smem: N <= ~165 on sm_90), the solver block builds it there itself; otherwise a
//     small kernel writes it to the workspace (global memory; rows read coalesced through L1/L2).
//  2. One block of 256 threads: lam and v = Gs lam live in shared memory; thread `tid` owns the
//     entries i = tid + s * 256. Per iteration: one fused block reduction gives the FW vertex t
//     (argmin v, ties -> smallest index), the away vertex a (argmax v over the support) and
//     q = lam . v (as the CPU op's refresh_q); then every thread computes the same step
//     (mn::plan: plain FW, away or pairwise with the exact line search, as csrc/cpu/min_norm.cpp)
//     and updates the entries it owns from rows t / a of Gs (mn::update). One __syncthreads per
//     iteration (double-buffered reduction scratch). Every 64 iterations v is recomputed from lam
//     (drift control): one warp per row, lanes over the support in index order (mn::row_partial),
//     a fixed butterfly. The returned gap is recomputed exactly at the returned lam.
// Stopping: gap = q - v_t <= tol_rel * q + tol_abs * max_i |G_ii| (mn::converged).
// Initialisation: warm start lam0 (normalised), else the best pair (closed form on every
// segment, smallest value, ties -> lexicographically smallest (i, j)), or e_{argmin G_ii}.
// Not on the GPU: the CPU op's face polish and the code_compat solver. Deterministic: every
// reduction runs in a fixed order.
// Host-tested (min_norm.cuh, tests/test_min_norm.py's host cases): segment, the orders, plan/update, the
// per-thread scan and per-lane recompute parts, the smem/global choice, through an emulation of
// the whole block against the reference and the CPU op. Only a GPU run checks (tests/test_min_norm.py's cuda cases):
// the shuffles, barriers, the shared-memory copy of G and the launch.
#include "common.cuh"
#include "min_norm.cuh"

#include <cmath>

namespace fedkernels {
namespace cuda {
namespace {

using mn::Arg;
using mn::better_max;
using mn::better_min;
using mn::kRecompute;
using mn::kThreads;
using mn::kWarps;

__global__ void symmetrize_kernel(const double* __restrict__ G, int64_t N, double* __restrict__ Gs) {
  const int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (e >= N * N) return;
  const int64_t i = e / N, j = e % N;
  Gs[e] = 0.5 * (G[i * N + j] + G[j * N + i]);
}

__device__ __forceinline__ Arg shfl(const Arg& a, int o) {
  Arg b;
  b.v = __shfl_xor_sync(0xffffffffu, a.v, o);
  b.i = __shfl_xor_sync(0xffffffffu, a.i, o);
  b.x = __shfl_xor_sync(0xffffffffu, a.x, o);
  return b;
}

struct Scratch {
  Arg mn[2][kWarps];
  Arg mx[2][kWarps];
  double s[2][kWarps];
};

// Block arg-min and arg-max (max only when want_max) with one barrier; every thread gets the
// results. `parity` alternates between calls so that the scratch is never overwritten early.
__device__ void block_argminmax(Scratch& sc, int& parity, Arg mn, Arg mx, bool want_max, Arg& omn, Arg& omx) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    Arg b = shfl(mn, o);
    if (better_min(b, mn)) mn = b;
    if (want_max) {
      Arg c = shfl(mx, o);
      if (better_max(c, mx)) mx = c;
    }
  }
  if (lane == 0) {
    sc.mn[parity][warp] = mn;
    if (want_max) sc.mx[parity][warp] = mx;
  }
  __syncthreads();
  omn = sc.mn[parity][0];
  if (want_max) omx = sc.mx[parity][0];
  for (int w = 1; w < kWarps; ++w) {
    if (better_min(sc.mn[parity][w], omn)) omn = sc.mn[parity][w];
    if (want_max && better_max(sc.mx[parity][w], omx)) omx = sc.mx[parity][w];
  }
  parity ^= 1;
}

// Fixed-order block sum (or max when is_max) with one barrier.
__device__ double block_reduce(Scratch& sc, int& parity, double x, bool is_max) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const double y = __shfl_xor_sync(0xffffffffu, x, o);
    x = is_max ? fmax(x, y) : x + y;
  }
  if (lane == 0) sc.s[parity][warp] = x;
  __syncthreads();
  double r = sc.s[parity][0];
  for (int w = 1; w < kWarps; ++w) r = is_max ? fmax(r, sc.s[parity][w]) : r + sc.s[parity][w];
  parity ^= 1;
  return r;
}

// v = Gs lam over the support. One warp per row i (Gs is symmetric, so row i is column i and the
// reads are coalesced): mn::row_partial per lane, then a butterfly adds the 32 partials in a
// fixed order. Deterministic; N^2 / 256 loads per thread with independent accumulators.
__device__ void recompute_v(const double* Gs, int64_t N, const double* lam, double* v) {
  __syncthreads();  // lam written by its owners
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t i = warp; i < N; i += kWarps) {
    const double s = detail::warp_sum(mn::row_partial(Gs + i * N, lam, N, lane));
    if (lane == 0) v[i] = s;
  }
  __syncthreads();  // v[i] is read by the thread that owns i
}

// Fused scan: FW vertex t (argmin v), away vertex a (argmax v over lam > 0, payload lam_a), q.
__device__ void scan(Scratch& sc, int& parity, int64_t N, const double* lam, const double* v, Arg& t, Arg& a,
                     double& q) {
  Arg mn, mx;
  double part;
  mn::scan_thread(threadIdx.x, N, lam, v, mn, mx, part);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
  if (threadIdx.x % 32 == 0) sc.s[parity][threadIdx.x / 32] = part;
  block_argminmax(sc, parity, mn, mx, true, t, a);  // its barrier also publishes sc.s[parity ^ 1]
  const int p = parity ^ 1;
  q = sc.s[p][0];
  for (int w = 1; w < kWarps; ++w) q += sc.s[p][w];
}

// SMEM: Gs is built in shared memory from G (G_in is the caller's G); else G_in is the symmetrised
// workspace in global memory.
template <bool SMEM>
__global__ void __launch_bounds__(kThreads, 1)
    min_norm_kernel(const double* __restrict__ G_in, int64_t N, const double* __restrict__ lam0, int method, int init,
                    int64_t max_iter, double tol_rel, double tol_abs, double* __restrict__ lam_out,
                    int64_t* __restrict__ it_out, double* __restrict__ gap_out) {
  extern __shared__ double smem[];
  double* lam = smem;         // [N]
  double* v = smem + N;       // [N]
  double* dg = smem + 2 * N;  // [N] diagonal
  __shared__ Scratch sc;
  int parity = 0;
  const int tid = threadIdx.x;
  const double* Gs = G_in;
  if (SMEM) {
    double* g = smem + 3 * N;  // [N, N]
    for (int64_t e = tid; e < N * N; e += kThreads) {
      const int64_t i = e / N, j = e % N;
      g[e] = 0.5 * (G_in[i * N + j] + G_in[j * N + i]);
    }
    Gs = g;
    __syncthreads();
  }

  double dmax = 0.0;
  for (int64_t i = tid; i < N; i += kThreads) {
    dg[i] = Gs[i * N + i];
    lam[i] = 0.0;
    dmax = fmax(dmax, fabs(dg[i]));
  }
  dmax = block_reduce(sc, parity, dmax, true);

  // ---- initialisation ----
  bool done_init = false;
  if (N == 1) {
    if (tid == 0) lam[0] = 1.0;
    done_init = true;
  }
  if (!done_init && lam0 != nullptr) {
    double s = 0.0;
    for (int64_t i = tid; i < N; i += kThreads) {
      const double x = lam0[i];
      lam[i] = (x > 0.0 && isfinite(x)) ? x : 0.0;
      s += lam[i];
    }
    s = block_reduce(sc, parity, s, false);
    if (s > 0.0 && isfinite(s)) {
      for (int64_t i = tid; i < N; i += kThreads) lam[i] /= s;
      done_init = true;
    } else {
      for (int64_t i = tid; i < N; i += kThreads) lam[i] = 0.0;
    }
  }
  if (!done_init && init == 1) {
    Arg mn{INFINITY, N, 0.0}, mx{-INFINITY, N, 0.0};
    for (int64_t i = tid; i < N; i += kThreads) {
      const Arg c{dg[i], i, 0.0};
      if (better_min(c, mn)) mn = c;
    }
    Arg omn, omx;
    block_argminmax(sc, parity, mn, mx, false, omn, omx);
    if (tid == 0) lam[omn.i < N ? omn.i : 0] = 1.0;
    done_init = true;
  }
  if (!done_init) {  // best pair: warps over i, lanes over j > i
    const int warp = tid / 32, lane = tid % 32;
    double bv = INFINITY, bg = 0.5;
    int64_t bi = N, bj = N;
    for (int64_t i = warp; i < N; i += kWarps) {
      const double* row = Gs + i * N;
      for (int64_t j = i + 1 + lane; j < N; j += 32) {
        double g, val;
        mn::segment(dg[i], row[j], dg[j], g, val);
        if (mn::pair_better(val, i, j, bv, bi, bj)) {
          bv = val;
          bi = i;
          bj = j;
          bg = g;
        }
      }
    }
    // lexicographic key (val, i, j): (i, j) encoded as i * N + j
    Arg mn{bv, bi < N ? bi * N + bj : N * N, bg}, mx{-INFINITY, 0, 0.0};
    Arg omn, omx;
    block_argminmax(sc, parity, mn, mx, false, omn, omx);
    if (tid == 0) {
      if (omn.i < N * N) {
        lam[omn.i / N] = omn.x;
        lam[omn.i % N] = 1.0 - omn.x;
      } else {
        lam[0] = 0.5;  // every pair value was NaN: start from the first pair, as the CPU op does
        lam[1] = 0.5;
      }
    }
  }

  recompute_v(Gs, N, lam, v);

  // ---- iterations ----
  int64_t it = 0;
  for (;; ++it) {
    if (it > 0 && it % kRecompute == 0) recompute_v(Gs, N, lam, v);
    Arg t, a;
    double q;
    scan(sc, parity, N, lam, v, t, a, q);
    const double gap = q - t.v;
    if (mn::converged(gap, q, tol_rel, tol_abs, dmax)) break;
    if (it >= max_iter) break;
    const bool has_a = a.i < N;
    const mn::Step st = mn::plan(method, N, q, gap, t, a, dg[t.i], has_a ? dg[a.i] : 0.0,
                                 has_a ? Gs[a.i * N + t.i] : 0.0);
    if (st.kind == mn::kStop) break;
    const double* gt = Gs + t.i * N;
    const double* ga = has_a ? Gs + a.i * N : gt;
    for (int64_t i = tid; i < N; i += kThreads) mn::update(st, i, lam[i], v[i], gt[i], ga[i]);
  }

  // exact gap at the returned lam
  recompute_v(Gs, N, lam, v);
  Arg t, a;
  double q;
  scan(sc, parity, N, lam, v, t, a, q);
  for (int64_t i = tid; i < N; i += kThreads) lam_out[i] = lam[i];
  if (tid == 0) {
    *it_out = it;
    *gap_out = q - t.v;
  }
}

size_t smem_budget() { return detail::smem_optin(sizeof(Scratch) + 256); }

}  // namespace

size_t min_norm_workspace_bytes(int64_t N) { return size_t(N) * size_t(N) * sizeof(double); }

cudaError_t min_norm(const double* G, int64_t N, const double* lam0, int method, int init, int64_t max_iter,
                     double tol_rel, double tol_abs, double* lam, int64_t* iterations, double* gap, void* workspace,
                     cudaStream_t stream) {
  if (N <= 0 || N > kMinNormMaxN || method < 0 || method > 2) return cudaErrorInvalidValue;
  const bool in_smem = mn::g_in_smem(N, smem_budget());
  const size_t smem = mn::vec_smem_bytes(N) + (in_smem ? size_t(N * N) * sizeof(double) : 0);
  cudaError_t err = cudaSuccess;
  auto launch = [&](auto kernel, const double* g) {
    if (smem > 48 * 1024) {
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
      if (err != cudaSuccess) return err;
    }
    kernel<<<1, kThreads, smem, stream>>>(g, N, lam0, method, init, max_iter, tol_rel, tol_abs, lam, iterations, gap);
    return cudaGetLastError();
  };
  if (in_smem) return launch(min_norm_kernel<true>, G);
  double* Gs = static_cast<double*>(workspace);
  const int64_t nn = N * N;
  symmetrize_kernel<<<(unsigned)((nn + 255) / 256), 256, 0, stream>>>(G, N, Gs);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return launch(min_norm_kernel<false>, Gs);
}

}  // namespace cuda
}  // namespace fedkernels
