"""`fedkernels run --resume` and Ctrl-C as a user meets them, every test a real
``python -m fedkernels`` child: a finished run is left byte for byte as it was (exit 0), a run without
a checkpoint is one error line (exit 2, nothing touched), and a double Ctrl-C keeps every completed
round (the second signal abandons local training; one that lands while a round aggregates lets that
round finish) with a resume bit-identical to an uninterrupted run."""

import hashlib
import json
import os
import signal
import sys

import pytest
import torch

import cli_process  # tests/cli_process.py: the command in a child forked from a pre-imported interpreter

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGINT"), reason="needs POSIX signals")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = ["plots=false", "threads=1", "--no-progress"]
SMALL = ["--preset", "smoke", "data.train_subset=400", "client_loss=none", *QUICK]


def _env():
    return dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")


def fk(*args, cwd):
    return cli_process.run(
        [sys.executable, "-m", "fedkernels", *args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300
    )


def _tree(d):
    """{relative path: sha256} of every file under ``d``, with the modification times."""
    out = {}
    for root, _, files in os.walk(d):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, d)] = (hashlib.sha256(fh.read()).hexdigest(), os.stat(p).st_mtime_ns)
    return out


def _final(run_dir):
    return torch.load(os.path.join(run_dir, "final_model.pt"), weights_only=True)["flat"]


@pytest.fixture(scope="module")
def ref5(tmp_path_factory):
    """The final model of an uninterrupted 5-round run."""
    d = tmp_path_factory.mktemp("ref")
    p = fk("run", *SMALL, "rounds=5", "--name", "ref", cwd=d)
    assert p.returncode == 0, p.stderr[-2000:]
    return _final(d / "runs" / "ref")


def test_resume_extends_a_run_and_leaves_a_finished_one_untouched(tmp_path, ref5):
    p = fk("run", *SMALL, "rounds=2", "checkpoint_every=1", "--name", "done", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    # more rounds continue from the last round's checkpoint: the same model as an uninterrupted run
    r = fk("run", "--resume", "runs/done", "rounds=5", *QUICK[2:], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed from runs/done/checkpoints/ckpt_round_000002.pt (round 2)" in r.stdout
    assert torch.equal(_final(tmp_path / "runs" / "done"), ref5)
    # the finished run: one line, exit 0, every byte and mtime as it was
    before = _tree(tmp_path / "runs" / "done")
    r = fk("run", "--resume", "runs/done", *QUICK[2:], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "runs/done: already complete (5 rounds done, rounds=5); nothing to do" in r.stdout, r.stdout
    assert "--resume runs/done rounds=N (N > 5)" in r.stdout
    assert _tree(tmp_path / "runs" / "done") == before


def test_resume_without_a_checkpoint_is_an_error_that_says_how_to_get_one(tmp_path):
    p = fk("run", *SMALL, "rounds=2", "checkpoint_every=0", "--name", "nock", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    d = tmp_path / "runs" / "nock"
    before = _tree(d)
    # a run that finished is complete even without a checkpoint ...
    r = fk("run", "--resume", "runs/nock", *QUICK[2:], cwd=tmp_path)
    assert r.returncode == 0 and "already complete (2 rounds done" in r.stdout, (r.stdout, r.stderr)
    # ... but more rounds need one: one line, exit 2, nothing touched
    r = fk("run", "--resume", "runs/nock", "rounds=4", *QUICK[2:], cwd=tmp_path)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("fedkernels run: error: --resume runs/nock: no checkpoint"), lines
    assert "checkpoint_every=0" in lines[0] and "checkpoint_every=1" in lines[0]
    assert _tree(d) == before


# The injector: the real CLI with one spot patched to send this process two SIGINTs (a double Ctrl-C).
_DOUBLE = r"""
import os, signal, sys
where, rnd, argv = sys.argv[1], int(sys.argv[2]) - 1, sys.argv[3:]
from fedkernels.sim import simulation
from fedkernels.sim.trainer import ClientTrainer
def twice():
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGINT)
if where == "train":            # inside a client's local training
    orig = ClientTrainer.train
    def train(self, c, r, *a, **k):
        if r == rnd and c == 1:
            twice()
        return orig(self, c, r, *a, **k)
    ClientTrainer.train = train
else:                           # inside the aggregation (the aggregator's call): the model is changing
    from fedkernels.algorithms import base
    hit = {"r": None}
    orig = simulation.Simulation.apply_aggregate
    def apply_aggregate(self, r, *a, **k):
        hit["r"] = r
        return orig(self, r, *a, **k)
    simulation.Simulation.apply_aggregate = apply_aggregate
    orig_agg = base.Aggregator.aggregate
    def aggregate(self, *a, **k):
        if hit["r"] == rnd:
            hit["r"] = None
            twice()
        return orig_agg(self, *a, **k)
    base.Aggregator.aggregate = aggregate
from fedkernels.sim.cli import main
sys.exit(main(argv))
"""


@pytest.mark.parametrize("where,kept", [("train", 2), ("aggregate", 3)])
def test_double_ctrl_c_keeps_every_completed_round(tmp_path, ref5, where, kept):
    """Round 3 is hit by two SIGINTs. In local training: round 3 is abandoned and round 2 checkpointed
    although checkpoint_every=0; during aggregation: round 3 finishes and is checkpointed. Either way
    the resumed run equals an uninterrupted one, bit for bit."""
    args = ["run", *SMALL, "rounds=5", "checkpoint_every=0", "--name", "cut"]
    p = cli_process.run(
        [sys.executable, "-c", _DOUBLE, where, "3", *args],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 130, (p.returncode, p.stderr[-2000:])
    assert "Traceback" not in p.stderr, p.stderr
    last = [x for x in p.stderr.splitlines() if x.strip()][-1]
    assert last == (
        f"interrupted after round {kept}: checkpoint at round {kept}; continue with `fedkernels run --resume runs/cut`"
    ), last
    d = tmp_path / "runs" / "cut"
    assert [int(f[11:17]) for f in sorted(os.listdir(d / "checkpoints"))] == [kept]
    assert [json.loads(x)["round"] for x in (d / "metrics.jsonl").read_text().splitlines()] == list(range(1, kept + 1))
    assert json.loads((d / "provenance.json").read_text())["status"] == "interrupted"
    r = fk("run", "--resume", "runs/cut", *QUICK[2:], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"(round {kept})" in r.stdout
    assert torch.equal(_final(d), ref5)


def test_every_preset_checkpoints_and_ends_on_a_checkpoint():
    from fedkernels.sim import presets

    for name in presets.names():
        cfg = presets.get(name)
        assert cfg.checkpoint_every >= 1 and cfg.rounds % cfg.checkpoint_every == 0, (name, cfg.checkpoint_every)
