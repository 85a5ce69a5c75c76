"""FedPGVC (Sahoo et al., TMLR). Spec: docs/specs/fedpgvc.md. The FedPVR baseline (spec §2.6) is in fedpvr.py.

FedPGVC changes only local training: on the controlled set S_gvc (the last ``n_ctrl`` parameterised
layers) every local step uses a direction built from the minibatch gradient g and the "gradient
penalty" rho = (1/B) sum_b l_b grad l_b = grad 0.5*mean(l^2) (spec §2.2). rho is a first-order
gradient of a different scalar: the ClientRule gets it with one extra ``autograd.grad`` that walks
only the head (no double backprop). Update modes (spec §2.4, ``mode=``):

* ``hadamard`` (alias ``paper_literal``; paper Eq. 15, Alg. 1): u = rho * g   (default)
* ``additive`` (paper App. §8): u = g + lam * rho
* ``layer_scalar`` (``stat`` = mean | norm): u_l = s_l * g_l, s_l = mean(rho_l) or ||rho_l||_2 per tensor
* ``layer_normalize`` (paper Eq. 9, target ``tau``): u_l = (tau / ||g_l||) g_l
* ``code`` (released script): plain steps, then a one-off shrink W <- (1 - eta r_j) W of every tensor of
  controlled Keras layer j, r_j from one pass over the whole local set (modes.py: the mapping)
* ``lr_matched`` (spec §8 Exp A's matched control, not a FedPGVC variant): u = (1 + lam * lbar) g with
  lbar the running mean of this client's minibatch losses in the current round. It gives the head the
  same average step boost as ``additive`` (rho ~ lbar g) without the per-sample loss weighting.

The server is a plain average (uniform by default, spec §2.3): w <- w + server_lr * sum_k a_k U_k,
one ``ops.weighted_sum`` pass.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from ..base import AggResult, Aggregator, BatchedRule, ClientContext, ClientRule, RoundInput, register
from ..parts import WEIGHTINGS, check_choice, check_n_ctrl, client_weights, controlled_entries
from .modes import PGVC_MODES, code_plan, code_r, code_shrink_, pgvc_direction_

_MODE_ALIASES = {"paper_literal": "hadamard", "paper": "hadamard"}
NAN_POLICIES = ("skip", "raise", "propagate")


def _per_sample_ce(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, target, reduction="none")


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
        self.plan = None  # code mode: modes.CodePlan

    def check_model(self, model, spec) -> None:
        agg = self.aggregator
        entries = agg.ctrl_entries(spec)
        if entries and agg.mode == "code":
            code_plan(model, spec, entries, agg.code_layers)  # raises for a model without a Keras layer list

    def begin(self, ctx: ClientContext, model) -> None:
        agg = self.aggregator
        entries = agg.ctrl_entries(ctx.spec)
        params = dict(model.named_parameters())
        self.ctrl = [params[e.name] for e in entries]
        self.skipped = 0
        self.loss_history = []
        # code mode, checked before training: the Keras layer mapping and the local set
        self.plan = code_plan(model, ctx.spec, entries, agg.code_layers) if self.ctrl and agg.mode == "code" else None
        if self.plan is not None and ctx.extras.get("local_data") is None:
            raise ValueError(
                "FedPGVC mode 'code' needs ctx.extras['local_data']: the client's whole local "
                "set as (x, y) batches (the script computes r from every local sample)"
            )
        if self.ctrl and self.plan is None:
            self._hook = model.register_forward_hook(self._capture)

    def _capture(self, module, inputs, output):
        self._out = output

    def _per_sample_loss(self, ctx: ClientContext) -> torch.Tensor:
        ell = ctx.extras.get("per_sample_loss")
        if ell is None:
            if self._out is None or ctx.batch is None:
                raise ValueError(
                    "FedPGVC client rule: no per-sample losses (set ctx.extras['per_sample_loss'] "
                    "or ctx.batch = (inputs, targets) before the forward pass)"
                )
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
                raise FloatingPointError(
                    f"FedPGVC: non-finite per-sample loss at client {ctx.client_id} step {ctx.step}"
                )
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
        self.last_rho = list(
            torch.autograd.grad((w * ell).mean(), self.ctrl, retain_graph=True, materialize_grads=True)
        )
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
        return self._skip_step  # True = the step is dropped (nan_policy "skip")

    def end(self, ctx: ClientContext, model) -> Dict[str, Any]:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        agg = self.aggregator
        out: Dict[str, Any] = {"pgvc_skipped_steps": self.skipped}
        if self.loss_history:
            out["pgvc_mean_loss"] = sum(self.loss_history) / len(self.loss_history)
        if self.plan is not None:
            r = code_r(model, agg.loss_fn, ctx.extras["local_data"], self.plan)
            code_shrink_(self.plan.tensors, r, agg.code_eta if agg.code_eta is not None else ctx.lr, self.plan.owner)
        return out


class FedPGVCBatched(BatchedRule):
    """FedPGVCRule, batched, on the controlled set: u = rho * g (hadamard), g + lam rho (additive),
    s_l g_l (layer_scalar), tau g_l / ||g_l|| (layer_normalize), (1 + lam lbar) g (lr_matched);
    rho = grad of sum_b m_b stopgrad(l_b) l_b / sum_b m_b comes from the same vmapped backward."""

    @classmethod
    def reason(cls, rule, fixed_steps):
        agg = rule.aggregator
        if agg.mode == "code":
            return f"{agg.name}: mode 'code' shrinks after a pass over each client's whole local set"
        if agg.nan_policy == "raise":
            return f"{agg.name}: nan_policy='raise' stops one client at its step"
        if agg.loss_fn is not _per_sample_ce:
            return f"{agg.name}: a custom loss_fn (batched: the per-sample cross-entropy)"
        return None

    def __init__(self, rule, spec):
        super().__init__(rule, spec)
        agg = self.agg
        self.ctrl = agg.ctrl_entries(spec)
        self.needs_rho = bool(self.ctrl) and agg.mode in ("hadamard", "additive", "layer_scalar")
        self.loss_clip = agg.loss_clip

    def begin(self, ch):
        dev = ch.W.device
        self.skipped = torch.zeros(ch.C, dtype=torch.int64, device=dev)
        self.hist_sum = torch.zeros(ch.C, dtype=torch.float64, device=dev)
        self.hist_n = torch.zeros(ch.C, dtype=torch.int64, device=dev)
        self._skip = None

    def before_step(self, ch, G, rho, ce, m, active):
        agg = self.agg
        self._skip = None
        if not self.ctrl or agg.mode == "layer_normalize":
            pass
        else:
            ok = (torch.isfinite(ce) | (m == 0)).all(1)
            if agg.nan_policy == "skip":
                self._skip = active & ~ok
                self.skipped += self._skip
            w = ce if self.loss_clip is None else ce.clamp(max=self.loss_clip)
            cnt = m.sum(1).clamp_min(1)
            counted = active if self._skip is None else active & ~self._skip
            self.hist_sum += torch.where(counted, torch.where(m > 0, w, 0.0).sum(1).double() / cnt.double(), 0.0)
            self.hist_n += counted
        if not self.ctrl:
            return
        mode = agg.mode
        if mode == "lr_matched":
            lbar = self.hist_sum / self.hist_n.clamp_min(1)
            f = (1.0 + agg.lam * lbar).to(G.dtype).unsqueeze(1)
            for e in self.ctrl:
                G[:, e.offset : e.offset + e.numel].mul_(f)
            return
        for e in self.ctrl:
            g = G[:, e.offset : e.offset + e.numel]
            if mode == "hadamard":
                g.mul_(rho[:, e.offset : e.offset + e.numel])
            elif mode == "additive":
                g.add_(rho[:, e.offset : e.offset + e.numel], alpha=agg.lam)
            elif mode == "layer_scalar":
                r = rho[:, e.offset : e.offset + e.numel]
                s = r.mean(1) if agg.stat == "mean" else torch.linalg.vector_norm(r, dim=1)
                g.mul_(s.unsqueeze(1))
            elif mode == "layer_normalize":
                n = torch.linalg.vector_norm(g, dim=1)
                s = torch.where(n > 0, agg.tau / n.clamp_min(torch.finfo(n.dtype).tiny), torch.zeros_like(n))
                g.mul_(s.unsqueeze(1))

    def skip(self):
        return self._skip

    def end(self, ch):
        out = []
        sk, hs, hn = self.skipped.tolist(), self.hist_sum.tolist(), self.hist_n.tolist()
        for i in range(ch.C):
            p: Dict[str, Any] = {"pgvc_skipped_steps": int(sk[i])}
            if hn[i]:
                p["pgvc_mean_loss"] = hs[i] / hn[i]
            out.append(p)
        return out


FedPGVCRule.batched_form = FedPGVCBatched


@register("fedpgvc")
class FedPGVC(Aggregator):
    """FedPGVC server (plain average) + client rule (gradient variance control on the last layers).

    Options: ``n_ctrl`` (int >= 0 or "all"; default 2), ``ctrl_modules`` (explicit module names),
    ``mode`` (see module doc; default "hadamard" = paper-literal), ``lam`` (additive), ``stat``
    (layer_scalar: mean|norm), ``tau`` (layer_normalize), ``code_eta`` (code mode; None = client lr),
    ``code_layers`` (code mode: the model's Keras layer list, default ``model.keras_layers``),
    ``loss_clip`` (clip l inside rho only), ``loss_fn`` (per-sample loss (out, target) -> [B]),
    ``nan_policy`` (skip|raise|propagate), ``weighting`` (uniform|samples)."""

    client_rule_cls = FedPGVCRule
    screen_in_pass = True  # stateless: its weighted_sum pass screens the rows
    reads_beyond_weighted_sum = "per-row projections of the updates"
    dp_verdict = "private"  # a FedAvg-style sum; the skipped-step counts are metadata

    option_ranges = {"lam": ">= 0", "tau": "> 0", "code_eta": "> 0"}

    def __init__(
        self,
        n_ctrl: Union[int, str] = 2,
        ctrl_modules: Optional[Sequence[str]] = None,
        mode: str = "hadamard",
        lam: float = 1.0,
        stat: str = "mean",
        tau: float = 1.0,
        code_eta: Optional[float] = 0.001,
        code_layers: Optional[Sequence[str]] = None,
        loss_clip: Optional[float] = None,
        loss_fn=None,
        nan_policy: str = "skip",
        weighting: str = "uniform",
        **kw,
    ):
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
        self.code_layers = list(code_layers) if code_layers is not None else None
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

    def suspect_payloads(self, payloads):
        rows = super().suspect_payloads(payloads)
        return None if rows is None else rows + [k for k, p in enumerate(payloads) if "pgvc_skipped_steps" not in p]

    def update_passes(self, K: Optional[int] = None) -> Tuple[str, ...]:
        return ("sum",)  # one weighted sum over U (Aggregator.passes)

    def _aggregate(self, rin: RoundInput) -> AggResult:
        a = client_weights(rin, self.weighting)
        new = rin.weighted_sum(a, base=rin.global_flat, alpha=self.server_lr)  # (screens U's rows)
        return AggResult(new, {"weights": a.tolist()})
