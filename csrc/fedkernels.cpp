// fedkernels op schemas and build facts. This is the only translation unit that includes
// torch/extension.h (pybind11); the kernel files in cpu/ and cuda/ include only ATen headers.
#include <torch/extension.h>
#include <torch/library.h>

#include <dlfcn.h>

#include <locale>

#include "lu_limits.h"

TORCH_LIBRARY(fedkernels, m) {
  // ---- aggregation core (gram, weighted_sum) ----------------------------------------------
  // G = U[rows] @ U^T with float64 accumulation and a fixed reduction order: [k or K, K] fp64.
  // U: [K, d] with unit column stride (any row stride, so a column chunk U[:, a:b] is a view).
  m.def("gram(Tensor U, Tensor? rows=None) -> Tensor");
  // out = base + alpha * sum_i coef[i] * U[rows[i]]  (rows defaults to all K rows).
  // out may alias base (in-place apply). coef: float tensor of len(rows) (read as float64).
  m.def("weighted_sum(Tensor U, Tensor coef, Tensor? base=None, float alpha=1.0, Tensor? rows=None) -> Tensor");
  m.def("weighted_sum_out(Tensor U, Tensor coef, Tensor? base, float alpha, Tensor? rows, Tensor(a!) out) -> ()");
  // weighted_sum and, from the same pass, ok[i] = all(isfinite(U[rows[i]])) (the NaN/Inf screen)
  m.def("weighted_sum_screened(Tensor U, Tensor coef, Tensor? base=None, float alpha=1.0, Tensor? rows=None) -> (Tensor, Tensor)");
  // the same into a caller's out (may alias base), returning ok
  m.def("weighted_sum_screened_out(Tensor U, Tensor coef, Tensor? base, float alpha, Tensor? rows, Tensor(a!) out) -> Tensor");
  // Kuramoto's phase statistics in one pass (no K x K Gram): mean = sum_k p[k] U[k] (fp64), then
  // dot[k] = <U[k], mean>, nsq[k] = ||U[k]||^2, nbar = ||mean||^2 (fp64, fixed order) and ok[k] =
  // all(isfinite(U[k])) from the same pass. p: [K] float (read as float64). -> (dot, nsq, nbar [], ok).
  m.def("kstats(Tensor U, Tensor p) -> (Tensor, Tensor, Tensor, Tensor)");
  // ok[k] = all(isfinite(U[k])): [K] bool, one read of U (bad-update screening).
  m.def("finite_rows(Tensor U) -> Tensor");

  // ---- min-norm solver (FedAWARE) -------------------------------------------------------------
  // lam = argmin_{lam in simplex} lam^T G lam on the symmetrised G (fp64). method: away | pairwise
  // | fw | code_compat; init: best_pair | min_diag; polish: face solves (away/pairwise); lam0: warm start;
  // scale s (optional, [K] > 0): solve on s_i s_j (G + G^T)/2 instead (FedAWARE's normalised Gram).
  // Returns (lam [K] f64, iterations i64 [], gap f64 []).
  m.def("min_norm(Tensor G, int max_iter=1000, float tol_rel=1e-12, float tol_abs=1e-15, str method=\"away\", str init=\"best_pair\", bool polish=True, Tensor? lam0=None, Tensor? scale=None) -> (Tensor, Tensor, Tensor)");

  // ---- small dense linear algebra (FedECADO) --------------------------------------------------
  // Partial-pivoting LU of A [n, n] or [B, n, n] (n <= 64), LAPACK getf2 semantics:
  // (LU, pivots int32 1-based, info int32: first zero pivot (1-based) or 0).
  m.def("lu_factor(Tensor A) -> (Tensor, Tensor, Tensor)");
  // X = A^{-1} R from lu_factor's (LU, pivots); R [n, m] or [B, n, m], streamed over the m columns.
  m.def("lu_solve(Tensor LU, Tensor pivots, Tensor R) -> Tensor");
  m.def("lu_solve_out(Tensor LU, Tensor pivots, Tensor R, Tensor(a!) out) -> ()");
  // [[alpha, b^T], [c, diag(a)]] [x; I] = [r0; R] per column (Schur complement on x): (x [m], I [K, m]).
  m.def("arrowhead_solve(Tensor a, Tensor b, Tensor c, float alpha, Tensor r0, Tensor R) -> (Tensor, Tensor)");
  // One fused FedECADO backward-Euler attempt (fedecado.md §2.6/§2.7/§5.3(a)), one pass over d:
  // U = x_end - xc0 [K, d]; theta_new/theta_old/inv_g: [K] host (CPU) coefficients (inv_g >= 0).
  // Returns (x_c' [d], I' [K, d], lte f64 [2] = (LTE_c, LTE_I), inf-norm, NaN -> +inf).
  // The _out variant writes into caller buffers, which must not overlap the inputs.
  m.def("fedecado_be_step(Tensor xc, Tensor Icur, Tensor xc0, Tensor U, Tensor Ik, Tensor? S_off, Tensor theta_new, "
        "Tensor theta_old, Tensor inv_g, float dt, float L) -> (Tensor, Tensor, Tensor)");
  m.def("fedecado_be_step_out(Tensor xc, Tensor Icur, Tensor xc0, Tensor U, Tensor Ik, Tensor? S_off, "
        "Tensor theta_new, Tensor theta_old, Tensor inv_g, float dt, float L, Tensor(a!) xc_out, Tensor(b!) I_out, "
        "Tensor(c!) lte) -> ()");

  // ---- gradient centralization (GC-Fed) -------------------------------------------------------
  // Every output-channel row (dim 0) of every tensor has its mean over the other dims removed, in one
  // call. 1-D tensors: "skip" or "center" (one row); 0-D/empty tensors and rows shorter than
  // min_fanin are unchanged. fp32 accumulation (fp64 for fp64). Any layout; mixed dtypes allowed.
  m.def("gc_project_(Tensor(a!)[] tensors, str vector_policy=\"skip\", int min_fanin=2) -> ()");
  m.def("gc_project(Tensor[] tensors, str vector_policy=\"skip\", int min_fanin=2) -> Tensor[]");


  // ---- fused local steps (SCAFFOLD, FedPVR, Local GC) ----------------------------------------
  // One SGD step over a list of tensors in one pass, torch.optim.SGD semantics (dampening 0):
  //   d = GC(g) [gc_mask] + c_add - c_sub [per tensor, where given] + weight_decay * p
  //   buf = d (first_step) or momentum * buf + d [momentum != 0];  p -= lr * buf (lr * d)
  // c_add / c_sub / gc_mask: empty (none) or one entry per parameter. grads are not modified.
  m.def("fused_sgd_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_bufs, Tensor?[] c_add, "
        "Tensor?[] c_sub, bool[] gc_mask, float lr, float momentum, float weight_decay, bool first_step, "
        "str vector_policy=\"skip\", int min_fanin=2) -> ()");


  // ---- end of schemas ---------------------------------------------------------------------------
}

