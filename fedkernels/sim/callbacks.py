"""Per-round callbacks: attach TensorBoard, W&B, MLflow or your own logging to a simulation.

A callback is any callable ``cb(round, metrics, model)``, called on the main process after every
round: ``round`` counts from 1, ``metrics`` is the round's dict as written to metrics.jsonl
(``accuracy``, ``test_loss``, ``train_loss_mean``, ``global_loss``, ``t_local``, ... and ``agg``,
the aggregator's info), ``model`` the ``nn.Module`` holding the new global model. An optional
``close()`` is called when the run ends::

    def to_wandb(rnd, metrics, model):
        wandb.log({k: v for k, v in metrics.items() if isinstance(v, float)}, step=rnd)
    Simulation(cfg, callbacks=[to_wandb, TensorBoardCallback()]).run()

:class:`TensorBoardCallback` ships here (``pip install tensorboard``; ``fedkernels run --tensorboard``).
"""
from __future__ import annotations

import math
import os
from typing import Any, Dict, Iterator, Optional, Tuple

from torch import nn

__all__ = ["TensorBoardCallback", "scalars"]


def scalars(metrics: Dict[str, Any], prefix: str = "") -> Iterator[Tuple[str, float]]:
    """The finite numbers of a metrics dict as ``(tag, value)``, nested dicts as ``a/b`` (lists skipped)."""
    for k, v in metrics.items():
        if isinstance(v, dict):
            yield from scalars(v, f"{prefix}{k}/")
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and k != "round":
            yield prefix + k, float(v)


class TensorBoardCallback:
    """Writes every round's scalar metrics to a TensorBoard event file (``log_dir``; default:
    ``<run_dir>/tensorboard``, the run directory given when the simulation starts it)."""

    def __init__(self, log_dir: Optional[str] = None):
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401 - needs the tensorboard package
        except ImportError:
            raise ValueError("--tensorboard: the tensorboard package is not installed (pip install tensorboard)") from None
        self.log_dir = log_dir
        self._writer = None

    def bind(self, run_dir: str) -> None:
        if self.log_dir is None:
            self.log_dir = os.path.join(run_dir, "tensorboard")

    def __call__(self, rnd: int, metrics: Dict[str, Any], model: nn.Module) -> None:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter
            self._writer = SummaryWriter(log_dir=self.log_dir or "tensorboard")
        for tag, v in scalars(metrics):
            self._writer.add_scalar(tag, v, rnd)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
