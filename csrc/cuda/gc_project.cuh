// Work plan of the gc_project CUDA kernel (gc_project.cu), shared with the host tests.
//
// One launch covers every tensor of one dtype. The table uploaded per call is one GcTensor per
// tensor (48 bytes: ResNet-18's 62 tensors are one 3 KB kernel-argument upload), not one entry per
// work item: gc_plan() writes each tensor's path, rows per item and first item index, and a block
// finds its tensor by a binary search over item0 (gc_item).
// Paths by row length M: 0: a warp per row, 8 warps x 8 rows per item (M <= 1024); 1: a block per
// row, the row in registers (M <= 8192); 2: a block per row reading it twice (longer rows).
// Host-tested (tests/cuda_host/): gc_plan and gc_item cover every row of every tensor exactly once,
// with the right path, for empty tensors, single rows and mixed lengths. Only a GPU run checks the
// warp/block reductions and the barriers of gc_project.cu.
#pragma once

#include <cstdint>

#include "hd.h"

namespace fedkernels {
namespace cuda {

struct GcTensor {
  void* ptr;        // output rows (the tensor itself when in place)
  const void* src;  // input rows (== ptr when in place)
  int64_t rows;
  int64_t cols;
  int64_t item0;    // first work item (gc_plan)
  int32_t path;     // 0, 1, 2 (gc_plan)
  int32_t rows_per_item;
};

namespace gc {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kShortMax = 1024;   // path 0: 32 values per lane
constexpr int kMediumMax = 8192;  // path 1: 32 values per thread
constexpr int kRowsPerWarp = 8;   // path 0 rows per warp per work item

// Fills path / rows_per_item / item0 of every tensor; returns the number of work items.
inline int64_t plan(GcTensor* t, int64_t n) {
  int64_t items = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t R = t[i].rows, M = t[i].cols;
    t[i].item0 = items;
    t[i].path = M <= kShortMax ? 0 : (M <= kMediumMax ? 1 : 2);
    t[i].rows_per_item = t[i].path == 0 ? kWarps * kRowsPerWarp : 1;
    if (R > 0 && M > 0) items += (R + t[i].rows_per_item - 1) / t[i].rows_per_item;
  }
  return items;
}

// Work item -> (tensor, first row, rows): the last tensor with item0 <= item (empty tensors own no
// item, so the search skips them: item0 is non-decreasing and equal for an empty tensor and its
// successor; the last one with item0 <= item is the non-empty owner).
FK_HD void item(const GcTensor* t, int64_t n, int64_t it, int64_t& ti, int64_t& row0, int64_t& nrows) {
  int64_t lo = 0, hi = n - 1;
  while (lo < hi) {  // last index with item0 <= it
    const int64_t mid = (lo + hi + 1) / 2;
    if (t[mid].item0 <= it)
      lo = mid;
    else
      hi = mid - 1;
  }
  ti = lo;
  row0 = (it - t[lo].item0) * t[lo].rows_per_item;
  const int64_t left = t[lo].rows - row0;
  nrows = left < t[lo].rows_per_item ? left : t[lo].rows_per_item;
}

}  // namespace gc
}  // namespace cuda
}  // namespace fedkernels

// ---- launchers (csrc/cuda/gc_project.cu), called by the torch glue csrc/cuda/gc_project_glue.cpp. They
// need the CUDA runtime headers: the host tests (tests/cuda_host, no CUDA) define FEDKERNELS_HD_ONLY.
#ifndef FEDKERNELS_HD_ONLY
#include "launch.h"

namespace fedkernels {
namespace cuda {

// ---- gc_project_: in-place per-row mean removal over many tensors in one launch ---------------
// A tensor is viewed as a [rows, cols] row-major matrix (cols = fan-in). All tensors of one call
// share one dtype. The host fills the GcTensor table (gc_project.cuh) with gc_plan(), which returns
// the number of work items, uploads the table (ntensors x 48 bytes) and launches gc_project().
int64_t gc_plan(GcTensor* tensors, int64_t ntensors);
cudaError_t gc_project(const GcTensor* device_tensors, int64_t ntensors, int64_t nwork, DType dt, cudaStream_t stream);

}  // namespace cuda
}  // namespace fedkernels
#endif  // FEDKERNELS_HD_ONLY
