"""Fused local steps for client rules: one native pass instead of gradient edits + optimizer.step().

A rule's ``step(ctx, model, optimizer)`` hook calls :func:`fused_sgd_step` with its correction
(SCAFFOLD/FedPVR ``c - c_i``) or its Local GC mask. When the optimizer is a plain
``torch.optim.SGD`` (one parameter group, dampening 0, no Nesterov, not maximising) over exactly
those parameters, the step is done by ``ops.fused_sgd_step_`` with torch-SGD semantics and the
optimizer's own momentum buffers (so a later ``optimizer.step()`` continues identically), and the
function returns True. Otherwise it returns False and the rule falls back to editing ``p.grad``
and letting the optimizer step.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from .. import ops


def plain_sgd(optimizer, params: Sequence[torch.Tensor]) -> Optional[dict]:
    """The SGD hyper-parameters if ``optimizer`` steps exactly ``params`` like the fused op would."""
    if type(optimizer) is not torch.optim.SGD or len(optimizer.param_groups) != 1:
        return None
    g = optimizer.param_groups[0]
    if g.get("nesterov") or g.get("dampening", 0) != 0 or g.get("maximize") or g.get("differentiable"):
        return None
    if {id(p) for p in g["params"] if p.grad is not None} != {id(p) for p in params if p.grad is not None}:
        return None
    return {"lr": float(g["lr"]), "momentum": float(g.get("momentum", 0.0)),
            "weight_decay": float(g.get("weight_decay", 0.0))}


def fused_sgd_step(optimizer, params: Sequence[torch.Tensor], *, c_add: Optional[List] = None,
                   gc_mask=None, vector_policy: str = "skip", min_fanin: int = 2) -> bool:
    """Does the optimizer's step natively with the correction / GC fused in; False if not eligible.

    ``c_add``: one tensor-or-None per parameter, added to the gradient (SCAFFOLD's ``c - c_i``).
    ``gc_mask``: one bool per parameter (Local GC on that parameter's gradient rows)."""
    hp = plain_sgd(optimizer, params)
    if hp is None:
        return False
    keep = [i for i, p in enumerate(params) if p.grad is not None]
    ps = [params[i] for i in keep]
    if not ps:
        return True
    bufs = None
    first = False
    if hp["momentum"] != 0:
        states = [optimizer.state[p] for p in ps]
        have = [s.get("momentum_buffer") is not None for s in states]
        if any(have) and not all(have):
            return False
        first = not any(have)
        if first:
            for s, p in zip(states, ps):
                s["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        bufs = [s["momentum_buffer"] for s in states]
    with torch.no_grad():
        ops.fused_sgd_step_(ps, [p.grad for p in ps], bufs, lr=hp["lr"], momentum=hp["momentum"],
                            weight_decay=hp["weight_decay"], first_step=first,
                            c_add=None if c_add is None else [c_add[i] for i in keep],
                            gc_mask=None if gc_mask is None else [bool(gc_mask[i]) for i in keep],
                            vector_policy=vector_policy, min_fanin=min_fanin)
    return True
