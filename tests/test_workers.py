"""workers=N: a round's clients trained in N forked worker processes (fedkernels.sim.workers).

Bit-identical to workers=1 at the same per-process thread count; bad clients follow the policy as in
one process; the workers never outlive the run (normal end, error, KeyboardInterrupt, a dead worker,
the main process killed)."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from torch import nn

from fedkernels.sim import presets
from fedkernels.sim.config import RunConfig, apply_overrides
from fedkernels.sim.report import TIMING_KEYS
from fedkernels.sim.server import BadClientError, Simulation
from fedkernels.sim.workers import WorkerPool, default_threads

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="workers=N forks")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def smoke(*overrides):
    return apply_overrides(presets.get("smoke"), ["threads=1", "verbose=false", "plots=false", "progress=false",
                                                  *overrides])


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
    try:   # a zombie is not running: read its state
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


class PidRecorder:
    """A per-round callback that records the pool's worker pids (and can interrupt the run)."""

    def __init__(self, sim_ref, interrupt_at=None):
        self.sim_ref, self.interrupt_at, self.pids = sim_ref, interrupt_at, []

    def __call__(self, rnd, m, model):
        self.pids = list(self.sim_ref[0]._pool.pids)
        if self.interrupt_at == rnd:
            raise KeyboardInterrupt


@pytest.mark.parametrize("extra", [[], ["algorithm.name=scaffold", "rounds=3", "clients_per_round=3"]],
                         ids=["fedavg-smoke", "scaffold"])
def test_bit_identical_to_one_process(extra):
    s1, _ = run(smoke(*extra))
    s2, _ = run(smoke("workers=2", *extra))
    s3, _ = run(smoke("workers=3", *extra))
    assert torch.equal(s1.global_flat, s2.global_flat)
    assert torch.equal(s1.global_flat, s3.global_flat)
    assert strip(s1.metrics) == strip(s2.metrics) == strip(s3.metrics)
    assert s1.metrics[-1]["accuracy"] > 0.5
    if "algorithm.name=scaffold" in extra:   # the server's control variates came back identical too
        st1, st2 = s1.agg.state_dict(), s2.agg.state_dict()
        for k, v in st1.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, st2[k]), k


def _parts_with_empty_client(cfg):
    from fedkernels.sim.data import load_dataset
    tr, te = load_dataset("digits")
    from fedkernels.sim.partition import partition
    parts = partition(tr.y.numpy(), cfg.num_clients, "iid", 0)
    parts[1] = np.zeros(0, dtype=np.int64)          # client 1 raises "has no training examples"
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
    s = Simulation(smoke("bad_client_policy=raise", "workers=2"), write_outputs=False, train=tr, test=te,
                   client_indices=parts)
    orig = s.train_local

    def spy(*a, **k):
        out = orig(*a, **k)
        ref[:] = s._pool.pids
        return out
    s.train_local = spy
    with pytest.raises(BadClientError) as e2:
        s.run()
    assert str(e1.value) == str(e2.value)
    assert s._pool is None
    assert ref and not any(alive(p) for p in ref)


def test_workers_end_after_run_and_on_keyboard_interrupt():
    box = [None]
    rec = PidRecorder(box)
    box[0] = Simulation(smoke("workers=2", "rounds=2"), write_outputs=False, callbacks=[rec])
    box[0].run()
    assert len(rec.pids) == 2 and box[0]._pool is None
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
    assert s._pool is None


def test_workers_die_with_the_main_process(tmp_path):
    """SIGKILL of the main process (no cleanup runs there): the kernel kills the workers."""
    script = textwrap.dedent("""
        import sys, time
        from fedkernels.sim import presets
        from fedkernels.sim.config import apply_overrides
        from fedkernels.sim.server import Simulation
        cfg = apply_overrides(presets.get("smoke"), ["workers=2", "threads=1", "rounds=50", "verbose=false",
                                                     "plots=false", "progress=false"])
        box = []
        def cb(r, m, model):
            if r == 1:
                print(" ".join(str(p) for p in box[0]._pool.pids), flush=True)
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
    r = subprocess.run([sys.executable, "-m", "fedkernels", "run", "--preset", "smoke", "workers=2", "threads=1",
                        f"out_dir={tmp_path}", "plots=false"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "round    2/2" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "fedkernels", "run", "--preset", "smoke", "workers=0",
                          f"out_dir={tmp_path}"], capture_output=True, text=True, env=env, timeout=600)
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
    s.device = torch.device("cuda")
    with pytest.raises(ValueError, match="CPU only"):
        WorkerPool(s, 2)


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
    monkeypatch.setattr("fedkernels.sim.server.evaluate", not_here)
    monkeypatch.setattr("fedkernels.sim.server.client_losses", not_here)
    for w in ("workers=2", "workers=3"):
        s, _ = run(smoke(w, *extra))
        assert strip(s.metrics) == ref
        assert torch.equal(s.global_flat, s1.global_flat)
    s, _ = run(smoke("workers=2", "client_loss=participants", "eval_batch_size=5000"))   # one batch, one worker idle
    monkeypatch.undo()
    assert strip(s.metrics) == strip(run(smoke("client_loss=participants", "eval_batch_size=5000"))[0].metrics)
