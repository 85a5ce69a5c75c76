// Gaussian noise of the differential-privacy mechanism, on the CPU:
//   add_gaussian_noise_(x, sigma, seed, counter, offset):  x[j] += sigma * N(seed, counter, offset + j)
//       (x's flat index j; offset: the global column of x[0] when x is a column block of a longer vector)
//   weighted_sum_noised(U, coef, base, alpha, rows, sigma, seed, counter, offset):
//       out[j] = base[j] + alpha * sum_i coef[i] U[rows[i], j] + sigma * N(seed, counter, offset + j)
// N is the counter-based normal of csrc/cuda/gaussian_noise.cuh (Philox4x32-10 + Box-Muller, the same
// header the CUDA kernels compile): a pure function of (seed, counter, j), so the noise bits do not
// depend on thread count, chunking or device. The noise is added in the write of the output: fp64 as
// fma(sigma, n, v), other dtypes as v + float(sigma * n) in the float accumulator, then one rounding.
// weighted_sum_noised is weighted_sum's column-blocked pass (csrc/cpu/weighted_sum.cpp) with the chunk's
// normals drawn into an L1 scratch just before its output write: bytes moved as weighted_sum,
// (n + 2) d elements; the generator costs ~20 ns per pair of columns on one core (bench/dp.py).
// sigma = 0 gives weighted_sum's bits. Schemas: here (TORCH_LIBRARY_FRAGMENT); CUDA: csrc/cuda/gaussian_noise*.
#include "common.h"
#include "../gaussian_noise_checks.h"
#include "../weighted_sum_checks.h"
#define FEDKERNELS_HD_ONLY  // the shared per-element logic only, not the CUDA launchers
#include "../cuda/gaussian_noise.cuh"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <type_traits>
#include <vector>

namespace fedkernels {

// weighted_sum's CPU pass with the noise in its output write (csrc/cpu/weighted_sum.cpp).
void weighted_sum_noised_out_cpu_impl(const at::Tensor& U, const at::Tensor& coef, const c10::optional<at::Tensor>& base,
                                      double alpha, const c10::optional<at::Tensor>& rows, double sigma, uint64_t seed,
                                      uint64_t counter, uint64_t offset, at::Tensor& out);

namespace {

namespace gn = cuda::gnoise;

constexpr int64_t kNoiseChunk = 8192;  // columns per task (even: chunks start on a column pair)

template <typename T>
void add_noise_impl(T* x, int64_t n, double sigma, uint64_t seed, uint64_t counter, uint64_t offset) {
  using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const int64_t nch = (n + kNoiseChunk - 1) / kNoiseChunk;
  at::parallel_for(0, nch, grain_for(kNoiseChunk * 16), [&](int64_t q0, int64_t q1) {
    std::vector<double> nz(kNoiseChunk);
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t j0 = q * kNoiseChunk, len = std::min(kNoiseChunk, n - j0);
      gn::fill_normals(seed, counter, offset + (uint64_t)j0, len, nz.data());
      T* xx = x + j0;
      for (int64_t j = 0; j < len; ++j) xx[j] = static_cast<T>(gn::add_noise(A(xx[j]), sigma, nz[j]));
    }
  });
}

void add_gaussian_noise_cpu(at::Tensor x, double sigma, int64_t seed, int64_t counter, int64_t offset) {
  checks::add_gaussian_noise_args(x, sigma, seed, counter, offset, at::kCPU);
  if (x.numel() == 0 || sigma == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "add_gaussian_noise_", [&] {
    add_noise_impl<scalar_t>(x.data_ptr<scalar_t>(), x.numel(), sigma, (uint64_t)seed, (uint64_t)counter,
                             (uint64_t)offset);
  });
}

at::Tensor weighted_sum_noised_cpu(const at::Tensor& U, const at::Tensor& coef, const c10::optional<at::Tensor>& base,
                                   double alpha, const c10::optional<at::Tensor>& rows, double sigma, int64_t seed,
                                   int64_t counter, int64_t offset) {
  checks::weighted_sum_args(U, coef, base, rows, nullptr, at::kCPU, "weighted_sum_noised");
  checks::noise_args(sigma, seed, counter, offset, "weighted_sum_noised");
  auto out = checks::weighted_sum_output(U, base);
  weighted_sum_noised_out_cpu_impl(U, coef, base, alpha, rows, sigma, (uint64_t)seed, (uint64_t)counter,
                                   (uint64_t)offset, out);
  return out;
}

// The normals themselves, N(seed, counter, j0 + i) for i < n, as float64: the test hook that compares the
// native bits with fedkernels.reference.philox_normal and with Random123's known answers.
at::Tensor philox_normal_cpu(int64_t n, int64_t seed, int64_t counter, int64_t j0) {
  checks::noise_args(0.0, seed, counter, j0, "philox_normal");
  TORCH_CHECK(n >= 0, "philox_normal: n must be >= 0, got ", n);
  auto out = at::empty({n}, at::TensorOptions().dtype(at::kDouble));
  gn::fill_normals((uint64_t)seed, (uint64_t)counter, (uint64_t)j0, n, out.data_ptr<double>());
  return out;
}

// Raw Philox4x32-10 words of counters ctr [n, 4] (int64 holding uint32) with key (k0, k1): [n, 4] int64 on
// the host (a test hook: Random123's known answers).
at::Tensor philox4x32_10_cpu(const at::Tensor& ctr, int64_t k0, int64_t k1) {
  checks::philox_counters(ctr);
  auto c = ctr.cpu().contiguous();
  auto out = at::empty_like(c);
  const int64_t* p = c.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < c.size(0); ++i) {
    uint32_t w[4] = {(uint32_t)p[4 * i], (uint32_t)p[4 * i + 1], (uint32_t)p[4 * i + 2], (uint32_t)p[4 * i + 3]};
    gn::philox4x32_10(w, (uint32_t)k0, (uint32_t)k1);
    for (int e = 0; e < 4; ++e) o[4 * i + e] = (int64_t)w[e];
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fedkernels, m) {
  m.def("add_gaussian_noise_(Tensor(a!) x, float sigma, int seed, int counter, int offset=0) -> ()");
  m.def("weighted_sum_noised(Tensor U, Tensor coef, Tensor? base, float alpha, Tensor? rows, float sigma, int seed, "
        "int counter, int offset=0) -> Tensor");
  m.def("philox_normal(int n, int seed, int counter, int j0=0) -> Tensor");
  m.def("philox4x32_10(Tensor ctr, int k0, int k1) -> Tensor");
}

TORCH_LIBRARY_IMPL(fedkernels, CPU, m) {
  m.impl("add_gaussian_noise_", &add_gaussian_noise_cpu);
  m.impl("weighted_sum_noised", &weighted_sum_noised_cpu);
}

// Device-independent test hooks: the generator's host values.
TORCH_LIBRARY_IMPL(fedkernels, CompositeExplicitAutograd, m) {
  m.impl("philox_normal", &philox_normal_cpu);
  m.impl("philox4x32_10", &philox4x32_10_cpu);
}

}  // namespace fedkernels
