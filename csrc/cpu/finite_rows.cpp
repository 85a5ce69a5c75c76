// finite_rows: ok[k] = all(isfinite(U[k, :])), one read of U with no K x d temporary.
#include "common.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>

namespace fedkernels {
namespace {

template <typename T>
void finite_impl(const at::Tensor& U, bool* ok) {
  const int64_t K = U.size(0), d = U.size(1), s0 = U.stride(0);
  const T* u = U.data_ptr<T>();
  constexpr int64_t CH = 1 << 14;
  const int64_t nch = (d + CH - 1) / CH;
  std::vector<unsigned char> flag(K * nch, 1);
  at::parallel_for(0, K * nch, grain_for(std::min(CH, d)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t k = t / nch, q = t % nch, j0 = q * CH, len = std::min(CH, d - j0);
      flag[t] = finite_span<T>(u + k * s0 + j0, len);
    }
  });
  for (int64_t k = 0; k < K; ++k) {
    bool all = true;
    for (int64_t q = 0; q < nch; ++q) all = all && flag[k * nch + q];
    ok[k] = all;
  }
}

at::Tensor finite_rows_cpu(const at::Tensor& U) {
  checks::matrix(U, at::kCPU, "finite_rows");
  auto ok = at::empty({U.size(0)}, U.options().dtype(at::kBool));
  if (U.size(0) == 0) return ok;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, U.scalar_type(), "finite_rows_cpu", [&] {
    finite_impl<scalar_t>(U, ok.data_ptr<bool>());
  });
  return ok;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fedkernels, m) {
  // ok[k] = all(isfinite(U[k])): [K] bool, one read of U (bad-update screening).
  m.def("finite_rows(Tensor U) -> Tensor");
}

TORCH_LIBRARY_IMPL(fedkernels, CPU, m) { m.impl("finite_rows", &finite_rows_cpu); }

}  // namespace fedkernels
