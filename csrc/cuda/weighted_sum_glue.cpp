// Torch glue of weighted_sum / weighted_sum_out / weighted_sum_screened(_out) (kernel: weighted_sum.cu).
// coef and rows may be host tensors (the Python wrappers pass them so: no host->device->host round
// trip) or on U's device. Host coef: the accumulation type (float unless some |alpha*coef| > 3e38,
// the CPU op's rule) is decided here; device coef: by the kernel. out (and base) have U's dtype, or
// fp32/fp64 for an fp16/bf16 U; the functional forms take base's dtype. Each entry point checks its
// arguments first (csrc/weighted_sum_checks.h), then runs the one pass.
#include <cmath>
#include <tuple>

#include <ATen/ops/ones.h>

#include "glue.h"
#include "weighted_sum.cuh"
#include "../weighted_sum_checks.h"
#include "../gaussian_noise_checks.h"

namespace fedkernels {
namespace {

using namespace glue;

// The pass, after the entry point checked the arguments (checks::weighted_sum_args); sigma > 0:
// weighted_sum_noised (its schema: csrc/cpu/gaussian_noise.cpp), the noise in the output write.
void wsum_cuda(const at::Tensor& U, const at::Tensor& coef, const c10::optional<at::Tensor>& base,
               double alpha, const c10::optional<at::Tensor>& rows, at::Tensor& out, at::Tensor* ok, const char* op,
               double sigma = 0.0, int64_t seed = 0, int64_t counter = 0, int64_t offset = 0) {
  checks::rows_apart(U, op);  // the kernel reads whole rows
  c10::cuda::CUDAGuard guard(U.device());
  const int64_t K = U.size(0), d = U.size(1);
  const int64_t n = rows.has_value() ? rows->numel() : K;
  at::Tensor r;
  if (rows.has_value()) r = rows_to_device(*rows, U, op);
  if (ok) *ok = at::ones({n}, U.options().dtype(at::kBool));
  if (d == 0) return;
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
  C10_CUDA_CHECK(fk::weighted_sum(U.data_ptr(), to_dtype(U.scalar_type(), op, "U"), K, d, row_stride(U),
                                  c.data_ptr<double>(), rows.has_value() ? r.data_ptr<int64_t>() : nullptr, n,
                                  base.has_value() ? base->data_ptr() : nullptr, alpha, wide, out.data_ptr(),
                                  to_dtype(out.scalar_type(), op, "out"), ok ? ok->data_ptr<bool>() : nullptr,
                                  stream(), sigma, (uint64_t)seed, (uint64_t)counter, (uint64_t)offset));
}

void weighted_sum_out_cuda(const at::Tensor& U, const at::Tensor& coef, const c10::optional<at::Tensor>& base,
                           double alpha, const c10::optional<at::Tensor>& rows, at::Tensor out) {
  checks::weighted_sum_args(U, coef, base, rows, &out, U.device(), "weighted_sum");
  wsum_cuda(U, coef, base, alpha, rows, out, nullptr, "weighted_sum");
}

at::Tensor weighted_sum_cuda(const at::Tensor& U, const at::Tensor& coef, const c10::optional<at::Tensor>& base,
                             double alpha, const c10::optional<at::Tensor>& rows) {
  checks::weighted_sum_args(U, coef, base, rows, nullptr, U.device(), "weighted_sum");
  c10::cuda::CUDAGuard guard(U.device());
  auto out = checks::weighted_sum_output(U, base);
  wsum_cuda(U, coef, base, alpha, rows, out, nullptr, "weighted_sum");
  return out;
}

at::Tensor weighted_sum_screened_out_cuda(const at::Tensor& U, const at::Tensor& coef,
                                          const c10::optional<at::Tensor>& base, double alpha,
                                          const c10::optional<at::Tensor>& rows, at::Tensor out) {
  checks::weighted_sum_args(U, coef, base, rows, &out, U.device(), "weighted_sum_screened");
  at::Tensor ok;
  wsum_cuda(U, coef, base, alpha, rows, out, &ok, "weighted_sum_screened");
  return ok;
}

std::tuple<at::Tensor, at::Tensor> weighted_sum_screened_cuda(const at::Tensor& U, const at::Tensor& coef,
                                                              const c10::optional<at::Tensor>& base, double alpha,
                                                              const c10::optional<at::Tensor>& rows) {
  checks::weighted_sum_args(U, coef, base, rows, nullptr, U.device(), "weighted_sum_screened");
  c10::cuda::CUDAGuard guard(U.device());
  auto out = checks::weighted_sum_output(U, base);
  at::Tensor ok;
  wsum_cuda(U, coef, base, alpha, rows, out, &ok, "weighted_sum_screened");
  return {out, ok};
}

at::Tensor weighted_sum_noised_cuda(const at::Tensor& U, const at::Tensor& coef, const c10::optional<at::Tensor>& base,
                                    double alpha, const c10::optional<at::Tensor>& rows, double sigma, int64_t seed,
                                    int64_t counter, int64_t offset) {
  checks::weighted_sum_args(U, coef, base, rows, nullptr, U.device(), "weighted_sum_noised");
  checks::noise_args(sigma, seed, counter, offset, "weighted_sum_noised");
  c10::cuda::CUDAGuard guard(U.device());
  auto out = checks::weighted_sum_output(U, base);
  wsum_cuda(U, coef, base, alpha, rows, out, nullptr, "weighted_sum_noised", sigma, seed, counter, offset);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CUDA, m) {
  m.impl("weighted_sum_noised", &weighted_sum_noised_cuda);
  m.impl("weighted_sum", &weighted_sum_cuda);
  m.impl("weighted_sum_out", &weighted_sum_out_cuda);
  m.impl("weighted_sum_screened", &weighted_sum_screened_cuda);
  m.impl("weighted_sum_screened_out", &weighted_sum_screened_out_cuda);
}

}  // namespace fedkernels
