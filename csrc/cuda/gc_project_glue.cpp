// Torch glue of gc_project_ / gc_project (kernel: gc_project.cu).
#include <ATen/ops/empty_like.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "glue.h"
#include "gc_project.cuh"
#include "../gc_project_checks.h"

namespace fedkernels {
namespace {

using namespace glue;

// ---- gc_project_ / gc_project --------------------------------------------------------------------
// Schemas: gc_project_(Tensor(a!)[] tensors, str vector_policy="skip", int min_fanin=2) -> ()
//          gc_project(Tensor[] tensors, str vector_policy="skip", int min_fanin=2) -> Tensor[]
// Same rules as csrc/cpu/gc_project.cpp: dim >= 2 -> rows = size(0), M = numel / rows; 1-D ->
// one row with "center", unchanged with "skip"; 0-D, empty and M < min_fanin unchanged. Tensors
// whose rows are not dense spans go through a contiguous copy. One launch per dtype. Arguments:
// checks::gc_args (csrc/gc_project_checks.h).

// Launches the planned jobs: one work table and one launch per dtype.
void run_gc(const std::vector<std::pair<fk::DType, fk::GcTensor>>& jobs, c10::Device dev) {
  std::map<int, std::vector<fk::GcTensor>> groups;
  for (const auto& j : jobs) groups[(int)j.first].push_back(j.second);
  for (auto& kv : groups) {
    const auto& ts = kv.second;
    const int64_t nt = (int64_t)ts.size();
    std::vector<fk::GcTensor> table = ts;
    const int64_t nw = fk::gc_plan(table.data(), nt);
    if (nw == 0) continue;
    // one 48-byte entry per tensor, uploaded as kernel arguments: capture-safe, no pinned memory
    auto dev_table = upload_bytes(table.data(), table.size() * sizeof(fk::GcTensor), dev);
    C10_CUDA_CHECK(fk::gc_project(static_cast<const fk::GcTensor*>(dev_table.data_ptr()), nt, nw,
                                  static_cast<fk::DType>(kv.first), stream()));
  }
}

void gc_project_inplace_cuda(at::TensorList tensors, c10::string_view vector_policy, int64_t min_fanin) {
  const bool center = checks::gc_args(tensors, vector_policy, min_fanin, "gc_project_");
  if (tensors.empty()) return;
  c10::cuda::CUDAGuard guard(tensors[0].device());
  std::vector<std::pair<fk::DType, fk::GcTensor>> jobs;
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back;  // (target, contiguous work copy)
  for (const auto& t : tensors) {
    int64_t rows = 0, M = 0;
    if (!checks::gc_row_shape(t, center, min_fanin, rows, M)) continue;
    const auto dt = to_dtype(t.scalar_type(), "gc_project_", "tensors");
    if (checks::gc_rows_dense(t, rows, M)) {
      jobs.push_back({dt, fk::GcTensor{t.data_ptr(), t.data_ptr(), rows, M, 0, 0, 0}});
    } else {
      auto c = t.contiguous();
      jobs.push_back({dt, fk::GcTensor{c.data_ptr(), c.data_ptr(), rows, M, 0, 0, 0}});
      copy_back.emplace_back(t, c);
    }
  }
  run_gc(jobs, tensors[0].device());
  for (auto& pr : copy_back) pr.first.copy_(pr.second);
}

std::vector<at::Tensor> gc_project_cuda(at::TensorList tensors, c10::string_view vector_policy, int64_t min_fanin) {
  const bool center = checks::gc_args(tensors, vector_policy, min_fanin, "gc_project");
  std::vector<at::Tensor> outs;
  if (tensors.empty()) return outs;
  c10::cuda::CUDAGuard guard(tensors[0].device());
  std::vector<std::pair<fk::DType, fk::GcTensor>> jobs;
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back;  // (output, contiguous result)
  std::vector<at::Tensor> keep;                             // contiguous input copies alive until launch
  for (const auto& t : tensors) {
    at::Tensor out = at::empty_like(t);
    outs.push_back(out);
    int64_t rows = 0, M = 0;
    if (!checks::gc_row_shape(t, center, min_fanin, rows, M)) {
      out.copy_(t);
      continue;
    }
    const auto dt = to_dtype(t.scalar_type(), "gc_project", "tensors");
    if (checks::gc_rows_dense(t, rows, M) && out.strides() == t.strides()) {
      jobs.push_back({dt, fk::GcTensor{out.data_ptr(), t.data_ptr(), rows, M, 0, 0, 0}});
      continue;
    }
    auto src = t.contiguous();
    keep.push_back(src);
    at::Tensor dst = out.is_contiguous() ? out : at::empty(t.sizes(), t.options());
    if (!dst.is_same(out)) copy_back.emplace_back(out, dst);
    jobs.push_back({dt, fk::GcTensor{dst.data_ptr(), src.data_ptr(), rows, M, 0, 0, 0}});
  }
  run_gc(jobs, tensors[0].device());
  for (auto& pr : copy_back) pr.first.copy_(pr.second);
  return outs;
}
}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CUDA, m) {
  m.impl("gc_project_", &gc_project_inplace_cuda);
  m.impl("gc_project", &gc_project_cuda);
}

}  // namespace fedkernels
