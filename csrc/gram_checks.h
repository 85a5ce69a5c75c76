// Argument rules of gram, written once for its CPU kernel (csrc/cpu/gram.cpp) and its CUDA glue
// (csrc/cuda/gram_glue.cpp): the one check of its tensors' shapes, dtypes, devices and layout, as
// one-line ValueErrors in the words of the Python wrapper (fedkernels/ops/gram.py).
#pragma once

#include "checks.h"

namespace fedkernels {
namespace checks {

// U: [K, d] float with unit column stride on `dev`; rows: absent or 1-D integer indices on the host or `dev`.
inline void gram_args(const at::Tensor& U, const c10::optional<at::Tensor>& rows, c10::Device dev) {
  matrix(U, dev, "gram");
  index_rows(rows, dev, "gram");
}

}  // namespace checks
}  // namespace fedkernels
