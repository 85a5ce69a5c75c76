"""Per-round callbacks: cb(round, metrics, model) after every round, with the new
global model in ``model``; TensorBoard's callback when tensorboard is installed."""

import importlib.util
import os

import pytest
import torch

from fedkernels.sim import presets
from fedkernels.sim.callbacks import TensorBoardCallback, scalars
from fedkernels.sim.config import apply_overrides
from fedkernels.sim.simulation import Simulation


def _cfg(tmp_path, **kw):
    ov = [
        f"out_dir={tmp_path}",
        "rounds=3",
        "plots=false",
        "verbose=false",
        "progress=false",
        "threads=1",
        "data.train_subset=300",
    ] + [f"{k}={v}" for k, v in kw.items()]
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
    assert [s[1] for s in seen] == sim.metrics  # the dicts metrics.jsonl holds
    assert all("accuracy" in s[1] and "train_loss_mean" in s[1] for s in seen)
    assert torch.equal(seen[-1][2], sim.global_flat[: seen[-1][2].numel()])  # the new global model
    assert not torch.equal(seen[0][2], seen[-1][2])


def test_callback_error_is_not_swallowed(tmp_path):
    def bad(rnd, metrics, model):
        raise RuntimeError("logging backend down")

    with pytest.raises(RuntimeError, match="logging backend down"):
        Simulation(_cfg(tmp_path), callbacks=[bad]).run()


def test_scalars_flattens_numbers_only():
    m = {
        "round": 3,
        "accuracy": 0.5,
        "clients": [1, 2],
        "agg": {"kappa": 0.2, "mode": "S", "ok": True},
        "test_loss": float("nan"),
    }
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


def test_simulation_checks_options_before_any_work(tmp_path):
    """The library path gets the CLI's checks: one-line ValueError at construction, nothing written."""
    cfg = apply_overrides(_cfg(tmp_path), ["algorithm.name=fedavgm", "algorithm.options.beta=abc"])
    with pytest.raises(ValueError, match=r"algorithm\.options\.beta"):
        Simulation(cfg)
    with pytest.raises(ValueError, match="did you mean 'alpha'"):
        Simulation(apply_overrides(_cfg(tmp_path), ["partition.options.alpa=0.1"]))
    assert not os.listdir(tmp_path)


def test_callback_hooks_run_in_order_between_the_run_files_and_the_checkpoint(tmp_path):
    """A Callback subclass gets every hook once per event, after the run files have the round
    (metrics.jsonl) and before that round's checkpoint is written; close() gets the status."""
    from fedkernels.sim import checkpoint as ckpt
    from fedkernels.sim.callbacks import Callback

    events = []

    class Spy(Callback):
        def on_setup(self, sim):
            events.append("setup")

        def on_start(self, sim):
            events.append(("start", os.path.exists(os.path.join(sim.run_dir, "config.yaml"))))

        def on_round_end(self, sim, m):
            with open(os.path.join(sim.run_dir, "metrics.jsonl")) as f:
                lines = len(f.read().splitlines())
            has_ckpt = os.path.exists(ckpt.path_for(sim.ckpt_dir, m["round"]))
            events.append(("round", m["round"], sim.rounds_done, lines, has_ckpt))

        def on_end(self, sim, summary):
            events.append(("end", summary["rounds_completed"]))

        def close(self, sim, status):
            events.append(("close", status))

    sim = Simulation(_cfg(tmp_path, checkpoint_every=1), callbacks=[Spy()])
    sim.run()
    assert events == [
        "setup",
        ("start", True),
        ("round", 1, 1, 1, False),
        ("round", 2, 2, 2, False),
        ("round", 3, 3, 3, False),
        ("end", 3),
        ("close", "completed"),
    ]
    assert [r for r, _ in ckpt.list_checkpoints(sim.ckpt_dir)] == [2, 3]  # keep_checkpoints=2 of 1, 2, 3


def test_user_callbacks_keep_the_default_files_and_a_failure_is_closed(tmp_path):
    """Passing callbacks does not replace the default ones (the same run directory); a callback that
    fails stops the run, every callback is closed with status "failed" and provenance.json says so."""
    from fedkernels.sim.callbacks import Callback

    plain = Simulation(_cfg(tmp_path, name="plain"))
    plain.run()
    closed = []

    class Fails(Callback):
        def on_round_end(self, sim, m):
            if m["round"] == 2:
                raise RuntimeError("backend down")

        def close(self, sim, status):
            closed.append(status)

    with_cb = Simulation(_cfg(tmp_path, name="with"), callbacks=[lambda r, m, model: None])
    with_cb.run()
    assert sorted(os.listdir(with_cb.run_dir)) == sorted(os.listdir(plain.run_dir))
    failing = Simulation(_cfg(tmp_path, name="fails"), callbacks=[Fails()])
    with pytest.raises(RuntimeError, match="backend down"):
        failing.run()
    assert closed == ["failed"]
    import json

    with open(os.path.join(failing.run_dir, "provenance.json")) as f:
        assert json.load(f)["status"] == "failed"


def test_a_callback_that_is_not_callable_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"callbacks: 3 is neither a Callback nor a callable"):
        Simulation(_cfg(tmp_path), callbacks=[3])


def test_a_callback_returns_stop_and_extra_metrics(tmp_path):
    """pfl-research's contract: a callable returning (stop, extra_metrics) adds its metrics to the round's
    row of metrics.jsonl and ends the run after that round, with a checkpoint of it and the final model."""
    import json
    from fedkernels.sim import checkpoint as ckpt

    def stop_at_two(rnd, metrics, model):
        return rnd == 2, {"my_round": rnd * 10}

    sim = Simulation(_cfg(tmp_path, rounds=4, checkpoint_every=3), callbacks=[stop_at_two])
    summary = sim.run()
    with open(os.path.join(sim.run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["my_round"] for r in rows] == [10, 20] and summary["rounds_completed"] == 2
    assert [r for r, _ in ckpt.list_checkpoints(sim.ckpt_dir)] == [2]
    saved = torch.load(os.path.join(sim.run_dir, "final_model.pt"), weights_only=True)
    assert saved["round"] == 2 and torch.equal(saved["flat"], sim.global_flat.cpu())
    with open(os.path.join(sim.run_dir, "provenance.json")) as f:
        assert json.load(f)["status"] == "stopped"


def test_a_callback_metric_may_not_replace_the_rounds(tmp_path):
    with pytest.raises(ValueError, match=r"returned the metric 'accuracy', which round 1 already has"):
        Simulation(_cfg(tmp_path), callbacks=[lambda r, m, model: (False, {"accuracy": 1.0})]).run()


def test_the_run_view_is_read_only(tmp_path):
    """Callbacks get a view of the run, not the simulation: they cannot write into it."""
    from fedkernels.sim.callbacks import Callback
    from fedkernels.sim.runstate import RunView

    seen = []

    class Writer(Callback):
        def on_round_end(self, run, m):
            seen.append((type(run), run.rounds_done, len(run.metrics)))
            with pytest.raises(AttributeError, match="read-only"):
                run.start_round = 0

    Simulation(_cfg(tmp_path, rounds=2), callbacks=[Writer()]).run()
    assert seen == [(RunView, 1, 1), (RunView, 2, 2)]
