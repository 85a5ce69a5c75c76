// The rule of the `rows` argument (Tensor? rows: the selected rows of U) of the ops that take one
// (gram, order_mean, closest_mean), for their CPU kernels and CUDA glue: its shape and dtype, in the
// words of the Python wrappers' rows rule. Its values (each in [0, K)) are checked on the host by the
// wrappers; the CPU kernels and the CUDA glue range-check host-resident rows again (common.h row_list,
// glue.h rows_to_device).
#pragma once

#include "checks.h"

namespace fedkernels {
namespace checks {

// rows: absent, or a 1-D tensor of integer indices (an empty one of any dtype).
inline void rows_arg(const c10::optional<at::Tensor>& rows, const char* op) {
  if (!rows.has_value()) return;
  const at::Tensor& r = *rows;
  TORCH_CHECK_VALUE(r.dim() == 1, op, ": rows must be a 1-D sequence of row indices, got shape ", py_shape(r.sizes()));
  const at::ScalarType st = r.scalar_type();
  TORCH_CHECK_VALUE(r.numel() == 0 || !(at::isFloatingType(st) || at::isComplexType(st) || st == at::kBool), op,
                    ": rows must hold integer row indices, got dtype ", py_dtype(st));
}

}  // namespace checks
}  // namespace fedkernels
