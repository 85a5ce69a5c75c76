"""Per-round callbacks (issue 15 item 10): cb(round, metrics, model) after every round, with the new
global model in ``model``; TensorBoard's callback when tensorboard is installed."""
import importlib.util
import os

import pytest
import torch

from fedkernels.sim import presets
from fedkernels.sim.callbacks import TensorBoardCallback, scalars
from fedkernels.sim.config import apply_overrides
from fedkernels.sim.server import Simulation


def _cfg(tmp_path, **kw):
    ov = [f"out_dir={tmp_path}", "rounds=3", "plots=false", "verbose=false", "progress=false", "threads=1",
          "data.train_subset=300"] + [f"{k}={v}" for k, v in kw.items()]
    return apply_overrides(presets.get("smoke"), ov)


def test_callback_sees_every_round_its_metrics_and_the_global_model(tmp_path):
    seen = []

    class Recorder:
        closed = False

        def __call__(self, rnd, metrics, model):
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            seen.append((rnd, dict(metrics), flat.clone()))

        def close(self):
            Recorder.closed = True

    sim = Simulation(_cfg(tmp_path), callbacks=[Recorder()])
    sim.run()
    assert [s[0] for s in seen] == [1, 2, 3] and Recorder.closed
    assert [s[1] for s in seen] == sim.metrics                           # the dicts metrics.jsonl holds
    assert all("accuracy" in s[1] and "train_loss_mean" in s[1] for s in seen)
    assert torch.equal(seen[-1][2], sim.global_flat[: seen[-1][2].numel()])   # the new global model
    assert not torch.equal(seen[0][2], seen[-1][2])


def test_callback_error_is_not_swallowed(tmp_path):
    def bad(rnd, metrics, model):
        raise RuntimeError("logging backend down")
    with pytest.raises(RuntimeError, match="logging backend down"):
        Simulation(_cfg(tmp_path), callbacks=[bad]).run()


def test_scalars_flattens_numbers_only():
    m = {"round": 3, "accuracy": 0.5, "clients": [1, 2], "agg": {"kappa": 0.2, "mode": "S", "ok": True},
         "test_loss": float("nan")}
    assert dict(scalars(m)) == {"accuracy": 0.5, "agg/kappa": 0.2}


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None, reason="tensorboard is installed")
def test_tensorboard_callback_says_what_is_missing():
    with pytest.raises(ValueError, match="tensorboard package is not installed"):
        TensorBoardCallback()


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard is not installed")
def test_tensorboard_callback_writes_events(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    sim = Simulation(_cfg(tmp_path, name="tb"), callbacks=[TensorBoardCallback()])
    sim.run()
    logdir = os.path.join(sim.run_dir, "tensorboard")
    ea = EventAccumulator(logdir)
    ea.Reload()
    acc = ea.Scalars("accuracy")
    assert [e.step for e in acc] == [1, 2, 3]
    assert acc[-1].value == pytest.approx(sim.metrics[-1]["accuracy"])
