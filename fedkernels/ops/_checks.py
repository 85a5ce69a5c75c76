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
from typing import Any, List, Literal, Optional, Protocol, Sequence, Union, overload

import torch

from .._types import CoefLike, RowsLike

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
HOST = torch.device("cpu")


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
    """A 2-D float matrix with unit column stride (copied once if it has none)."""
    U = _tensor(U, op, name)
    if U.dim() != 2:
        raise ValueError(f"{op}: {name} must be a 2-D [K, d] tensor, got shape {tuple(U.shape)}")
    _float_dtype(U, op, name)
    if U.size(1) > 1 and U.stride(1) != 1:
        U = U.contiguous()
    if U.size(0) > 1 and U.stride(0) < U.size(1):  # e.g. expanded or overlapping rows
        U = U.contiguous()
    return U


def _like(v: Typed, op: str, name: str, like: Typed, like_name: str = "U") -> None:
    """``v`` has the dtype and device of ``like`` (the rule of every op wrapper and of
    ``Aggregator.validate``, worded once)."""
    if v.dtype != like.dtype:
        raise ValueError(f"{op}: {name} must have dtype {like.dtype} (the dtype of {like_name}), got {v.dtype}")
    if v.device != like.device:
        raise ValueError(f"{op}: {name} is on {v.device} but {like_name} is on {like.device}")


def _vector(v: object, op: str, name: str, length: int, like: torch.Tensor) -> torch.Tensor:
    v = _tensor(v, op, name)
    if v.dim() != 1 or v.size(0) != length:
        raise ValueError(f"{op}: {name} must be a 1-D tensor of length {length}, got shape {tuple(v.shape)}")
    _like(v, op, name, like)
    return v


@overload
def _rows(rows: None, K: int, op: str) -> None: ...


@overload
def _rows(rows: Union[torch.Tensor, Sequence[int]], K: int, op: str) -> torch.Tensor: ...


@overload
def _rows(rows: RowsLike, K: int, op: str) -> Optional[torch.Tensor]: ...


def _rows(rows: RowsLike, K: int, op: str) -> Optional[torch.Tensor]:
    """Row indices as a contiguous int64 HOST tensor, each in [0, K) (checked on the host for every
    device: a device tensor is copied to the host once)."""
    if rows is None:
        return None
    if isinstance(rows, torch.Tensor):
        r = rows.detach()
        if r.device.type != "cpu":
            r = r.to(HOST)
    else:
        r = torch.as_tensor(rows)
    if r.dim() != 1:
        raise ValueError(f"{op}: rows must be a 1-D sequence of row indices, got shape {tuple(r.shape)}")
    if r.numel() and (r.dtype.is_floating_point or r.dtype.is_complex or r.dtype == torch.bool):
        raise ValueError(f"{op}: rows must hold integer row indices, got dtype {r.dtype}")
    r = r.to(torch.long)
    if r.numel() and not tracing() and not _batched(r):
        lo, hi = int(r.min()), int(r.max())
        if lo < 0 or hi >= K:
            raise ValueError(f"{op}: rows must lie in [0, {K}), got min {lo} max {hi}")
    return r.contiguous()


def _coef(coef: CoefLike, n: int, op: str, name: str = "coef") -> torch.Tensor:
    """``n`` float coefficients as a HOST tensor (a device tensor is copied to the host once; the
    copy is differentiable, so autograd still reaches a device ``coef``); finite in eager mode."""
    c = coef if isinstance(coef, torch.Tensor) else torch.as_tensor(coef, dtype=torch.float64)
    if c.dim() != 1 or c.size(0) != n:
        raise ValueError(
            f"{op}: {name} must be a 1-D tensor of length {n} (one per selected row), got shape {tuple(c.shape)}"
        )
    if not c.dtype.is_floating_point:
        c = c.to(torch.float64)
    if c.device.type != "cpu":
        c = c.to(HOST)
    if not tracing() and not _batched(c) and not _finite_range(c):
        raise ValueError(f"{op}: {name} must be finite, got {c.tolist() if n <= 16 else 'non-finite entries'}")
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
    """Per-client scalars (FedECADO) as a contiguous float64 HOST tensor of length K."""
    t = torch.as_tensor(v, dtype=torch.float64) if not isinstance(v, torch.Tensor) else v
    if t.dim() != 1 or t.size(0) != K:
        raise ValueError(
            f"{op}: {name} must be a 1-D sequence of length K = {K} (one per client), got shape {tuple(t.shape)}"
        )
    if not t.dtype.is_floating_point:
        raise ValueError(f"{op}: {name} must be a float tensor, got {t.dtype}")
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


@overload
def _tensor_list(
    xs: object, n: int, op: str, name: str, params: Sequence[torch.Tensor], optional_entries: Literal[False] = ...
) -> List[torch.Tensor]: ...


@overload
def _tensor_list(
    xs: object, n: int, op: str, name: str, params: Sequence[torch.Tensor], optional_entries: Literal[True]
) -> List[Optional[torch.Tensor]]: ...


def _tensor_list(
    xs: object, n: int, op: str, name: str, params: Sequence[torch.Tensor], optional_entries: bool = False
) -> List[Any]:
    """``n`` tensors, each matching ``params[i]`` in shape, dtype and device (None allowed with
    ``optional_entries``)."""
    if isinstance(xs, torch.Tensor) or not isinstance(xs, (list, tuple)):
        raise TypeError(f"{op}: {name} must be a list or tuple of tensors, got {type(xs).__name__}")
    xs = list(xs)
    if len(xs) != n:
        raise ValueError(f"{op}: {name} must have one entry per parameter ({n}), got {len(xs)}")
    out: List[Optional[torch.Tensor]] = []
    for i, (x, p) in enumerate(zip(xs, params)):
        if x is None and optional_entries:
            out.append(None)
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{op}: {name}[{i}] must be a torch.Tensor, got {type(x).__name__}")
        if x.shape != p.shape or x.dtype != p.dtype or x.device != p.device:
            raise ValueError(
                f"{op}: {name}[{i}] must match params[{i}] (shape {tuple(p.shape)}, {p.dtype}, "
                f"{p.device}), got shape {tuple(x.shape)}, {x.dtype}, {x.device}"
            )
        out.append(x)
    return out


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
