"""The simulator loop, checkpoints, config and CLI, on digits with a tiny MLP (fast)."""

import json
import logging
import os

import pytest
import torch

from fedkernels import algorithms
from fedkernels.errors import RunError
from fedkernels.sim import checkpoint as ckpt
from fedkernels.sim import presets
from fedkernels.sim.hetero import HeteroCompute
from fedkernels.sim.trainer import ClientTrainer, schedule_factor
from fedkernels.sim.config import RunConfig, apply_overrides
from fedkernels.sim.report import TIMING_KEYS, json_safe
from fedkernels.sim import assemble
from fedkernels.sim.assemble import sample_schedule
from fedkernels.sim.client_errors import BadClientError
from fedkernels.sim.simulation import Simulation


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def digits():
    from fedkernels.sim.data import load_dataset

    return load_dataset("digits")


# one name per registered class (aliases dropped); options a method cannot run without
METHODS = sorted({cls.name for cls in algorithms.base._REGISTRY.values()})
REQUIRED = {"local_gc_only": {"lam": 0.5}}


def method_overrides(method):
    return {"algorithm.name": method, **{f"algorithm.options.{k}": v for k, v in REQUIRED.get(method, {}).items()}}


def tiny_cfg(tmp_path, **kw):
    cfg = RunConfig.from_dict(
        {
            "rounds": 3,
            "num_clients": 6,
            "clients_per_round": 3,
            "seed": 1,
            "eval_every": 1,
            "out_dir": str(tmp_path),
            "plots": False,
            "verbose": False,
            "progress": False,
            "data": {"name": "digits", "train_subset": 600},
            "partition": {"scheme": "dirichlet", "options": {"alpha": 0.5, "min_size": 10}},
            "model": {"name": "mlp", "options": {"hidden": [16]}},
            "train": {"steps": 4, "batch_size": 16, "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4},
        }
    )
    return apply_overrides(cfg, [f"{k}={v}" for k, v in kw.items()])


def sim(cfg, digits, **kw):
    tr, te = digits
    return Simulation(cfg, train=tr, test=te, **kw)


def strip_timing(metrics):
    return [{k: v for k, v in m.items() if k not in TIMING_KEYS} for m in metrics]


# ---- every registered method runs ----------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_two_rounds_every_method(method, digits, tmp_path):
    cfg = tiny_cfg(tmp_path, rounds=2, **method_overrides(method))
    s = sim(cfg, digits, write_outputs=False)
    summary = s.run()
    assert summary["rounds_completed"] == 2
    assert all(m["excluded"] == [] for m in s.metrics), s.metrics
    assert all(m["num_updates"] == 3 for m in s.metrics)
    assert 0.0 <= summary["final_accuracy"] <= 1.0
    assert bool(torch.isfinite(s.global_flat).all())
    init = assemble.build_model(s.cfg, s.x, s.num_classes, s._model_fn).to(s.device)
    assert not torch.equal(s.global_flat, s.spec.flatten(init))  # it moved


# ---- determinism ---------------------------------------------------------------------------------
def test_same_seed_same_bits(digits, tmp_path):
    cfg = tiny_cfg(
        tmp_path,
        **{
            "train.hetero.enabled": True,
            "train.hetero.lr_range": "[0.01, 0.1]",
            "train.hetero.epochs_range": "[1, 2]",
            "train.steps": "null",
            "train.lr_schedule": "cosine",
        },
    )
    a, b = sim(cfg, digits, write_outputs=False), sim(cfg, digits, write_outputs=False)
    a.run(), b.run()
    assert torch.equal(a.global_flat, b.global_flat)
    assert strip_timing(a.metrics) == strip_timing(b.metrics)
    c = sim(apply_overrides(cfg, ["seed=2"]), digits, write_outputs=False)
    c.run()
    assert not torch.equal(a.global_flat, c.global_flat)


def test_client_stream_shared_by_methods(digits, tmp_path):
    runs = []
    for m in ("fedavg", "fedavgm"):
        s = sim(tiny_cfg(tmp_path, **{"algorithm.name": m}), digits, write_outputs=False)
        s.run()
        runs.append([m_["clients"] for m_ in s.metrics])
    assert runs[0] == runs[1]
    sched = sample_schedule(1, 6, 3, 3)
    assert runs[0] == sched
    assert sample_schedule(1, 6, 3, 10)[:3] == sched  # a longer run extends a shorter one
    assert all(len(set(r)) == 3 and all(0 <= c < 6 for c in r) for r in sched)


def test_lr_schedules_and_hetero_draws():
    cfg = RunConfig()
    cfg.train.lr, cfg.train.lr_schedule = 0.1, "cosine"
    assert schedule_factor(cfg.train, 0, 10) == 1.0
    assert schedule_factor(cfg.train, 5, 10) == pytest.approx(0.5)
    cfg.train.lr_schedule, cfg.train.lr_step, cfg.train.lr_gamma = "step", 2, 0.5
    assert [schedule_factor(cfg.train, r, 10) for r in range(5)] == [1, 1, 0.5, 0.5, 0.25]
    cfg.train.hetero.enabled = True
    cfg.train.hetero.lr_range, cfg.train.hetero.epochs_range = [0.005, 0.05], [1, 5]
    h1, h2 = HeteroCompute(cfg.train, 20, 3), HeteroCompute(cfg.train, 20, 3)
    t = h1.table()
    assert t == h2.table()
    assert all(0.005 <= r["lr"] <= 0.05 and 1 <= r["epochs"] <= 5 for r in t)
    assert len({r["epochs"] for r in t}) > 1 and h1.get(4, 0) == h1.get(4, 7)  # fixed per run
    cfg.train.hetero.redraw = "round"
    h3 = HeteroCompute(cfg.train, 20, 3)
    assert [h3.get(4, r) for r in range(6)] != [h3.get(4, 0)] * 6


# ---- resume --------------------------------------------------------------------------------------
def _resume_equal(cfg, digits, tmp_path, stop_after):
    full = sim(apply_overrides(cfg, ["name=full"]), digits)
    full.run()
    part_cfg = apply_overrides(cfg, ["name=part"])
    p1 = sim(part_cfg, digits)
    p1.run(stop_after=stop_after)
    assert ckpt.list_checkpoints(p1.ckpt_dir)
    p2 = sim(part_cfg, digits, resume=True)
    p2.run()
    assert p2.start_round == cfg.rounds
    return full, p2


@pytest.mark.parametrize("method", ["fedavgm", "scaffold"])
def test_resume_bit_identical(method, digits, tmp_path):
    if method not in algorithms.available():
        pytest.skip(f"{method} not registered")
    cfg = tiny_cfg(tmp_path, rounds=4, checkpoint_every=1, **{"algorithm.name": method})
    full, resumed = _resume_equal(cfg, digits, tmp_path, stop_after=2)
    assert torch.equal(full.global_flat, resumed.global_flat)
    assert strip_timing(full.metrics) == strip_timing(json_safe(resumed.metrics))
    lines = open(os.path.join(resumed.run_dir, "metrics.jsonl")).read().splitlines()
    assert [json.loads(l)["round"] for l in lines] == [1, 2, 3, 4]
    fm = torch.load(os.path.join(resumed.run_dir, "final_model.pt"), weights_only=True)
    assert torch.equal(fm["flat"], full.global_flat)


@pytest.mark.parametrize("method", METHODS)
def test_every_method_state_survives_checkpoint(method, digits, tmp_path):
    """Aggregator state_dicts load with weights_only=True and a resumed run matches bit for bit."""
    cfg = tiny_cfg(tmp_path, rounds=3, checkpoint_every=1, **method_overrides(method))
    full, resumed = _resume_equal(cfg, digits, tmp_path, stop_after=1)
    assert torch.equal(full.global_flat, resumed.global_flat)


# ---- checkpoints ---------------------------------------------------------------------------------
def test_checkpoint_roundtrip_and_corruption(tmp_path, caplog):
    d = str(tmp_path / "ck")
    st = {"round": 1, "global": torch.arange(5.0), "nested": {"a": [1, 2.5, None, "x"]}}
    ckpt.save(ckpt.path_for(d, 1), st)
    ckpt.save(ckpt.path_for(d, 2), dict(st, round=2))
    back = ckpt.load(ckpt.path_for(d, 1))
    assert back["nested"] == st["nested"] and torch.equal(back["global"], st["global"])
    assert not [f for f in os.listdir(d) if f.startswith(".tmp")]
    p2 = ckpt.path_for(d, 2)
    raw = open(p2, "rb").read()
    open(p2, "wb").write(raw[:-7])  # truncated
    with pytest.raises(ckpt.CheckpointError, match="truncated"):
        ckpt.load(p2)
    flipped = bytearray(raw)
    flipped[-3] ^= 0xFF
    open(p2, "wb").write(bytes(flipped))  # one corrupted byte
    with pytest.raises(ckpt.CheckpointError, match="checksum"):
        ckpt.load(p2)
    with caplog.at_level(logging.WARNING, logger="fedkernels.sim"):
        path, got = ckpt.load_latest(d)
    assert path == ckpt.path_for(d, 1) and got["round"] == 1
    assert "checksum mismatch" in caplog.text
    open(ckpt.path_for(d, 1), "wb").write(b"garbage")
    with pytest.raises(ckpt.CheckpointError, match="no usable checkpoint"):
        ckpt.load_latest(d)
    assert ckpt.load_latest(str(tmp_path / "empty")) is None


def test_resume_skips_corrupted_latest(digits, tmp_path):
    cfg = tiny_cfg(tmp_path, rounds=3, checkpoint_every=1, keep_checkpoints=3, name="c")
    full = sim(apply_overrides(cfg, ["name=full"]), digits)
    full.run()
    a = sim(cfg, digits)
    a.run(stop_after=2)
    latest = ckpt.path_for(a.ckpt_dir, 2)
    raw = open(latest, "rb").read()
    open(latest, "wb").write(raw[: len(raw) // 2])
    b = sim(cfg, digits, resume=True)
    b.setup()
    assert b.start_round == 1  # fell back to the previous checkpoint
    b.run()
    assert torch.equal(b.global_flat, full.global_flat)


# ---- bad clients ---------------------------------------------------------------------------------
def _faulty(monkeypatch, nan_client, error_client):
    orig = ClientTrainer.train

    def train(self, cid, rnd, *a, **kw):
        if cid == error_client:
            raise ValueError("simulated crash")  # a bad-client error (client_errors.CLIENT_ERRORS)
        res = orig(self, cid, rnd, *a, **kw)
        if cid == nan_client:
            self.work[3] = float("nan")
        return res

    monkeypatch.setattr(ClientTrainer, "train", train)


def test_bad_clients_excluded_and_logged(digits, tmp_path, monkeypatch, caplog):
    cfg = tiny_cfg(tmp_path, rounds=2, clients_per_round=6)
    _faulty(monkeypatch, nan_client=2, error_client=4)
    s = sim(cfg, digits)
    with caplog.at_level(logging.WARNING):
        summary = s.run()
    assert summary["rounds_completed"] == 2 and summary["excluded_total"] == 4
    for m in s.metrics:
        reasons = {e["client_id"]: e["reason"] for e in m["excluded"]}
        assert set(reasons) == {2, 4}
        assert "NaN" in reasons[2] and "simulated crash" in reasons[4]
        assert m["num_updates"] == 4
        assert m["accuracy"] > 0.1
    assert bool(torch.isfinite(s.global_flat).all())
    assert "excluded client 2" in caplog.text and "excluded client 4" in caplog.text
    line = json.loads(open(os.path.join(s.run_dir, "metrics.jsonl")).readline())
    assert {e["client_id"] for e in line["excluded"]} == {2, 4}


def test_bad_client_policy_raise(digits, tmp_path, monkeypatch):
    cfg = tiny_cfg(tmp_path, rounds=1, clients_per_round=6, bad_client_policy="raise")
    _faulty(monkeypatch, nan_client=2, error_client=None)
    with pytest.raises(BadClientError, match="client 2.*NaN"):
        sim(cfg, digits, write_outputs=False).run()


def test_all_clients_bad_is_a_run_error(digits, tmp_path, monkeypatch):
    """Every client of a round excluded: nothing was trained, the run stops, the global model kept."""
    cfg = tiny_cfg(tmp_path, rounds=1, num_clients=2, clients_per_round=1)
    s = sim(cfg, digits, write_outputs=False)
    s.setup()
    g0 = s.global_flat.clone()
    _faulty(monkeypatch, nan_client=None, error_client=s.schedule[0][0])
    with pytest.raises(RunError, match=r"round 1: every client was excluded \(1 of 1: ValueError: simulated crash"):
        s.run()
    assert torch.equal(s.global_flat, g0) and s.metrics == []


# ---- config --------------------------------------------------------------------------------------
def test_config_yaml_roundtrip_and_overrides(tmp_path):
    for name in presets.names():
        cfg = presets.get(name)
        assert RunConfig.from_yaml(cfg.to_yaml()) == cfg
    cfg = presets.get("fedecado-fmnist")
    p = str(tmp_path / "c.yaml")
    cfg.to_yaml(p)
    assert RunConfig.from_yaml(p) == cfg
    o = apply_overrides(
        cfg,
        [
            "train.lr=0.5",
            "train.hetero.epochs_range=[2, 3]",
            "rounds=7",
            "algorithm.name=kuramoto",
            "algorithm.options.kappa0=1",
            "partition.options.alpha=0.3",
            "data.root=null",
            "name=x",
        ],
    )
    assert o.train.lr == 0.5 and o.train.hetero.epochs_range == [2, 3] and o.rounds == 7
    assert o.algorithm.options == {"kappa0": 1} and o.partition.options["alpha"] == 0.3 and o.name == "x"
    assert cfg.rounds == 50  # the original is untouched
    with pytest.raises(ValueError, match="unknown config key 'train.learning_rate'"):
        apply_overrides(cfg, ["train.learning_rate=1"])
    with pytest.raises(ValueError, match="key=value"):
        apply_overrides(cfg, ["rounds"])
    with pytest.raises(ValueError, match="unknown config key"):
        RunConfig.from_yaml("rounds: 3\nbogus: 1\n")
    with pytest.raises(ValueError, match="participation"):
        apply_overrides(cfg, ["participation=1.5", "clients_per_round=null"]).validate()


def test_preset_variants_build():
    for name in presets.names():
        for label, var in presets.variants(name).items():
            if var["name"] in algorithms.available():
                algorithms.build(var["name"], **var.get("options", {}))
    label, var = presets.parse_method("kuramoto:mode=C:kappa0=0.3", presets.variants("kuramoto-digits"))
    assert var == {"name": "kuramoto", "options": {"mode": "C", "kappa0": 0.3}}


def test_json_safe():
    v = json_safe({"t": torch.tensor([1.0, float("nan")]), "x": float("inf"), "n": (1, 2), "big": torch.ones(5000)})
    assert v["t"] == [1.0, None] and v["x"] == "inf" and v["n"] == [1, 2]
    assert v["big"]["shape"] == [5000]
    json.dumps(v)


def test_resume_warns_on_changed_config(digits, tmp_path, caplog):
    cfg = tiny_cfg(tmp_path, rounds=2, checkpoint_every=1, name="w")
    sim(cfg, digits).run(stop_after=1)
    with caplog.at_level(logging.WARNING, logger="fedkernels.sim"):
        s = sim(apply_overrides(cfg, ["train.lr=0.5", "rounds=3"]), digits, resume=True)
        s.setup()
    assert s.start_round == 1
    assert "differs from the checkpoint's in train.lr" in caplog.text
