// fedecado_be_step: one fused FedECADO backward-Euler attempt (fedecado.md §2.6, §2.7, §5.3(a)).
//
// Inputs (d = number of parameters, K = active clients):
//   xc [d] current central state, Icur [K, d] current flows, xc0 [d] central state at the round
//   start, U [K, d] = x_end - xc0 (client updates), Ik [K, d] flows at the round start, S_off [d]
//   (frozen flows of the inactive clients, optional), per-client host coefficients theta_new [K] =
//   (tau + dt) / T_i, theta_old [K] = tau / T_i, inv_g [K] = 1 / g_i (>= 0; 0 = ECADO limit), dt, L.
// Per coordinate j (c = dt / L, a_i = 1 + c inv_g_i, den = 1 + dt c sum_i 1 / a_i):
//   r_i   = Icur_i + c (xc0 + theta_new_i U_i + inv_g_i Ik_i)
//   x'    = (xc + dt S_off + dt sum_i r_i / a_i) / den            (Schur complement on the x row)
//   I'_i  = (r_i - c x') / a_i
//   D_i   = I'_i - Icur_i,  dsum = sum_i D_i
//   e_i   = (theta_new_i - theta_old_i) U_i - inv_g_i D_i - (x' - xc)
//         = (x~_i' - x') - (x~_i - xc) with x~ from the sensitivity model (§2.7)
// Outputs: xc_out [d] = x', I_out [K, d] = I', lte [2] float64 = (dt/2 max_j |dsum_j|,
//   dt/(2L) max_{i,j} |e_ij|); NaN anywhere in a maximum is mapped to +inf (forces a rejection).
//
// One pass over d: at::parallel_for over column chunks, the K loop inner and every loop along the
// chunk in whole vectors (no scalar remainder loop: see row_spans). The chunk's r_i are kept in an
// L2-resident float64 scratch between the two K loops (the spec's "register array"), so each of xc,
// xc0, S_off, U, Icur, Ik is read once and x', I' are written once: 16 (K + 1) d bytes in fp32.
// Arithmetic in float64 for fp32 and fp64 (as arrowhead_solve); the LTE uses the stored (rounded) x' and
// I', as the torch composition does. Determinism: every column's arithmetic is fixed (the same bits for
// any thread count, chunking or position in its chunk); the maxima are taken per chunk and combined in
// chunk order (max is order-independent anyway).
#include "common.h"
#include "../fedecado_be_step_checks.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <tuple>
#include <type_traits>

