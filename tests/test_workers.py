"""workers=N: a round's clients trained in N worker processes (fedkernels.sim.workers).

Bit-identical to workers=1 at the same per-process thread count; the workers are never forks of the
main process (where autograd may have run); bad clients follow the policy as in one process; a
failure of a worker (cannot start, dies, a client error that is not a bad client) and a round whose
clients were all excluded are run errors (one line, exit 1 on the CLI), in every mode; the workers
never outlive the run (normal end, error, KeyboardInterrupt, a dead worker, the main process killed)."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from torch import nn

from fedkernels.errors import RunError
from fedkernels.sim import presets
from fedkernels.sim.trainer import ClientTrainer
from fedkernels.sim.config import RunConfig, apply_overrides
from fedkernels.sim.report import TIMING_KEYS
from fedkernels.sim.client_errors import BadClientError
from fedkernels.sim.simulation import Simulation
from fedkernels.sim.workers import WorkerPool, default_threads

import cli_process  # tests/cli_process.py: the command in a child forked from a pre-imported interpreter

pytestmark = pytest.mark.skipif(
    not hasattr(os, "fork"), reason="workers=N starts its workers from a fork server (POSIX)"
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def smoke(*overrides):
    return apply_overrides(
        presets.get("smoke"), ["threads=1", "verbose=false", "plots=false", "progress=false", *overrides]
    )


def strip(metrics):
    return [{k: v for k, v in m.items() if k not in TIMING_KEYS} for m in metrics]


def run(cfg, **kw):
    s = Simulation(cfg, write_outputs=False, **kw)
    summary = s.run()
    return s, summary


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not running: read its state
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


class PidRecorder:
    """A per-round callback that records the pool's worker pids (and can interrupt the run)."""

    def __init__(self, sim_ref, interrupt_at=None):
        self.sim_ref, self.interrupt_at, self.pids = sim_ref, interrupt_at, []

    def __call__(self, rnd, m, model):
        self.pids = list(self.sim_ref[0].pool.pids)
        if self.interrupt_at == rnd:
            raise KeyboardInterrupt


@pytest.mark.parametrize(
    "extra",
    [[], ["algorithm.name=scaffold", "rounds=3", "clients_per_round=3"], ["algorithm.name=fedecado"]],
    ids=["fedavg-smoke", "scaffold", "fedecado"],
)
def test_bit_identical_to_one_process(extra):
    s1, _ = run(smoke(*extra))
    s2, _ = run(smoke("workers=2", *extra))
    s3, _ = run(smoke("workers=3", *extra))
    assert torch.equal(s1.global_flat, s2.global_flat)
    assert torch.equal(s1.global_flat, s3.global_flat)
    assert strip(s1.metrics) == strip(s2.metrics) == strip(s3.metrics)
    assert s1.metrics[-1]["accuracy"] > 0.5
    if "algorithm.name=scaffold" in extra:  # the server's control variates came back identical too
        st1, st2 = s1.agg.state_dict(), s2.agg.state_dict()
        for k, v in st1.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, st2[k]), k


def test_workers_get_the_aggregator_configuration_not_its_state():
    """What a worker receives is small: SCAFFOLD's per-client control-variate table (K x d, the
    server's state) stays in the main process (a rule gets its c / c_i as payloads)."""
    from fedkernels.sim.workers import _worker_state

    s = Simulation(smoke("algorithm.name=scaffold", "num_clients=40", "workers=2"), write_outputs=False).setup()
    table = s.agg.c_table
    _, blob = _worker_state(s.local)
    assert table.numel() >= 40 * s.spec.d and len(blob) < table.numel() * table.element_size() // 10
    assert s.agg.c_table is table  # the main process's aggregator is untouched


def test_client_side_dp_clips_in_the_workers_as_in_one_process():
    """dp.kind=client: each client clips its row as it writes it, in a worker as in the main process
    (the workers get the run's LocalTraining, clip norm included): the same model bit for bit."""
    dp = ["dp.kind=client", "dp.clip=0.05", "dp.noise_multiplier=0.5"]
    s1, _ = run(smoke(*dp))
    s2, _ = run(smoke(*dp, "workers=2"))
    assert torch.equal(s1.global_flat, s2.global_flat)


def _parts_with_empty_client(cfg):
    from fedkernels.sim.data import load_dataset

    tr, te = load_dataset("digits")
    from fedkernels.sim.partition import partition

    parts = partition(tr.y.numpy(), cfg.num_clients, "iid", 0)
    parts[1] = np.zeros(0, dtype=np.int64)  # client 1 raises "has no training examples"
    return tr, te, parts


