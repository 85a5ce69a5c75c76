"""Buffers (BatchNorm's running statistics, any float buffer of the FlatSpec) are not parameters: every
method's new model has them as the sample-weighted average of the round's clients' buffers
(fedkernels/algorithms/buffers.py), so no server step can make a running variance negative; a
non-finite evaluation stops a simulated run with one line naming the round and the method."""

import os
import sys

import numpy as np
import pytest
import torch
from torch import nn

from fedkernels import algorithms
from fedkernels.algorithms.buffers import buffer_ranges
from fedkernels.flat import FlatSpec
from fedkernels.sim import presets
from fedkernels.sim.config import apply_overrides
from fedkernels.sim.simulation import Simulation

import cli_process  # tests/cli_process.py: the command in a child forked from a pre-imported interpreter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class BNNet(nn.Module):
    """A conv layer without bias, BatchNorm, a linear head: the model where FedECADO's and FedAvgM's
    server steps drove the running variance below 0 (to -0.48 after round 2, NaN test losses)."""

    def __init__(self, num_classes):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 8 * 8, num_classes)

    def forward(self, x):
        return self.fc(torch.relu(self.norm(self.conv(x))).flatten(1))


_DATA = {}


def _data():
    if not _DATA:
        from fedkernels.sim.data import load_dataset

        tr, te = load_dataset("digits")
        perm = np.random.default_rng(0).permutation(len(tr.y))
        _DATA["v"] = tr, te, [perm[a:b] for a, b in ((0, 13), (13, 74), (74, 164), (164, 314))]
    return _DATA["v"]


HETERO = ["train.hetero.enabled=true", "train.hetero.lr_range=[0.02,0.2]", "train.hetero.epochs_range=[1,3]"]
OPTIONS = {
    "kuramoto": ["algorithm.options.mode=C", "algorithm.options.kappa0=0.2"],
    "local_gc_only": ["algorithm.options.lam=0.5"],
}


def _run(name, *overrides):
    tr, te, parts = _data()
    cfg = apply_overrides(
        presets.get("smoke"),
        [
            "threads=1",
            "verbose=false",
            "plots=false",
            "progress=false",
            "rounds=3",
            "num_clients=4",
            "client_loss=participants",
            f"algorithm.name={name}",
            *OPTIONS.get(name, []),
            *HETERO,
            *overrides,
        ],
    )
    s = Simulation(
        cfg, write_outputs=False, train=tr, test=te, client_indices=parts, model_fn=lambda nc, c, sz: BNNet(nc)
    )
    s.run()
    return s


@pytest.mark.parametrize("name", algorithms.available())
def test_every_method_keeps_batchnorm_statistics_valid(name):
    s = _run(name)
    assert len(s.metrics) == 3 and not any(m.get("diverged") for m in s.metrics)
    for m in s.metrics:
        assert np.isfinite(m["test_loss"]) and np.isfinite(m["accuracy"]), (name, m["round"], m["test_loss"])
    s.global_model()
    bn = [m for m in s.model.modules() if isinstance(m, nn.BatchNorm2d)][0]
    assert torch.isfinite(bn.running_mean).all() and bool((bn.running_var >= 0).all()), bn.running_var


def test_buffers_are_the_sample_weighted_average_whatever_the_method():
    """FedAvgM's momentum and a server learning rate of 2 move the parameters, not the buffers: those
    are global + sum_k p_k U_k, computed here in float64 from the same rows."""
    model = BNNet(10)
    spec = FlatSpec.from_module(model)
    ((a, b),) = buffer_ranges(spec)
    assert (a, b) == (spec.d - 16, spec.d)  # running_mean and running_var, adjacent: one range
    g = spec.flatten(model).clone()
    gen = torch.Generator().manual_seed(0)
    n = [13.0, 61.0, 90.0]
    for name, opts in (("fedavgm", {"server_lr": 1.0}), ("fedavg", {"server_lr": 2.0})):
        agg = algorithms.build(name, **opts)
        agg.setup(spec, 3, g)
        x = g
        for _ in range(3):
            U = torch.randn(3, spec.d, generator=gen) * 0.1
            new, _ = agg.aggregate(x, U, n, [0, 1, 2])
            p = torch.tensor(n, dtype=torch.float64) / sum(n)
            want = x[a:b].double() + p @ U[:, a:b].double()
            torch.testing.assert_close(new[a:b].double(), want, rtol=0, atol=4 * 2**-24 * float(want.abs().max()))
            x = new
        assert not torch.equal(new[:a], g[:a])


def test_no_spec_or_no_buffers_leaves_the_result_alone():
    """Library use without a spec, or a model without buffers: exactly the method's own result."""
    torch.manual_seed(0)
    g, U = torch.randn(50), torch.randn(4, 50)
    ref, _ = algorithms.build("fedavgm", server_lr=1.5).aggregate(g, U, [1, 2, 3, 4])
    agg = algorithms.build("fedavgm", server_lr=1.5)
    agg.setup(FlatSpec.from_module(nn.Linear(7, 6)), 4)  # 7*6 + 6 = 48 parameters, no buffer
    assert buffer_ranges(agg.spec) == [] and buffer_ranges(None) == []


def test_fedavg_is_unchanged_bit_for_bit():
    """FedAvg's own result on the buffer columns is already the average: the same bits."""
    model = BNNet(10)
    spec = FlatSpec.from_module(model)
    g = spec.flatten(model).clone()
    U = torch.randn(4, spec.d, generator=torch.Generator().manual_seed(1))
    plain, _ = algorithms.build("fedavg").aggregate(g, U, [1, 2, 3, 4])
    agg = algorithms.build("fedavg")
    agg.setup(spec, 4, g)
    with_spec, _ = agg.aggregate(g, U, [1, 2, 3, 4])
    assert torch.equal(plain, with_spec)


def test_a_non_finite_evaluation_stops_the_run_with_one_line(tmp_path):
    """A server learning rate of 1e30 in round 2 (a schedule file) leaves the model finite but its test
    loss not: exit 1, one line naming the round and the method; round 1's checkpoint kept, none of round 2."""
    sched = tmp_path / "lr.json"
    sched.write_text('{"server_lr": [1, 1e30, 1]}')
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    p = cli_process.run(
        [
            sys.executable,
            "-m",
            "fedkernels",
            "run",
            "--preset",
            "smoke",
            "rounds=3",
            "plots=false",
            "threads=1",
            "--no-progress",
            f"out_dir={tmp_path}",
            "checkpoint_every=1",
            "algorithm.name=fedavg",
            f"algorithm.options.server_lr_schedule={sched}",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 1, (p.returncode, p.stderr[-2000:])
    err = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(err) == 1 and "round 2" in err[0] and "fedavg" in err[0] and "not finite" in err[0], p.stderr
    ck = sorted(x.name for x in tmp_path.glob("*/checkpoints/*"))
    assert len(ck) == 1 and "1" in ck[0], ck
