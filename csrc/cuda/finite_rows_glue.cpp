// Torch glue of finite_rows (kernel: finite_rows.cu). Schema: finite_rows(Tensor U) -> Tensor [K] bool.
#include "glue.h"
#include "finite_rows.cuh"

namespace fedkernels {
namespace {

using namespace glue;

at::Tensor finite_rows_cuda(const at::Tensor& U) {
  checks::matrix(U, U.device(), "finite_rows");
  checks::rows_apart(U, "finite_rows");
  c10::cuda::CUDAGuard guard(U.device());
  auto ok = at::empty({U.size(0)}, U.options().dtype(at::kBool));
  if (U.size(0) == 0) return ok;
  C10_CUDA_CHECK(fk::finite_rows(U.data_ptr(), to_dtype(U.scalar_type(), "finite_rows", "U"), U.size(0), U.size(1),
                                 row_stride(U), ok.data_ptr<bool>(), stream()));
  return ok;
}

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CUDA, m) { m.impl("finite_rows", &finite_rows_cuda); }

}  // namespace fedkernels
