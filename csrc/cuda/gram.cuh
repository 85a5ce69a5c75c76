// Per-thread / per-tile logic of the gram CUDA kernels (gram.cu), shared with the host tests.
//
// Host-tested (tests/cuda_host/, against fedkernels.reference.gram and a Python model of the
// documented orders): the plan (path, tile, column parts, part widths; every column in exactly one
// part, workspace bound), the tile-pair map (pair_of: the upper triangle when symmetric), path R's
// column ownership, its per-thread fma order and block reduction order (same bits as the
// documented order), path T's loader slots (every row x column of a stage once), its warp -> 8x8
// tile map and activity rule (every needed output element computed by exactly one (warp, lane,
// value)), the DMMA m8n8k4 fragment indices (A/B/C as in the PTX ISA: a = A[lane/4][lane%4],
// b = B[lane%4][lane/4], c_v = C[lane/4][2 (lane%4) + v]) through an emulated mma, and the final
// reduction over the parts (red_partial / red_combine: the same bits as the documented order).
// Only a GPU run checks: the mma.sync instruction itself (and the order of the 4 products inside
// one DMMA, the hardware's, fixed), shared-memory staging and barriers, the shuffles of path R and
// the launch configuration.
#pragma once

#include <cstddef>
#include <cstdint>

#include "hd.h"

