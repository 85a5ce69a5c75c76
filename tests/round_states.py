"""A callback that records a run's state after every round, for tests that restart one round from
the state another run had before it (tests/test_batched.py, tests/test_sim_distributed.py)."""

from __future__ import annotations

import copy

from torch import nn

from fedkernels.sim.callbacks import Callback


class RoundStates(Callback):
    """``states[0]``: the model the run starts from; ``states[r]``: the run's state after round r
    (``Simulation.state``). ``bn_steps``: also each BatchNorm's ``num_batches_tracked`` (not in the
    flat state) under ``"tracked"``."""

    def __init__(self, bn_steps: bool = False):
        self.states = []
        self.bn_steps = bn_steps

    def on_start(self, sim):
        self.states.append({"global": sim.global_flat.detach().cpu().clone()})

    def on_round_end(self, sim, metrics):
        st = copy.deepcopy(sim.state(metrics["round"]))
        if self.bn_steps:
            st["tracked"] = [
                int(m.num_batches_tracked)
                for m in sim.global_model().modules()
                if isinstance(m, nn.modules.batchnorm._BatchNorm)
            ]
        self.states.append(st)
