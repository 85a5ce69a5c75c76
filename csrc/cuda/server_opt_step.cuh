// Per-element logic of server_opt_step_ (the adaptive server optimisers of Reddi et al. 2021 as
// Flower's FedAdam / FedYogi / FedAdagrad write them), shared by the CUDA kernel
// (csrc/cuda/server_opt_step.cu) and the CPU kernel (csrc/cpu/server_opt_step.cpp, which includes
// this header with FEDKERNELS_HD_ONLY): both backends run the same arithmetic in the same order.
//
// One coordinate, in the state's precision A (float32, or float64 for float64 state):
//   g  = io                      (or io - x when io holds an inner method's new model: from_model)
//   m' = beta_1 m + (1 - beta_1) g                          fma(b1, m, c1 * g)
//   v' = adam:    beta_2 v + (1 - beta_2) g^2               fma(b2, v, c2 * g2),  g2 = g * g (rounded)
//        yogi:    v - (1 - beta_2) g^2 sign(v - g^2)        fma(-(c2 * g2), s, v), s = (v > g2) - (v < g2)
//        adagrad: v + g^2                                   fma(g, g, v)
//   io' = x + (lr m') / (sqrt(v') + tau)                    (correctly rounded sqrt and division)
// c1 = 1 - beta_1 and c2 = 1 - beta_2 are formed in float64 on the host and rounded to A once, as
// NumPy does with a Python float times a float32 array. Every multiply-add is an explicit fma (never
// left to -ffp-contract / nvcc's --fmad, which may contract a vector body and its scalar tail
// differently): the bits depend only on the inputs, not on the ISA, the alignment or the thread
// count. The sign test compares v with the rounded g2, which is the sign of Flower's rounded v - g2
// (a difference of two floats is zero only when they are equal). NaN propagates to m', v' and io'.
//
// Host-tested through the CPU op (tests/test_server_opt.py: the same function against the float64
// reference). Only a GPU run checks the CUDA launch and the device's fma / sqrt / division intrinsics
// (IEEE round-to-nearest: __fmaf_rn, __fsqrt_rn, __fdiv_rn and their double forms, so the CUDA op
// gives the CPU op's bits).
#pragma once

#include <cmath>
#include <cstdint>

#include "hd.h"

namespace fedkernels {
namespace cuda {
namespace so {

enum Rule : int { kAdam = 0, kYogi = 1, kAdagrad = 2 };

// IEEE round-to-nearest sqrt and division on both sides (the device intrinsics ignore --use_fast_math; fma_rn: hd.h).
FK_HD float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}
FK_HD double sqrt_rn(double a) {
#if defined(__CUDA_ARCH__)
  return __dsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}
FK_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
FK_HD double div_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}

// The step's scalars in the state's precision.
template <typename A> struct Coef {
  A b1, c1, b2, c2, lr, tau;
};

// One coordinate: updates m and v and returns the new model value x + lr m' / (sqrt(v') + tau).
template <int RULE, typename A> FK_HD A update(A g, A x, A& m, A& v, const Coef<A>& c) {
  const A mn = fma_rn(c.b1, m, c.c1 * g);
  const A g2 = g * g;
  A vn;
  if (RULE == kAdam) {
    vn = fma_rn(c.b2, v, c.c2 * g2);
  } else if (RULE == kYogi) {
    const A s = A(int(v > g2) - int(v < g2));
    vn = fma_rn(-(c.c2 * g2), s, v);
  } else {
    vn = fma_rn(g, g, v);
  }
  m = mn;
  v = vn;
  return x + div_rn(c.lr * mn, sqrt_rn(vn) + c.tau);
}

}  // namespace so
}  // namespace cuda
}  // namespace fedkernels

// ---- launcher (csrc/cuda/server_opt_step.cu), called by the torch glue csrc/cuda/server_opt_step_glue.cpp. It
// needs the CUDA runtime headers: the CPU kernel and the host tests define FEDKERNELS_HD_ONLY.
#ifndef FEDKERNELS_HD_ONLY
#include "launch.h"

namespace fedkernels {
namespace cuda {

// ---- server_opt_step_: io, m, v updated in place over d coordinates (x read); m, v float32 (state64
// false) or float64 (true); io and x of dtype dt. coef = {b1, c1, b2, c2, lr, tau} in float64 (rounded
// to the state's precision by the launcher). ------------------------------------------------------
cudaError_t server_opt_step(void* io, void* m, void* v, const void* x, DType dt, bool state64, int64_t d, int rule,
                            bool from_model, const double* coef, cudaStream_t stream);

}  // namespace cuda
}  // namespace fedkernels
#endif  // FEDKERNELS_HD_ONLY
