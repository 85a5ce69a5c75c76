// kstats: Kuramoto's phase statistics in one pass over U, no K x K Gram matrix
// (docs/specs/kuramoto_fedavg.md §2.7 line 7, §5.1 KSTATS).
//
// Maths: mean_j = sum_k p_k U_kj (the p-weighted mean update), then
//   dot_k = sum_j U_kj mean_j,  nsq_k = sum_j U_kj^2,  nbar = sum_j mean_j^2,
// and ok_k = all(isfinite(U_k)). Every element of U is converted exactly to float64 and everything is
// accumulated in float64. All of it is column-local: a chunk of C columns (K x C elements of U within
// ~192 KB of L2) gets its mean first (rows in order, 4 at a time, vectorised along the columns, into an
// L1-resident fp64 vector), then each row's dot with it and its squared norm over the chunk (the
// chunk's second touch, served from L2), and ||chunk mean||^2.
//
// Flags: a row with a NaN/Inf has a non-finite nsq (a square is never NaN, NaN + x is NaN); a finite
// fp16/bf16/fp32 row never does (its squares are exact in float64 and cannot overflow it): ok_k =
// isfinite(nsq_k) is exact for those dtypes. A float64 row whose nsq is not finite is scanned again on
// its own (finite_span): the flags are exact for every dtype. (A bad row makes the mean, every dot and
// nbar NaN: the caller drops the row and asks again.)
//
// Order (determinism): d is split into nparts parts of whole chunks, nparts and C functions of (K, d,
// U's element size) only. Within a part the chunks are added in column order: per chunk, mean_j is
// one fma chain over the rows in order; a row's chunk dot and
// nsq are sums over 16 lanes (column j in lane j % 16) added in a fixed tree (independent of the ISA and
// of the row's alignment), added to the part's sums. Parts are summed in index order from part 0. Threads share the
// parts, each part computed by one thread: the same inputs give the same bits with any thread count.
//
// Bytes moved: U read once from memory (K x d elements; each chunk's second touch hits L2), plus the
// re-read of a float64 row whose nsq overflowed or that holds a NaN/Inf; outputs 3K + 1 doubles and
// K bools; nparts x (2K + 1) fp64 partials. FLOPs: 3 fused multiply-adds per element of U + 1 per column.
#include "common.h"
#include "../kstats_checks.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <type_traits>
#include <vector>

