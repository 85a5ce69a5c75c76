// Per-thread logic of the finite_rows CUDA kernel (finite_rows.cu), shared with the host tests.
//
// Host-tested (tests/cuda_host/, against fedkernels.reference.finite_rows): the block -> (row,
// chunk) split, the vector/scalar path choice (every row start 16-byte aligned), the column of
// every (thread, unroll step, vector element) on both paths (every column of every row exactly
// once, tails when d is not a multiple of the chunk or of the vector width), and the NaN/Inf test.
// Only a GPU run checks: the 16-byte loads, __syncthreads_or and the launch configuration.
#pragma once

#include <cmath>
#include <cstdint>

#include "hd.h"

namespace fedkernels {
namespace cuda {
namespace fr {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

// Columns scanned by one block: kThreads threads x kUnroll steps x V elements (V = 16 / element size).
FK_HD int64_t chunk(int V) { return (int64_t)kThreads * V * kUnroll; }
FK_HD int64_t num_chunks(int64_t d, int V) { return (d + chunk(V) - 1) / chunk(V); }

// Block b scans row b / nch, columns [j0, j0 + chunk) with j0 = (b % nch) * chunk.
FK_HD void block_span(int64_t b, int64_t nch, int V, int64_t& row, int64_t& j0) {
  row = b / nch;
  j0 = (b % nch) * chunk(V);
}

// Vector path: U's base and every row start 16-byte aligned (row stride in bytes a multiple of 16, or one row).
FK_HD bool vec_ok(uintptr_t u, int64_t ld_bytes, int64_t K) { return (u % 16) == 0 && ((ld_bytes % 16) == 0 || K <= 1); }

// A block takes 16-byte vectors only for a full chunk; the row's tail chunk is scanned element-wise.
FK_HD bool full_chunk(int64_t j0, int64_t d, int V) { return j0 + chunk(V) <= d; }

// Vector path: element e of the vector loaded by thread tid at unroll step u.
FK_HD int64_t vec_col(int64_t j0, int u, int tid, int V, int e) { return j0 + ((int64_t)u * kThreads + tid) * V + e; }
// Scalar path: step s in [0, V * kUnroll) of thread tid (consecutive threads, consecutive columns); j >= d is skipped.
FK_HD int64_t scalar_col(int64_t j0, int64_t s, int tid) { return j0 + s * kThreads + tid; }

// The test on one element converted to float (fp16/bf16/fp32) or double: NaN and +-Inf are bad.
template <typename A> FK_HD bool bad(A x) {
#if defined(__CUDA_ARCH__)
  return !isfinite(x);
#else
  return !std::isfinite(x);
#endif
}

}  // namespace fr
}  // namespace cuda
}  // namespace fedkernels

// ---- launchers (csrc/cuda/finite_rows.cu), called by the torch glue csrc/cuda/finite_rows_glue.cpp. They
// need the CUDA runtime headers: the host tests (tests/cuda_host, no CUDA) define FEDKERNELS_HD_ONLY.
#ifndef FEDKERNELS_HD_ONLY
#include "launch.h"

namespace fedkernels {
namespace cuda {

// ---- finite_rows: ok[k] = all(isfinite(U[k, :])) -----------------------------------------------
cudaError_t finite_rows(const void* U, DType dt, int64_t K, int64_t d, int64_t ld, bool* ok, cudaStream_t stream);

}  // namespace cuda
}  // namespace fedkernels
#endif  // FEDKERNELS_HD_ONLY
