// Torch glue of the fedkernels CUDA kernels: TORCH_LIBRARY_IMPL(fedkernels, CUDA, m).
// Built only in the CUDA build (setup.py globs csrc/cuda/*.cpp under CUDAExtension). The kernels
// themselves (csrc/cuda/*.cu) see no torch header; this file checks arguments, allocates outputs
// and workspaces with at::empty on the input's device, and launches on the current stream.
// No op synchronises the host: min_norm returns its iteration count and gap as a device tensor.
//
// Each section follows the schema in csrc/fedkernels.cpp; a section can be left out of a build
// with -DFEDKERNELS_CUDA_NO_<SECTION> (MIN_NORM, GC, LU, BE_STEP). arrowhead_solve has no CUDA kernel.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "kernels.h"

namespace fedkernels {
namespace {

namespace fk = fedkernels::cuda;

fk::DType to_dtype(at::ScalarType s, const char* op, const char* name) {
  switch (s) {
    case at::kHalf: return fk::DType::Float16;
    case at::kBFloat16: return fk::DType::BFloat16;
    case at::kFloat: return fk::DType::Float32;
    case at::kDouble: return fk::DType::Float64;
    default: TORCH_CHECK(false, op, ": ", name, " must be float16, bfloat16, float32 or float64, got ", s);
  }
}

void check_cuda(const at::Tensor& t, const at::Tensor& like, const char* op, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.device() == like.device(), op, ": ", name, " must be on ", like.device(), ", got ",
              t.device());
}

void check_rowmajor(const at::Tensor& U, const char* op) {
  TORCH_CHECK(U.dim() == 2, op, ": U must be 2-D [K, d], got ", U.dim(), "-D");
  TORCH_CHECK(U.size(1) <= 1 || U.stride(1) == 1, op, ": U must have unit column stride (the Python wrapper makes it so)");
  TORCH_CHECK(U.size(0) <= 1 || U.stride(0) >= U.size(1), op, ": U rows must not overlap");
}

int64_t row_stride(const at::Tensor& U) { return U.size(0) > 1 ? U.stride(0) : U.size(1); }

at::Tensor rows_on_device(const c10::optional<at::Tensor>& rows, const at::Tensor& U, const char* op) {
  TORCH_CHECK(rows->dim() == 1, op, ": rows must be 1-D, got ", rows->dim(), "-D");
  TORCH_CHECK(!rows->is_floating_point() && rows->scalar_type() != at::kBool, op, ": rows must hold integer indices");
  // Range [0, K) is checked on the device (a device-side assert), without a host sync.
  return rows->to(U.device(), at::kLong).contiguous();
}

// ---- aggregation core ------------------------------------------------------------------------
at::Tensor gram_cuda(const at::Tensor& U, const c10::optional<at::Tensor>& rows) {
  check_rowmajor(U, "gram");
  c10::cuda::CUDAGuard guard(U.device());
  const int64_t K = U.size(0), d = U.size(1);
  at::Tensor r;
  if (rows.has_value()) r = rows_on_device(rows, U, "gram");
  const int64_t k = rows.has_value() ? r.numel() : K;
  const bool symmetric = !rows.has_value();
  if (k == 0 || K == 0 || d == 0) return at::zeros({k, K}, U.options().dtype(at::kDouble));
  auto G = at::empty({k, K}, U.options().dtype(at::kDouble));
  const size_t wsb = fk::gram_workspace_bytes(k, K, d, symmetric);
  auto ws = at::empty({(int64_t)wsb}, U.options().dtype(at::kByte));
  C10_CUDA_CHECK(fk::gram(U.data_ptr(), to_dtype(U.scalar_type(), "gram", "U"), K, d, row_stride(U),
                          symmetric ? nullptr : r.data_ptr<int64_t>(), k, G.data_ptr<double>(), ws.data_ptr(),
                          at::cuda::getCurrentCUDAStream()));
  return G;
}

void weighted_sum_out_cuda(const at::Tensor& U, const at::Tensor& coef, const c10::optional<at::Tensor>& base,
                           double alpha, const c10::optional<at::Tensor>& rows, at::Tensor out) {
  check_rowmajor(U, "weighted_sum");
  c10::cuda::CUDAGuard guard(U.device());
  const int64_t K = U.size(0), d = U.size(1);
  at::Tensor r;
  if (rows.has_value()) r = rows_on_device(rows, U, "weighted_sum");
  const int64_t n = rows.has_value() ? r.numel() : K;
  TORCH_CHECK(coef.dim() == 1 && coef.numel() == n, "weighted_sum: coef must be 1-D of length ", n,
              " (one per selected row), got shape ", coef.sizes());
  TORCH_CHECK(coef.is_floating_point(), "weighted_sum: coef must be a float tensor");
  TORCH_CHECK(out.dim() == 1 && out.size(0) == d && out.is_contiguous() && out.scalar_type() == U.scalar_type(),
              "weighted_sum: out must be a contiguous 1-D tensor of length ", d, " and dtype ", U.scalar_type());
  check_cuda(out, U, "weighted_sum", "out");
  if (base.has_value()) {
    TORCH_CHECK(base->dim() == 1 && base->size(0) == d && base->is_contiguous() && base->scalar_type() == U.scalar_type(),
                "weighted_sum: base must be a contiguous 1-D tensor of length ", d, " and dtype ", U.scalar_type());
    check_cuda(*base, U, "weighted_sum", "base");
  }
  if (d == 0) return;
  auto c = coef.to(U.device(), at::kDouble).contiguous();
  C10_CUDA_CHECK(fk::weighted_sum(U.data_ptr(), to_dtype(U.scalar_type(), "weighted_sum", "U"), K, d, row_stride(U),
                                  c.data_ptr<double>(), rows.has_value() ? r.data_ptr<int64_t>() : nullptr, n,
                                  base.has_value() ? base->data_ptr() : nullptr, alpha, out.data_ptr(),
                                  at::cuda::getCurrentCUDAStream()));
}

at::Tensor weighted_sum_cuda(const at::Tensor& U, const at::Tensor& coef, const c10::optional<at::Tensor>& base,
                             double alpha, const c10::optional<at::Tensor>& rows) {
  TORCH_CHECK(U.dim() == 2, "weighted_sum: U must be 2-D [K, d], got ", U.dim(), "-D");
  auto out = at::empty({U.size(1)}, U.options());
  weighted_sum_out_cuda(U, coef, base, alpha, rows, out);
  return out;
}

at::Tensor finite_rows_cuda(const at::Tensor& U) {
  check_rowmajor(U, "finite_rows");
  c10::cuda::CUDAGuard guard(U.device());
  auto ok = at::empty({U.size(0)}, U.options().dtype(at::kBool));
  if (U.size(0) == 0) return ok;
  C10_CUDA_CHECK(fk::finite_rows(U.data_ptr(), to_dtype(U.scalar_type(), "finite_rows", "U"), U.size(0), U.size(1),
                                 row_stride(U), ok.data_ptr<bool>(), at::cuda::getCurrentCUDAStream()));
  return ok;
}

#ifndef FEDKERNELS_CUDA_NO_MIN_NORM
// ---- min_norm ----------------------------------------------------------------------------------
// Schema (csrc/fedkernels.cpp): min_norm(Tensor G, int max_iter, float tol_rel, float tol_abs,
// str method, str init, bool polish, Tensor? lam0) -> (lam [K] f64, iterations i64 [], gap f64 [])
// On CUDA: methods fw, away, pairwise; polish=True is rejected for away/pairwise (the face polish
// is host-only) and code_compat is host-only. Outputs stay on the device (no sync); G finiteness
// and lam0 validity are not checked here (that would need a sync): ops.min_norm checks them.
std::tuple<at::Tensor, at::Tensor, at::Tensor> min_norm_cuda(const at::Tensor& G, int64_t max_iter, double tol_rel,
                                                             double tol_abs, c10::string_view method,
                                                             c10::string_view init, bool polish,
                                                             const c10::optional<at::Tensor>& lam0) {
  TORCH_CHECK(G.dim() == 2 && G.size(0) == G.size(1), "min_norm: G must be a square [K, K] matrix, got shape ",
              G.sizes());
  TORCH_CHECK(at::isFloatingType(G.scalar_type()), "min_norm: G must have a floating dtype, got ", G.scalar_type());
  const int64_t N = G.size(0);
  TORCH_CHECK(N >= 1, "min_norm: G must be at least 1 x 1");
  TORCH_CHECK(N <= fk::kMinNormMaxN, "min_norm: the CUDA solver supports K <= ", fk::kMinNormMaxN, ", got ", N);
  TORCH_CHECK(max_iter >= 0, "min_norm: max_iter must be >= 0, got ", max_iter);
  TORCH_CHECK(tol_rel >= 0.0 && tol_abs >= 0.0, "min_norm: tolerances must be >= 0");
  int meth = -1;
  if (method == "fw") meth = 0;
  else if (method == "away") meth = 1;
  else if (method == "pairwise") meth = 2;
  TORCH_CHECK(meth >= 0, "min_norm: method on CUDA must be one of 'away', 'pairwise', 'fw' (code_compat runs on the "
              "CPU), got '", std::string(method), "'");
  TORCH_CHECK(!polish || meth == 0, "min_norm: polish=True is implemented on the CPU only; on CUDA pass polish=False");
  TORCH_CHECK(init == "best_pair" || init == "min_diag", "min_norm: init must be 'best_pair' or 'min_diag', got '",
              std::string(init), "'");
  c10::cuda::CUDAGuard guard(G.device());
  auto g = G.to(at::kDouble).contiguous();
  at::Tensor l0;
  if (lam0.has_value()) {
    TORCH_CHECK(lam0->dim() == 1 && lam0->size(0) == N, "min_norm: lam0 must be a 1-D tensor of length ", N,
                ", got shape ", lam0->sizes());
    check_cuda(*lam0, G, "min_norm", "lam0");
    l0 = lam0->to(at::kDouble).contiguous();
  }
  auto opts = G.options().dtype(at::kDouble);
  auto lam = at::empty({N}, opts);
  auto iters = at::empty({}, opts.dtype(at::kLong));
  auto gap = at::empty({}, opts);
  auto ws = at::empty({(int64_t)fk::min_norm_workspace_bytes(N)}, opts.dtype(at::kByte));
  C10_CUDA_CHECK(fk::min_norm(g.data_ptr<double>(), N, l0.defined() ? l0.data_ptr<double>() : nullptr, meth,
                              init == "min_diag" ? 1 : 0, max_iter, tol_rel, tol_abs, lam.data_ptr<double>(),
                              iters.data_ptr<int64_t>(), gap.data_ptr<double>(), ws.data_ptr(),
                              at::cuda::getCurrentCUDAStream()));
  return {lam, iters, gap};
}
#endif

#ifndef FEDKERNELS_CUDA_NO_GC
// ---- gc_project_ / gc_project --------------------------------------------------------------------
// Schemas: gc_project_(Tensor(a!)[] tensors, str vector_policy="skip", int min_fanin=2) -> ()
//          gc_project(Tensor[] tensors, str vector_policy="skip", int min_fanin=2) -> Tensor[]
// Same rules as csrc/cpu/gc_project.cpp: dim >= 2 -> rows = size(0), M = numel / rows; 1-D ->
// one row with "center", unchanged with "skip"; 0-D, empty and M < min_fanin unchanged. Tensors
// whose rows are not dense spans go through a contiguous copy. One launch per dtype.
bool row_shape(const at::Tensor& t, bool center, int64_t min_fanin, int64_t& rows, int64_t& M) {
  if (t.dim() == 0 || t.numel() == 0) return false;
  if (t.dim() == 1) {
    if (!center) return false;
    rows = 1;
    M = t.numel();
  } else {
    rows = t.size(0);
    M = t.numel() / rows;
  }
  return M >= min_fanin;
}

bool rows_dense(const at::Tensor& t, int64_t rows, int64_t M) {
  if (t.is_contiguous()) return true;
  if (!t.is_non_overlapping_and_dense()) return false;
  return rows == 1 || t.stride(0) == M;
}

bool check_gc_args(at::TensorList tensors, c10::string_view policy, int64_t min_fanin) {
  TORCH_CHECK(policy == "skip" || policy == "center", "gc_project: vector_policy must be 'skip' or 'center', got '",
              std::string(policy), "'");
  TORCH_CHECK(min_fanin >= 1, "gc_project: min_fanin must be >= 1, got ", min_fanin);
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(tensors[i].is_cuda() && tensors[i].device() == tensors[0].device(), "gc_project: tensors[", i,
                "] must be on ", tensors[0].device(), ", got ", tensors[i].device());
    to_dtype(tensors[i].scalar_type(), "gc_project", "tensors");
  }
  return policy == "center";
}

