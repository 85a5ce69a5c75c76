"""Argument checks shared by the op wrappers (private).

Each thing is checked in one place. The native op checks its tensor arguments (shape, dtype, device,
layout) in C++ (``csrc/<op>_checks.h``) for every caller, raising a one-line ``ValueError`` that names
the op, the argument, the value and what was expected. The Python wrapper checks what only Python
sees, before any work: argument types (``TypeError`` for a non-tensor), Python scalars and options,
and values (row indices in range, finite coefficients), each a one-line ``ValueError`` of the same
form; it also copies a U without unit column stride once (:func:`_matrix`). The rules here that
read a tensor's dtype or device (:func:`_like`, :func:`_float_dtype`) serve the functions that have
no native op behind them and the round runner's contract check (updates against global_flat).

Host-side index and coefficient checks: ``rows`` and the small per-client vectors
(``coef``, FedECADO's thetas) are checked and handed to the native op as HOST (CPU) tensors for
every device of ``U``: a CUDA ``rows``/``coef`` is copied to the host once; the CUDA glue moves
them to the device. So a bad index is a ValueError here and never a device assert.

Under ``torch.compile`` tracing (``tracing()``) and torch.func transforms, the checks that need a
tensor's *values* (ranges, finiteness) are skipped; the native op still checks the tensors when the
graph runs, and the CPU kernels keep their own range checks, so a bad index still raises (a
RuntimeError from the kernel) instead of reading out of bounds.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Protocol, Sequence, TypeVar, Union, overload

import torch

from .._types import CoefLike, RowsLike

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
HOST = torch.device("cpu")
R = TypeVar("R")


class Typed(Protocol):
    """What the dtype/device rules read: a tensor, or a description of one (``algorithms.base.UpdatesShape``,
    the rows of a chunked source)."""

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...


def tracing() -> bool:
    """True while torch.compile / torch.export traces the caller (value checks are skipped)."""
    return torch.compiler.is_compiling()


def _batched(t: torch.Tensor) -> bool:
    """True inside torch.func transforms (vmap, grad, ...): a vmapped tensor's values cannot be read
    on the host, so value checks are skipped there as under tracing."""
    return torch._C._are_functorch_transforms_active()


def _tensor(x: object, op: str, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _float_dtype(x: Typed, op: str, name: str) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"{op}: {name} must have a floating dtype (float16, bfloat16, float32, float64), got {x.dtype}"
        )


def _finite_number(x: object, op: str, name: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise ValueError(f"{op}: {name} must be a finite number, got {x!r}")
    return float(x)


def _matrix(U: object, op: str, name: str = "U") -> torch.Tensor:
    """``U`` as the kernels read it: a tensor (``TypeError`` otherwise); a 2-D one without unit column
    stride, or with overlapping rows (expanded), is copied once. Its shape, dtype and device are the
    native op's to check."""
    U = _tensor(U, op, name)
    if U.dim() == 2 and ((U.size(1) > 1 and U.stride(1) != 1) or (U.size(0) > 1 and U.stride(0) < U.size(1))):
        U = U.contiguous()
    return U


def _matrix_rows(U: torch.Tensor) -> Optional[int]:
    """K = U.size(0) for a value check that needs it, or None when U is not 2-D: then the native op
    raises U's shape error, which a check against a wrong K must not pre-empt."""
    return U.size(0) if U.dim() == 2 else None


def _like(v: Typed, op: str, name: str, like: Typed, like_name: str = "U") -> None:
    """``v`` has the dtype and device of ``like`` (the rule of every op wrapper and of
    ``Aggregator.validate``, worded once)."""
    if v.dtype != like.dtype:
        raise ValueError(f"{op}: {name} must have dtype {like.dtype} (the dtype of {like_name}), got {v.dtype}")
    if v.device != like.device:
        raise ValueError(f"{op}: {name} is on {v.device} but {like_name} is on {like.device}")


