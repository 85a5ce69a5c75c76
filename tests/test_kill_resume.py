"""Fault injection by killing the process (SIGKILL), then ``fedkernels run --resume``.

Every run here is a real ``python -m fedkernels run`` child process (smoke preset: digits, 4 clients,
MLP 64-32-10; 6 rounds, a checkpoint every round). The faulted child is the same CLI started through
a small injector (``_INJECT``) that patches one spot, prints a marker line and blocks there; the test
then sends it SIGKILL from outside, so the kill lands at a known point:

* in the middle of a client's local training (round 4, client 2, third mini-batch: clients 0-1 of the
  round have already written their update rows);
* inside the checkpoint write of round 3, with the temp file half written, or fully written and
  fsync'ed but not yet renamed onto ``ckpt_round_000003.pt``;
* and, at resume, with the newest checkpoints corrupted (one payload byte flipped; a file emptied).

Each resumed run must finish bit-identical to an uninterrupted run (``final_model.pt`` and the
non-timing fields of every metrics line), with every round exactly once in metrics.jsonl, from the
checkpoint we expect.
"""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from fedkernels.sim import checkpoint as ckpt
from fedkernels.sim.report import TIMING_KEYS

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX SIGKILL")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROUNDS = 6
RUN_ARGS = [
    "--preset",
    "smoke",
    f"rounds={ROUNDS}",
    "checkpoint_every=1",
    "keep_checkpoints=3",
    "plots=false",
    "--no-progress",
]
MARK = "@@FAULT-READY"

# argv: FAULT ROUND(1-based) CLIENT CLI-ARGS...; FAULT is train | ckpt-partial | ckpt-before-rename
_INJECT = r"""
import os, sys, time
fault, rnd, cid, argv = sys.argv[1], int(sys.argv[2]) - 1, int(sys.argv[3]), sys.argv[4:]

def ready_and_wait(where):
    print("@@FAULT-READY " + where, flush=True)
    time.sleep(300)                  # the test SIGKILLs this process here
    sys.exit("fault injector: not killed")

if fault == "train":
    from fedkernels.sim.trainer import ClientTrainer
    orig_train = ClientTrainer.train
    def train(self, c, r, *a, **k):
        if (r, c) != (rnd, cid):
            return orig_train(self, c, r, *a, **k)
        crit, calls = self.criterion, [0]
        def criterion(out, y):
            calls[0] += 1
            if calls[0] == 3:
                ready_and_wait("train round=%d client=%d batch=3" % (r + 1, c))
            return crit(out, y)
        self.criterion = criterion
        try:
            return orig_train(self, c, r, *a, **k)
        finally:
            self.criterion = crit
    ClientTrainer.train = train
else:
    from fedkernels.sim import checkpoint as ck
    target, orig_save = ck._NAME.format(rnd + 1), ck.save
    class HalfWriter:                # the payload write stops half way, flushed to disk
        def __init__(self, f): self.f, self.n = f, 0
        def __enter__(self): return self
        def __exit__(self, *e): self.f.close()
        def fileno(self): return self.f.fileno()
        def flush(self): self.f.flush()
        def write(self, b):
            self.n += 1
            if self.n < 2:
                return self.f.write(b)
            self.f.write(b[: len(b) // 2]); self.f.flush(); os.fsync(self.f.fileno())
            ready_and_wait("ckpt-partial " + target)
    def save(path, state):
        if os.path.basename(path) == target:
            if fault == "ckpt-partial":
                real_fdopen = os.fdopen
                os.fdopen = lambda *a, **k: HalfWriter(real_fdopen(*a, **k))
            else:
                real_replace = os.replace
                def replace(src, dst, *a, **k):
                    if os.path.basename(dst) == target:
                        ready_and_wait("ckpt-before-rename " + os.path.basename(src))
                    return real_replace(src, dst, *a, **k)
                os.replace = replace
        return orig_save(path, state)
    ck.save = save

from fedkernels.sim.cli import main
sys.exit(main(argv))
"""


def _env():
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0")
    env.pop("FEDKERNELS_FAULT", None)
    return env


def _cli(*args):
    """Runs ``python -m fedkernels run ...`` to completion; returns (stdout, stderr)."""
    p = subprocess.run(
        [sys.executable, "-m", "fedkernels", "run", *args],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, f"fedkernels run {args} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    return p.stdout, p.stderr


def _run_and_kill(fault, rnd, client, out, name):
    """Starts the faulted CLI run, waits for its marker, SIGKILLs it; returns the run dir and marker."""
    cmd = [
        sys.executable,
        "-c",
        _INJECT,
        fault,
        str(rnd),
        str(client),
        "run",
        *RUN_ARGS,
        "--out",
        str(out),
        "--name",
        name,
    ]
    err_path = os.path.join(str(out), f"{name}.stderr")
    os.makedirs(str(out), exist_ok=True)
    with open(err_path, "w") as err:
        p = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=err, text=True)
        lines = []
        try:
            for line in p.stdout:  # EOF (the child ended without reaching the fault) ends the loop
                lines.append(line)
                if line.startswith(MARK):
                    p.send_signal(signal.SIGKILL)
                    break
        finally:
            if p.poll() is None and not (lines and lines[-1].startswith(MARK)):
                p.kill()
            p.wait(timeout=60)
            p.stdout.close()
    assert lines and lines[-1].startswith(MARK), (
        f"the fault was never reached:\n{''.join(lines)}\n{open(err_path).read()}"
    )
    assert p.returncode == -signal.SIGKILL
    return os.path.join(str(out), name), lines[-1].split(" ", 1)[1].strip()


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(l) for l in f.read().splitlines() if l.strip()]


