// server_opt_step_: the fused adaptive server-optimiser step (FedAdam / FedYogi / FedAdagrad), one pass
// over d: reads io, x, m, v and writes io, m, v (the per-element maths: server_opt_step.cuh, shared
// with the CPU kernel). A grid-stride loop, one coordinate per thread per step, coalesced scalar loads;
// no reduction, so the result is the same for any launch configuration.
// Only a GPU run checks: the launch and the device intrinsics (the per-element function is the CPU op's,
// tested there against the float64 reference).
#include "common.cuh"
#include "server_opt_step.cuh"

#include <algorithm>
#include <type_traits>

namespace fedkernels {
namespace cuda {
namespace {

using namespace detail;

constexpr int kThreads = 256;

template <typename T, typename A, int RULE, bool FROM_MODEL>
__global__ void __launch_bounds__(kThreads)
    step_kernel(T* __restrict__ io, A* __restrict__ m, A* __restrict__ v, const T* __restrict__ x, int64_t d,
                so::Coef<A> c) {
  const int64_t stride = (int64_t)gridDim.x * kThreads;
  for (int64_t j = (int64_t)blockIdx.x * kThreads + threadIdx.x; j < d; j += stride) {
    const A xj = static_cast<A>(to_float(__ldg(x + j)));
    A g = static_cast<A>(to_float(io[j]));
    if (FROM_MODEL) g = g - xj;
    A mj = m[j], vj = v[j];
    const A out = so::update<RULE, A>(g, xj, mj, vj, c);
    m[j] = mj;
    v[j] = vj;
    io[j] = from_acc<T>(out);
  }
}

template <typename T, typename A>
cudaError_t launch(void* io, void* m, void* v, const void* x, int64_t d, int rule, bool from_model, const double* k,
                   cudaStream_t stream) {
  const so::Coef<A> c{A(k[0]), A(k[1]), A(k[2]), A(k[3]), A(k[4]), A(k[5])};
  const int64_t want = (d + kThreads - 1) / kThreads;
  const unsigned blocks = (unsigned)std::min<int64_t>(want, (int64_t)num_sms() * 8);
  T* o = static_cast<T*>(io);
  A* mm = static_cast<A*>(m);
  A* vv = static_cast<A*>(v);
  const T* xx = static_cast<const T*>(x);
#define FK_SO_LAUNCH(R, F) step_kernel<T, A, R, F><<<blocks, kThreads, 0, stream>>>(o, mm, vv, xx, d, c)
  switch (rule * 2 + (from_model ? 1 : 0)) {
    case 0: FK_SO_LAUNCH(so::kAdam, false); break;
    case 1: FK_SO_LAUNCH(so::kAdam, true); break;
    case 2: FK_SO_LAUNCH(so::kYogi, false); break;
    case 3: FK_SO_LAUNCH(so::kYogi, true); break;
    case 4: FK_SO_LAUNCH(so::kAdagrad, false); break;
    case 5: FK_SO_LAUNCH(so::kAdagrad, true); break;
    default: return cudaErrorInvalidValue;
  }
#undef FK_SO_LAUNCH
  return cudaGetLastError();
}

}  // namespace

cudaError_t server_opt_step(void* io, void* m, void* v, const void* x, DType dt, bool state64, int64_t d, int rule,
                            bool from_model, const double* coef, cudaStream_t stream) {
  if (d <= 0) return cudaSuccess;
  return dispatch(dt, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_same<T, double>::value) {   // a float64 model has float64 state (the glue checks)
      return state64 ? launch<T, double>(io, m, v, x, d, rule, from_model, coef, stream) : cudaErrorInvalidValue;
    } else {
      return state64 ? launch<T, double>(io, m, v, x, d, rule, from_model, coef, stream)
                     : launch<T, float>(io, m, v, x, d, rule, from_model, coef, stream);
    }
  });
}

}  // namespace cuda
}  // namespace fedkernels