// Launches the planned jobs: one work table and one launch per dtype.
void run_gc(const std::vector<std::pair<fk::DType, fk::GcTensor>>& jobs, c10::Device dev) {
  std::map<int, std::vector<fk::GcTensor>> groups;
  for (const auto& j : jobs) groups[(int)j.first].push_back(j.second);
  auto stream = at::cuda::getCurrentCUDAStream();
  for (auto& kv : groups) {
    const auto& ts = kv.second;
    const int64_t nt = (int64_t)ts.size();
    const int64_t nw = fk::gc_plan(ts.data(), nt, nullptr);
    if (nw == 0) continue;
    const size_t bytes = fk::gc_table_bytes(nt, nw);
    auto host = at::empty({(int64_t)bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    char* h = static_cast<char*>(host.data_ptr());
    std::memcpy(h, ts.data(), ts.size() * sizeof(fk::GcTensor));
    const size_t off = (size_t(nt) * sizeof(fk::GcTensor) + 15) / 16 * 16;
    fk::gc_plan(ts.data(), nt, reinterpret_cast<fk::GcWork*>(h + off));
    auto table = at::empty({(int64_t)bytes}, at::TensorOptions().dtype(at::kByte).device(dev));
    table.copy_(host, /*non_blocking=*/true);  // pinned -> device on the current stream, no host sync
    C10_CUDA_CHECK(fk::gc_project(table.data_ptr(), nt, nw, static_cast<fk::DType>(kv.first), stream));
  }
}

void gc_project_inplace_cuda(at::TensorList tensors, c10::string_view vector_policy, int64_t min_fanin) {
  const bool center = check_gc_args(tensors, vector_policy, min_fanin);
  if (tensors.empty()) return;
  c10::cuda::CUDAGuard guard(tensors[0].device());
  std::vector<std::pair<fk::DType, fk::GcTensor>> jobs;
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back;  // (target, contiguous work copy)
  for (const auto& t : tensors) {
    int64_t rows = 0, M = 0;
    if (!row_shape(t, center, min_fanin, rows, M)) continue;
    const auto dt = to_dtype(t.scalar_type(), "gc_project_", "tensors");
    if (rows_dense(t, rows, M)) {
      jobs.push_back({dt, fk::GcTensor{t.data_ptr(), t.data_ptr(), rows, M}});
    } else {
      auto c = t.contiguous();
      jobs.push_back({dt, fk::GcTensor{c.data_ptr(), c.data_ptr(), rows, M}});
      copy_back.emplace_back(t, c);
    }
  }
  run_gc(jobs, tensors[0].device());
  for (auto& pr : copy_back) pr.first.copy_(pr.second);
}

std::vector<at::Tensor> gc_project_cuda(at::TensorList tensors, c10::string_view vector_policy, int64_t min_fanin) {
  const bool center = check_gc_args(tensors, vector_policy, min_fanin);
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
    if (!row_shape(t, center, min_fanin, rows, M)) {
      out.copy_(t);
      continue;
    }
    const auto dt = to_dtype(t.scalar_type(), "gc_project", "tensors");
    if (rows_dense(t, rows, M) && out.strides() == t.strides()) {
      jobs.push_back({dt, fk::GcTensor{out.data_ptr(), t.data_ptr(), rows, M}});
      continue;
    }
    auto src = t.contiguous();
    keep.push_back(src);
    at::Tensor dst = out.is_contiguous() ? out : at::empty(t.sizes(), t.options());
    if (!dst.is_same(out)) copy_back.emplace_back(out, dst);
    jobs.push_back({dt, fk::GcTensor{dst.data_ptr(), src.data_ptr(), rows, M}});
  }
  run_gc(jobs, tensors[0].device());
  for (auto& pr : copy_back) pr.first.copy_(pr.second);
  return outs;
}
#endif

#ifndef FEDKERNELS_CUDA_NO_LU
// ---- small dense linear algebra ------------------------------------------------------------------
// Schemas: lu_factor(Tensor A) -> (Tensor LU, Tensor pivots, Tensor info)
//   A [n, n] or [B, n, n] float32/float64, n <= 64; pivots int32 [..., n] 1-based; info int32 [...].
// lu_solve(Tensor LU, Tensor pivots, Tensor R) -> Tensor     R [n, m] or [B, n, m] -> X like R.
// Not checked on the device (each would need a host sync): finiteness of A, pivot range (an
// out-of-range pivot is treated as no swap) and zero U diagonals in lu_solve (Inf/NaN result).
std::tuple<at::Tensor, at::Tensor, at::Tensor> lu_factor_cuda(const at::Tensor& A) {
  TORCH_CHECK(A.dim() == 2 || A.dim() == 3, "lu_factor: A must be [n, n] or [B, n, n], got shape ", A.sizes());
  const int64_t n = A.size(-1);
  TORCH_CHECK(A.size(-2) == n, "lu_factor: A must be square, got shape ", A.sizes());
  TORCH_CHECK(n >= 1 && n <= fk::kLuMaxN, "lu_factor: n must be in [1, ", fk::kLuMaxN, "] (small systems), got ", n);
  TORCH_CHECK(A.scalar_type() == at::kFloat || A.scalar_type() == at::kDouble,
              "lu_factor: A must be float32 or float64, got ", A.scalar_type());
  c10::cuda::CUDAGuard guard(A.device());
  const bool batched = A.dim() == 3;
  const int64_t B = batched ? A.size(0) : 1;
  auto a = A.contiguous();
  auto LU = at::empty(A.sizes(), A.options());
  auto piv = at::empty(batched ? std::vector<int64_t>{B, n} : std::vector<int64_t>{n}, A.options().dtype(at::kInt));
  auto info = at::empty(batched ? std::vector<int64_t>{B} : std::vector<int64_t>{}, A.options().dtype(at::kInt));
  if (B == 0) return {LU, piv, info};
  C10_CUDA_CHECK(fk::lu_factor_batched(a.data_ptr(), LU.data_ptr(), to_dtype(a.scalar_type(), "lu_factor", "A"), B, n,
                                       piv.data_ptr<int32_t>(), info.data_ptr<int32_t>(),
                                       at::cuda::getCurrentCUDAStream()));
  return {LU, piv, info};
}

at::Tensor lu_solve_cuda(const at::Tensor& LU, const at::Tensor& pivots, const at::Tensor& R) {
  TORCH_CHECK(LU.dim() == 2 || LU.dim() == 3, "lu_solve: LU must be [n, n] or [B, n, n], got ", LU.sizes());
  const bool batched = LU.dim() == 3;
  const int64_t n = LU.size(-1), B = batched ? LU.size(0) : 1;
  TORCH_CHECK(LU.size(-2) == n, "lu_solve: LU must be square, got ", LU.sizes());
  TORCH_CHECK(n >= 1 && n <= fk::kLuMaxN, "lu_solve: n must be in [1, ", fk::kLuMaxN, "] on CUDA, got ", n);
  TORCH_CHECK(R.dim() == LU.dim() && R.size(-2) == n && (!batched || R.size(0) == B),
              "lu_solve: R must be [n, m] (or [B, n, m] for batched LU) with n = ", n, ", got ", R.sizes());
  TORCH_CHECK(pivots.dim() == LU.dim() - 1 && pivots.size(-1) == n && (!batched || pivots.size(0) == B),
              "lu_solve: pivots must be [n] (or [B, n]), got ", pivots.sizes());
  TORCH_CHECK(R.scalar_type() == at::kFloat || R.scalar_type() == at::kDouble,
              "lu_solve: R must be float32 or float64, got ", R.scalar_type());
  TORCH_CHECK(LU.is_floating_point(), "lu_solve: LU must have a floating dtype, got ", LU.scalar_type());
  check_cuda(pivots, LU, "lu_solve", "pivots");
  check_cuda(R, LU, "lu_solve", "R");
  c10::cuda::CUDAGuard guard(LU.device());
  const int64_t m = R.size(-1);
  auto r = R.contiguous();
  auto X = at::empty(R.sizes(), R.options());
  if (m == 0 || B == 0) return X;
  auto lu = LU.to(at::kDouble).contiguous();
  auto pv = pivots.to(at::kInt).contiguous();
  C10_CUDA_CHECK(fk::lu_solve(lu.data_ptr<double>(), pv.data_ptr<int32_t>(), r.data_ptr(), X.data_ptr(),
                              to_dtype(r.scalar_type(), "lu_solve", "R"), B, n, m, at::cuda::getCurrentCUDAStream()));
  return X;
}
#endif

#ifndef FEDKERNELS_CUDA_NO_BE_STEP
// ---- fedecado_be_step ------------------------------------------------------------------------------
// Schemas: fedecado_be_step(xc, Icur, xc0, U, Ik, S_off?, theta_new, theta_old, inv_g, float dt,
//   float L) -> (x' [d], I' [K, d], lte f64 [2]) and fedecado_be_step_out(..., xc_out, I_out, lte).
// Same rules as csrc/cpu/fedecado_be_step.cpp: fp32/fp64 tensors on one CUDA device; theta_new,
// theta_old, inv_g are host (CPU) float tensors of length K (validated on the host, no sync); the
// coefficient table goes to the device through pinned memory (non-blocking). lte stays on the device.
void be_check_mat(const at::Tensor& m, const at::Tensor& U, const char* name) {
  TORCH_CHECK(m.dim() == 2 && m.size(0) == U.size(0) && m.size(1) == U.size(1), "fedecado_be_step: ", name,
              " must be [K, d] = ", U.sizes(), ", got ", m.sizes());
  TORCH_CHECK(m.size(1) <= 1 || m.stride(1) == 1, "fedecado_be_step: ", name, " must have unit column stride");
  TORCH_CHECK(m.scalar_type() == U.scalar_type(), "fedecado_be_step: ", name, " must have dtype ", U.scalar_type());
  check_cuda(m, U, "fedecado_be_step", name);
}

void be_check_vec(const at::Tensor& v, const at::Tensor& U, const char* name) {
  TORCH_CHECK(v.dim() == 1 && v.size(0) == U.size(1), "fedecado_be_step: ", name, " must be 1-D of length d = ",
              U.size(1), ", got ", v.sizes());
  TORCH_CHECK(v.scalar_type() == U.scalar_type(), "fedecado_be_step: ", name, " must have dtype ", U.scalar_type());
  check_cuda(v, U, "fedecado_be_step", name);
}

void be_step_out_cuda(const at::Tensor& xc, const at::Tensor& Icur, const at::Tensor& xc0, const at::Tensor& U,
                      const at::Tensor& Ik, const c10::optional<at::Tensor>& S_off, const at::Tensor& theta_new,
                      const at::Tensor& theta_old, const at::Tensor& inv_g, double dt, double L, at::Tensor xc_out,
                      at::Tensor I_out, at::Tensor lte) {
  TORCH_CHECK(U.dim() == 2, "fedecado_be_step: U must be 2-D [K, d], got ", U.dim(), "-D");
  TORCH_CHECK(U.is_cuda(), "fedecado_be_step: U must be a CUDA tensor here, got ", U.device());
  TORCH_CHECK(U.scalar_type() == at::kFloat || U.scalar_type() == at::kDouble,
              "fedecado_be_step: U must be float32 or float64, got ", U.scalar_type());
  TORCH_CHECK(U.size(1) <= 1 || U.stride(1) == 1, "fedecado_be_step: U must have unit column stride");
  const int64_t K = U.size(0), d = U.size(1);
  be_check_mat(Icur, U, "Icur");
  be_check_mat(Ik, U, "Ik");
  be_check_mat(I_out, U, "I_out");
  be_check_vec(xc, U, "xc");
  be_check_vec(xc0, U, "xc0");
  be_check_vec(xc_out, U, "xc_out");
  if (S_off.has_value()) be_check_vec(*S_off, U, "S_off");
  TORCH_CHECK(xc_out.is_contiguous() && I_out.is_contiguous(), "fedecado_be_step: xc_out and I_out must be contiguous");
  TORCH_CHECK(lte.dim() == 1 && lte.size(0) == 2 && lte.scalar_type() == at::kDouble && lte.is_contiguous(),
              "fedecado_be_step: lte must be a contiguous float64 tensor of shape [2]");
  check_cuda(lte, U, "fedecado_be_step", "lte");
  TORCH_CHECK(std::isfinite(dt) && dt > 0, "fedecado_be_step: dt must be finite and > 0, got ", dt);
  TORCH_CHECK(std::isfinite(L) && L > 0, "fedecado_be_step: L must be finite and > 0, got ", L);
  for (const at::Tensor* t : {&theta_new, &theta_old, &inv_g})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == K && t->is_floating_point() && t->device().is_cpu(),
                "fedecado_be_step: theta_new, theta_old and inv_g must be 1-D float CPU (host) tensors of length K = ",
                K, ", got shape ", t->sizes(), " on ", t->device());
  auto thn = theta_new.to(at::kDouble).contiguous(), tho = theta_old.to(at::kDouble).contiguous();
  auto igc = inv_g.to(at::kDouble).contiguous();
  const double *pn = thn.data_ptr<double>(), *po = tho.data_ptr<double>(), *pg = igc.data_ptr<double>();
  const double c = dt / L;
  auto host = at::empty({std::max<int64_t>(4 * K, 1)}, at::TensorOptions().dtype(at::kDouble).pinned_memory(true));
  double* h = host.data_ptr<double>();
  double s = 0.0;
  for (int64_t i = 0; i < K; ++i) {
    TORCH_CHECK(std::isfinite(pn[i]) && std::isfinite(po[i]), "fedecado_be_step: theta_new[", i, "] and theta_old[", i,
                "] must be finite");
    TORCH_CHECK(std::isfinite(pg[i]) && pg[i] >= 0, "fedecado_be_step: inv_g[", i, "] = ", pg[i],
                " must be finite and >= 0");
    h[i] = pn[i];
    h[K + i] = pn[i] - po[i];
    h[2 * K + i] = pg[i];
    h[3 * K + i] = 1.0 / (1.0 + c * pg[i]);
    s += h[3 * K + i];
  }
  c10::cuda::CUDAGuard guard(U.device());
  auto coef = at::empty({host.numel()}, U.options().dtype(at::kDouble));
  coef.copy_(host, /*non_blocking=*/true);
  auto xcc = xc.contiguous(), xc0c = xc0.contiguous();
  at::Tensor Sc;
  if (S_off.has_value()) Sc = S_off->contiguous();
  const int64_t ld_i = K > 1 ? Icur.stride(0) : d, ld_u = K > 1 ? U.stride(0) : d, ld_k = K > 1 ? Ik.stride(0) : d;
  C10_CUDA_CHECK(fk::fedecado_be_step(xcc.data_ptr(), Icur.data_ptr(), ld_i, xc0c.data_ptr(), U.data_ptr(), ld_u,
                                      Ik.data_ptr(), ld_k, Sc.defined() ? Sc.data_ptr() : nullptr,
                                      coef.data_ptr<double>(), K, d, c, dt, 1.0 / (1.0 + dt * c * s), 0.5 * dt,
                                      0.5 * dt / L, xc_out.data_ptr(), I_out.data_ptr(), lte.data_ptr<double>(),
                                      to_dtype(U.scalar_type(), "fedecado_be_step", "U"),
                                      at::cuda::getCurrentCUDAStream()));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> be_step_cuda(const at::Tensor& xc, const at::Tensor& Icur,
                                                            const at::Tensor& xc0, const at::Tensor& U,
                                                            const at::Tensor& Ik, const c10::optional<at::Tensor>& S_off,
                                                            const at::Tensor& theta_new, const at::Tensor& theta_old,
                                                            const at::Tensor& inv_g, double dt, double L) {
  TORCH_CHECK(U.dim() == 2, "fedecado_be_step: U must be 2-D [K, d], got ", U.dim(), "-D");
  c10::cuda::CUDAGuard guard(U.device());
  auto xo = at::empty({U.size(1)}, U.options());
  auto Io = at::empty({U.size(0), U.size(1)}, U.options());
  auto lte = at::empty({2}, U.options().dtype(at::kDouble));
  be_step_out_cuda(xc, Icur, xc0, U, Ik, S_off, theta_new, theta_old, inv_g, dt, L, xo, Io, lte);
  return {xo, Io, lte};
}
#endif

}  // namespace

TORCH_LIBRARY_IMPL(fedkernels, CUDA, m) {
  m.impl("gram", &gram_cuda);
  m.impl("weighted_sum", &weighted_sum_cuda);
  m.impl("weighted_sum_out", &weighted_sum_out_cuda);
  m.impl("finite_rows", &finite_rows_cuda);
#ifndef FEDKERNELS_CUDA_NO_MIN_NORM
  m.impl("min_norm", &min_norm_cuda);
#endif
#ifndef FEDKERNELS_CUDA_NO_GC
  m.impl("gc_project_", &gc_project_inplace_cuda);
  m.impl("gc_project", &gc_project_cuda);
#endif
#ifndef FEDKERNELS_CUDA_NO_LU
  m.impl("lu_factor", &lu_factor_cuda);
  m.impl("lu_solve", &lu_solve_cuda);
#endif
#ifndef FEDKERNELS_CUDA_NO_BE_STEP
  m.impl("fedecado_be_step", &be_step_cuda);
  m.impl("fedecado_be_step_out", &be_step_out_cuda);
#endif
}

}  // namespace fedkernels
