// gram: G = U[rows] @ U^T in float64 with a fixed reduction order.
//
// Every element of U is converted exactly to float64 (fp32/fp16/bf16 products are exact in fp64),
// so the result matches a float64 reference to rounding of the sums. Determinism: the d columns
// are split into a number of parts that depends only on (d, k, K), never on the thread count;
// each part is summed sequentially over fixed column sub-chunks, and the parts are reduced in
// index order. Same inputs give the same bits with any number of threads.
#include "common.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>

namespace fedkernels {
namespace {

#if defined(__AVX512F__)
constexpr int VW = 8;
#else
constexpr int VW = 4;
#endif
constexpr int TI = 4, TJ = 4;  // register tile: TI x TJ accumulators of W doubles (W = vector width)

struct AlignedFree { void operator()(double* p) const { std::free(p); } };
using Buf = std::unique_ptr<double[], AlignedFree>;
Buf alloc_doubles(int64_t n) {
  size_t bytes = ((size_t)std::max<int64_t>(n, 1) * sizeof(double) + 63) / 64 * 64;
  return Buf(static_cast<double*>(std::aligned_alloc(64, bytes)));
}


// Converts rows `idx` (n of them, padded to np with zero rows) of columns [c0, c0+C) into dst
// (row stride ldb, C padded to a multiple of the vector width with zeros).
template <typename T>
void load_block(const T* U, int64_t stride0, const int64_t* idx, int64_t n, int64_t np, int64_t c0,
                int64_t C, int64_t ldb, double* dst) {
  for (int64_t r = 0; r < np; ++r) {
    double* o = dst + r * ldb;
    if (r < n) {
      const T* s = U + idx[r] * stride0 + c0;
      for (int64_t c = 0; c < C; ++c) o[c] = static_cast<double>(s[c]);
      for (int64_t c = C; c < ldb; ++c) o[c] = 0.0;
    } else {
      for (int64_t c = 0; c < ldb; ++c) o[c] = 0.0;
    }
  }
}

// acc[i][j] += sum_c A[i][c] * B[j][c] over a block; lengths are multiples of W. Always inlined into
// the per-ISA entry points below, so the vector code is generated for their target.
template <int W> struct Vec { typedef double type __attribute__((vector_size(W * sizeof(double)))); };
template <int W>
__attribute__((always_inline)) inline typename Vec<W>::type vload(const double* p) {
  typename Vec<W>::type v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <int W>
__attribute__((always_inline)) inline double hsum(typename Vec<W>::type v) {
  double s = 0;
  for (int l = 0; l < W; ++l) s += v[l];
  return s;
}

template <int W>
__attribute__((always_inline)) inline void tile_products_w(const double* A, int64_t kp, const double* B, int64_t Kp,
                                                           int64_t ldb, bool symmetric, double* acc /* kp x Kp */) {
  typedef typename Vec<W>::type vd;
  for (int64_t ib = 0; ib < kp; ib += TI) {
    for (int64_t jb = symmetric ? ib : 0; jb < Kp; jb += TJ) {
      vd s[TI][TJ];
      for (int x = 0; x < TI; ++x)
        for (int y = 0; y < TJ; ++y) s[x][y] = vd{} ;
      const double* a0 = A + (ib + 0) * ldb; const double* a1 = A + (ib + 1) * ldb;
      const double* a2 = A + (ib + 2) * ldb; const double* a3 = A + (ib + 3) * ldb;
      const double* b0 = B + (jb + 0) * ldb; const double* b1 = B + (jb + 1) * ldb;
      const double* b2 = B + (jb + 2) * ldb; const double* b3 = B + (jb + 3) * ldb;
      for (int64_t c = 0; c < ldb; c += W) {
        vd va[TI] = {vload<W>(a0 + c), vload<W>(a1 + c), vload<W>(a2 + c), vload<W>(a3 + c)};
        vd vb[TJ] = {vload<W>(b0 + c), vload<W>(b1 + c), vload<W>(b2 + c), vload<W>(b3 + c)};
        for (int x = 0; x < TI; ++x)
          for (int y = 0; y < TJ; ++y) s[x][y] += va[x] * vb[y];
      }
      for (int x = 0; x < TI; ++x)
        for (int y = 0; y < TJ; ++y) acc[(ib + x) * Kp + jb + y] += hsum<W>(s[x][y]);
    }
  }
}

#if defined(FEDKERNELS_DISPATCH) && defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// Portable build: the vector width (which also fixes the summation order) is chosen once per process
// from the CPU, so results are the same for any thread count.
__attribute__((target("arch=x86-64-v4"))) void tile_products_v4(const double* A, int64_t kp, const double* B,
                                                                 int64_t Kp, int64_t ldb, bool sym, double* acc) {
  tile_products_w<8>(A, kp, B, Kp, ldb, sym, acc);
}
__attribute__((target("arch=x86-64-v3"))) void tile_products_v3(const double* A, int64_t kp, const double* B,
                                                                 int64_t Kp, int64_t ldb, bool sym, double* acc) {
  tile_products_w<4>(A, kp, B, Kp, ldb, sym, acc);
}
void tile_products_base(const double* A, int64_t kp, const double* B, int64_t Kp, int64_t ldb, bool sym,
                        double* acc) {
  tile_products_w<4>(A, kp, B, Kp, ldb, sym, acc);
}
int isa_level() {
  static const int level = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("x86-64-v4") ? 4 : __builtin_cpu_supports("x86-64-v3") ? 3 : 2;
  }();
  return level;
}
inline int gram_width() { return isa_level() == 4 ? 8 : 4; }
void tile_products(const double* A, int64_t kp, const double* B, int64_t Kp, int64_t ldb, bool sym, double* acc) {
  switch (isa_level()) {
    case 4: tile_products_v4(A, kp, B, Kp, ldb, sym, acc); break;
    case 3: tile_products_v3(A, kp, B, Kp, ldb, sym, acc); break;
    default: tile_products_base(A, kp, B, Kp, ldb, sym, acc);
  }
}
#else
constexpr int gram_width() { return VW; }
void tile_products(const double* A, int64_t kp, const double* B, int64_t Kp, int64_t ldb, bool sym, double* acc) {
  tile_products_w<VW>(A, kp, B, Kp, ldb, sym, acc);
}
#endif

template <typename T>
void gram_impl(const at::Tensor& U, const std::vector<int64_t>& rows, bool symmetric, double* out) {
  const int64_t K = U.size(0), d = U.size(1), k = (int64_t)rows.size();
  const int64_t stride0 = U.stride(0);
  const T* base = U.data_ptr<T>();
  const int64_t kp = (k + TI - 1) / TI * TI, Kp = (K + TJ - 1) / TJ * TJ;
  const int64_t W = gram_width();
  std::vector<int64_t> all(K);
  for (int64_t i = 0; i < K; ++i) all[i] = i;

  // Column sub-chunk: the (kp + Kp) x C double block stays within ~768 KB of L2.
  int64_t C = (768 * 1024 / 8) / std::max<int64_t>(symmetric ? Kp : kp + Kp, 1);
  C = std::max<int64_t>(W * 8, std::min<int64_t>(C, 4096)) / W * W;
  // Parts: a function of (d, k, K) only. At most 64, and their partials stay under 256 MB.
  const int64_t part_bytes = kp * Kp * 8;
  int64_t nparts = std::min<int64_t>(64, std::max<int64_t>(1, (int64_t(256) << 20) / std::max<int64_t>(part_bytes, 1)));
  int64_t part_cols = std::max<int64_t>(C, (d + nparts - 1) / nparts);
  part_cols = (part_cols + C - 1) / C * C;
  nparts = std::max<int64_t>(1, (d + part_cols - 1) / part_cols);

  Buf partials = alloc_doubles(nparts * kp * Kp);
  std::fill(partials.get(), partials.get() + nparts * kp * Kp, 0.0);

  at::parallel_for(0, nparts, grain_for(part_cols * kp * Kp / 4), [&](int64_t p0, int64_t p1) {
    const int64_t ldb = (C + W - 1) / W * W;
    Buf bufB = alloc_doubles(Kp * ldb);
    Buf bufA = symmetric ? Buf(nullptr) : alloc_doubles(kp * ldb);
    for (int64_t p = p0; p < p1; ++p) {
      double* acc = partials.get() + p * kp * Kp;
      const int64_t pend = std::min(d, (p + 1) * part_cols);
      for (int64_t c0 = p * part_cols; c0 < pend; c0 += C) {
        const int64_t cl = std::min(C, pend - c0);
        const int64_t ld = (cl + W - 1) / W * W;
        load_block<T>(base, stride0, all.data(), K, Kp, c0, cl, ld, bufB.get());
        const double* A = bufB.get();
        if (!symmetric) {
          load_block<T>(base, stride0, rows.data(), k, kp, c0, cl, ld, bufA.get());
          A = bufA.get();
        }
        tile_products(A, kp, bufB.get(), Kp, ld, symmetric, acc);
      }
    }
  });

  for (int64_t i = 0; i < k; ++i)
    for (int64_t j = 0; j < K; ++j) {
      double s = 0.0;
      for (int64_t p = 0; p < nparts; ++p) s += partials[p * kp * Kp + i * Kp + j];
      out[i * K + j] = s;
    }
  if (symmetric)
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < i; ++j) out[i * K + j] = out[j * K + i];
}

at::Tensor gram_cpu(const at::Tensor& U, const c10::optional<at::Tensor>& rows) {
  check_rowmajor(U, "gram", "U");
  const int64_t K = U.size(0);
  const bool symmetric = !rows.has_value();
  auto r = row_list(rows, K, "gram");
  const auto opts = U.options().dtype(at::kDouble);
  if (r.empty() || K == 0 || U.size(1) == 0) return at::zeros({(int64_t)r.size(), K}, opts);
  auto G = at::empty({(int64_t)r.size(), K}, opts);   // gram_impl writes every entry (no zero-fill pass)
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, U.scalar_type(), "gram_cpu", [&] {
    gram_impl<scalar_t>(U, r, symmetric, G.data_ptr<double>());
  });
  return G;
}

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CPU, m) { m.impl("gram", &gram_cpu); }

}  // namespace fedkernels
