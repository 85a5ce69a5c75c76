// dequant_weighted_sum: out = base + alpha * sum_i coef[i] * dequant(Q[rows[i]]), one pass over compressed rows,
// with ok[i] (the row's NaN/Inf screen) from the same pass. The schema is defined here (TORCH_LIBRARY_FRAGMENT).
//
// Maths: Q is [K, d] of int8 or float8 e4m3 (e4m3fn: no Inf, NaN = S.1111.111) codes in blocks of `block`
// columns (the last block of a row may be short), scales [K, nb] float32, nb = ceil(d / block):
//   dequant(Q)[k, j] = scales[k, j / block] * Q[k, j].
// Per (row, block) the weight w = alpha * coef[i] * scales[r, b] is formed in float64 and rounded once to
// the accumulation type A; each element adds one fma, acc = fma(w, x, acc), rows in the order given. A is
// out's type (float32 or float64), or float64 when some finite |w| exceeds 3e38 (the weighted_sum rule: a
// finite input never gives an overflowed weight). Codes convert exactly (int8 and e4m3 are exact in float).
// The result is base + acc (or acc), stored in out's dtype (float32 or float64; base has it).
//
// Layout: column chunks of WSUM_CHUNK columns; within a chunk, segments of one scale block; per segment
// the rows are added 8 (then 4) at a time in one vectorised loop (the fma chain keeps row order, so the bits do not
// depend on the unrolling, the ISA or the thread count: chunks are fixed, each element is one fma chain).
//
// Screen: ok[i] = all scales of row rows[i] finite and (e4m3) no NaN code in it, i.e. the dequantised row
// is made of finite numbers times finite scales. A bad row makes its chunk's accumulator non-finite (an
// Inf/NaN weight times any code is Inf or NaN, 0 * Inf is NaN, a NaN code gives NaN), so only a chunk whose
// accumulator is not finite (a bad row, or an fp32 overflow of finite values) has its rows' scales and
// codes checked one by one. Flags exact.
//
// Bytes moved: n d code bytes + n ceil(d / block) scale floats (read twice: a pre-pass for the
// accumulation type, then the pass), d of base and d of out (out's dtype); the int8 rows are a quarter
// of an fp32 row's bytes and half of a bf16 row's.
#include "common.h"
#include "chunk_result.h"
#include "../dequant_weighted_sum_checks.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>

#include <cmath>
#include <cstring>
#include <tuple>

#ifndef WSUM_CHUNK
#define WSUM_CHUNK 8192
#endif

TORCH_LIBRARY_FRAGMENT(fedkernels, m) {
  // out = base + alpha * sum_i coef[i] * scales[rows[i], j / block] * Q[rows[i], j], and ok[i] (the row's
  // scales finite, no NaN code): Q [K, d] int8 / float8_e4m3fn, scales [K, ceil(d / block)] float32; the
  // result is float32 or float64 (base's dtype, else out_dtype, else float32). -> (out, ok)
  m.def("dequant_weighted_sum(Tensor Q, Tensor scales, Tensor coef, int block, Tensor? base=None, float alpha=1.0, "
        "Tensor? rows=None, ScalarType? out_dtype=None) -> (Tensor, Tensor)");
}

