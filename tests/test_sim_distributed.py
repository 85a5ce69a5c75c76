"""The distributed simulator (fedkernels.sim.distributed_sim): 2 gloo ranks on 127.0.0.1 train
disjoint parts of each round's clients, exchange column slices and aggregate them; the result equals
the single-process run of the same config (model, metrics, checkpoints): bit for bit where the
arithmetic is the same (per-coordinate methods), each round from the same state to a bound derived
from the arithmetic where it is not (Gram-based methods, see ONE_ROUND)."""

import copy
import datetime
import json
import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fedkernels.sim import checkpoint as ckpt
from fedkernels.sim import presets
from fedkernels.sim.assemble import torch_settings
from round_states import RoundStates
from fedkernels.sim.config import apply_overrides
from fedkernels.sim.distributed_sim import assign_positions, merge_sliced_state, slice_state
from fedkernels.sim.report import TIMING_KEYS
from fedkernels.sim.simulation import Simulation

WORLD = 2
# (algorithm, options, bitwise): per-coordinate methods give identical bits; Gram-based ones sum
# per-rank fp64 partials (fp32 rounding)
METHODS = [
    ("fedavg", {}, True),
    ("kuramoto", {"mode": "S", "kappa0": 0.5}, False),
    ("fedaware", {}, False),
    ("scaffold", {}, True),
]


def _cfg(out_dir, algo, opts, **kw):
    ov = [
        f"out_dir={out_dir}",
        f"algorithm.name={algo}",
        "rounds=3",
        "clients_per_round=3",
        "plots=false",
        "verbose=false",
        "progress=false",
        "threads=1",
    ]
    ov += [f"algorithm.options.{k}={v}" for k, v in opts.items()]
    ov += [f"{k}={v}" for k, v in kw.items()]
    return apply_overrides(presets.get("smoke"), ov)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, port, tmp, body, *args):
    """One gloo rank: joins the group, runs body(rank, tmp, *args), leaves; a failure's traceback
    goes to tmp/err.<rank> (the parent shows it)."""
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=WORLD,
            timeout=datetime.timedelta(seconds=120),
        )
        body(rank, tmp, *args)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(tmp, f"err.{rank}"), "w") as f:
            f.write(traceback.format_exc())
        raise


def _spawn(tmp_path, body, *args):
    try:
        mp.spawn(_rank, args=(_free_port(), str(tmp_path), body) + args, nprocs=WORLD, join=True)
    except Exception:
        msgs = [p.read_text() for p in sorted(tmp_path.glob("err.*"))]
        pytest.fail("worker failed:\n" + "\n".join(msgs))


def _worker(rank, tmp, data):
    from fedkernels.sim.distributed_sim import DistributedSimulation

    tr, te = data
    for name, opts, _ in METHODS:
        cp = 1 if name == "scaffold" else 0
        sim = DistributedSimulation(_cfg(os.path.join(tmp, "dist"), name, opts, checkpoint_every=cp), train=tr, test=te)
        sim.run()
        assert os.path.exists(os.path.join(sim.run_dir, "metrics.jsonl"))  # rank 0 wrote it
        assert sim.summary["run_dir"] is None if rank else sim.summary["run_dir"] == sim.run_dir
    # an interrupted distributed run resumed from its (merged, full) checkpoint
    cfg = _cfg(os.path.join(tmp, "resumed"), "scaffold", {}, checkpoint_every=1)
    DistributedSimulation(cfg, train=tr, test=te).run(stop_after=2)
    sim = DistributedSimulation(cfg, train=tr, test=te, resume=True)
    sim.run()
    assert sim.start_round == 3


def _final(run_dir):
    return torch.load(os.path.join(run_dir, "final_model.pt"), weights_only=False)["flat"]


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS} for line in f if line.strip()]


