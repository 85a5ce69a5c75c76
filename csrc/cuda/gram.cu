// gram: G = U[rows] @ U^T with exact float64 products and float64 accumulation, deterministic.
//
// Work split (gm::plan, a function of the shapes only): output block tiles x column parts.
// grid.x runs over tile pairs (fastest, so the blocks that share a column part run together and
// re-read U from L2), grid.y over column parts. Each block writes its float64 partial tile to a
// workspace [parts, kp, Kp]; a second kernel sums the parts in a fixed order. Same inputs and
// shapes on the same device give the same bits on every call.
// Symmetric case (no rows): only tile pairs I <= J (and in diagonal blocks only 8 x 8 tiles on or
// above the diagonal) are computed, and G[i][j] = G[j][i] is written from the same sum: G is
// exactly symmetric. An out-of-range rows entry gives a NaN row of G (no device assert, no read
// outside U).
// Paths:
//  R (K <= 16 and k <= 16): tiles of 8 rows; every thread owns columns c0 + tid + 256 s and keeps the
//    whole 8 x 8 accumulator (upper triangle on diagonal tiles) in registers, loading straight from
//    global memory (one fma per entry and column, in column order); block reduction: butterfly in
//    each warp, then the 8 warps in index order. Memory-bound regime (the usual FL round).
//  T (otherwise): fp64 tensor cores (DMMA, mma.sync.m8n8k4.f64, sm_80+; a shuffle emulation of the
//    same fragment maths below sm_80). Block tile 128 x 128, 16 warps, each owning 4 x 4 interleaved
//    8 x 8 tiles (32 float64 accumulators per lane; fragments reused 4 times). Columns are staged
//    in shared memory as float64 (every element converted exactly: fp32/fp16/bf16 products are
//    exact in float64), 64 columns (32 for fp64 data) per stage; the next stage is prefetched into
//    registers while the tensor cores work on the current one. Diagonal blocks stage one matrix.
//    Target (GPU run to confirm): K = 100, d = 11.2M fp32 within 2x the memory floor (one read of U).
// Final reduction (gram_reduce_kernel): a block owns 32 consecutive output elements (one per lane,
// coalesced part rows); warp w sums parts w, w + 8, ... in increasing order (gm::red_partial),
// then the 8 partials are added in warp order (gm::red_combine). Deterministic, no atomics.
// Host-tested (gram.cuh, tests/test_gram.py's host cases): the plan, the pair map, both paths' thread /
// warp / lane index maths and fragment layout through an emulated mma, path R's partials and the
// final reduction bit for bit against a Python model of the documented orders. Only a GPU run
// checks (tests/test_gram.py's cuda cases, bench/gpu.py): the mma.sync instruction and the order of the four
// products inside one DMMA (the hardware's, fixed), shared-memory barriers, shuffles, the launch.
#include "common.cuh"
#include "gram.cuh"

#include <algorithm>
#include <type_traits>

