// select: per-column selection over the k selected rows of U (coordinate-wise median, trimmed mean,
// Bulyan's "beta closest to the median"), one read of U, no K x d sorted copy.
//
// Maths, per column j, with x_0 <= ... <= x_{k-1} the sorted values of U[rows[i], j]:
//   order_mean(lo, hi)  = (x_lo + ... + x_{hi-1}) / (hi - lo): the median is lo = (k-1)//2, hi = k//2 + 1
//                         (even k: the mean of the two middle values, as np.median), the trimmed mean
//                         lo = int(beta k), hi = k - lo (scipy.stats.trim_mean, Flower's FedTrimmedAvg);
//   closest_mean(beta)  = the mean of the beta values closest to m = (x_a + x_{k//2}) / 2, a = (k-1)//2
//                         (x_a / 2 + x_{k//2} / 2 where the float64 sum overflows)
//                         (the median; Bulyan's coordinate-wise step, Flower's _aggregate_n_closest_weights),
//                         distances |x - m| in float64; at equal distance the smaller value first, so the
//                         beta values are the consecutive order statistics x_s..x_{s+beta-1} with s the
//                         first start where moving the window right does not bring a strictly closer value (a move over equal values is
//                         taken: it changes nothing), searched from max(0, a - beta) to min(k - beta, k//2)
//                         (the windows next to the median; rounding of m can favour either middle value).
// The selected values are added in float64 in ascending order (a sum of fp64 values near the maximum may
// overflow to +-Inf, as np.mean's) and divided by their count once: the
// median of odd k is its middle element exactly (of even k, the two middle values' float64 mean), then
// rounded once to the result's dtype (float64 for a float64 U, else float32).
// order_mean with lo <= 15 and k - hi <= 15 (the trimmed mean with beta = 0.1 up to k = 159, the median
// up to k = 32) where that is cheaper (use_extremes) takes the window's ends a = x_lo, b = x_{hi-1} from
// the 16 smallest and 16 largest values (extremes_out: no sort of the column) and sums the window as
//   (the x with a < x < b, float64, in row order) + (#{x <= a} - lo) a + (hi - #{x < b}) b   (a < b),
//   (hi - lo) a                                                                                (a == b):
// the same values as the ascending sum (the window's multiset: its ties at both ends counted), added in
// another order. Rounding against the float64 reference (which adds in ascending order): both are
// recursive float64 sums of the n = hi - lo window values (the two products are exact for float32 values:
// a count below 2^29 times 24 bits; one rounding each for float64), so each is within (n + 1) u sum|x|
// <= (n + 1) n u max|x| of the exact sum (u = 2^-53), the means within (n + 1) u max|x| of each other's
// exact value, before the final rounding to the result's dtype: the tests' bound 2 n u max|x| + u_out |x|.
// The median of odd k (a == b, n = 1) is still its middle element exactly, of even k (a + b) / 2 as before
// (a single float64 addition: the same bits as the ascending sum).
// NaN/Inf: ok[i] = all(isfinite(U[rows[i], :])) comes from the same pass (exact, every dtype). A column
// with a NaN among its selected values gives NaN (order_mean: +-Inf are ordered values, so a window that
// holds one is +-Inf, or NaN for both); closest_mean gives NaN for a column with any NaN or Inf.
//
// Kernel: columns in tiles of C columns (the k x C tile, converted to S = float (fp16/bf16/fp32, exact) or
// double (fp64), within ~128 KB of L2, row stride C + W so the rows do not alias in L1); a tile is read
// from U once (per row a contiguous run: the row's finite flag and the columns' NaN flags are taken
// there), then sorted in place W = 64 / sizeof(S) columns at a time (one 64-byte vector per row) by a
// sorting network across the columns: Parberry's pairwise sorting network on the next power of two, the
// comparators that touch a padding position dropped (a +inf pad never moves) and those that cannot
// reach the needed sorted positions pruned (the median of 10 values: 28 of 31 comparators left, of 100
// values 776 of 1077). The network is bound by its stores to L1 (each comparator rewrites two 64-byte
// vectors per row pair); meanwhile the next tile's rows are prefetched, one cache line per comparator,
// so its load does not stall on memory. k > kNetMax
// (256) selected rows: per column std::nth_element + partial_sort of the needed positions instead.
// extremes_out (see use_extremes) instead keeps everything in registers: per group of W columns the rows in
// blocks of 16, each sorted by a 60-comparator network and merged into the running 16 smallest / largest
// by a bitonic keep-min / keep-max (16 min or max + 32 comparators each; the last rows inserted one by
// one when there are few), then one more read of the group's rows for the counts and the sum (with the
// next tile's prefetches). At k = 100, beta = 0.1: 1000 comparators in registers (~0.5 ns per 16 columns
// each) against the 1053 of the network through L1 (1.2-2 ns each). The tile load carries no column flags
// on that path (the NaN test is in the sum's read).
// Bytes moved: U's selected rows read once (k d elements), the result written once (d elements of 4 or
// 8 bytes); the tile's re-reads hit L1/L2. Determinism: every column is computed on its own in a fixed
// order (no cross-column sums); the flags are and-ed: the same bits for any thread count.
#include "common.h"
#include "../select_checks.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>

