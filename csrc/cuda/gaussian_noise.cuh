// The Gaussian noise of the differential-privacy mechanism, written once for the CPU kernels
// (csrc/cpu/gaussian_noise.cpp, csrc/cpu/weighted_sum.cpp) and the CUDA kernels (gaussian_noise.cu,
// weighted_sum.cu): N(seed, counter, j), the standard normal of column j, is a pure function of its
// three arguments, so every device, thread count and chunking draws the same bits.
//
// Bits: Philox4x32-10 (Salmon et al., SC'11; Random123's philox4x32 with 10 rounds), key =
// (lo32(seed), hi32(seed)), counter = (lo32(p), hi32(p), lo32(counter), hi32(counter)) for the column
// pair p = j / 2. Its four words x0..x3 give two uniforms with 52 random bits each:
//   u1 = (((x1 & 0xfffff) << 32 | x0) + 0.5) * 2^-52   in (0, 1), never 0 (the +0.5 is exact);
//   the angle's quadrant q = x3 >> 30 and its fraction w = ((x3 & 0x3fffffff) << 22 | x2 >> 10) * 2^-52,
//   theta = (q + w) * pi / 2.
// Box-Muller: rho = sqrt(-2 ln u1), N(2p) = rho cos(theta), N(2p + 1) = rho sin(theta).
// ln and sin/cos are evaluated here with +, -, *, /, sqrt and explicit fma only (each correctly rounded
// by IEEE 754 on the host and on the GPU): no libm, no contraction-dependent expression (every product
// that feeds an addition is an explicit fma or exact), so the normals are the same bits on every device
// and in the Python reference (fedkernels.reference.philox_normal, which evaluates the same steps).
// Accuracy of the normals: a few ulp (ln: atanh series to s^23 on |s| <= 0.1716; sin/cos: Taylor to
// x^17 / x^18 on [0, pi/4]); Box-Muller's tail is bounded by u1 >= 2^-53: |N| <= 8.57.
// NOT a cryptographic generator, and floating-point Gaussian samples leak through their low bits
// (Mironov 2012): see docs/privacy.md.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "hd.h"