@overload
def _rows(rows: None, K: Optional[int], op: str, shape: bool = ...) -> None: ...


@overload
def _rows(rows: Union[torch.Tensor, Sequence[int]], K: Optional[int], op: str, shape: bool = ...) -> torch.Tensor: ...


@overload
def _rows(rows: RowsLike, K: Optional[int], op: str, shape: bool = ...) -> Optional[torch.Tensor]: ...


def _rows(rows: RowsLike, K: Optional[int], op: str, shape: bool = False) -> Optional[torch.Tensor]:
    """Row indices as a contiguous int64 HOST tensor (a device tensor is copied to the host once), each
    in [0, K) (checked on the host for every device; not when K is None). Rows that are not a 1-D
    sequence of integers are passed on as given (on the host), for the native op to name what is
    wrong with them; with ``shape`` (a function with no native op behind it) that is raised here."""
    if rows is None:
        return None
    r = rows.detach() if isinstance(rows, torch.Tensor) else torch.as_tensor(rows)
    if r.device.type != "cpu":
        r = r.to(HOST)
    bad_shape = r.dim() != 1
    bad_dtype = r.numel() > 0 and (r.dtype.is_floating_point or r.dtype.is_complex or r.dtype == torch.bool)
    if shape and bad_shape:
        raise ValueError(f"{op}: rows must be a 1-D sequence of row indices, got shape {tuple(r.shape)}")
    if shape and bad_dtype:
        raise ValueError(f"{op}: rows must hold integer row indices, got dtype {r.dtype}")
    if bad_shape or bad_dtype:
        return r
    r = r.to(torch.long)
    if K is not None and r.numel() and not tracing() and not _batched(r):
        lo, hi = int(r.min()), int(r.max())
        if lo < 0 or hi >= K:
            raise ValueError(f"{op}: rows must lie in [0, {K}), got min {lo} max {hi}")
    return r.contiguous()


def _selected_rows(U: torch.Tensor, rows: RowsLike, op: str) -> "tuple[Optional[torch.Tensor], Optional[int]]":
    """(rows as :func:`_rows` gives them, checked against K = U.size(0); k = the number of selected rows).
    k is None when U is not 2-D or the rows are not 1-D integers: the native op raises that error, and a
    value check against a wrong k must not pre-empt it."""
    K = _matrix_rows(U)
    r = _rows(rows, K, op)
    if K is None or (r is not None and (r.dim() != 1 or r.dtype != torch.long)):
        return r, None
    return r, K if r is None else r.numel()


def _coef(coef: CoefLike, n: Optional[int], op: str, name: str = "coef", shape: bool = False) -> torch.Tensor:
    """Per-row float coefficients as a HOST tensor (a sequence is read as float64, an integer tensor
    converted to float64, a device tensor copied to the host once: a differentiable copy, so autograd
    still reaches a device ``coef``), finite in eager mode when they are ``n`` of them (not when n is
    None). Coefficients that are not 1-D of length n are passed on, for the native op to name what is
    wrong; with ``shape`` (a function with no native op behind it) that is raised here."""
    c = coef if isinstance(coef, torch.Tensor) else torch.as_tensor(coef, dtype=torch.float64)
    right = n is not None and c.dim() == 1 and c.size(0) == n
    if shape and not right:
        raise ValueError(
            f"{op}: {name} must be a 1-D tensor of length {n} (one per selected row), got shape {tuple(c.shape)}"
        )
    if not c.dtype.is_floating_point:
        c = c.to(torch.float64)
    if c.device.type != "cpu":
        c = c.to(HOST)
    if right and not tracing() and not _batched(c) and not _finite_range(c):
        raise ValueError(f"{op}: {name} must be finite, got {c.tolist() if c.numel() <= 16 else 'non-finite entries'}")
    return c


