// Launchers of the fedkernels CUDA kernels: plain C++ (raw pointers, cudaStream_t), no torch
// headers, so each csrc/cuda/<op>.cu compiles alone with nvcc (CI compile check); the torch glue
// of op <op> sits beside it in csrc/cuda/<op>_glue.cpp (host compiler, ATen headers, registers
// itself with TORCH_LIBRARY_IMPL(fedkernels, CUDA, m)).
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

#include "gc_project.cuh"
#include "lu.cuh"

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

// ---- gram: G[k, K] = U[rows] @ U^T, exact float64 products and float64 accumulation ----------
// rows: device int64 [k] or nullptr (all K rows, symmetric: only upper tiles are computed and G
// is mirrored exactly). The d columns are split into parts (gram.cuh gm::plan, a function of the
// shapes only; K > 16 runs on fp64 tensor cores); per-part tiles go to `workspace`
// (gram_workspace_bytes) and are reduced over the parts in a fixed order.
size_t gram_workspace_bytes(int64_t k, int64_t K, int64_t d, bool symmetric);
cudaError_t gram(const void* U, DType dt, int64_t K, int64_t d, int64_t ld, const int64_t* rows, int64_t k,
                 double* G, void* workspace, cudaStream_t stream);

// ---- weighted_sum: out = base + alpha * sum_i coef[i] * U[rows[i]] -----------------------------
// coef: device float64 [n]; rows: device int64 [n] or nullptr (n == K, rows 0..K-1); base: [d] or
// nullptr; out: [d], may alias base. Accumulation: fp32 for fp16/bf16/fp32, fp64 for fp64, fp64
// for every dtype when some |alpha * coef[i]| > 3e38 (the CPU op's rule). wide: 1 / 0 when the
// caller knows (host coefficients), -1 to let every block decide from coef. Each output element
// sums the rows in index order. ok: nullptr, or [n] bool set to true by the caller, where the
// kernel writes false for each selected row holding a NaN/Inf (weighted_sum_screened).
cudaError_t weighted_sum(const void* U, DType dt, int64_t K, int64_t d, int64_t ld, const double* coef,
                         const int64_t* rows, int64_t n, const void* base, double alpha, int wide, void* out,
                         bool* ok, cudaStream_t stream);

// ---- finite_rows: ok[k] = all(isfinite(U[k, :])) -----------------------------------------------
cudaError_t finite_rows(const void* U, DType dt, int64_t K, int64_t d, int64_t ld, bool* ok, cudaStream_t stream);

// ---- min_norm: Frank-Wolfe min-norm point of the convex hull, on a float64 Gram matrix ---------
// One thread block, float64 throughout (fedaware.md §2.6; same rules as csrc/cpu/min_norm.cpp
// without its face polish and code_compat modes). G: device [N, N] float64, symmetrised into the
// workspace (min_norm_workspace_bytes(N)). method: 0 = plain FW, 1 = away steps, 2 = pairwise.
// lam0: device float64 [N] warm start or nullptr (normalised; a non-positive sum falls back to
// init). init: 0 = best pair, 1 = e_{argmin G_ii}. Stop: gap <= tol_rel * q + tol_abs * max|G_ii|.
// Outputs (device): lam [N], iterations (int64 scalar), gap (float64 scalar, exact at lam).
constexpr int kMinNormMaxN = 8192;
size_t min_norm_workspace_bytes(int64_t N);
cudaError_t min_norm(const double* G, int64_t N, const double* lam0, int method, int init, int64_t max_iter,
                     double tol_rel, double tol_abs, double* lam, int64_t* iterations, double* gap, void* workspace,
                     cudaStream_t stream);

// ---- gc_project_: in-place per-row mean removal over many tensors in one launch ---------------
// A tensor is viewed as a [rows, cols] row-major matrix (cols = fan-in). All tensors of one call
// share one dtype. The host fills the GcTensor table (gc_project.cuh) with gc_plan(), which returns
// the number of work items, uploads the table (ntensors x 48 bytes) and launches gc_project().
int64_t gc_plan(GcTensor* tensors, int64_t ntensors);
cudaError_t gc_project(const GcTensor* device_tensors, int64_t ntensors, int64_t nwork, DType dt, cudaStream_t stream);

