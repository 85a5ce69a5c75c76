// gram: G = U[rows] @ U^T in float64 with a fixed reduction order.
//
// Maths: G[q][j] = sum_c U[rows[q]][c] * U[j][c]. Every element of U is converted exactly to float64
// (fp32/fp16/bf16 products are exact in fp64) and summed in float64, so the result matches a float64
// reference to rounding of the sums.
//
// Two kernels, chosen by shape only (use_bcast: the broadcast one from K = 16 below d = 512 and at
// every d from K = 200; FEDKERNELS_GRAM_PATH=bcast|cols forces one, for benchmarks and tests):
// * broadcast: a sub-chunk of C columns is staged transposed, clients contiguous, in panels of
//   P = NV * W clients; an R x P tile of G stays in registers and each column c adds one broadcast
//   element A[i][c] times NV vectors B[c][j..j+P): no horizontal sums (AVX-512: 8 x 16, W = 8; AVX2
//   and the baseline: 4 x 12, W = 4). Without rows= (and when rows= lists every row, in any order,
//   repeats allowed) only the tiles that touch the upper triangle are computed and the lower triangle
//   is copied from it: G is exactly symmetric and gram(U, rows) is bitwise gram(U)[rows]. Other rows=
//   compute their distinct rows against all K rows; repeated rows are copies.
// * column vectors (K < 16, or K < 200 with d >= 512): TI x TJ = 4 x 4 rows, W-wide vectors along
//   the columns, one horizontal sum per entry and sub-chunk.
//
// Order (determinism): d is split into nparts parts and each part into sub-chunks, nparts and the
// sub-chunk length functions of (d, k, K) and the ISA level only, never of the thread count.
// Broadcast: an entry's sub-chunk sum is one fma chain over c ascending from 0; a part is
// ((sub-chunk 0 + sub-chunk 1) + sub-chunk 2) + ...; G = ((part 0 + part 1) + part 2) + ...
// (nparts = 1 from K = 128; below, up to 64 parts of >= 2048 columns). Column vectors: per sub-chunk
// W lane sums (lane l: columns l, l + W, ... ascending), their horizontal sum in lane order, added to
// the part from 0; parts added in index order from 0. Threads share the parts, or (broadcast, one
// part) the client panels of a sub-chunk, each entry computed by exactly one thread: same inputs give
// the same bits with any number of threads. The ISA level (W) is fixed once per process.
//
// Bytes moved: broadcast: U read once (K x d elements; a rows= that does not list every row reads its
// m distinct rows a second time); G's computed tiles (symmetric: the upper triangle) are stored once
// and read back and added to once per further sub-chunk of C = 128 columns at K = 1000; the strict
// lower triangle is written once, from the final upper one (each full tile's transpose from
// registers, the diagonal blocks from the panel's strip in cache); when nparts > 1 (K < 128),
// (nparts - 1) m x K partial sums written and read back. Column vectors: K (+ k with rows=) rows read
// per sub-chunk, nparts kp x Kp partials zeroed, summed into, and read back.
#include "common.h"
#include "../gram_checks.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

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
template <int W> struct IVec { typedef long long type __attribute__((vector_size(W * sizeof(long long)))); };
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

// ---- broadcast path ---------------------------------------------------------------------------
// Converts rows idx[0..n) of columns [c0, c0 + C) into panels of P rows, clients contiguous: row r,
// column c goes to dst[(r / P) * C * P + c * P + r % P]; rows n..np-1 (np a multiple of P) are zeros.
template <typename T>
void pack_panels(const T* U, int64_t stride0, const int64_t* idx, int64_t n, int64_t np, int64_t P, int64_t c0,
                 int64_t C, double* dst) {
  for (int64_t r = 0; r < np; ++r) {
    double* o = dst + (r / P) * C * P + r % P;
    if (r < n) {
      const T* s = U + idx[r] * stride0 + c0;
      for (int64_t c = 0; c < C; ++c) o[c * P] = static_cast<double>(s[c]);
    } else {
      for (int64_t c = 0; c < C; ++c) o[c * P] = 0.0;
    }
  }
}

// One sub-chunk of C columns: B holds the K clients in panels of P ([Kp / P][C][P]); A the m rows in
// panels of R ([mp / R][C][R]), or nullptr when the rows are the clients themselves (symmetric; R
// divides P, so a row tile is read from B). G row i goes to dst + roff[i].
struct BcastBlock {
  const double* B;
  const double* A;
  int64_t C, m, K;
  double* dst;
  const int64_t* roff;
  bool sym, first;  // first: the part's first sub-chunk (store, not add)
  bool mirror;      // symmetric and this sub-chunk completes G: each panel writes its rows below the diagonal
};

