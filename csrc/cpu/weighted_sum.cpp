// weighted_sum: out = base + alpha * sum_i coef[i] * U[rows[i]], one pass over the rows (alpha is folded into the
// coefficients, sum_i (alpha coef[i]) U[rows[i]]: alpha = 0 gives base even where the plain sum would overflow).
//
// Column-blocked: a chunk of kChunk columns is accumulated over all rows in a small L1-resident
// accumulator, so every element of U is read once. out (and base) have U's dtype, or, for fp16/bf16
// U, a wider fp32/fp64 (a half-precision update summed into an fp32/fp64 model in one pass, with no
// converted copy of U). The accumulation type is out's: fp32 for fp32/fp16/bf16 out, fp64 for fp64
// out (so fp16/bf16 U into fp64 out accumulates in fp64). Each element of U is converted exactly to
// it, so a wide out gives the same bits as converting U to out's dtype first and summing that.
// Each output element is summed in row order: deterministic for any thread count.
// Bytes moved: n d elements of U's dtype, d of base and d of out (out's dtype).
// out may alias base (in-place apply).
// weighted_sum_screened (and weighted_sum_screened_out, into a caller's out) also returns ok[i] = all(isfinite(U[rows[i], :])) from the same pass: a
// NaN/Inf anywhere in a chunk's rows makes that chunk's accumulator non-finite (c * Inf and
// c * NaN are never finite, 0 * Inf is NaN), so the L1-resident accumulator is checked after each
// chunk, and only a chunk whose accumulator is not finite (a bad row, or an fp32 overflow of
// finite values) has its rows scanned one by one (z += x * 0). Bytes moved: unchanged, (n+2) d
// elements, plus a re-read of the chunks that hold a bad row. Flags exact; the sum is the same
// bits as weighted_sum's.
#include "common.h"
#include "../weighted_sum_checks.h"
#define FEDKERNELS_HD_ONLY  // the shared per-element logic only, not the CUDA launchers
#include "../cuda/gaussian_noise.cuh"

#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <type_traits>

#ifndef WSUM_CHUNK
#define WSUM_CHUNK 8192  // columns per task: 8 pages of each fp32 row stream, so prefetchers keep streaming
#endif

namespace fedkernels {
namespace {

template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };
template <typename T> struct Tag { using type = T; };

// The Gaussian noise of weighted_sum_noised (csrc/cpu/gaussian_noise.cpp): sigma * N(seed, counter, j)
// added in the output write; nullptr for weighted_sum (whose code path and bits are unchanged).
struct Noise {
  double sigma;
  uint64_t seed, counter, offset;  // column j draws N(seed, counter, offset + j)
};

// ok[i] = ok[i] && (row rows[i] is finite on the chunk [j0, j0 + len)).
template <typename T, typename A>
void finite_chunk(const T* u, int64_t stride0, const int64_t* rows, int64_t n, int64_t j0, int64_t len,
                  unsigned char* ok) {
  for (int64_t i = 0; i < n; ++i) ok[i] = ok[i] && finite_span<T>(u + rows[i] * stride0 + j0, len);
}

// One column chunk [j0, j0+len): acc = sum_i c[i] * U[rows[i], chunk] in row order, then
// o = b + acc (or acc). Runtime-dispatched to the widest vector ISA in portable builds.
template <typename T, typename O, typename A>
FEDKERNELS_SIMD_CLONES void wsum_chunk(const T* u, int64_t stride0, const int64_t* rows, const A* c, int64_t n,
                                       int64_t j0, int64_t len, const O* b, O* o, A* acc,
                                       const Noise* nz = nullptr, double* nbuf = nullptr) {
  for (int64_t j = 0; j < len; ++j) acc[j] = A(0);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const T* x0 = u + rows[i] * stride0 + j0;
    const T* x1 = u + rows[i + 1] * stride0 + j0;
    const T* x2 = u + rows[i + 2] * stride0 + j0;
    const T* x3 = u + rows[i + 3] * stride0 + j0;
    const T* x4 = u + rows[i + 4] * stride0 + j0;
    const T* x5 = u + rows[i + 5] * stride0 + j0;
    const T* x6 = u + rows[i + 6] * stride0 + j0;
    const T* x7 = u + rows[i + 7] * stride0 + j0;
    const A c0 = c[i], c1 = c[i + 1], c2 = c[i + 2], c3 = c[i + 3];
    const A c4 = c[i + 4], c5 = c[i + 5], c6 = c[i + 6], c7 = c[i + 7];
#pragma omp simd
    for (int64_t j = 0; j < len; ++j)
      acc[j] += (c0 * A(x0[j]) + c1 * A(x1[j]) + c2 * A(x2[j]) + c3 * A(x3[j])) +
                (c4 * A(x4[j]) + c5 * A(x5[j]) + c6 * A(x6[j]) + c7 * A(x7[j]));
  }
  for (; i + 4 <= n; i += 4) {
    const T* x0 = u + rows[i] * stride0 + j0;
    const T* x1 = u + rows[i + 1] * stride0 + j0;
    const T* x2 = u + rows[i + 2] * stride0 + j0;
    const T* x3 = u + rows[i + 3] * stride0 + j0;
    const A c0 = c[i], c1 = c[i + 1], c2 = c[i + 2], c3 = c[i + 3];
#pragma omp simd
    for (int64_t j = 0; j < len; ++j)
      acc[j] += c0 * A(x0[j]) + c1 * A(x1[j]) + c2 * A(x2[j]) + c3 * A(x3[j]);
  }
  for (; i < n; ++i) {
    const T* x0 = u + rows[i] * stride0 + j0;
    const A c0 = c[i];
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) acc[j] += c0 * A(x0[j]);
  }
  O* oo = o + j0;
  if (nz) {  // weighted_sum_noised: the chunk's normals, then the noise in the output write
    cuda::gnoise::fill_normals(nz->seed, nz->counter, nz->offset + (uint64_t)j0, len, nbuf);
    const O* bb = b ? b + j0 : nullptr;
    for (int64_t j = 0; j < len; ++j) {
      const A v = bb ? A(bb[j]) + acc[j] : acc[j];
      oo[j] = static_cast<O>(cuda::gnoise::add_noise(v, nz->sigma, nbuf[j]));
    }
    return;
  }
  if (b) {
    const O* bb = b + j0;
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) oo[j] = static_cast<O>(A(bb[j]) + acc[j]);
  } else {
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) oo[j] = static_cast<O>(acc[j]);
  }
}

