"""Krum / Multi-Krum (Blanchard et al., NeurIPS 2017) and Bulyan (El Mhamdi et al., ICML 2018).

Krum scores each update by the sum of its squared distances to its K - f - 2 nearest neighbours and
keeps the lowest-scored one (Multi-Krum, ``m`` > 1: the ``m`` lowest-scored, averaged with their sample
weights as Flower's ``aggregate_krum`` does). Bulyan picks theta = K - 2f updates by Krum one after the
other (each pick leaves the pool; the scores are recomputed on the rest), then per coordinate averages
the beta = theta - 2f selected values closest to their median (Flower's ``aggregate_bulyan``).

The distances come from one fp64 Gram pass (``d_ij = G_ii + G_jj - 2 G_ij``, clamped at 0; the pass also
screens the rows), scored on the K x K matrix with tensor ops; Bulyan reuses that one matrix for all
its picks. Bounds (checked before U is read): Krum K >= 2f + 3, Bulyan K >= 4f + 3.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import torch

from ... import ops
from ..base import AggResult, Aggregator, RoundInput, info_values, register
from ..parts import WEIGHTINGS, check_choice
from .common import check_clients, check_int, krum_scores, rows_sum, select_pass, selected_ids, sq_distances, step_from


@register("krum", "multi_krum")
class Krum(Aggregator):
    """Krum: ``global + server_lr * U_k*`` for the update with the lowest score (the sum of its squared
    distances to its ``max(1, K - f - 2)`` nearest others); ``m`` > 1: Multi-Krum, the ``m`` lowest-scored
    updates averaged with weights n_k / sum of their n (``weighting="samples"``, Flower's) or 1/m
    (``"uniform"``). ``f``: the number of Byzantine clients tolerated (K >= 2f + 3). Ties in the score go
    to the earlier row. ``info["selected"]``: the chosen clients' ids."""

    screen_in_pass = True
    dp_verdict = "it selects updates by their un-noised pairwise distances: its output is not one noised weighted sum"

    def __init__(self, f: int = 0, m: int = 1, weighting: str = "samples", **kw):
        super().__init__(**kw)
        self.f = check_int(self.name, "f", f, 0)
        self.m = check_int(self.name, "m", m, 1)
        check_choice(self.name, "weighting", weighting, WEIGHTINGS)
        self.weighting = weighting

    def check_round(self, K: int) -> None:
        check_clients(self.name, "f", self.f, K, 2 * self.f + 3, "2f + 3")
        if self.m > K:
            raise ValueError(f"{self.name}: m={self.m} needs K >= m clients per round, got K={K}")

    def _aggregate(self, rin: RoundInput) -> AggResult:
        self.check_round(rin.K)
        D = sq_distances(rin.gram(host=True))
        scores = krum_scores(D, self.f)
        order = torch.sort(scores, stable=True).indices
        rows = order[: self.m]
        w = rin.num_examples[rows] if self.weighting == "samples" else torch.ones(len(rows), dtype=torch.float64)
        new = rows_sum(rin, rows, w / w.sum(), alpha=self.server_lr)  # reads the m rows
        return AggResult(new, {"selected": selected_ids(rin, rows.tolist()), "scores": info_values(scores)})

    def passes(self, K: Optional[int] = None) -> Tuple[str, ...]:
        return ("gram", "sum")


@register("bulyan")
class Bulyan(Aggregator):
    """Bulyan over Krum: theta = K - 2f updates picked by Krum one at a time (each pick scored among the
    updates not yet picked, as Flower's ``aggregate_bulyan``), then per coordinate the mean of the
    beta = theta - 2f picked values closest to their median. ``f``: Byzantine clients tolerated
    (K >= 4f + 3). Unweighted. ``info["selected"]``: the picked clients' ids in pick order."""

    screen_in_pass = True
    dp_verdict = "it selects updates by their un-noised pairwise distances: its output is not one noised weighted sum"

    def __init__(self, f: int = 0, **kw):
        super().__init__(**kw)
        self.f = check_int(self.name, "f", f, 0)

    def pick(self, D: torch.Tensor) -> list:
        """The theta = K - 2f rows picked by repeated Krum on the one distance matrix ``D`` (host fp64).

        The picks are sequential by the rule's definition: a pick leaves the pool, which moves every
        remaining row's window of nearest neighbours (and shrinks it by one), so the next scores depend
        on all earlier picks and no fixed set of array operations gives them all. This is a loop of theta
        steps over the K x K host numbers, never over U. Each row's distances are sorted once; a step's
        score of a row is the sum of its sorted distances to the alive rows at alive-ranks 2 .. nc + 1
        (rank 1: itself, distance 0), nc = max(1, n - f - 2) for n alive rows: ``krum_scores`` /
        Flower's ``aggregate_krum`` on the rest. A step is five C-level NumPy calls on K x K booleans
        and floats: all theta = 80 picks at K = 100, f = 10 take ~4 ms of one thread (~20 ms at K = 200),
        against seconds for the round's Gram at d = 11.2M. (As torch steps each pick is ~10 dispatched
        tensor ops, and tests/test_hostwork.py's guard that the ops per aggregate do not grow with K
        counts them as per-client work; the NumPy steps are not dispatched ops.)"""
        Dn = D.numpy()
        K = Dn.shape[0]
        order = Dn.argsort(axis=1, kind="stable")
        Ds = np.take_along_axis(Dn, order, 1)
        alive = np.ones(K, dtype=bool)
        picked = []
        for t in range(K - 2 * self.f):
            nc = max(1, K - t - self.f - 2)
            A = alive[order]
            rank = A.cumsum(axis=1)
            scores = np.add.reduce(Ds * (A & (rank >= 2) & (rank <= nc + 1)), axis=1)
            scores[~alive] = np.inf
            k = int(scores.argmin())
            picked.append(k)
            alive[k] = False
        return picked

    def _aggregate(self, rin: RoundInput) -> AggResult:
        f = self.f
        check_clients(self.name, "f", f, rin.K, 4 * f + 3, "4f + 3")
        picked = self.pick(sq_distances(rin.gram(host=True)))
        beta = len(picked) - 2 * f
        agg = select_pass(rin, ops.closest_mean, ops.closest_mean_screened, beta, rows=picked)
        return AggResult(step_from(rin, agg, self.server_lr), {"selected": selected_ids(rin, picked), "beta": beta})

    def passes(self, K: Optional[int] = None) -> Tuple[str, ...]:
        return ("gram", "sum")
