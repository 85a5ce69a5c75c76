"""GC-Fed (Seo et al., arXiv 2503.13180): gradient centralization, local, global and hybrid.
Spec: specs/gcfed.md.

GC(X)[i, :] = X[i, :] - mean_j X[i, j] per output row (axis 0 = row, the fan-in flattened).
* Local GC (``LocalGCRule.before_step``): GC on the local-set gradients at every local step.
* Global GC (server): Delta = sum_k a_k U_k (uniform a_k by default), GC on the global-set tensors'
  rows of Delta, w <- w + server_lr * Delta. GC is linear, so this equals averaging centred updates.
* GC-Fed: Local GC on the feature layers, Global GC on the classifier (``global_layers`` module
  prefixes, default the last parameterised module) or on everything (``global_scope="all"``, the
  official code). ``local_layers="first_fraction"`` uses the first floor(lam * L) parameter tensors.

Registered: ``gcfed`` (hybrid), ``local_gc``, ``global_gc``, ``local_gc_only`` (Local GC on the
first floor(lam L) tensors, no Global GC: the paper's Fig. 9 comparison curve).
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

import torch

from .. import ops
from ._fused import fused_sgd_step
from .base import AggResult, Aggregator, ClientContext, ClientRule, RoundInput, register
from .parts import WEIGHTINGS, check_choice, client_weights

VECTOR_POLICIES = ("center", "skip")
# mean-vector variants for conv weights (spec §2.6): name -> axes reduced (None = the standard row)
MU_VARIANTS = {"cout": None, "cout_cin": (2, 3), "cout_taps": (1,), "cout_cin_kw": (2,), "cin_taps": (0,)}
LOCAL_ORDERS = ("pre_wd", "post_wd", "post_momentum")


# ---------------------------------------------------------------------------------------------
# the GC projection
# ---------------------------------------------------------------------------------------------
def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def gc_project_(tensors: Sequence[torch.Tensor], vector_policy: str = "skip", min_fanin: int = 2):
    """GC in place on many tensors in one native call (``ops.gc_project_``): subtract each output
    row's mean; 1-D tensors centred as one row under "center", left alone under "skip"; 0-D, empty
    and fan-in < min_fanin tensors left alone."""
    if tensors:
        ops.gc_project_(list(tensors), vector_policy, min_fanin)
    return tensors


def gc_mean_variant_(t: torch.Tensor, variant: str) -> torch.Tensor:
    """Table-8 ablation on one 4-D conv tensor: subtract the mean over MU_VARIANTS[variant] axes."""
    axes = MU_VARIANTS[variant]
    acc = _acc_dtype(t)
    v = t.detach().to(acc)
    t.detach().copy_((v - v.mean(dim=axes, keepdim=True)).to(t.dtype))
    return t


def apply_gc_(tensors: Sequence[torch.Tensor], vector_policy: str, min_fanin: int, mu: str = "cout"):
    """GC with the mean-vector variant ``mu`` on 4-D tensors (standard rows on everything else)."""
    if mu == "cout":
        return gc_project_(tensors, vector_policy, min_fanin)
    conv = [t for t in tensors if t.dim() == 4]
    rest = [t for t in tensors if t.dim() != 4]
    gc_project_(rest, vector_policy, min_fanin)
    for t in conv:
        gc_mean_variant_(t, mu)
    return tensors


# ---------------------------------------------------------------------------------------------
# layer borderline (spec §2.4)
# ---------------------------------------------------------------------------------------------
def _prefix_match(name: str, prefixes: Sequence[str]) -> bool:
    for p in prefixes:
        q = p if p.endswith(".") else p + "."
        if name == p or name.startswith(q):
            return True
    return False


def split_layers(names: Sequence[str], local_layers: str = "all_except",
                 global_layers: Optional[Sequence[str]] = None, lam: Optional[float] = None) -> List[bool]:
    """Per parameter tensor (``names`` in named_parameters order): True = in the local (Local GC) set.

    local_layers: "all_except" (every tensor except those under the module prefixes
    ``global_layers``, matched as exact module prefixes: "fc" does not match "fc1.weight"),
    "first_fraction" (the first floor(lam * L + 1e-9) tensors), "all", "none"."""
    L = len(names)
    if local_layers == "all":
        return [True] * L
    if local_layers == "none":
        return [False] * L
    if local_layers == "first_fraction":
        if lam is None or not 0.0 <= lam <= 1.0:
            raise ValueError(f"split_layers: lam must lie in [0, 1] for 'first_fraction', got {lam!r}")
        n = int(math.floor(lam * L + 1e-9))
        return [i < n for i in range(L)]
    if local_layers == "all_except":
        if not global_layers:
            raise ValueError("split_layers: 'all_except' needs global_layers (module prefixes)")
        hit = [_prefix_match(n, global_layers) for n in names]
        for p in global_layers:
            if not any(_prefix_match(n, [p]) for n in names):
                raise ValueError(f"split_layers: global layer prefix {p!r} matches no parameter; names: {list(names)}")
        return [not h for h in hit]
    raise ValueError(f"split_layers: local_layers must be all_except|first_fraction|all|none, got {local_layers!r}")


# ---------------------------------------------------------------------------------------------
# client rule
# ---------------------------------------------------------------------------------------------
class LocalGCRule(ClientRule):
    """Local GC (spec §2.2). ``order``:
    * "pre_wd" (official code): GC on the raw gradient; the loop's optimizer then adds wd and momentum.
    * "post_wd" (GC2020): grad += wd * p on every tensor, then GC on the local ones, then the
      optimizer's momentum and step. wd is the aggregator's ``weight_decay`` or, when that is 0, the
      optimizer's own ``weight_decay`` (suspended for that step so it is applied once); setting both
      raises.
    * "post_momentum": the rule does the SGD step itself: d = g + wd p, buf = mu buf + d (un-centred),
      p -= lr * GC(buf) on the local set, p -= lr * buf elsewhere."""

    def __init__(self, aggregator: "GCFed"):
        super().__init__(aggregator)

    def begin(self, ctx: ClientContext, model) -> None:
        if ctx.spec is None:
            raise ValueError("GC-Fed client rule: ctx.spec (the model's FlatSpec) is required")
        agg = self.aggregator
        params = dict(model.named_parameters())
        entries = [e for e in ctx.spec.entries if not e.is_buffer]
        mask = agg.local_mask(ctx.spec)
        self.local = [params[e.name] for e, m in zip(entries, mask) if m]
        self.all = [params[e.name] for e in entries]
        self.bufs: Dict[int, torch.Tensor] = {}

    def end(self, ctx: ClientContext, model) -> Dict[str, Any]:
        return {"local_gc": len(self.local)}   # tensors centred (the server checks the rule ran)

    def _fusable(self) -> bool:
        agg = self.aggregator
        return bool(self.local) and agg.fused_step and agg.local_order == "pre_wd" and agg.mu == "cout"

    def _gc_local_grads(self) -> None:
        agg = self.aggregator
        grads = [p.grad for p in self.local if p.grad is not None]
        apply_gc_(grads, agg.vector_policy, agg.min_fanin, agg.mu)

    def before_step(self, ctx: ClientContext, model) -> None:
        agg = self.aggregator
        if not self.local or agg.local_order != "pre_wd" or self._fusable():
            return  # post_wd, post_momentum and the fused pre_wd path act in step()
        self._gc_local_grads()

    def _post_wd_step(self, optimizer) -> bool:
        """GC2020 order: g += wd p on every tensor, GC on the local ones, then the optimizer's step
        (with its own weight decay suspended when that is where wd came from)."""
        agg = self.aggregator
        groups = list(getattr(optimizer, "param_groups", []))
        opt_wd = {float(g.get("weight_decay", 0.0) or 0.0) for g in groups}
        opt_wd.discard(0.0)
        if agg.weight_decay and opt_wd:
            raise ValueError(f"{agg.name}: local_order='post_wd' got weight decay twice (weight_decay="
                             f"{agg.weight_decay} and the optimizer's weight_decay={sorted(opt_wd)}); set one of them")
        if len(opt_wd) > 1:
            raise ValueError(f"{agg.name}: local_order='post_wd' needs one weight_decay for all parameter groups, "
                             f"got {sorted(opt_wd)}")
        wd = agg.weight_decay or (opt_wd.pop() if opt_wd else 0.0)
        withg = [p for p in self.all if p.grad is not None]
        with torch.no_grad():
            if wd and withg:
                torch._foreach_add_([p.grad for p in withg], [p.detach() for p in withg], alpha=wd)
            self._gc_local_grads()
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

    def step(self, ctx: ClientContext, model, optimizer) -> bool:
        agg = self.aggregator
        if agg.local_order == "post_wd":
            return self._post_wd_step(optimizer) if self.local or agg.weight_decay else False
        if self._fusable():
            local_ids = {id(p) for p in self.local}
            if fused_sgd_step(optimizer, self.all, gc_mask=[id(p) in local_ids for p in self.all],
                              vector_policy=agg.vector_policy, min_fanin=agg.min_fanin):
                return True          # GC(g) + wd p, momentum, p -= lr buf: one native pass
            self._gc_local_grads()   # optimizer not plain SGD: centre the gradients, let it step
            return False
        if agg.local_order != "post_momentum":
            return False
        local_ids = {id(p) for p in self.local}
        with torch.no_grad():
            dirs_local = []
            for p in self.all:
                if p.grad is None:
                    continue
                d = p.grad.detach().clone()
                if agg.weight_decay:
                    d.add_(p.detach(), alpha=agg.weight_decay)
                b = self.bufs.get(id(p))
                if b is None or agg.momentum == 0:
                    b = d
                else:
                    b.mul_(agg.momentum).add_(d)
                self.bufs[id(p)] = b
                if id(p) in local_ids:
                    dirs_local.append((p, b.clone()))
                else:
                    p.sub_(b, alpha=ctx.lr)
            cent = [d for _, d in dirs_local]
            apply_gc_(cent, agg.vector_policy, agg.min_fanin, agg.mu)
            for (p, _), d in zip(dirs_local, cent):
                p.sub_(d, alpha=ctx.lr)
        return True


# ---------------------------------------------------------------------------------------------
# server
# ---------------------------------------------------------------------------------------------
@register("gcfed", "gc-fed")
class GCFed(Aggregator):
    """GC-Fed (hybrid). Options: ``local_layers`` (all_except|first_fraction|all|none),
    ``global_layers`` (module prefixes of the classifier; None = the last parameterised module),
    ``lam`` (first_fraction), ``global_scope`` (all = every tensor, as the official code; complement
    = the non-local tensors; none), ``vector_policy`` (center = official code; skip = standard GC),
    ``min_fanin`` 2, ``mu`` (mean-vector variant for conv weights, MU_VARIANTS), ``weighting``
    (uniform|samples), ``local_order`` (pre_wd|post_wd|post_momentum), ``weight_decay`` and
    ``momentum`` (used by the rule only for post_wd / post_momentum), ``fused_step`` (default True:
    with local_order="pre_wd", mu="cout" and a plain torch SGD optimizer, the client does Local GC +
    weight decay + momentum + update in one native pass, ``ops.fused_sgd_step_``)."""

    client_rule_cls = LocalGCRule
    _defaults = dict(local_layers="all_except", global_scope="all")

    def __init__(self, local_layers: Optional[str] = None, global_layers: Optional[Sequence[str]] = None,
                 lam: Optional[float] = None, global_scope: Optional[str] = None, vector_policy: str = "center",
                 min_fanin: int = 2, mu: str = "cout", weighting: str = "uniform", local_order: str = "pre_wd",
                 weight_decay: float = 0.0, momentum: float = 0.0, fused_step: bool = True, **kw):
        super().__init__(**kw)
        local_layers = local_layers or self._defaults["local_layers"]
        global_scope = global_scope or self._defaults["global_scope"]
        n = self.name
        checks = (("local_layers", local_layers, ("all_except", "first_fraction", "all", "none")),
                  ("global_scope", global_scope, ("all", "complement", "none")),
                  ("vector_policy", vector_policy, VECTOR_POLICIES), ("mu", mu, tuple(MU_VARIANTS)),
                  ("weighting", weighting, WEIGHTINGS), ("local_order", local_order, LOCAL_ORDERS))
        for opt, val, allowed in checks:
            check_choice(n, opt, val, allowed)
        if local_layers == "first_fraction" and (lam is None or not 0.0 <= lam <= 1.0):
            raise ValueError(f"{n}: lam must lie in [0, 1] with local_layers='first_fraction', got {lam!r}")
        if int(min_fanin) < 1:
            raise ValueError(f"{n}: min_fanin must be >= 1, got {min_fanin!r}")
        self.local_layers, self.global_layers, self.lam = local_layers, global_layers, lam
        self.global_scope, self.vector_policy, self.min_fanin, self.mu = global_scope, vector_policy, int(min_fanin), mu
        self.weighting, self.local_order = weighting, local_order
        self.weight_decay, self.momentum = float(weight_decay), float(momentum)
        self.fused_step = bool(fused_step)
        self._buf: Optional[torch.Tensor] = None
        self._views: List[torch.Tensor] = []

    def client_rule(self):
        return None if self.local_layers == "none" else LocalGCRule(self)

    def check_payload(self, payload: Dict[str, Any]) -> Optional[str]:
        r = super().check_payload(payload)
        if r or self.local_layers == "none" or "local_gc" in payload:
            return r
        return self.missing_payload("local_gc", "the number of tensors Local GC centred")

    # ---- sets ----------------------------------------------------------------------------------
    def _param_entries(self, spec):
        return [e for e in spec.entries if not e.is_buffer]

    def local_mask(self, spec) -> List[bool]:
        entries = self._param_entries(spec)
        names = [e.name for e in entries]
        gl = self.global_layers
        if self.local_layers == "all_except" and not gl:
            gl = [spec.layer_modules()[-1]]      # default: the output (classifier) module
        return split_layers(names, self.local_layers, gl, self.lam)

    def global_entries(self, spec):
        entries = self._param_entries(spec)
        if self.global_scope == "none":
            return []
        if self.global_scope == "all":
            return entries
        full = getattr(spec, "full", spec)     # a distributed ShardSpec: the sets are the whole model's
        names = {e.name for e, m in zip(self._param_entries(full), self.local_mask(full)) if not m}
        return [e for e in entries if e.name in names]

    # ---- aggregation ------------------------------------------------------------------------------
    def _workspace(self, like: torch.Tensor) -> torch.Tensor:
        if self._buf is None or self._buf.dtype != like.dtype or self._buf.device != like.device \
                or self._buf.numel() != like.numel():
            self._buf = torch.empty_like(like)
            ents = self.global_entries(self.spec) if self.global_scope != "none" else []
            self._views = [self._buf[e.slice].view(e.shape) for e in ents]
        return self._buf

    def _aggregate(self, rin: RoundInput) -> AggResult:
        a = client_weights(rin, self.weighting)
        dev = rin.U.device
        if self.global_scope == "none":
            new = ops.weighted_sum(rin.U, a, base=rin.global_flat, alpha=self.server_lr)
            return AggResult(new, {"weights": a.tolist()})
        if self.spec is None:
            raise ValueError(f"{self.name}: Global GC needs the model's FlatSpec (call setup(spec=...))")
        if self.spec.d != rin.d:
            raise ValueError(f"{self.name}: FlatSpec has d={self.spec.d} but the updates have d={rin.d}")
        delta = self._workspace(rin.global_flat)
        ops.weighted_sum(rin.U, a, out=delta)          # Delta = sum_k a_k U_k
        apply_gc_(self._views, self.vector_policy, self.min_fanin, self.mu)   # P Delta on the global set
        new = torch.add(rin.global_flat, delta, alpha=self.server_lr)
        return AggResult(new, {"weights": a.tolist()})


@register("local_gc")
class LocalGC(GCFed):
    """Local GC on every parameter tensor, plain (uniform) averaging on the server."""
    _defaults = dict(local_layers="all", global_scope="none")


@register("global_gc")
class GlobalGC(GCFed):
    """Global GC on every parameter tensor of the aggregated update; clients train like FedAvg."""
    _defaults = dict(local_layers="none", global_scope="all")


@register("local_gc_only")
class LocalGCOnly(GCFed):
    """Local-GC-only(lam) (paper Fig. 9): Local GC on the first floor(lam L) tensors, no Global GC."""
    _defaults = dict(local_layers="first_fraction", global_scope="none")