#include <algorithm>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <vector>

namespace fedkernels {
namespace {

constexpr int64_t kNetMax = 256;            // largest k sorted by a network (n = 256: 3839 comparators)
constexpr int64_t kTileBytes = 128 * 1024;  // the k x C tile of converted values
constexpr int64_t kInsertMax = 6;           // extremes_out: last rows inserted one by one, not sorted as a block

enum class Mode { Order, Closest };

// The sorted positions [plo, phi) a mode needs.
struct Need { int64_t plo, phi; };
Need needed(Mode mode, int64_t k, int64_t lo, int64_t hi, int64_t beta) {
  if (mode == Mode::Order) return {lo, hi};
  const int64_t a = (k - 1) / 2;
  const int64_t smin = std::max<int64_t>(0, a - beta), send = std::min(k - beta, k / 2);
  return {smin, std::max(send + beta, k / 2 + 1)};   // and the upper middle value, for the median
}

// Parberry's pairwise sorting network for n = 2^p >= k (min to the lower index; as many comparators as
// Batcher's odd-even merge sort, but its pruned forms are smaller: the median of 100 values needs 776
// comparators, against 898 pruned from Batcher's), without the comparators that touch a position >= k
// (a +inf pad never moves), pruned backwards to those that reach a position in [plo, phi). Each comparator
// is stored as its two row offsets in the tile (row * stride).
std::vector<int32_t> network(int64_t k, int64_t plo, int64_t phi, int64_t stride) {
  int64_t n = 1;
  while (n < k) n <<= 1;
  std::vector<std::pair<int32_t, int32_t>> all;
  auto add = [&](int64_t a, int64_t b) {
    if (b < k) all.emplace_back((int32_t)a, (int32_t)b);
  };
  for (int64_t a = 1; a < n; a *= 2)   // first half: sort the pairs, then pairs of pairs, ...
    for (int64_t b = a, c = 0; b < n;) {
      add(b - a, b);
      ++b;
      c = (c + 1) % a;
      if (c == 0) b += a;
    }
  for (int64_t a = n / 4, e = 1; a > 0; a /= 2, e = 2 * e + 1)   // second half: the merging cascade
    for (int64_t dd = e; dd > 0; dd /= 2)
      for (int64_t b = (dd + 1) * a, c = 0; b < n;) {
        add(b - dd * a, b);
        ++b;
        c = (c + 1) % a;
        if (c == 0) b += a;
      }
  std::vector<char> need(k, 0);
  for (int64_t i = plo; i < phi; ++i) need[i] = 1;
  std::vector<std::pair<int32_t, int32_t>> kept;
  for (auto it = all.rbegin(); it != all.rend(); ++it)
    if (need[it->first] || need[it->second]) {
      need[it->first] = need[it->second] = 1;
      kept.push_back(*it);
    }
  std::vector<int32_t> off;
  off.reserve(2 * kept.size());
  for (auto it = kept.rbegin(); it != kept.rend(); ++it) {
    off.push_back((int32_t)(it->first * stride));
    off.push_back((int32_t)(it->second * stride));
  }
  return off;
}

// The network on one group of G = 2W columns (x: the group's first column in the tile, 64-byte aligned):
// two 64-byte vectors per row, independent work for the out-of-order core. A GCC vector of G values per row, so each comparator is one min, one max and two plain stores (an
// element loop is turned into masked stores behind a data-dependent branch).
// pf[0, npf): cache lines of the next tile to prefetch, one with each of the first npf comparators (the
// network is bound by its L1 stores; U's next rows come in meanwhile instead of stalling the next load).
template <typename S, int W>
FEDKERNELS_SIMD_CLONES void sort_group(S* x, const int32_t* off, int64_t ncomp, const char* const* pf, int64_t npf) {
  typedef S V __attribute__((vector_size(W * sizeof(S))));   // one 64-byte vector (wider ones are split)
  for (int64_t c = 0; c < ncomp; ++c) {
    if (c < npf) __builtin_prefetch(pf[c], 0, 2);
    V* a = reinterpret_cast<V*>(x + off[2 * c]);
    V* b = reinterpret_cast<V*>(x + off[2 * c + 1]);
    const V u0 = a[0], v0 = b[0], u1 = a[1], v1 = b[1];
    a[0] = v0 < u0 ? v0 : u0;
    b[0] = v0 < u0 ? u0 : v0;
    a[1] = v1 < u1 ? v1 : u1;
    b[1] = v1 < u1 ? u1 : v1;
  }
}

// out[l] = acc[l] / n rounded to O, NaN where the column is flagged, for the group's first len columns.
template <typename S, typename O, int W>
inline void store_out(const double* acc, double n, const S* flag, O* out, int64_t len) {
  O res[W];
#pragma omp simd
  for (int l = 0; l < W; ++l) res[l] = flag[l] != flag[l] ? std::numeric_limits<O>::quiet_NaN() : O(acc[l] / n);
  for (int64_t l = 0; l < len; ++l) out[l] = res[l];
}

// Per column of a group: the mean of the sorted positions [lo, hi) (ascending, float64), NaN where flagged.
template <typename S, typename O, int W>
FEDKERNELS_SIMD_CLONES void order_out(const S* x, int64_t stride, int64_t lo, int64_t hi, const S* flag, O* out,
                                      int64_t len) {
  double acc[W];
  for (int l = 0; l < W; ++l) acc[l] = 0.0;
  for (int64_t p = lo; p < hi; ++p) {
    const S* r = x + p * stride;
#pragma omp simd
    for (int l = 0; l < W; ++l) acc[l] += double(r[l]);
  }
  const double n = double(hi - lo);
  store_out<S, O, W>(acc, n, flag, out, len);
}

// Per column of a group: the mean of the beta values closest to the median (see the header).
template <typename S, typename O, int W>
FEDKERNELS_SIMD_CLONES void closest_out(const S* x, int64_t stride, int64_t k, int64_t beta, const S* flag, O* out,
                                        int64_t len) {
  const int64_t a = (k - 1) / 2, h = k / 2;
  const int64_t smin = std::max<int64_t>(0, a - beta), send = std::min(k - beta, h);
  // window starts and flags as doubles (small integers, exact) so that every lane array is one vector type
  double m[W], acc[W], s[W], go[W];
  for (int l = 0; l < W; ++l) {
    const double xa = double(x[a * stride + l]), xh = double(x[h * stride + l]), mm = (xa + xh) * 0.5;
    m[l] = std::isfinite(mm) ? mm : xa * 0.5 + xh * 0.5;   // the sum overflows only for fp64 values near the max
    s[l] = double(smin);
    go[l] = 1.0;
    acc[l] = 0.0;
  }
  for (int64_t p = smin; p < send; ++p) {
    const S* r0 = x + p * stride;
    const S* r1 = x + (p + beta) * stride;
#pragma omp simd
    for (int l = 0; l < W; ++l) {
      const double x0 = double(r0[l]), x1 = double(r1[l]);
      const double mv = (std::fabs(x1 - m[l]) < std::fabs(x0 - m[l])) | (x1 == x0) ? 1.0 : 0.0;
      go[l] *= mv;
      s[l] += go[l];
    }
  }
  const double b = double(beta);
  for (int64_t p = smin; p < send + beta; ++p) {
    const S* r = x + p * stride;
    const double q = double(p);
#pragma omp simd
    for (int l = 0; l < W; ++l) {   // acc + 1 * x = acc + x; acc + 0 * x = acc (a NaN/Inf column is flagged)
      const double in = (q >= s[l]) & (q < s[l] + b) ? 1.0 : 0.0;
      acc[l] += in * double(r[l]);
    }
  }
  const double n = b;
  store_out<S, O, W>(acc, n, flag, out, len);
}

// Compare-exchange of two vectors of W columns (min to a, max to b). A NaN compares false, so the pair is
// left as it is: values are only ever permuted (a flagged column's NaN is never lost).
// (With AVX-512, one vminps/vmaxps each: min(a, b) = a < b ? a : b and max(b, a) = b > a ? b : a, the
// same pair; GCC writes the vector ?: as a compare and two blends.)
template <typename V>
__attribute__((always_inline)) inline void cswap(V& a, V& b) {
#ifdef __AVX512F__
  if constexpr (sizeof(V) == 64) {
    using E = std::remove_reference_t<decltype(a[0])>;
    if constexpr (std::is_same_v<E, float>) {
      const V lo = (V)_mm512_min_ps((__m512)a, (__m512)b), hi = (V)_mm512_max_ps((__m512)b, (__m512)a);
      a = lo;
      b = hi;
      return;
    } else {
      const V lo = (V)_mm512_min_pd((__m512d)a, (__m512d)b), hi = (V)_mm512_max_pd((__m512d)b, (__m512d)a);
      a = lo;
      b = hi;
      return;
    }
  }
#endif
  const V lo = a < b ? a : b, hi = a < b ? b : a;
  a = lo;
  b = hi;
}

// Sorts 16 vectors (each lane on its own) in registers: a 60-comparator, 10-layer network (the best known
// for 16 inputs; tests/test_select.py checks it by the 0-1 principle on all 2^16 inputs).
#define FK_SORT16_NET(CS)                                                                                   \
  CS(0, 13) CS(1, 12) CS(2, 15) CS(3, 14) CS(4, 8) CS(5, 6) CS(7, 11) CS(9, 10)                             \
  CS(0, 5) CS(1, 7) CS(2, 9) CS(3, 4) CS(6, 13) CS(8, 14) CS(10, 15) CS(11, 12)                             \
  CS(0, 1) CS(2, 3) CS(4, 5) CS(6, 8) CS(7, 9) CS(10, 11) CS(12, 13) CS(14, 15)                             \
  CS(0, 2) CS(1, 3) CS(4, 10) CS(5, 11) CS(6, 7) CS(8, 9) CS(12, 14) CS(13, 15)                             \
  CS(1, 2) CS(3, 12) CS(4, 6) CS(5, 7) CS(8, 10) CS(9, 11) CS(13, 14)                                       \
  CS(1, 4) CS(2, 6) CS(5, 8) CS(7, 10) CS(9, 13) CS(11, 14)                                                 \
  CS(2, 4) CS(3, 6) CS(9, 12) CS(11, 13)                                                                    \
  CS(3, 5) CS(6, 8) CS(7, 9) CS(10, 12)                                                                     \
  CS(3, 4) CS(5, 6) CS(7, 8) CS(9, 10) CS(11, 12)                                                           \
  CS(6, 7) CS(8, 9)
template <typename V>
__attribute__((always_inline)) inline void sort16(V* s) {
#define FK_CS(i, j) cswap(s[i], s[j]);
  FK_SORT16_NET(FK_CS)
#undef FK_CS
}

// Sorts a bitonic sequence of 16 vectors (half-cleaners at distances 8, 4, 2, 1: 32 comparators).
template <typename V>
__attribute__((always_inline)) inline void bitonic16(V* r) {
#pragma GCC unroll 4
  for (int dd = 8; dd > 0; dd /= 2)
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i)
      if ((i & dd) == 0) cswap(r[i], r[i + dd]);
}

// r, s ascending: r becomes the 16 smallest of r and s, ascending (min(r_i, s_15-i) is bitonic: 16 min
// and 32 comparators); keep_max16 the 16 largest (the max is bitonic too: falling, then rising).
template <typename V>
__attribute__((always_inline)) inline void keep_min16(V* r, const V* s) {
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    V hi = s[15 - i];
    cswap(r[i], hi);
  }
  bitonic16(r);
}
template <typename V>
__attribute__((always_inline)) inline void keep_max16(V* t, const V* s) {
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    V lo = s[15 - i];
    cswap(lo, t[i]);
  }
  bitonic16(t);
}

