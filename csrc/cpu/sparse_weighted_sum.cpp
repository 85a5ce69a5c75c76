// sparse_weighted_sum: out = base + alpha * sum_i coef[i] * scatter(list rows[i]), where list k is the
// index/value pairs idx[offsets[k]:offsets[k+1]], val[...] (CSR-like: one flat idx and val, row offsets),
// scatter(list)[j] = the sum of the list's values at index j (0 where it has none). With ok[i] = all values
// of list rows[i] finite, from the same pass. The schema is defined here (TORCH_LIBRARY_FRAGMENT).
//
// Contract: each list's indices are non-decreasing (duplicates allowed: summed in list order) and in
// [0, d); the Python wrapper checks both. The kernel never reads or writes outside its buffers whatever the
// indices (an entry is used only where it falls in the chunk being built), so a list that breaks the contract
// gives wrong numbers, never a memory error.
//
// Maths and order: w_i = alpha * coef[i] rounded once to the accumulation type A (out's: float32 or float64;
// float64 when some |w_i| > 3e38); each value converts exactly to A; acc[j] = fma(w_i, v, acc[j]) over the
// lists in the order given and, within a list, in position order; out = base + acc (or acc), in out's dtype.
//
// Determinism: the columns are cut into fixed chunks of SPARSE_CHUNK; a chunk is built by one thread, which
// finds each list's entries in it by binary search and adds them in the order above: every output element is
// the same chain of fmas with any thread count.
//
// Bytes moved: nnz (index + value) of the selected lists, a binary search per (chunk, list) (n log nnz_k
// index reads per chunk), d of base and d of out. Dense work: d (the result is dense).
#include "common.h"
#include "chunk_result.h"
#include "../sparse_weighted_sum_checks.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#ifndef SPARSE_CHUNK
#define SPARSE_CHUNK 16384  // columns per task: a 64 KB float32 accumulator (L2)
#endif

TORCH_LIBRARY_FRAGMENT(fedkernels, m) {
  // out = base + alpha * sum_i coef[i] * scatter(idx, val of list rows[i]) over K lists stored CSR-like
  // (offsets [K + 1] on the host; each list's idx non-decreasing, in [0, d)), and ok[i] = all values of that
  // list finite. The result is float32 or float64 (base's dtype, else out_dtype, else float64 for float64
  // values and float32 otherwise). -> (out, ok)
  m.def("sparse_weighted_sum(Tensor idx, Tensor val, Tensor offsets, Tensor coef, int d, Tensor? base=None, "
        "float alpha=1.0, Tensor? rows=None, ScalarType? out_dtype=None) -> (Tensor, Tensor)");
}

namespace fedkernels {
namespace {

template <typename T> struct Tag { using type = T; };

template <typename I, typename T, typename O, typename A>
void sp_impl(const I* idx, const T* val, const int64_t* off, const std::vector<int64_t>& rows, const std::vector<A>& w,
             int64_t d, const O* b, O* o, bool* ok_out) {
  const int64_t n = (int64_t)rows.size();
  constexpr int64_t CH = SPARSE_CHUNK;
  const int64_t nch = (d + CH - 1) / CH;
  std::vector<unsigned char> flag(nch * n, 1);
  at::parallel_for(0, nch, grain_for(std::min(CH, d)), [&](int64_t c0, int64_t c1) {
    std::vector<A> accv(CH);
    A* acc = accv.data();
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t j0 = c * CH, j1 = std::min(d, j0 + CH), len = j1 - j0;
      for (int64_t j = 0; j < len; ++j) acc[j] = A(0);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t k = rows[i], lo = off[k], hi = off[k + 1];
        const I* p = std::lower_bound(idx + lo, idx + hi, (I)j0);
        const I* e = idx + hi;
        const A wi = w[i];
        A z = A(0);
        for (; p < e && int64_t(*p) < j1; ++p) {
          const int64_t j = int64_t(*p);
          if (j < j0) continue;           // only where the list breaks its order (the wrapper refuses that)
          const A v = A(val[p - idx]);
          acc[j - j0] = std::fma(wi, v, acc[j - j0]);
          z += v * A(0);
        }
        if (!(z == A(0))) flag[c * n + i] = 0;
      }
      store_chunk<O, A>(b ? b + j0 : nullptr, acc, o + j0, len);
    }
  });
  and_chunk_flags(flag, nch, n, ok_out);
}

std::tuple<at::Tensor, at::Tensor> sparse_weighted_sum_cpu(const at::Tensor& idx, const at::Tensor& val,
                                                           const at::Tensor& offsets, const at::Tensor& coef, int64_t d,
                                                           const c10::optional<at::Tensor>& base, double alpha,
                                                           const c10::optional<at::Tensor>& rows,
                                                           c10::optional<at::ScalarType> out_dtype) {
  const char* op = "sparse_weighted_sum";
  const auto args = checks::sparse_weighted_sum_args(idx, val, offsets, coef, d, base, rows, out_dtype, at::kCPU);
  auto r = row_list(rows, args.K, op);
  const int64_t n = args.n;
  const at::ScalarType ost = args.result;
  auto out = at::empty({d}, val.options().dtype(ost));
  auto ok = at::ones({n}, val.options().dtype(at::kBool));
  // the values of the lists that meet no chunk (d = 0) are screened here
  const auto cv = to_double_vector(coef);
  bool fits_float = true;
  for (double c : cv) fits_float = fits_float && std::abs(alpha * c) <= 3.0e38;
  auto off = offsets.contiguous();
  const int64_t* op_ = off.data_ptr<int64_t>();
  const at::Tensor* bp = base.has_value() ? &base.value() : nullptr;
  bool* okp = ok.data_ptr<bool>();
  if (d == 0) {
    auto vf = val.to(at::kDouble);
    const double* v = vf.data_ptr<double>();
    for (int64_t i = 0; i < n; ++i)
      for (int64_t p = op_[r[i]]; p < op_[r[i] + 1]; ++p) okp[i] = okp[i] && std::isfinite(v[p]);
    return {out, ok};
  }
  const auto run = [&](auto i_tag, auto t_tag, auto o_tag, auto a_tag) {
    using I = typename decltype(i_tag)::type;
    using T = typename decltype(t_tag)::type;
    using O = typename decltype(o_tag)::type;
    using A = typename decltype(a_tag)::type;
    std::vector<A> w(n);
    for (int64_t i = 0; i < n; ++i) w[i] = static_cast<A>(alpha * cv[i]);
    sp_impl<I, T, O, A>(idx.data_ptr<I>(), val.data_ptr<T>(), op_, r, w, d, bp ? bp->data_ptr<O>() : nullptr,
                        out.data_ptr<O>(), okp);
  };
  const auto by_out = [&](auto i_tag, auto t_tag) {
    if (ost == at::kDouble) run(i_tag, t_tag, Tag<double>{}, Tag<double>{});
    else if (fits_float) run(i_tag, t_tag, Tag<float>{}, Tag<float>{});
    else run(i_tag, t_tag, Tag<float>{}, Tag<double>{});
  };
  const auto by_val = [&](auto i_tag) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, val.scalar_type(), "sparse_weighted_sum_cpu",
                                    [&] { by_out(i_tag, Tag<scalar_t>{}); });
  };
  if (idx.scalar_type() == at::kInt) by_val(Tag<int32_t>{});
  else by_val(Tag<int64_t>{});
  return {out, ok};
}

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CPU, m) { m.impl("sparse_weighted_sum", &sparse_weighted_sum_cpu); }

}  // namespace fedkernels
