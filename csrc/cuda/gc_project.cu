// gc_project_ / gc_project: Y[r, :] = X[r, :] - mean(X[r, :]) (Y may be X: in place) for every row of every tensor of one call, in one
// launch (gcfed.md §5.4). The host plan (gc::plan, gc_project.cuh) cuts the tensors into work
// items of one path each; one 256-thread block runs one work item, found by gc::item:
//   path 0 (M <= 1024): a warp per row, 8 warps x up to 8 rows per item; each lane keeps its
//           <= 32 values of the row in registers (one read, one write);
//   path 1 (M <= 8192): a block per row, each thread keeps <= 32 values in registers;
//   path 2 (longer rows): a block per row, reading the row twice (the second read hits L2).
// Sums in fp32 (fp64 for fp64 inputs) in a fixed tree order: deterministic, no atomics. Every
// element is read before it is written by the same thread, and a barrier (path 1, 2) or the warp
// reduction (path 0) separates the reduce and the write phases.
// Host-tested (gc_project.cuh, tests/test_gc_project.py's host cases): the work plan (gc::plan / gc::item: every
// row of every tensor exactly once, the path per row length). Not host-tested: the per-path row
// loops and tree reductions here. Only a GPU run checks (tests/test_gc_project.py's cuda cases, compute-sanitizer
// racecheck in bench/gpu.sh): the warp / block reductions, the barriers, the launch.
#include "common.cuh"
#include "gc_project.cuh"

#include <algorithm>
#include <cstring>

namespace fedkernels {
namespace cuda {
namespace {

using namespace detail;

using gc::kMediumMax;
using gc::kRowsPerWarp;
using gc::kShortMax;
using gc::kThreads;
using gc::kWarps;

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
__global__ void __launch_bounds__(kThreads) gc_kernel(const GcTensor* __restrict__ tensors, int64_t ntensors) {
  using A = typename Acc<T>::type;
  __shared__ A red[kWarps];
  struct {
    int64_t row0, nrows;
    int path;
  } w;
  int64_t ti;
  gc::item(tensors, ntensors, blockIdx.x, ti, w.row0, w.nrows);
  const GcTensor t = tensors[ti];
  w.path = t.path;
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

int64_t gc_plan(GcTensor* tensors, int64_t ntensors) { return gc::plan(tensors, ntensors); }

cudaError_t gc_project(const GcTensor* device_tensors, int64_t ntensors, int64_t nwork, DType dt, cudaStream_t stream) {
  if (nwork <= 0) return cudaSuccess;
  if (nwork > 0x7fffffff) return cudaErrorInvalidConfiguration;
  return dispatch(dt, [&](auto tag) {
    using T = typename decltype(tag)::type;
    gc_kernel<T><<<(unsigned)nwork, kThreads, 0, stream>>>(device_tensors, ntensors);
    return cudaGetLastError();
  });
}

}  // namespace cuda
}  // namespace fedkernels