// order_mean of one group of W columns whose window has at most 15 positions below it and at most 15
// above it (lo <= 15, k - hi <= 15), without sorting the column: the rows are taken in blocks of 16, each
// sorted in registers and merged into the running 16 smallest (r) and 16 largest (t) of the rows so far
// (the last block padded with +inf for r and -inf for t), so a = x_lo = r[lo] and b = x_{hi-1} =
// t[15 - (k - hi)]. Then one more read of the group's rows: with L = #{x <= a}, M = #{x < b}, the window
// is the values strictly between a and b, L - lo copies of a and hi - M copies of b (a < b), or hi - lo
// copies of a (a == b):
//   sum = (sum of the x with a < x < b, in row order) + (L - lo) a + (hi - M) b.
// NaN: the column's flag (a NaN never enters a comparison's result: see cswap).
template <typename S, typename O, int W>
FEDKERNELS_SIMD_CLONES void extremes_out(const S* x, int64_t stride, int64_t k, int64_t lo, int64_t hi, O* out,
                                         int64_t len, const char* const* pf, int64_t npf) {
  typedef S V __attribute__((vector_size(W * sizeof(S))));
  const V pinf = V{} + std::numeric_limits<S>::infinity(), ninf = -pinf;
  auto row = [&](int64_t p) { return *reinterpret_cast<const V*>(x + p * stride); };
  V r[16], t[16], s[16];
  int64_t p = 0;
  if (k >= 16) {
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) s[i] = row(i);
    sort16(s);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) r[i] = t[i] = s[i];
    for (p = 16; p + 16 <= k; p += 16) {
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) s[i] = row(p + i);
      sort16(s);
      keep_min16(r, s);
      keep_max16(t, s);
    }
  }
  const int64_t rem = k - p;
  if (p > 0 && rem <= kInsertMax) {   // a few last rows: each inserted into both lists (16 + 16 comparators)
    for (; p < k; ++p) {
      V y = row(p), z = y;
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) cswap(r[i], y);
#pragma GCC unroll 16
      for (int i = 15; i >= 0; --i) cswap(z, t[i]);
    }
  }
  auto padded = [&](const V pad) {   // s: the last rows and pad up to 16, sorted
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) s[i] = i < rem ? row(p + i) : pad;
    sort16(s);
  };
  if (p < k) {   // the last rows (all of them for k < 16), padded to 16
    padded(pinf);
    if (p == 0) std::copy(s, s + 16, r);
    else keep_min16(r, s);
    padded(ninf);
    if (p == 0) std::copy(s, s + 16, t);
    else keep_max16(t, s);
  }
  V av = r[0], bv = t[0];