// ---- lu_factor / lu_solve (FedECADO dense path, fedecado.md §5.3(b)) ---------------------------
// A: [B, n, n] row-major, LU written to `LU` (may alias A); piv: int32 [B, n] 1-based (LAPACK
// getrf: first index of max |a_ik| on ties, zero pivot -> info = k+1 (first occurrence), no
// division, factorisation continues). info: int32 [B]. n <= kLuMaxN (warp per matrix for n <= 32,
// block per matrix with the matrix in shared memory above).
constexpr int kLuMaxN = lu::kMaxN;
cudaError_t lu_factor_batched(const void* A, void* LU, DType dt, int64_t B, int64_t n, int32_t* piv, int32_t* info,
                              cudaStream_t stream);
// X = A^{-1} R for each batch entry, with A = P L U from lu_factor_batched (LU given in float64;
// arithmetic in float64). R, X: [B, n, m] of dtype dt (float32/float64; X may alias R). The m
// right-hand sides are streamed: one thread per column, the factor and the permutation in shared
// memory. A zero U diagonal gives Inf/NaN (the caller checks it where a host sync is acceptable).
cudaError_t lu_solve(const double* LU, const int32_t* piv, const void* R, void* X, DType dt, int64_t B, int64_t n,
                     int64_t m, cudaStream_t stream);

// ---- arrowhead_solve: [[alpha, b^T], [c, diag(a)]] [x; I] = [r0; R] per column -----------------
// coef: device float64 [3K] = (b_i / a_i, c_i, 1 / a_i), inv_den = 1 / (alpha - sum_i b_i c_i / a_i)
// (computed and checked on the host, as the CPU op). r0, x: [m]; R: [K, m] with row stride ld_r;
// I: [K, m] contiguous. One thread per column, float64 arithmetic, rows in index order (the CPU
// op's order): x = (r0 - sum_i (b_i/a_i) R_i) * inv_den, I_i = (R_i - c_i x) / a_i.
cudaError_t arrowhead_solve(const double* coef, int64_t K, int64_t m, double inv_den, const void* r0, const void* R,
                            int64_t ld_r, void* x, void* I, DType dt, cudaStream_t stream);

// ---- fedecado_be_step: one fused FedECADO backward-Euler attempt (fedecado.md §5.3(a)) ---------
// Inputs [dtype ty: Float32 or Float64]: xc, xc0, S_off (nullptr: none) [d] contiguous; Icur, U,
// Ik [K, d] with row strides ld_*. coef: device float64 [4K] = (theta_new, theta_new - theta_old,
// inv_g, 1 / a) with a_i = 1 + c inv_g_i; c = dt / L; inv_den = 1 / (1 + dt c sum_i 1 / a_i).
// Outputs: xc_out [d], I_out [K, d] contiguous (must not overlap the inputs); lte: device float64
// [2] = (scale_c max_j |sum_i (I'_i - Icur_i)|, scale_I max_ij |e_ij|) with NaN -> +inf (scale_c =
// dt / 2, scale_I = dt / (2 L)); cleared and reduced on `stream` (atomicMax on the bit patterns of
// the non-negative maxima: deterministic). One read of every input element up to K ~ 440 (fp64) /
// ~880 (fp32) on sm_90 (registers for K <= 32, shared memory above); beyond, U and Icur are read twice.
cudaError_t fedecado_be_step(const void* xc, const void* Icur, int64_t ld_icur, const void* xc0, const void* U,
                             int64_t ld_u, const void* Ik, int64_t ld_ik, const void* S_off, const double* coef,
                             int64_t K, int64_t d, double c, double dt, double inv_den, double scale_c, double scale_I,
                             void* xc_out, void* I_out, double* lte, DType ty, cudaStream_t stream);

}  // namespace cuda
}  // namespace fedkernels