namespace fedkernels {
namespace cuda {
namespace {

using namespace detail;
using gm::ceil_div;
using gm::kThreadsR;
using gm::kThreadsT;
using gm::kTileR;
using gm::kTileT;
using gm::kWarpTiles;

// ---- path R ----------------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(kThreadsR) gram_r_kernel(const T* __restrict__ U, int64_t K, int64_t d, int64_t ld,
                                                           const int64_t* __restrict__ rows, int64_t k,
                                                           bool symmetric, int64_t part_cols, double* __restrict__ ws,
                                                           int64_t kp, int64_t Kp) {
  const int64_t ti = ceil_div(k, kTileR), tj = ceil_div(K, kTileR);
  int64_t I, J;
  gm::pair_of(blockIdx.x, ti, tj, symmetric, I, J);
  const bool diag = symmetric && I == J;
  const int64_t part = blockIdx.y;
  const int64_t c0 = part * part_cols, c1 = min(d, c0 + part_cols);

  const T* pa[kTileR];
  const T* pb[kTileR];
#pragma unroll
  for (int r = 0; r < kTileR; ++r) {
    const int64_t ia = I * kTileR + r, jb = J * kTileR + r;
    pa[r] = nullptr;
    pb[r] = nullptr;
    if (ia < k) {
      const int64_t row = rows ? rows[ia] : ia;
      pa[r] = (row >= 0 && row < K) ? U + row * ld : nullptr;
    }
    if (jb < K) pb[r] = U + jb * ld;
  }

  double acc[kTileR][kTileR];
#pragma unroll
  for (int i = 0; i < kTileR; ++i)
#pragma unroll
    for (int j = 0; j < kTileR; ++j) acc[i][j] = 0.0;

  for (int64_t c = gm::r_first_col(c0, threadIdx.x); c < c1; c += gm::kStepR) {
    double a[kTileR], b[kTileR];
#pragma unroll
    for (int r = 0; r < kTileR; ++r) a[r] = pa[r] ? to_double(pa[r][c]) : 0.0;
    if (diag) {
#pragma unroll
      for (int i = 0; i < kTileR; ++i)
#pragma unroll
        for (int j = i; j < kTileR; ++j) acc[i][j] = fma(a[i], a[j], acc[i][j]);
    } else {
#pragma unroll
      for (int r = 0; r < kTileR; ++r) b[r] = pb[r] ? to_double(pb[r][c]) : 0.0;
#pragma unroll
      for (int i = 0; i < kTileR; ++i)
#pragma unroll
        for (int j = 0; j < kTileR; ++j) acc[i][j] = fma(a[i], b[j], acc[i][j]);
    }
  }

  // Fixed-order block reduction: butterfly within warps, then warps in index order.
  __shared__ double red[kThreadsR / 32][kTileR * kTileR];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < kTileR; ++i)
#pragma unroll
    for (int j = 0; j < kTileR; ++j) {
      const double s = warp_sum(acc[i][j]);
      if (lane == 0) red[warp][i * kTileR + j] = s;
    }
  __syncthreads();
  if (threadIdx.x < kTileR * kTileR) {
    const int i = threadIdx.x / kTileR, j = threadIdx.x % kTileR;
    double s = red[0][threadIdx.x];
#pragma unroll
    for (int w = 1; w < kThreadsR / 32; ++w) s += red[w][threadIdx.x];
    const int64_t ia = I * kTileR + i;
    const bool bad = rows != nullptr && ia < k && !(rows[ia] >= 0 && rows[ia] < K);  // NaN row, no assert
    ws[(part * kp + ia) * Kp + J * kTileR + j] = bad ? NAN : s;
  }
}

// ---- path T ----------------------------------------------------------------------------------
// D = A B + D on one 8 x 8 x 4 tile, float64 (fragments: gram.cuh frag_index / acc_pos).
__device__ __forceinline__ void dmma(double& d0, double& d1, double a, double b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, {%0, %1};\n"
      : "+d"(d0), "+d"(d1)
      : "d"(a), "d"(b));
#else
  // Same fragment maths with shuffles: lane (r, c) needs A[r][k] (lane 4 r + k) and B[k][c] (lane 4 c + k).
  const int lane = threadIdx.x % 32, r = lane / 4, c0 = (lane % 4) * 2;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const double ar = __shfl_sync(0xffffffffu, a, 4 * r + kk);
    const double b0 = __shfl_sync(0xffffffffu, b, 4 * c0 + kk);
    const double b1 = __shfl_sync(0xffffffffu, b, 4 * (c0 + 1) + kk);
    d0 = fma(ar, b0, d0);
    d1 = fma(ar, b1, d1);
  }
#endif
}