#pragma GCC unroll 16
  for (int i = 1; i < 16; ++i) {
    if (i == lo) av = r[i];
    if (i == 15 - (k - hi)) bv = t[i];
  }
#ifdef __AVX512F__
  if constexpr (std::is_same_v<S, float> && W == 16) {   // the same sums with fp32 compares and mask registers
    const __m512 A = (__m512)av, B = (__m512)bv;
    const __m512i one = _mm512_set1_epi32(1);
    __m512d acc0 = _mm512_setzero_pd(), acc1 = _mm512_setzero_pd();
    __m512i le = _mm512_setzero_si512(), lt = _mm512_setzero_si512();
    __mmask16 nan = 0;
    for (int64_t q = 0; q < k; ++q) {
      for (int64_t e = q * npf / k; e < (q + 1) * npf / k; ++e) __builtin_prefetch(pf[e], 0, 2);
      const __m512 v = _mm512_load_ps(x + q * stride);
      const __mmask16 mle = _mm512_cmp_ps_mask(v, A, _CMP_LE_OQ), mlt = _mm512_cmp_ps_mask(v, B, _CMP_LT_OQ);
      nan = _kor_mask16(nan, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q));
      le = _mm512_mask_add_epi32(le, mle, le, one);
      lt = _mm512_mask_add_epi32(lt, mlt, lt, one);
      const __mmask16 mb = _kandn_mask16(mle, mlt);
      acc0 = _mm512_mask_add_pd(acc0, (__mmask8)mb, acc0, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
      acc1 = _mm512_mask_add_pd(acc1, (__mmask8)(mb >> 8), acc1, _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1)));
    }
    const __m512d dn = _mm512_set1_pd(double(hi - lo)), dlo = _mm512_set1_pd(double(lo)),
                  dhi = _mm512_set1_pd(double(hi));
    const __m512d accs[2] = {acc0, acc1};
    O res[W];
    for (int c = 0; c < 2; ++c) {
      const __m512d a8 = _mm512_cvtps_pd(c ? _mm512_extractf32x8_ps(A, 1) : _mm512_castps512_ps256(A));
      const __m512d b8 = _mm512_cvtps_pd(c ? _mm512_extractf32x8_ps(B, 1) : _mm512_castps512_ps256(B));
      const __m256i le8 = c ? _mm512_extracti32x8_epi32(le, 1) : _mm512_castsi512_si256(le);
      const __m256i lt8 = c ? _mm512_extracti32x8_epi32(lt, 1) : _mm512_castsi512_si256(lt);
      const __m512d na = _mm512_sub_pd(_mm512_cvtepi32_pd(le8), dlo), nb = _mm512_sub_pd(dhi, _mm512_cvtepi32_pd(lt8));
      const __m512d gen = _mm512_add_pd(_mm512_add_pd(accs[c], _mm512_mul_pd(na, a8)), _mm512_mul_pd(nb, b8));
      const __mmask8 eq = _mm512_cmp_pd_mask(a8, b8, _CMP_EQ_OQ);
      const __m512d sum = _mm512_mask_blend_pd(eq, gen, _mm512_mul_pd(dn, a8));
      _mm256_storeu_ps(res + 8 * c, _mm512_cvtpd_ps(_mm512_div_pd(sum, dn)));
    }
    for (int l = 0; l < W; ++l)
      if ((nan >> l) & 1) res[l] = std::numeric_limits<O>::quiet_NaN();
    for (int64_t l = 0; l < len; ++l) out[l] = res[l];
    return;
  }
