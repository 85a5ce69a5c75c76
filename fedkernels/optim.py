"""``FusedSGD``: ``torch.optim.SGD`` with the SCAFFOLD/FedPVR gradient correction and Local GC
fused into one native pass per step (``ops.fused_sgd_step_``), as a ``torch.optim.Optimizer``
(LR schedulers, ``state_dict``, parameter groups work as usual)::

    opt = FusedSGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4, gc=True)
    opt.set_correction({p: c_minus_ci_view for p, ...})      # SCAFFOLD: c - c_i per parameter
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)

Per parameter, with g its gradient (torch SGD semantics, dampening 0)::

    d   = GC(g) [if the group's gc] + correction [if set] + weight_decay * p
    buf = d on its first step, else momentum * buf + d       (momentum != 0)
    p  -= lr * buf                                            (lr * d when momentum == 0)

GC is per output-channel row (``vector_policy``, ``min_fanin`` as ``ops.gc_project_``), applied
to the raw gradient (GC-Fed's [CODE] order). Nesterov, dampening and maximize are not offered.
"""

from __future__ import annotations

from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    List,
    MutableMapping,
    Optional,
    Sequence,
    Tuple,
    Union,
    cast,
    overload,
)

import torch

from . import ops
from ._types import GcMask

if TYPE_CHECKING:
    from torch.optim.optimizer import ParamsT

__all__ = ["FusedSGD", "sgd_step_"]


def sgd_step_(
    params: Sequence[torch.Tensor],
    state: MutableMapping[torch.Tensor, Dict[str, Any]],
    *,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    c_add: Optional[Sequence[Optional[torch.Tensor]]] = None,
    gc_mask: GcMask = None,
    vector_policy: str = "skip",
    min_fanin: int = 2,
) -> None:
    """One torch-SGD step over ``params`` (those with a gradient) by ``ops.fused_sgd_step_``, with
    the momentum buffers kept as torch.optim.SGD keeps them: ``state[p]["momentum_buffer"]``, created
    on a parameter's first step (buf = d). ``c_add`` / ``gc_mask``: one entry per parameter of
    ``params``. Shared by :class:`FusedSGD` and the client rules that step a torch SGD natively."""
    keep = [i for i, p in enumerate(params) if p.grad is not None]
    parts = [(keep, False)]
    if momentum != 0:  # parameters whose buffer exists continue it; the others start it
        parts = [
            ([i for i in keep if state[params[i]].get("momentum_buffer") is not None], False),
            ([i for i in keep if state[params[i]].get("momentum_buffer") is None], True),
        ]
    for idx, first in parts:
        if not idx:
            continue
        ps = [params[i] for i in idx]
        if momentum != 0 and first:
            for p in ps:
                state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        ca = None if c_add is None else [c_add[i] for i in idx]
        with torch.no_grad():
            ops.fused_sgd_step_(
                ps,
                cast(List[torch.Tensor], [p.grad for p in ps]),  # all set (keep)
                [state[p]["momentum_buffer"] for p in ps] if momentum != 0 else None,
                lr=lr,
                momentum=momentum,
                weight_decay=weight_decay,
                first_step=first,
                c_add=ca if ca is not None and any(c is not None for c in ca) else None,
                gc_mask=gc_mask if isinstance(gc_mask, bool) or gc_mask is None else [bool(gc_mask[i]) for i in idx],
                vector_policy=vector_policy,
                min_fanin=min_fanin,
            )


class FusedSGD(torch.optim.Optimizer):
    """SGD (momentum, weight decay) with an optional per-parameter gradient correction
    (:meth:`set_correction`) and Local GC (group option ``gc``), one native pass per step."""

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        gc: bool = False,
        vector_policy: str = "skip",
        min_fanin: int = 2,
    ) -> None:
        for name, v in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not float(v) >= 0 or v == float("inf"):
                raise ValueError(f"FusedSGD: {name} must be a finite number >= 0, got {v!r}")
        if vector_policy not in ("skip", "center"):
            raise ValueError(f"FusedSGD: vector_policy must be 'skip' or 'center', got {vector_policy!r}")
        if isinstance(min_fanin, bool) or not isinstance(min_fanin, int) or min_fanin < 1:
            raise ValueError(f"FusedSGD: min_fanin must be an int >= 1, got {min_fanin!r}")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            gc=bool(gc),
            vector_policy=vector_policy,
            min_fanin=min_fanin,
        )
        super().__init__(params, defaults)

    def set_correction(
        self, correction: Union[None, Dict[torch.Tensor, Optional[torch.Tensor]], Sequence[Optional[torch.Tensor]]]
    ) -> None:
        """The tensor added to each parameter's gradient at every step (SCAFFOLD/FedPVR: c - c_i):
        a dict {parameter: tensor or None}, or a list with one tensor-or-None per parameter in
        ``param_groups`` order; None clears every correction. Kept in the optimizer state."""
        allp = [p for g in self.param_groups for p in g["params"]]
        items: List[Tuple[torch.Tensor, Optional[torch.Tensor]]]
        if correction is None:
            items = [(p, None) for p in allp]
        elif isinstance(correction, dict):
            known = {id(p) for p in allp}
            if any(id(p) not in known for p in correction):
                raise ValueError("FusedSGD.set_correction: a key is not a parameter of this optimizer")
            items = list(correction.items())
        else:
            correction = list(correction)
            if len(correction) != len(allp):
                raise ValueError(
                    f"FusedSGD.set_correction: got {len(correction)} tensors, expected one per parameter ({len(allp)})"
                )
            items = list(zip(allp, correction))
        for p, c in items:
            if c is not None and (not isinstance(c, torch.Tensor) or c.shape != p.shape):
                got = tuple(c.shape) if isinstance(c, torch.Tensor) else type(c).__name__
                raise ValueError(
                    f"FusedSGD.set_correction: correction of shape {got} for a parameter of shape {tuple(p.shape)}"
                )
        for p, c in items:
            st = self.state[p]
            if c is None:
                st.pop("correction", None)
            else:
                st["correction"] = c.detach().to(device=p.device, dtype=p.dtype)

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            ps = group["params"]
            sgd_step_(
                ps,
                self.state,
                lr=float(group["lr"]),
                momentum=float(group["momentum"]),
                weight_decay=float(group["weight_decay"]),
                c_add=[self.state[p].get("correction") for p in ps],
                gc_mask=bool(group["gc"]),
                vector_policy=group["vector_policy"],
                min_fanin=int(group["min_fanin"]),
            )
        return loss
