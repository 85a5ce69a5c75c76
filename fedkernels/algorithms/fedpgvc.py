"""FedPGVC (Sahoo et al., TMLR) and the FedPVR baseline (Li et al., CVPR 2023). Spec: specs/fedpgvc.md.

FedPGVC changes only local training: on the controlled set S_gvc (the last ``n_ctrl`` parameterised
layers) every local step uses a direction built from the minibatch gradient g and the "gradient
penalty" rho = (1/B) sum_b l_b grad l_b = grad 0.5*mean(l^2) (spec §2.2). rho is a first-order
gradient of a different scalar: the ClientRule gets it with one extra ``autograd.grad`` that walks
only the head (no double backprop). Update modes (spec §2.4, ``mode=``):

* ``hadamard`` (alias ``paper_literal``; paper Eq. 15, Alg. 1): u = rho * g   (default)
* ``additive`` (paper App. §8): u = g + lam * rho
* ``layer_scalar`` (``stat`` = mean | norm): u_l = s_l * g_l, s_l = mean(rho_l) or ||rho_l||_2 per tensor
* ``layer_normalize`` (paper Eq. 9, target ``tau``): u_l = (tau / ||g_l||) g_l
* ``code`` (released script): plain steps, then a one-off multiplicative shrink W_t <- (1 - eta r_t) W_t
* ``lr_matched`` (spec §8 Exp A's matched control, not a FedPGVC variant): u = (1 + lam * lbar) g with
  lbar the running mean of this client's minibatch losses in the current round. It gives the head the
  same average step boost as ``additive`` (rho ~ lbar g) without the per-sample loss weighting.

The server is a plain average (uniform by default, spec §2.3): w <- w + server_lr * sum_k a_k U_k,
one ``ops.weighted_sum`` pass.

The FedPVR baseline (spec §2.6) is in fedpvr.py.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from .. import ops
from .base import AggResult, Aggregator, ClientContext, ClientRule, RoundInput, register
from .parts import WEIGHTINGS, check_choice, check_n_ctrl, client_weights, controlled_entries

PGVC_MODES = ("hadamard", "additive", "layer_scalar", "layer_normalize", "code", "lr_matched")
_MODE_ALIASES = {"paper_literal": "hadamard", "paper": "hadamard"}
NAN_POLICIES = ("skip", "raise", "propagate")


# ---------------------------------------------------------------------------------------------
# update directions (the arithmetic of the fused pgvc_step, spec §5.2, on lists of tensors)
# ---------------------------------------------------------------------------------------------
def pgvc_direction_(grads: List[torch.Tensor], rhos: Optional[List[torch.Tensor]], mode: str,
                    lam: float = 1.0, stat: str = "mean", tau: float = 1.0) -> List[torch.Tensor]:
    """Overwrites each g in ``grads`` with the FedPGVC direction u (spec §2.4); returns grads."""
    if not grads:
        return grads
    if mode == "hadamard":
        torch._foreach_mul_(grads, rhos)
    elif mode == "additive":
        torch._foreach_add_(grads, rhos, alpha=lam)
    elif mode == "layer_scalar":
        if stat == "mean":
            s = [r.mean() for r in rhos]
        else:
            s = list(torch._foreach_norm(rhos))
        torch._foreach_mul_(grads, s)
    elif mode == "layer_normalize":
        norms = torch._foreach_norm(grads)
        # a zero gradient stays zero (no direction to normalise)
        s = [torch.where(n > 0, tau / n.clamp_min(torch.finfo(n.dtype).tiny), torch.zeros_like(n)) for n in norms]
        torch._foreach_mul_(grads, s)
    elif mode == "code":
        pass
    else:
        raise ValueError(f"unknown FedPGVC mode {mode!r}")
    return grads


def code_shrink_(tensors: List[torch.Tensor], r: Sequence[float], eta: float) -> None:
    """The released script's post-training step (spec §2.4 [CODE], U8): W_t <- (1 - eta r_t) W_t."""
    with torch.no_grad():
        torch._foreach_mul_(tensors, [1.0 - eta * float(x) for x in r])


def _per_sample_ce(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, target, reduction="none")


