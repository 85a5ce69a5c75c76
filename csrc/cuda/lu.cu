// lu_factor_batched and lu_solve for many small dense systems (fedecado.md §5.3(b)).
//
// lu_factor_batched: LAPACK getrf semantics (partial pivoting, pivot = first index of the largest
// |a_ik| over i >= k, 1-based int32 pivots, a zero pivot sets info = k + 1 at its first occurrence
// and skips the division; the factorisation continues).
//   n <= 32: one warp per matrix. Lane i keeps row i in registers (compile-time indices: the k and
//            j loops are unrolled up to NMAX), pivot search is a warp arg-max, row swaps and the
//            broadcast of the pivot row are warp shuffles. No shared memory, no barriers.
//   n <= kLuMaxN (64, csrc/lu_limits.h): one block per matrix with the matrix in shared memory.
// lu_solve: X = A^{-1} R with A = P L U, in float64 (the factor is passed as float64; float32 R
// and X are converted on load and store, as the CPU op does). The factor and the final row permutation (the pivots
// applied in order) sit in shared memory; each thread streams one right-hand-side column:
// gathers it through the permutation, forward (unit L) and back (U) substitution in registers,
// writes it (register arrays sized 8/16/32/kLuMaxN: no local memory, lu::solve_column). X may alias R (each column is read completely before it is written).
// Pivots: lu::pivot_key / pivot_better (lu.cuh), a strict total order that matches the CPU scan
// with NaN, so every lane of a warp picks the same pivot and every shuffle runs on all lanes.
// An out-of-range pivot passed to lu_solve gives NaN columns (no device assert).
// arrowhead_solve: one thread per column (lu::arrowhead_column); all threads read the same
// coefficient at a time (a broadcast from L1).
// Host-tested (lu.cuh, tests/test_lu.py's host cases): the pivot order through emulated warp butterflies
// (NaN, +-inf, ties, zero columns), the permutation and the per-column substitution of lu_solve,
// the arrowhead column solve, against the CPU ops and the float64 reference. Only a GPU run checks
// (tests/test_lu.py's cuda cases): the shuffles (row swaps, pivot-row broadcast), the shared-memory staging and
// barriers of the block kernels, the launches.
#include "common.cuh"
#include "lu.cuh"

