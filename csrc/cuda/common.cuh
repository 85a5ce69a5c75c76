// Device helpers shared by the fedkernels CUDA kernels (no torch headers).
// Conversions are explicit (__half2float etc.) so the files also compile under torch's
// -D__CUDA_NO_HALF_OPERATORS__ / -D__CUDA_NO_HALF_CONVERSIONS__ flags.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "launch.h"

namespace fedkernels {
namespace cuda {
namespace detail {

// Accumulation type: fp32 for fp16/bf16/fp32, fp64 for fp64.
template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ double to_float(double x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_acc(float x);
template <> __device__ __forceinline__ float from_acc<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_acc<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <typename T> __device__ __forceinline__ T from_acc(double x);
template <> __device__ __forceinline__ double from_acc<double>(double x) { return x; }
// double -> narrow types through float, as c10::Half / c10::BFloat16 (the CPU op's casts) do.
template <> __device__ __forceinline__ float from_acc<float>(double x) { return static_cast<float>(x); }
template <> __device__ __forceinline__ __half from_acc<__half>(double x) { return __float2half_rn(static_cast<float>(x)); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(double x) {
  return __float2bfloat16_rn(static_cast<float>(x));
}

template <typename T> __device__ __forceinline__ double to_double(T x) { return static_cast<double>(to_float(x)); }

// 16-byte vector of T: kVec elements.
template <typename T> struct Vec16 { static constexpr int n = 16 / sizeof(T); };

// Loads n = Vec16<T>::n elements from a 16-byte aligned address into acc-type registers.
template <typename T, typename A>
__device__ __forceinline__ void load16(const T* p, A (&v)[Vec16<T>::n]) {
  uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < Vec16<T>::n; ++i) v[i] = static_cast<A>(to_float(e[i]));
}
// Same without the read-only cache hint (for data the kernel may also write, e.g. base == out).
template <typename T, typename A>
__device__ __forceinline__ void load16_rw(const T* p, A (&v)[Vec16<T>::n]) {
  uint4 raw = *reinterpret_cast<const uint4*>(p);
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < Vec16<T>::n; ++i) v[i] = static_cast<A>(to_float(e[i]));
}
template <typename T, typename A>
__device__ __forceinline__ void store16(T* p, const A (&v)[Vec16<T>::n]) {
  uint4 raw;
  T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int i = 0; i < Vec16<T>::n; ++i) e[i] = from_acc<T>(v[i]);
  *reinterpret_cast<uint4*>(p) = raw;
}

template <typename A> __device__ __forceinline__ A warp_sum(A x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;  // butterfly: every lane holds the same value, in a fixed order
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

inline int num_sms() {
  static int sms = 0;
  if (sms == 0) {
    int dev = 0;
    cudaGetDevice(&dev);
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms <= 0) sms = 132;
  }
  return sms;
}

// Shared memory one block may opt in to on the current device (cudaFuncAttributeMaxDynamicSharedMemorySize
// limit), minus `reserve` bytes for the kernel's static shared arrays.
inline size_t smem_optin(size_t reserve) {
  static int optin = 0;
  if (optin == 0) {
    int dev = 0;
    cudaGetDevice(&dev);
    if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess || optin <= 0)
      optin = 48 * 1024;
  }
  return size_t(optin) > reserve ? size_t(optin) - reserve : 0;
}

}  // namespace detail
}  // namespace cuda
}  // namespace fedkernels

// Dispatches on DType to a callable templated on the element type: FK_DISPATCH(dt, [&](auto tag)
// { using T = typename decltype(tag)::type; ... }).
namespace fedkernels { namespace cuda { namespace detail {
template <typename T> struct TypeTag { using type = T; };
template <typename F> cudaError_t dispatch(DType dt, F&& f) {
  switch (dt) {
    case DType::Float16: return f(TypeTag<__half>{});
    case DType::BFloat16: return f(TypeTag<__nv_bfloat16>{});
    case DType::Float32: return f(TypeTag<float>{});
    case DType::Float64: return f(TypeTag<double>{});
  }
  return cudaErrorInvalidValue;
}
}}}  // namespace fedkernels::cuda::detail
