// Torch glue of dequant_weighted_sum (kernel: dequant_weighted_sum.cu; schema: csrc/cpu/dequant_weighted_sum.cpp).
// coef and rows may be host tensors (the Python wrapper passes them so) or on Q's device.
#include <tuple>
#include <vector>

#include <ATen/ops/ones.h>

#include "glue.h"
#include "dequant_weighted_sum.cuh"
#include "../dequant_weighted_sum_checks.h"

namespace fedkernels {
namespace {

using namespace glue;

std::tuple<at::Tensor, at::Tensor> dequant_weighted_sum_cuda(const at::Tensor& Q, const at::Tensor& scales,
                                                             const at::Tensor& coef, int64_t block,
                                                             const c10::optional<at::Tensor>& base, double alpha,
                                                             const c10::optional<at::Tensor>& rows,
                                                             c10::optional<at::ScalarType> out_dtype) {
  const char* op = "dequant_weighted_sum";
  const auto args = checks::dequant_weighted_sum_args(Q, scales, coef, block, base, rows, out_dtype, Q.device());
  const int64_t n = args.n;
  const at::ScalarType ost = args.result;
  checks::rows_apart(Q, op, "Q");  // the kernel reads whole rows
  c10::cuda::CUDAGuard guard(Q.device());
  const int64_t K = Q.size(0), d = Q.size(1);
  at::Tensor r;
  if (rows.has_value()) r = rows_to_device(*rows, Q, op);
  auto out = at::empty({d}, Q.options().dtype(ost));
  auto ok = at::ones({n}, Q.options().dtype(at::kBool));
  if (d == 0) return {out, ok};
  auto ac = coef.to(at::kDouble).mul(alpha);   // alpha coef_i in float64, on coef's device
  ac = small_to_device(ac, at::kDouble, Q.device());
  auto ws = at::empty({4}, Q.options().dtype(at::kInt));
  const int64_t ldq = K > 1 ? Q.stride(0) : d, lds = K > 1 ? scales.stride(0) : scales.size(1);
  C10_CUDA_CHECK(fk::dequant_weighted_sum(Q.data_ptr(), Q.scalar_type() == at::kChar ? 0 : 1, K, d, ldq,
                                          scales.data_ptr<float>(), lds, block, ac.data_ptr<double>(),
                                          rows.has_value() ? r.data_ptr<int64_t>() : nullptr, n,
                                          base.has_value() ? base->data_ptr() : nullptr, out.data_ptr(),
                                          ost == at::kDouble, ok.data_ptr<bool>(), ws.data_ptr<int>(), stream()));
  return {out, ok};
}

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CUDA, m) { m.impl("dequant_weighted_sum", &dequant_weighted_sum_cuda); }

}  // namespace fedkernels