// In-register transpose of a W x W block of doubles (x[r] = row r): log2(W) butterfly stages, each
// exchanging the lanes whose bit h differs from the row's (generic shuffles, so every ISA clone
// gets its own permute instructions).
template <int W>
__attribute__((always_inline)) inline void transpose_block(typename Vec<W>::type* x) {
  typedef typename IVec<W>::type vi;
#pragma GCC unroll 4
  for (int h = 1; h < W; h *= 2) {
    vi lo, hi;
    for (int l = 0; l < W; ++l) {
      lo[l] = (l & h) ? W + l - h : l;
      hi[l] = (l & h) ? W + l : l + h;
    }
#pragma GCC unroll 8
    for (int k = 0; k < W; ++k)
      if (!(k & h)) {
        const typename Vec<W>::type a = x[k], b = x[k + h];
        x[k] = __builtin_shuffle(a, b, lo);
        x[k + h] = __builtin_shuffle(a, b, hi);
      }
  }
}

// tile[r][q] = sum over c ascending of a[c * sa + r] * b[c * P + q] (one fma chain per entry, a
// broadcast times NV vectors along the clients: no horizontal sum), r < R, q < P = NV * W; then
// stored into (first) or added to dst rows roff[0..nr), columns j..j+nq. mirror (a full tile above
// the diagonal whose sum is final): its transpose also goes to rows croff[0..P), columns i..i+R.
template <int W, int NV, int R>
__attribute__((always_inline)) inline void bcast_tile(const double* a, int64_t sa, const double* b, int64_t C,
                                                      double* dst, const int64_t* roff, int64_t j, int nr, int nq,
                                                      bool first, bool mirror, const int64_t* croff, int64_t i) {
  typedef typename Vec<W>::type vd;
  constexpr int P = NV * W;
  static_assert(R == W, "the mirror transposes W x W blocks");
  vd acc[R][NV];
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = vd{};
  for (int64_t c = 0; c < C; ++c) {
    vd bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = vload<W>(b + c * P + v * W);
    const double* ac = a + c * sa;
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) {
      const double x = ac[r];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] += x * bv[v];
    }
  }
  if (nr == R && nq == P) {
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) {
      double* o = dst + roff[r] + j;
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        vd y = acc[r][v];
        if (!first) y += vload<W>(o + v * W);
        std::memcpy(o + v * W, &y, sizeof(y));
        acc[r][v] = y;
      }
    }
    if (mirror) {
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        vd x[W];
#pragma GCC unroll 8
        for (int r = 0; r < W; ++r) x[r] = acc[r][v];
        transpose_block<W>(x);
#pragma GCC unroll 8
        for (int q = 0; q < W; ++q) std::memcpy(dst + croff[v * W + q] + i, &x[q], sizeof(vd));
      }
    }
  } else {
    for (int r = 0; r < nr; ++r) {
      double t[P];
      std::memcpy(t, &acc[r][0], sizeof(t));
      double* o = dst + roff[r] + j;
      for (int q = 0; q < nq; ++q) o[q] = first ? t[q] : o[q] + t[q];
    }
  }
}

// Client panel jp against every row tile that needs it (symmetric: the tiles with rows i < the
// panel's end), then, when the sub-chunk completes G, the panel's rows below the diagonal from its strip.
template <int W, int NV, int R>
__attribute__((always_inline)) inline void bcast_panel(const BcastBlock& g, int64_t jp) {
  constexpr int P = NV * W;
  const int64_t j = jp * P;
  const int nq = (int)std::min<int64_t>(P, g.K - j);
  const int64_t ntiles = (g.m + R - 1) / R;
  const int64_t tend = g.sym ? std::min<int64_t>(ntiles, (j + P) / R) : ntiles;
  const double* b = g.B + jp * g.C * P;
  const bool tmirror = g.mirror && nq == P;  // full panel: its tiles above the diagonal store their transpose
  for (int64_t t = 0; t < tend; ++t) {
    const int64_t i = t * R;
    if (t + 1 < tend)  // the next tile's output rows (scattered 8 x P doubles) while this one computes
      for (int64_t r = i + R; r < std::min(g.m, i + 2 * R); ++r) {
        __builtin_prefetch(g.dst + g.roff[r] + j, 1);
        __builtin_prefetch(g.dst + g.roff[r] + j + nq - 1, 1);
        if (P > 8) __builtin_prefetch(g.dst + g.roff[r] + j + 8, 1);
      }
    const double* a = g.A ? g.A + t * g.C * R : g.B + (i / P) * g.C * P + i % P;
    const int64_t sa = g.A ? R : P;
    bcast_tile<W, NV, R>(a, sa, b, g.C, g.dst, g.roff + i, j, (int)std::min<int64_t>(R, g.m - i), nq, g.first,
                         tmirror && i + R <= j, g.roff + j, i);
  }
  if (g.mirror) {  // the rest of rows [j, j + nq) below the diagonal, from the panel's column strip
    const int64_t iend = j + nq;
    for (int64_t r = tmirror ? j : 0; r < iend - 1; ++r) {
      const double* s = g.dst + g.roff[r];
      for (int64_t i = std::max(j, r + 1); i < iend; ++i) g.dst[g.roff[i] + r] = s[i];
    }
  }
}