namespace {
// How this extension reaches libstdc++ (see fedkernels/_toolchain.py): "static" when std::locale's
// code lives in this very file (a private copy linked in by a compiler without libstdc++.so, whose
// locale is never initialised: the first C++ error message crashes), else "shared"; libstdcxx_path
// names the file that provides it. setup.py refuses to produce a "static" build.
void libstdcxx_facts(pybind11::dict& d) {
  Dl_info self{}, lib{};
  const std::locale& (*classic)() = &std::locale::classic;
  if (dladdr(reinterpret_cast<void*>(&libstdcxx_facts), &self) != 0 &&
      dladdr(reinterpret_cast<void*>(classic), &lib) != 0 && lib.dli_fname != nullptr) {
    d["libstdcxx"] = self.dli_fbase == lib.dli_fbase ? "static" : "shared";
    d["libstdcxx_path"] = lib.dli_fname;
  } else {
    d["libstdcxx"] = "unknown";
  }
}

pybind11::dict build_info() {
  pybind11::dict d;
  // The compiler command setup.py chose (its guard: $CXX, else the system compiler) and its version.
#ifdef FEDKERNELS_CXX
  d["cxx"] = FEDKERNELS_CXX;
#else
  d["cxx"] = "unknown";
#endif
  d["cxx_version"] = __VERSION__;
  libstdcxx_facts(d);
#ifdef FEDKERNELS_WITH_CUDA
  d["cuda"] = true;
#else
  d["cuda"] = false;
#endif
#ifdef _OPENMP
  d["openmp"] = true;
  d["openmp_version"] = _OPENMP;
#else
  d["openmp"] = false;
#endif
  d["torch_version"] = std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) +
                       "." + std::to_string(TORCH_VERSION_PATCH);
#ifdef __AVX512F__
  d["simd"] = "avx512";
#elif defined(__AVX2__)
  d["simd"] = "avx2";
#else
  d["simd"] = "baseline";
#endif
#define FK_STR2(x) #x
#define FK_STR(x) FK_STR2(x)
#ifdef FEDKERNELS_MARCH_NAME
  d["march"] = FK_STR(FEDKERNELS_MARCH_NAME);
#else
  d["march"] = "unknown";
#endif
  // Which clone of the hot loops runs here (portable builds pick one per process at load time).
#if defined(FEDKERNELS_DISPATCH) && defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  __builtin_cpu_init();
  d["simd_dispatch"] = __builtin_cpu_supports("x86-64-v4")   ? "x86-64-v4"
                       : __builtin_cpu_supports("x86-64-v3") ? "x86-64-v3"
                                                             : "default";
#else
  d["simd_dispatch"] = "none";
#endif
  // Op limits defined once in C++ and read by the Python wrappers (fedkernels.ops.lu.LU_MAX_N).
  d["lu_max_n"] = fedkernels::kLuMaxN;
  return d;
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fedkernels native ops (registered under torch.ops.fedkernels)";
  m.def("build_info", &build_info,
        "Build facts: CUDA compiled, OpenMP, torch version, SIMD level, C++ compiler and libstdc++ linkage, "
        "op size limits (lu_max_n)");
}
