// What every launcher of the fedkernels CUDA kernels shares: the DType tag, upload() and the
// conventions below. Each op declares its own launchers at the end of csrc/cuda/<op>.cuh, beside
// its per-thread logic: plain C++ (raw pointers, cudaStream_t), no torch headers, so each
// csrc/cuda/<op>.cu compiles alone with nvcc (CI compile check); the torch glue of op <op> sits
// beside it in csrc/cuda/<op>_glue.cpp (host compiler, ATen headers, registers itself with
// TORCH_LIBRARY_IMPL(fedkernels, CUDA, m)).
//
// Conventions:
// - Every launcher enqueues work on `stream` and returns cudaGetLastError() of its launches; it
//   never synchronises the host. Shapes are validated by the caller (the glue).
// - Matrices are row-major with unit column stride; `ld` is the row stride in elements.
// - Row indices are not range-checked by a device assert (an assert poisons the CUDA context):
//   an out-of-range entry gives NaN in the rows of the result it touches, and never a read
//   outside U. The glue checks host-resident indices; the Python wrappers check every device.
// - Reductions use a fixed order (no floating-point atomics): same inputs and shapes on the same
//   device give the same bits.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace fedkernels {
namespace cuda {

enum class DType : int { Float16 = 0, BFloat16 = 1, Float32 = 2, Float64 = 3 };

// ---- upload: host bytes -> device buffer through kernel arguments ------------------------------
// Small host tables (coefficients, row indices, work lists) reach the device as the by-value
// argument of one tiny kernel per kUploadBytes: stream-ordered, no pinned staging buffer, no host
// sync, and safe under CUDA-graph capture (the values are captured with the launch). dev must be
// 16-byte aligned with room for `bytes` rounded up to 16.
constexpr size_t kUploadBytes = 3840;
cudaError_t upload(const void* host, size_t bytes, void* dev, cudaStream_t stream);

}  // namespace cuda
}  // namespace fedkernels
