"""Fused local steps for client rules: one native pass instead of gradient edits + optimizer.step().

A rule's ``step(ctx, model, optimizer)`` hook calls :func:`fused_sgd_step` with its correction
(SCAFFOLD/FedPVR ``c - c_i``) or its Local GC mask (the step itself: ``fedkernels.optim.sgd_step_``,
shared with the ``FusedSGD`` optimizer). When the optimizer is a plain
``torch.optim.SGD`` (one parameter group, dampening 0, no Nesterov, not maximising) over exactly
those parameters, the step is done by ``ops.fused_sgd_step_`` with torch-SGD semantics and the
optimizer's own momentum buffers (so a later ``optimizer.step()`` continues identically), and the
function returns True. Otherwise it returns False and the rule falls back to editing ``p.grad``
and letting the optimizer step.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from ..optim import sgd_step_


def plain_sgd(optimizer, params: Sequence[torch.Tensor]) -> Optional[dict]:
    """The SGD hyper-parameters if ``optimizer`` steps exactly ``params`` like the fused op would."""
    if type(optimizer) is not torch.optim.SGD or len(optimizer.param_groups) != 1:
        return None
    g = optimizer.param_groups[0]
    if g.get("nesterov") or g.get("dampening", 0) != 0 or g.get("maximize") or g.get("differentiable"):
        return None
    if {id(p) for p in g["params"] if p.grad is not None} != {id(p) for p in params if p.grad is not None}:
        return None
    return {
        "lr": float(g["lr"]),
        "momentum": float(g.get("momentum", 0.0)),
        "weight_decay": float(g.get("weight_decay", 0.0)),
    }


def fused_sgd_step(
    optimizer,
    params: Sequence[torch.Tensor],
    *,
    c_add: Optional[List] = None,
    gc_mask=None,
    vector_policy: str = "skip",
    min_fanin: int = 2,
) -> bool:
    """Does the optimizer's step natively with the correction / GC fused in; False if not eligible.

    ``c_add``: one tensor-or-None per parameter, added to the gradient (SCAFFOLD's ``c - c_i``).
    ``gc_mask``: one bool per parameter (Local GC on that parameter's gradient rows)."""
    hp = plain_sgd(optimizer, params)
    if hp is None:
        return False
    sgd_step_(
        params,
        optimizer.state,
        lr=hp["lr"],
        momentum=hp["momentum"],
        weight_decay=hp["weight_decay"],
        c_add=c_add,
        gc_mask=gc_mask,
        vector_policy=vector_policy,
        min_fanin=min_fanin,
    )
    return True
