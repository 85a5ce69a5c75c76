// Argument rules of the selection ops order_mean and closest_mean, written once for their CPU kernel
// (csrc/cpu/select.cpp) and their CUDA glue (csrc/cuda/select_glue.cpp): the one check of their tensors'
// shapes, dtypes, devices and layout, as one-line ValueErrors in the words of the Python wrappers
// (fedkernels/ops/select.py); lo, hi and beta are checked by the wrappers, and here again as a last line.
#pragma once

#include "checks.h"

namespace fedkernels {
namespace checks {

// U: [K, d] float with unit column stride on `dev`; rows: absent or 1-D integer indices on the host or `dev`.
inline void select_args(const at::Tensor& U, const c10::optional<at::Tensor>& rows, c10::Device dev, const char* op) {
  matrix(U, dev, op);
  index_rows(rows, dev, op);
}

// order_mean: the sorted positions lo..hi-1 of k values: 0 <= lo < hi <= k.
inline void order_mean_args(int64_t k, int64_t lo, int64_t hi) {
  TORCH_CHECK(0 <= lo && lo < hi && hi <= k, "order_mean: need 0 <= lo < hi <= k (k = ", k,
              " selected rows), got lo=", lo, " hi=", hi);
}

// closest_mean: 1 <= beta <= k.
inline void closest_mean_args(int64_t k, int64_t beta) {
  TORCH_CHECK(1 <= beta && beta <= k, "closest_mean: need 1 <= beta <= k (k = ", k, " selected rows), got beta=",
              beta);
}

// The result's dtype: float64 for a float64 U, else float32.
inline at::ScalarType select_out_dtype(at::ScalarType u) { return u == at::kDouble ? at::kDouble : at::kFloat; }

}  // namespace checks
}  // namespace fedkernels
