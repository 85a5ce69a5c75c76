// kstats: Kuramoto's phase statistics in one pass over U, no K x K Gram (csrc/cpu/kstats.cpp has the
// maths; docs/specs/kuramoto_fedavg.md §5.1 KSTATS).
//
// A block per column part (kstats.cuh kstats_hd::plan: tiles of TW columns, a part = tpp consecutive tiles,
// at most kMaxParts parts; all functions of K, d and the element size). Per tile: phase 1, the tile's
// p-weighted mean in fp64 (thread t sums column t % TW over a fixed subset of rows, the groups added in
// order through shared memory); phase 2, warp w takes rows w, w + 8, ...: each lane its columns' U_kj
// mean_j and U_kj^2 in fp64, the warp's butterfly sum, added by lane 0 to the part's sums of row k in
// global memory (the same warp owns row k in every tile: no race, tiles in column order); warp 0 adds
// ||tile mean||^2. A second kernel adds the parts in part order (dot, nsq, nbar) and sets ok[k] =
// isfinite(nsq[k]), exact for fp16/bf16/fp32 (their squares cannot overflow fp64); a float64 row whose
// nsq is not finite is scanned on its own (one thread, rare: a bad or huge row). No atomics: the same
// inputs give the same bits on the same device.
//
// Bytes moved: U read from memory once (phase 2 re-reads the block's K x TW tile, sized to stay in L2),
// the parts' sums nparts x (2K + 1) doubles written, read and re-written per tile, outputs 3K + 1
// doubles and K bools. Plain loads (no 16-byte vectors): simple first, GPU speed not measured.
// Compile-checked only (nvcc, sm_90); no GPU run yet: tests/test_kstats.py's cuda cases check it there.
#include "common.cuh"
#include "kstats.cuh"

#include <cmath>

namespace fedkernels {
namespace cuda {
namespace {

using namespace detail;
using kstats_hd::kThreads;
using kstats_hd::kWarps;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    kstats_parts(const T* __restrict__ U, int64_t K, int64_t d, int64_t ld, const double* __restrict__ p,
                 int64_t TW, int64_t tpp, double* __restrict__ part) {
  __shared__ double smean[kThreads];    // phase 1: the groups' column sums, then the tile's mean
  __shared__ double mean[256];
  const int t = threadIdx.x, warp = t / 32, lane = t % 32;
  const int64_t stride = 2 * K + 1;
  double* dot = part + blockIdx.x * stride;
  double* nsq = dot + K;
  double* nbar = dot + 2 * K;
  const int64_t G = kstats_hd::mean_groups(TW), c = kstats_hd::mean_col(t, TW), g = kstats_hd::mean_group(t, TW);
  for (int64_t ti = 0; ti < tpp; ++ti) {
    const int64_t j0 = (blockIdx.x * tpp + ti) * TW;
    if (j0 >= d) break;
    const bool first = ti == 0;
    // phase 1
    double s = 0.0;
    if (j0 + c < d)
      for (int64_t k = g; k < K; k += G) s += p[k] * to_double(__ldg(U + k * ld + j0 + c));
    smean[t] = s;
    __syncthreads();
    if (t < TW) {
      double m = smean[t];
      for (int64_t q = 1; q < G; ++q) m += smean[q * TW + t];
      mean[t] = m;
    }
    __syncthreads();
    // phase 2
    for (int64_t k = kstats_hd::row_first(warp); k < K; k += kWarps) {
      const T* x = U + k * ld + j0;
      double sd = 0.0, sn = 0.0;
      for (int64_t j = lane; j < TW; j += 32)
        if (j0 + j < d) {
          const double v = to_double(__ldg(x + j));
          sd += v * mean[j];
          sn += v * v;
        }
      sd = warp_sum(sd);
      sn = warp_sum(sn);
      if (lane == 0) {
        dot[k] = first ? sd : dot[k] + sd;
        nsq[k] = first ? sn : nsq[k] + sn;
      }
    }
    if (warp == 0) {
      double sm = 0.0;
      for (int64_t j = lane; j < TW; j += 32) sm += mean[j] * mean[j];   // (mean is 0 past d)
      sm = warp_sum(sm);
      if (lane == 0) *nbar = first ? sm : *nbar + sm;
    }
    __syncthreads();   // smean / mean are rewritten by the next tile
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    kstats_final(const T* __restrict__ U, int64_t K, int64_t d, int64_t ld, const double* __restrict__ part,
                 int64_t nparts, double* __restrict__ dot, double* __restrict__ nsq, double* __restrict__ nbar,
                 bool* __restrict__ ok) {
  const int64_t stride = 2 * K + 1;
  const int64_t i = blockIdx.x * (int64_t)kThreads + threadIdx.x;
  if (i == 0) *nbar = kstats_hd::parts_sum(part, nparts, stride, 2 * K);
  if (i >= K) return;
  dot[i] = kstats_hd::parts_sum(part, nparts, stride, i);
  const double n = kstats_hd::parts_sum(part, nparts, stride, K + i);
  nsq[i] = n;
  bool good = isfinite(n);
  if (!good && sizeof(T) == 8) {   // a float64 row: its squared norm may overflow; check its values
    good = true;
    const T* x = U + i * ld;
    for (int64_t j = 0; j < d && good; ++j) good = isfinite(to_double(x[j]));
  }
  ok[i] = good;
}

size_t esize(DType dt) { return dt == DType::Float64 ? 8 : dt == DType::Float32 ? 4 : 2; }

}  // namespace

size_t kstats_workspace_bytes(int64_t K, int64_t d, DType dt) {
  const kstats_hd::Plan pl = kstats_hd::plan(K, d, (int64_t)esize(dt));
  return size_t(pl.nparts > 0 ? pl.nparts : 1) * size_t(2 * K + 1) * sizeof(double);
}

cudaError_t kstats(const void* U, DType dt, int64_t K, int64_t d, int64_t ld, const double* p, double* dot,
                   double* nsq, double* nbar, bool* ok, void* workspace, cudaStream_t stream) {
  if (K <= 0 || d <= 0) return cudaSuccess;   // the glue returns zeros and all-true flags
  const kstats_hd::Plan pl = kstats_hd::plan(K, d, (int64_t)esize(dt));
  double* part = static_cast<double*>(workspace);
  return dispatch(dt, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* u = static_cast<const T*>(U);
    kstats_parts<T><<<(unsigned)pl.nparts, kThreads, 0, stream>>>(u, K, d, ld, p, pl.TW, pl.tpp, part);
    const int64_t blocks = (K + kThreads - 1) / kThreads;
    if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
    kstats_final<T><<<(unsigned)blocks, kThreads, 0, stream>>>(u, K, d, ld, part, pl.nparts, dot, nsq, nbar, ok);
    return cudaGetLastError();
  });
}

}  // namespace cuda
}  // namespace fedkernels
