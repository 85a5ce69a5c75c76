"""Gradient centralization (GC-Fed): ``gc_project_``, ``gc_project``, ``gc_project_flat_``.

Per output-channel row mean subtraction of many tensors in one native call
(``csrc/cpu/gc_project.cpp``, ``csrc/cuda/gc_project.cu``); float64 oracle:
``fedkernels.reference.gc_project``. The out-of-place ``gc_project`` is differentiable (GC is a
linear projection, its own adjoint); the in-place ``gc_project_`` is not.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Protocol, Sequence, Tuple

import torch

from . import _autograd as _ag
from ._checks import _needs_kernel, _no_grad_through, _tensor, tracing

__all__ = ["gc_project_", "gc_project", "gc_project_flat_", "GC_VECTOR_POLICIES"]

GC_VECTOR_POLICIES = ("skip", "center")


class _LayoutEntry(Protocol):
    """One tensor of a flat layout (what ``gc_project_flat_`` reads of a ``flat.ParamEntry``)."""

    @property
    def offset(self) -> int: ...

    @property
    def numel(self) -> int: ...

    @property
    def shape(self) -> Tuple[int, ...]: ...


class FlatLayout(Protocol):
    """A flat-vector layout as :class:`fedkernels.flat.FlatSpec` provides it (structural type: ops
    sit below ``flat`` and never import it)."""

    @property
    def d(self) -> int: ...

    @property
    def entries(self) -> Sequence[_LayoutEntry]: ...


def _gc_args(tensors: object, vector_policy: object, min_fanin: object, op: str) -> List[torch.Tensor]:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{op}: tensors must be a list or tuple of tensors, got {type(tensors).__name__}")
    if vector_policy not in GC_VECTOR_POLICIES:
        raise ValueError(f"{op}: vector_policy must be 'skip' or 'center', got {vector_policy!r}")
    if isinstance(min_fanin, bool) or not isinstance(min_fanin, int) or min_fanin < 1:
        raise ValueError(f"{op}: min_fanin must be an int >= 1, got {min_fanin!r}")
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: tensors[{i}] must be a torch.Tensor, got {type(t).__name__}")
    # (dtypes and devices: the native op checks them, csrc/gc_project_checks.h)
    if tensors:
        _needs_kernel(op.rstrip("_") if op == "gc_project" else "gc_project_", tensors[0].device, op)
    return tensors


def gc_project_(tensors: Sequence[torch.Tensor], vector_policy: str = "skip", min_fanin: int = 2) -> List[torch.Tensor]:
    """Gradient centralization of many tensors in one call, in place (GC-Fed spec §2.1).

    Every output-channel row ``X[i]`` (dim 0; row length M = numel / size(0)) becomes
    ``X[i] - mean(X[i])``. 1-D tensors (biases, norm weights) are left alone with
    ``vector_policy="skip"`` (standard GC) or centred as one row with ``"center"`` (the GC-Fed code).
    0-D tensors, empty tensors and tensors whose rows are shorter than ``min_fanin`` are unchanged
    (M = 1 would zero the gradient). Sums accumulate in fp32 (fp64 for fp64 tensors) with one rounding
    on the write; results do not depend on the thread count. Any layout is accepted (channels-last
    rows are used in place, other non-contiguous tensors go through a copy); dtypes may be mixed.
    Axis 0 is always the row axis: exclude ConvTranspose weights and embeddings yourself.
    NaN/Inf propagate to the whole row. An empty list is a no-op. Returns the list.
    """
    tensors = _gc_args(tensors, vector_policy, min_fanin, "gc_project_")
    if not tracing():  # under torch.compile, functionalization rejects in-place writes to overlapping memory
        for i, t in enumerate(tensors):
            if t.numel() > 1 and torch._debug_has_internal_overlap(t) == 1:  # 1 = MemOverlap::Yes
                raise ValueError(
                    f"gc_project_: tensors[{i}] has internally overlapping memory (e.g. from expand()) "
                    "and cannot be written in place; clone() it or use gc_project"
                )
    _no_grad_through("gc_project_", *tensors)
    if tensors:
        torch.ops.fedkernels.gc_project_(tensors, vector_policy, min_fanin)
    return tensors


def gc_project(tensors: Sequence[torch.Tensor], vector_policy: str = "skip", min_fanin: int = 2) -> List[torch.Tensor]:
    """Out-of-place :func:`gc_project_`: new tensors (same shapes, dtypes and, for dense inputs, layouts)."""
    tensors = _gc_args(tensors, vector_policy, min_fanin, "gc_project")
    if not tensors:
        return []
    if _ag.needs_grad(*tensors):
        return list(_GcProject.apply(vector_policy, min_fanin, *tensors))
    return list(_ag.call(torch.ops.fedkernels.gc_project, tensors, vector_policy, min_fanin))


def gc_project_flat_(
    vec: torch.Tensor,
    spec: FlatLayout,
    vector_policy: str = "skip",
    min_fanin: int = 2,
    select: Optional[Callable[[Any], bool]] = None,
) -> torch.Tensor:
    """Global GC on a flat vector laid out by a :class:`fedkernels.flat.FlatSpec`, in place.

    ``vec`` is ``[d]`` or ``[K, d]`` (each row centred independently, one call for all K). The spec's
    tensors are taken as views of ``vec`` (no copy); ``select(entry) -> bool`` restricts GC to some
    entries (e.g. ``lambda e: not e.is_buffer``; GC-Fed's "complement" scope). Returns ``vec``.
    """
    vec = _tensor(vec, "gc_project_flat_", "vec")
    if vec.dim() not in (1, 2) or vec.size(-1) != spec.d:
        raise ValueError(f"gc_project_flat_: vec must be [d] or [K, d] with d={spec.d}, got shape {tuple(vec.shape)}")
    if vec.size(-1) > 1 and vec.stride(-1) != 1:
        raise ValueError("gc_project_flat_: vec must have unit stride along d (views are taken in place)")
    entries = [e for e in spec.entries if select is None or select(e)]
    rows = [vec] if vec.dim() == 1 else list(vec.unbind(0))
    views = [r[e.offset : e.offset + e.numel].view(e.shape) for r in rows for e in entries]
    gc_project_(views, vector_policy, min_fanin)
    return vec


@torch.library.register_fake("fedkernels::gc_project_")
def _gc_project_inplace_fake(tensors: List[torch.Tensor], vector_policy: str = "skip", min_fanin: int = 2) -> None:
    return None


@torch.library.register_fake("fedkernels::gc_project")
def _gc_project_fake(
    tensors: List[torch.Tensor], vector_policy: str = "skip", min_fanin: int = 2
) -> List[torch.Tensor]:
    return [torch.empty_like(t) for t in tensors]


# ---- derivative: GC is an orthogonal projection P (per-row mean removal), so dX = P(g): the op
# itself applied to the incoming gradients
def _gc_setup(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
    tensors, vector_policy, min_fanin = inputs
    ctx.policy, ctx.min_fanin = vector_policy, int(min_fanin)
    ctx.like = [(t.shape, t.dtype, t.device) for t in tensors]


def _gc_backward(ctx: Any, *grads: Any) -> Tuple[Any, ...]:
    gl: Sequence[Any] = grads
    if len(grads) == 1 and isinstance(grads[0], (list, tuple)):  # the Tensor[] output's grads, as one list
        gl = grads[0]
    gs = [torch.zeros(s, dtype=dt, device=dev) if g is None else g for g, (s, dt, dev) in zip(gl, ctx.like)]
    res = (list(torch.ops.fedkernels.gc_project(gs, ctx.policy, ctx.min_fanin)), None, None)
    # torch's Tensor[] support (torch/_library/autograd.py) matches the return against the arguments
    # as the dispatcher passed them (trailing defaults dropped, plus its metadata input, for which
    # it appends the None itself): return one entry per passed argument, minus that one
    spec = getattr(getattr(ctx, "_pt_metadata", None), "input_spec", None)
    n = getattr(spec, "num_children", None) if spec is not None else None
    return res if n is None else res[: n - 1]


class _GcProject(torch.autograd.Function):
    @staticmethod
    def forward(policy: str, min_fanin: int, *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        return tuple(torch.ops.fedkernels.gc_project(list(tensors), policy, min_fanin))

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        ctx.policy, ctx.min_fanin = inputs[0], int(inputs[1])
        ctx.like = [(t.shape, t.dtype, t.device) for t in inputs[2:]]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Tuple[Optional[torch.Tensor], ...]:
        gs = [torch.zeros(s, dtype=dt, device=dev) if g is None else g for g, (s, dt, dev) in zip(grads, ctx.like)]
        return (None, None, *torch.ops.fedkernels.gc_project(gs, ctx.policy, ctx.min_fanin))


torch.library.register_autograd("fedkernels::gc_project", _gc_backward, setup_context=_gc_setup)
