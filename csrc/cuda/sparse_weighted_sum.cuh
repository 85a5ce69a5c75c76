// Per-thread logic of the sparse_weighted_sum CUDA kernel (sparse_weighted_sum.cu), then its launcher.
//
// A block owns a tile of kTile output columns and a shared accumulator for it. For each selected list in the
// order given, every thread finds the list's entries in the tile by the same binary search (sorted lists),
// then each thread takes whole runs of equal indices (a run starts where the index differs from the one
// before) and adds the run's values in position order, one fma each: a column gets at most one run per list,
// so no two threads touch one accumulator between the barriers, and every column's sum is the CPU op's fma
// chain (lists in order, then positions). Host-checkable: the search and the run rule. Only a GPU run checks
// the barriers, the shared accumulator and the launch.
#pragma once

#include <cstdint>

#include "hd.h"

namespace fedkernels {
namespace cuda {
namespace sp {

constexpr int kThreads = 256;
constexpr int64_t kTile = 2048;

FK_HD int64_t num_tiles(int64_t d) { return (d + kTile - 1) / kTile; }

// First position p in [lo, hi) with idx[p] >= v (hi when none): the list's first entry at or after column v.
template <typename I> FK_HD int64_t lower_bound(const I* idx, int64_t lo, int64_t hi, int64_t v) {
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if ((int64_t)idx[mid] < v) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// Position p of [p0, p1) starts a run (its thread adds the run) when it is the first of the range or its
// index differs from the previous one.
template <typename I> FK_HD bool run_start(const I* idx, int64_t p0, int64_t p) {
  return p == p0 || idx[p] != idx[p - 1];
}

}  // namespace sp
}  // namespace cuda
}  // namespace fedkernels

#ifndef FEDKERNELS_HD_ONLY
#include "launch.h"

namespace fedkernels {
namespace cuda {

// out = base + sum_i w[i] * scatter(list i), list i = idx/val[lo[i], hi[i]) (device int64 [n] each; the
// selected lists' ranges), w: device float64 [n] (alpha coef); idx: int32 (idx64 = false) or int64; val: dt;
// out (and base, or nullptr) float32 (out_f64 = false) or float64; wide: accumulate in float64 (some |w_i| >
// 3e38); ok: [n] bool set to true by the caller, false written for a list holding a NaN/Inf.
cudaError_t sparse_weighted_sum(const void* idx, bool idx64, const void* val, DType dt, const int64_t* lo,
                                const int64_t* hi, const double* w, int64_t n, int64_t d, const void* base, void* out,
                                bool out_f64, bool wide, bool* ok, cudaStream_t stream);

}  // namespace cuda
}  // namespace fedkernels
#endif  // FEDKERNELS_HD_ONLY