#endif
  // the sum pass in float64 vectors of 8 lanes (comparisons of the exact float64 values, the same as in S)
  typedef double D __attribute__((vector_size(64)));
  typedef S H __attribute__((vector_size(8 * sizeof(S))));
  constexpr int NC = W / 8;
  const D zero = D{}, one = zero + 1.0;
  D A[NC], B[NC], acc[NC], le[NC], lt[NC], nan[NC];
#pragma GCC unroll 2
  for (int c = 0; c < NC; ++c) {
    H ha, hb;
    std::memcpy(&ha, reinterpret_cast<const S*>(&av) + 8 * c, sizeof(H));
    std::memcpy(&hb, reinterpret_cast<const S*>(&bv) + 8 * c, sizeof(H));
    A[c] = __builtin_convertvector(ha, D);
    B[c] = __builtin_convertvector(hb, D);
    acc[c] = le[c] = lt[c] = nan[c] = zero;
  }
  for (int64_t q = 0; q < k; ++q) {
    for (int64_t e = q * npf / k; e < (q + 1) * npf / k; ++e) __builtin_prefetch(pf[e], 0, 2);
    const S* rq = x + q * stride;
#pragma GCC unroll 2
    for (int c = 0; c < NC; ++c) {
      H h;
      std::memcpy(&h, rq + 8 * c, sizeof(H));
      const D v = __builtin_convertvector(h, D);
      le[c] += v <= A[c] ? one : zero;
      lt[c] += v < B[c] ? one : zero;
      acc[c] += (v > A[c]) & (v < B[c]) ? v : zero;
      nan[c] += v != v ? one : zero;
    }
  }
  const double n = double(hi - lo);
  const D dn = zero + n, dlo = zero + double(lo), dhi = zero + double(hi);
  O res[W];
