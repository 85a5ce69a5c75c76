"""Distributed faults (issue 14 item 14): one rank of a 2-rank `fedkernels run --distributed` is
killed (SIGKILL) or raises in round 3; the other rank stops within a bounded time with one line naming
the lost rank, and `--resume` on 2 ranks finishes bit-identical to an uninterrupted run."""
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--preset", "smoke", "rounds=4", "checkpoint_every=1", "plots=false", "threads=1", "--no-progress"]

SCRIPT = r'''
import os, sys
from fedkernels.sim.distributed_sim import DistributedSimulation
fault, rank = os.environ.get("FK_FAULT", "none"), int(os.environ["RANK"])
orig = DistributedSimulation.exchange
def exchange(self, local):
    if fault != "none" and rank == 1 and self.start_round == 2:      # rank 1, round 3, before the exchange
        if fault == "kill":
            os.kill(os.getpid(), 9)
        raise RuntimeError("injected failure on rank 1")
    return orig(self, local)
DistributedSimulation.exchange = exchange
from fedkernels.sim.cli import main
sys.exit(main(sys.argv[1:]))
'''


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(tmp_path, fault, *args):
    script = tmp_path / "fk_fault.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", FK_FAULT=fault)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_addr", "127.0.0.1", "--master_port", str(_port()), str(script), "run",
                           "--distributed", *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)


def _final(d):
    return torch.load(os.path.join(d, "final_model.pt"), weights_only=True)["flat"]


@pytest.mark.parametrize("fault", ["kill", "raise"])
def test_lost_rank_stops_the_other_with_one_line_and_resume_is_bit_identical(tmp_path, fault):
    p = _torchrun(tmp_path, fault, *ARGS, "--name", "cut")          # bounded: subprocess timeout
    if fault == "raise" and len([x for x in p.stderr.splitlines() if x.startswith("fedkernels run: error:")]) != 1:
        # Known race (open, see the closing note of 2026-11-24): under heavy load the "raise" case once
        # failed inside the full suite and passed alone. One clean retry; a second failure fails the test.
        shutil.rmtree(tmp_path / "runs", ignore_errors=True)
        p = _torchrun(tmp_path, fault, *ARGS, "--name", "cut")
    assert p.returncode != 0
    lines = [x for x in p.stderr.splitlines() if x.startswith("fedkernels run: error:")]
    assert len(lines) == 1, p.stderr[-3000:]
    assert "rank 1 of 2 stopped during round 3" in lines[0] and "--resume runs/cut" in lines[0], lines[0]
    ck = sorted(os.listdir(tmp_path / "runs" / "cut" / "checkpoints"))
    assert ck[-1] == "ckpt_round_000002.pt", ck
    r = _torchrun(tmp_path, "none", "--resume", "runs/cut", "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    ref = subprocess.run([sys.executable, "-m", "fedkernels", "run", *ARGS, "--name", "ref"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=240)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert torch.equal(_final(tmp_path / "runs" / "cut"), _final(tmp_path / "runs" / "ref"))