namespace fedkernels {
namespace {

// mean[j] = sum_k p[k] U[k, j0 + j], j < len: one fma chain per column over the rows in order.
// Every accumulation is an explicit fma (never left to -ffp-contract, which may contract a vector body and
// its scalar peel differently): the bits do not depend on the row's alignment or the ISA.
template <typename T>
FEDKERNELS_SIMD_CLONES void chunk_mean(const T* u, int64_t ld, const double* p, int64_t K, int64_t j0, int64_t len,
                                       double* mean) {
  for (int64_t j = 0; j < len; ++j) mean[j] = 0.0;
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {
    const T* x0 = u + k * ld + j0;
    const T* x1 = x0 + ld;
    const T* x2 = x1 + ld;
    const T* x3 = x2 + ld;
    const double p0 = p[k], p1 = p[k + 1], p2 = p[k + 2], p3 = p[k + 3];
#pragma omp simd
    for (int64_t j = 0; j < len; ++j)
      mean[j] = std::fma(p3, double(x3[j]), std::fma(p2, double(x2[j]), std::fma(p1, double(x1[j]),
                std::fma(p0, double(x0[j]), mean[j]))));
  }
  for (; k < K; ++k) {
    const T* x0 = u + k * ld + j0;
    const double p0 = p[k];
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) mean[j] = std::fma(p0, double(x0[j]), mean[j]);
  }
}

// The lanes of a row's chunk sums: column j goes to lane j % L (L = 16, whatever the vector width; a
// tail shorter than L fills lanes 0..), the lanes added in a fixed tree: the order depends only on the
// chunk's length, not on the ISA or the alignment of the row.
constexpr int L = 16;
inline double lanes_sum(const double* s) {
  double t[L / 2];
  for (int l = 0; l < L / 2; ++l) t[l] = s[l] + s[l + L / 2];
  return ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
}

// dot[k] += sum_j U[k, j0 + j] mean[j], nsq[k] += sum_j U[k, j0 + j]^2 over the chunk; returns sum_j mean[j]^2.
template <typename T>
FEDKERNELS_SIMD_CLONES double chunk_rows(const T* u, int64_t ld, const double* mean, int64_t K, int64_t j0,
                                         int64_t len, double* dot, double* nsq) {
  const int64_t full = len / L * L;
  for (int64_t k = 0; k < K; ++k) {
    const T* x = u + k * ld + j0;
    double sd[L] = {}, sn[L] = {};
    for (int64_t j = 0; j < full; j += L) {
#pragma omp simd
      for (int l = 0; l < L; ++l) {
        const double v = double(x[j + l]);
        sd[l] = std::fma(v, mean[j + l], sd[l]);
        sn[l] = std::fma(v, v, sn[l]);
      }
    }
    for (int64_t j = full; j < len; ++j) {
      const double v = double(x[j]);
      sd[j - full] = std::fma(v, mean[j], sd[j - full]);
      sn[j - full] = std::fma(v, v, sn[j - full]);
    }
    dot[k] += lanes_sum(sd);
    nsq[k] += lanes_sum(sn);
  }
  double sm[L] = {};
  for (int64_t j = 0; j < full; j += L) {
#pragma omp simd
    for (int l = 0; l < L; ++l) sm[l] = std::fma(mean[j + l], mean[j + l], sm[l]);
  }
  for (int64_t j = full; j < len; ++j) sm[j - full] = std::fma(mean[j], mean[j], sm[j - full]);
  return lanes_sum(sm);
}

// The plan, a function of (K, d, element size) only: chunks of C columns (K x C elements within ~192 KB,
// 64..2048 columns, a multiple of 16), parts of whole chunks (at most 64, each >= 64K elements).
struct Plan { int64_t C, part_cols, nparts; };
Plan plan(int64_t K, int64_t d, int64_t esize) {
  int64_t C = (192 * 1024) / std::max<int64_t>(K * esize, 1);
  C = std::max<int64_t>(64, std::min<int64_t>(C, 2048)) / 16 * 16;
  int64_t part_cols = std::max<int64_t>({C, (d + 63) / 64, ((int64_t)1 << 16) / std::max<int64_t>(K, 1)});
  part_cols = (part_cols + C - 1) / C * C;
  return {C, part_cols, std::max<int64_t>(1, (d + part_cols - 1) / part_cols)};
}

template <typename T>
void kstats_impl(const at::Tensor& U, const std::vector<double>& p, double* dot, double* nsq, double* nbar,
                 bool* ok) {
  const int64_t K = U.size(0), d = U.size(1), ld = U.stride(0);
  const T* u = U.data_ptr<T>();
  const Plan pl = plan(K, d, (int64_t)sizeof(T));
  // part q's sums: dot at part[q * (2K + 1)], nsq after it, nbar last
  const int64_t stride = 2 * K + 1;
  std::vector<double> part(pl.nparts * stride, 0.0);
  at::parallel_for(0, pl.nparts, 1, [&](int64_t q0, int64_t q1) {
    std::vector<double> mean(pl.C);
    for (int64_t q = q0; q < q1; ++q) {
      double* s = part.data() + q * stride;
      const int64_t end = std::min(d, (q + 1) * pl.part_cols);
      for (int64_t j0 = q * pl.part_cols; j0 < end; j0 += pl.C) {
        const int64_t len = std::min(pl.C, end - j0);
        chunk_mean<T>(u, ld, p.data(), K, j0, len, mean.data());
        s[2 * K] += chunk_rows<T>(u, ld, mean.data(), K, j0, len, s, s + K);
      }
    }
  });
  for (int64_t i = 0; i < stride; ++i) {   // parts in index order
    double t = part[i];
    for (int64_t q = 1; q < pl.nparts; ++q) t += part[q * stride + i];
    if (i < K) dot[i] = t;
    else if (i < 2 * K) nsq[i - K] = t;
    else *nbar = t;
  }
  for (int64_t k = 0; k < K; ++k)
    ok[k] = std::isfinite(nsq[k]) || (std::is_same_v<T, double> && finite_span<T>(u + k * ld, d));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> kstats_cpu(const at::Tensor& U, const at::Tensor& p) {
  checks::kstats_args(U, p, at::kCPU);
  const int64_t K = U.size(0);
  const auto f64 = U.options().dtype(at::kDouble);
  auto dot = at::zeros({K}, f64), nsq = at::zeros({K}, f64), nbar = at::zeros({}, f64);
  auto ok = at::ones({K}, U.options().dtype(at::kBool));
  if (K == 0 || U.size(1) == 0) return {dot, nsq, nbar, ok};
  const auto pv = to_double_vector(p);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, U.scalar_type(), "kstats_cpu", [&] {
    kstats_impl<scalar_t>(U, pv, dot.data_ptr<double>(), nsq.data_ptr<double>(), nbar.data_ptr<double>(),
                          ok.data_ptr<bool>());
  });
  return {dot, nsq, nbar, ok};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fedkernels, m) {
  // Kuramoto's phase statistics in one pass (no K x K Gram): mean = sum_k p[k] U[k] (fp64), then
  // dot[k] = <U[k], mean>, nsq[k] = ||U[k]||^2, nbar = ||mean||^2 (fp64, fixed order) and ok[k] =
  // all(isfinite(U[k])) from the same pass. p: [K] float (read as float64). -> (dot, nsq, nbar [], ok).
  m.def("kstats(Tensor U, Tensor p) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fedkernels, CPU, m) { m.impl("kstats", &kstats_cpu); }

}  // namespace fedkernels
