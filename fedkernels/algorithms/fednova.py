"""FedNova (Wang et al., 2020): normalised averaging that removes the objective inconsistency
caused by clients taking different numbers of local steps.

Client i reports tau_i local steps (payload ``local_steps``). Its update is normalised by
``a_i = ||a_i||_1``, the l1 norm of its local-solver coefficient vector:

* plain SGD: a_i = tau_i;
* SGD with (PyTorch-style) momentum rho: a_i = [tau_i - rho (1 - rho^tau_i) / (1 - rho)] / (1 - rho);
* any other local solver: the client may send ``a_norm`` directly.

Then, with p_i = n_i / sum n over the round's clients (or 1/K with ``weighting="uniform"``),

    tau_eff = sum_i p_i a_i,        new = global + server_lr * tau_eff * sum_i p_i U_i / a_i

i.e. one ``weighted_sum`` with coefficients p_i tau_eff / a_i. Equal a_i gives FedAvg.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import torch

from .base import AggResult, BatchedRule, ClientContext, ClientRule, RoundInput, payload_numbers, register, rows_where
from .fedavg import FedAvg
from .parts import momentum_steps, optimizer_lr_momentum


def optimizer_momentum(optimizer) -> float:
    """The momentum of the optimizer's first parameter group (0 when it has none)."""
    return optimizer_lr_momentum(optimizer)[1]


class FedNovaRule(ClientRule):
    """Counts local steps and records the optimizer's momentum; ``end`` returns
    ``{"local_steps": tau, "momentum": rho}``. Training itself is unchanged."""

    def step(self, ctx: ClientContext, model, optimizer) -> bool:
        ctx.extras["momentum"] = optimizer_momentum(optimizer)
        return False

    def end(self, ctx: ClientContext, model) -> Dict[str, Any]:
        return {"local_steps": int(ctx.step), "momentum": float(ctx.extras.get("momentum", 0.0))}


class FedNovaBatched(BatchedRule):
    """FedNova's client side only reports its steps and momentum (FedNovaRule, batched)."""

    def end(self, ch):
        return [{"local_steps": int(k), "momentum": float(ch.momentum)} for k in ch.steps]


FedNovaRule.batched_form = FedNovaBatched


def _number(v) -> Optional[float]:
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            return None
        v = v.item()
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


@register("fednova")
class FedNova(FedAvg):
    """Normalised averaging by the clients' local work (see module docstring).

    Options: ``local_momentum`` (rho used when a payload has no ``momentum``; default 0),
    ``weighting`` ("samples" default, or "uniform"), ``server_lr``. Payload per client:
    ``local_steps`` (required, > 0), optional ``momentum`` and ``a_norm``.
    """

    client_rule_cls = FedNovaRule

    def __init__(self, local_momentum: float = 0.0, **kw):
        super().__init__(**kw)
        momentum_steps(1, local_momentum)  # validates
        self.local_momentum = float(local_momentum)

    def check_payload(self, payload: Dict[str, Any]) -> Optional[str]:
        r = super().check_payload(payload)
        if r:
            return r
        if "a_norm" in payload:
            a = _number(payload["a_norm"])
            if a is None or not math.isfinite(a) or a <= 0:
                return f"payload 'a_norm' must be a finite number > 0, got {payload['a_norm']!r}"
            return None
        if "local_steps" not in payload:
            return self.missing_payload("local_steps", "the client's number of local steps")
        tau = _number(payload["local_steps"])
        if tau is None or not math.isfinite(tau) or tau <= 0:
            return f"payload 'local_steps' must be a number > 0, got {payload['local_steps']!r}"
        rho = _number(payload.get("momentum", self.local_momentum))
        if rho is None or not (0.0 <= rho < 1.0):
            return f"payload 'momentum' must lie in [0, 1), got {payload.get('momentum')!r}"
        return None

    _cols = None  # (payloads, their columns): read once per round by suspect_payloads and a_norms

    def _columns(self, payloads):
        """(sent, a_norm, tau, rho) over the round: sent [K] bool (a_norm given; None when no client sent
        one), a_norm [K] float64 (0 where not sent; None with sent), tau, rho [K] float64; None when some
        entry is not a plain number."""
        if self._cols is not None and self._cols[0] is payloads:
            return self._cols[1]
        sent = [k for k, p in enumerate(payloads) if "a_norm" in p]
        cols = (
            payload_numbers(payloads, "a_norm", 0.0) if sent else None,
            payload_numbers(payloads, "local_steps"),
            payload_numbers(payloads, "momentum", self.local_momentum),
        )
        if any(c is None for c in cols[1:]) or (sent and cols[0] is None):
            out = None
        else:
            has_a = None
            if sent:
                has_a = torch.zeros(len(payloads), dtype=torch.bool)
                has_a[sent] = True
            out = (has_a,) + cols
        self._cols = (payloads, out)
        return out

    def suspect_payloads(self, payloads):
        rows, cols = super().suspect_payloads(payloads), self._columns(payloads)
        if rows is None or cols is None:
            return None
        sent, a, tau, rho = cols
        inf = math.inf  # (x > 0) & (x < inf): isfinite(x) & (x > 0) in two ops (NaN fails both)
        ok = (tau > 0) & (tau < inf) & (rho >= 0) & (rho < 1)
        if sent is not None:
            ok = torch.where(sent, (a > 0) & (a < inf), ok)
        return rows if bool(ok.all()) else rows + rows_where(~ok)

    def a_norms(self, rin: RoundInput) -> torch.Tensor:
        cols = self._columns(rin.payloads)
        self._cols = None
        if cols is not None:  # whole-round: a = a_norm if sent, else ||a(tau, rho)||_1
            sent, a, tau, rho = cols
            out = tau.clone() if sent is None else torch.where(sent, a, tau)
            mom = (rho != 0) if sent is None else ~sent & (rho != 0)
            if bool(mom.any()):  # the closed form, once per distinct (tau, rho)
                pairs = torch.stack([tau[mom], rho[mom]], 1).tolist()
                memo = {tr: momentum_steps(*tr) for tr in set(map(tuple, pairs))}
                out[mom] = torch.tensor([memo[tuple(tr)] for tr in pairs], dtype=torch.float64)
            return out
        out = []
        for pl in rin.payloads:
            if "a_norm" in pl:
                out.append(_number(pl["a_norm"]))
            else:
                out.append(momentum_steps(_number(pl["local_steps"]), _number(pl.get("momentum", self.local_momentum))))
        return torch.tensor(out, dtype=torch.float64)

    def update_passes(self, K: Optional[int] = None) -> Tuple[str, ...]:
        return ("sum",)  # one weighted sum over U (Aggregator.passes)

    def _aggregate(self, rin: RoundInput) -> AggResult:
        p = self.weights(rin)
        a = self.a_norms(rin)
        tau_eff = float((p * a).sum())
        coef = p * (tau_eff / a)
        new = rin.weighted_sum(coef, base=rin.global_flat, alpha=self.server_lr)
        return AggResult(new, {"weights": p.tolist(), "a_norm": a.tolist(), "tau_eff": tau_eff, "coef": coef.tolist()})