// T = U's dtype, O = out's (and base's). A = accumulation type: float for fp32/fp16/bf16 out,
// double for fp64 out, and double for any out when a scaled coefficient does not fit in float (e.g.
// lam / ||m|| for a denormal m), so finite inputs never give an overflowed coefficient.
template <typename T, typename O, typename A>
void wsum_impl(const at::Tensor& U, const std::vector<double>& coef, const std::vector<int64_t>& rows,
               const at::Tensor* base, double alpha, at::Tensor& out, bool* ok_out, const Noise* nz = nullptr) {
  const int64_t d = U.size(1), n = (int64_t)rows.size(), stride0 = U.stride(0);
  const T* u = U.data_ptr<T>();
  const O* b = base ? base->data_ptr<O>() : nullptr;
  O* o = out.data_ptr<O>();
  std::vector<A> c(n);
  for (int64_t i = 0; i < n; ++i) c[i] = static_cast<A>(alpha * coef[i]);
  constexpr int64_t CH = WSUM_CHUNK;
  const int64_t nch = (d + CH - 1) / CH;
  // flags per (chunk, row), and-ed over chunks after the pass (no shared writes inside it)
  std::vector<unsigned char> flag(ok_out ? nch * n : 0, 1);
  at::parallel_for(0, nch, grain_for(std::min(CH, d) * std::max<int64_t>(n, 1)), [&](int64_t q0, int64_t q1) {
    std::vector<A> accv(CH);
    std::vector<double> nbuf(nz ? CH : 0);
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t j0 = q * CH, len = std::min(CH, d - j0);
      wsum_chunk<T, O, A>(u, stride0, rows.data(), c.data(), n, j0, len, b, o, accv.data(), nz, nbuf.data());
      if (ok_out && !finite_span<A>(accv.data(), len))   // rare: find the rows of this chunk
        finite_chunk<T, A>(u, stride0, rows.data(), n, j0, len, flag.data() + q * n);
    }
  });
  if (ok_out)
    for (int64_t i = 0; i < n; ++i) {
      bool all = true;
      for (int64_t q = 0; q < nch; ++q) all = all && flag[q * n + i];
      ok_out[i] = all;
    }
}

// The pass, after the entry point checked the arguments (checks::weighted_sum_args).
void wsum_cpu(const at::Tensor& U, const at::Tensor& coef, const c10::optional<at::Tensor>& base,
              double alpha, const c10::optional<at::Tensor>& rows, at::Tensor& out, at::Tensor* ok, const char* op,
              const Noise* nz = nullptr) {
  auto r = row_list(rows, U.size(0), op);
  if (ok) *ok = at::ones({(int64_t)r.size()}, U.options().dtype(at::kBool));
  if (U.size(1) == 0) return;
  bool* okp = ok ? ok->data_ptr<bool>() : nullptr;
  auto cv = to_double_vector(coef);
  const at::Tensor* bp = base.has_value() ? &base.value() : nullptr;
  bool fits_float = true;
  for (double c : cv) fits_float = fits_float && std::abs(alpha * c) <= 3.0e38;
  // out's dtype is U's, or fp32/fp64 for fp16/bf16 U (checked by the caller): O = out's element type.
  const auto run = [&](auto u_tag, auto o_tag) {
    using T = typename decltype(u_tag)::type;
    using O = typename decltype(o_tag)::type;
    if (fits_float)
      wsum_impl<T, O, typename Acc<O>::type>(U, cv, r, bp, alpha, out, okp, nz);
    else
      wsum_impl<T, O, double>(U, cv, r, bp, alpha, out, okp, nz);
  };
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, U.scalar_type(), "weighted_sum_cpu", [&] {
    if constexpr (std::is_same_v<scalar_t, at::Half> || std::is_same_v<scalar_t, at::BFloat16>) {
      if (out.scalar_type() == at::kFloat) return run(Tag<scalar_t>{}, Tag<float>{});
      if (out.scalar_type() == at::kDouble) return run(Tag<scalar_t>{}, Tag<double>{});
    }
    run(Tag<scalar_t>{}, Tag<scalar_t>{});
  });
}