template <typename T, bool DIAG>
__global__ void __launch_bounds__(kThreadsT, 1) gram_t_kernel(const T* __restrict__ U, int64_t K, int64_t d, int64_t ld,
                                                              const int64_t* __restrict__ rows, int64_t k,
                                                              bool symmetric, int64_t part_cols,
                                                              double* __restrict__ ws, int64_t kp, int64_t Kp) {
  using St = gm::Stage<sizeof(T), DIAG>;
  constexpr int LD = St::ld, COLS = St::cols, SLOTS = St::slots;
  extern __shared__ __align__(16) double gram_smem[];
  double* As = gram_smem;                                  // staged A rows [kTileT][LD]
  const double* Bp = DIAG ? gram_smem : gram_smem + kTileT * LD;  // B rows: A's on the diagonal
  __shared__ int64_t srow[St::rows];                       // U row of each staged row; -1 none, -2 bad

  const int64_t ti = ceil_div(k, kTileT), tj = ceil_div(K, kTileT);
  int64_t I = blockIdx.x, J = blockIdx.x;
  if (!DIAG) gm::offdiag_pair(blockIdx.x, ti, tj, symmetric, I, J);
  const int64_t part = blockIdx.y;
  const int64_t c0 = part * part_cols, c1 = min(d, c0 + part_cols);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

  for (int r = tid; r < St::rows; r += kThreadsT) {
    int64_t u = -1;
    if (r < kTileT) {
      const int64_t ia = I * kTileT + r;
      if (ia < k) {
        u = rows ? rows[ia] : ia;
        if (u < 0 || u >= K) u = -2;  // out of range: zeros while loading, NaN when written
      }
    } else {
      const int64_t jb = J * kTileT + (r - kTileT);
      u = jb < K ? jb : -1;
    }
    srow[r] = u;
  }
  __syncthreads();
  const int64_t nI = k - I * kTileT, nJ = K - J * kTileT;  // valid rows / columns (may exceed the tile)

  double acc[kWarpTiles][kWarpTiles][2];
#pragma unroll
  for (int m = 0; m < kWarpTiles; ++m)
#pragma unroll
    for (int n = 0; n < kWarpTiles; ++n) acc[m][n][0] = acc[m][n][1] = 0.0;

  // Prefetch registers: the raw elements of this thread's loader slots and which of them are valid.
  T pv[SLOTS];
  uint32_t ok = 0;
  auto fetch = [&](int64_t s0) {
    ok = 0;
#pragma unroll
    for (int q = 0; q < SLOTS; ++q) {
      int r, cc;
      gm::load_slot(tid, q, COLS, r, cc);
      const int64_t c = s0 + cc, u = srow[r];
      if (c < c1 && u >= 0) {
        pv[q] = U[u * ld + c];
        ok |= 1u << q;
      }
    }
  };
  if (c0 < c1) fetch(c0);
  for (int64_t s0 = c0; s0 < c1; s0 += COLS) {
    __syncthreads();  // the previous stage has been consumed
#pragma unroll
    for (int q = 0; q < SLOTS; ++q) {
      int r, cc;
      gm::load_slot(tid, q, COLS, r, cc);
      As[r * LD + cc] = (ok >> q) & 1u ? to_double(pv[q]) : 0.0;
    }
    __syncthreads();
    if (s0 + COLS < c1) fetch(s0 + COLS);  // in flight while the tensor cores work
#pragma unroll 2
    for (int kk = 0; kk < COLS / 4; ++kk) {
      double af[kWarpTiles], bf[kWarpTiles];
#pragma unroll
      for (int m = 0; m < kWarpTiles; ++m) af[m] = As[gm::frag_index(gm::warp_row_tile(warp, m), kk, lane, LD)];
#pragma unroll
      for (int n = 0; n < kWarpTiles; ++n) bf[n] = Bp[gm::frag_index(gm::warp_col_tile(warp, n), kk, lane, LD)];
#pragma unroll
      for (int m = 0; m < kWarpTiles; ++m)
#pragma unroll
        for (int n = 0; n < kWarpTiles; ++n)
          if (gm::tile_active(gm::warp_row_tile(warp, m), gm::warp_col_tile(warp, n), nI, nJ, DIAG))  // warp-uniform
            dmma(acc[m][n][0], acc[m][n][1], af[m], bf[n]);
    }
  }

#pragma unroll
  for (int m = 0; m < kWarpTiles; ++m)
#pragma unroll
    for (int n = 0; n < kWarpTiles; ++n) {
      const int a = gm::warp_row_tile(warp, m), b = gm::warp_col_tile(warp, n);
      if (!gm::tile_active(a, b, nI, nJ, DIAG)) continue;
#pragma unroll
      for (int v = 0; v < 2; ++v) {
        int r, c;
        gm::acc_pos(lane, v, r, c);
        const int lr = a * 8 + r;
        ws[(part * kp + I * kTileT + lr) * Kp + J * kTileT + b * 8 + c] = srow[lr] == -2 ? NAN : acc[m][n][v];
      }
    }
}

