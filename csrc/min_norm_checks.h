// Argument rules of min_norm, written once for its CPU kernel (csrc/cpu/min_norm.cpp) and its CUDA
// glue (csrc/cuda/min_norm_glue.cpp): the one check of its tensors' shapes and dtypes, as one-line
// ValueErrors in the words of the Python wrapper (fedkernels/ops/min_norm.py), then the options as a
// last line (the wrapper checks them first). G's finiteness is checked by the CPU solve in its one read of G.
#pragma once

#include "checks.h"

namespace fedkernels {
namespace checks {

// Returns K. method is checked by each backend (the CUDA solver has no code_compat / polish).
inline int64_t min_norm_args(const at::Tensor& G, int64_t max_iter, double tol_rel, double tol_abs,
                             c10::string_view init, const c10::optional<at::Tensor>& lam0,
                             const c10::optional<at::Tensor>& scale) {
  TORCH_CHECK_VALUE(G.dim() == 2 && G.size(0) == G.size(1), "min_norm: G must be a square [K, K] Gram matrix, got shape ",
                    py_shape(G.sizes()));
  float_dtype(G, "min_norm", "G");
  const int64_t K = G.size(0);
  TORCH_CHECK_VALUE(K >= 1, "min_norm: G must be at least 1 x 1 (K >= 1 vectors), got shape ", py_shape(G.sizes()));
  if (lam0.has_value()) {
    TORCH_CHECK_VALUE(lam0->dim() == 1 && lam0->size(0) == K, "min_norm: lam0 must be a 1-D tensor of length ", K,
                      ", got shape ", py_shape(lam0->sizes()));
    host_or_on(*lam0, G.device(), "min_norm", "lam0", "G");
  }
  if (scale.has_value()) {
    TORCH_CHECK_VALUE(scale->dim() == 1 && scale->size(0) == K, "min_norm: scale must be a 1-D tensor of length ", K,
                      ", got shape ", py_shape(scale->sizes()));
    host_or_on(*scale, G.device(), "min_norm", "scale", "G");
  }
  TORCH_CHECK(max_iter >= 0, "min_norm: max_iter must be >= 0, got ", max_iter);
  TORCH_CHECK(tol_rel >= 0.0 && tol_abs >= 0.0, "min_norm: tolerances must be >= 0");
  TORCH_CHECK(init == "best_pair" || init == "min_diag", "min_norm: init must be 'best_pair' or 'min_diag', got '",
              std::string(init), "'");
  return K;
}

}  // namespace checks
}  // namespace fedkernels
