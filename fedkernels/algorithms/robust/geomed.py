"""RFA: robust federated aggregation by the geometric median (Pillutla, Kakade, Harchaoui, IEEE TSP
2022), computed by the smoothed Weiszfeld algorithm.

The point v minimises sum_k alpha_k max(nu, ||v - U_k||) (alpha_k = n_k / sum n). Starting from the
weighted mean, each iteration re-weights the rows by ``beta_k = alpha_k / max(nu, ||v - U_k||)`` and
takes v = sum_k beta_k U_k / sum_k beta_k; it stops after ``iterations`` steps, or earlier once the
objective improves by less than ``ftol`` of itself (RFA's own stopping rule).

v is always a combination of the rows (v = U^T p), so the distances of all rows to v come from one
``kstats(U, p)`` pass (``||U_k - v||^2 = ||U_k||^2 - 2 <U_k, v> + ||v||^2`` in fp64, clamped at 0): one
read of U per iteration, plus the final weighted sum. No K x d temporary.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..base import AggResult, Aggregator, RoundInput, info_values, register
from ..parts import WEIGHTINGS, check_choice, client_weights
from .common import check_int, check_positive


@register("geometric_median", "rfa")
class GeometricMedian(Aggregator):
    """RFA: ``global + server_lr * v``, v the smoothed geometric median of the updates (weights alpha:
    ``weighting="samples"`` n_k / sum n, Pillutla et al.'s, or ``"uniform"``), by at most ``iterations``
    smoothed Weiszfeld steps with smoothing ``nu`` (RFA's default 1e-6), stopping early when the
    objective's relative improvement is below ``ftol``. ``info``: the final weights, the steps taken and
    the objective sum_k alpha_k ||v_t - U_k|| at the last point measured."""

    screen_in_pass = True
    dp_verdict = (
        "its Weiszfeld weights are functions of the un-noised updates: its output is not one noised weighted sum"
    )

    def __init__(self, iterations: int = 3, nu: float = 1e-6, ftol: float = 1e-6, weighting: str = "samples", **kw):
        super().__init__(**kw)
        self.iterations = check_int(self.name, "iterations", iterations, 1)
        self.nu = check_positive(self.name, "nu", nu)
        f = float(ftol)
        if not 0.0 <= f < float("inf"):
            raise ValueError(f"{self.name}: ftol must be a finite number >= 0, got {ftol!r}")
        self.ftol = f
        check_choice(self.name, "weighting", weighting, WEIGHTINGS)
        self.weighting = weighting

    def weiszfeld(self, rin: RoundInput) -> Tuple[torch.Tensor, int, float]:
        """(p, steps, objective): the final point v = U^T p after the smoothed Weiszfeld steps."""
        alpha = client_weights(rin, self.weighting)
        p = alpha.clone()
        prev = None
        steps = 0
        obj = float("nan")
        for _ in range(self.iterations):
            dot, nsq, nbar = rin.kstats(p)  # distances of every row to v = U^T p
            dist = (nsq - 2.0 * dot + nbar).clamp_min(0.0).sqrt()
            obj = float((alpha * dist).sum())
            if prev is not None and abs(prev - obj) <= self.ftol * obj:
                break
            beta = alpha / dist.clamp_min(self.nu)
            p = beta / beta.sum()
            prev = obj
            steps += 1
        return p, steps, obj

    def _aggregate(self, rin: RoundInput) -> AggResult:
        p, steps, obj = self.weiszfeld(rin)
        new = rin.weighted_sum(p, base=rin.global_flat, alpha=self.server_lr)
        return AggResult(new, {"weights": info_values(p), "steps": steps, "objective": obj})

    def passes(self, K: Optional[int] = None) -> Tuple[str, ...]:
        return ("sum",) * (self.iterations + 1)