# ---------------------------------------------------------------------------------------------
# FedPGVC
# ---------------------------------------------------------------------------------------------
class FedPGVCRule(ClientRule):
    """Client side of FedPGVC (spec §2.5 lines 6-11).

    Needs the per-sample losses of the current minibatch: taken from ``ctx.extras["per_sample_loss"]``
    when the training loop provides it (a [B] tensor attached to the graph), otherwise recomputed
    from the model output (captured by a forward hook, no second forward) with the aggregator's
    ``loss_fn`` (default per-sample cross-entropy) and ``ctx.batch[1]`` as targets.
    ``self.last_rho`` holds rho of the last step (list, one per controlled tensor)."""

    def __init__(self, aggregator: "FedPGVC"):
        super().__init__(aggregator)
        self._hook = None
        self._out = None
        self.ctrl: List[torch.Tensor] = []
        self.last_rho: Optional[List[torch.Tensor]] = None
        self.skipped = 0
        self._skip_step = False
        self.loss_history: List[float] = []

    def begin(self, ctx: ClientContext, model) -> None:
        agg = self.aggregator
        entries = agg.ctrl_entries(ctx.spec)
        params = dict(model.named_parameters())
        self.ctrl = [params[e.name] for e in entries]
        self.skipped = 0
        self.loss_history = []
        if self.ctrl and agg.mode != "code":
            self._hook = model.register_forward_hook(self._capture)

    def _capture(self, module, inputs, output):
        self._out = output

    def _per_sample_loss(self, ctx: ClientContext) -> torch.Tensor:
        ell = ctx.extras.get("per_sample_loss")
        if ell is None:
            if self._out is None or ctx.batch is None:
                raise ValueError("FedPGVC client rule: no per-sample losses (set ctx.extras['per_sample_loss'] "
                                 "or ctx.batch = (inputs, targets) before the forward pass)")
            ell = self.aggregator.loss_fn(self._out, ctx.batch[1])
        if ell.dim() != 1:
            raise ValueError(f"FedPGVC client rule: per-sample loss must be 1-D [B], got shape {tuple(ell.shape)}")
        return ell

    def loss_term(self, ctx: ClientContext, model) -> Optional[torch.Tensor]:
        self._skip_step = False
        if not self.ctrl or self.aggregator.mode in ("code", "layer_normalize"):
            return None
        agg = self.aggregator
        ell = self._per_sample_loss(ctx)
        self._out = None
        if not bool(torch.isfinite(ell).all()):
            if agg.nan_policy == "raise":
                raise FloatingPointError(f"FedPGVC: non-finite per-sample loss at client {ctx.client_id} step {ctx.step}")
            if agg.nan_policy == "skip":
                self._skip_step = True
                self.skipped += 1
                self.last_rho = None
                return None
        w = ell.detach()
        if agg.loss_clip is not None:
            w = w.clamp(max=agg.loss_clip)
        self.loss_history.append(float(w.mean()))
        if agg.mode == "lr_matched":
            return None
        # rho = (1/B) sum_b l_b grad l_b = grad of mean(stopgrad(l) * l): a first-order gradient
        self.last_rho = list(torch.autograd.grad((w * ell).mean(), self.ctrl, retain_graph=True,
                                                 allow_unused=True))
        self.last_rho = [torch.zeros_like(p) if r is None else r for p, r in zip(self.ctrl, self.last_rho)]
        return None

    def before_step(self, ctx: ClientContext, model) -> None:
        agg = self.aggregator
        if not self.ctrl or self._skip_step or agg.mode == "code":
            return
        grads = [p.grad for p in self.ctrl]
        if any(g is None for g in grads):
            raise ValueError("FedPGVC client rule: a controlled parameter has no gradient after backward()")
        if agg.mode == "lr_matched":
            lbar = sum(self.loss_history) / len(self.loss_history)
            torch._foreach_mul_(grads, 1.0 + agg.lam * lbar)
            return
        pgvc_direction_(grads, self.last_rho, agg.mode, agg.lam, agg.stat, agg.tau)

    def step(self, ctx: ClientContext, model, optimizer) -> bool:
        return self._skip_step   # True = the step is dropped (nan_policy "skip")

    def end(self, ctx: ClientContext, model) -> Dict[str, Any]:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        agg = self.aggregator
        out: Dict[str, Any] = {"pgvc_skipped_steps": self.skipped}
        if self.loss_history:
            out["pgvc_mean_loss"] = sum(self.loss_history) / len(self.loss_history)
        if self.ctrl and agg.mode == "code":
            r = self._code_r(ctx, model)
            code_shrink_(self.ctrl, r, agg.code_eta if agg.code_eta is not None else ctx.lr)
        return out

    def _code_r(self, ctx: ClientContext, model) -> List[float]:
        """[CODE] r_t = l_t * mean(G_t), G = grad of the summed loss over the local data, t = tensor index."""
        data = ctx.extras.get("local_data") or ([ctx.batch] if ctx.batch is not None else [])
        if not data:
            raise ValueError("FedPGVC mode 'code' needs ctx.extras['local_data'] (batches) or ctx.batch")
        allp = [p for p in model.parameters() if p.requires_grad]
        G = [torch.zeros_like(p) for p in allp]
        losses = []
        for x, y in data:
            ell = self.aggregator.loss_fn(model(x), y)
            gs = torch.autograd.grad(ell.sum(), allp, allow_unused=True)
            for acc, g in zip(G, gs):
                if g is not None:
                    acc.add_(g)
            losses.append(ell.detach())
        ells = torch.cat(losses)
        idx = {id(p): t for t, p in enumerate(allp)}
        r = []
        for p in self.ctrl:
            t = idx[id(p)]
            r.append(float(ells[t]) * float(G[t].mean()) if t < ells.numel() else 0.0)
        return r