namespace fedkernels {
namespace {

// float8 e4m3fn -> float, exactly, in integer ops that vectorise: the exponent field is rebiased by adding
// 120 (127 - 7) to it, so no intermediate is a float32 subnormal (a denormals-are-zero mode cannot change the
// result); an e4m3 subnormal (exponent 0) is built as 2^-6 (1 + m/8) - 2^-6 = 2^-6 m/8. NaN codes give NaN.
inline float e4m3_to_float(uint8_t b) {
  const uint32_t mag = b & 0x7Fu;
  const bool sub = (mag >> 3) == 0;
  const uint32_t bits = (mag << 20) + (sub ? (121u << 23) : (120u << 23));
  float f;
  std::memcpy(&f, &bits, sizeof f);
  f -= sub ? 0x1p-6f : 0.0f;
  f = (b & 0x80u) ? -f : f;
  return mag == 0x7Fu ? NAN : f;
}

struct Int8Codes {
  using raw = int8_t;
  static float value(int8_t x) { return float(x); }
  static bool bad(int8_t) { return false; }
};
struct E4M3Codes {
  using raw = uint8_t;
  static float value(uint8_t x) { return e4m3_to_float(x); }
  static bool bad(uint8_t x) { return (x & 0x7Fu) == 0x7Fu; }
};

template <typename T> struct Tag { using type = T; };

// acc[0:len) = sum_i w_i,b * Q[rows[i], j0 + j] over the scale blocks b that meet [j0, j0 + len).
template <typename C, typename A>
FEDKERNELS_SIMD_CLONES void dq_chunk(const typename C::raw* q, int64_t ldq, const float* s, int64_t lds,
                                     const int64_t* rows, const double* ac, int64_t n, int64_t block, int64_t j0,
                                     int64_t len, A* acc) {
  using R = typename C::raw;
  for (int64_t j = 0; j < len; ++j) acc[j] = A(0);
  for (int64_t a = j0; a < j0 + len;) {
    const int64_t b = a / block, e = std::min((b + 1) * block, j0 + len), m = e - a;
    A* y = acc + (a - j0);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {      // 8 rows per pass over the segment's accumulators (fewer loads / stores)
      const R* x[8];
      A w[8];
      for (int r = 0; r < 8; ++r) {
        x[r] = q + rows[i + r] * ldq + a;
        w[r] = A(ac[i + r] * double(s[rows[i + r] * lds + b]));
      }
      const R *x0 = x[0], *x1 = x[1], *x2 = x[2], *x3 = x[3], *x4 = x[4], *x5 = x[5], *x6 = x[6], *x7 = x[7];
      const A w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3], w4 = w[4], w5 = w[5], w6 = w[6], w7 = w[7];
#pragma omp simd
      for (int64_t j = 0; j < m; ++j) {
        A t = std::fma(w0, A(C::value(x0[j])), y[j]);
        t = std::fma(w1, A(C::value(x1[j])), t);
        t = std::fma(w2, A(C::value(x2[j])), t);
        t = std::fma(w3, A(C::value(x3[j])), t);
        t = std::fma(w4, A(C::value(x4[j])), t);
        t = std::fma(w5, A(C::value(x5[j])), t);
        t = std::fma(w6, A(C::value(x6[j])), t);
        y[j] = std::fma(w7, A(C::value(x7[j])), t);
      }
    }
    for (; i + 4 <= n; i += 4) {
      const R* x0 = q + rows[i] * ldq + a;
      const R* x1 = q + rows[i + 1] * ldq + a;
      const R* x2 = q + rows[i + 2] * ldq + a;
      const R* x3 = q + rows[i + 3] * ldq + a;
      const A w0 = A(ac[i] * double(s[rows[i] * lds + b])), w1 = A(ac[i + 1] * double(s[rows[i + 1] * lds + b]));
      const A w2 = A(ac[i + 2] * double(s[rows[i + 2] * lds + b])), w3 = A(ac[i + 3] * double(s[rows[i + 3] * lds + b]));
#pragma omp simd
      for (int64_t j = 0; j < m; ++j)
        y[j] = std::fma(w3, A(C::value(x3[j])),
                        std::fma(w2, A(C::value(x2[j])), std::fma(w1, A(C::value(x1[j])), std::fma(w0, A(C::value(x0[j])), y[j]))));
    }
    for (; i < n; ++i) {
      const R* x0 = q + rows[i] * ldq + a;
      const A w0 = A(ac[i] * double(s[rows[i] * lds + b]));
#pragma omp simd
      for (int64_t j = 0; j < m; ++j) y[j] = std::fma(w0, A(C::value(x0[j])), y[j]);
    }
    a = e;
  }
}

// flag[i] = 0 for each row whose scales over the chunk are not all finite or (e4m3) that holds a NaN code there.
template <typename C>
void dq_flags(const typename C::raw* q, int64_t ldq, const float* s, int64_t lds, const int64_t* rows, int64_t n,
              int64_t block, int64_t j0, int64_t len, unsigned char* flag) {
  const int64_t b0 = j0 / block, b1 = (j0 + len - 1) / block;
  for (int64_t i = 0; i < n; ++i) {
    bool ok = finite_span<float>(s + rows[i] * lds + b0, b1 - b0 + 1);
    const typename C::raw* x = q + rows[i] * ldq + j0;
    for (int64_t j = 0; ok && j < len; ++j) ok = !C::bad(x[j]);
    flag[i] = flag[i] && ok;
  }
}

template <typename C, typename O, typename A>
void dq_impl(const at::Tensor& Q, const at::Tensor& S, int64_t block, const std::vector<double>& ac,
             const std::vector<int64_t>& rows, const at::Tensor* base, at::Tensor& out, bool* ok_out) {
  using R = typename C::raw;
  const int64_t d = Q.size(1), n = (int64_t)rows.size();
  const int64_t ldq = Q.size(0) > 1 ? Q.stride(0) : d, lds = S.size(0) > 1 ? S.stride(0) : S.size(1);
  const R* q = static_cast<const R*>(Q.data_ptr());
  const float* s = S.data_ptr<float>();
  const O* b = base ? base->data_ptr<O>() : nullptr;
  O* o = out.data_ptr<O>();
  constexpr int64_t CH = WSUM_CHUNK;
  const int64_t nch = (d + CH - 1) / CH;
  std::vector<unsigned char> flag(nch * n, 1);
  at::parallel_for(0, nch, grain_for(std::min(CH, d) * std::max<int64_t>(n, 1)), [&](int64_t q0, int64_t q1) {
    std::vector<A> accv(CH);
    A* acc = accv.data();
    for (int64_t c = q0; c < q1; ++c) {
      const int64_t j0 = c * CH, len = std::min(CH, d - j0);
      dq_chunk<C, A>(q, ldq, s, lds, rows.data(), ac.data(), n, block, j0, len, acc);
      if (!finite_span<A>(acc, len)) dq_flags<C>(q, ldq, s, lds, rows.data(), n, block, j0, len, flag.data() + c * n);
      store_chunk<O, A>(b ? b + j0 : nullptr, acc, o + j0, len);
    }
  });
  and_chunk_flags(flag, nch, n, ok_out);
}

std::tuple<at::Tensor, at::Tensor> dequant_weighted_sum_cpu(const at::Tensor& Q, const at::Tensor& scales,
                                                            const at::Tensor& coef, int64_t block,
                                                            const c10::optional<at::Tensor>& base, double alpha,
                                                            const c10::optional<at::Tensor>& rows,
                                                            c10::optional<at::ScalarType> out_dtype) {
  const char* op = "dequant_weighted_sum";
  const auto args = checks::dequant_weighted_sum_args(Q, scales, coef, block, base, rows, out_dtype, at::kCPU);
  const int64_t n = args.n;
  const at::ScalarType ost = args.result;
  auto r = row_list(rows, Q.size(0), op);
  const int64_t d = Q.size(1);
  auto out = at::empty({d}, Q.options().dtype(ost));
  auto ok = at::ones({n}, Q.options().dtype(at::kBool));
  if (d == 0) return {out, ok};
  const auto cv = to_double_vector(coef);
  std::vector<double> ac(n);
  for (int64_t i = 0; i < n; ++i) ac[i] = alpha * cv[i];
  // float accumulation unless a finite weight alpha coef_i scale does not fit in float
  bool fits_float = true;
  const int64_t nb = scales.size(1), lds = scales.size(0) > 1 ? scales.stride(0) : nb;
  const float* sp = scales.data_ptr<float>();
  for (int64_t i = 0; i < n && fits_float; ++i) {
    double mx = 0;
    const float* row = sp + r[i] * lds;
    for (int64_t bb = 0; bb < nb; ++bb) {
      const double v = std::abs(double(row[bb]));
      mx = std::isfinite(v) && v > mx ? v : mx;
    }
    const double w = std::abs(ac[i]) * mx;
    fits_float = !(std::isfinite(w) && w > 3.0e38);
  }
  const at::Tensor* bp = base.has_value() ? &base.value() : nullptr;
  bool* okp = ok.data_ptr<bool>();
  const auto run = [&](auto c_tag, auto o_tag) {
    using C = typename decltype(c_tag)::type;
    using O = typename decltype(o_tag)::type;
    if constexpr (std::is_same_v<O, double>)
      dq_impl<C, double, double>(Q, scales, block, ac, r, bp, out, okp);
    else if (fits_float)
      dq_impl<C, float, float>(Q, scales, block, ac, r, bp, out, okp);
    else
      dq_impl<C, float, double>(Q, scales, block, ac, r, bp, out, okp);
  };
  const auto by_out = [&](auto c_tag) {
    if (ost == at::kDouble) run(c_tag, Tag<double>{});
    else run(c_tag, Tag<float>{});
  };
  if (Q.scalar_type() == at::kChar) by_out(Tag<Int8Codes>{});
  else by_out(Tag<E4M3Codes>{});
  return {out, ok};
}

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CPU, m) { m.impl("dequant_weighted_sum", &dequant_weighted_sum_cpu); }

}  // namespace fedkernels