#pragma GCC unroll 2
  for (int c = 0; c < NC; ++c) {
    const D sum = A[c] == B[c] ? dn * A[c] : acc[c] + (le[c] - dlo) * A[c] + (dhi - lt[c]) * B[c];
    const D m = sum / dn;
    for (int l = 0; l < 8; ++l) res[8 * c + l] = nan[c][l] != 0.0 ? std::numeric_limits<O>::quiet_NaN() : O(m[l]);
  }
  for (int64_t l = 0; l < len; ++l) out[l] = res[l];
}

// Copies row segment src[0, len) into dst as S; returns false if it holds a NaN/Inf. flag[j] becomes
// NaN when the column's value is NaN (Order) or NaN/Inf (Closest).
template <typename T, typename S, Mode mode, bool flags>
FEDKERNELS_SIMD_CLONES bool load_row(const T* src, int64_t len, S* dst, S* flag) {
  S zs = 0;
  int64_t j0 = 0;
  if constexpr (std::is_same_v<T, S>) {   // fp32/fp64: the row's test in a vector register (the reduction
    constexpr int W = 64 / sizeof(S);     // below keeps its accumulator on the stack: a store-to-load chain)
    typedef S V __attribute__((vector_size(64)));
    V z = V{};
    for (; j0 + W <= len; j0 += W) {
      V v, f;
      std::memcpy(&v, src + j0, sizeof(V));
      std::memcpy(dst + j0, &v, sizeof(V));
      const V t = v * S(0);
      z += t;
      if constexpr (flags) {
        std::memcpy(&f, flag + j0, sizeof(V));
        if constexpr (mode == Mode::Order) f = v != v ? v : f;
        else f += t;
        std::memcpy(flag + j0, &f, sizeof(V));
      }
    }
    for (int l = 0; l < W; ++l) zs += z[l];
  }
  S z = 0;   // the rest (every column for fp16/bf16)
#pragma omp simd reduction(+ : z)
  for (int64_t j = j0; j < len; ++j) {
    const S v = S(src[j]);
    dst[j] = v;
    const S t = v * S(0);
    z += t;
    if constexpr (!flags) continue;
    else if constexpr (mode == Mode::Order) flag[j] = v != v ? v : flag[j];
    else flag[j] += t;
  }
  return zs + z == S(0);
}

