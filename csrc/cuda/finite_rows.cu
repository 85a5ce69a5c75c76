// finite_rows: ok[k] = all(isfinite(U[k, :])), one read of U.
//
// ok is first set to true (memset); a 1-D grid of (row, chunk) blocks scans 16-byte vectors (or
// single elements when unaligned) and a block that finds a NaN/Inf writes ok[k] = false. Every
// writer writes the same value, so the result needs no atomics and is deterministic.
// Host-tested (finite_rows.cuh, tests/test_finite_rows.py's host cases): the block split, the path choice, the
// column of every thread on both paths (each column exactly once, tails, misaligned rows) and the
// NaN/Inf test. Only a GPU run checks (tests/test_finite_rows.py's cuda cases, compute-sanitizer in bench/gpu.sh): the
// 16-byte loads, __syncthreads_or and the launch.
#include "common.cuh"
#include "finite_rows.cuh"

namespace fedkernels {
namespace cuda {
namespace {

using namespace detail;

using fr::kThreads;
using fr::kUnroll;

template <typename T, bool VEC>
__global__ void __launch_bounds__(kThreads)
    finite_kernel(const T* __restrict__ U, int64_t d, int64_t ld, int64_t nch, bool* __restrict__ ok) {
  using A = typename Acc<T>::type;
  constexpr int V = Vec16<T>::n;
  int64_t row, j0;
  fr::block_span(blockIdx.x, nch, V, row, j0);
  const T* p = U + row * ld;
  bool any = false;
  if (VEC && fr::full_chunk(j0, d, V)) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      A x[V];
      load16<T, A>(p + fr::vec_col(j0, u, threadIdx.x, V, 0), x);
#pragma unroll
      for (int e = 0; e < V; ++e) any |= fr::bad(x[e]);
    }
  } else {
#pragma unroll 4
    for (int64_t s = 0; s < (int64_t)V * kUnroll; ++s) {
      const int64_t j = fr::scalar_col(j0, s, threadIdx.x);
      if (j < d) any |= fr::bad(static_cast<A>(to_float(__ldg(p + j))));
    }
  }
  if (__syncthreads_or(any) && threadIdx.x == 0) ok[row] = false;
}

}  // namespace

cudaError_t finite_rows(const void* U, DType dt, int64_t K, int64_t d, int64_t ld, bool* ok, cudaStream_t stream) {
  if (K <= 0) return cudaSuccess;
  cudaError_t err = cudaMemsetAsync(ok, 1, size_t(K) * sizeof(bool), stream);
  if (err != cudaSuccess || d <= 0) return err;
  return dispatch(dt, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int V = Vec16<T>::n;
    const T* u = static_cast<const T*>(U);
    const int64_t nch = fr::num_chunks(d, V);
    const int64_t blocks = K * nch;
    if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
    const bool vec = fr::vec_ok(reinterpret_cast<uintptr_t>(u), ld * (int64_t)sizeof(T), K);
    if (vec)
      finite_kernel<T, true><<<(unsigned)blocks, kThreads, 0, stream>>>(u, d, ld, nch, ok);
    else
      finite_kernel<T, false><<<(unsigned)blocks, kThreads, 0, stream>>>(u, d, ld, nch, ok);
    return cudaGetLastError();
  });
}

}  // namespace cuda
}  // namespace fedkernels