namespace fedkernels {
namespace cuda {
namespace {

using namespace detail;

// The pivot of a column: the best lu::pivot_key over the 32 lanes (a strict total order, NaN-safe),
// by a butterfly, so every lane gets the same key; called by all 32 lanes.
__device__ __forceinline__ lu::PivotKey warp_best_pivot(lu::PivotKey best) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    lu::PivotKey other;
    other.rank = __shfl_xor_sync(0xffffffffu, best.rank, o);
    other.v = __shfl_xor_sync(0xffffffffu, best.v, o);
    other.i = __shfl_xor_sync(0xffffffffu, best.i, o);
    if (lu::pivot_better(other, best)) best = other;
  }
  return best;
}

// ---- warp per matrix (n <= 32) ----
template <typename T, int NMAX>
__global__ void __launch_bounds__(128) lu_warp_kernel(const T* __restrict__ A, T* __restrict__ LU, int64_t B, int n,
                                                      int32_t* __restrict__ piv, int32_t* __restrict__ info) {
  const int lane = threadIdx.x % 32;
  const int64_t b = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (b >= B) return;  // warp-uniform
  const int64_t nn = (int64_t)n * n;
  const T* a = A + b * nn;
  T row[NMAX];
#pragma unroll
  for (int j = 0; j < NMAX; ++j) row[j] = (lane < n && j < n) ? a[(int64_t)lane * n + j] : T(0);
  int32_t inf = 0;
#pragma unroll
  for (int k = 0; k < NMAX; ++k) {
    if (k >= n) break;
    // Pivot: the arg-max of lu::pivot_key over lanes k..n-1, a strict total order (NaN-safe), so
    // the butterfly leaves the same p on every lane; every shuffle below runs on all 32 lanes.
    const lu::PivotKey best = warp_best_pivot(lu::pivot_key(static_cast<double>(row[k]), lane, k, n));
    const int p = best.i;  // in [k, n): lane k always has rank >= 1
    if (lane == 0) piv[b * n + k] = p + 1;
    const T pv = __shfl_sync(0xffffffffu, row[k], p);
    const bool nonzero = pv != T(0);  // the same on every lane (NaN counts as nonzero, as on the CPU)
    const int src = (nonzero && p != k) ? (lane == k ? p : (lane == p ? k : lane)) : lane;
#pragma unroll
    for (int j = 0; j < NMAX; ++j) row[j] = __shfl_sync(0xffffffffu, row[j], src);
    if (nonzero) {
      if (lane > k && lane < n) row[k] = row[k] / pv;
    } else if (inf == 0) {
      inf = k + 1;
    }
    // trailing update with the pivot row (now in lane k)
#pragma unroll
    for (int j = k + 1; j < NMAX; ++j) {
      const T ukj = __shfl_sync(0xffffffffu, row[j], k);
      if (lane > k && lane < n && j < n) row[j] = fma(-row[k], ukj, row[j]);
    }
  }
  T* o = LU + b * nn;
  if (lane < n) {
#pragma unroll
    for (int j = 0; j < NMAX; ++j)
      if (j < n) o[(int64_t)lane * n + j] = row[j];
  }
  if (lane == 0) info[b] = inf;
}

// ---- block per matrix (32 < n <= kLuMaxN) ----
static_assert(kLuMaxN > 32 && sizeof(double) * kLuMaxN * (kLuMaxN + 1) <= 48 * 1024,
              "lu_block_kernel: n in (32, kLuMaxN] in one block's static shared memory (48 KiB)");
template <typename T>
__global__ void __launch_bounds__(256) lu_block_kernel(const T* __restrict__ A, T* __restrict__ LU, int n,
                                                       int32_t* __restrict__ piv, int32_t* __restrict__ info) {
  constexpr int LD = kLuMaxN + 1;
  __shared__ T s[kLuMaxN][LD];
  __shared__ int sp;
  __shared__ T spv;
  const int64_t b = blockIdx.x;
  const int64_t nn = (int64_t)n * n;
  const T* a = A + b * nn;
  const int tid = threadIdx.x;
  for (int e = tid; e < n * n; e += blockDim.x) s[e / n][e % n] = a[e];
  __syncthreads();
  int32_t inf = 0;
  for (int k = 0; k < n; ++k) {
    if (tid < 32) {
      // Each lane scans rows k + tid, k + tid + 32, ...; then a butterfly. lu::pivot_better is a
      // strict total order, so the result does not depend on the reduction tree (lu.cuh).
      lu::PivotKey best = lu::pivot_key(0.0, -1, k, n);  // rank -1: loses to every candidate
      for (int i = k + tid; i < n; i += 32) {
        const lu::PivotKey c = lu::pivot_key(static_cast<double>(s[i][k]), i, k, n);
        if (lu::pivot_better(c, best)) best = c;
      }
      best = warp_best_pivot(best);
      if (tid == 0) {
        sp = best.i;
        spv = s[best.i][k];
        piv[b * n + k] = best.i + 1;
      }
    }
    __syncthreads();
    const int p = sp;
    const T pv = spv;
    if (pv != T(0)) {
      if (p != k)
        for (int j = tid; j < n; j += blockDim.x) {
          const T t = s[k][j];
          s[k][j] = s[p][j];
          s[p][j] = t;
        }
      __syncthreads();
      for (int i = k + 1 + tid; i < n; i += blockDim.x) s[i][k] = s[i][k] / pv;
    } else if (inf == 0) {
      inf = k + 1;
    }
    __syncthreads();
    const int m = n - k - 1;
    for (int e = tid; e < m * m; e += blockDim.x) {
      const int i = k + 1 + e / m, j = k + 1 + e % m;
      s[i][j] = fma(-s[i][k], s[k][j], s[i][j]);
    }
    __syncthreads();
  }
  T* o = LU + b * nn;
  for (int e = tid; e < n * n; e += blockDim.x) o[e] = s[e / n][e % n];
  if (tid == 0) info[b] = inf;
}

// ---- solve: one thread per right-hand-side column ----
template <typename T, int NMAX>
__global__ void lu_solve_kernel(const double* __restrict__ LU, const int32_t* __restrict__ piv, const T* R, T* X, int n,
                                int64_t m, int64_t nb) {
  __shared__ double s[NMAX][NMAX];
  __shared__ int perm[NMAX];
  __shared__ bool bad_piv;
  const int64_t gx = gridDim.x / nb, b = blockIdx.x / gx, bx = blockIdx.x % gx;  // 1-D grid: (b, column block)
  const int64_t nn = (int64_t)n * n;
  const double* lu = LU + b * nn;
  for (int e = threadIdx.x; e < n * n; e += blockDim.x) s[e / n][e % n] = lu[e];
  if (threadIdx.x == 0) bad_piv = !lu::permutation(piv + b * n, n, perm);
  __syncthreads();
  const int64_t c = bx * blockDim.x + threadIdx.x;
  if (c >= m) return;
  const T* r = R + b * (int64_t)n * m;
  double x[NMAX];
#pragma unroll
  for (int i = 0; i < NMAX; ++i) x[i] = i < n ? static_cast<double>(r[(int64_t)perm[i] * m + c]) : 0.0;
  lu::solve_column<NMAX>([&](int i, int j) { return s[i][j]; }, n, x);
  T* o = X + b * (int64_t)n * m;
#pragma unroll
  for (int i = 0; i < NMAX; ++i)
    if (i < n) o[(int64_t)i * m + c] = static_cast<T>(bad_piv ? NAN : x[i]);
}

template <typename T>
cudaError_t factor_t(const T* A, T* LU, int64_t B, int n, int32_t* piv, int32_t* info, cudaStream_t st) {
  if (n <= 32) {
    const int64_t blocks = (B + 3) / 4;
    if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
    if (n <= 8)
      lu_warp_kernel<T, 8><<<(unsigned)blocks, 128, 0, st>>>(A, LU, B, n, piv, info);
    else if (n <= 16)
      lu_warp_kernel<T, 16><<<(unsigned)blocks, 128, 0, st>>>(A, LU, B, n, piv, info);
    else
      lu_warp_kernel<T, 32><<<(unsigned)blocks, 128, 0, st>>>(A, LU, B, n, piv, info);
  } else {
    if (B > 0x7fffffff) return cudaErrorInvalidConfiguration;
    lu_block_kernel<T><<<(unsigned)B, 256, 0, st>>>(A, LU, n, piv, info);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t solve_t(const double* LU, const int32_t* piv, const T* R, T* X, int64_t B, int n, int64_t m, cudaStream_t st) {
  const int threads = m >= 256 ? 256 : (int)((m + 31) / 32 * 32);
  const int64_t gx = (m + threads - 1) / threads;
  if (gx * B > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const unsigned grid = (unsigned)(gx * B);
  if (n <= 8)
    lu_solve_kernel<T, 8><<<grid, threads, 0, st>>>(LU, piv, R, X, n, m, B);
  else if (n <= 16)
    lu_solve_kernel<T, 16><<<grid, threads, 0, st>>>(LU, piv, R, X, n, m, B);
  else if (n <= 32)
    lu_solve_kernel<T, 32><<<grid, threads, 0, st>>>(LU, piv, R, X, n, m, B);
  else
    lu_solve_kernel<T, kLuMaxN><<<grid, threads, 0, st>>>(LU, piv, R, X, n, m, B);
  return cudaGetLastError();
}

// ---- arrowhead: one thread per column ----
template <typename T>
__global__ void __launch_bounds__(256) arrowhead_kernel(const double* __restrict__ coef, int64_t K, int64_t m,
                                                        double inv_den, const T* __restrict__ r0,
                                                        const T* __restrict__ R, int64_t ld_r, T* __restrict__ x,
                                                        T* __restrict__ I) {
  const int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (c >= m) return;
  auto rd = [&](int64_t i) { return static_cast<double>(R[i * ld_r + c]); };
  auto put = [&](int64_t i, double v) { I[i * m + c] = static_cast<T>(v); };
  x[c] = static_cast<T>(lu::arrowhead_column(coef, K, static_cast<double>(r0[c]), inv_den, rd, put));
}

}  // namespace

cudaError_t arrowhead_solve(const double* coef, int64_t K, int64_t m, double inv_den, const void* r0, const void* R,
                            int64_t ld_r, void* x, void* I, DType dt, cudaStream_t stream) {
  if (m <= 0) return cudaSuccess;
  const int64_t blocks = (m + 255) / 256;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  if (dt == DType::Float32)
    arrowhead_kernel<float><<<(unsigned)blocks, 256, 0, stream>>>(coef, K, m, inv_den, static_cast<const float*>(r0),
                                                                   static_cast<const float*>(R), ld_r,
                                                                   static_cast<float*>(x), static_cast<float*>(I));
  else if (dt == DType::Float64)
    arrowhead_kernel<double><<<(unsigned)blocks, 256, 0, stream>>>(coef, K, m, inv_den,
                                                                    static_cast<const double*>(r0),
                                                                    static_cast<const double*>(R), ld_r,
                                                                    static_cast<double*>(x), static_cast<double*>(I));
  else
    return cudaErrorInvalidValue;
  return cudaGetLastError();
}

cudaError_t lu_factor_batched(const void* A, void* LU, DType dt, int64_t B, int64_t n, int32_t* piv, int32_t* info,
                              cudaStream_t stream) {
  if (B <= 0 || n <= 0) return cudaSuccess;
  if (n > kLuMaxN) return cudaErrorInvalidValue;
  if (dt == DType::Float32)
    return factor_t<float>(static_cast<const float*>(A), static_cast<float*>(LU), B, (int)n, piv, info, stream);
  if (dt == DType::Float64)
    return factor_t<double>(static_cast<const double*>(A), static_cast<double*>(LU), B, (int)n, piv, info, stream);
  return cudaErrorInvalidValue;
}

cudaError_t lu_solve(const double* LU, const int32_t* piv, const void* R, void* X, DType dt, int64_t B, int64_t n,
                     int64_t m, cudaStream_t stream) {
  if (B <= 0 || n <= 0 || m <= 0) return cudaSuccess;
  if (n > kLuMaxN) return cudaErrorInvalidValue;
  if (dt == DType::Float32)
    return solve_t<float>(LU, piv, static_cast<const float*>(R), static_cast<float*>(X), B,
                          (int)n, m, stream);
  if (dt == DType::Float64)
    return solve_t<double>(LU, piv, static_cast<const double*>(R), static_cast<double*>(X),
                           B, (int)n, m, stream);
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace fedkernels
