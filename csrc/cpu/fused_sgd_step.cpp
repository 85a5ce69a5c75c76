// fused_sgd_step_: one pass per local SGD step over a list of parameters (SCAFFOLD, FedPVR, Local GC).
//
// Per tensor i, elementwise (torch.optim.SGD semantics, dampening 0, no Nesterov):
//   d   = GC_i(g) + c_add[i] - c_sub[i] + wd * p     (GC_i only where gc_mask[i]; c_* only where given)
//   buf = d (first step) or momentum * buf + d        (only when momentum != 0)
//   p  -= lr * buf                                    (lr * d without momentum)
// GC_i(g) removes each output-channel row's mean from g (as gc_project_, same policies); g is not
// modified. SCAFFOLD/FedPVR: c_add = c (server), c_sub = c_i (client), or c_add = c - c_i precomputed.
//
// Bytes per element: read p, g (+ c, c_i) (+ buf), write p (+ buf): 5 N s for the Local GC + momentum
// step, 7 N s for the SCAFFOLD step with c and c_i, against 13-17 N s for the _foreach composition.
// Arithmetic in fp32 (fp64 for fp64 parameters); every tensor in a group (p, g, buf, c, c_i) has the
// parameter's dtype and shape and is contiguous (the Python wrapper makes it so; checked once in
// csrc/fused_sgd_step_checks.h). Work is split into
// items of whole rows (GC tensors) or element chunks over all tensors of the list.
#include "common.h"
#include "../fused_sgd_step_checks.h"

#include <algorithm>
#include <string>

namespace fedkernels {
namespace {

template <typename T> struct StepAcc { using type = float; };
template <> struct StepAcc<double> { using type = double; };

struct StepJob {
  void* p;
  const void* g;
  void* buf;
  const void* cadd;
  const void* csub;
  int64_t rows, M;  // GC tensors: rows x M; others: 1 x numel (no row structure needed)
  bool gc;
  at::ScalarType dtype;
};

struct StepArgs {
  double lr, mu, wd;
  bool first;
};

template <typename T, bool ADD, bool SUB, bool MOM, bool FIRST>
inline void step_span(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ buf, const T* __restrict__ ca,
                      const T* __restrict__ cs, int64_t n, typename StepAcc<T>::type shift, const StepArgs& a) {
  using A = typename StepAcc<T>::type;
  const A lr = A(a.lr), mu = A(a.mu), wd = A(a.wd);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const A pj = static_cast<A>(p[j]);
    A d = static_cast<A>(g[j]) - shift + wd * pj;
    if constexpr (ADD) d += static_cast<A>(ca[j]);
    if constexpr (SUB) d -= static_cast<A>(cs[j]);
    if constexpr (MOM) {
      if constexpr (!FIRST) d = mu * static_cast<A>(buf[j]) + d;
      buf[j] = static_cast<T>(d);
    }
    p[j] = static_cast<T>(pj - lr * d);
  }
}

// Runtime-dispatched to the widest vector ISA in portable builds (step_span is inlined into it).
template <typename T, bool ADD, bool SUB, bool MOM, bool FIRST>
FEDKERNELS_SIMD_CLONES void step_item(const StepJob& jb, int64_t r0, int64_t r1, const StepArgs& a) {
  using A = typename StepAcc<T>::type;
  T* p = static_cast<T*>(jb.p);
  const T* g = static_cast<const T*>(jb.g);
  T* buf = static_cast<T*>(jb.buf);
  const T* ca = static_cast<const T*>(jb.cadd);
  const T* cs = static_cast<const T*>(jb.csub);
  if (!jb.gc) {  // r0..r1 is an element range
    const int64_t n = r1 - r0;
    step_span<T, ADD, SUB, MOM, FIRST>(p + r0, g + r0, MOM ? buf + r0 : nullptr, ADD ? ca + r0 : nullptr,
                                       SUB ? cs + r0 : nullptr, n, A(0), a);
    return;
  }
  const int64_t M = jb.M;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t o = r * M;
    const T* gr = g + o;
    A s = A(0);
#pragma omp simd reduction(+ : s)
    for (int64_t j = 0; j < M; ++j) s += static_cast<A>(gr[j]);
    const A mean = s / static_cast<A>(M);
    step_span<T, ADD, SUB, MOM, FIRST>(p + o, gr, MOM ? buf + o : nullptr, ADD ? ca + o : nullptr,
                                       SUB ? cs + o : nullptr, M, mean, a);
  }
}

template <typename T>
void step_dispatch(const StepJob& jb, int64_t r0, int64_t r1, const StepArgs& a) {
  const bool add = jb.cadd != nullptr, sub = jb.csub != nullptr, mom = jb.buf != nullptr;
  const int key = (add ? 8 : 0) | (sub ? 4 : 0) | (mom ? 2 : 0) | (a.first ? 1 : 0);
#define FK_STEP_CASE(K, A_, S_, M_, F_) \
  case K: step_item<T, A_, S_, M_, F_>(jb, r0, r1, a); break;
  switch (key) {
    FK_STEP_CASE(0, false, false, false, false)
    FK_STEP_CASE(1, false, false, false, true)
    FK_STEP_CASE(2, false, false, true, false)
    FK_STEP_CASE(3, false, false, true, true)
    FK_STEP_CASE(4, false, true, false, false)
    FK_STEP_CASE(5, false, true, false, true)
    FK_STEP_CASE(6, false, true, true, false)
    FK_STEP_CASE(7, false, true, true, true)
    FK_STEP_CASE(8, true, false, false, false)
    FK_STEP_CASE(9, true, false, false, true)
    FK_STEP_CASE(10, true, false, true, false)
    FK_STEP_CASE(11, true, false, true, true)
    FK_STEP_CASE(12, true, true, false, false)
    FK_STEP_CASE(13, true, true, false, true)
    FK_STEP_CASE(14, true, true, true, false)
    FK_STEP_CASE(15, true, true, true, true)
  }
#undef FK_STEP_CASE
}

