// gc_project_ / gc_project: gradient centralization of many tensors in one call.
//
// For each tensor X of shape (d0, d1, ..., dn), every output-channel row X[i] (dim 0, M = numel/d0
// elements) has its mean removed: X[i] -= mean(X[i]). 1-D tensors are skipped ("skip") or centred
// as one row ("center"); 0-D and empty tensors and rows with M < min_fanin are left unchanged.
//
// Work plan: all rows of all tensors go into one work list of (tensor, row range) items of roughly
// equal size, processed by at::parallel_for, so one call balances a 25088-wide classifier against
// 27-wide first-conv rows. A row is read once for its sum and re-read from cache (L1/L2: a 25088-wide
// fp32 row is 100 KB) for the subtract, so DRAM traffic is 2*N*s bytes. Sums accumulate in fp32
// (fp64 for fp64 inputs; fp16/bf16 read as fp32), one rounding on the write. Every row is reduced by
// one thread in a fixed order: results are bitwise identical for any number of threads.
//
// Layouts: a tensor whose rows are dense spans (contiguous, channels-last, any non-overlapping dense
// layout with dim 0 outermost) is processed where it lies (the mean does not depend on element order);
// anything else (slices, transposed views) goes through a contiguous copy and is copied back.
#include "common.h"
#include "../gc_project_checks.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <string>

namespace fedkernels {
namespace {

template <typename T> struct GcAcc { using type = float; };
template <> struct GcAcc<double> { using type = double; };

// Sum of a row in a fixed order: kLanes independent partial sums (several vector accumulators, so
// the reduction runs at load throughput instead of add latency), then the partials in lane order.
template <typename T>
inline typename GcAcc<T>::type row_sum(const T* __restrict__ x, int64_t M) {
  using A = typename GcAcc<T>::type;
  constexpr int64_t L = 128 / sizeof(A);  // 32 floats / 16 doubles: four 256-bit accumulators
  alignas(64) A part[L];
  for (int64_t l = 0; l < L; ++l) part[l] = A(0);
  int64_t j = 0;
  for (; j + L <= M; j += L) {
#pragma omp simd aligned(part : 64)
    for (int64_t l = 0; l < L; ++l) part[l] += static_cast<A>(x[j + l]);
  }
  for (int64_t l = 0; j + l < M; ++l) part[l] += static_cast<A>(x[j + l]);
  A s = A(0);
  for (int64_t l = 0; l < L; ++l) s += part[l];
  return s;
}

// dst[j] = src[j] - mean(src) for one row of M elements (dst may equal src).
template <typename T>
inline void gc_row(const T* src, T* dst, int64_t M) {
  using A = typename GcAcc<T>::type;
  const A mean = row_sum<T>(src, M) / static_cast<A>(M);
#pragma omp simd
  for (int64_t j = 0; j < M; ++j) dst[j] = static_cast<T>(static_cast<A>(src[j]) - mean);
}

// Rows [r0, r1): runtime-dispatched to the widest vector ISA in portable builds.
template <typename T>
FEDKERNELS_SIMD_CLONES void gc_rows(const void* src, void* dst, int64_t r0, int64_t r1, int64_t M) {
  const T* s = static_cast<const T*>(src);
  T* d = static_cast<T*>(dst);
  for (int64_t r = r0; r < r1; ++r) gc_row<T>(s + r * M, d + r * M, M);
}

// One tensor to centralize: rows x M elements, row r at src + r*M (dense), written to dst + r*M.
struct Job {
  const void* src;
  void* dst;
  int64_t rows, M;
  at::ScalarType dtype;
};

struct Item {
  int64_t job, r0, r1;
};

void run_rows(const Job& j, int64_t r0, int64_t r1) {
  switch (j.dtype) {
    case at::kFloat: gc_rows<float>(j.src, j.dst, r0, r1, j.M); break;
    case at::kDouble: gc_rows<double>(j.src, j.dst, r0, r1, j.M); break;
    case at::kBFloat16: gc_rows<c10::BFloat16>(j.src, j.dst, r0, r1, j.M); break;
    case at::kHalf: gc_rows<c10::Half>(j.src, j.dst, r0, r1, j.M); break;
    default: TORCH_CHECK(false, "gc_project: unsupported dtype ", j.dtype);
  }
}

void run_jobs(const std::vector<Job>& jobs) {
  int64_t total = 0;
  for (const auto& j : jobs) total += j.rows * j.M;
  if (total == 0) return;
  // Items of about `target` elements (never splitting a row): enough items to balance the threads.
  const int64_t nt = std::max<int64_t>(1, at::get_num_threads());
  const int64_t target = std::max<int64_t>(4096, total / (nt * 8));
  std::vector<Item> items;
  for (int64_t k = 0; k < (int64_t)jobs.size(); ++k) {
    const int64_t per = std::max<int64_t>(1, target / jobs[k].M);
    for (int64_t r = 0; r < jobs[k].rows; r += per) items.push_back({k, r, std::min(jobs[k].rows, r + per)});
  }
  const int64_t n = (int64_t)items.size();
  // Small calls (the per-step Local GC of a small model) run inline: no thread wake-up.
  const int64_t grain = total < (1 << 15) ? n : 1;
  at::parallel_for(0, n, grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) run_rows(jobs[items[i].job], items[i].r0, items[i].r1);
  });
}

