"""The weighted sum of blockwise-quantised update rows, read as they are: ``dequant_weighted_sum``.

``base + alpha * sum_i coef_i * dequant(Q[rows_i])`` with ``dequant(Q)[k, j] = scales[k, j // block] * Q[k, j]``
for int8 or float8 e4m3 (``torch.float8_e4m3fn``) codes ``Q`` [K, d] and float32 scales [K, ceil(d / block)]
(the last block of a row may be short), accumulated straight into a float32/float64 result in one pass over
the codes, with the rows' finite flags from the same pass (``csrc/cpu/dequant_weighted_sum.cpp``,
``csrc/cuda/dequant_weighted_sum.cu``); float64 oracle: ``fedkernels.reference.dequant_weighted_sum``.
No dequantised copy of ``Q`` is made: an int8 row is read as a quarter of an fp32 row's bytes.
``coef`` and ``rows`` are small host vectors, checked on the host (see ``_checks``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._types import CoefLike, RowsLike
from . import _autograd as _ag
from ._checks import fake_devices, fake_size, _finite_number, _matrix, _needs_kernel, _tensor
from .weighted_sum import _host_rows_coef

__all__ = ["dequant_weighted_sum", "CODE_DTYPES", "RESULT_DTYPES"]

CODE_DTYPES = (torch.int8, torch.float8_e4m3fn)
RESULT_DTYPES = (torch.float32, torch.float64)


def _float_base(op: str, base: Optional[torch.Tensor], out_dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
    """base (a tensor, ``TypeError`` otherwise; a non-contiguous one copied once) after the ``out_dtype``
    option's check. The result's dtype (base's, else out_dtype, else the op's default), base's length,
    dtype and device, and out_dtype's agreement with base are the native op's to check."""
    if out_dtype is not None and out_dtype not in RESULT_DTYPES:
        raise ValueError(f"{op}: out_dtype must be torch.float32 or torch.float64, got {out_dtype!r}")
    return None if base is None else _tensor(base, op, "base").contiguous()


def _block(block: object, op: str) -> int:
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"{op}: block must be an int >= 1 (columns per scale), got {block!r}")
    return block


def dequant_weighted_sum(
    Q: torch.Tensor,
    scales: torch.Tensor,
    coef: CoefLike,
    block: int,
    base: Optional[torch.Tensor] = None,
    alpha: float = 1.0,
    rows: RowsLike = None,
    out_dtype: Optional[torch.dtype] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(out, ok)``: ``out = base + alpha * sum_i coef[i] * scales[rows[i], j // block] * Q[rows[i], j]`` and
    ``ok[i]`` = row ``rows[i]`` dequantises to finite numbers (all its scales finite, no NaN code), from one
    pass over the codes.

    Q: [K, d] int8 or float8_e4m3fn (any row stride, unit column stride; copied once otherwise); scales:
    [K, ceil(d / block)] float32; coef: [len(rows)] finite (read as float64); block >= 1 (the last block of a
    row holds d - (nb - 1) block columns). The result: base's dtype, else ``out_dtype``, else float32 (float32
    or float64: accumulated in it, in float64 when some alpha coef_i scale exceeds float32's range); per
    (row, block) the weight alpha coef_i scale is rounded once, each code adds one fma, rows in the order
    given: the same bits with any thread count. Not differentiable.
    """
    op = "dequant_weighted_sum"
    Q = _matrix(Q, op, "Q")  # its shape, dtype and device: the native op's (csrc/dequant_weighted_sum_checks.h)
    _needs_kernel(op, Q.device, op)
    block = _block(block, op)
    scales = _matrix(scales, op, "scales")
    r, c = _host_rows_coef(Q, rows, coef, op)
    a = _finite_number(alpha, op, "alpha")
    base = _float_base(op, base, out_dtype)
    return _ag.call(torch.ops.fedkernels.dequant_weighted_sum, Q, scales, c, block, base, a, r, out_dtype)


@torch.library.register_fake("fedkernels::dequant_weighted_sum")
def _dequant_fake(
    Q: torch.Tensor,
    scales: torch.Tensor,
    coef: torch.Tensor,
    block: int,
    base: Optional[torch.Tensor] = None,
    alpha: float = 1.0,
    rows: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    fake_devices("dequant_weighted_sum", Q, "Q is on", scales=scales)
    fake_devices("dequant_weighted_sum", Q, "the rows are on", base=base)
    odt = base.dtype if base is not None else (out_dtype or torch.float32)
    K, d = fake_size(Q, 0), fake_size(Q, 1)
    n = K if rows is None else rows.size(0)
    return Q.new_empty((d,), dtype=odt), Q.new_empty((n,), dtype=torch.bool)


_ag.no_derivative_op(
    "dequant_weighted_sum", "quantised codes have no gradient; differentiate reference.dequant_weighted_sum instead"
)
