"""GC-Fed's options and ablations, apart from the method (gcfed/__init__.py).

* :func:`check_options` - the constructor's option checks.
* :func:`gc_mean_variant_` - the Table-8 ablation: subtract the mean over other axes of a conv weight
  (``mu``, spec §2.6).
* :func:`post_wd_step` / :func:`post_momentum_step` - the Local GC orders the spec offers only as
  ablation flags (§2.2): GC2020's "post_wd" (wd, then GC, then the optimizer's momentum and step) and
  "post_momentum" (GC on the momentum direction). The default "pre_wd" (the official code) is the
  method's own ``LocalGCRule``.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch

from ..parts import WEIGHTINGS, check_choice

VECTOR_POLICIES = ("center", "skip")
# mean-vector variants for conv weights (spec §2.6): name -> axes reduced (None = the standard row)
MU_VARIANTS = {"cout": None, "cout_cin": (2, 3), "cout_taps": (1,), "cout_cin_kw": (2,), "cin_taps": (0,)}
LOCAL_ORDERS = ("pre_wd", "post_wd", "post_momentum")
LOCAL_LAYERS = ("all_except", "first_fraction", "all", "none")
GLOBAL_SCOPES = ("all", "complement", "none")


def check_options(
    name: str,
    local_layers: str,
    global_scope: str,
    vector_policy: str,
    mu: str,
    weighting: str,
    local_order: str,
    lam: Optional[float],
    min_fanin,
) -> None:
    """One-line ValueError for the first option outside its allowed values."""
    for opt, val, allowed in (
        ("local_layers", local_layers, LOCAL_LAYERS),
        ("global_scope", global_scope, GLOBAL_SCOPES),
        ("vector_policy", vector_policy, VECTOR_POLICIES),
        ("mu", mu, tuple(MU_VARIANTS)),
        ("weighting", weighting, WEIGHTINGS),
        ("local_order", local_order, LOCAL_ORDERS),
    ):
        check_choice(name, opt, val, allowed)
    if local_layers == "first_fraction" and (lam is None or not 0.0 <= lam <= 1.0):
        raise ValueError(f"{name}: lam must lie in [0, 1] with local_layers='first_fraction', got {lam!r}")
    if int(min_fanin) < 1:
        raise ValueError(f"{name}: min_fanin must be >= 1, got {min_fanin!r}")


def gc_mean_variant_(t: torch.Tensor, variant: str) -> torch.Tensor:
    """Table-8 ablation on one 4-D conv tensor: subtract the mean over MU_VARIANTS[variant] axes."""
    axes = MU_VARIANTS[variant]
    acc = torch.float64 if t.dtype == torch.float64 else torch.float32
    v = t.detach().to(acc)
    t.detach().copy_((v - v.mean(dim=axes, keepdim=True)).to(t.dtype))
    return t


def post_wd_step(
    name: str, params: Sequence[torch.Tensor], weight_decay: float, optimizer, center_local: Callable[[], None]
) -> bool:
    """GC2020 order: g += wd p on every tensor of ``params``, ``center_local()`` (GC on the local
    ones), then the optimizer's step with its own weight decay suspended when that is where wd came
    from (wd is ``weight_decay`` or, when that is 0, the optimizer's; both set raises). Returns
    whether the step was taken (False without an optimizer)."""
    groups = list(getattr(optimizer, "param_groups", []))
    opt_wd = {float(g.get("weight_decay", 0.0) or 0.0) for g in groups}
    opt_wd.discard(0.0)
    if weight_decay and opt_wd:
        raise ValueError(
            f"{name}: local_order='post_wd' got weight decay twice (weight_decay="
            f"{weight_decay} and the optimizer's weight_decay={sorted(opt_wd)}); set one of them"
        )
    if len(opt_wd) > 1:
        raise ValueError(
            f"{name}: local_order='post_wd' needs one weight_decay for all parameter groups, got {sorted(opt_wd)}"
        )
    wd = weight_decay or (opt_wd.pop() if opt_wd else 0.0)
    withg = [p for p in params if p.grad is not None]
    with torch.no_grad():
        if wd and withg:
            torch._foreach_add_([p.grad for p in withg], [p.detach() for p in withg], alpha=wd)
        center_local()
    if optimizer is None:
        return False
    saved = [g.get("weight_decay", 0.0) for g in groups]
    for g in groups:
        if "weight_decay" in g:
            g["weight_decay"] = 0.0
    try:
        optimizer.step()
    finally:
        for g, w in zip(groups, saved):
            if "weight_decay" in g:
                g["weight_decay"] = w
    return True


def post_momentum_step(
    params: Sequence[torch.Tensor],
    local: Sequence[torch.Tensor],
    bufs: Dict[int, torch.Tensor],
    lr: float,
    weight_decay: float,
    momentum: float,
    center: Callable[[List[torch.Tensor]], object],
) -> bool:
    """The SGD step with GC on the momentum direction: d = g + wd p, buf = mu buf + d (un-centred,
    kept in ``bufs``), p -= lr * center(buf) on the ``local`` tensors, p -= lr * buf elsewhere."""
    local_ids = {id(p) for p in local}
    with torch.no_grad():
        dirs_local = []
        for p in params:
            if p.grad is None:
                continue
            d = p.grad.detach().clone()
            if weight_decay:
                d.add_(p.detach(), alpha=weight_decay)
            b = bufs.get(id(p))
            if b is None or momentum == 0:
                b = d
            else:
                b.mul_(momentum).add_(d)
            bufs[id(p)] = b
            if id(p) in local_ids:
                dirs_local.append((p, b.clone()))
            else:
                p.sub_(b, alpha=lr)
        cent = [d for _, d in dirs_local]
        center(cent)
        for (p, _), d in zip(dirs_local, cent):
            p.sub_(d, alpha=lr)
    return True
