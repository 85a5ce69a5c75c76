"""Kuramoto-FedAvg (Muhebwa et al., 2025), per docs/specs/kuramoto_fedavg.md.

Each client update U_k gets a phase theta_k = arccos(cos(U_k, mean)), measured against the
p-weighted mean update; the server re-weights the clients with s_k = sin(theta_bar - theta_k),
theta_bar the plain mean phase, and applies the weighted sum. Three modes:

* ``mode="P"``: **paper-literal** (eqs. (1)-(5), Alg. 1 line 23): rho_k = s_k / sum_j s_j,
  new = w + server_lr * kappa_t * sum_k rho_k U_k, behind the spec's guard: the round is degenerate
  (rho := p, ``degenerate=True``) when fewer than 3 clients are valid, S is not finite, or
  |S| <= tau * sum_j |s_j| (tau = 0.05). ``guard=False`` drops the 3-client and tau tests (the
  literal formula; only S = 0 or non-finite S still falls back).
* ``mode="S"`` (default, [OURS] "coupled"): a_k = p_k (1 + kappa s_k) / sum_j p_j (1 + kappa s_j),
  kappa = clamp(kappa_t, 0, 1), delta clipped to [-pi/2, pi/2] (``clip_delta``); kappa = 0 is
  FedAvg bit for bit (a = p, same kernel call).
* ``mode="C"``: the authors' code. Phases are scalars phi_k sent by the clients (payload ``phase``,
  the mean local gradient norm, measured by ``KuramotoPhaseRule``);
  new = w + server_lr * (sum_k p_k U_k + K_t * clamp(sum_k b_k U_k, -clip, clip)),
  b_k = (c'_k - p_k sum_j c'_j) / max(1, K - 1), c'_k = sum_{j != k} cos(phi_k - phi_j).

kappa_t = kappa0 * beta^t with t the aggregator's round counter (default beta = 1: constant).

Hot path (modes P and S): one ``ops.kstats`` pass over U (spec §5.1 KSTATS: the p-weighted mean, then
dot = <U_k, mean>, nsq = ||U_k||^2, nbar = ||mean||^2, fp64, column-local: no K x K Gram) that also screens
the rows, and one ``ops.weighted_sum`` pass. No K x d temporary. On a GPU one device-to-host copy per
aggregate: the 2K + 1 statistics ride in the finite flags' copy (``RoundInput.kstats``). Mode C: two
``weighted_sum`` passes (the elementwise clamp needs the sync vector), one device-to-host copy: the
first pass's flags wait on the device (``hold``) for the clamp's flag (``RoundInput.release``).
Buffers: a flat vector holds whatever the FlatSpec holds; every entry is treated alike.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import torch

from ... import ops
from ..base import (
    AggResult,
    Aggregator,
    BatchedRule,
    ClientContext,
    ClientRule,
    RoundInput,
    host_float64,
    info_values,
    payload_numbers,
    register,
    rows_where,
    tracing,
)
from ..parts import client_weights
from .options import check_options, check_phase

EPS2 = 1e-30  # absolute floor on squared norms (fp64)
REL_NBAR = 1e-13  # ||mean||^2 below this fraction of sum_k p_k ||U_k||^2 is rounding noise


def kuramoto_stats(
    U: Optional[torch.Tensor], p, G: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dot [K], nsq [K], nbar []) in fp64 on the CPU: dot_k = <U_k, mean>, nsq_k = ||U_k||^2,
    nbar = ||mean||^2 with mean = sum_k p_k U_k; from one ``ops.kstats`` pass over U (no Gram), or, when
    the caller has U's Gram matrix ``G`` already, from it: dot = G p, nsq = diag G, nbar = p^T G p."""
    if G is None:
        if U is None:
            raise ValueError("kuramoto_stats: pass U (the [K, d] updates) or G (their Gram matrix), got neither")
        dot, nsq, nbar, _ = ops.kstats(U, host_float64(p))
        return dot.cpu(), nsq.cpu(), nbar.cpu()
    if G.device.type != "cpu":
        G = G.cpu()
    p64 = host_float64(p)
    if p64.numel() != G.size(0):
        raise ValueError(f"kuramoto_stats: p must have K={G.size(0)} entries, got {p64.numel()}")
    dot = G @ p64
    nsq = torch.diagonal(G).clone()
    return dot, nsq, p64 @ dot


