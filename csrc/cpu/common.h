// Shared helpers for the CPU kernels. Light headers only (no torch/extension.h).
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "../checks.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

// Runtime vector dispatch for portable builds. A local source build compiles everything for the
// build machine (-march=native) and FEDKERNELS_SIMD_CLONES is empty. A portable wheel is compiled
// for a baseline (FEDKERNELS_MARCH=x86-64-v2; setup.py then defines FEDKERNELS_DISPATCH) and each
// hot loop marked FEDKERNELS_SIMD_CLONES is also compiled for x86-64-v4 (AVX-512) and x86-64-v3
// (AVX2 + FMA); the loader picks the widest one the CPU supports, once per process (an ifunc), so
// every thread runs the same clone and results stay identical across thread counts.
#if defined(FEDKERNELS_DISPATCH) && defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FEDKERNELS_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FEDKERNELS_SIMD_CLONES
#endif

namespace fedkernels {

// Fixed column chunk for streaming kernels: a chunk of K rows x kChunk columns stays in L2.
constexpr int64_t kChunk = 2048;

// Grain for at::parallel_for over tasks of `work_per_task` elements each: small inputs run on the
// calling thread (waking OpenMP workers costs more than the work below ~64K elements).
inline int64_t grain_for(int64_t work_per_task) {
  constexpr int64_t kMinParallelWork = 1 << 16;
  return std::max<int64_t>(1, kMinParallelWork / std::max<int64_t>(work_per_task, 1));
}

// Reads a small 1-D float tensor (coefficients, weights) into a host double vector.
inline std::vector<double> to_double_vector(const at::Tensor& t) {
  std::vector<double> v(t.numel());
  auto tc = t.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, tc.scalar_type(), "to_double_vector", [&] {
    const scalar_t* p = tc.data_ptr<scalar_t>();
    for (int64_t i = 0; i < tc.numel(); ++i) v[i] = static_cast<double>(p[i]);
  });
  return v;
}

// Reads an optional int64 row-index tensor; checks range [0, K). Empty optional -> 0..K-1.
inline std::vector<int64_t> row_list(const c10::optional<at::Tensor>& rows, int64_t K, const char* op) {
  std::vector<int64_t> r;
  if (!rows.has_value()) {
    r.resize(K);
    for (int64_t i = 0; i < K; ++i) r[i] = i;
    return r;
  }
  auto t = rows->to(at::kLong).contiguous();
  TORCH_CHECK(t.dim() == 1, op, ": rows must be 1-D, got ", t.dim(), "-D");
  const int64_t* p = t.data_ptr<int64_t>();
  r.assign(p, p + t.numel());
  for (int64_t x : r)
    TORCH_CHECK(x >= 0 && x < K, op, ": rows entry ", x, " out of range [0, ", K, ")");
  return r;
}

// True when all len elements of x are finite: x*0 is 0 for finite x and NaN for NaN/Inf, so one
// vectorisable reduction decides (runtime-dispatched to the widest vector ISA in portable builds).
// The NaN/Inf screen of finite_rows and of weighted_sum_screened. Internal linkage: each kernel file
// gets its own copy (and, in portable builds, its own clones), as a file-local function would.
namespace {
template <typename T>
FEDKERNELS_SIMD_CLONES bool finite_span(const T* x, int64_t len) {
  using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
  A acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < len; ++j) acc += A(x[j]) * A(0);
  return acc == A(0);
}
}  // namespace

}  // namespace fedkernels
