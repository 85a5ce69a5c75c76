// Torch glue of add_gaussian_noise_ and weighted_sum_noised (kernels: gaussian_noise.cu, and
// weighted_sum.cu with its noise argument). coef and rows as weighted_sum's glue: host or on U's device.
#include <cmath>

#include "glue.h"
#include "gaussian_noise.cuh"
#include "weighted_sum.cuh"
#include "../gaussian_noise_checks.h"
#include "../weighted_sum_checks.h"

namespace fedkernels {
namespace {

using namespace glue;

void add_gaussian_noise_cuda(at::Tensor x, double sigma, int64_t seed, int64_t counter, int64_t offset) {
  c10::cuda::CUDAGuard guard(x.device());
  checks::add_gaussian_noise_args(x, sigma, seed, counter, offset, x.device());
  C10_CUDA_CHECK(fk::add_gaussian_noise(x.data_ptr(), to_dtype(x.scalar_type(), "add_gaussian_noise_", "x"), x.numel(),
                                        sigma, (uint64_t)seed, (uint64_t)counter, (uint64_t)offset, stream()));
}

at::Tensor weighted_sum_noised_cuda(const at::Tensor& U, const at::Tensor& coef, const c10::optional<at::Tensor>& base,
                                    double alpha, const c10::optional<at::Tensor>& rows, double sigma, int64_t seed,
                                    int64_t counter, int64_t offset) {
  check_rowmajor(U, "weighted_sum_noised");
  c10::cuda::CUDAGuard guard(U.device());
  checks::noise_args(sigma, seed, counter, offset, "weighted_sum_noised");
  auto out = checks::weighted_sum_output(U, base);
  const int64_t K = U.size(0), d = U.size(1);
  const int64_t n = rows.has_value() ? rows->numel() : K;
  checks::weighted_sum_args(U, coef, n, base, out, U.device());
  check_host_or_device(coef, U, "weighted_sum_noised", "coef");
  at::Tensor r;
  if (rows.has_value()) r = rows_to_device(*rows, U, "weighted_sum_noised");
  if (d == 0) return out;
  int wide = -1;
  at::Tensor c;
  if (coef.device().is_cpu()) {
    auto h = coef.to(at::kDouble).contiguous();
    const double* p = h.data_ptr<double>();
    wide = 0;
    for (int64_t i = 0; i < n; ++i) wide |= !(std::abs(alpha * p[i]) <= 3.0e38);
    c = small_to_device(h, at::kDouble, U.device());
  } else {
    c = coef.to(at::kDouble).contiguous();
  }
  C10_CUDA_CHECK(fk::weighted_sum(U.data_ptr(), to_dtype(U.scalar_type(), "weighted_sum_noised", "U"), K, d,
                                  row_stride(U), c.data_ptr<double>(), rows.has_value() ? r.data_ptr<int64_t>() : nullptr,
                                  n, base.has_value() ? base->data_ptr() : nullptr, alpha, wide, out.data_ptr(),
                                  to_dtype(out.scalar_type(), "weighted_sum_noised", "out"), nullptr, stream(), sigma,
                                  (uint64_t)seed, (uint64_t)counter, (uint64_t)offset));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CUDA, m) {
  m.impl("add_gaussian_noise_", &add_gaussian_noise_cuda);
  m.impl("weighted_sum_noised", &weighted_sum_noised_cuda);
}

}  // namespace fedkernels
