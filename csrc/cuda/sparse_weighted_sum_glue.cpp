// Torch glue of sparse_weighted_sum (kernel: sparse_weighted_sum.cu; schema: csrc/cpu/sparse_weighted_sum.cpp).
// offsets are host tensors (checked there); coef and rows may be host tensors or on idx's device (read on the
// host: small per-list vectors); the selected lists' [lo, hi) ranges and weights reach the device by upload.
#include <cmath>
#include <tuple>
#include <vector>

#include <ATen/ops/ones.h>

#include "glue.h"
#include "sparse_weighted_sum.cuh"
#include "../sparse_weighted_sum_checks.h"

namespace fedkernels {
namespace {

using namespace glue;

std::tuple<at::Tensor, at::Tensor> sparse_weighted_sum_cuda(const at::Tensor& idx, const at::Tensor& val,
                                                            const at::Tensor& offsets, const at::Tensor& coef, int64_t d,
                                                            const c10::optional<at::Tensor>& base, double alpha,
                                                            const c10::optional<at::Tensor>& rows,
                                                            c10::optional<at::ScalarType> out_dtype) {
  const char* op = "sparse_weighted_sum";
  c10::cuda::CUDAGuard guard(idx.device());
  const auto args = checks::sparse_weighted_sum_args(idx, val, offsets, coef, d, base, rows, out_dtype, idx.device());
  const int64_t K = args.K;
  std::vector<int64_t> r;
  if (rows.has_value()) {
    auto h = rows->to(at::kCPU, at::kLong).contiguous();  // 1-D: checked above
    r.assign(h.data_ptr<int64_t>(), h.data_ptr<int64_t>() + h.numel());
    for (int64_t x : r) TORCH_CHECK(x >= 0 && x < K, op, ": rows entry ", x, " out of range [0, ", K, ")");
  } else {
    for (int64_t k = 0; k < K; ++k) r.push_back(k);
  }
  const int64_t n = args.n;
  const at::ScalarType ost = args.result;
  auto out = at::empty({d}, val.options().dtype(ost));
  auto ok = at::ones({n}, val.options().dtype(at::kBool));
  if (d == 0) {   // no tile: the lists' values are screened here
    auto v = val.to(at::kCPU, at::kDouble).contiguous();
    auto o = offsets.contiguous();
    auto okh = at::ones({n}, at::TensorOptions().dtype(at::kBool));
    for (int64_t i = 0; i < n; ++i)
      for (int64_t p = o.data_ptr<int64_t>()[r[i]]; p < o.data_ptr<int64_t>()[r[i] + 1]; ++p)
        okh.data_ptr<bool>()[i] = okh.data_ptr<bool>()[i] && std::isfinite(v.data_ptr<double>()[p]);
    return {out, okh.to(idx.device())};
  }
  const auto cv = checks::host_doubles(coef);
  auto o = offsets.contiguous();
  const int64_t* op_ = o.data_ptr<int64_t>();
  std::vector<int64_t> lo(n), hi(n);
  std::vector<double> w(n);
  bool wide = false;
  for (int64_t i = 0; i < n; ++i) {
    lo[i] = op_[r[i]];
    hi[i] = op_[r[i] + 1];
    w[i] = alpha * cv[i];
    wide = wide || std::abs(w[i]) > 3.0e38;
  }
  auto lo_d = upload_bytes(lo.data(), lo.size() * sizeof(int64_t), idx.device());
  auto hi_d = upload_bytes(hi.data(), hi.size() * sizeof(int64_t), idx.device());
  auto w_d = upload_bytes(w.data(), w.size() * sizeof(double), idx.device());
  C10_CUDA_CHECK(fk::sparse_weighted_sum(idx.data_ptr(), idx.scalar_type() == at::kLong, val.data_ptr(),
                                         to_dtype(val.scalar_type(), op, "val"), static_cast<int64_t*>(lo_d.data_ptr()),
                                         static_cast<int64_t*>(hi_d.data_ptr()), static_cast<double*>(w_d.data_ptr()), n,
                                         d, base.has_value() ? base->data_ptr() : nullptr, out.data_ptr(),
                                         ost == at::kDouble, wide, ok.data_ptr<bool>(), stream()));
  return {out, ok};
}

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CUDA, m) { m.impl("sparse_weighted_sum", &sparse_weighted_sum_cuda); }

}  // namespace fedkernels