def test_two_ranks_match_one_process(tmp_path):
    from fedkernels.sim.data import load_dataset

    torch.set_num_threads(1)
    data = load_dataset("digits")
    _spawn(tmp_path, _worker, data)
    for name, opts, bitwise in METHODS:
        cp = 1 if name == "scaffold" else 0
        cfg = _cfg(str(tmp_path / "single"), name, opts, checkpoint_every=cp)
        s = Simulation(cfg, train=data[0], test=data[1])
        s.run()
        d_dir = os.path.join(str(tmp_path / "dist"), cfg.run_name())
        got, ref = _final(d_dir), _final(s.run_dir)
        assert ref.numel() == got.numel()
        if bitwise:
            assert torch.equal(got, ref), f"{name}: max diff {(got - ref).abs().max()}"
        # (a Gram-based method's model and metrics: each round from the same state, to the bounds of
        # ONE_ROUND, in test_same_metrics_as_one_process; its trajectory over rounds is chaotic)
        md, ms = _metrics(d_dir), _metrics(s.run_dir)
        assert [m["clients"] for m in md] == [m["clients"] for m in ms] == [list(c) for c in s.schedule[:3]]
        for a, b in zip(md, ms):
            assert a["local_steps"] == b["local_steps"] and a["num_updates"] == b["num_updates"] == 3
            if bitwise:
                assert a == b, name
        if name == "scaffold":
            # the merged distributed checkpoint is the single-process one (full-size control variates)
            compared = 0
            for rnd in (1, 2, 3):
                pa, pb = (ckpt.path_for(os.path.join(r, "checkpoints"), rnd) for r in (d_dir, s.run_dir))
                if not (os.path.exists(pa) and os.path.exists(pb)):
                    continue  # pruned (keep_checkpoints)
                a, b = ckpt.load(pa), ckpt.load(pb)
                compared += 1
                assert a["round"] == b["round"] == rnd and torch.equal(a["global"], b["global"])
                assert a["aggregator"]["c_table"].shape == b["aggregator"]["c_table"].shape
                for k, v in b["aggregator"].items():
                    if isinstance(v, torch.Tensor):
                        assert torch.equal(a["aggregator"][k], v), k
            assert compared >= 2
            # stop after 2 rounds, resume on 2 ranks from the merged checkpoint: same final model
            assert torch.equal(_final(os.path.join(str(tmp_path / "resumed"), cfg.run_name())), ref)


# ---- one round loop: same metric keys and values in both modes -----------------------------------
def _metrics_worker(rank, tmp, data, name, opts, states):
    """The whole run (``states`` None), or each round once from the single-process run's state before
    it: rank 0 saves the new global model and the round's metrics to tmp/round<r>.pt."""
    from fedkernels.sim.distributed_sim import DistributedSimulation

    if states is None:
        DistributedSimulation(
            _cfg(os.path.join(tmp, "dist"), name, opts, client_loss="all", name="allloss"), train=data[0], test=data[1]
        ).run()
        return
    for r, st in enumerate(states[:-1]):
        s = DistributedSimulation(
            _cfg(os.path.join(tmp, "dist"), name, opts, client_loss="all", name="allloss"),
            train=data[0],
            test=data[1],
            write_outputs=False,
        )
        with torch_settings(s.cfg):  # as run() sets up
            s.setup()
        if "round" in st:
            s.load_state(copy.deepcopy(st))
        else:
            s.global_flat.copy_(st["global"])
        s.run(stop_after=s.start_round + 1)
        if rank == 0:
            torch.save(
                {"global": s.global_flat.detach().cpu().clone(), "metrics": json.loads(json.dumps(s.metrics[-1]))},
                os.path.join(tmp, f"round{r}.pt"),
            )


