// upload: host bytes -> device through the by-value argument of a one-block kernel (launch.h).
// Kernel arguments are copied at launch (and at capture time under CUDA-graph capture), so the
// host buffer may be freed or reused as soon as upload() returns; no pinned memory, no host sync.
// Not host-tested (a copy loop); tests/test_weighted_sum.py's cuda cases (host coefficients and rows vs device ones)
// checks it on a GPU.
#include "common.cuh"

#include <cstring>

namespace fedkernels {
namespace cuda {
namespace {

constexpr int kWords = (int)(kUploadBytes / 16);
static_assert(kUploadBytes % 16 == 0 && kUploadBytes <= 4000, "kernel arguments are limited to 4 KB");

struct Chunk {
  uint4 w[kWords];
};

__global__ void upload_kernel(const Chunk c, uint4* __restrict__ dst, int nwords) {
  for (int i = threadIdx.x; i < nwords; i += blockDim.x) dst[i] = c.w[i];
}

}  // namespace

cudaError_t upload(const void* host, size_t bytes, void* dev, cudaStream_t stream) {
  const char* h = static_cast<const char*>(host);
  uint4* d = static_cast<uint4*>(dev);
  for (size_t off = 0; off < bytes; off += kUploadBytes) {
    const size_t len = bytes - off < kUploadBytes ? bytes - off : kUploadBytes;
    Chunk c;
    std::memset(&c, 0, sizeof(c));
    std::memcpy(&c, h + off, len);
    const int nwords = (int)((len + 15) / 16);
    upload_kernel<<<1, 256, 0, stream>>>(c, d + off / 16, nwords);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace cuda
}  // namespace fedkernels