def test_bad_client_excluded_as_in_one_process():
    cfg = smoke()
    tr, te, parts = _parts_with_empty_client(cfg)
    s1, _ = run(cfg, train=tr, test=te, client_indices=parts)
    s2, _ = run(smoke("workers=2"), train=tr, test=te, client_indices=parts)
    assert [m["excluded"] for m in s1.metrics] == [m["excluded"] for m in s2.metrics]
    assert s2.metrics[0]["excluded"][0]["client_id"] == 1
    assert "no training examples" in s2.metrics[0]["excluded"][0]["reason"]
    assert s2.metrics[0]["num_updates"] == 3
    assert torch.equal(s1.global_flat, s2.global_flat)


def test_bad_client_raise_stops_and_workers_end():
    cfg = smoke("bad_client_policy=raise")
    tr, te, parts = _parts_with_empty_client(cfg)
    with pytest.raises(BadClientError) as e1:
        run(cfg, train=tr, test=te, client_indices=parts)
    ref = []
    s = Simulation(
        smoke("bad_client_policy=raise", "workers=2"), write_outputs=False, train=tr, test=te, client_indices=parts
    )
    orig = s.train_local

    def spy(*a, **k):
        out = orig(*a, **k)
        ref[:] = s.pool.pids
        return out

    s.train_local = spy
    with pytest.raises(BadClientError) as e2:
        s.run()
    assert str(e1.value) == str(e2.value)
    assert s.pool is None
    assert ref and not any(alive(p) for p in ref)


def test_workers_end_after_run_and_on_keyboard_interrupt():
    box = [None]
    rec = PidRecorder(box)
    box[0] = Simulation(smoke("workers=2", "rounds=2"), write_outputs=False, callbacks=[rec])
    box[0].run()
    assert len(rec.pids) == 2 and box[0].pool is None
    assert not any(alive(p) for p in rec.pids)

    box2 = [None]
    rec2 = PidRecorder(box2, interrupt_at=1)
    box2[0] = Simulation(smoke("workers=2", "rounds=3"), write_outputs=False, callbacks=[rec2])
    with pytest.raises(KeyboardInterrupt):
        box2[0].run()
    assert len(rec2.pids) == 2 and not any(alive(p) for p in rec2.pids)


class _ExitInChild(nn.Module):
    """A model whose forward kills the process it runs in unless that is the test process."""

    def __init__(self, parent):
        super().__init__()
        self.parent = parent
        self.lin = nn.Linear(64, 10)

    def forward(self, x):
        if os.getpid() != self.parent:
            os._exit(7)
        return self.lin(x.reshape(len(x), -1))


def test_dead_worker_stops_the_run_with_one_line():
    parent = os.getpid()
    s = Simulation(smoke("workers=2"), write_outputs=False, model_fn=lambda *a: _ExitInChild(parent))
    with pytest.raises(RuntimeError, match=r"workers=2: worker \d \(pid \d+\) exited with code 7 during round 1"):
        s.run()
    assert s.pool is None


