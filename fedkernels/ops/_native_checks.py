"""What the wrappers of the ops whose tensor rules live in C++ keep in Python (private).

The native ops (``csrc/<op>_checks.h``) check every tensor argument's shape, dtype, device and layout
and raise a one-line ValueError naming the op and the argument, for every caller. Their wrappers
keep the rest: argument types (a TypeError for a non-tensor), the values of small host vectors, and
the layout adaptation the kernels need (:func:`rowmajor`). A wrapper that calls a native op of
another name (``gram_screened`` calls ``gram``) raises its errors under its own name (:func:`as_op`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

import torch

from .._types import CoefLike, RowsLike
from ._checks import HOST, _batched, _finite_range, _tensor, tracing

R = TypeVar("R")


def rowmajor(U: object, op: str, name: str = "U") -> torch.Tensor:
    """``U`` as a tensor (TypeError if it is not one) in the layout the kernels read: a 2-D tensor without
    unit column stride, or with overlapping rows (expanded), is copied once. Its shape, dtype and device
    are checked by the native op."""
    U = _tensor(U, op, name)
    if U.dim() == 2 and ((U.size(1) > 1 and U.stride(1) != 1) or (U.size(0) > 1 and U.stride(0) < U.size(1))):
        U = U.contiguous()
    return U


def matrix_rows(U: torch.Tensor) -> Optional[int]:
    """K = U.size(0) for a value check that needs it, or None when U is not 2-D (then the native op raises
    U's shape error, which a check against a wrong K must not pre-empt)."""
    return U.size(0) if U.dim() == 2 else None


def host_rows(rows: RowsLike, K: Optional[int], op: str) -> Optional[torch.Tensor]:
    """Row indices as a contiguous int64 HOST tensor (a device tensor is copied to the host once), each in
    [0, K) (checked on the host for every device; not when K is None). Rows that are not a 1-D sequence of
    integers are passed on as given (on the host): the native op names what is wrong with them."""
    if rows is None:
        return None
    r = rows.detach() if isinstance(rows, torch.Tensor) else torch.as_tensor(rows)
    if r.device.type != "cpu":
        r = r.to(HOST)
    if r.dim() != 1 or (r.numel() and (r.dtype.is_floating_point or r.dtype.is_complex or r.dtype == torch.bool)):
        return r
    r = r.to(torch.long)
    if K is not None and r.numel() and not tracing() and not _batched(r):
        lo, hi = int(r.min()), int(r.max())
        if lo < 0 or hi >= K:
            raise ValueError(f"{op}: rows must lie in [0, {K}), got min {lo} max {hi}")
    return r.contiguous()


def host_coef(coef: CoefLike, n: Optional[int], op: str, name: str) -> torch.Tensor:
    """Per-row float coefficients as a HOST tensor (a sequence is read as float64, an integer tensor
    converted to float64, a device tensor copied to the host once: a differentiable copy), finite in
    eager mode when they are ``n`` of them (not when n is None). Their shape is the native op's rule:
    coefficients that are not 1-D of length n are passed on, and the native op names what is wrong."""
    c = coef if isinstance(coef, torch.Tensor) else torch.as_tensor(coef, dtype=torch.float64)
    if not c.dtype.is_floating_point:
        c = c.to(torch.float64)
    if c.device.type != "cpu":
        c = c.to(HOST)
    right = n is not None and c.dim() == 1 and c.size(0) == n
    if right and not tracing() and not _batched(c) and not _finite_range(c):
        raise ValueError(f"{op}: {name} must be finite, got {c.tolist() if c.numel() <= 16 else 'non-finite entries'}")
    return c


def fake_size(t: torch.Tensor, i: int) -> int:
    """``t.size(i)`` for a fake kernel's output shape, 0 when t has no dimension i: the native op refuses
    such a tensor when the compiled graph runs, and tracing must not stop first on an IndexError."""
    return t.size(i) if t.dim() > i else 0


def as_op(op: str, native: str, fn: Callable[..., R], *args: Any) -> R:
    """``fn(*args)``, a call of ``fedkernels::<native>`` made for the wrapper ``op``: the native op's
    ValueError (``"<native>: ..."``) is raised as ``"<op>: ..."``, the wrapper's name. (Under tracing the
    call is made as is: the compiled graph runs the native op with its own name.)"""
    if tracing():
        return fn(*args)
    try:
        return fn(*args)
    except ValueError as e:
        msg = str(e)
        if not msg.startswith(native + ": "):
            raise
        raise ValueError(op + msg[len(native) :]) from None