// Work items [q0, q1) of a sub-chunk: item q is client panel q or, symmetric, the panels q and
// np - 1 - q (equal work, so that threads splitting the items get equal shares).
template <int W, int NV, int R>
__attribute__((always_inline)) inline void bcast_items_w(const BcastBlock& g, int64_t q0, int64_t q1) {
  const int64_t np = (g.K + NV * W - 1) / (NV * W);
  for (int64_t q = q0; q < q1; ++q) {
    bcast_panel<W, NV, R>(g, q);
    if (g.sym && np - 1 - q != q) bcast_panel<W, NV, R>(g, np - 1 - q);
  }
}

// Register tiles (R rows x NV vectors of W doubles): AVX-512 8 x (2 x 8) = 16 of 32 registers;
// AVX2 4 x (3 x 4) = 12 of 16. R = W: the mirror transposes W x W blocks.
struct BcastShape { int64_t P, R; };

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
__attribute__((target("arch=x86-64-v4"))) void bcast_items_v4(const BcastBlock& g, int64_t q0, int64_t q1) {
  bcast_items_w<8, 2, 8>(g, q0, q1);
}
__attribute__((target("arch=x86-64-v3"))) void bcast_items_v3(const BcastBlock& g, int64_t q0, int64_t q1) {
  bcast_items_w<4, 3, 4>(g, q0, q1);
}
void bcast_items_base(const BcastBlock& g, int64_t q0, int64_t q1) { bcast_items_w<4, 3, 4>(g, q0, q1); }
int isa_level() {
  static const int level = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("x86-64-v4") ? 4 : __builtin_cpu_supports("x86-64-v3") ? 3 : 2;
  }();
  return level;
}
inline int gram_width() { return isa_level() == 4 ? 8 : 4; }
inline BcastShape bcast_shape() { return isa_level() == 4 ? BcastShape{16, 8} : BcastShape{12, 4}; }
void tile_products(const double* A, int64_t kp, const double* B, int64_t Kp, int64_t ldb, bool sym, double* acc) {
  switch (isa_level()) {
    case 4: tile_products_v4(A, kp, B, Kp, ldb, sym, acc); break;
    case 3: tile_products_v3(A, kp, B, Kp, ldb, sym, acc); break;
    default: tile_products_base(A, kp, B, Kp, ldb, sym, acc);
  }
}
void bcast_items(const BcastBlock& g, int64_t q0, int64_t q1) {
  switch (isa_level()) {
    case 4: bcast_items_v4(g, q0, q1); break;
    case 3: bcast_items_v3(g, q0, q1); break;
    default: bcast_items_base(g, q0, q1);
  }
}
#else
constexpr int gram_width() { return VW; }
void tile_products(const double* A, int64_t kp, const double* B, int64_t Kp, int64_t ldb, bool sym, double* acc) {
  tile_products_w<VW>(A, kp, B, Kp, ldb, sym, acc);
}
#if defined(__AVX512F__)
constexpr BcastShape bcast_shape() { return {16, 8}; }
void bcast_items(const BcastBlock& g, int64_t q0, int64_t q1) { bcast_items_w<8, 2, 8>(g, q0, q1); }
#else
constexpr BcastShape bcast_shape() { return {12, 4}; }
void bcast_items(const BcastBlock& g, int64_t q0, int64_t q1) { bcast_items_w<4, 3, 4>(g, q0, q1); }
#endif
#endif

