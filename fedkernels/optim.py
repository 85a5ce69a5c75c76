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

from typing import Callable, Dict, Iterable, Optional, Sequence, Union

import torch

from . import ops

__all__ = ["FusedSGD"]


class FusedSGD(torch.optim.Optimizer):
    """SGD (momentum, weight decay) with an optional per-parameter gradient correction
    (:meth:`set_correction`) and Local GC (group option ``gc``), one native pass per step."""

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, weight_decay: float = 0.0,
                 gc: bool = False, vector_policy: str = "skip", min_fanin: int = 2):
        for name, v in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not float(v) >= 0 or v == float("inf"):
                raise ValueError(f"FusedSGD: {name} must be a finite number >= 0, got {v!r}")
        if vector_policy not in ("skip", "center"):
            raise ValueError(f"FusedSGD: vector_policy must be 'skip' or 'center', got {vector_policy!r}")
        if isinstance(min_fanin, bool) or not isinstance(min_fanin, int) or min_fanin < 1:
            raise ValueError(f"FusedSGD: min_fanin must be an int >= 1, got {min_fanin!r}")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, gc=bool(gc),
                        vector_policy=vector_policy, min_fanin=min_fanin)
        super().__init__(params, defaults)

    def set_correction(self, correction: Union[None, Dict[torch.Tensor, Optional[torch.Tensor]],
                                               Sequence[Optional[torch.Tensor]]]) -> None:
        """The tensor added to each parameter's gradient at every step (SCAFFOLD/FedPVR: c - c_i):
        a dict {parameter: tensor or None}, or a list with one tensor-or-None per parameter in
        ``param_groups`` order; None clears every correction. Kept in the optimizer state."""
        allp = [p for g in self.param_groups for p in g["params"]]
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
                raise ValueError(f"FusedSGD.set_correction: got {len(correction)} tensors, expected one per "
                                 f"parameter ({len(allp)})")
            items = list(zip(allp, correction))
        for p, c in items:
            if c is not None and (not isinstance(c, torch.Tensor) or c.shape != p.shape):
                got = tuple(c.shape) if isinstance(c, torch.Tensor) else type(c).__name__
                raise ValueError(f"FusedSGD.set_correction: correction of shape {got} for a parameter of "
                                 f"shape {tuple(p.shape)}")
        for p, c in items:
            st = self.state[p]
            if c is None:
                st.pop("correction", None)
            else:
                st["correction"] = c.detach().to(device=p.device, dtype=p.dtype)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            ps = [p for p in group["params"] if p.grad is not None]
            if not ps:
                continue
            mom = float(group["momentum"])
            # parameters whose momentum buffer exists continue it; the others start it (buf = d)
            parts = [(ps, False)]
            if mom != 0:
                parts = [([p for p in ps if "momentum_buffer" in self.state[p]], False),
                         ([p for p in ps if "momentum_buffer" not in self.state[p]], True)]
            for sel, first in parts:
                if not sel:
                    continue
                if mom != 0 and first:
                    for p in sel:
                        self.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                corr = [self.state[p].get("correction") for p in sel]
                ops.fused_sgd_step_(sel, [p.grad for p in sel],
                                    [self.state[p]["momentum_buffer"] for p in sel] if mom != 0 else None,
                                    lr=float(group["lr"]), momentum=mom, weight_decay=float(group["weight_decay"]),
                                    first_step=first, c_add=corr if any(c is not None for c in corr) else None,
                                    gc_mask=bool(group["gc"]), vector_policy=group["vector_policy"],
                                    min_fanin=int(group["min_fanin"]))
        return loss
