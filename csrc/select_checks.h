// Argument rules of the selection ops order_mean and closest_mean, written once for their CPU kernel
// (csrc/cpu/select.cpp) and their CUDA glue (csrc/cuda/select_glue.cpp): cheap last-line checks (the
// Python wrapper validates first and names the argument).
#pragma once

#include "checks.h"

namespace fedkernels {
namespace checks {

// U: [K, d] with unit column stride on `dev`, one of the four float dtypes; k = the number of selected rows.
inline void select_matrix(const at::Tensor& U, c10::Device dev, const char* op) {
  check_rowmajor(U, op, "U");
  on_device(U, dev, op, "U");
  TORCH_CHECK(is_float4(U.scalar_type()), op, ": U must be float16, bfloat16, float32 or float64, got ",
              U.scalar_type());
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
