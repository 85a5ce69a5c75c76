// finite_rows: ok[k] = all(isfinite(U[k, :])), one read of U.
//
// ok is first set to true (memset); a 1-D grid of (row, chunk) blocks scans 16-byte vectors (or
// single elements when unaligned) and a block that finds a NaN/Inf writes ok[k] = false. Every
// writer writes the same value, so the result needs no atomics and is deterministic.
// Verification: no per-thread logic is host-tested (a plain scan); tests/test_cuda.py on a GPU
// checks it (NaN/Inf positions, unaligned views), compute-sanitizer (bench/gpu.sh) the bounds.
#include "common.cuh"

namespace fedkernels {
namespace cuda {
namespace {

using namespace detail;

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

template <typename A> __device__ __forceinline__ bool bad(A x) { return !isfinite(x); }

template <typename T, bool VEC>
__global__ void __launch_bounds__(kThreads)
    finite_kernel(const T* __restrict__ U, int64_t d, int64_t ld, int64_t nch, bool* __restrict__ ok) {
  using A = typename Acc<T>::type;
  constexpr int V = Vec16<T>::n;
  constexpr int64_t kChunk = (int64_t)kThreads * V * kUnroll;
  const int64_t t = blockIdx.x;
  const int64_t row = t / nch, j0 = (t % nch) * kChunk;
  const T* p = U + row * ld;
  bool any = false;
  if (VEC && j0 + kChunk <= d) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      A x[V];
      load16<T, A>(p + j0 + ((int64_t)u * kThreads + threadIdx.x) * V, x);
#pragma unroll
      for (int e = 0; e < V; ++e) any |= bad(x[e]);
    }
  } else {
#pragma unroll 4
    for (int64_t s = 0; s < (int64_t)V * kUnroll; ++s) {
      const int64_t j = j0 + s * kThreads + threadIdx.x;
      if (j < d) any |= bad(static_cast<A>(to_float(__ldg(p + j))));
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
    constexpr int64_t kChunk = (int64_t)kThreads * V * kUnroll;
    const T* u = static_cast<const T*>(U);
    const int64_t nch = (d + kChunk - 1) / kChunk;
    const int64_t blocks = K * nch;
    if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
    const bool vec = aligned16(u) && ((ld * (int64_t)sizeof(T)) % 16 == 0 || K <= 1);
    if (vec)
      finite_kernel<T, true><<<(unsigned)blocks, kThreads, 0, stream>>>(u, d, ld, nch, ok);
    else
      finite_kernel<T, false><<<(unsigned)blocks, kThreads, 0, stream>>>(u, d, ld, nch, ok);
    return cudaGetLastError();
  });
}

}  // namespace cuda
}  // namespace fedkernels
