"""GC-Fed (Seo et al., arXiv 2503.13180): gradient centralization, local, global and hybrid.
Spec: docs/specs/gcfed.md.

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

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ...ops import gc_project_  # GC in place, one native call for many tensors
from .._fused import fused_sgd_step
from ..base import AggResult, Aggregator, BatchedRule, ClientContext, ClientRule, RoundInput, register
from ..parts import client_weights, split_layers
from .options import check_options, gc_mean_variant_, post_momentum_step, post_wd_step


# ---------------------------------------------------------------------------------------------
# the GC projection
# ---------------------------------------------------------------------------------------------
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
# client rule
# ---------------------------------------------------------------------------------------------
class LocalGCRule(ClientRule):
    """Local GC (spec §2.2), the official code's order ("pre_wd"): GC on the raw gradients of the
    local set, then the optimizer adds weight decay and momentum and steps (one native pass with a
    plain torch SGD, ``fused_step``). The ablation orders "post_wd" (GC2020) and "post_momentum" are
    ``options.post_wd_step`` / ``post_momentum_step``."""

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
        return {"local_gc": len(self.local)}  # tensors centred (the server checks the rule ran)

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

    def step(self, ctx: ClientContext, model, optimizer) -> bool:
        agg = self.aggregator
        if agg.local_order == "post_wd":
            if not (self.local or agg.weight_decay):
                return False
            return post_wd_step(agg.name, self.all, agg.weight_decay, optimizer, self._gc_local_grads)
        if self._fusable():
            local_ids = {id(p) for p in self.local}
            if fused_sgd_step(
                optimizer,
                self.all,
                gc_mask=[id(p) in local_ids for p in self.all],
                vector_policy=agg.vector_policy,
                min_fanin=agg.min_fanin,
            ):
                return True  # GC(g) + wd p, momentum, p -= lr buf: one native pass
            self._gc_local_grads()  # optimizer not plain SGD: centre the gradients, let it step
            return False
        if agg.local_order != "post_momentum":
            return False
        return post_momentum_step(
            self.all,
            self.local,
            self.bufs,
            ctx.lr,
            agg.weight_decay,
            agg.momentum,
            lambda ts: apply_gc_(ts, agg.vector_policy, agg.min_fanin, agg.mu),
        )


class LocalGCBatched(BatchedRule):
    """LocalGCRule, batched (order "pre_wd", mean "cout"): each local tensor's gradient rows centred."""

    @classmethod
    def reason(cls, rule, fixed_steps):
        agg = rule.aggregator
        if agg.local_order != "pre_wd" or agg.mu != "cout":
            return f"{agg.name}: local_order={agg.local_order!r} / mu={agg.mu!r} (batched: pre_wd with mu='cout' only)"
        return None

    def begin(self, ch):
        agg = self.agg
        entries = [e for e in self.spec.entries if not e.is_buffer]
        mask = agg.local_mask(self.spec)
        self.local = [e for e, k in zip(entries, mask) if k]
        self.rows = []  # (entry, fan-in) of the tensors GC changes
        for e in self.local:
            if e.numel == 0 or len(e.shape) == 0:
                continue
            if len(e.shape) == 1:
                if agg.vector_policy == "skip" or e.numel < agg.min_fanin:
                    continue
                self.rows.append((e, e.numel))
            elif e.numel // e.shape[0] >= agg.min_fanin:
                self.rows.append((e, e.numel // e.shape[0]))

    def edit(self, G):
        C = G.size(0)
        for e, fan in self.rows:
            v = G[:, e.offset : e.offset + e.numel].view(C, -1, fan)
            v.sub_(v.mean(-1, keepdim=True))

    def fused(self):
        return super().fused() and bool(self.local)

    def end(self, ch):
        return [{"local_gc": len(self.local)} for _ in range(ch.C)]


LocalGCRule.batched_form = LocalGCBatched


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
    screen_in_pass = True  # the first read of U is rin.weighted_sum; the workspace holds no state
    reads_beyond_weighted_sum = "per-channel projections of the dense updates"
    dp_verdict = "private"  # the gradient-centralisation projection of the noised sum: post-processing
    _defaults = dict(local_layers="all_except", global_scope="all")

    option_ranges = {"lam": "[0, 1]", "weight_decay": ">= 0", "momentum": "[0, 1)"}

    def __init__(
        self,
        local_layers: Optional[str] = None,
        global_layers: Optional[Sequence[str]] = None,
        lam: Optional[float] = None,
        global_scope: Optional[str] = None,
        vector_policy: str = "center",
        min_fanin: int = 2,
        mu: str = "cout",
        weighting: str = "uniform",
        local_order: str = "pre_wd",
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        fused_step: bool = True,
        **kw,
    ):
        super().__init__(**kw)
        local_layers = local_layers or self._defaults["local_layers"]
        global_scope = global_scope or self._defaults["global_scope"]
        check_options(self.name, local_layers, global_scope, vector_policy, mu, weighting, local_order, lam, min_fanin)
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

    def suspect_payloads(self, payloads):
        rows = super().suspect_payloads(payloads)
        if rows is None or self.local_layers == "none":
            return rows
        return rows + [k for k, p in enumerate(payloads) if "local_gc" not in p]

    # ---- sets ----------------------------------------------------------------------------------
    def _param_entries(self, spec):
        return [e for e in spec.entries if not e.is_buffer]

    def local_mask(self, spec) -> List[bool]:
        entries = self._param_entries(spec)
        names = [e.name for e in entries]
        gl = self.global_layers
        if self.local_layers == "all_except" and not gl:
            gl = [spec.layer_modules()[-1]]  # default: the output (classifier) module
        return split_layers(names, self.local_layers, gl, self.lam)

    def global_entries(self, spec):
        entries = self._param_entries(spec)
        if self.global_scope == "none":
            return []
        if self.global_scope == "all":
            return entries
        full = getattr(spec, "full", spec)  # a distributed ShardSpec: the sets are the whole model's
        names = {e.name for e, m in zip(self._param_entries(full), self.local_mask(full)) if not m}
        return [e for e in entries if e.name in names]

    # ---- aggregation ------------------------------------------------------------------------------
    def _workspace(self, like: torch.Tensor) -> torch.Tensor:
        if (
            self._buf is None
            or self._buf.dtype != like.dtype
            or self._buf.device != like.device
            or self._buf.numel() != like.numel()
        ):
            self._buf = torch.empty_like(like)
            ents = self.global_entries(self.spec) if self.global_scope != "none" else []
            self._views = [self._buf[e.slice].view(e.shape) for e in ents]
        return self._buf

    def update_passes(self, K: Optional[int] = None) -> Tuple[str, ...]:
        return ("sum",)  # one weighted sum over U (Aggregator.passes)

    def _aggregate(self, rin: RoundInput) -> AggResult:
        a = client_weights(rin, self.weighting)
        dev = rin.device
        if self.global_scope == "none":
            new = rin.weighted_sum(a, base=rin.global_flat, alpha=self.server_lr)  # (screens U's rows)
            return AggResult(new, {"weights": a.tolist()})
        if self.spec is None:
            raise ValueError(f"{self.name}: Global GC needs the model's FlatSpec (call setup(spec=...))")
        if self.spec.d != rin.d:
            raise ValueError(f"{self.name}: FlatSpec has d={self.spec.d} but the updates have d={rin.d}")
        delta = self._workspace(rin.global_flat)
        delta.copy_(rin.weighted_sum(a))  # Delta = sum_k a_k U_k (the pass screens U's rows)
        apply_gc_(self._views, self.vector_policy, self.min_fanin, self.mu)  # P Delta on the global set
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