template <typename T>
void gram_cols(const at::Tensor& U, const std::vector<int64_t>& rows, bool symmetric, double* out) {
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

// The broadcast path's rows: sym (the product is symmetric: rows list every client) or the distinct
// rows arow; G row i (client i, or arow[i]) goes to out + roff[i]; copies: (out offset, source
// offset) of the repeated rows, copied after the product.
struct RowPlan {
  bool sym = true;
  std::vector<int64_t> arow, roff;
  std::vector<std::pair<int64_t, int64_t>> copies;
};

RowPlan plan_rows(const std::vector<int64_t>& rows, bool all_rows, int64_t K) {
  RowPlan pl;
  if (all_rows) {
    pl.roff.resize(K);
    for (int64_t i = 0; i < K; ++i) pl.roff[i] = i * K;
    return pl;
  }
  std::vector<int64_t> first(K, -1);  // the output row of each client's first request
  for (int64_t q = 0; q < (int64_t)rows.size(); ++q) {
    const int64_t x = rows[q];
    if (first[x] < 0) {
      first[x] = q;
      pl.arow.push_back(x);
    } else {
      pl.copies.push_back({q * K, x});
    }
  }
  for (auto& cp : pl.copies) cp.second = first[cp.second] * K;
  pl.sym = (int64_t)pl.arow.size() == K;
  if (pl.sym) {
    pl.arow.clear();
    pl.roff.resize(K);
    for (int64_t i = 0; i < K; ++i) pl.roff[i] = first[i] * K;
  } else {
    pl.roff.resize(pl.arow.size());
    for (size_t i = 0; i < pl.arow.size(); ++i) pl.roff[i] = first[pl.arow[i]] * K;
  }
  return pl;
}

template <typename T>
void gram_bcast(const at::Tensor& U, const RowPlan& pl, double* out) {
  const int64_t K = U.size(0), d = U.size(1), m = pl.sym ? K : (int64_t)pl.arow.size();
  const int64_t stride0 = U.stride(0);
  const T* base = U.data_ptr<T>();
  const BcastShape sh = bcast_shape();
  const int64_t P = sh.P, R = sh.R;
  const int64_t Kp = (K + P - 1) / P * P, mp = pl.sym ? 0 : (m + R - 1) / R * R;
  std::vector<int64_t> all(K);
  for (int64_t i = 0; i < K; ++i) all[i] = i;

  // Sub-chunk: the packed clients and rows ((Kp + mp) x C doubles) within ~1 MB of L2, a client
  // panel (P x C <= 2048 doubles: 16 KB) within L1.
  const int64_t C = std::max<int64_t>(16, std::min<int64_t>((1 << 17) / (Kp + mp), 2048 / P));
  // Parts (threads split d): only for K < 128, where a sub-chunk has too few client panels to share
  // among threads; at least 2048 columns each, at most 64, their partials under 256 MB.
  int64_t nparts = 1;
  if (K < 128)
    nparts = std::max<int64_t>(1, std::min<int64_t>({64, d / 2048, (int64_t(256) << 20) / (m * K * 8)}));
  int64_t part_cols = (d + nparts - 1) / nparts;
  part_cols = (part_cols + C - 1) / C * C;
  nparts = (d + part_cols - 1) / part_cols;

  // Part 0 is summed in out (rows roff), part p >= 1 in partials block p - 1 (row i at i * K).
  Buf partials = alloc_doubles((nparts - 1) * m * K);
  std::vector<int64_t> poff(m);
  for (int64_t i = 0; i < m; ++i) poff[i] = i * K;
  const int64_t npan = Kp / P, items = pl.sym ? (npan + 1) / 2 : npan;

  auto run_part = [&](int64_t p, bool parallel_items, double* bufB, double* bufA) {
    double* dst = p == 0 ? out : partials.get() + (p - 1) * m * K;
    const int64_t* ro = p == 0 ? pl.roff.data() : poff.data();
    const int64_t pend = std::min(d, (p + 1) * part_cols);
    for (int64_t c0 = p * part_cols; c0 < pend; c0 += C) {
      const int64_t cl = std::min(C, pend - c0);
      pack_panels<T>(base, stride0, all.data(), K, Kp, P, c0, cl, bufB);
      if (!pl.sym) pack_panels<T>(base, stride0, pl.arow.data(), m, mp, R, c0, cl, bufA);
      const BcastBlock g{bufB, pl.sym ? nullptr : bufA, cl, m, K, dst, ro, pl.sym, c0 == p * part_cols,
                         pl.sym && nparts == 1 && c0 + cl == pend};
      if (parallel_items)
        at::parallel_for(0, items, grain_for(P * m * cl / (pl.sym ? 1 : 2) + 1),
                         [&](int64_t q0, int64_t q1) { bcast_items(g, q0, q1); });
      else
        bcast_items(g, 0, items);
    }
  };
  if (nparts == 1) {
    Buf bufB = alloc_doubles(Kp * C), bufA = alloc_doubles(mp * C);
    run_part(0, true, bufB.get(), bufA.get());
  } else {
    at::parallel_for(0, nparts, 1, [&](int64_t p0, int64_t p1) {
      Buf bufB = alloc_doubles(Kp * C), bufA = alloc_doubles(mp * C);
      for (int64_t p = p0; p < p1; ++p) run_part(p, false, bufB.get(), bufA.get());
    });
    // parts added in index order: ((part0 + part1) + part2) + ... (symmetric: the upper triangle)
    at::parallel_for(0, m, grain_for(K * nparts), [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        double* o = out + pl.roff[i];
        for (int64_t p = 1; p < nparts; ++p) {
          const double* s = partials.get() + (p - 1) * m * K + i * K;
          for (int64_t j = pl.sym ? i : 0; j < K; ++j) o[j] += s[j];
        }
      }
    });
  }
  if (pl.sym && nparts > 1) {  // the strict lower triangle from the upper one, in 32 x 32 blocks
    constexpr int64_t BS = 32;
    at::parallel_for(0, (K + BS - 1) / BS, grain_for(BS * K / 2), [&](int64_t b0, int64_t b1) {
      for (int64_t ib = b0 * BS; ib < std::min(K, b1 * BS); ib += BS)
        for (int64_t jb = 0; jb <= ib; jb += BS)
          for (int64_t i = ib; i < std::min(K, ib + BS); ++i) {
            double* o = out + pl.roff[i];
            for (int64_t j = jb; j < std::min(i, jb + BS); ++j) o[j] = out[pl.roff[j] + i];
          }
    });
  }
  for (const auto& cp : pl.copies) std::memcpy(out + cp.first, out + cp.second, K * sizeof(double));
}

