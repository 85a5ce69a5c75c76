"""Fused local SGD steps: ``fused_sgd_step_``, ``corrected_sgd_step_`` (SCAFFOLD / FedPVR),
``gc_sgd_step_`` (Local GC).

One native pass per local step (``csrc/cpu/fused_sgd_step.cpp``); float64 oracle:
``fedkernels.reference``. In place, no derivative (optimizer steps run under ``torch.no_grad``).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, cast

import torch

from .._types import GcMask, TensorsOrNone
from ._checks import _finite_number, _needs_kernel, _no_grad_through
from .gc_project import GC_VECTOR_POLICIES

__all__ = ["fused_sgd_step_", "corrected_sgd_step_", "gc_sgd_step_"]

# Native, because it pays (bench/cpu_gc.py, 1 thread, loaded 2-core AVX-512 machine, median time of
# the composition / time of the fused op; CNN 2.2M and ResNet18-GN 11.2M parameters, fp32):
#   SCAFFOLD step (c, c_i, momentum, wd): 2.7-2.8x over the _foreach composition (1.7-2.1x over
#     _foreach correction + torch._fused_sgd_);
#   Local GC + momentum SGD: 2.1-2.6x over gc_project_ + _foreach (1.1-1.3x over gc_project_ +
#     torch._fused_sgd_). Current numbers: bench/results/cpu-gc.json.


def _tensor_entries(xs: object, op: str, name: str, optional_entries: bool = False) -> List[Any]:
    """``xs`` as a list whose entries are tensors (or None with ``optional_entries``): the types only.
    Their lengths, shapes, dtypes and devices are the native op's checks
    (csrc/fused_sgd_step_checks.h)."""
    if isinstance(xs, torch.Tensor) or not isinstance(xs, (list, tuple)):
        raise TypeError(f"{op}: {name} must be a list or tuple of tensors, got {type(xs).__name__}")
    xs = list(xs)
    for i, x in enumerate(xs):
        if not (isinstance(x, torch.Tensor) or (x is None and optional_entries)):
            raise TypeError(f"{op}: {name}[{i}] must be a torch.Tensor, got {type(x).__name__}")
    return xs


def fused_sgd_step_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_bufs: Optional[Sequence[torch.Tensor]] = None,
    *,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    first_step: bool = False,
    c_add: Optional[TensorsOrNone] = None,
    c_sub: Optional[TensorsOrNone] = None,
    gc_mask: GcMask = None,
    vector_policy: str = "skip",
    min_fanin: int = 2,
) -> List[torch.Tensor]:
    """One SGD step over a list of parameters in one native pass (torch.optim.SGD semantics,
    dampening 0, no Nesterov), with the SCAFFOLD/FedPVR correction and Local GC fused in::

        d   = GC(g) [where gc_mask] + c_add - c_sub [where given] + weight_decay * p
        buf = d (first_step) or momentum * buf + d        (momentum != 0)
        p  -= lr * buf                                     (lr * d when momentum == 0)

    ``params`` and ``momentum_bufs`` are updated in place; ``grads`` is not modified. ``c_add`` and
    ``c_sub`` are None or lists with one tensor-or-None per parameter (None: no correction on that
    tensor, e.g. FedPVR's S_sgd part). ``gc_mask`` is None (no GC), a bool for all, or one bool per
    parameter; GC is per output-channel row of g, as :func:`gc_project_` with ``vector_policy`` and
    ``min_fanin`` (the GC-Fed [CODE] order: GC on the raw gradient, then weight decay, then momentum).
    ``first_step`` initialises the buffers as torch does (buf = d) instead of reading them. Arithmetic
    in fp32 (fp64 for fp64 parameters); all tensors of a parameter share its shape, dtype and device.
    Returns ``params``.
    """
    op = "fused_sgd_step_"
    params = _tensor_entries(params, op, "params")
    n = len(params)
    grads = _tensor_entries(grads, op, "grads")
    lr = _finite_number(lr, op, "lr")
    momentum = _finite_number(momentum, op, "momentum")
    weight_decay = _finite_number(weight_decay, op, "weight_decay")
    if momentum < 0:
        raise ValueError(f"{op}: momentum must be >= 0, got {momentum}")
    if momentum != 0:
        if momentum_bufs is None:
            raise ValueError(f"{op}: momentum_bufs are required when momentum != 0")
        bufs = _tensor_entries(momentum_bufs, op, "momentum_bufs")
    else:
        bufs = []
    ca = [] if c_add is None else _tensor_entries(c_add, op, "c_add", optional_entries=True)
    cs = [] if c_sub is None else _tensor_entries(c_sub, op, "c_sub", optional_entries=True)
    for name, given, lst in (("c_add", c_add, ca), ("c_sub", c_sub, cs)):
        # (the native op reads an empty list as "no correction", the wrapper's is None; and it cannot
        # be called with no tensor at all: the length of a list without a tensor is checked here)
        if given is not None and len(lst) != n and all(t is None for t in lst):
            raise ValueError(f"{op}: {name} must have one entry per parameter ({n}), got {len(lst)}")
    if gc_mask is None or gc_mask is False:
        mask = []
    elif gc_mask is True:
        mask = [True] * n
    else:
        mask = [bool(m) for m in gc_mask]
        if len(mask) != n:
            raise ValueError(f"{op}: gc_mask must have one entry per parameter ({n}), got {len(mask)}")
    if mask and vector_policy not in GC_VECTOR_POLICIES:
        raise ValueError(f"{op}: vector_policy must be 'skip' or 'center', got {vector_policy!r}")
    if isinstance(min_fanin, bool) or not isinstance(min_fanin, int) or min_fanin < 1:
        raise ValueError(f"{op}: min_fanin must be an int >= 1, got {min_fanin!r}")
    # (shapes, dtypes, devices and list lengths: the native op checks them; with no parameters it is
    # called only when another list is not empty, to raise that list's length error)
    tensors = [t for t in (*grads, *bufs, *ca, *cs) if t is not None]
    if n == 0 and not tensors:
        return params
    _needs_kernel("fused_sgd_step_", (params or tensors)[0].device, op)
    _no_grad_through(op, *params, *bufs)
    # non-contiguous tensors: read-only ones are copied in; mutated ones are copied in and back
    write_back = []
    work_p = []
    for p in params:
        if p.is_contiguous():
            work_p.append(p)
        else:
            c = p.contiguous()
            work_p.append(c)
            write_back.append((p, c))
    work_b = []
    for b in bufs:
        if b.is_contiguous():
            work_b.append(b)
        else:
            c = b.contiguous()
            work_b.append(c)
            write_back.append((b, c))
    grads = [g if g.is_contiguous() else g.contiguous() for g in grads]
    ca = [c if c is None or c.is_contiguous() else c.contiguous() for c in ca]
    cs = [c if c is None or c.is_contiguous() else c.contiguous() for c in cs]
    torch.ops.fedkernels.fused_sgd_step_(
        work_p, grads, work_b, ca, cs, mask, lr, momentum, weight_decay, bool(first_step), vector_policy, min_fanin
    )
    for dst, src in write_back:
        dst.copy_(src)
    return params


def corrected_sgd_step_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    c: TensorsOrNone,
    c_i: Optional[TensorsOrNone] = None,
    momentum_bufs: Optional[Sequence[torch.Tensor]] = None,
    *,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    first_step: bool = False,
    subset: Optional[Sequence[int]] = None,
) -> List[torch.Tensor]:
    """SCAFFOLD / FedPVR local step ``p -= lr * (g - c_i + c)`` (with torch-SGD momentum and weight
    decay on the corrected gradient), one native pass.

    ``c`` and ``c_i``: one tensor per parameter (server and client control variates); pass
    ``c_i=None`` when ``c`` already holds the per-round difference ``c - c_i`` (one vector fewer to
    read per step). ``subset``: indices (or a bool list) of the parameters that get the correction
    (FedPVR's S_ctrl); the others take a plain SGD step. Entries of c/c_i outside the subset may be None.
    """
    if isinstance(params, torch.Tensor) or not isinstance(params, (list, tuple)):
        raise TypeError(f"corrected_sgd_step_: params must be a list or tuple of tensors, got {type(params).__name__}")
    n = len(params)
    if subset is None:
        keep = [True] * n
    else:
        subset = list(subset)
        if subset and all(isinstance(s, bool) for s in subset):
            if len(subset) != n:
                raise ValueError(f"corrected_sgd_step_: a bool subset must have {n} entries, got {len(subset)}")
            keep = cast(List[bool], subset)  # all entries are bools (checked above)
        else:
            keep = [False] * n
            for s in subset:
                if isinstance(s, bool) or not isinstance(s, int) or not -n <= s < n:
                    raise ValueError(f"corrected_sgd_step_: subset entries must be indices in [0, {n}), got {s!r}")
                keep[s] = True
    if not isinstance(c, (list, tuple)) or len(c) != n:
        raise ValueError(f"corrected_sgd_step_: c must be a list with one entry per parameter ({n})")
    ca = [x if k else None for x, k in zip(c, keep)]
    cs = None
    if c_i is not None:
        if not isinstance(c_i, (list, tuple)) or len(c_i) != n:
            raise ValueError(f"corrected_sgd_step_: c_i must be a list with one entry per parameter ({n})")
        cs = [x if k else None for x, k in zip(c_i, keep)]
    for name, lst in (("c", ca), ("c_i", cs)):
        if lst is not None and any(x is None for x, k in zip(lst, keep) if k):
            raise ValueError(f"corrected_sgd_step_: {name} has None for a parameter in the corrected subset")
    return fused_sgd_step_(
        params,
        grads,
        momentum_bufs,
        lr=lr,
        momentum=momentum,
        weight_decay=weight_decay,
        first_step=first_step,
        c_add=ca,
        c_sub=cs,
    )


def gc_sgd_step_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_bufs: Optional[Sequence[torch.Tensor]] = None,
    *,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    first_step: bool = False,
    gc_mask: GcMask = True,
    vector_policy: str = "skip",
    min_fanin: int = 2,
) -> List[torch.Tensor]:
    """Local GC + SGD step (GC-Fed §2.2, [CODE] order) in one native pass: per output-channel row
    g~ = g - mean(g) (where ``gc_mask``), d = g~ + wd*p, buf = momentum*buf + d (d on the first
    step), p -= lr*buf. ``grads`` is not modified."""
    return fused_sgd_step_(
        params,
        grads,
        momentum_bufs,
        lr=lr,
        momentum=momentum,
        weight_decay=weight_decay,
        first_step=first_step,
        gc_mask=gc_mask,
        vector_policy=vector_policy,
        min_fanin=min_fanin,
    )


@torch.library.register_fake("fedkernels::fused_sgd_step_")
def _fused_sgd_step_fake(
    params: List[torch.Tensor],
    grads: List[torch.Tensor],
    momentum_bufs: List[torch.Tensor],
    c_add: List[Optional[torch.Tensor]],
    c_sub: List[Optional[torch.Tensor]],
    gc_mask: List[bool],
    lr: float,
    momentum: float,
    weight_decay: float,
    first_step: bool,
    vector_policy: str = "skip",
    min_fanin: int = 2,
) -> None:
    return None
