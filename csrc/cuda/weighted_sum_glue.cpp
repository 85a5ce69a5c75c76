// Torch glue of weighted_sum / weighted_sum_out (kernel: weighted_sum.cu).
// coef and rows may be host tensors (the Python wrappers pass them so: no host->device->host round
// trip) or on U's device. Host coef: the accumulation type (float unless some |alpha*coef| > 3e38,
// the CPU op's rule) is decided here; device coef: by the kernel.
#include <cmath>

#include "glue.h"

namespace fedkernels {
namespace {

using namespace glue;

void weighted_sum_out_cuda(const at::Tensor& U, const at::Tensor& coef, const c10::optional<at::Tensor>& base,
                           double alpha, const c10::optional<at::Tensor>& rows, at::Tensor out) {
  check_rowmajor(U, "weighted_sum");
  c10::cuda::CUDAGuard guard(U.device());
  const int64_t K = U.size(0), d = U.size(1);
  const int64_t n = rows.has_value() ? rows->numel() : K;
  TORCH_CHECK(coef.dim() == 1 && coef.numel() == n, "weighted_sum: coef must be 1-D of length ", n,
              " (one per selected row), got shape ", coef.sizes());
  TORCH_CHECK(coef.is_floating_point(), "weighted_sum: coef must be a float tensor, got ", coef.scalar_type());
  check_host_or_device(coef, U, "weighted_sum", "coef");
  TORCH_CHECK(out.dim() == 1 && out.size(0) == d && out.is_contiguous() && out.scalar_type() == U.scalar_type(),
              "weighted_sum: out must be a contiguous 1-D tensor of length ", d, " and dtype ", U.scalar_type());
  check_cuda(out, U, "weighted_sum", "out");
  if (base.has_value()) {
    TORCH_CHECK(base->dim() == 1 && base->size(0) == d && base->is_contiguous() && base->scalar_type() == U.scalar_type(),
                "weighted_sum: base must be a contiguous 1-D tensor of length ", d, " and dtype ", U.scalar_type());
    check_cuda(*base, U, "weighted_sum", "base");
  }
  at::Tensor r;
  if (rows.has_value()) r = rows_to_device(*rows, U, "weighted_sum");
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
  C10_CUDA_CHECK(fk::weighted_sum(U.data_ptr(), to_dtype(U.scalar_type(), "weighted_sum", "U"), K, d, row_stride(U),
                                  c.data_ptr<double>(), rows.has_value() ? r.data_ptr<int64_t>() : nullptr, n,
                                  base.has_value() ? base->data_ptr() : nullptr, alpha, wide, out.data_ptr(),
                                  stream()));
}

at::Tensor weighted_sum_cuda(const at::Tensor& U, const at::Tensor& coef, const c10::optional<at::Tensor>& base,
                             double alpha, const c10::optional<at::Tensor>& rows) {
  TORCH_CHECK(U.dim() == 2, "weighted_sum: U must be 2-D [K, d], got ", U.dim(), "-D");
  auto out = at::empty({U.size(1)}, U.options());
  weighted_sum_out_cuda(U, coef, base, alpha, rows, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CUDA, m) {
  m.impl("weighted_sum", &weighted_sum_cuda);
  m.impl("weighted_sum_out", &weighted_sum_out_cuda);
}

}  // namespace fedkernels