# A Gram-based method's G is, in distributed runs, the sum of the ranks' fp64 partials over their
# column slices, in one process one fp64 accumulation over all d: the same numbers summed in another
# order. The fp64 statistics it logs (info "agg": Kuramoto's theta, s, S, ratio, weights; FedAWARE's
# lam, coef, q, gap, elud) then differ in the last bits. Those statistics are compared at AGG_ABS: the
# worst-case error of a reordered fp64 sum of n terms is about n * 2^-53 relative (n = d = 2410 for
# the smoke MLP: 2.7e-13), times 1/sin(theta) <= 5 through Kuramoto's arccos; seen here: <= 4.5e-15
# (FedAWARE's coef), <= 1.2e-15 (Kuramoto's theta).
AGG_ABS = 1e-12
# ONE_ROUND: the fp32 model then differs only where a coefficient's change (<= AGG_ABS, times
# sum_k |row_k| <= 3 * 10 here: < 1e-10) moves the fp64 accumulation of `base + alpha * sum_k c_k row_k`
# across an fp32 rounding boundary: at most one rounding of the result (and one of the step, where a
# method adds its step in fp32): |a - b| <= 2^-23 (|a| + |a - start|) + 1e-10, per element. One round
# from the same state only: the trajectory over rounds is chaotic (a one-ulp change after round 1 moves
# round 3's model by ~1e-4), so later rounds start again from the single-process run's state. The
# local training of a round from the same state is the same arithmetic (train_loss_*, local_steps:
# equal); the evaluation runs on models apart by that bound: losses to LOSS_REL (a relative change
# 2^-22 of the weights moves the smoke MLP's logits by about that times its condition, <= 100), the
# accuracy to one test sample (one at a near-tie of its two best logits may change its class).
ONE_ROUND_ABS = 1e-10
LOSS_REL = 2.0**-22 * 100
EVAL_KEYS = ("accuracy", "test_loss", "client_loss_mean", "client_loss_var", "global_loss")


def _assert_same(a, b, path="", in_agg=False, n_test=None):
    if isinstance(a, dict) and isinstance(b, dict):
        assert sorted(a) == sorted(b), f"{path}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            _assert_same(a[k], b[k], f"{path}/{k}", in_agg or k == "agg", n_test)
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]", in_agg, n_test)
    elif in_agg and isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, rel=0, abs=AGG_ABS), f"{path}: {a!r} != {b!r}"
    elif n_test is not None and path.endswith("/accuracy"):
        assert abs(a - b) <= 1.5 / n_test, f"{path}: {a!r} != {b!r} (more than one test sample)"
    elif n_test is not None and path.rsplit("/", 1)[-1] in EVAL_KEYS:
        assert abs(a - b) <= LOSS_REL * abs(b) + 1e-12, f"{path}: {a!r} != {b!r}"
    else:
        assert type(a) is type(b) and a == b, f"{path}: {a!r} != {b!r}"


def _assert_one_round(start, a, b, what):
    """The new global models ``a`` (distributed) and ``b`` (one process) of one round from ``start``."""
    a, b, start = a.double(), b.double(), start.double()
    bound = 2.0**-23 * (b.abs() + (b - start).abs()) + ONE_ROUND_ABS
    err = (a - b).abs()
    assert bool((err <= bound).all()), (
        f"{what}: apart by {float(err.max()):.3g} (bound {float(bound[err.argmax()]):.3g})"
    )


@pytest.mark.parametrize("name,opts,bitwise", METHODS, ids=[m[0] for m in METHODS])
def test_same_metrics_as_one_process(tmp_path, name, opts, bitwise):
    """Distributed and single-process runs log the same metric keys and values (global_loss, the
    federated objective over all clients, included): FedAvg and a stateful method with client payloads
    (SCAFFOLD) bit for bit over the whole run; the Gram-based Kuramoto and FedAWARE each round from the
    same state, the model to ONE_ROUND and the statistics to AGG_ABS."""
    from fedkernels.sim.data import load_dataset

    torch.set_num_threads(1)
    data = load_dataset("digits")
    cfg = _cfg(str(tmp_path / "single"), name, opts, client_loss="all", name="allloss")
    rec = RoundStates()
    s = Simulation(cfg, train=data[0], test=data[1], callbacks=[] if bitwise else [rec])
    s.run()
    ms = _metrics(s.run_dir)
    assert len(ms) == 3 and all("global_loss" in m for m in ms)
    if bitwise:
        _spawn(tmp_path, _metrics_worker, data, name, opts, None)
        md = _metrics(os.path.join(str(tmp_path / "dist"), cfg.run_name()))
        assert [sorted(m) for m in md] == [sorted(m) for m in ms]
        assert md == ms
        _assert_same(md, ms)
        return
    assert len(rec.states) == 4
    _spawn(tmp_path, _metrics_worker, data, name, opts, rec.states)
    for r in range(3):
        got = torch.load(tmp_path / f"round{r}.pt", weights_only=False)
        _assert_one_round(rec.states[r]["global"], got["global"], rec.states[r + 1]["global"], f"{name} round {r + 1}")
        md = {k: v for k, v in got["metrics"].items() if k not in TIMING_KEYS}
        assert sorted(md) == sorted(ms[r])
        _assert_same(md, ms[r], f"round {r + 1}", n_test=len(data[1].y))


