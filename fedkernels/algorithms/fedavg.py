"""FedAvg (McMahan et al., 2017): global <- global + eta_g * sum_k p_k U_k, p_k = n_k / sum n."""

from __future__ import annotations

from typing import Optional, Tuple

from .base import AggResult, Aggregator, RoundInput, info_values, register
from .parts import WEIGHTINGS, check_choice, client_weights
from .server_lr import ServerLRSchedule


@register("fedavg")
class FedAvg(Aggregator):
    """Sample-weighted average of the client updates, applied with server learning rate ``server_lr``.

    ``weighting="samples"`` (default) uses p_k = n_k / sum n; ``"uniform"`` uses 1/K.
    ``server_lr_schedule``: path of a JSON file of per-round multipliers s_t
    (``fedkernels.algorithms.server_lr``): round t then uses server learning rate ``server_lr * s_t``
    (logged as ``server_lr``). Only FedAvg and FedAvgM apply it; a subclass with its own step rejects it.
    One native ``weighted_sum`` pass over the K x d updates; no per-layer loop.
    """

    screen_in_pass = True  # its weighted_sum pass over U also screens the rows (RoundInput.weighted_sum)
    reads_beyond_weighted_sum = None  # (its subclasses' updates too: FedAvgM, FedProx, FedNova, FedAdam, ...)
    # (FedAvgM: momentum on the noised aggregate, FedAdam/FedYogi/FedAdagrad: a server step on it, both
    # post-processing; FedProx: the proximal term is client-side; FedNova: step counts as public metadata)
    dp_verdict = "private"
    applies_round_lr = True  # this class's _aggregate steps with round_lr() (server_lr_schedule is honoured)

    def __init__(self, weighting: str = "samples", server_lr_schedule: Optional[str] = None, **kw):
        super().__init__(**kw)
        check_choice(self.name, "weighting", weighting, WEIGHTINGS)
        self.weighting = weighting
        self.lr_schedule: Optional[ServerLRSchedule] = None
        if server_lr_schedule is not None:
            owner = next(k for k in type(self).__mro__ if "_aggregate" in vars(k))
            if not vars(owner).get("applies_round_lr", False):
                raise ValueError(
                    f"{self.name}: server_lr_schedule={server_lr_schedule!r} is not supported "
                    "(only fedavg and fedavgm apply a per-round server learning rate)"
                )
            self.lr_schedule = ServerLRSchedule.load(server_lr_schedule, f"{self.name}: server_lr_schedule")

    def weights(self, rin: RoundInput):
        return client_weights(rin, self.weighting)

    def round_lr(self, rin: RoundInput) -> float:
        """This round's server learning rate: ``server_lr``, times s_t when a schedule is set (the
        schedule checks the round's sampled clients: the accepted and the excluded ones)."""
        if self.lr_schedule is None:
            return self.server_lr
        ids = list(rin.client_ids) + [e["client_id"] for e in rin.excluded if "client_id" in e]
        return self.server_lr * self.lr_schedule.value(self.round, ids)

    def update_passes(self, K: Optional[int] = None) -> Tuple[str, ...]:
        return ("sum",)  # one weighted sum over U (Aggregator.passes)

    def _aggregate(self, rin: RoundInput) -> AggResult:
        p = self.weights(rin)
        lr = self.round_lr(rin)
        new = rin.weighted_sum(p, base=rin.global_flat, alpha=lr)  # (screens the rows in the same pass)
        info = {"weights": info_values(p)}
        if self.lr_schedule is not None:
            info["server_lr"] = lr
        return AggResult(new, info)