def code_weights(phase: torch.Tensor, p: torch.Tensor, kappa: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Mode C: (b, a) with sync = sum_k b_k U_k and, while the clamp is inactive, a = p + kappa b.

    c'_k = sum_{j != k} cos(phi_k - phi_j) = cos phi_k (C - cos phi_k) + sin phi_k (S - sin phi_k), with
    C = sum_j cos phi_j and S = sum_j sin phi_j (cos(x - y) = cos x cos y + sin x sin y): O(K), no K x K
    pass; it differs from the pairwise sum by rounding only (~K ulp of 1, absolute)."""
    phase = phase.to(torch.float64)
    K = phase.numel()
    c, s = torch.cos(phase), torch.sin(phase)
    cp = c * (c.sum() - c) + s * (s.sum() - s)  # c'_k
    b = (cp - p * cp.sum()) / max(1, K - 1)
    return b, p + kappa * b


def _vec64(x) -> torch.Tensor:
    """``x`` as a 1-D float64 tensor (no op when it is one)."""
    t = torch.as_tensor(x, dtype=torch.float64)
    return t if t.dim() == 1 else t.reshape(-1)


def _info(**kv) -> Dict[str, Any]:
    """Phase statistics for AggResult.info: Python values in eager mode, tensors while tracing."""
    return {k: info_values(v) for k, v in kv.items()}


def kuramoto_weights(
    dot,
    nsq,
    nbar,
    p,
    mode: str = "S",
    kappa: float = 0.5,
    tau: float = 0.05,
    clip_delta: bool = True,
    theta_bar: str = "uniform",
    guard: bool = True,
) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """Weights from the phase statistics (modes "P" and "S"), all in fp64.

    Mode S returns the coefficients a (sum 1, >= 0). Mode P returns rho (sum 1 unless degenerate,
    may be negative); the caller multiplies by kappa_t at apply time. ``info`` holds theta, s, S,
    ratio = |S| / sum|s|, valid flags, degenerate / reason, mean_zero.
    """
    if mode not in ("P", "S"):
        raise ValueError(f"kuramoto_weights: mode must be 'P' or 'S' (mode C uses code_weights), got {mode!r}")
    if theta_bar not in ("uniform", "p"):
        raise ValueError(f"kuramoto_weights: theta_bar must be 'uniform' or 'p', got {theta_bar!r}")
    dot, nsq, p = _vec64(dot), _vec64(nsq), _vec64(p)
    nbar = torch.as_tensor(nbar, dtype=torch.float64)
    # tensor-only from here to the weights (traceable by torch.compile; no host syncs). Few ops, in
    # place where the tensor is fresh: each costs a few us on the host whatever K is. For x >= 0 (or
    # NaN), "x < inf" is isfinite(x) in one op.
    inf = math.inf
    mean_zero = ~((nbar < inf) & (nbar > (REL_NBAR * (p * nsq).sum()).clamp_min_(EPS2)))  # (NaN stays NaN)
    invalid = ~((nsq > EPS2) & (nsq < inf) & (dot.abs() < inf)) | mean_zero
    den = (nsq * nbar).sqrt_()  # one rounding: identical rows give c = 1
    den = torch.where(den < inf, den, nsq.sqrt() * nbar.sqrt())  # product overflowed fp64
    c = (dot / den).masked_fill_(invalid, 1.0).clamp_(-1.0, 1.0)
    th0 = torch.arccos(c)  # theta, 0 (= arccos 1) where invalid
    valid = ~invalid
    nvalid = valid.sum()
    if theta_bar == "uniform":
        tbar = th0.sum() / nvalid  # (= the mean weighted by valid's 0/1)
    else:
        wt = p.masked_fill(invalid, 0.0)
        tbar = (th0 * wt).sum() / wt.sum()
    delta = tbar - th0
    if mode == "S" and clip_delta:
        delta.clamp_(-math.pi / 2, math.pi / 2)
    s = delta.sin_().masked_fill_(invalid, 0.0)
    theta = th0.masked_fill(invalid, math.nan)
    S, abs_sum = s.sum(), s.abs().sum()
    if mode == "S":
        num = (s * kappa).add_(1.0).mul_(p)  # p (1 + kappa s)
        nden = num.sum()
        ok = nden > 1e-12
        a = p if kappa == 0.0 else torch.where(ok, num / nden, p)
        info = _info(
            theta=theta,
            theta_bar=tbar,
            s=s,
            S=S,
            valid=valid,
            num_valid=nvalid,
            mean_zero=mean_zero,
            degenerate=~ok if kappa != 0.0 else torch.zeros((), dtype=torch.bool),
        )
        if tracing():
            info["ratio"] = torch.where(abs_sum > 0, S.abs() / abs_sum, torch.full_like(S, float("nan")))
        else:
            info["ratio"] = (abs(info["S"]) / float(abs_sum)) if float(abs_sum) > 0 else None
        if info["degenerate"] is True:
            info["reason"] = "coupling denominator <= 1e-12"
        return a, info
    if tracing():
        raise RuntimeError(
            "kuramoto mode P under torch.compile: its guard is host logic; use mode S, or call the aggregator eagerly"
        )
    nvalid, S, abs_sum = int(nvalid), float(S), float(abs_sum)
    info = _info(
        theta=theta, theta_bar=tbar, s=s, S=S, valid=valid, num_valid=nvalid, mean_zero=mean_zero, degenerate=False
    )
    info["ratio"] = (abs(S) / abs_sum) if abs_sum > 0 else None
    # mode P (paper-literal, with the guard)
    reason = None
    if not math.isfinite(S):
        reason = "S is not finite"
    elif S == 0.0:
        reason = "S = 0"
    elif guard and nvalid < 3:
        reason = f"fewer than 3 valid clients ({nvalid})"
    elif guard and abs(S) <= tau * abs_sum:
        reason = f"|S| <= tau * sum|s| (ratio {abs(S) / abs_sum:.3g}, tau {tau})"
    if reason is not None:
        info.update(degenerate=True, reason=reason)
        return p, info
    return s / S, info


class KuramotoPhaseRule(ClientRule):
    """Mode C client side: phase = mean over local steps of the full-model gradient l2 norm."""

    def before_step(self, ctx: ClientContext, model) -> None:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not grads:
            return
        with torch.no_grad():
            n = torch.linalg.vector_norm(torch.stack(torch._foreach_norm([g.detach() for g in grads])).double())
        acc = ctx.extras.get("phase_sum")
        ctx.extras["phase_sum"] = n if acc is None else acc + n
        ctx.extras["phase_steps"] = ctx.extras.get("phase_steps", 0) + 1

    def end(self, ctx: ClientContext, model) -> Dict[str, Any]:
        n = ctx.extras.get("phase_steps", 0)
        return {"phase": float(ctx.extras["phase_sum"]) / n if n else 0.0}


class KuramotoPhaseBatched(BatchedRule):
    """KuramotoPhaseRule, batched (mode C): phase = mean over the local steps of the gradient's l2 norm."""

    def begin(self, ch):
        self.sum = torch.zeros(ch.C, dtype=torch.float64, device=ch.W.device)

    def before_step(self, ch, G, rho, ce, m, active):
        self.sum += torch.where(active, torch.linalg.vector_norm(G.double(), dim=1), 0.0)

    def end(self, ch):
        return [{"phase": float(s) / k if k else 0.0} for s, k in zip(self.sum.tolist(), ch.steps)]


KuramotoPhaseRule.batched_form = KuramotoPhaseBatched


@register("kuramoto", "kuramoto_fedavg")
class KuramotoFedAvg(Aggregator):
    """Kuramoto-FedAvg aggregator (see module docstring; options: ``kuramoto/options.py``)."""

    screen_in_pass = True  # the first read of U (kstats, or mode C's weighted_sum) screens its rows

    def __init__(
        self,
        mode: str = "S",
        kappa0: Optional[float] = None,
        beta: float = 1.0,
        tau: float = 0.05,
        guard: bool = True,
        clip_delta: bool = True,
        theta_bar: str = "uniform",
        clip: float = 10.0,
        weighting: str = "samples",
        **kw,
    ):
        super().__init__(**kw)
        self.mode, self.kappa0 = check_options(self.name, mode, kappa0, beta, tau, theta_bar, clip, weighting)
        self.beta, self.tau, self.clip = float(beta), float(tau), float(clip)
        self.guard, self.clip_delta, self.theta_bar, self.weighting = (
            bool(guard),
            bool(clip_delta),
            theta_bar,
            weighting,
        )

    def kappa(self, t: Optional[int] = None) -> float:
        """kappa_t = kappa0 * beta^t (t defaults to the current round)."""
        t = self.round if t is None else int(t)
        return self.kappa0 * self.beta**t

    def client_rule(self) -> Optional[ClientRule]:
        return KuramotoPhaseRule(self) if self.mode == "C" else None

    def check_payload(self, payload: Dict[str, Any]) -> Optional[str]:
        r = super().check_payload(payload)
        return r if r or self.mode != "C" else check_phase(payload)

    def suspect_payloads(self, payloads):
        rows = super().suspect_payloads(payloads)
        if rows is None or self.mode != "C":
            return rows
        phase = payload_numbers(payloads, "phase")  # NaN where missing
        return None if phase is None else rows + rows_where(~torch.isfinite(phase))

    def update_passes(self, K: Optional[int] = None) -> Tuple[str, ...]:
        return ("sum", "sum")  # modes P/S: the kstats pass (column-local, like a sum), the sum; mode C: the sum

    def _aggregate(self, rin: RoundInput) -> AggResult:
        p = client_weights(rin, self.weighting)
        kt = self.kappa()
        if self.mode == "C":
            phase = payload_numbers(rin.payloads, "phase")
            if phase is None:  # numbers as text, ...: one by one
                phase = torch.tensor([float(pl["phase"]) for pl in rin.payloads], dtype=torch.float64)
            b, a = code_weights(phase, p, kt)
            # the first pass screens U's rows; its flags wait on the device for the clamp's flag
            new = rin.weighted_sum(p, base=rin.global_flat, alpha=self.server_lr, hold=True)
            sync = rin.weighted_sum(b)
            over = ops.any_flag(sync.abs() > self.clip)
            sync.clamp_(-self.clip, self.clip)
            new.add_(sync, alpha=self.server_lr * kt)
            clipped = bool(rin.release(over))  # flags and clamp flag: one device-to-host copy
            info = {
                "mode": "C",
                "kappa": kt,
                "phase": phase.tolist(),
                "weights": a.tolist(),
                "sync_coef": b.tolist(),
                "clipped": clipped,
            }
            return AggResult(new, info)
        dot, nsq, nbar = rin.kstats(p)  # one pass over U that screens its rows (spec §5.1 KSTATS); the
        # statistics come to the host with the flags (one device-to-host copy), so the rest is host arithmetic
        if self.mode == "S":
            kap = min(max(kt, 0.0), 1.0)
            a, info = kuramoto_weights(
                dot, nsq, nbar, p, "S", kap, clip_delta=self.clip_delta, theta_bar=self.theta_bar
            )
            alpha = self.server_lr
        else:
            kap = kt
            a, info = kuramoto_weights(
                dot, nsq, nbar, p, "P", kap, tau=self.tau, theta_bar=self.theta_bar, guard=self.guard
            )
            alpha = self.server_lr * kt
        new = rin.weighted_sum(a, base=rin.global_flat, alpha=alpha)
        info.update(
            mode=self.mode,
            kappa=kap,
            weights=info_values(a),
            p=info_values(p),
            guard_fired=self.mode == "P" and info["degenerate"],
        )
        if self.mode == "P" and not info["degenerate"]:
            info["max_abs_rho"] = float(a.abs().max())
        return AggResult(new, info)
