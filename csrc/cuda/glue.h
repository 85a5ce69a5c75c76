// Helpers shared by the per-op torch glue files csrc/cuda/<op>_glue.cpp.
//
// Layout: csrc/cuda/<op>.cu holds the kernels and their launchers (plain CUDA, no torch header, so
// the CI compile check builds each alone with nvcc in ~2 s), csrc/cuda/<op>_glue.cpp the torch
// glue of that op (host compiler only: ATen headers through nvcc are slow and fragile), which
// registers itself with TORCH_LIBRARY_IMPL(fedkernels, CUDA, m). Both are built only in the CUDA
// build (setup.py). Includes only c10/cuda/CUDAStream.h for the stream: ATen/cuda/CUDAContext.h
// would pull in the cuBLAS/cuSPARSE/cuSOLVER headers that a minimal toolkit lacks.
//
// Division of work: the op's tensor rules (shapes, dtypes, devices, layouts) are in csrc/<op>_checks.h,
// called by the glue and the CPU kernel alike; the Python wrappers (fedkernels.ops) check types and
// values. The glue range-checks host-resident indices as it uploads them, and never synchronises the host
// (small vectors given on the device are read with checks::host_doubles: a device-to-host copy;
// the Python wrappers pass them on the host). Small per-client vectors (coef, rows, FedECADO's
// per-client scalars) may come as host (CPU) tensors or as tensors on the op's device; host ones
// reach the device through fedkernels::cuda::upload (kernel arguments: stream-ordered and safe
// under CUDA-graph capture, no pinned table).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "../checks.h"
#include "launch.h"

namespace fedkernels {
namespace glue {

namespace fk = fedkernels::cuda;

inline cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

inline fk::DType to_dtype(at::ScalarType s, const char* op, const char* name) {
  switch (s) {
    case at::kHalf: return fk::DType::Float16;
    case at::kBFloat16: return fk::DType::BFloat16;
    case at::kFloat: return fk::DType::Float32;
    case at::kDouble: return fk::DType::Float64;
    default: TORCH_CHECK(false, op, ": ", name, " must be float16, bfloat16, float32 or float64, got ", s);
  }
}

inline int64_t row_stride(const at::Tensor& U) { return U.size(0) > 1 ? U.stride(0) : U.size(1); }

// Host bytes -> a fresh 16-byte aligned device buffer (stream-ordered, capture-safe).
inline at::Tensor upload_bytes(const void* host, size_t bytes, c10::Device dev) {
  const int64_t n = (int64_t)((bytes + 15) / 16 * 16);
  auto buf = at::empty({std::max<int64_t>(n, 16)}, at::TensorOptions().dtype(at::kByte).device(dev));
  if (bytes) C10_CUDA_CHECK(fk::upload(host, bytes, buf.data_ptr(), stream()));
  return buf;
}

// A 1-D small vector as a contiguous device tensor of dtype st: host tensors are converted on the
// host and uploaded; device tensors are converted on the device.
inline at::Tensor small_to_device(const at::Tensor& t, at::ScalarType st, c10::Device dev) {
  if (!t.device().is_cpu()) return t.to(st).contiguous().view({-1});
  auto h = t.to(st).contiguous();
  const int64_t n = h.numel();
  auto buf = upload_bytes(h.data_ptr(), size_t(n) * h.element_size(), dev);
  return buf.view(st).narrow(0, 0, n);
}

// rows (after checks::index_rows: 1-D integer indices on the host or U's device): host-resident ones
// are range-checked here (device ones cannot be without a sync: the kernels turn an out-of-range
// entry into NaN, and the Python wrapper checks).
inline at::Tensor rows_to_device(const at::Tensor& rows, const at::Tensor& U, const char* op) {
  if (rows.device().is_cpu()) {
    auto h = rows.to(at::kLong).contiguous();
    const int64_t* p = h.data_ptr<int64_t>();
    const int64_t K = U.size(0);
    for (int64_t i = 0; i < h.numel(); ++i)
      TORCH_CHECK(p[i] >= 0 && p[i] < K, op, ": rows[", i, "] = ", p[i], " out of range [0, ", K, ")");
  }
  return small_to_device(rows, at::kLong, U.device());
}

}  // namespace glue
}  // namespace fedkernels