# ---- pieces without processes -------------------------------------------------------------------
def test_assign_positions_contiguous_and_balanced():
    for K in range(0, 9):
        for world in (1, 2, 3, 4):
            b = assign_positions(K, world)
            assert len(b) == world and b[0][0] == 0 and b[-1][1] == K
            assert all(b[i][1] == b[i + 1][0] for i in range(world - 1))
            sizes = [hi - lo for lo, hi in b]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_merge_and_slice_state_round_trip():
    d, bounds = 10, [(0, 4), (4, 10)]
    full = {
        "c": torch.arange(d, dtype=torch.float32),
        "table": torch.randn(3, d),
        "round": 5,
        "stats": torch.tensor([1.0, 2.0]),
        "nested": {"m": [torch.randn(d)]},
    }
    parts = [slice_state(full, d, lo, hi) for lo, hi in bounds]
    assert parts[0]["table"].shape == (3, 4) and parts[1]["c"].shape == (6,)
    assert torch.equal(parts[0]["stats"], full["stats"])  # not d-sized: kept whole
    merged = merge_sliced_state(parts, [hi - lo for lo, hi in bounds])
    assert merged["round"] == 5 and torch.equal(merged["stats"], full["stats"])
    for k in ("c", "table"):
        assert torch.equal(merged[k], full[k])
    assert torch.equal(merged["nested"]["m"][0], full["nested"]["m"][0])


def test_needs_a_process_group(monkeypatch):
    if dist.is_initialized():
        pytest.skip("a process group is active")
    from fedkernels.sim.distributed_sim import DistributedSimulation

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        DistributedSimulation(presets.get("smoke"))


def test_own_group_destroyed_at_exit():
    """A process group that `init_from_env` made is destroyed at exit while the interpreter is still
    whole: a gloo group left to interpreter finalisation can abort a finished rank (SIGABRT,
    "terminate called without an active exception"), and torchrun then reports the run failed."""
    import subprocess
    import sys

    code = r"""
import atexit
import torch.distributed as dist
from fedkernels.sim.distributed_sim import init_from_env
# atexit runs its handlers last-in first-out: this one runs after any that init_from_env registers
atexit.register(lambda: print("initialised at exit:", dist.is_initialized(), flush=True))
assert init_from_env("cpu") is True
"""
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env["PYTHONPATH"] = os.getcwd()
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "initialised at exit: False" in p.stdout, (p.stdout, p.stderr[-2000:])


def test_a_callers_group_is_left_to_the_caller(monkeypatch):
    """A group that was initialised before `init_from_env` is the caller's: nothing is registered
    to destroy it."""
    import atexit

    from fedkernels.sim import distributed_sim

    registered = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(atexit, "register", lambda f, *a, **k: registered.append(f))
    assert distributed_sim.init_from_env("cpu") is False and registered == []


def test_torchrun_cli(tmp_path):
    """`torchrun --nproc_per_node 2 -m fedkernels run --preset smoke --distributed`: rank 0 alone
    writes the run directory and prints; the final model is the single-process one."""
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd())
    args = ["--preset", "smoke", f"out_dir={tmp_path}", "plots=false", "threads=1", "--quiet", "--no-progress"]
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(_free_port()),
            "-m",
            "fedkernels",
            "run",
            "--distributed",
            "--name",
            "dist",
        ]
        + args,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == 1 and lines[0]["run_dir"].endswith("dist")  # rank 0 only
    from fedkernels.sim.cli import main

    assert main(["run", "--name", "single"] + args) == 0
    assert torch.equal(_final(str(tmp_path / "dist")), _final(str(tmp_path / "single")))
    assert _metrics(str(tmp_path / "dist")) == _metrics(str(tmp_path / "single"))
