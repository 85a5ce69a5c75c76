"""FedAvg (McMahan et al., 2017): global <- global + eta_g * sum_k p_k U_k, p_k = n_k / sum n."""
from __future__ import annotations

from .. import ops
from .base import AggResult, Aggregator, RoundInput, info_values, register
from .parts import WEIGHTINGS, check_choice, client_weights


@register("fedavg")
class FedAvg(Aggregator):
    """Sample-weighted average of the client updates, applied with server learning rate ``server_lr``.

    ``weighting="samples"`` (default) uses p_k = n_k / sum n; ``"uniform"`` uses 1/K.
    One native ``weighted_sum`` pass over the K x d updates; no per-layer loop.
    """

    screen_after_pure = True   # stateless: one pass over U; rows are scanned only if the result is not finite

    def __init__(self, weighting: str = "samples", **kw):
        super().__init__(**kw)
        check_choice(self.name, "weighting", weighting, WEIGHTINGS)
        self.weighting = weighting

    def weights(self, rin: RoundInput):
        return client_weights(rin, self.weighting)

    def _aggregate(self, rin: RoundInput) -> AggResult:
        p = self.weights(rin)
        new = ops.weighted_sum(rin.U, p, base=rin.global_flat, alpha=self.server_lr)
        return AggResult(new, {"weights": info_values(p)})