def _strip(ms):
    return [{k: v for k, v in m.items() if k not in TIMING_KEYS} for m in ms]


def _assert_identical(run_dir, ref_dir):
    a = torch.load(os.path.join(run_dir, "final_model.pt"), weights_only=True)
    b = torch.load(os.path.join(ref_dir, "final_model.pt"), weights_only=True)
    assert a["round"] == b["round"] == ROUNDS
    assert a["flat"].dtype == b["flat"].dtype and torch.equal(a["flat"], b["flat"])  # bit for bit
    assert a["state_dict"].keys() == b["state_dict"].keys()
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
    ms = _metrics(run_dir)
    assert [m["round"] for m in ms] == list(range(1, ROUNDS + 1))  # each round exactly once
    assert _strip(ms) == _strip(_metrics(ref_dir))
    with open(os.path.join(run_dir, "summary.json")) as f:
        s = json.load(f)
    assert s["rounds_completed"] == ROUNDS


def _no_outputs_yet(run_dir):
    assert not os.path.exists(os.path.join(run_dir, "final_model.pt"))
    assert not os.path.exists(os.path.join(run_dir, "summary.json"))


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("kill_resume")


@pytest.fixture(scope="module")
def reference(work):
    """One uninterrupted run with the same config and seed."""
    _cli(*RUN_ARGS, "--out", str(work), "--name", "ref")
    return os.path.join(str(work), "ref")


@pytest.fixture(scope="module")
def killed_in_training(work):
    """A run SIGKILLed in round 4's local training (client 2, third mini-batch)."""
    run_dir, where = _run_and_kill("train", 4, 2, work, "killed-train")
    assert where == "train round=4 client=2 batch=3"
    _no_outputs_yet(run_dir)
    assert [r for r, _ in ckpt.list_checkpoints(os.path.join(run_dir, "checkpoints"))] == [1, 2, 3]
    assert [m["round"] for m in _metrics(run_dir)] == [1, 2, 3]
    return run_dir


def _copy(run_dir, work, name):
    dst = os.path.join(str(work), name)
    shutil.copytree(run_dir, dst)
    return dst


def test_sigkill_during_local_training_resumes_bit_identical(killed_in_training, reference, work):
    run_dir = _copy(killed_in_training, work, "resume-train")
    out, err = _cli("--resume", run_dir, "--no-progress")
    assert "ckpt_round_000003.pt (round 3)" in out, out + err
    _assert_identical(run_dir, reference)


def test_corrupted_latest_checkpoints_after_kill_fall_back(killed_in_training, reference, work):
    """Round 3's checkpoint has one payload byte flipped and round 2's is empty (as after a crash on a
    filesystem without atomic rename): resume names both with the reason and uses round 1's."""
    run_dir = _copy(killed_in_training, work, "resume-corrupted")
    ck_dir = os.path.join(run_dir, "checkpoints")
    raw = bytearray(open(ckpt.path_for(ck_dir, 3), "rb").read())
    raw[len(raw) // 2] ^= 0x5A  # inside the payload: the SHA-256 no longer matches
    with open(ckpt.path_for(ck_dir, 3), "wb") as f:
        f.write(raw)
    open(ckpt.path_for(ck_dir, 2), "wb").close()
    out, err = _cli("--resume", run_dir, "--no-progress")
    warnings = [l for l in err.splitlines() if "skipping checkpoint" in l]
    assert len(warnings) == 2, err
    assert "ckpt_round_000003.pt: checksum mismatch" in warnings[0], err
    assert "ckpt_round_000002.pt is not a fedkernels checkpoint (bad header)" in warnings[1], err
    assert "ckpt_round_000001.pt (round 1)" in out, out + err
    _assert_identical(run_dir, reference)


@pytest.mark.parametrize("fault", ["ckpt-partial", "ckpt-before-rename"])
def test_sigkill_during_checkpoint_write_resumes_bit_identical(reference, work, fault):
    run_dir, where = _run_and_kill(fault, 3, 0, work, f"killed-{fault}")
    ck_dir = os.path.join(run_dir, "checkpoints")
    _no_outputs_yet(run_dir)
    # the kill landed inside save(): a temp file is there, round 3's checkpoint is not
    tmps = [f for f in os.listdir(ck_dir) if f.startswith(".tmp-")]
    assert len(tmps) == 1, os.listdir(ck_dir)
    assert [r for r, _ in ckpt.list_checkpoints(ck_dir)] == [1, 2]
    tmp = os.path.join(ck_dir, tmps[0])
    if fault == "ckpt-partial":
        with pytest.raises(ckpt.CheckpointError, match="truncated"):
            ckpt.load(tmp)  # the half-written temp is detectably bad
    else:
        assert ckpt.load(tmp)["round"] == 3  # complete and fsync'ed, but never named a checkpoint
    assert [m["round"] for m in _metrics(run_dir)] == [1, 2, 3]  # round 3 was logged before its save

    out, err = _cli("--resume", run_dir, "--no-progress")
    assert "ckpt_round_000002.pt (round 2)" in out, out + err  # the previous checkpoint was used
    assert "skipping checkpoint" not in err, err  # the temp file was never read
    _assert_identical(run_dir, reference)
    assert [r for r, _ in ckpt.list_checkpoints(ck_dir)] == [ROUNDS - 2, ROUNDS - 1, ROUNDS]
