"""FedProx (Li et al., 2020): FedAvg aggregation, local objective F_k(w) + mu/2 ||w - w_global||^2.

The server side is FedAvg. The client side adds the proximal term. Two equivalent ways are offered
by ``FedProxRule``:

* ``prox="grad"`` (default): the exact gradient of the term, ``g += mu (w - w_global)``, added in
  ``before_step`` with two fused ``torch._foreach_add_`` calls over the parameter list (no autograd
  graph, no temporaries);
* ``prox="loss"``: ``loss_term`` returns ``mu/2 ||w - w_global||^2`` as a differentiable scalar (use
  it when the loss value itself must include the term).

The global model is read through views of ``ctx.global_flat`` (FlatSpec), never copied.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from ..flat import FlatSpec
from .base import BatchedRule, ClientContext, ClientRule, payload_numbers, register, rows_where
from .fedavg import FedAvg


def param_flat_pairs(ctx: ClientContext, model, vec: torch.Tensor) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """The model's trainable parameters and the matching views of the flat vector ``vec``.

    Uses ``ctx.spec`` (the FlatSpec the flat vectors follow); without one, the spec of the model's
    parameters in ``named_parameters()`` order. Buffers are skipped.
    """
    spec = ctx.spec if ctx.spec is not None else FlatSpec.from_module(model)
    if vec.numel() != spec.d:
        raise ValueError(f"client rule: flat vector has {vec.numel()} elements but the FlatSpec has d={spec.d}")
    named = dict(model.named_parameters())
    params, views = [], []
    for e in spec.entries:
        if e.is_buffer:
            continue
        p = named.get(e.name)
        if p is None:
            raise ValueError(f"client rule: the model has no parameter {e.name!r} recorded in the FlatSpec")
        if not p.requires_grad:
            continue
        params.append(p)
        views.append(vec[e.slice].view(e.shape))
    return params, views


class FedProxRule(ClientRule):
    """Adds the proximal term mu/2 ||w - w_global||^2 to local training (see module docstring)."""

    def __init__(self, aggregator=None, mu: Optional[float] = None, prox: Optional[str] = None):
        super().__init__(aggregator)
        self.mu = float(mu if mu is not None else getattr(aggregator, "mu", 0.0))
        self.prox = prox if prox is not None else getattr(aggregator, "prox", "grad")
        if self.prox not in ("grad", "loss"):
            raise ValueError(f"fedprox: prox must be 'grad' or 'loss', got {self.prox!r}")

    def begin(self, ctx: ClientContext, model) -> None:
        params, views = param_flat_pairs(ctx, model, ctx.global_flat)
        ctx.extras["prox_pairs"] = (params, [v.to(p.dtype) if v.dtype != p.dtype else v for p, v in zip(params, views)])

    def _pairs(self, ctx, model):
        if "prox_pairs" not in ctx.extras:
            self.begin(ctx, model)
        return ctx.extras["prox_pairs"]

    def loss_term(self, ctx: ClientContext, model) -> Optional[torch.Tensor]:
        if self.prox != "loss" or self.mu == 0.0:
            return None
        params, glob = self._pairs(ctx, model)
        sq = sum(((p - g) ** 2).sum() for p, g in zip(params, glob))
        return 0.5 * self.mu * sq

    def before_step(self, ctx: ClientContext, model) -> None:
        if self.prox != "grad" or self.mu == 0.0:
            return
        params, glob = self._pairs(ctx, model)
        sel = [(p, g) for p, g in zip(params, glob) if p.grad is not None]
        if not sel:
            return
        grads = [p.grad for p, _ in sel]
        with torch.no_grad():
            torch._foreach_add_(grads, [p.detach() for p, _ in sel], alpha=self.mu)
            torch._foreach_add_(grads, [g for _, g in sel], alpha=-self.mu)

    def end(self, ctx: ClientContext, model) -> Dict[str, Any]:
        return {"prox_mu": self.mu}  # the server checks the clients trained with its mu


class FedProxBatched(BatchedRule):
    """g += mu (w - x) (FedProxRule, batched; the "loss" form has the same gradient)."""

    def before_step(self, ch, G, rho, ce, m, active):
        mu = self.rule.mu
        if mu != 0.0:
            G.add_(ch.W, alpha=mu).sub_(ch.x * mu)

    def end(self, ch):
        return [{"prox_mu": self.rule.mu} for _ in range(ch.C)]


FedProxRule.batched_form = FedProxBatched


@register("fedprox")
class FedProx(FedAvg):
    """FedAvg on the server; ``client_rule()`` returns a ``FedProxRule`` with ``mu`` (default 0.01).

    Options: ``mu >= 0``, ``prox`` ("grad" default or "loss"), plus FedAvg's ``weighting`` and
    ``server_lr``. ``mu = 0`` trains exactly like FedAvg.
    """

    client_rule_cls = FedProxRule

    def __init__(self, mu: float = 0.01, prox: str = "grad", **kw):
        super().__init__(**kw)
        mu = float(mu)
        if not (mu >= 0.0) or mu == float("inf"):
            raise ValueError(f"fedprox: mu must be a finite number >= 0, got {mu}")
        if prox not in ("grad", "loss"):
            raise ValueError(f"fedprox: prox must be 'grad' or 'loss', got {prox!r}")
        self.mu = mu
        self.prox = prox

    def check_payload(self, payload: Dict[str, Any]) -> Optional[str]:
        r = super().check_payload(payload)
        if r or self.mu == 0.0:
            return r
        if "prox_mu" not in payload:
            return self.missing_payload("prox_mu", "the mu the client's proximal term used")
        try:
            mu = float(payload["prox_mu"])
        except (TypeError, ValueError):
            return f"payload 'prox_mu' must be a number, got {payload['prox_mu']!r}"
        if mu != self.mu:
            return f"the client trained with mu={mu} but the server has mu={self.mu}"
        return None

    def suspect_payloads(self, payloads):
        rows = super().suspect_payloads(payloads)
        if rows is None or self.mu == 0.0:
            return rows
        mu = payload_numbers(payloads, "prox_mu")  # NaN where missing
        return None if mu is None else rows + rows_where(mu != self.mu)

    def update_passes(self, K: Optional[int] = None) -> Tuple[str, ...]:
        return ("sum",)  # one weighted sum over U (Aggregator.passes)

    def _aggregate(self, rin):
        res = super()._aggregate(rin)
        res.info["mu"] = self.mu
        return res
