// Per-thread logic of the fedecado_be_step CUDA kernel (fedecado_be_step.cu), shared with the host tests.
//
// Host-tested (tests/cuda_host/, against fedkernels.reference.fedecado_be_step in float64 and the
// CPU op): the per-element update (rhs, x_new, flow, err with NaN -> +inf), the order of the two
// client loops, the path choice (registers for K <= 32, per-thread shared-memory slots when they
// fit, the recomputing pass otherwise: smem_threads) and the slot layout (each thread touches
// only its own 2K slots: no barrier needed between the passes), the column of every thread
// (each column exactly once). The three paths give the same bits (same arithmetic, same order).
// Only a GPU run checks: the launch, the dynamic shared-memory size, the read-only loads and the
// block max + atomicMax of the LTE. The device may contract a * b + c into one fma where the host
// does not: results agree to rounding, not bit for bit.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "hd.h"

namespace fedkernels {
namespace cuda {
namespace be {

constexpr int kRegK = 32;                     // K <= 32: r_i and q_i in register arrays
constexpr size_t kSmemSoft = 96 * 1024;       // prefer >= 2 blocks per SM

// |v| with NaN -> +inf (the LTE maxima treat NaN as a rejection).
template <typename A> FK_HD A abs_nan_inf(A v) {
  const A a = v < A(0) ? -v : v;
  return a == a ? a : A(INFINITY);
}

// Client i at one coordinate: r_i = Icur_i + c (xc0 + theta_new_i U_i + inv_g_i Ik_i) and the LTE
// term q_i = (theta_new_i - theta_old_i) U_i + inv_g_i Icur_i.
template <typename A>
FK_HD void rhs(A x0, A u, A icv, A ik, A thn, A dth, A ig, A c, A& r, A& q) {
  r = icv + c * ((x0 + thn * u) + ig * ik);
  q = dth * u + ig * icv;
}

// x' = (xc + dt S_off + dt sum_i r_i / a_i) / den (Schur complement on the x row).
template <typename A> FK_HD A x_new(A xcj, bool has_s, A s, A dt, A acc, A inv_den) {
  A b = xcj;
  if (has_s) b += dt * s;
  return (b + dt * acc) * inv_den;
}

// I'_i = (r_i - c x') / a_i (from the unrounded x').
template <typename A> FK_HD A flow(A r, A c, A x, A inv_a) { return (r - c * x) * inv_a; }

// |e_i| = |(q_i - inv_g_i I'_i) - (x' - xc)| with the stored (rounded) I'_i and x' (dx = x'_stored - xc).
template <typename A> FK_HD A err(A q, A ig, A In_stored, A dx) { return abs_nan_inf((q - ig * In_stored) - dx); }

// Threads per block of the shared-memory path (K > kRegK): each thread keeps r_i and q_i of its
// current column in 2K private slots of A. The largest of 256/128/64/32 whose slots fit in
// kSmemSoft, else in the device budget; 0: they do not fit (the recomputing pass reads U and
// Icur twice).
FK_HD int smem_threads(int64_t K, int acc_bytes, size_t budget) {
  const size_t per_thread = size_t(2) * size_t(K) * size_t(acc_bytes);
  for (int nt = 256; nt >= 32; nt /= 2)
    if (per_thread * nt <= (kSmemSoft < budget ? kSmemSoft : budget)) return nt;
  return per_thread * 32 <= budget ? 32 : 0;
}
FK_HD size_t smem_bytes(int64_t K, int acc_bytes, int nt) { return size_t(2) * size_t(K) * acc_bytes * nt; }
// Slot of r_i (which = 0) or q_i (which = 1) of thread tid: consecutive threads, consecutive words.
FK_HD int64_t slot(int which, int64_t i, int tid, int64_t K, int nt) { return ((int64_t)which * K + i) * nt + tid; }

// Grid-stride column loop: first column of (block, tid) and the stride.
FK_HD int64_t first_col(int64_t block, int tid, int nt) { return block * nt + tid; }
FK_HD int64_t col_step(int64_t grid, int nt) { return grid * nt; }

}  // namespace be
}  // namespace cuda
}  // namespace fedkernels

// ---- launchers (csrc/cuda/fedecado_be_step.cu), called by the torch glue csrc/cuda/fedecado_be_step_glue.cpp. They
// need the CUDA runtime headers: the host tests (tests/cuda_host, no CUDA) define FEDKERNELS_HD_ONLY.
#ifndef FEDKERNELS_HD_ONLY
#include "launch.h"

namespace fedkernels {
namespace cuda {

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
#endif  // FEDKERNELS_HD_ONLY