// The path: FEDKERNELS_GRAM_PATH=cols|bcast forces one (benchmarks and tests compare them); unset or
// auto: by shape only (so the summation order stays a function of the shape and the ISA level).
// Measured (bench/cpu_gram.py, AVX-512, 1 thread): the broadcast path is 1.5x faster at K = 100 and
// 3x at K = 1000 (d = 76), 1.2-4x at K = 300 and 2.4-3x at K = 1000 for d = 300 .. 1e4, about equal at
// K = 16-32 with d <= 300; the column-vector path is 1.2-1.5x faster for K <= 100 from d = 1000 (its
// long sub-chunks amortise the horizontal sums; the broadcast path's transposing pack costs about
// 32 / K of its multiply-adds and its 8 x 16 tiles pad small K) and 5-9x at K = 4.
bool use_bcast(int64_t K, int64_t d) {
  const char* e = std::getenv("FEDKERNELS_GRAM_PATH");
  if (e == nullptr || *e == '\0' || std::strcmp(e, "auto") == 0) return K >= 200 || (K >= 16 && d < 512);
  if (std::strcmp(e, "cols") == 0) return false;
  if (std::strcmp(e, "bcast") == 0) return true;
  TORCH_CHECK_VALUE(false, "FEDKERNELS_GRAM_PATH=", e, ": expected auto, cols or bcast");
  return false;
}

at::Tensor gram_cpu(const at::Tensor& U, const c10::optional<at::Tensor>& rows) {
  checks::gram_args(U, rows, at::kCPU);
  const int64_t K = U.size(0);
  const bool symmetric = !rows.has_value();
  auto r = row_list(rows, K, "gram");
  const bool bcast = use_bcast(K, U.size(1));
  const auto opts = U.options().dtype(at::kDouble);
  if (r.empty() || K == 0 || U.size(1) == 0) return at::zeros({(int64_t)r.size(), K}, opts);
  auto G = at::empty({(int64_t)r.size(), K}, opts);   // both paths write every entry (no zero-fill pass)
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, U.scalar_type(), "gram_cpu", [&] {
    if (bcast)
      gram_bcast<scalar_t>(U, plan_rows(r, symmetric, K), G.data_ptr<double>());
    else
      gram_cols<scalar_t>(U, r, symmetric, G.data_ptr<double>());
  });
  return G;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fedkernels, m) {
  // G = U[rows] @ U^T with float64 accumulation and a fixed reduction order: [k or K, K] fp64.
  // U: [K, d] with unit column stride (any row stride, so a column chunk U[:, a:b] is a view).
  m.def("gram(Tensor U, Tensor? rows=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(fedkernels, CPU, m) { m.impl("gram", &gram_cpu); }

}  // namespace fedkernels