namespace fedkernels {
namespace {

using checks::BeCoefs;

// |v| with NaN -> +inf (branch-free select: vectorises).
inline double abs_nan_inf(double v) {
  const double a = std::abs(v);
  return a == a ? a : std::numeric_limits<double>::infinity();
}

// The loops along a chunk of n columns run in whole vectors of kW<T> columns (64 bytes of T): the span
// [0, nb), nb = n rounded down to kW, then, when n is not a multiple of kW, the span of its last kW columns
// [n - kW, n) once more, a loop of compile-time length (a chunk of n < kW columns, d < kW: one span of n).
// Each span has its own scratch columns (the second at [nb, nb + kW)), so the columns that both hold are
// computed twice from the same inputs in the same order: the same bits, stored twice into x' and I', the
// maxima unchanged. (The remainder loops that gcc 12 leaves after a vector loop, a narrower vector and then
// scalar code, none after a reduction, ran up to 15 columns of every one of the K rows scalar: K = 1000,
// fp32, d = 76 took 1.9x the time per element of d = 64 or 80, growing with d mod 16. Raw op, one core,
// d = 64 / 76 / 80: 81 / 151 / 90 us -> 88 / 104 / 96 us, 1.27-1.99 -> 1.20-1.37 ns per element.)
template <typename T>
constexpr int64_t kW = 64 / int64_t(sizeof(T));

template <typename T>
constexpr int64_t scratch_cols(int64_t n) {   // the scratch columns of a chunk of n columns
  return n < kW<T> ? n : (n + kW<T> - 1) / kW<T> * kW<T>;
}

// f(chunk column, scratch column, width), the width a compile-time constant for the last span
template <typename T, typename F>
inline void row_spans(int64_t n, F&& f) {
  if (n < kW<T>) {
    f(int64_t(0), int64_t(0), n);
    return;
  }
  const int64_t nb = n / kW<T> * kW<T>;
  f(int64_t(0), int64_t(0), nb);
  if (nb < n) f(n - kW<T>, nb, std::integral_constant<int64_t, kW<T>>{});
}

template <typename T>
void be_chunk(const BeCoefs& cf, int64_t K, const T* __restrict__ xc, const T* Icur, int64_t ldi,
              const T* __restrict__ xc0, const T* U, int64_t ldu, const T* Ik, int64_t ldk,
              const T* __restrict__ S, T* __restrict__ xo, T* Io, int64_t ldo, int64_t j0, int64_t n,
              double* __restrict__ rbuf /* K x ns */, double* __restrict__ acc, double* __restrict__ dsum,
              double* __restrict__ dx,
              double& max_c, double& max_e) {
  const double c = cf.c, dt = cf.dt;
  const int64_t ns = scratch_cols<T>(n);
  // pass 1: r_i and acc = sum_i r_i / a_i
  for (int64_t j = 0; j < ns; ++j) acc[j] = 0.0;
  for (int64_t i = 0; i < K; ++i) {
    const double thn = cf.thn[i], ig = cf.ig[i], ia = cf.inv_a[i];
    row_spans<T>(n, [&](int64_t m, int64_t sc, auto w) {
      const T* __restrict__ u = U + i * ldu + j0 + m;
      const T* __restrict__ ic = Icur + i * ldi + j0 + m;
      const T* __restrict__ ik = Ik + i * ldk + j0 + m;
      const T* __restrict__ x0 = xc0 + j0 + m;
      double* __restrict__ r = rbuf + i * ns + sc;
      double* __restrict__ a = acc + sc;
#pragma omp simd
      for (int64_t j = 0; j < int64_t(w); ++j) {
        const double rv = double(ic[j]) + c * ((double(x0[j]) + thn * double(u[j])) + ig * double(ik[j]));
        r[j] = rv;
        a[j] += ia * rv;
      }
    });
  }
  // x' (stored rounded; acc now holds the unrounded x'), dsum = 0
  row_spans<T>(n, [&](int64_t m, int64_t sc, auto w) {
    const T* __restrict__ x = xc + j0 + m;
    const T* __restrict__ s = S ? S + j0 + m : nullptr;
    T* __restrict__ o = xo + j0 + m;
    double* __restrict__ a = acc + sc;
    double* __restrict__ dxs = dx + sc;
    double* __restrict__ ds = dsum + sc;
    if (s) {
#pragma omp simd
      for (int64_t j = 0; j < int64_t(w); ++j) a[j] = ((double(x[j]) + dt * double(s[j])) + dt * a[j]) * cf.inv_den;
    } else {
#pragma omp simd
      for (int64_t j = 0; j < int64_t(w); ++j) a[j] = (double(x[j]) + dt * a[j]) * cf.inv_den;
    }
#pragma omp simd
    for (int64_t j = 0; j < int64_t(w); ++j) {
      const T xs = static_cast<T>(a[j]);
      o[j] = xs;
      dxs[j] = double(xs) - double(x[j]);
      ds[j] = 0.0;
    }
  });
  // pass 2: I'_i (from the unrounded x'), dsum, e_i (from the stored x' and I': dx = x'_stored - xc)
  double me = 0.0;
  for (int64_t i = 0; i < K; ++i) {
    const double ia = cf.inv_a[i], ig = cf.ig[i], dth = cf.dth[i];
    row_spans<T>(n, [&](int64_t m, int64_t sc, auto w) {
      const T* __restrict__ u = U + i * ldu + j0 + m;
      const T* __restrict__ ic = Icur + i * ldi + j0 + m;
      T* __restrict__ io = Io + i * ldo + j0 + m;
      const double* __restrict__ r = rbuf + i * ns + sc;
      const double* __restrict__ a = acc + sc;
      const double* __restrict__ dxs = dx + sc;
      double* __restrict__ ds = dsum + sc;
      double mr = 0.0;
#pragma omp simd reduction(max : mr)
      for (int64_t j = 0; j < int64_t(w); ++j) {
        const T In = static_cast<T>((r[j] - c * a[j]) * ia);
        io[j] = In;
        const double D = double(In) - double(ic[j]);
        ds[j] += D;
        const double e = (dth * double(u[j]) - ig * D) - dxs[j];
        mr = std::max(mr, abs_nan_inf(e));
      }
      me = std::max(me, mr);
    });
  }
  double mc = 0.0;
#pragma omp simd reduction(max : mc)
  for (int64_t j = 0; j < ns; ++j) mc = std::max(mc, abs_nan_inf(dsum[j]));
  max_c = std::max(max_c, mc);
  max_e = std::max(max_e, me);
}

void be_step_out_cpu(const at::Tensor& xc, const at::Tensor& Icur, const at::Tensor& xc0, const at::Tensor& U,
                     const at::Tensor& Ik, const c10::optional<at::Tensor>& S_off, const at::Tensor& theta_new,
                     const at::Tensor& theta_old, const at::Tensor& inv_g, double dt, double L, at::Tensor xc_out,
                     at::Tensor I_out, at::Tensor lte) {
  checks::be_step_args(xc, Icur, xc0, U, Ik, S_off, xc_out, I_out, lte, at::kCPU);
  const int64_t K = U.size(0), d = U.size(1);
  const auto st = U.scalar_type();
  for (const at::Tensor* t : {&theta_new, &theta_old, &inv_g})
    checks::on_device(*t, at::kCPU, "fedecado_be_step", "theta_new/theta_old/inv_g");
  const BeCoefs cf = checks::be_step_coefs(theta_new, theta_old, inv_g, K, dt, L);
  auto xcc = xc.contiguous(), xc0c = xc0.contiguous();
  at::Tensor Sc;
  if (S_off.has_value()) Sc = S_off->contiguous();
  double* lp = lte.data_ptr<double>();
  if (d == 0) {
    lp[0] = lp[1] = 0.0;
    return;
  }
  // Chunk of columns: C0 sizes the K x C float64 r scratch for L2 (512 KB where K allows; at least 64, at
  // most 1024 columns). (128 KB made the chunks of K = 40..100 rows 384..128 columns wide, 1.5..0.5 KB of
  // each of the 3 K input row streams per chunk in fp32, too short for the prefetchers: K = 100, d = 1e6 + 1,
  // fp32, one core 421 -> 227 ms, K = 40 112 -> 86 ms; K <= 16 and K >= 1000 get the same chunks as then.)
  // The chunks are balanced, a remainder shorter than C0 joining the others (about d / C0 chunks, rounded
  // down, of under 2 C0 columns, a multiple of 16, so scratch_cols(n) <= C): a short tail chunk would cost
  // the K row loops of a full one. Columns are independent: the chunking does not change the arithmetic
  // (same bits). The scratch is left uninitialised (every entry is written before it is read).
  const int64_t C0 = std::max<int64_t>(64, std::min<int64_t>(1024, (int64_t(65536) / std::max<int64_t>(K, 1)) / 64 * 64));
  const int64_t n0 = std::max<int64_t>(1, d / C0);
  const int64_t C = ((d + n0 - 1) / n0 + 15) / 16 * 16;
  const int64_t nch = (d + C - 1) / C;                         // (<= n0; every chunk has >= 1 column)
  std::vector<double> mx(2 * nch, 0.0);
  const int64_t ldi = K > 1 ? Icur.stride(0) : d, ldu = K > 1 ? U.stride(0) : d, ldk = K > 1 ? Ik.stride(0) : d;
  AT_DISPATCH_FLOATING_TYPES(st, "fedecado_be_step_cpu", [&] {
    const scalar_t* px = xcc.data_ptr<scalar_t>();
    const scalar_t* pI = Icur.data_ptr<scalar_t>();
    const scalar_t* p0 = xc0c.data_ptr<scalar_t>();
    const scalar_t* pU = U.data_ptr<scalar_t>();
    const scalar_t* pK = Ik.data_ptr<scalar_t>();
    const scalar_t* pS = Sc.defined() ? Sc.data_ptr<scalar_t>() : nullptr;
    scalar_t* ox = xc_out.data_ptr<scalar_t>();
    scalar_t* oI = I_out.data_ptr<scalar_t>();
    at::parallel_for(0, nch, grain_for(C * (3 * K + 3)), [&](int64_t q0, int64_t q1) {
      std::unique_ptr<double[]> scratch(new double[(K + 3) * C]);   // (every entry is written before it is read)
      double* rbuf = scratch.get();
      double* acc = rbuf + K * C;
      double* dsum = acc + C;
      double* dx = dsum + C;
      for (int64_t q = q0; q < q1; ++q) {
        const int64_t j0 = q * C, n = std::min(C, d - j0);
        double mc = 0.0, me = 0.0;
        be_chunk<scalar_t>(cf, K, px, pI, ldi, p0, pU, ldu, pK, ldk, pS, ox, oI, d, j0, n, rbuf, acc, dsum, dx, mc,
                           me);
        mx[2 * q] = mc;
        mx[2 * q + 1] = me;
      }
    });
  });
  double mc = 0.0, me = 0.0;
  for (int64_t q = 0; q < nch; ++q) {
    mc = std::max(mc, mx[2 * q]);
    me = std::max(me, mx[2 * q + 1]);
  }
  lp[0] = 0.5 * dt * mc;
  lp[1] = 0.5 * dt / L * me;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> be_step_cpu(const at::Tensor& xc, const at::Tensor& Icur,
                                                           const at::Tensor& xc0, const at::Tensor& U,
                                                           const at::Tensor& Ik, const c10::optional<at::Tensor>& S_off,
                                                           const at::Tensor& theta_new, const at::Tensor& theta_old,
                                                           const at::Tensor& inv_g, double dt, double L) {
  auto outs = checks::be_step_outputs(U);
  be_step_out_cpu(xc, Icur, xc0, U, Ik, S_off, theta_new, theta_old, inv_g, dt, L, std::get<0>(outs), std::get<1>(outs),
                  std::get<2>(outs));
  return outs;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fedkernels, m) {
  // One fused FedECADO backward-Euler attempt (fedecado.md §2.6/§2.7/§5.3(a)), one pass over d:
  // U = x_end - xc0 [K, d]; theta_new/theta_old/inv_g: [K] host (CPU) coefficients (inv_g >= 0).
  // Returns (x_c' [d], I' [K, d], lte f64 [2] = (LTE_c, LTE_I), inf-norm, NaN -> +inf).
  // The _out variant writes into caller buffers, which must not overlap the inputs.
  m.def("fedecado_be_step(Tensor xc, Tensor Icur, Tensor xc0, Tensor U, Tensor Ik, Tensor? S_off, Tensor theta_new, "
        "Tensor theta_old, Tensor inv_g, float dt, float L) -> (Tensor, Tensor, Tensor)");
  m.def("fedecado_be_step_out(Tensor xc, Tensor Icur, Tensor xc0, Tensor U, Tensor Ik, Tensor? S_off, "
        "Tensor theta_new, Tensor theta_old, Tensor inv_g, float dt, float L, Tensor(a!) xc_out, Tensor(b!) I_out, "
        "Tensor(c!) lte) -> ()");
}

TORCH_LIBRARY_IMPL(fedkernels, CPU, m) {
  m.impl("fedecado_be_step", &be_step_cpu);
  m.impl("fedecado_be_step_out", &be_step_out_cpu);
}

}  // namespace fedkernels
