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
