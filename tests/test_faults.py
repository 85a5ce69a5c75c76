"""Fault injection in the simulator: a client that raises mid-training, returns NaN, or returns a
wrong-size update is excluded (default policy) and logged; the run finishes with a finite model;
with bad_client_policy="raise" the first bad client stops the run."""

import dataclasses
import math

import pytest
import torch

from fedkernels.sim import presets
from fedkernels.sim.client_errors import BadClientError
from fedkernels.sim.simulation import Simulation


def _cfg(**kw):
    cfg = presets.get("smoke")
    kw = {"plots": False, "progress": False, "verbose": False, **kw}  # the run's files without its figures
    return dataclasses.replace(cfg, **kw)


def _sim(tmp_path, fault, **kw):
    sim = Simulation(_cfg(**kw), run_dir=str(tmp_path / "run"))
    sim.setup()
    real_train = sim.trainer.train
    victim = sim.schedule[0][0]

    def train(cid, rnd, global_flat, *a, **k):
        res = real_train(cid, rnd, global_flat, *a, **k)
        if cid == victim and rnd == 0:
            if fault == "raise":
                raise FloatingPointError(
                    "injected failure mid-training"
                )  # a bad-client error (client_errors.CLIENT_ERRORS)
            if fault == "nan":
                with torch.no_grad():
                    next(sim.model.parameters()).view(-1)[0] = float("nan")
            if fault == "flatten_error":  # the update cannot be formed (e.g. a wrong-size model)
                raise ValueError("FlatSpec: out must be a 1-D tensor of length d (injected wrong-size update)")
        return res

    sim.trainer.train = train
    return sim, victim


@pytest.mark.parametrize("fault", ["raise", "nan", "flatten_error"])
def test_bad_client_is_excluded_and_run_finishes(tmp_path, fault):
    sim, victim = _sim(tmp_path, fault)
    summary = sim.run()
    assert torch.isfinite(sim.global_flat).all()
    assert summary.get("excluded_total", 0) >= 1


@pytest.mark.parametrize("fault", ["raise", "nan"])
def test_bad_client_with_raise_policy_stops(tmp_path, fault):
    sim, victim = _sim(tmp_path, fault, bad_client_policy="raise")
    with pytest.raises(BadClientError, match=f"client {victim}"):
        sim.run()


@pytest.mark.parametrize("policy", ["exclude", "raise"])
def test_rows_screened_by_the_aggregator_not_twice(tmp_path, monkeypatch, policy):
    """Under "exclude" the simulator does not scan each client's row itself: the aggregator's first
    read of U screens the rows, and the NaN client is still excluded and logged. Under "raise" each row
    is screened as it is written (the first bad client in schedule order stops the run)."""
    from fedkernels import ops

    sim, victim = _sim(tmp_path, "nan", bad_client_policy=policy, rounds=1)
    buf_ptr = sim.buf.data.untyped_storage().data_ptr()
    per_row = []
    real = ops.finite_rows

    def spy(U):
        if U.size(0) == 1 and U.untyped_storage().data_ptr() == buf_ptr:  # one row of the update buffer
            per_row.append(U)
        return real(U)

    monkeypatch.setattr(ops, "finite_rows", spy)
    if policy == "raise":
        with pytest.raises(BadClientError, match=f"client {victim}.*NaN"):
            sim.run()
        assert per_row
        return
    sim.run()
    assert per_row == []
    m = sim.metrics[0]
    assert m["excluded"] == [{"client_id": victim, "reason": "update contains NaN/Inf"}]
    assert m["num_updates"] == len(m["clients"]) - 1 and len(m["local_steps"]) == m["num_updates"]
    assert torch.isfinite(sim.global_flat).all()
