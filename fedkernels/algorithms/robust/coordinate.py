"""Coordinate-wise median and trimmed mean (Yin et al. 2018): per coordinate, an order statistic of
the K client updates instead of their mean, as Flower's FedMedian (``np.median``: an even K takes the
mean of the two middle values) and FedTrimmedAvg (``int(beta K)`` values cut from each end, as
``scipy.stats.trim_mean``). Unweighted (the clients' sample counts do not enter), like Flower's.
One read of U (``ops.order_mean``, which also screens the rows)."""

from __future__ import annotations

from typing import Optional, Tuple

from ... import ops
from ..base import AggResult, Aggregator, RoundInput, register
from .common import select_pass, step_from


@register("median")
class Median(Aggregator):
    """Coordinate-wise median of the updates: ``global + server_lr * median_k U_k`` per coordinate
    (an even K: the mean of the two middle values, like ``np.median``)."""

    screen_in_pass = True
    dp_verdict = "it takes order statistics of the un-noised updates: its output is not one noised weighted sum"

    def order_range(self, K: int) -> Tuple[int, int]:
        return (K - 1) // 2, K // 2 + 1

    def _aggregate(self, rin: RoundInput) -> AggResult:
        lo, hi = self.order_range(rin.K)
        agg = select_pass(rin, ops.order_mean, ops.order_mean_screened, lo, hi)
        return AggResult(step_from(rin, agg, self.server_lr), {"order_range": [lo, hi]})

    def passes(self, K: Optional[int] = None) -> Tuple[str, ...]:
        return ("sum", "sum")  # on a source: the screen, then the selection pass


@register("trimmed_mean")
class TrimmedMean(Median):
    """Coordinate-wise trimmed mean: per coordinate, the mean of the values left after dropping the
    ``int(beta * K)`` smallest and the ``int(beta * K)`` largest (Flower's FedTrimmedAvg,
    ``scipy.stats.trim_mean``). ``beta`` in [0, 0.5): 0 is the plain (unweighted) mean."""

    def __init__(self, beta: float = 0.2, **kw):
        super().__init__(**kw)
        b = float(beta)
        if not 0.0 <= b < 0.5:
            raise ValueError(f"{self.name}: beta must lie in [0, 0.5), got {beta!r}")
        self.beta = b

    def order_range(self, K: int) -> Tuple[int, int]:
        lo = int(self.beta * K)
        return lo, K - lo