// ---- final reduction over the column parts (see the file header) ------------------------------
__global__ void __launch_bounds__(256) gram_reduce_kernel(const double* __restrict__ ws, int64_t nparts, int64_t k,
                                                          int64_t K, int64_t kp, int64_t Kp, bool symmetric,
                                                          double* __restrict__ G) {
  __shared__ double part[gm::kRedWarps][32];
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
  const int64_t e = (int64_t)blockIdx.x * 32 + lane;
  const int64_t i = e / K, j = e % K;
  const bool active = e < k * K && !(symmetric && i > j);
  part[w][lane] = active ? gm::red_partial(ws, nparts, kp * Kp, i * Kp + j, w) : 0.0;
  __syncthreads();
  if (w == 0 && active) {
    double p[gm::kRedWarps];
#pragma unroll
    for (int q = 0; q < gm::kRedWarps; ++q) p[q] = part[q][lane];
    const double t = gm::red_combine(p);
    G[i * K + j] = t;
    if (symmetric && i != j) G[j * K + i] = t;
  }
}

int elem_bytes(DType dt) { return dt == DType::Float64 ? 8 : (dt == DType::Float32 ? 4 : 2); }

}  // namespace

size_t gram_workspace_bytes(int64_t k, int64_t K, int64_t d, bool symmetric) {
  // the largest over the element sizes (the plan's part width depends on it only through alignment)
  size_t b = 0;
  for (int eb : {2, 4, 8}) b = std::max(b, gm::workspace_bytes(gm::plan(k, K, d, symmetric, eb)));
  return b;
}

cudaError_t gram(const void* U, DType dt, int64_t K, int64_t d, int64_t ld, const int64_t* rows, int64_t k,
                 double* G, void* workspace, cudaStream_t stream) {
  const bool symmetric = rows == nullptr;
  if (symmetric) k = K;
  if (k <= 0 || K <= 0) return cudaSuccess;
  if (d <= 0) return cudaMemsetAsync(G, 0, size_t(k * K) * sizeof(double), stream);
  const gm::Plan pl = gm::plan(k, K, d, symmetric, elem_bytes(dt));
  double* ws = static_cast<double*>(workspace);
  if (pl.pairs > 0x7fffffff || pl.nparts > 65535) return cudaErrorInvalidConfiguration;
  dim3 grid((unsigned)pl.pairs, (unsigned)pl.nparts);
  cudaError_t err = dispatch(dt, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* u = static_cast<const T*>(U);
    if (pl.path_r) {
      gram_r_kernel<T><<<grid, kThreadsR, 0, stream>>>(u, K, d, ld, rows, k, symmetric, pl.part_cols, ws, pl.kp, pl.Kp);
    } else {
      auto launch_t = [&](auto diag_tag, int64_t nblocks) {
        constexpr bool DIAG = decltype(diag_tag)::value;
        if (nblocks <= 0) return cudaSuccess;
        using St = gm::Stage<sizeof(T), DIAG>;
        const size_t smem = size_t(St::rows) * St::ld * sizeof(double);
        cudaError_t e = cudaSuccess;
        if (smem > 48 * 1024)
          e = cudaFuncSetAttribute(gram_t_kernel<T, DIAG>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess) return e;
        gram_t_kernel<T, DIAG><<<dim3((unsigned)nblocks, (unsigned)pl.nparts), kThreadsT, smem, stream>>>(
            u, K, d, ld, rows, k, symmetric, pl.part_cols, ws, pl.kp, pl.Kp);
        return cudaGetLastError();
      };
      const int64_t nd = gm::num_diag_pairs(K, symmetric);
      const cudaError_t e = launch_t(std::true_type{}, nd);
      if (e != cudaSuccess) return e;
      return launch_t(std::false_type{}, pl.pairs - nd);
    }
    return cudaGetLastError();
  });
  if (err != cudaSuccess) return err;
  const int64_t n = k * K;  // 32 output elements per block
  if (ceil_div(n, 32) > 0x7fffffff) return cudaErrorInvalidConfiguration;
  gram_reduce_kernel<<<(unsigned)ceil_div(n, 32), 256, 0, stream>>>(ws, pl.nparts, k, K, pl.kp, pl.Kp, symmetric, G);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace fedkernels
