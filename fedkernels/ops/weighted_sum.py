"""The weighted sum of the update rows: ``weighted_sum``, ``weighted_sum_screened``,
``weighted_sum_chunked``.

The pass of every aggregator over the K x d update matrix ``U`` (one client per row) that applies
the weights: ``base + alpha * sum_i coef_i U[rows_i]`` (``csrc/cpu/weighted_sum.cpp``,
``csrc/cuda/weighted_sum.cu``); float64 oracle: ``fedkernels.reference.weighted_sum``.
``coef`` and ``rows`` are small host vectors: they are checked on the host and handed to the
native op as CPU tensors for every device of ``U`` (see ``_checks``).

The result (``out``, ``base``) has ``U``'s dtype, or for a bf16/fp16 ``U`` a wider float32/float64
(:func:`out_dtypes`): a half-precision update summed into an fp32/fp64 model in one pass, accumulated in
the result's dtype, the same bits as converting ``U`` to it first. The functional forms take ``base``'s
dtype (``U``'s without ``base``); ``out=`` names it.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple, Union

import torch

from .._types import CoefLike, RowsLike
from . import _autograd as _ag
from ._checks import (
    FLOAT_DTYPES,
    _coef,
    _finite_number,
    _float_dtype,
    _matrix,
    _needs_kernel,
    _no_grad_through,
    _rows,
    _selected_rows,
    _tensor,
    fake_devices,
    fake_size,
    has_kernel,
)
from .reductions import shard_and

__all__ = ["weighted_sum", "weighted_sum_screened", "weighted_sum_chunked", "out_dtypes"]

# The wider results of a half-precision U (csrc/weighted_sum_checks.h: weighted_sum_out_dtype_ok).
_WIDER = {torch.float16: (torch.float32, torch.float64), torch.bfloat16: (torch.float32, torch.float64)}


def out_dtypes(dtype: torch.dtype) -> Tuple[torch.dtype, ...]:
    """The dtypes the weighted sum of a U of ``dtype`` can be written in (``out``, ``base``): ``dtype``,
    and float32/float64 for float16/bfloat16 (accumulated in that dtype)."""
    return (dtype,) + _WIDER.get(dtype, ())


_NO_COEF = torch.empty(0, dtype=torch.float64)


def _host_rows_coef(
    U: torch.Tensor, rows: RowsLike, coef: CoefLike, op: str
) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
    """(rows, coef) as host tensors, the rows in [0, K) and the coefficients finite (``_checks``). For a U
    that is not 2-D nothing is read, and the native op raises U's shape error."""
    if U.dim() != 2:
        return None, _NO_COEF
    r, n = _selected_rows(U, rows, op)
    return r, _coef(coef, n, op)


