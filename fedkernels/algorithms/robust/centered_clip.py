"""Centred clipping (Karimireddy, He, Jaggi, "Learning from History for Byzantine Robust
Optimization", ICML 2021).

    v <- v + (1/K) sum_k clip_tau(U_k - v),   clip_tau(x) = x min(1, tau / ||x||),

repeated ``iterations`` times, starting from the previous round's aggregate (zero at the first round):
the authors' code keeps its output as the next round's starting centre (their ``Clipping`` aggregator's
``momentum``; default one iteration), which is what makes one iteration enough in their analysis, so
this does the same. Uniform weights 1/K, as in the paper.

After l iterations v = a v_0 + U^T c (a scalar, c in R^K), so the distances ||U_k - v|| need only
``U v_0``, ``||U_k||^2`` and ``||v_0||^2`` (one native read of U that also screens the rows:
``common.row_dots``) and, from the second iteration on, one ``kstats(U, c)`` pass each; the result is
one weighted sum with base a v_0: iterations + 1 reads of U in all. (All iterations on the fp64 Gram
instead would need U v_0 besides, and the Gram costs K^2 d / 2 multiply-adds: at K = 100 it takes
about 15 reads' time on the CPU, more than a kstats pass per iteration for any usual iteration count.)
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..base import AggResult, Aggregator, RoundInput, register
from ..._memory import new_vector
from .common import check_int, check_positive, row_dots


@register("centered_clip")
class CenteredClip(Aggregator):
    """Centred clipping: ``global + server_lr * v`` with v from ``iterations`` steps of
    v <- v + mean_k clip_tau(U_k - v) starting at the previous round's v (state ``center``; zeros at
    the first round). ``tau`` > 0: the clipping radius (in the updates' norm). ``info``: the clients'
    clip factors min(1, tau/||U_k - v||) of the last iteration."""

    state_attrs = ("center",)
    screen_in_pass = True  # row_dots' pass screens the rows (on a tensor; a source is screened first)
    dp_verdict = "its iterated clipping reads the un-noised updates: its output is not one noised weighted sum"

    def __init__(self, tau: float = 10.0, iterations: int = 1, **kw):
        super().__init__(**kw)
        self.tau = check_positive(self.name, "tau", tau)
        self.iterations = check_int(self.name, "iterations", iterations, 1)
        self.center: Optional[torch.Tensor] = None

    def _aggregate(self, rin: RoundInput) -> AggResult:
        g = rin.global_flat
        K = rin.K
        v0 = self.center
        if v0 is None or v0.shape != g.shape:
            v0 = torch.zeros_like(g)
        v0 = v0.to(device=g.device, dtype=g.dtype)
        dots0, nsq, vv0 = row_dots(rin, v0)  # U v0, ||U_k||^2, ||v0||^2 (one read of U, screened)
        a, c = 1.0, torch.zeros(K, dtype=torch.float64)
        s = torch.ones(K, dtype=torch.float64)
        for it in range(self.iterations):
            if it == 0:
                uv, vv = dots0, vv0
            else:  # v = a v0 + U^T c
                dotc, _, nbar = rin.kstats(c)
                uv = a * dots0 + dotc
                vv = a * a * vv0 + 2.0 * a * float(c @ dots0) + float(nbar)
            dist = (nsq - 2.0 * uv + vv).clamp_min(0.0).sqrt()
            s = torch.where(dist > self.tau, self.tau / dist, torch.ones_like(dist))
            keep = 1.0 - float(s.sum()) / K
            a, c = a * keep, c * keep + s / K
        base = torch.mul(v0, a, out=new_vector(v0.numel(), v0.dtype, v0.device)) if a != 0.0 else None
        v = rin.weighted_sum(c, base=base)
        self.center = v
        new = (
            torch.add(g, v, alpha=self.server_lr, out=rin.result_vector())
            if v.dtype == g.dtype
            else g.add(v, alpha=self.server_lr)
        )
        return AggResult(new, {"clip_factors": s.tolist(), "center_weight": a})

    def passes(self, K: Optional[int] = None) -> Tuple[str, ...]:
        return ("sum", "sum") + ("sum",) * (self.iterations - 1) + ("sum",)
