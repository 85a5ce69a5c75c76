// Torch glue of add_gaussian_noise_ (kernel: gaussian_noise.cu). weighted_sum_noised's glue is weighted_sum's
// (csrc/cuda/weighted_sum_glue.cpp: the same pass with its noise argument).
#include "glue.h"
#include "gaussian_noise.cuh"
#include "../gaussian_noise_checks.h"

namespace fedkernels {
namespace {

using namespace glue;

void add_gaussian_noise_cuda(at::Tensor x, double sigma, int64_t seed, int64_t counter, int64_t offset) {
  c10::cuda::CUDAGuard guard(x.device());
  checks::add_gaussian_noise_args(x, sigma, seed, counter, offset, x.device());
  C10_CUDA_CHECK(fk::add_gaussian_noise(x.data_ptr(), to_dtype(x.scalar_type(), "add_gaussian_noise_", "x"), x.numel(),
                                        sigma, (uint64_t)seed, (uint64_t)counter, (uint64_t)offset, stream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CUDA, m) {
  m.impl("add_gaussian_noise_", &add_gaussian_noise_cuda);
}

}  // namespace fedkernels