def _result_args(
    out: Optional[torch.Tensor], base: Optional[torch.Tensor], op: str
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(out, base): tensors (``TypeError`` otherwise), a non-contiguous base copied once; their length, dtype
    (:func:`out_dtypes`), device and out's contiguity are the native op's to check."""
    if out is not None:
        out = _tensor(out, op, "out")
    if base is not None:
        base = _tensor(base, op, "base").contiguous()
    return out, base


def weighted_sum(
    U: torch.Tensor,
    coef: CoefLike,
    base: Optional[torch.Tensor] = None,
    alpha: float = 1.0,
    rows: RowsLike = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``base + alpha * sum_i coef[i] * U[rows[i]]`` in one pass over the selected rows.

    U: [K, d]; coef: [len(rows)] (read as float64, applied in the accumulation dtype, the result's:
    fp32 for fp32/fp16/bf16, fp64 for fp64; a host vector, a device one is copied to the host once);
    base: optional [d]; out: optional [d] contiguous, may be ``base`` itself (in-place apply). The
    result's dtype: out's, else base's, else U's; U's or, for a bf16/fp16 U, float32/float64
    (:func:`out_dtypes`); base has out's. Returns out. Differentiable w.r.t. ``U``, ``coef`` and
    ``base`` (without ``out``).
    """
    op = "weighted_sum"
    U = _matrix(U, op)
    _needs_kernel("weighted_sum" if out is None else "weighted_sum_out", U.device, op)
    r, c = _host_rows_coef(U, rows, coef, op)
    alpha = _finite_number(alpha, op, "alpha")
    out, base = _result_args(out, base, op)
    if out is None:
        if _ag.needs_grad(U, c, base):
            return _WeightedSum.apply(U, c, base, alpha, r)
        return _ag.call(torch.ops.fedkernels.weighted_sum, U, c, base, alpha, r)
    _no_grad_through("weighted_sum(out=...)", U, c, base, out)
    torch.ops.fedkernels.weighted_sum_out(U, c, base, alpha, r, out)
    return out


def weighted_sum_screened(
    U: torch.Tensor,
    coef: CoefLike,
    base: Optional[torch.Tensor] = None,
    alpha: float = 1.0,
    rows: RowsLike = None,
    out: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(weighted_sum(U, coef, base, alpha, rows, out), ok)``, ok[i] = all(isfinite(U[rows[i]]))
    ([len(rows)] bool on U's device), from the same pass over U: the NaN/Inf screen of the rows costs
    no extra read. Arguments as :func:`weighted_sum` (``out``: optional [d] contiguous on U's device, may
    be ``base``; returned as the sum; the result's dtype as there: a bf16/fp16 U summed into an fp32/fp64
    out screens and widens in one pass); not differentiable (a screen, not a formula)."""
    op = "weighted_sum_screened"
    U = _matrix(U, op)
    _needs_kernel(op if out is None else "weighted_sum_screened_out", U.device, op)
    r, c = _host_rows_coef(U, rows, coef, op)
    a = _finite_number(alpha, op, "alpha")
    out, base = _result_args(out, base, op)
    if out is None:
        _no_grad_through(op, U, c, base)
        out, ok = torch.ops.fedkernels.weighted_sum_screened(U, c, base, a, r)
        return out, shard_and(ok)
    _no_grad_through(op, U, c, base, out)
    ok = torch.ops.fedkernels.weighted_sum_screened_out(U, c, base, a, r, out)
    return out, shard_and(ok)


def weighted_sum_chunked(
    M: torch.Tensor,
    coef: CoefLike,
    base: Optional[torch.Tensor] = None,
    alpha: float = 1.0,
    rows: RowsLike = None,
    out_dtype: Optional[torch.dtype] = None,
    device: Optional[Union[str, torch.device]] = None,
    chunk_cols: int = 1 << 18,
) -> torch.Tensor:
    """``base + alpha * sum_i coef_i M[rows_i]`` for a table ``M`` stored in another dtype (bf16) or on
    another device (the host) than the result: column chunks of the selected rows are converted to
    ``out_dtype`` (default: base's dtype, else M's) on ``device`` (default: base's device, else M's)
    one at a time (temporary: len(rows) x chunk_cols) and summed with :func:`weighted_sum`. Equal to
    ``weighted_sum(M[rows].to(device, out_dtype), coef, base, alpha)`` without the full copy. A table
    already on ``device`` whose dtype widens to ``out_dtype`` (:func:`out_dtypes`: bf16/fp16 to
    fp32/fp64) is summed in one :func:`weighted_sum` pass instead (no temporary; the same bits).
    """
    op = "weighted_sum_chunked"
    M = _tensor(M, op, "M")
    if M.dim() != 2:
        raise ValueError(f"{op}: M must be a 2-D [K, d] tensor, got shape {tuple(M.shape)}")
    _float_dtype(M, op, "M")
    if isinstance(chunk_cols, bool) or not isinstance(chunk_cols, int) or chunk_cols < 1:
        raise ValueError(f"{op}: chunk_cols must be an int >= 1, got {chunk_cols!r}")
    if out_dtype is not None and out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: out_dtype must be a floating dtype or None, got {out_dtype!r}")
    _finite_number(alpha, op, "alpha")
    if base is not None:
        base = _tensor(base, op, "base")
    dev = torch.device(device) if device is not None else (base.device if base is not None else M.device)
    odt = out_dtype if out_dtype is not None else (base.dtype if base is not None else M.dtype)
    K, d = M.shape
    if base is not None:
        if base.dim() != 1 or base.size(0) != d:
            raise ValueError(f"{op}: base must be a 1-D tensor of length {d}, got shape {tuple(base.shape)}")
        if base.dtype != odt or base.device != dev:
            raise ValueError(
                f"{op}: base must have the result's dtype {odt} and device {dev}, got {base.dtype} on {base.device}"
            )
    r = torch.arange(K) if rows is None else _rows(rows, K, op, shape=True)
    c64 = _coef(coef, r.numel(), op, shape=True).to(torch.float64)
    out = torch.empty(d, dtype=odt, device=dev)
    if (
        M.device == dev
        and odt in out_dtypes(M.dtype)
        and has_kernel("weighted_sum_out", dev)
        and (d <= 1 or M.stride(1) == 1)
        and (K <= 1 or M.stride(0) >= d)
    ):  # read in place: one pass
        return weighted_sum(M, c64, base=base, alpha=alpha, rows=None if rows is None else r, out=out)
    ridx = r.to(M.device)
    for a in range(0, d, chunk_cols):
        b = min(d, a + chunk_cols)
        blk = M[:, a:b].index_select(0, ridx).to(device=dev, dtype=odt)
        bb = None if base is None else base[a:b]
        out[a:b] = weighted_sum(blk, c64, base=bb, alpha=alpha)
    return out


# ---- fake (meta) kernels, so the ops work under torch.compile / opcheck ------------------------
@torch.library.register_fake("fedkernels::weighted_sum")
def _wsum_fake(
    U: torch.Tensor,
    coef: torch.Tensor,
    base: Optional[torch.Tensor] = None,
    alpha: float = 1.0,
    rows: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    fake_devices("weighted_sum", U, "U is on", base=base)
    return U.new_empty((fake_size(U, 1),), dtype=U.dtype if base is None else base.dtype)


@torch.library.register_fake("fedkernels::weighted_sum_out")
def _wsum_out_fake(
    U: torch.Tensor,
    coef: torch.Tensor,
    base: Optional[torch.Tensor],
    alpha: float,
    rows: Optional[torch.Tensor],
    out: torch.Tensor,
) -> None:
    fake_devices("weighted_sum", U, "U is on", out=out, base=base)
    return None


@torch.library.register_fake("fedkernels::weighted_sum_screened")
def _wsum_screened_fake(
    U: torch.Tensor,
    coef: torch.Tensor,
    base: Optional[torch.Tensor] = None,
    alpha: float = 1.0,
    rows: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    fake_devices("weighted_sum_screened", U, "U is on", base=base)
    K, d = fake_size(U, 0), fake_size(U, 1)
    n = K if rows is None else rows.size(0)
    return U.new_empty((d,), dtype=U.dtype if base is None else base.dtype), U.new_empty((n,), dtype=torch.bool)


@torch.library.register_fake("fedkernels::weighted_sum_screened_out")
def _wsum_screened_out_fake(
    U: torch.Tensor,
    coef: torch.Tensor,
    base: Optional[torch.Tensor],
    alpha: float,
    rows: Optional[torch.Tensor],
    out: torch.Tensor,
) -> torch.Tensor:
    fake_devices("weighted_sum_screened", U, "U is on", out=out, base=base)
    return U.new_empty((fake_size(U, 0) if rows is None else rows.size(0),), dtype=torch.bool)


# ---- derivative (``g`` = gradient of the output): dU[rows_i] += alpha coef_i g,
# dcoef_i = alpha <U[rows_i], g> (float64 dot), dbase = g; vmap: one native call per batch element
def _wsum_setup(ctx: Any, inputs: Tuple[Any, ...], output: torch.Tensor) -> None:
    U, coef, base, alpha, rows = inputs
    ctx.alpha = float(alpha)
    ctx.has_base = base is not None
    ctx.save_for_backward(U, coef, rows)


def _wsum_backward(ctx: Any, g: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
    U, coef, rows = ctx.saved_tensors
    a = ctx.alpha
    # trailing arguments left at their defaults are not passed on (nor counted in needs_input_grad)
    need_U, need_c, need_b = (tuple(ctx.needs_input_grad) + (False,) * 3)[:3]
    gU: Optional[torch.Tensor] = None
    gc: Optional[torch.Tensor] = None
    gb: Optional[torch.Tensor] = None
    r = None if rows is None else rows.to(U.device)
    if need_U:
        w = (a * coef.to(device=U.device, dtype=torch.float64)).to(g.dtype)
        contrib = w[:, None] * g[None, :]
        if r is None:
            gU = contrib.to(U.dtype)
        else:
            gU = torch.zeros_like(U).index_add_(0, r, contrib.to(U.dtype))
    if need_c:
        sel = U if r is None else U.index_select(0, r)
        gc = (a * (sel.to(torch.float64) @ g.to(torch.float64))).to(device=coef.device, dtype=coef.dtype)
    if need_b and ctx.has_base:
        gb = g
    return gU, gc, gb, None, None


class _WeightedSum(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(
        U: torch.Tensor, coef: torch.Tensor, base: Optional[torch.Tensor], alpha: float, rows: Optional[torch.Tensor]
    ) -> torch.Tensor:
        return torch.ops.fedkernels.weighted_sum(U, coef, base, alpha, rows)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: torch.Tensor) -> None:
        _wsum_setup(ctx, inputs, output)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        return _wsum_backward(ctx, g)


def _wsum_vmap(
    info: Any,
    in_dims: Sequence[Optional[int]],
    U: torch.Tensor,
    coef: torch.Tensor,
    base: Optional[torch.Tensor] = None,
    alpha: float = 1.0,
    rows: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, int]:
    dims = (tuple(in_dims) + (None,) * 5)[:5]
    return _ag.vmap_loop(torch.ops.fedkernels.weighted_sum, info, dims, (U, coef, base, alpha, rows))


torch.library.register_autograd("fedkernels::weighted_sum", _wsum_backward, setup_context=_wsum_setup)
torch.library.register_vmap("fedkernels::weighted_sum", _wsum_vmap)
