// FK_HD marks the per-thread / per-tile logic that the CUDA kernels call and that the host tests
// (tests/cuda_host/) compile with g++: under nvcc it is __host__ __device__, elsewhere nothing.
// Headers that use it include only <cmath>/<cstdint> and this file, never cuda_runtime.h.
#pragma once

#if defined(__CUDACC__)
#define FK_HD __host__ __device__ __forceinline__
#else
#define FK_HD inline
#endif
