"""What the wrappers of the ops whose tensor rules live in C++ keep in Python (private).

The native ops (``csrc/<op>_checks.h``) check every tensor argument's shape, dtype, device and layout
and raise a one-line ValueError naming the op and the argument, for every caller. Their wrappers
keep the rest: argument types (a TypeError for a non-tensor), the values of small host vectors, and
the layout adaptation the kernels need (:func:`rowmajor`). A wrapper that calls a native op of
another name (``gram_screened`` calls ``gram``) raises its errors under its own name (:func:`as_op`).
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch

from ._checks import _tensor, tracing

R = TypeVar("R")


def rowmajor(U: object, op: str, name: str = "U") -> torch.Tensor:
    """``U`` as a tensor (TypeError if it is not one) in the layout the kernels read: a 2-D tensor without
    unit column stride, or with overlapping rows (expanded), is copied once. Its shape, dtype and device
    are checked by the native op."""
    U = _tensor(U, op, name)
    if U.dim() == 2 and ((U.size(1) > 1 and U.stride(1) != 1) or (U.size(0) > 1 and U.stride(0) < U.size(1))):
        U = U.contiguous()
    return U


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
