"""Heterogeneous compute (FedECADO §6, eqs. 43-44): each client's base learning rate and local epochs,
drawn from the run seed so that every method sees the same draws (config ``train.hetero``)."""

from __future__ import annotations

import math
from typing import Any, Dict, List

import numpy as np

from .config import TrainConfig
from .seeds import STREAM_HETERO, derive_seed


class HeteroCompute:
    """Per-client learning rates and epochs (FedECADO §6, eqs. 43-44): lr_i ~ U[lr_range] (or
    log-uniform), E_i ~ U{epochs_range}; drawn once per client per run (``redraw="run"``) or per
    (client, round) (``redraw="round"``), from the run seed, so every method sees the same draws."""

    def __init__(self, train: TrainConfig, num_clients: int, seed: int):
        self.train, self.h, self.seed, self.n = train, train.hetero, int(seed), int(num_clients)
        self._fixed = [self._draw(c, -1) for c in range(self.n)] if self.h.enabled and self.h.redraw == "run" else None

    def _draw(self, cid: int, rnd: int):
        rng = np.random.default_rng(derive_seed(self.seed, STREAM_HETERO, rnd + 1, cid))
        lr = float(self.train.lr)
        if self.h.lr_range is not None:
            lo, hi = float(self.h.lr_range[0]), float(self.h.lr_range[1])
            lr = (
                float(math.exp(rng.uniform(math.log(lo), math.log(hi))))
                if self.h.lr_dist == "loguniform"
                else float(rng.uniform(lo, hi))
            )
        ep = int(self.train.epochs)
        if self.h.epochs_range is not None:
            ep = int(rng.integers(int(self.h.epochs_range[0]), int(self.h.epochs_range[1]) + 1))
        return lr, ep

    def get(self, cid: int, rnd: int):
        """(base lr, epochs) of client ``cid`` in round ``rnd``."""
        if not self.h.enabled:
            return float(self.train.lr), int(self.train.epochs)
        if self._fixed is not None:
            return self._fixed[cid]
        return self._draw(cid, rnd)

    def table(self) -> List[Dict[str, Any]]:
        return [{"client_id": c, "lr": self.get(c, 0)[0], "epochs": self.get(c, 0)[1]} for c in range(self.n)]