void weighted_sum_out_cpu(const at::Tensor& U, const at::Tensor& coef, const c10::optional<at::Tensor>& base,
                          double alpha, const c10::optional<at::Tensor>& rows, at::Tensor out) {
  checks::weighted_sum_args(U, coef, base, rows, &out, at::kCPU, "weighted_sum");
  wsum_cpu(U, coef, base, alpha, rows, out, nullptr, "weighted_sum");
}

at::Tensor weighted_sum_cpu(const at::Tensor& U, const at::Tensor& coef, const c10::optional<at::Tensor>& base,
                            double alpha, const c10::optional<at::Tensor>& rows) {
  checks::weighted_sum_args(U, coef, base, rows, nullptr, at::kCPU, "weighted_sum");
  auto out = checks::weighted_sum_output(U, base);
  wsum_cpu(U, coef, base, alpha, rows, out, nullptr, "weighted_sum");
  return out;
}

at::Tensor weighted_sum_screened_out_cpu(const at::Tensor& U, const at::Tensor& coef,
                                         const c10::optional<at::Tensor>& base, double alpha,
                                         const c10::optional<at::Tensor>& rows, at::Tensor out) {
  checks::weighted_sum_args(U, coef, base, rows, &out, at::kCPU, "weighted_sum_screened");
  at::Tensor ok;
  wsum_cpu(U, coef, base, alpha, rows, out, &ok, "weighted_sum_screened");
  return ok;
}

std::tuple<at::Tensor, at::Tensor> weighted_sum_screened_cpu(const at::Tensor& U, const at::Tensor& coef,
                                                             const c10::optional<at::Tensor>& base, double alpha,
                                                             const c10::optional<at::Tensor>& rows) {
  checks::weighted_sum_args(U, coef, base, rows, nullptr, at::kCPU, "weighted_sum_screened");
  auto out = checks::weighted_sum_output(U, base);
  at::Tensor ok;
  wsum_cpu(U, coef, base, alpha, rows, out, &ok, "weighted_sum_screened");
  return {out, ok};
}

}  // namespace

// weighted_sum_noised's pass (its schema, wrapper and argument checks: csrc/cpu/gaussian_noise.cpp); sigma = 0:
// weighted_sum.
void weighted_sum_noised_out_cpu_impl(const at::Tensor& U, const at::Tensor& coef, const c10::optional<at::Tensor>& base,
                                      double alpha, const c10::optional<at::Tensor>& rows, double sigma, uint64_t seed,
                                      uint64_t counter, uint64_t offset, at::Tensor& out) {
  const Noise nz{sigma, seed, counter, offset};
  wsum_cpu(U, coef, base, alpha, rows, out, nullptr, "weighted_sum_noised", sigma != 0 ? &nz : nullptr);
}

TORCH_LIBRARY_FRAGMENT(fedkernels, m) {
  // out = base + alpha * sum_i coef[i] * U[rows[i]]  (rows defaults to all K rows).
  // out may alias base (in-place apply). coef: float tensor of len(rows) (read as float64).
  m.def("weighted_sum(Tensor U, Tensor coef, Tensor? base=None, float alpha=1.0, Tensor? rows=None) -> Tensor");
  m.def("weighted_sum_out(Tensor U, Tensor coef, Tensor? base, float alpha, Tensor? rows, Tensor(a!) out) -> ()");
  // weighted_sum and, from the same pass, ok[i] = all(isfinite(U[rows[i]])) (the NaN/Inf screen)
  m.def("weighted_sum_screened(Tensor U, Tensor coef, Tensor? base=None, float alpha=1.0, Tensor? rows=None) -> (Tensor, Tensor)");
  // the same into a caller's out (may alias base), returning ok
  m.def("weighted_sum_screened_out(Tensor U, Tensor coef, Tensor? base, float alpha, Tensor? rows, Tensor(a!) out) -> Tensor");
}

TORCH_LIBRARY_IMPL(fedkernels, CPU, m) {
  m.impl("weighted_sum", &weighted_sum_cpu);
  m.impl("weighted_sum_out", &weighted_sum_out_cpu);
  m.impl("weighted_sum_screened", &weighted_sum_screened_cpu);
  m.impl("weighted_sum_screened_out", &weighted_sum_screened_out_cpu);
}

}  // namespace fedkernels
