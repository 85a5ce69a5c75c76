// add_gaussian_noise_: x[j] += sigma * N(seed, counter, offset + j) on the GPU, one thread per column
// pair (an even offset: the pair's Philox block gives both normals; an odd one: each column its own). The normal and its rounding into x are gaussian_noise.cuh's
// host/device functions, the ones the CPU kernel (csrc/cpu/gaussian_noise.cpp) runs: the same noise
// bits on every device. weighted_sum_noised is weighted_sum.cu's kernel with its noise argument.
// Host-tested (gaussian_noise.cuh, tests/test_gaussian_noise.py): the Philox words against Random123's
// known answers, the normals against fedkernels.reference.philox_normal (bitwise), the pair layout.
// Only a GPU run checks: the launch, the grid-stride loop, the device fma/sqrt being IEEE (nvcc's
// default -prec-sqrt=true, no fast-math) and the converted loads/stores.
#include "common.cuh"
#include "gaussian_noise.cuh"

namespace fedkernels {
namespace cuda {
namespace {

using namespace detail;
constexpr int kThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    noise_kernel(T* __restrict__ x, int64_t n, double sigma, uint64_t seed, uint64_t counter, uint64_t offset) {
  using A = typename Acc<T>::type;
  const int64_t np = (n + 1) / 2;
  for (int64_t p = blockIdx.x * (int64_t)kThreads + threadIdx.x; p < np; p += (int64_t)gridDim.x * kThreads) {
    const int64_t j = 2 * p;
    double n0, n1;
    if ((offset & 1u) == 0) {
      gnoise::normal_pair(seed, counter, (offset + (uint64_t)j) >> 1, n0, n1);
    } else {
      n0 = gnoise::normal(seed, counter, offset + (uint64_t)j);
      n1 = gnoise::normal(seed, counter, offset + (uint64_t)j + 1);
    }
    x[j] = from_acc<T>(gnoise::add_noise(static_cast<A>(to_float(x[j])), sigma, n0));
    if (j + 1 < n) x[j + 1] = from_acc<T>(gnoise::add_noise(static_cast<A>(to_float(x[j + 1])), sigma, n1));
  }
}

}  // namespace

cudaError_t add_gaussian_noise(void* x, DType dt, int64_t n, double sigma, uint64_t seed, uint64_t counter,
                               uint64_t offset, cudaStream_t stream) {
  if (n <= 0 || sigma == 0) return cudaSuccess;
  const int64_t np = (n + 1) / 2;
  const int64_t blocks = std::min<int64_t>((np + kThreads - 1) / kThreads, (int64_t)num_sms() * 32);
  return dispatch(dt, [&](auto tag) {
    using T = typename decltype(tag)::type;
    noise_kernel<T><<<(unsigned)blocks, kThreads, 0, stream>>>(static_cast<T*>(x), n, sigma, seed, counter, offset);
    return cudaGetLastError();
  });
}

}  // namespace cuda
}  // namespace fedkernels
