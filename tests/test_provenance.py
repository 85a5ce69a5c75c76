"""sim.provenance: provenance.json (versions, commit, hardware, command, times) and run.log."""

import json
import os
import platform
import re
import shutil
import subprocess

import pytest
import torch

import fedkernels
from fedkernels.sim import provenance


def test_collect_records_versions_hardware_and_command():
    info = provenance.collect(["fedkernels", "run", "--preset", "smoke", "train.lr=0.1 0.2"])
    assert info["fedkernels"] == fedkernels.__version__
    assert info["torch"] == torch.__version__
    assert info["python"] == platform.python_version()
    assert info["torch_threads"] == torch.get_num_threads()
    assert info["cpu_count"] == os.cpu_count()
    assert isinstance(info["cpu"], str) and info["cpu"]
    assert info["gpus"] == (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    )
    assert info["argv"] == ["fedkernels", "run", "--preset", "smoke", "train.lr=0.1 0.2"]
    assert info["command"] == "fedkernels run --preset smoke 'train.lr=0.1 0.2'"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", info["start_time"])
    assert info["status"] == "running" and info["end_time"] is None
    json.dumps(info)  # plain JSON


@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
def test_git_info_matches_the_checkout_and_sees_dirt(tmp_path):
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(fedkernels.__file__)))
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=pkg, capture_output=True, text=True)
    if head.returncode == 0:
        assert provenance.git_info()["commit"] == head.stdout.strip()
    else:
        assert provenance.git_info()["commit"] is None
    # outside a checkout: no commit
    assert provenance.git_info(str(tmp_path)) == {"commit": None}
    # a fresh repository: clean, then dirty once a tracked file changes
    repo = tmp_path / "repo"
    repo.mkdir()
    env = dict(
        os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t"
    )
    (repo / "a.txt").write_text("1\n")
    for cmd in (["init", "-q"], ["add", "a.txt"], ["commit", "-qm", "x"]):
        subprocess.run(["git", *cmd], cwd=repo, check=True, env=env)
    g = provenance.git_info(str(repo))
    assert len(g["commit"]) == 40 and g["dirty"] is False
    (repo / "b.txt").write_text("untracked\n")
    assert provenance.git_info(str(repo))["dirty"] is False
    (repo / "a.txt").write_text("2\n")
    assert provenance.git_info(str(repo))["dirty"] is True


def test_write_finish_and_resume_keep_every_session(tmp_path):
    d = str(tmp_path / "run")
    first = provenance.collect(["fedkernels", "run", "--preset", "smoke"])
    provenance.write(d, first)
    assert os.listdir(d) == ["provenance.json"]  # no temporary file left behind
    rec = provenance.finish(d, status="interrupted", last_round=3)
    assert rec["status"] == "interrupted" and rec["last_round"] == 3
    assert rec["duration_s"] >= 0 and rec["end_time"] is not None
    assert provenance.read(d)["status"] == "interrupted"
    # a resumed session: the earlier record moves under "previous"
    second = dict(provenance.collect(["fedkernels", "run", "--resume", d]), start_unix=first["start_unix"] + 1)
    provenance.write(d, second)
    third = dict(provenance.collect(["fedkernels", "run", "--resume", d]), start_unix=first["start_unix"] + 2)
    provenance.write(d, third)
    got = provenance.read(d)
    assert got["argv"][-2:] == ["--resume", d] and got["status"] == "running"
    assert [p["start_unix"] for p in got["previous"]] == [first["start_unix"], second["start_unix"]]
    assert got["previous"][0]["status"] == "interrupted"
    assert "previous" not in got["previous"][1]
    assert provenance.finish(str(tmp_path / "none")) is None


def test_run_log_lines_are_timestamped(tmp_path):
    with provenance.RunLog(str(tmp_path)) as log:
        log("start")
        log("two\nlines")
    with provenance.RunLog(str(tmp_path)) as log:  # appends
        log("resumed")
    lines = (tmp_path / "run.log").read_text().splitlines()
    assert len(lines) == 4
    for line, msg in zip(lines, ["start", "two", "lines", "resumed"]):
        m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ) (.*)", line)
        assert m and m.group(2) == msg