def host_range(t: torch.Tensor) -> "tuple[float, float]":
    """(min, max) of a host float tensor as Python floats, NaN if it holds a NaN ((inf, -inf) when
    empty): one reduction, so ``all(isfinite(t))`` is both finite (a quarter of the cost of
    ``torch.isfinite(t).all()``, which makes a bool tensor first)."""
    if t.numel() == 0:
        return math.inf, -math.inf
    lo, hi = torch.aminmax(t.detach().reshape(-1))
    return float(lo), float(hi)


def _finite_range(t: torch.Tensor) -> bool:
    if t.numel() == 0:
        return True
    lo, hi = host_range(t)
    return math.isfinite(lo) and math.isfinite(hi)


def _host_coef(v: CoefLike, K: int, op: str, name: str, nonneg: bool = False) -> torch.Tensor:
    """Per-client scalars (FedECADO) as a contiguous float64 HOST tensor of length K, finite (and >= 0
    with ``nonneg``) in eager mode. A vector that is not 1-D float of length K is handed on as it is,
    on the host, for the native op to name its length or dtype error."""
    t = torch.as_tensor(v, dtype=torch.float64) if not isinstance(v, torch.Tensor) else v
    if t.dim() != 1 or t.size(0) != K or not t.dtype.is_floating_point:
        return t.detach().cpu()  # (on the host, as every host vector: the op's device is U's)
    t = t.detach().to(device=HOST, dtype=torch.float64).contiguous()
    if not tracing() and K:
        lo, hi = host_range(t)
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise ValueError(f"{op}: {name} must be finite, got {t.tolist() if K <= 16 else 'non-finite entries'}")
        if nonneg and lo < 0:
            raise ValueError(
                f"{op}: {name} must be >= 0 (1/g_i; 0 = ECADO limit), "
                f"got {t.tolist() if K <= 16 else 'negative entries'}"
            )
    return t


def _no_grad_through(op: str, *tensors: Any) -> None:
    """Mutating / out= variants have no derivative: refuse inputs that would need one."""
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
        raise RuntimeError(
            f"fedkernels.{op} has no derivative (it writes its result in place / into out=); "
            "call it under torch.no_grad(), or use the out-of-place op where one exists"
        )


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.numel() > 0 and b.numel() > 0 and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


_DISPATCH_KEY = {"cuda": "CUDA", "xpu": "XPU", "mps": "MPS", "hip": "HIP"}


def has_kernel(native: str, device: torch.device) -> bool:
    """True when ``fedkernels::<native>`` has a kernel for ``device`` in this build."""
    if device.type in ("cpu", "meta"):
        return True
    key = _DISPATCH_KEY.get(device.type, "PrivateUse1")
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"fedkernels::{native}", key)


def _needs_kernel(native: str, device: torch.device, op: str) -> None:
    """One clear error before any work when ``fedkernels::<native>`` has no kernel for ``device``
    in this build (e.g. a CPU-only build given CUDA tensors)."""
    if tracing():
        return
    if not has_kernel(native, device):
        raise ValueError(
            f"{op}: this build of fedkernels has no {device.type} kernel for fedkernels::{native}; "
            f"pass CPU tensors (got {device})"
        )


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


# ---- what the fake kernels need (torch.compile, opcheck) -------------------------------------------
def fake_size(t: torch.Tensor, i: int) -> int:
    """``t.size(i)`` for a fake kernel's output shape, 0 when t has no dimension i: the native op refuses
    such a tensor when the compiled graph runs, and tracing must not stop first on an IndexError."""
    return t.size(i) if t.dim() > i else 0


def fake_devices(op: str, like: torch.Tensor, but: str, **tensors: Optional[torch.Tensor]) -> None:
    """The native op's device rule, in the fake kernels: a meta tensor among the arguments sends the call
    to the fake, where the C++ checks cannot run, so a mix of devices is refused here in their words
    ("base is on meta but U is on cpu"; ``but``: "U is on", "the rows are on")."""
    for name, t in tensors.items():
        if t is not None and t.device != like.device:
            raise ValueError(f"{op}: {name} is on {t.device} but {but} {like.device}")