def test_workers_die_with_the_main_process(tmp_path):
    """SIGKILL of the main process (no cleanup runs there): the kernel kills the workers."""
    script = textwrap.dedent("""
        import sys, time
        from fedkernels.sim import presets
        from fedkernels.sim.config import apply_overrides
        from fedkernels.sim.simulation import Simulation
        cfg = apply_overrides(presets.get("smoke"), ["workers=2", "threads=1", "rounds=50", "verbose=false",
                                                     "plots=false", "progress=false"])
        box = []
        def cb(r, m, model):
            if r == 1:
                print(" ".join(str(p) for p in box[0].pool.pids), flush=True)
                time.sleep(120)
        box.append(Simulation(cfg, write_outputs=False, callbacks=[cb]))
        box[0].run()
    """)
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        pids = [int(x) for x in p.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(q) for q in pids)
        p.kill()
        p.wait(30)
        deadline = time.monotonic() + 30
        while any(alive(q) for q in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(q) for q in pids)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_cli_run_with_workers(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = cli_process.run(
        [
            sys.executable,
            "-m",
            "fedkernels",
            "run",
            "--preset",
            "smoke",
            "workers=2",
            "threads=1",
            f"out_dir={tmp_path}",
            "plots=false",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert "round    2/2" in r.stdout
    bad = cli_process.run(
        [sys.executable, "-m", "fedkernels", "run", "--preset", "smoke", "workers=0", f"out_dir={tmp_path}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert bad.returncode == 2 and "workers must be >= 1, got 0" in bad.stderr


def test_config_checks():
    with pytest.raises(ValueError, match="workers must be >= 1, got 0"):
        smoke("workers=0").validate()
    with pytest.raises(ValueError, match="workers=2 and distributed=true exclude each other"):
        smoke("workers=2", "distributed=true").validate()
    # workers does not change the computation: the same run directory / config hash
    assert smoke("workers=2").config_hash() == smoke().config_hash()
    s = Simulation(smoke("workers=2"), write_outputs=False)
    s.setup()
    import dataclasses

    with pytest.raises(ValueError, match="CPU only"):
        WorkerPool(dataclasses.replace(s.local, device=torch.device("cuda")), 2)


def test_default_threads():
    assert default_threads(2, 3) == 3
    cores = len(os.sched_getaffinity(0))
    assert default_threads(1) == cores
    assert default_threads(cores * 2) == 1


def test_evaluation_in_the_workers_bit_identical(monkeypatch):
    """Accuracy, test loss, the clients' losses and global_loss: computed batch by batch in the workers
    (uneven batches, more batches than workers, every client's loss), equal bit for bit to one process."""
    extra = ["client_loss=all", "eval_batch_size=97", "rounds=3"]
    s1, _ = run(smoke(*extra))
    ref = strip(s1.metrics)
    assert all(len(s1.yt) % 97 and "global_loss" in m and "client_loss_var" in m for m in ref)

    def not_here(*a, **k):
        raise AssertionError("workers>1 evaluates in the worker processes, not in the main one")

    monkeypatch.setattr("fedkernels.sim.evaluate.evaluate_global", not_here)
    for w in ("workers=2", "workers=3"):
        s, _ = run(smoke(w, *extra))
        assert strip(s.metrics) == ref
        assert torch.equal(s.global_flat, s1.global_flat)
    s, _ = run(smoke("workers=2", "client_loss=participants", "eval_batch_size=5000"))  # one batch, one worker idle
    monkeypatch.undo()
    assert strip(s.metrics) == strip(run(smoke("client_loss=participants", "eval_batch_size=5000"))[0].metrics)


# ---- the start method: never a fork of the main process --------------------------------------------
# torch built with CUDA, on a machine with a GPU: the first backward starts autograd's device threads
# and registers a pthread_atfork handler (torch/csrc/autograd/engine.cpp, in_bad_autograd_fork) after
# which backward in any process forked from this one raises the message below. Emulated here with
# os.register_at_fork: a forked child of the process that registered the handler gets a backward
# that raises it.
AUTOGRAD_FORK = (
    "Unable to handle autograd's threading in combination with fork-based multiprocessing. "
    "See https://github.com/pytorch/pytorch/wiki/Autograd-and-Fork"
)
_BAD_FORK = {"on": False, "registered": False}


def _poison_backward_in_child():
    if _BAD_FORK["on"]:

        def backward(*a, **k):
            raise RuntimeError(AUTOGRAD_FORK)

        torch.autograd.backward = backward


def test_workers_are_not_forks_of_the_main_process():
    """With autograd "bad to fork" in this process (as after any backward under a CUDA torch with a
    GPU), workers=2 still trains every client, bit for bit as one process (a plain fork of this
    process would fail every client's backward)."""
    ref, _ = run(smoke())  # autograd has run here
    if not _BAD_FORK["registered"]:
        os.register_at_fork(after_in_child=_poison_backward_in_child)
        _BAD_FORK["registered"] = True
    _BAD_FORK["on"] = True
    try:
        s, _ = run(smoke("workers=2"))
    finally:
        _BAD_FORK["on"] = False
    assert all(m["excluded"] == [] for m in s.metrics)
    assert torch.equal(s.global_flat, ref.global_flat)


# ---- failures of the workers are run errors, never bad clients ----------------------------------------
SITECUSTOMIZE = f"""
import os, sys
def _bad_fork():     # every process forked from this one (the fork server's workers): backward fails
    torch = sys.modules.get("torch")
    if torch is not None:
        def backward(*a, **k):
            raise RuntimeError({AUTOGRAD_FORK!r})
        torch.autograd.backward = backward
os.register_at_fork(after_in_child=_bad_fork)
"""


def _cli(tmp_path, *args, sitecustomize=None):
    path = [ROOT]
    if sitecustomize is not None:
        (tmp_path / "site").mkdir()
        (tmp_path / "site" / "sitecustomize.py").write_text(sitecustomize)
        path.insert(0, str(tmp_path / "site"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    run = cli_process.run if sitecustomize is None else subprocess.run  # sitecustomize acts at start: fresh
    return run(
        [
            sys.executable,
            "-m",
            "fedkernels",
            "run",
            "--preset",
            "smoke",
            "threads=1",
            "plots=false",
            f"out_dir={tmp_path / 'runs'}",
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def _nothing_logged(tmp_path, r):
    """The run stopped before any round was logged: no round line, an empty metrics.jsonl, and
    provenance.json says it failed."""
    import json

    (run_dir,) = (tmp_path / "runs").iterdir()
    assert "round    1/2" not in r.stdout
    assert (run_dir / "metrics.jsonl").read_text() == ""
    assert json.loads((run_dir / "provenance.json").read_text())["status"] == "failed"


def test_worker_failure_is_a_run_error_on_the_cli(tmp_path):
    """The autograd-after-fork RuntimeError in every worker (injected), under the default exclude
    policy: not a bad client but a run error: exit 1, one line naming it, no round logged."""
    r = _cli(tmp_path, "workers=2", "bad_client_policy=exclude", sitecustomize=SITECUSTOMIZE)
    assert r.returncode == 1, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("fedkernels run: error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert re.search(
        r"round 1, client \d+: RuntimeError: Unable to handle autograd's threading .* \(in worker \d, "
        r"pid \d+\) \(a failure of the run, not a bad client update; the run stops\)",
        errors[0],
    ), errors
    assert "excluded client" not in r.stderr
    _nothing_logged(tmp_path, r)


class _UnpicklesOnlyIn(nn.Module):
    """A model that cannot be rebuilt in any process but ``parent`` (a worker fails to start)."""

    def __init__(self, parent):
        super().__init__()
        self.parent = parent
        self.lin = nn.Linear(64, 10)

    def forward(self, x):
        return self.lin(x.reshape(len(x), -1))

    def __setstate__(self, state):
        if os.getpid() != state["parent"]:
            raise ImportError("injected: no module named 'only_in_the_parent'")
        super().__setstate__(state)


def test_worker_that_cannot_start_stops_the_run():
    parent = os.getpid()
    s = Simulation(smoke("workers=2"), write_outputs=False, model_fn=lambda *a: _UnpicklesOnlyIn(parent))
    with pytest.raises(
        RunError,
        match=r"workers=2: worker \d \(pid \d+\) could not start: ImportError: injected: "
        r"no module named 'only_in_the_parent' while starting; the run stops",
    ):
        s.run()
    assert s.pool is None and s.metrics == []


def test_what_cannot_be_sent_to_the_workers_is_refused_before_they_start():
    s = Simulation(smoke("workers=2"), write_outputs=False, transform=lambda x, g: x)
    with pytest.raises(
        ValueError,
        match="workers=2: the set-up simulation cannot be sent to the worker processes "
        r"\(.*lambda.*\); with workers > 1 the model, transform and aggregator must "
        "be picklable",
    ):
        s.run()
    assert s.pool is None and s.metrics == []


def test_client_runtime_error_is_a_run_error_in_one_process(monkeypatch):
    """Sequential mode, exclude policy: a RuntimeError of one client's training (e.g. out of memory)
    stops the run; a bad-client error (ValueError) of another client is still excluded."""
    orig = ClientTrainer.train

    def train(self, cid, rnd, *a, **k):
        if cid == 1:
            raise ValueError("client 1: invalid input")
        if cid == 2:
            raise RuntimeError("injected: out of memory")
        return orig(self, cid, rnd, *a, **k)

    monkeypatch.setattr(ClientTrainer, "train", train)
    s = Simulation(smoke("bad_client_policy=exclude"), write_outputs=False)
    with pytest.raises(
        RunError,
        match=r"^round 1, client 2: RuntimeError: injected: out of memory \(a failure of the "
        r"run, not a bad client update; the run stops\)$",
    ):
        s.run()
    assert s.metrics == []


# ---- a round with every client excluded is a run error -----------------------------------------------------
@pytest.mark.parametrize("workers", ["workers=1", "workers=2"])
def test_every_client_excluded_is_a_run_error_on_the_cli(tmp_path, workers):
    """A learning rate so large that every client's update overflows to NaN/Inf: each client is
    excluded (the policy), then the round, which trained nothing, stops the run: exit 1, one line."""
    r = _cli(tmp_path, workers, "train.lr=1.0e+30")
    assert r.returncode == 1, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("fedkernels run: error:")]
    assert errors == [
        "fedkernels run: error: round 1: every client was excluded (4 of 4: update contains NaN/Inf "
        "(4 clients)); nothing was trained, the run stops"
    ], r.stderr
    _nothing_logged(tmp_path, r)
