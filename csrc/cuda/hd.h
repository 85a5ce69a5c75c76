// FK_HD marks the per-thread / per-tile logic that the CUDA kernels call and that the host tests
// (tests/cuda_host/) compile with g++: under nvcc it is __host__ __device__, elsewhere nothing.
// Headers that use it include only <cmath>/<cstdint> and this file, never cuda_runtime.h, except in
// their closing launcher section (launch.h), which the host tests leave out with FEDKERNELS_HD_ONLY.
#pragma once

#if defined(__CUDACC__)
#define FK_HD __host__ __device__ __forceinline__
#define FK_UNROLL _Pragma("unroll")
#else
#define FK_HD inline
#define FK_UNROLL
#endif

#include <cmath>
#include <cstdint>
#include <cstring>

namespace fedkernels {
namespace cuda {

// IEEE round-to-nearest fma and bit casts, the same on the host and the device (the device intrinsics
// ignore --use_fast_math): kernels whose CPU and CUDA results must agree bit for bit use these.
FK_HD float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
FK_HD double fma_rn(double a, double b, double c) {
#if defined(__CUDA_ARCH__)
  return __fma_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
FK_HD uint64_t bits_of(double x) {
#if defined(__CUDA_ARCH__)
  return (uint64_t)__double_as_longlong(x);
#else
  uint64_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
#endif
}
FK_HD double of_bits(uint64_t b) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double((long long)b);
#else
  double x;
  std::memcpy(&x, &b, sizeof x);
  return x;
#endif
}
FK_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

}  // namespace cuda
}  // namespace fedkernels
