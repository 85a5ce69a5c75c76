// kstats: the per-thread logic of csrc/cuda/kstats.cu (the plan, the threads' columns and rows, the
// fixed reduction orders), shared with the host tests, then the launcher's prototype.
#pragma once

#include <cstdint>

#include "hd.h"

namespace fedkernels {
namespace cuda {
namespace kstats_hd {  // the __host__ __device__ (FK_HD) logic, shared with the host tests

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int64_t kMaxParts = 1024;   // blocks of the main kernel (column parts), at most

// The plan, a function of (K, d, element size) only: tiles of TW columns (a power of two in 32..256,
// the K x TW tile of U within ~96 KB so that its second touch hits L2 while the blocks on the device
// hold theirs), parts of `tpp` consecutive tiles (one block each).
struct Plan { int64_t TW, tpp, nparts; };
FK_HD Plan plan(int64_t K, int64_t d, int64_t esize) {
  int64_t cols = (96 * 1024) / (K * esize > 0 ? K * esize : 1);
  int64_t TW = 32;
  while (TW < 256 && TW * 2 <= cols) TW *= 2;
  const int64_t ntiles = (d + TW - 1) / TW;
  const int64_t tpp = (ntiles + kMaxParts - 1) / kMaxParts;
  return {TW, tpp > 0 ? tpp : 1, tpp > 0 ? (ntiles + tpp - 1) / tpp : 0};
}

// Phase 1 (the tile's mean): thread t sums column t % TW over the rows g, g + G, g + 2G, ... ascending
// (g = t / TW, G = kThreads / TW groups); the groups' sums are then added in group order from 0.
FK_HD int64_t mean_col(int t, int64_t TW) { return t % TW; }
FK_HD int64_t mean_group(int t, int64_t TW) { return t / TW; }
FK_HD int64_t mean_groups(int64_t TW) { return kThreads / TW; }

// Phase 2 (the rows against the mean): warp w takes rows w, w + kWarps, ...; lane l columns l, l + 32,
// ... < TW (summed ascending), the lanes then added by the butterfly warp_sum (a fixed order).
FK_HD int64_t row_first(int warp) { return warp; }

// The parts' sums added in part order from part 0 (dot, nsq, nbar alike).
FK_HD double parts_sum(const double* part, int64_t nparts, int64_t stride, int64_t i) {
  double t = part[i];
  for (int64_t q = 1; q < nparts; ++q) t += part[q * stride + i];
  return t;
}

}  // namespace kstats_hd
}  // namespace cuda
}  // namespace fedkernels

// ---- launcher (csrc/cuda/kstats.cu), called by the torch glue csrc/cuda/kstats_glue.cpp. It needs the
// CUDA runtime headers: the host tests (tests/cuda_host, no CUDA) define FEDKERNELS_HD_ONLY.
#ifndef FEDKERNELS_HD_ONLY
#include "launch.h"

namespace fedkernels {
namespace cuda {

// ---- kstats: mean = sum_k p[k] U[k]; dot[k] = <U[k], mean>, nsq[k] = ||U[k]||^2, nbar = ||mean||^2,
// ok[k] = all(isfinite(U[k])); fp64, fixed order. p: device float64 [K]. workspace: kstats_workspace_bytes.
size_t kstats_workspace_bytes(int64_t K, int64_t d, DType dt);
cudaError_t kstats(const void* U, DType dt, int64_t K, int64_t d, int64_t ld, const double* p, double* dot,
                   double* nsq, double* nbar, bool* ok, void* workspace, cudaStream_t stream);

}  // namespace cuda
}  // namespace fedkernels
#endif  // FEDKERNELS_HD_ONLY
