// Torch glue of gram (kernel: gram.cu). Schema: gram(Tensor U, Tensor? rows=None) -> Tensor [k|K, K] f64.
#include <ATen/ops/zeros.h>

#include "glue.h"
#include "gram.cuh"
#include "../gram_checks.h"

namespace fedkernels {
namespace {

using namespace glue;

at::Tensor gram_cuda(const at::Tensor& U, const c10::optional<at::Tensor>& rows) {
  checks::gram_args(U, rows, U.device());
  checks::rows_apart(U, "gram");
  c10::cuda::CUDAGuard guard(U.device());
  const int64_t K = U.size(0), d = U.size(1);
  at::Tensor r;
  if (rows.has_value()) r = rows_to_device(*rows, U, "gram");
  const int64_t k = rows.has_value() ? r.numel() : K;
  const bool symmetric = !rows.has_value();
  if (k == 0 || K == 0 || d == 0) return at::zeros({k, K}, U.options().dtype(at::kDouble));
  auto G = at::empty({k, K}, U.options().dtype(at::kDouble));
  const size_t wsb = fk::gram_workspace_bytes(k, K, d, symmetric);
  auto ws = at::empty({(int64_t)wsb}, U.options().dtype(at::kByte));
  C10_CUDA_CHECK(fk::gram(U.data_ptr(), to_dtype(U.scalar_type(), "gram", "U"), K, d, row_stride(U),
                          symmetric ? nullptr : r.data_ptr<int64_t>(), k, G.data_ptr<double>(), ws.data_ptr(),
                          stream()));
  return G;
}

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CUDA, m) { m.impl("gram", &gram_cuda); }

}  // namespace fedkernels
