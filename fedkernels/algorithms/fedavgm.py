"""FedAvgM (Hsu, Qi & Brown, 2019): FedAvg with server momentum.

In the update convention of fedkernels (U_k = local - global):

    v   <- beta * v + sum_k p_k U_k
    new <- global + server_lr * v            (nesterov: global + server_lr * (beta * v + sum_k p_k U_k))

``beta = 0`` is FedAvg with server learning rate ``server_lr``. The momentum vector v
(``parts.ServerMomentum``; length d, dtype and device of the global model) is the only state.
"""

from __future__ import annotations

from typing import Optional, Tuple

from .base import AggResult, RoundInput, register
from .fedavg import FedAvg
from .parts import ServerMomentum, momentum_attr


@register("fedavgm")
class FedAvgM(FedAvg):
    """Server momentum ``beta`` (default 0.9) on the sample-weighted mean update.

    Options: ``beta`` in [0, 1), ``server_lr`` (default 1.0), ``nesterov`` (default False),
    ``weighting`` ("samples" or "uniform", as FedAvg), ``server_lr_schedule`` (as FedAvg: round t
    steps with ``server_lr * s_t``; the momentum buffer itself is not rescaled). One ``weighted_sum`` pass over U that
    accumulates straight into the momentum buffer, then one axpy over d.
    """

    applies_round_lr = True  # _aggregate steps with round_lr()
    state_attrs = ("momentum",)

    def __init__(self, beta: float = 0.9, nesterov: bool = False, **kw):
        super().__init__(**kw)
        beta = float(beta)
        if not (0.0 <= beta < 1.0):
            raise ValueError(f"fedavgm: beta must lie in [0, 1), got {beta}")
        self.beta = beta
        self.nesterov = bool(nesterov)
        self._mom = ServerMomentum(beta)

    momentum = momentum_attr("_mom")

    def update_passes(self, K: Optional[int] = None) -> Tuple[str, ...]:
        return ("sum", "sum") if self.nesterov else ("sum",)  # Nesterov: the mean update again

    def _aggregate(self, rin: RoundInput) -> AggResult:
        p = self.weights(rin)
        g = rin.global_flat
        lr = self.round_lr(rin)
        v = self._mom.step(rin, p, g)  # v = beta v + sum p U (screens U)
        if self.nesterov:
            step = rin.weighted_sum(p).add_(v, alpha=self.beta)
            new = g.add(step, alpha=lr)
        else:
            new = g.add(v, alpha=lr)
        info = {"weights": p.tolist(), "beta": self.beta}
        if self.lr_schedule is not None:
            info["server_lr"] = lr
        return AggResult(new, info)