@register("fedpgvc")
class FedPGVC(Aggregator):
    """FedPGVC server (plain average) + client rule (gradient variance control on the last layers).

    Options: ``n_ctrl`` (int >= 0 or "all"; default 2), ``ctrl_modules`` (explicit module names),
    ``mode`` (see module doc; default "hadamard" = paper-literal), ``lam`` (additive), ``stat``
    (layer_scalar: mean|norm), ``tau`` (layer_normalize), ``code_eta`` (code mode; None = client lr),
    ``loss_clip`` (clip l inside rho only), ``loss_fn`` (per-sample loss (out, target) -> [B]),
    ``nan_policy`` (skip|raise|propagate), ``weighting`` (uniform|samples)."""

    client_rule_cls = FedPGVCRule

    def __init__(self, n_ctrl: Union[int, str] = 2, ctrl_modules: Optional[Sequence[str]] = None,
                 mode: str = "hadamard", lam: float = 1.0, stat: str = "mean", tau: float = 1.0,
                 code_eta: Optional[float] = 0.001, loss_clip: Optional[float] = None, loss_fn=None,
                 nan_policy: str = "skip", weighting: str = "uniform", **kw):
        super().__init__(**kw)
        mode = _MODE_ALIASES.get(mode, mode)
        if mode not in PGVC_MODES:
            raise ValueError(f"{self.name}: mode must be one of {PGVC_MODES + tuple(_MODE_ALIASES)}, got {mode!r}")
        check_choice(self.name, "stat", stat, ("mean", "norm"))
        check_choice(self.name, "nan_policy", nan_policy, NAN_POLICIES)
        check_choice(self.name, "weighting", weighting, WEIGHTINGS)
        if loss_clip is not None and not loss_clip > 0:
            raise ValueError(f"{self.name}: loss_clip must be > 0 or None, got {loss_clip!r}")
        check_n_ctrl(self.name, n_ctrl)
        self.n_ctrl, self.ctrl_modules = n_ctrl, (list(ctrl_modules) if ctrl_modules is not None else None)
        self.mode, self.lam, self.stat, self.tau = mode, float(lam), stat, float(tau)
        self.code_eta, self.loss_clip = code_eta, loss_clip
        self.loss_fn = loss_fn if loss_fn is not None else _per_sample_ce
        self.nan_policy, self.weighting = nan_policy, weighting

    def ctrl_entries(self, spec):
        if spec is None:
            raise ValueError(f"{self.name}: the controlled layers need a FlatSpec (call setup(spec=...))")
        return controlled_entries(spec, self.n_ctrl, self.ctrl_modules)

    def check_payload(self, payload: Dict[str, Any]) -> Optional[str]:
        r = super().check_payload(payload)
        if r or "pgvc_skipped_steps" in payload:
            return r
        return self.missing_payload("pgvc_skipped_steps", "the client's count of skipped steps")

    def _aggregate(self, rin: RoundInput) -> AggResult:
        a = client_weights(rin, self.weighting)
        new = ops.weighted_sum(rin.U, a, base=rin.global_flat, alpha=self.server_lr)
        return AggResult(new, {"weights": a.tolist()})