void gc_project_inplace_cpu(at::TensorList tensors, c10::string_view vector_policy, int64_t min_fanin) {
  const bool center = checks::gc_args(tensors, vector_policy, min_fanin, "gc_project_");
  std::vector<Job> jobs;
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back;  // (target, contiguous work copy)
  jobs.reserve(tensors.size());
  for (const auto& t : tensors) {
    int64_t rows = 0, M = 0;
    if (!checks::gc_row_shape(t, center, min_fanin, rows, M)) continue;
    if (checks::gc_rows_dense(t, rows, M)) {
      jobs.push_back({t.data_ptr(), t.data_ptr(), rows, M, t.scalar_type()});
    } else {
      auto c = t.contiguous();
      jobs.push_back({c.data_ptr(), c.data_ptr(), rows, M, t.scalar_type()});
      copy_back.emplace_back(t, c);
    }
  }
  run_jobs(jobs);
  for (auto& pr : copy_back) pr.first.copy_(pr.second);
}

std::vector<at::Tensor> gc_project_cpu(at::TensorList tensors, c10::string_view vector_policy, int64_t min_fanin) {
  const bool center = checks::gc_args(tensors, vector_policy, min_fanin, "gc_project");
  std::vector<at::Tensor> outs;
  outs.reserve(tensors.size());
  std::vector<Job> jobs;
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back;  // (output, contiguous result)
  std::vector<at::Tensor> keep;                             // contiguous input copies alive until run
  for (const auto& t : tensors) {
    at::Tensor out = at::empty_like(t);  // same layout as t for dense t (what the fake kernel returns)
    outs.push_back(out);
    int64_t rows = 0, M = 0;
    if (!checks::gc_row_shape(t, center, min_fanin, rows, M)) {
      out.copy_(t);
      continue;
    }
    if (checks::gc_rows_dense(t, rows, M) && out.strides() == t.strides()) {
      jobs.push_back({t.data_ptr(), out.data_ptr(), rows, M, t.scalar_type()});
      continue;
    }
    auto src = t.contiguous();
    keep.push_back(src);
    at::Tensor dst = out.is_contiguous() ? out : at::empty(t.sizes(), t.options());
    if (!dst.is_same(out)) copy_back.emplace_back(out, dst);
    jobs.push_back({src.data_ptr(), dst.data_ptr(), rows, M, t.scalar_type()});
  }
  run_jobs(jobs);
  for (auto& pr : copy_back) pr.first.copy_(pr.second);
  return outs;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fedkernels, m) {
  // Every output-channel row (dim 0) of every tensor has its mean over the other dims removed, in one
  // call. 1-D tensors: "skip" or "center" (one row); 0-D/empty tensors and rows shorter than
  // min_fanin are unchanged. fp32 accumulation (fp64 for fp64). Any layout; mixed dtypes allowed.
  m.def("gc_project_(Tensor(a!)[] tensors, str vector_policy=\"skip\", int min_fanin=2) -> ()");
  m.def("gc_project(Tensor[] tensors, str vector_policy=\"skip\", int min_fanin=2) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(fedkernels, CPU, m) {
  m.impl("gc_project_", &gc_project_inplace_cpu);
  m.impl("gc_project", &gc_project_cpu);
}

}  // namespace fedkernels
