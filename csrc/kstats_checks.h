// Argument rules of kstats, written once for its CPU kernel (csrc/cpu/kstats.cpp) and its CUDA glue
// (csrc/cuda/kstats_glue.cpp): the one check of its tensors' shapes, dtypes, devices and layout, as
// one-line ValueErrors in the words of the Python wrapper (fedkernels/ops/kstats.py).
#pragma once

#include "checks.h"

namespace fedkernels {
namespace checks {

// U: [K, d] float with unit column stride on `dev`; p: 1-D float of length K (one weight per row), on the
// host or `dev`.
inline void kstats_args(const at::Tensor& U, const at::Tensor& p, c10::Device dev) {
  matrix(U, dev, "kstats");
  TORCH_CHECK_VALUE(p.dim() == 1 && p.size(0) == U.size(0), "kstats: p must be a 1-D tensor of length ", U.size(0),
                    " (one per selected row), got shape ", py_shape(p.sizes()));
  float_dtype(p, "kstats", "p");
  host_or_on(p, dev, "kstats", "p", "U");
}

}  // namespace checks
}  // namespace fedkernels