// Whether order_mean(lo, hi) takes extremes_out (the window's ends among the 16 smallest and 16 largest)
// rather than the sorting network: always beyond kNetMax, else when its register comparators (60 per
// block of 16 rows, 96 per merge, the padded last block sorted twice) cost less than the network's
// comparators through L1, about twice as dear each (measured: ~0.6 ns against 1.2-2 ns per 16 columns).
bool use_extremes(int64_t k, int64_t lo, int64_t hi, int64_t ncomp) {
  if (lo > 15 || k - hi > 15) return false;
  const int64_t nb = k / 16, rem = k % 16;
  const int64_t cost = nb ? 156 * nb - 96 + (rem == 0 ? 0 : rem <= kInsertMax ? 32 * rem : 216) : 120;
  return k > kNetMax || cost < 2 * ncomp;
}

template <typename T, Mode mode>
void select_impl(const at::Tensor& U, const std::vector<int64_t>& rows, int64_t lo, int64_t hi, int64_t beta,
                 at::Tensor& out, bool* ok) {
  using S = std::conditional_t<std::is_same_v<T, double>, double, float>;
  using O = S;
  constexpr int W = 64 / sizeof(S);
  const int64_t k = (int64_t)rows.size(), d = U.size(1), ld = U.size(0) > 1 ? U.stride(0) : d;
  const T* u = U.data_ptr<T>();
  O* o = out.data_ptr<O>();
  int64_t C = kTileBytes / (k * (int64_t)sizeof(S));
  C = std::max<int64_t>(2 * W, std::min<int64_t>(C, 4096)) / (2 * W) * (2 * W);   // whole network groups
  C = std::min<int64_t>(C, (d + 2 * W - 1) / (2 * W) * (2 * W));
  const int64_t stride = C + W, ntiles = (d + C - 1) / C;
  const Need nd = needed(mode, k, lo, hi, beta);
  std::vector<int32_t> off = k <= kNetMax ? network(k, nd.plo, nd.phi, stride) : std::vector<int32_t>();
  const bool ext = mode == Mode::Order && use_extremes(k, lo, hi, (int64_t)off.size() / 2);
  if (ext) off.clear();
  const bool net = !ext && k <= kNetMax;
  const int64_t ncomp = (int64_t)off.size() / 2;
  std::vector<char> good(k, 1);
  std::mutex mu;
  at::parallel_for(0, ntiles, grain_for(k * C), [&](int64_t t0, int64_t t1) {
    std::vector<S> buf(k * stride + W), flag(C);
    S* tile = buf.data() + (W - (reinterpret_cast<uintptr_t>(buf.data()) / sizeof(S)) % W) % W;   // 64-byte aligned
    std::vector<char> g(k, 1);
    std::vector<S> col(net ? 0 : k);
    std::vector<const char*> pf;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t j0 = t * C, len = std::min(C, d - j0), lg = (len + 2 * W - 1) / (2 * W) * (2 * W);
      pf.clear();
      if ((net || ext) && t + 1 < t1) {   // the next tile's rows, line by line
        const int64_t nj0 = j0 + C, nbytes = std::min(C, d - nj0) * (int64_t)sizeof(T);
        for (int64_t i = 0; i < k; ++i) {
          const char* r = reinterpret_cast<const char*>(u + rows[i] * ld + nj0);
          for (int64_t b = 0; b < nbytes; b += 64) pf.push_back(r + b);
        }
      }
      const int64_t ngroups = lg / (2 * W), npf = (int64_t)pf.size();
      std::fill(flag.begin(), flag.end(), S(0));
      for (int64_t i = 0; i < k; ++i) {
        S* dst = tile + i * stride;
        const bool fin = ext ? load_row<T, S, mode, false>(u + rows[i] * ld + j0, len, dst, nullptr)
                             : load_row<T, S, mode, true>(u + rows[i] * ld + j0, len, dst, flag.data());
        if (!fin) g[i] = 0;
        for (int64_t j = len; j < lg; ++j) dst[j] = S(0);
      }
      if (!net && !ext) {   // per column: the needed positions in place, sorted (a flagged column is skipped)
        for (int64_t j = 0; j < len; ++j) {
          if (flag[j] != flag[j]) continue;
          for (int64_t i = 0; i < k; ++i) col[i] = tile[i * stride + j];
          std::nth_element(col.begin(), col.begin() + nd.plo, col.end());
          std::partial_sort(col.begin() + nd.plo, col.begin() + nd.phi, col.end());
          for (int64_t i = nd.plo; i < nd.phi; ++i) tile[i * stride + j] = col[i];
        }
      }
      for (int64_t j = 0; j < lg; j += W) {
        S* x = tile + j;
        if (net && j % (2 * W) == 0) {
          const int64_t g = j / (2 * W), a = g * npf / ngroups, b = (g + 1) * npf / ngroups;
          sort_group<S, W>(x, off.data(), ncomp, pf.data() + a, b - a);
        }
        const int64_t n = std::min<int64_t>(W, len - j);
        if (n <= 0) continue;
        if (ext) {
          const int64_t nw = lg / W, a = (j / W) * npf / nw, b = (j / W + 1) * npf / nw;
          extremes_out<S, O, W>(x, stride, k, lo, hi, o + j0 + j, n, pf.data() + a, b - a);
        }
        else if constexpr (mode == Mode::Order) order_out<S, O, W>(x, stride, lo, hi, flag.data() + j, o + j0 + j, n);
        else closest_out<S, O, W>(x, stride, k, beta, flag.data() + j, o + j0 + j, n);
      }
    }
    std::lock_guard<std::mutex> lock(mu);
    for (int64_t i = 0; i < k; ++i) good[i] = good[i] && g[i];
  });
  for (int64_t i = 0; i < k; ++i) ok[i] = good[i] != 0;
}