namespace fedkernels {
namespace cuda {
namespace gnoise {

// fma_rn, bits_of, of_bits: hd.h
FK_HD void mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t p = (uint64_t)a * (uint64_t)b;
  hi = (uint32_t)(p >> 32);
  lo = (uint32_t)p;
}

// Philox4x32-10 of counter c with key k, in place (Random123's round, key bumped between rounds).
FK_HD void philox4x32_10(uint32_t (&c)[4], uint32_t k0, uint32_t k1) {
  FK_UNROLL
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo(0xD2511F53u, c[0], hi0, lo0);
    mulhilo(0xCD9E8D57u, c[2], hi1, lo1);
    const uint32_t n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
    c[0] = n0;
    c[1] = lo1;
    c[2] = n2;
    c[3] = lo0;
  }
}

// ln(u) for u in (0, 1) normal (u >= 2^-53 here): u = m 2^e with m in [sqrt(1/2), sqrt(2)), ln m =
// 2 atanh(s), s = (m - 1) / (m + 1) (m - 1 is exact: Sterbenz), atanh by its series to s^23.
FK_HD double log_unit(double u) {
  // frexp by bits (u is normal): u = m 2^e, m in [1/2, 1)
  const uint64_t b = bits_of(u);
  int e = (int)((b >> 52) & 0x7ffu) - 1022;
  double m = of_bits((b & 0x800fffffffffffffull) | (1022ull << 52));
  const bool lo = m < 0.70710678118654752440;
  m = lo ? m * 2.0 : m;  // exact
  e = lo ? e - 1 : e;
  const double f = m - 1.0;
  const double s = f / (2.0 + f);
  const double z = s * s;
  double p = 1.0 / 23.0;
  p = fma_rn(p, z, 1.0 / 21.0);
  p = fma_rn(p, z, 1.0 / 19.0);
  p = fma_rn(p, z, 1.0 / 17.0);
  p = fma_rn(p, z, 1.0 / 15.0);
  p = fma_rn(p, z, 1.0 / 13.0);
  p = fma_rn(p, z, 1.0 / 11.0);
  p = fma_rn(p, z, 1.0 / 9.0);
  p = fma_rn(p, z, 1.0 / 7.0);
  p = fma_rn(p, z, 1.0 / 5.0);
  p = fma_rn(p, z, 1.0 / 3.0);
  const double t = z * p;
  const double lnm = 2.0 * fma_rn(s, t, s);  // 2 (s + s^3 p(s^2)); the doubling is exact
  const double de = (double)e;
  return fma_rn(de, 6.93147180369123816490e-01, fma_rn(de, 1.90821492927058770002e-10, lnm));  // e ln2 (hi + lo)
}

// sin and cos of x in [0, pi/4] by their Taylor series (to x^17 and x^18).
FK_HD void sincos_octant(double x, double& s, double& c) {
  const double z = x * x;
  double ps = -1.0 / 355687428096000.0;       // -1/17!
  ps = fma_rn(ps, z, 1.0 / 1307674368000.0);    // 1/15!
  ps = fma_rn(ps, z, -1.0 / 6227020800.0);      // -1/13!
  ps = fma_rn(ps, z, 1.0 / 39916800.0);         // 1/11!
  ps = fma_rn(ps, z, -1.0 / 362880.0);          // -1/9!
  ps = fma_rn(ps, z, 1.0 / 5040.0);             // 1/7!
  ps = fma_rn(ps, z, -1.0 / 120.0);             // 1/5!
  ps = fma_rn(ps, z, 1.0 / 6.0);                // 1/3!
  // sin x = x - x z ps(z), ps(z) = 1/3! - z/5! + z^2/7! - ...; cos x = 1 - z pc(z), pc(z) = 1/2! - z/4! + ...
  const double xz = x * z;
  s = fma_rn(-xz, ps, x);
  double pc = 1.0 / 6402373705728000.0;       // 1/18!
  pc = fma_rn(pc, z, -1.0 / 20922789888000.0);  // -1/16!
  pc = fma_rn(pc, z, 1.0 / 87178291200.0);      // 1/14!
  pc = fma_rn(pc, z, -1.0 / 479001600.0);       // -1/12!
  pc = fma_rn(pc, z, 1.0 / 3628800.0);          // 1/10!
  pc = fma_rn(pc, z, -1.0 / 40320.0);           // -1/8!
  pc = fma_rn(pc, z, 1.0 / 720.0);              // 1/6!
  pc = fma_rn(pc, z, -1.0 / 24.0);              // -1/4!
  pc = fma_rn(pc, z, 1.0 / 2.0);                // 1/2!
  c = fma_rn(-z, pc, 1.0);
}

// Box-Muller from Philox words (see the header comment): the squared radius -2 ln u1 from x0, x1 ...
FK_HD double bm_radius2(uint32_t x0, uint32_t x1) {
  const uint64_t k1 = ((uint64_t)(x1 & 0xfffffu) << 32) | (uint64_t)x0;
  const double u1 = ((double)k1 + 0.5) * 2.220446049250313080847e-16;  // 2^-52; (k1 + 0.5) is exact
  return -2.0 * log_unit(u1);
}

// ... and cos, sin of the angle from x2, x3.
FK_HD void bm_angle(uint32_t x2, uint32_t x3, double& c, double& s) {
  const uint64_t kw = ((uint64_t)(x3 & 0x3fffffffu) << 22) | (uint64_t)(x2 >> 10);
  const double w = (double)kw * 2.220446049250313080847e-16;
  const uint32_t q = x3 >> 30;
  const bool hi = w > 0.5;
  const double v = hi ? 1.0 - w : w;                      // exact; v in [0, 1/2]
  const double xa = v * 1.57079632679489661923;           // in [0, pi/4]
  double sv, cv;
  sincos_octant(xa, sv, cv);
  const double sn = hi ? cv : sv, cs = hi ? sv : cv;      // sin, cos of w pi/2
  // rotate by q quarter turns
  const double s1 = (q & 1u) ? cs : sn, c1 = (q & 1u) ? -sn : cs;
  s = (q & 2u) ? -s1 : s1;
  c = (q & 2u) ? -c1 : c1;
}

FK_HD double sqrt_(double x) {
#if defined(__CUDA_ARCH__)
  return sqrt(x);  // IEEE round-to-nearest (nvcc's default -prec-sqrt=true)
#else
  return std::sqrt(x);
#endif
}

// Normals of the column pair p: N(seed, counter, 2p) = rho cos, N(seed, counter, 2p + 1) = rho sin.
FK_HD void normal_pair(uint64_t seed, uint64_t counter, uint64_t p, double& n0, double& n1) {
  uint32_t c[4] = {(uint32_t)p, (uint32_t)(p >> 32), (uint32_t)counter, (uint32_t)(counter >> 32)};
  philox4x32_10(c, (uint32_t)seed, (uint32_t)(seed >> 32));
  double cs, sn;
  bm_angle(c[2], c[3], cs, sn);
  const double rho = sqrt_(bm_radius2(c[0], c[1]));
  n0 = rho * cs;
  n1 = rho * sn;
}

// N(seed, counter, j).
FK_HD double normal(uint64_t seed, uint64_t counter, uint64_t j) {
  double n0, n1;
  normal_pair(seed, counter, j >> 1, n0, n1);
  return (j & 1u) ? n1 : n0;
}

#if !defined(__CUDA_ARCH__)
// Host batch of np column pairs from pair p0, out[2q], out[2q + 1] = normal_pair(p0 + q): the same per-pair
// functions as normal_pair, run as stages over a block of pairs so that each stage is a vector loop (the
// Philox words, then the radius and the angle); the square root alone (libm's sqrt keeps errno, which
// blocks vectorisation) is a scalar loop. Same bits as normal_pair.
inline void normal_pairs_host(uint64_t seed, uint64_t counter, uint64_t p0, int64_t np, double* out) {
  constexpr int64_t B = 256;
  alignas(64) uint32_t w0[B], w1[B], w2[B], w3[B];
  alignas(64) double r2[B], cs[B], sn[B];
  const uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
  const uint32_t c2 = (uint32_t)counter, c3 = (uint32_t)(counter >> 32);
  for (int64_t b0 = 0; b0 < np; b0 += B) {
    const int64_t nb = np - b0 < B ? np - b0 : B;
#pragma omp simd
    for (int64_t q = 0; q < nb; ++q) {
      const uint64_t p = p0 + (uint64_t)(b0 + q);
      uint32_t c[4] = {(uint32_t)p, (uint32_t)(p >> 32), c2, c3};
      philox4x32_10(c, k0, k1);
      w0[q] = c[0];
      w1[q] = c[1];
      w2[q] = c[2];
      w3[q] = c[3];
    }
#pragma omp simd
    for (int64_t q = 0; q < nb; ++q) r2[q] = bm_radius2(w0[q], w1[q]);
#pragma omp simd
    for (int64_t q = 0; q < nb; ++q) bm_angle(w2[q], w3[q], cs[q], sn[q]);
    double* o = out + 2 * b0;
    for (int64_t q = 0; q < nb; ++q) {
      const double rho = std::sqrt(r2[q]);
      o[2 * q] = rho * cs[q];
      o[2 * q + 1] = rho * sn[q];
    }
  }
}
#endif

// out[i] = N(seed, counter, j0 + i) for i in [0, len): whole pairs in a batch, a lone first or last
// column alone.
FK_HD void fill_normals(uint64_t seed, uint64_t counter, uint64_t j0, int64_t len, double* out) {
  if (len <= 0) return;
  int64_t i = 0;
  if (j0 & 1u) {
    out[0] = normal(seed, counter, j0);
    i = 1;
  }
  const uint64_t p0 = (j0 + (uint64_t)i) >> 1;
  const int64_t np = (len - i) / 2;
#if defined(__CUDA_ARCH__)
  for (int64_t q = 0; q < np; ++q) normal_pair(seed, counter, p0 + (uint64_t)q, out[i + 2 * q], out[i + 2 * q + 1]);
#else
  normal_pairs_host(seed, counter, p0, np, out + i);
#endif
  i += 2 * np;
  if (i < len) out[i] = normal(seed, counter, j0 + (uint64_t)i);
}

// v + sigma * n in accumulation type A, the one rounding rule every kernel uses: fp64 as fma(sigma, n,
// v) (one rounding), fp32 as v + float(sigma * n) (the noise rounded to float, then the float add).
FK_HD double add_noise(double v, double sigma, double n) { return fma_rn(sigma, n, v); }
FK_HD float add_noise(float v, double sigma, double n) { return v + (float)(sigma * n); }

}  // namespace gnoise
}  // namespace cuda
}  // namespace fedkernels

// ---- launchers (csrc/cuda/gaussian_noise.cu), called by csrc/cuda/gaussian_noise_glue.cpp.
#ifndef FEDKERNELS_HD_ONLY
#include "launch.h"

namespace fedkernels {
namespace cuda {

// x[j] += sigma * N(seed, counter, offset + j) for j in [0, n), x contiguous of dtype dt (add_noise's
// rounding in x's accumulation type, then one rounding to dt).
cudaError_t add_gaussian_noise(void* x, DType dt, int64_t n, double sigma, uint64_t seed, uint64_t counter,
                               uint64_t offset, cudaStream_t stream);

}  // namespace cuda
}  // namespace fedkernels
#endif  // FEDKERNELS_HD_ONLY
