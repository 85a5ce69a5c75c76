// Torch glue of order_mean / closest_mean (kernel: select.cu; schemas: csrc/cpu/select.cpp). rows may be a
// host tensor (the Python wrapper passes it so) or on U's device.
#include <tuple>

#include <ATen/ops/ones.h>

#include "glue.h"
#include "select.cuh"
#include "../select_checks.h"

namespace fedkernels {
namespace {

using namespace glue;

template <bool closest>
std::tuple<at::Tensor, at::Tensor> select_cuda(const at::Tensor& U, int64_t lo, int64_t hi,
                                               const c10::optional<at::Tensor>& rows, const char* op) {
  checks::select_args(U, rows, U.device(), op);
  checks::rows_apart(U, op);
  c10::cuda::CUDAGuard guard(U.device());
  const int64_t K = U.size(0), d = U.size(1);
  const int64_t k = rows.has_value() ? rows->numel() : K;
  if (closest) checks::closest_mean_args(k, lo);
  else checks::order_mean_args(k, lo, hi);
  at::Tensor r;
  if (rows.has_value()) r = rows_to_device(*rows, U, op);
  auto out = at::empty({d}, U.options().dtype(checks::select_out_dtype(U.scalar_type())));
  auto ok = at::ones({k}, U.options().dtype(at::kBool));
  if (d == 0) return {out, ok};
  const auto dt = to_dtype(U.scalar_type(), op, "U");
  const int64_t* rp = rows.has_value() ? r.data_ptr<int64_t>() : nullptr;
  if (closest)
    C10_CUDA_CHECK(fk::closest_mean(U.data_ptr(), dt, K, d, row_stride(U), rp, k, lo, out.data_ptr(),
                                    ok.data_ptr<bool>(), stream()));
  else
    C10_CUDA_CHECK(fk::order_mean(U.data_ptr(), dt, K, d, row_stride(U), rp, k, lo, hi, out.data_ptr(),
                                  ok.data_ptr<bool>(), stream()));
  return {out, ok};
}

std::tuple<at::Tensor, at::Tensor> order_mean_cuda(const at::Tensor& U, int64_t lo, int64_t hi,
                                                   const c10::optional<at::Tensor>& rows) {
  return select_cuda<false>(U, lo, hi, rows, "order_mean");
}

std::tuple<at::Tensor, at::Tensor> closest_mean_cuda(const at::Tensor& U, int64_t beta,
                                                     const c10::optional<at::Tensor>& rows) {
  return select_cuda<true>(U, beta, 0, rows, "closest_mean");
}

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CUDA, m) {
  m.impl("order_mean", &order_mean_cuda);
  m.impl("closest_mean", &closest_mean_cuda);
}

}  // namespace fedkernels