void run_item(const StepJob& jb, int64_t r0, int64_t r1, const StepArgs& a) {
  switch (jb.dtype) {
    case at::kFloat: step_dispatch<float>(jb, r0, r1, a); break;
    case at::kDouble: step_dispatch<double>(jb, r0, r1, a); break;
    case at::kBFloat16: step_dispatch<c10::BFloat16>(jb, r0, r1, a); break;
    case at::kHalf: step_dispatch<c10::Half>(jb, r0, r1, a); break;
    default: TORCH_CHECK(false, "fused_sgd_step_: unsupported dtype ", jb.dtype);
  }
}

void fused_sgd_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList momentum_bufs,
                        const c10::List<c10::optional<at::Tensor>>& c_add,
                        const c10::List<c10::optional<at::Tensor>>& c_sub, const c10::List<bool>& gc_mask, double lr,
                        double momentum, double weight_decay, bool first_step, c10::string_view vector_policy,
                        int64_t min_fanin) {
  checks::fused_step_args(params, grads, momentum_bufs, c_add, c_sub, gc_mask, momentum, vector_policy, min_fanin,
                          params.empty() ? c10::Device(at::kCPU) : params[0].device());
  const size_t n = params.size();
  const bool mom = momentum != 0.0;
  const bool center = vector_policy == "center";

  std::vector<StepJob> jobs;
  jobs.reserve(n);
  int64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    const auto& p = params[i];
    TORCH_CHECK(p.device().is_cpu(), "fused_sgd_step_: params[", i, "] must be on cpu here, got ", p.device());
    const auto st = p.scalar_type();
    StepJob jb{p.data_ptr(), grads[i].data_ptr(), nullptr, nullptr, nullptr, 1, p.numel(), false, st};
    if (mom) jb.buf = momentum_bufs[i].data_ptr();
    if (auto c = checks::fused_control(c_add, i)) jb.cadd = c->data_ptr();
    if (auto c = checks::fused_control(c_sub, i)) jb.csub = c->data_ptr();
    if (gc_mask.size() && gc_mask.get(i) && p.dim() >= 1 && p.numel() > 0 && (p.dim() >= 2 || center)) {
      const int64_t rows = p.dim() == 1 ? 1 : p.size(0);
      const int64_t M = p.numel() / rows;
      if (M >= min_fanin) {
        jb.gc = true;
        jb.rows = rows;
        jb.M = M;
      }
    }
    if (p.numel() == 0) continue;
    total += p.numel();
    jobs.push_back(jb);
  }
  if (total == 0) return;
  // Items of about `target` elements: whole rows for GC tensors, element ranges otherwise.
  const int64_t nt = std::max<int64_t>(1, at::get_num_threads());
  const int64_t target = std::max<int64_t>(4096, total / (nt * 8));
  struct Item { int64_t job, a, b; };
  std::vector<Item> items;
  for (int64_t k = 0; k < (int64_t)jobs.size(); ++k) {
    const auto& jb = jobs[k];
    if (jb.gc) {
      const int64_t per = std::max<int64_t>(1, target / jb.M);
      for (int64_t r = 0; r < jb.rows; r += per) items.push_back({k, r, std::min(jb.rows, r + per)});
    } else {
      for (int64_t e = 0; e < jb.M; e += target) items.push_back({k, e, std::min(jb.M, e + target)});
    }
  }
  const StepArgs args{lr, momentum, weight_decay, first_step};
  const int64_t ni = (int64_t)items.size();
  const int64_t grain = total < (1 << 15) ? ni : 1;
  at::parallel_for(0, ni, grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) run_item(jobs[items[i].job], items[i].a, items[i].b, args);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fedkernels, m) {
  // One SGD step over a list of tensors in one pass, torch.optim.SGD semantics (dampening 0):
  //   d = GC(g) [gc_mask] + c_add - c_sub [per tensor, where given] + weight_decay * p
  //   buf = d (first_step) or momentum * buf + d [momentum != 0];  p -= lr * buf (lr * d)
  // c_add / c_sub / gc_mask: empty (none) or one entry per parameter. grads are not modified.
  m.def("fused_sgd_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_bufs, Tensor?[] c_add, "
        "Tensor?[] c_sub, bool[] gc_mask, float lr, float momentum, float weight_decay, bool first_step, "
        "str vector_policy=\"skip\", int min_fanin=2) -> ()");
}

TORCH_LIBRARY_IMPL(fedkernels, CPU, m) { m.impl("fused_sgd_step_", &fused_sgd_step_cpu); }

}  // namespace fedkernels