template <Mode mode>
std::tuple<at::Tensor, at::Tensor> select_cpu(const at::Tensor& U, int64_t lo, int64_t hi, int64_t beta,
                                              const c10::optional<at::Tensor>& rows, const char* op) {
  checks::select_args(U, rows, at::kCPU, op);
  const auto r = row_list(rows, U.size(0), op);
  const int64_t k = (int64_t)r.size();
  if (mode == Mode::Order) checks::order_mean_args(k, lo, hi);
  else checks::closest_mean_args(k, beta);
  auto out = at::empty({U.size(1)}, U.options().dtype(checks::select_out_dtype(U.scalar_type())));
  auto ok = at::ones({k}, U.options().dtype(at::kBool));
  if (U.size(1) == 0) return {out, ok};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, U.scalar_type(), "select_cpu", [&] {
    select_impl<scalar_t, mode>(U, r, lo, hi, beta, out, ok.data_ptr<bool>());
  });
  return {out, ok};
}

std::tuple<at::Tensor, at::Tensor> order_mean_cpu(const at::Tensor& U, int64_t lo, int64_t hi,
                                                  const c10::optional<at::Tensor>& rows) {
  return select_cpu<Mode::Order>(U, lo, hi, 0, rows, "order_mean");
}

std::tuple<at::Tensor, at::Tensor> closest_mean_cpu(const at::Tensor& U, int64_t beta,
                                                    const c10::optional<at::Tensor>& rows) {
  return select_cpu<Mode::Closest>(U, 0, 0, beta, rows, "closest_mean");
}

}  // namespace

// The schemas (this op's own fragment of the fedkernels library):
//   order_mean(U, lo, hi, rows) -> (out [d], ok [k]): per column the mean of the sorted positions lo..hi-1
//     of the selected rows' values; ok[i] = all(isfinite(U[rows[i]])) from the same pass.
//   closest_mean(U, beta, rows) -> (out [d], ok [k]): per column the mean of the beta values closest to
//     the median (Bulyan). out: float64 for a float64 U, else float32. rows: int64 indices (all K if None).
TORCH_LIBRARY_FRAGMENT(fedkernels, m) {
  m.def("order_mean(Tensor U, int lo, int hi, Tensor? rows=None) -> (Tensor, Tensor)");
  m.def("closest_mean(Tensor U, int beta, Tensor? rows=None) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fedkernels, CPU, m) {
  m.impl("order_mean", &order_mean_cpu);
  m.impl("closest_mean", &closest_mean_cpu);
}

}  // namespace fedkernels
