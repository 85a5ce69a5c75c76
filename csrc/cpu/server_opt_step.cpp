// server_opt_step_: the fused adaptive server-optimiser step of FedAdam / FedYogi / FedAdagrad
// (Reddi et al. 2021, "Adaptive Federated Optimization", Algorithm 2, as Flower's strategies write it),
// its schema (TORCH_LIBRARY_FRAGMENT) and its CPU kernel.
//
// Maths, per coordinate j (in the state's precision A: float32 state, or float64 for float64 state):
//   g = io[j]  (or io[j] - x[j] with from_model: io holds an inner method's new model)
//   m = beta_1 m + (1 - beta_1) g
//   v = adam: beta_2 v + (1 - beta_2) g^2 | yogi: v - (1 - beta_2) g^2 sign(v - g^2) | adagrad: v + g^2
//   io[j] = x[j] + lr m / (sqrt(v) + tau)
// The per-coordinate function is the CUDA kernel's (csrc/cuda/server_opt_step.cuh, included here with
// FEDKERNELS_HD_ONLY): explicit fmas, correctly rounded sqrt and division, the same order on both
// backends. lr is the caller's step size (eta, times Flower's / Adam's bias correction where asked).
//
// Bytes moved: one pass over d: read io, x, m, v and write io, m, v (7 d-vectors; 4 + 4 + 4 + 4 read and
// 4 + 4 + 4 written per coordinate for an fp32 model and fp32 state: 28 bytes), against the 13-15 d-vectors of
// the torch composition of the same maths (bench/server_opt.py). No temporaries.
// Determinism: elementwise, no reduction: every coordinate's bits depend only on its inputs (not on the
// thread count, the chunking or the ISA: explicit fma, no contraction left to the compiler). The loop
// vectorises (sqrt and division included) because the build passes -fno-math-errno (setup.py).
#include "common.h"
#include "../server_opt_step_checks.h"

#define FEDKERNELS_HD_ONLY
#include "../cuda/server_opt_step.cuh"
#undef FEDKERNELS_HD_ONLY

namespace fedkernels {
namespace {

namespace so = fedkernels::cuda::so;

constexpr int64_t kSpan = 1 << 14;   // coordinates per task (64 KB of fp32 per stream)

template <typename T, typename A, int RULE, bool FROM_MODEL>
FEDKERNELS_SIMD_CLONES void step_span(T* __restrict__ io, A* __restrict__ m, A* __restrict__ v,
                                      const T* __restrict__ x, int64_t n, so::Coef<A> c) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const A xj = static_cast<A>(x[j]);
    A g = static_cast<A>(io[j]);
    if constexpr (FROM_MODEL) g = g - xj;
    A mj = m[j], vj = v[j];
    const A out = so::update<RULE, A>(g, xj, mj, vj, c);
    m[j] = mj;
    v[j] = vj;
    io[j] = static_cast<T>(out);
  }
}

template <typename T, typename A>
void run(at::Tensor& io, at::Tensor& m, at::Tensor& v, const at::Tensor& x, int rule, bool from_model,
         const double* k) {
  const so::Coef<A> c{A(k[0]), A(k[1]), A(k[2]), A(k[3]), A(k[4]), A(k[5])};
  T* o = io.data_ptr<T>();
  A* mm = m.data_ptr<A>();
  A* vv = v.data_ptr<A>();
  const T* xx = x.data_ptr<T>();
  const int64_t d = io.numel(), ntask = (d + kSpan - 1) / kSpan;
  at::parallel_for(0, ntask, grain_for(kSpan), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t a = t * kSpan, n = std::min(kSpan, d - a);
      switch (rule * 2 + (from_model ? 1 : 0)) {
        case 0: step_span<T, A, so::kAdam, false>(o + a, mm + a, vv + a, xx + a, n, c); break;
        case 1: step_span<T, A, so::kAdam, true>(o + a, mm + a, vv + a, xx + a, n, c); break;
        case 2: step_span<T, A, so::kYogi, false>(o + a, mm + a, vv + a, xx + a, n, c); break;
        case 3: step_span<T, A, so::kYogi, true>(o + a, mm + a, vv + a, xx + a, n, c); break;
        case 4: step_span<T, A, so::kAdagrad, false>(o + a, mm + a, vv + a, xx + a, n, c); break;
        default: step_span<T, A, so::kAdagrad, true>(o + a, mm + a, vv + a, xx + a, n, c); break;
      }
    }
  });
}

void server_opt_step_cpu(at::Tensor& io, at::Tensor& m, at::Tensor& v, const at::Tensor& x, c10::string_view rule,
                         double lr, double beta_1, double beta_2, double tau, bool from_model) {
  const int r = checks::server_opt_rule(rule);
  checks::server_opt_args(io, m, v, x);
  if (io.numel() == 0) return;
  const double coef[6] = {beta_1, 1.0 - beta_1, beta_2, 1.0 - beta_2, lr, tau};
  const bool s64 = m.scalar_type() == at::kDouble;
  switch (io.scalar_type()) {
    case at::kDouble: run<double, double>(io, m, v, x, r, from_model, coef); break;
    case at::kFloat:
      s64 ? run<float, double>(io, m, v, x, r, from_model, coef) : run<float, float>(io, m, v, x, r, from_model, coef);
      break;
    case at::kBFloat16:
      s64 ? run<c10::BFloat16, double>(io, m, v, x, r, from_model, coef)
          : run<c10::BFloat16, float>(io, m, v, x, r, from_model, coef);
      break;
    default:   // kHalf (the checks admit the four float dtypes only)
      s64 ? run<c10::Half, double>(io, m, v, x, r, from_model, coef)
          : run<c10::Half, float>(io, m, v, x, r, from_model, coef);
      break;
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fedkernels, m) {
  // ---- adaptive server optimiser (FedAdam / FedYogi / FedAdagrad), one fused pass over d -------------
  // io: [d] the pseudo-gradient (aggregate - x) in, the new model x + lr m / (sqrt(v) + tau) out;
  // with from_model, io holds the inner method's new model in and the pseudo-gradient is io - x.
  // m, v: [d] float32/float64 state, updated in place (rule: adam | yogi | adagrad); x: [d] read.
  m.def("server_opt_step_(Tensor(a!) io, Tensor(b!) m, Tensor(c!) v, Tensor x, str rule, float lr, float beta_1, "
        "float beta_2, float tau, bool from_model=False) -> ()");
}

TORCH_LIBRARY_IMPL(fedkernels, CPU, m) { m.impl("server_opt_step_", &server_opt_step_cpu); }

}  // namespace fedkernels