namespace fedkernels {
namespace cuda {
namespace gm {

FK_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---- path R (K <= 16 and k <= 16): 8 x 8 tiles, each thread owns columns, accumulators in registers
constexpr int kThreadsR = 256;
constexpr int kTileR = 8;
// ---- path T (otherwise): 128 x 128 block tiles of 8 x 8 DMMA tiles; 16 warps in a 4 x 4 grid, warp
// (wr, wc) = (w / 4, w % 4) owns row tiles wr + 4m and column tiles wc + 4n (m, n < 4: 16 tiles, 32
// accumulators per lane), interleaved so that the upper triangle of a diagonal block is spread
// over the warps. Columns are staged in shared memory in float64, kStage at a time.
constexpr int kThreadsT = 512;
constexpr int kWarpsT = kThreadsT / 32;
constexpr int kTileT = 128;
constexpr int kWarpTiles = 4;  // per warp: 4 row tiles x 4 column tiles
// Columns per stage: diagonal blocks stage one matrix (64 columns, 32 for fp64 data), off-diagonal
// blocks two (32, 16 for fp64): the prefetch registers stay at 16 per thread either way.
// The staged rows: the block's A rows (0..127) and, off the diagonal, its B rows (128..255), one
// [rows][ld] float64 array.
template <int ELEM_BYTES, bool DIAG> struct Stage {
  static constexpr int cols = (ELEM_BYTES >= 8 ? 32 : 64) / (DIAG ? 1 : 2);
  static constexpr int rows = DIAG ? kTileT : 2 * kTileT;
  static constexpr int ld = cols + 4;                    // row stride in doubles: ld % 16 == 4, no bank conflicts
  static constexpr int slots = rows * cols / kThreadsT;  // elements per thread per stage (16, 8 for fp64)
};
constexpr int kMaxParts = 1024;
constexpr int64_t kMaxWorkspace = int64_t(256) << 20;

FK_HD bool use_path_r(int64_t k, int64_t K) { return K <= 16 && k <= 16; }
FK_HD int tile_of(int64_t k, int64_t K) { return use_path_r(k, K) ? kTileR : kTileT; }

FK_HD int64_t num_pairs(int64_t k, int64_t K, bool symmetric) {
  const int t = tile_of(k, K);
  const int64_t ti = ceil_div(k, t), tj = ceil_div(K, t);
  return symmetric ? tj * (tj + 1) / 2 : ti * tj;
}

// Pair index p -> block tile (I, J): row-major over the upper triangle when symmetric.
FK_HD void pair_of(int64_t p, int64_t ti, int64_t tj, bool symmetric, int64_t& I, int64_t& J) {
  if (!symmetric) {
    I = p / tj;
    J = p % tj;
    return;
  }
  int64_t i = 0, rem = p;
  while (rem >= tj - i) {
    rem -= tj - i;
    ++i;
  }
  I = i;
  J = i + rem;
}

// Path T launches the diagonal blocks (I == J, symmetric only) and the off-diagonal blocks as two
// grids: p -> (p, p), and p -> the p-th pair I < J row-major (symmetric) or (p / tj, p % tj).
FK_HD void offdiag_pair(int64_t p, int64_t ti, int64_t tj, bool symmetric, int64_t& I, int64_t& J) {
  if (!symmetric) {
    I = p / tj;
    J = p % tj;
    return;
  }
  (void)ti;
  int64_t i = 0, rem = p;
  while (rem >= tj - 1 - i) {
    rem -= tj - 1 - i;
    ++i;
  }
  I = i;
  J = i + 1 + rem;
}
FK_HD int64_t num_diag_pairs(int64_t K, bool symmetric) { return symmetric ? ceil_div(K, kTileT) : 0; }

// The launch plan: a function of the shapes only (so the same inputs give the same bits).
struct Plan {
  bool path_r;
  int tile;
  int64_t kp, Kp;       // padded rows / columns of a part's partial tile in the workspace
  int64_t pairs;        // grid.x
  int64_t part_cols;    // columns per part (a multiple of the path's column step)
  int64_t nparts;       // grid.y
};
FK_HD Plan plan(int64_t k, int64_t K, int64_t d, bool symmetric, int elem_bytes) {
  Plan p{};
  p.path_r = use_path_r(k, K);
  p.tile = tile_of(k, K);
  if (k <= 0 || K <= 0 || d <= 0) return p;
  p.kp = ceil_div(k, p.tile) * p.tile;
  p.Kp = ceil_div(K, p.tile) * p.tile;
  p.pairs = num_pairs(k, K, symmetric);
  const int64_t min_cols = p.path_r ? 8192 : 4096;
  const int64_t target = p.path_r ? 2048 : 1024;                    // blocks to fill the GPU
  int64_t P = ceil_div(target, p.pairs);
  const int64_t by_cols = ceil_div(d, min_cols);                    // parts not too thin
  P = P < by_cols ? P : by_cols;
  const int64_t by_ws = kMaxWorkspace / (p.kp * p.Kp * 8);
  P = P < by_ws ? P : by_ws;
  P = P < kMaxParts ? P : kMaxParts;
  P = P < 1 ? 1 : P;
  const int64_t align = p.path_r ? kThreadsR : (elem_bytes >= 8 ? Stage<8, true>::cols : Stage<4, true>::cols);
  p.part_cols = ceil_div(ceil_div(d, P), align) * align;
  p.nparts = ceil_div(d, p.part_cols);
  return p;
}
FK_HD size_t workspace_bytes(const Plan& p) { return size_t(p.nparts * p.kp * p.Kp) * sizeof(double); }

// ---- path R per thread ----------------------------------------------------------------------------
// Thread tid of a part [c0, c1) takes columns c0 + tid, c0 + tid + 256, ... in increasing order and
// accumulates acc[i][j] = fma(a_i, b_j, acc[i][j]) per column; the block then adds the 256 partials
// of each entry: butterfly x_l + x_{l^o} (o = 16..1) in each warp, then the 8 warps in index order.
FK_HD int64_t r_first_col(int64_t c0, int tid) { return c0 + tid; }
constexpr int kStepR = kThreadsR;

// ---- path T per thread ----------------------------------------------------------------------------
// Loader slot q of thread tid in a stage of `cols` columns: staged row tid / cols + q * (kThreadsT /
// cols), column tid % cols (a warp reads 32 consecutive columns of one row, or 16 of two rows for
// fp64 off the diagonal: 128-byte segments).
FK_HD void load_slot(int tid, int q, int cols, int& row, int& col) {
  row = tid / cols + q * (kThreadsT / cols);
  col = tid % cols;
}
FK_HD int warp_row_tile(int warp, int m) { return warp / 4 + 4 * m; }
FK_HD int warp_col_tile(int warp, int n) { return warp % 4 + 4 * n; }
// Whether an 8 x 8 tile (a, b) of a block tile is computed: it holds a valid row and column, and in
// a diagonal block of the symmetric case it is on or above the diagonal (a <= b).
FK_HD bool tile_active(int a, int b, int64_t nI, int64_t nJ, bool diag) {
  return (int64_t)a * 8 < nI && (int64_t)b * 8 < nJ && (!diag || a <= b);
}
// DMMA m8n8k4 fragments from the stage X[kTileT][ld] (row r of the block tile, column c of the
// stage). A (8 x 4, row-major): lane holds A[lane / 4][lane % 4] = X[tile * 8 + lane / 4][4 kk + lane % 4].
// B (4 x 8, col-major): lane holds B[lane % 4][lane / 4]; B[k][n] = X[tile * 8 + n][4 kk + k]: the
// same index. So both fragments are X[frag_index(tile, kk, lane, ld)].
FK_HD int frag_index(int tile, int kk, int lane, int ld) { return (tile * 8 + lane / 4) * ld + kk * 4 + lane % 4; }
// Accumulator c_v (v = 0, 1) of a lane: row lane / 4, column 2 (lane % 4) + v of the 8 x 8 tile.
FK_HD void acc_pos(int lane, int v, int& r, int& c) {
  r = lane / 4;
  c = (lane % 4) * 2 + v;
}

// ---- final reduction over the parts ----------------------------------------------------------------
// G[i][j] = red_combine over the kRedWarps warps of red_partial(w): warp w sums parts w, w + 8, ...
// in increasing order from 0.0, then the 8 partials are added in warp order (part[0] + part[1] + ...).
constexpr int kRedWarps = 8;
FK_HD double red_partial(const double* ws, int64_t nparts, int64_t part_stride, int64_t off, int w) {
  double s = 0.0;
  for (int64_t p = w; p < nparts; p += kRedWarps) s += ws[p * part_stride + off];
  return s;
}
FK_HD double red_combine(const double (&part)[kRedWarps]) {
  double t = part[0];
  for (int q = 1; q < kRedWarps; ++q) t += part[q];
  return t;
}

}  // namespace gm
}  // namespace cuda
}  // namespace fedkernels

// ---- launchers (csrc/cuda/gram.cu), called by the torch glue csrc/cuda/gram_glue.cpp. They
// need the CUDA runtime headers: the host tests (tests/cuda_host, no CUDA) define FEDKERNELS_HD_ONLY.
#ifndef FEDKERNELS_HD_ONLY
#include "launch.h"

namespace fedkernels {
namespace cuda {

// ---- gram: G[k, K] = U[rows] @ U^T, exact float64 products and float64 accumulation ----------
// rows: device int64 [k] or nullptr (all K rows, symmetric: only upper tiles are computed and G
// is mirrored exactly). The d columns are split into parts (gram.cuh gm::plan, a function of the
// shapes only; K > 16 runs on fp64 tensor cores); per-part tiles go to `workspace`
// (gram_workspace_bytes) and are reduced over the parts in a fixed order.
size_t gram_workspace_bytes(int64_t k, int64_t K, int64_t d, bool symmetric);
cudaError_t gram(const void* U, DType dt, int64_t K, int64_t d, int64_t ld, const int64_t* rows, int64_t k,
                 double* G, void* workspace, cudaStream_t stream);

}  // namespace cuda
}  // namespace fedkernels
#endif  // FEDKERNELS_HD_ONLY
