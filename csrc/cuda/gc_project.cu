// gc_project_ / gc_project: Y[r, :] = X[r, :] - mean(X[r, :]) (Y may be X: in place) for every row of every tensor of one call, in one
// launch (gcfed.md §5.4). The host plan (gc_plan) cuts the tensors into work items of one path
// each; one 256-thread block runs one work item:
//   path 0 (M <= 1024): a warp per row, 8 warps x up to 8 rows per item; each lane keeps its
//           <= 32 values of the row in registers (one read, one write);
//   path 1 (M <= 8192): a block per row, each thread keeps <= 32 values in registers;
//   path 2 (longer rows): a block per row, reading the row twice (the second read hits L2).
// Sums in fp32 (fp64 for fp64 inputs) in a fixed tree order: deterministic, no atomics. Every
// element is read before it is written by the same thread, and a barrier (path 1, 2) or the warp
// reduction (path 0) separates the reduce and the write phases.
#include "common.cuh"

#include <algorithm>
#include <cstring>

namespace fedkernels {
namespace cuda {
namespace {

using namespace detail;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kShortMax = 1024;   // path 0: 32 values per lane
constexpr int kMediumMax = 8192;  // path 1: 32 values per thread
constexpr int kRowsPerWarp = 8;   // path 0 rows per warp per work item

template <typename A> __device__ A block_sum(A x, A* red) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  x = warp_sum(x);
  if (lane == 0) red[warp] = x;
  __syncthreads();
  A s = red[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) s += red[w];
  __syncthreads();  // red may be reused
  return s;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) gc_kernel(const GcTensor* __restrict__ tensors, const GcWork* __restrict__ work) {
  using A = typename Acc<T>::type;
  __shared__ A red[kWarps];
  const GcWork w = work[blockIdx.x];
  const GcTensor t = tensors[w.tensor];
  T* base = static_cast<T*>(t.ptr);
  const T* sbase = static_cast<const T*>(t.src);
  const int64_t M = t.cols;
  const int tid = threadIdx.x;

  if (w.path == 0) {
    const int warp = tid / 32, lane = tid % 32;
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      const int64_t r = w.row0 + (int64_t)rr * kWarps + warp;
      if (r >= w.row0 + w.nrows) break;
      T* row = base + r * M;
      const T* srow = sbase + r * M;
      A x[kShortMax / 32];
      A s = A(0);
#pragma unroll
      for (int q = 0; q < kShortMax / 32; ++q) {
        const int64_t j = lane + 32 * q;
        x[q] = j < M ? static_cast<A>(to_float(srow[j])) : A(0);
        s += x[q];
      }
      s = warp_sum(s);
      const A mean = s / static_cast<A>(M);
#pragma unroll
      for (int q = 0; q < kShortMax / 32; ++q) {
        const int64_t j = lane + 32 * q;
        if (j < M) row[j] = from_acc<T>(x[q] - mean);
      }
    }
    return;
  }

  T* row = base + w.row0 * M;  // paths 1 and 2: one row per item
  const T* srow = sbase + w.row0 * M;
  if (w.path == 1) {
    A x[kMediumMax / kThreads];
    A s = A(0);
#pragma unroll
    for (int q = 0; q < kMediumMax / kThreads; ++q) {
      const int64_t j = tid + (int64_t)kThreads * q;
      x[q] = j < M ? static_cast<A>(to_float(srow[j])) : A(0);
      s += x[q];
    }
    const A mean = block_sum(s, red) / static_cast<A>(M);
#pragma unroll
    for (int q = 0; q < kMediumMax / kThreads; ++q) {
      const int64_t j = tid + (int64_t)kThreads * q;
      if (j < M) row[j] = from_acc<T>(x[q] - mean);
    }
    return;
  }

  // path 2: two reads; each thread sums a fixed strided subset in order.
  A s = A(0);
  for (int64_t j = tid; j < M; j += kThreads) s += static_cast<A>(to_float(srow[j]));
  const A mean = block_sum(s, red) / static_cast<A>(M);
  for (int64_t j = tid; j < M; j += kThreads) row[j] = from_acc<T>(static_cast<A>(to_float(srow[j])) - mean);
}

}  // namespace

int64_t gc_plan(const GcTensor* tensors, int64_t ntensors, GcWork* work) {
  int64_t n = 0;
  auto emit = [&](int64_t ti, int path, int64_t r0, int64_t nr) {
    if (work) work[n] = GcWork{(int32_t)ti, (int32_t)path, r0, nr};
    ++n;
  };
  for (int64_t ti = 0; ti < ntensors; ++ti) {
    const int64_t R = tensors[ti].rows, M = tensors[ti].cols;
    if (R <= 0 || M <= 0) continue;
    if (M <= kShortMax) {
      const int64_t per = (int64_t)kWarps * kRowsPerWarp;
      for (int64_t r0 = 0; r0 < R; r0 += per) emit(ti, 0, r0, std::min(per, R - r0));
    } else {
      const int path = M <= kMediumMax ? 1 : 2;
      for (int64_t r = 0; r < R; ++r) emit(ti, path, r, 1);
    }
  }
  return n;
}

size_t gc_table_bytes(int64_t ntensors, int64_t nwork) {
  const size_t a = (size_t(ntensors) * sizeof(GcTensor) + 15) / 16 * 16;
  return a + size_t(nwork) * sizeof(GcWork);
}

cudaError_t gc_project(const void* device_table, int64_t ntensors, int64_t nwork, DType dt, cudaStream_t stream) {
  if (nwork <= 0) return cudaSuccess;
  const GcTensor* tens = static_cast<const GcTensor*>(device_table);
  const GcWork* work = reinterpret_cast<const GcWork*>(static_cast<const char*>(device_table) +
                                                       (size_t(ntensors) * sizeof(GcTensor) + 15) / 16 * 16);
  if (nwork > 0x7fffffff) return cudaErrorInvalidConfiguration;
  return dispatch(dt, [&](auto tag) {
    using T = typename decltype(tag)::type;
    gc_kernel<T><<<(unsigned)nwork, kThreads, 0, stream>>>(tens, work);
    return cudaGetLastError();
  });
}

}  // namespace cuda
}  // namespace fedkernels
