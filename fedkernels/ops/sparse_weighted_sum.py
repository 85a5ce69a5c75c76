"""The weighted sum of sparse update rows (index/value lists), read as they are: ``sparse_weighted_sum``.

``base + alpha * sum_i coef_i * scatter(list rows_i)`` over K index/value lists stored CSR-like (one flat
``idx`` and ``val``, list k = ``[offsets[k], offsets[k + 1])``; ``scatter(list)[j]`` = the sum of the list's values
at index j), with each list's NaN/Inf flag from the same pass (``csrc/cpu/sparse_weighted_sum.cpp``,
``csrc/cuda/sparse_weighted_sum.cu``); float64 oracle: ``fedkernels.reference.sparse_weighted_sum``. The top-k
codec's rows (``fedkernels.compress``) are summed this way, without a K x d dense copy. Deterministic: every
output element adds its entries in list order, then position order, with any thread count.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from .._types import CoefLike, RowsLike
from . import _autograd as _ag
from ._checks import _batched, _coef, fake_devices, _finite_number, HOST, _needs_kernel, _rows, _tensor, tracing
from .dequant_weighted_sum import _float_base
from .weighted_sum import _NO_COEF

__all__ = ["sparse_weighted_sum", "stack_lists"]

INDEX_DTYPES = (torch.int32, torch.int64)
_NO_LISTS = torch.zeros(1, dtype=torch.int64)


def _offsets(offsets: object, nnz: int, op: str) -> torch.Tensor:
    o = offsets if isinstance(offsets, torch.Tensor) else torch.as_tensor(offsets)
    if o.dim() != 1 or o.numel() < 1:
        raise ValueError(f"{op}: offsets must be a 1-D sequence of K + 1 list starts, got shape {tuple(o.shape)}")
    if o.dtype.is_floating_point or o.dtype.is_complex or o.dtype == torch.bool:
        raise ValueError(f"{op}: offsets must hold integers, got {o.dtype}")
    o = o.detach().to(HOST, torch.int64).contiguous()
    if not tracing() and not _batched(o):
        if int(o[0]) != 0 or int(o[-1]) != nnz:
            raise ValueError(
                f"{op}: offsets must run from 0 to nnz = {nnz} (the length of idx), got {int(o[0])} .. {int(o[-1])}"
            )
        if o.numel() > 1 and bool((o[1:] < o[:-1]).any()):
            k = int((o[1:] < o[:-1]).nonzero()[0])
            raise ValueError(
                f"{op}: offsets must be non-decreasing, got offsets[{k}] = {int(o[k])} > "
                f"offsets[{k + 1}] = {int(o[k + 1])}"
            )
    return o


def _check_indices(idx: torch.Tensor, o: torch.Tensor, d: int, op: str) -> None:
    """Every index in [0, d), non-decreasing within each list (one vectorised pass, on idx's device)."""
    if idx.numel() == 0 or tracing() or _batched(idx):
        return
    lo, hi = torch.aminmax(idx)
    if int(lo) < 0 or int(hi) >= d:
        raise ValueError(f"{op}: idx must lie in [0, d = {d}), got min {int(lo)} max {int(hi)}")
    if idx.numel() > 1:
        down = idx[1:] < idx[:-1]
        inner = o[1:-1]
        inner = inner[(inner > 0) & (inner < idx.numel())] - 1  # a list's first entry may be below the last one's
        if inner.numel():
            down[inner.to(idx.device)] = False
        if bool(down.any()):
            p = int(down.nonzero()[0]) + 1
            k = int(torch.searchsorted(o, torch.tensor([p]), right=True)[0]) - 1
            raise ValueError(
                f"{op}: idx must be non-decreasing within each list, list {k} has idx[{p}] = "
                f"{int(idx[p])} < idx[{p - 1}] = {int(idx[p - 1])}"
            )


def sparse_weighted_sum(
    idx: torch.Tensor,
    val: torch.Tensor,
    offsets: object,
    coef: CoefLike,
    d: int,
    base: Optional[torch.Tensor] = None,
    alpha: float = 1.0,
    rows: RowsLike = None,
    out_dtype: Optional[torch.dtype] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(out, ok)``: ``out = base + alpha * sum_i coef[i] * scatter(list rows[i])`` ([d]) and ``ok[i]`` = all
    values of list ``rows[i]`` finite, from one pass over the selected lists.

    idx: [nnz] int32/int64, each list's indices non-decreasing (duplicates are summed in list order) and in
    [0, d); val: [nnz] float16/bfloat16/float32/float64 on idx's device; offsets: K + 1 list starts (host or
    device, read on the host) from 0 to nnz; coef: [len(rows)] finite; d: the dense length. The result:
    base's dtype, else ``out_dtype``, else float64 for float64 values and float32 otherwise (accumulated in it;
    in float64 when some |alpha coef_i| exceeds float32's range). Not differentiable.
    """
    op = "sparse_weighted_sum"
    # idx's and val's shapes, dtypes, devices: the native op's (csrc/sparse_weighted_sum_checks.h)
    idx, val = _tensor(idx, op, "idx"), _tensor(val, op, "val")
    if isinstance(d, bool) or not isinstance(d, int) or d < 0:
        raise ValueError(f"{op}: d must be an int >= 0 (the dense length), got {d!r}")
    _needs_kernel(op, idx.device, op)
    if idx.dim() == 1 and idx.dtype in INDEX_DTYPES:
        o = _offsets(offsets, idx.numel(), op)
        idx, val = idx.contiguous(), val.contiguous()
        _check_indices(idx, o, d, op)
        r = _rows(rows, o.numel() - 1, op)
        c = _coef(coef, o.numel() - 1 if r is None else r.numel(), op)
    else:  # these rules read idx as index lists: the native op raises idx's error first
        o, r, c = _NO_LISTS, None, _NO_COEF
    a = _finite_number(alpha, op, "alpha")
    base = _float_base(op, base, out_dtype)
    return _ag.call(torch.ops.fedkernels.sparse_weighted_sum, idx, val, o, c, d, base, a, r, out_dtype)


def stack_lists(
    idx: Sequence[torch.Tensor], val: Sequence[torch.Tensor]
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K index/value lists as the (idx, val, offsets) of :func:`sparse_weighted_sum` (one concatenation)."""
    if len(idx) != len(val):
        raise ValueError(f"stack_lists: idx and val must have one list each per row, got {len(idx)} and {len(val)}")
    lens = torch.tensor([0] + [int(t.numel()) for t in idx], dtype=torch.int64)
    for k, (i, v) in enumerate(zip(idx, val)):
        if i.dim() != 1 or v.dim() != 1 or i.numel() != v.numel():
            raise ValueError(
                f"stack_lists: list {k} must be two 1-D tensors of one length, got shapes "
                f"{tuple(i.shape)} and {tuple(v.shape)}"
            )
    if not idx:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0), lens
    return torch.cat(list(idx)), torch.cat(list(val)), torch.cumsum(lens, 0)


@torch.library.register_fake("fedkernels::sparse_weighted_sum")
def _sparse_fake(
    idx: torch.Tensor,
    val: torch.Tensor,
    offsets: torch.Tensor,
    coef: torch.Tensor,
    d: int,
    base: Optional[torch.Tensor] = None,
    alpha: float = 1.0,
    rows: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    fake_devices("sparse_weighted_sum", idx, "idx is on", val=val)
    fake_devices("sparse_weighted_sum", idx, "the rows are on", base=base)
    dflt = torch.float64 if val.dtype == torch.float64 else torch.float32
    odt = base.dtype if base is not None else (out_dtype or dflt)
    n = offsets.size(0) - 1 if rows is None else rows.size(0)
    return val.new_empty((d,), dtype=odt), val.new_empty((n,), dtype=torch.bool)


_ag.no_derivative_op("sparse_weighted_sum", "differentiate reference.sparse_weighted_sum instead")
