"""The fedkernels command line, end to end into tmp_path (digits, a few seconds)."""

import json
import subprocess
import sys

import pytest
import torch

from fedkernels.sim.cli import main
from fedkernels.sim.config import RunConfig


pytestmark = pytest.mark.usefixtures("one_thread")


def test_run_smoke_end_to_end_and_resume(tmp_path, capsys):
    rc = main(
        [
            "run",
            "--preset",
            "smoke",
            "--out",
            str(tmp_path),
            "--name",
            "sm",
            "--no-progress",
            "checkpoint_every=1",
            "rounds=2",
        ]
    )
    assert rc == 0
    d = tmp_path / "sm"
    for f in ("config.yaml", "metrics.jsonl", "summary.json", "summary.csv", "curves.png", "final_model.pt"):
        assert (d / f).exists(), f
    lines = (d / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(l)["round"] for l in lines] == [1, 2]
    s = json.loads((d / "summary.json").read_text())
    assert s["final_accuracy"] > 0.3 and s["rounds_completed"] == 2
    assert RunConfig.from_yaml(str(d / "config.yaml")).rounds == 2
    assert "final_accuracy" in (d / "summary.csv").read_text().splitlines()[0]
    out = capsys.readouterr().out
    assert "round    2/2" in out and "final accuracy" in out
    # extend the finished run by one round from its last checkpoint
    assert main(["run", "--resume", str(d), "--no-progress", "rounds=3"]) == 0
    lines = (d / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(l)["round"] for l in lines] == [1, 2, 3]
    assert "resumed from" in capsys.readouterr().out


def test_run_from_yaml_with_overrides(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "rounds: 1\nnum_clients: 3\nplots: false\ndata: {name: digits}\n"
        "model: {name: mlp, options: {hidden: [8]}}\ntrain: {steps: 2}\n"
    )
    assert (
        main(
            [
                "run",
                str(cfg),
                "--out",
                str(tmp_path),
                "--quiet",
                "--no-progress",
                "algorithm.name=fedavgm",
                "algorithm.options.beta=0.5",
                "name=y",
            ]
        )
        == 0
    )
    r = RunConfig.from_yaml(str(tmp_path / "y" / "config.yaml"))
    assert r.algorithm.name == "fedavgm" and r.algorithm.options == {"beta": 0.5} and r.num_clients == 3


def test_bad_invocations(tmp_path, capsys):
    assert main(["run", "--preset", "nope"]) == 2
    assert "unknown preset" in capsys.readouterr().err
    assert main(["run", "--preset", "smoke", "train.nope=1"]) == 2
    assert "unknown config key 'train.nope'" in capsys.readouterr().err
    # --resume errors carry the usual prefix and exit 2
    assert main(["run", "--resume", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.startswith("fedkernels run: error: --resume:")


def test_compare_table_and_outputs(tmp_path, capsys):
    # an unknown method is an error before any run (tests/test_compare.py), not a skipped run
    rc = main(
        [
            "compare",
            "--preset",
            "smoke",
            "--methods",
            "fedavg,fedavgm:beta=0.5",
            "--seeds",
            "0,1",
            "--rounds",
            "1",
            "--out",
            str(tmp_path),
            "--quiet",
            "--no-progress",
        ]
    )
    assert rc == 0
    res = json.loads((tmp_path / "compare.json").read_text())
    assert set(res["methods"]) == {"fedavg", "fedavgm:beta=0.5"} and res["failed"] == []
    assert len(res["methods"]["fedavg"]["runs"]) == 2
    assert (tmp_path / "compare.png").exists() and (tmp_path / "fedavg-s1" / "metrics.jsonl").exists()
    out = capsys.readouterr().out
    assert "fedavgm:beta=0.5" in out and "±" in out


def test_info_presets_bench(capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert "fedavg" in info["algorithms"] and "digits" in info["datasets"] and "smoke" in info["presets"]
    assert main(["presets"]) == 0
    assert "smoke" in capsys.readouterr().out
    try:
        import bench.gpu  # noqa: F401
    except ImportError:
        assert main(["bench", "--suite", "gpu"]) == 2
        assert "not importable" in capsys.readouterr().err


def test_python_dash_m():
    r = subprocess.run([sys.executable, "-m", "fedkernels", "presets"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "smoke" in r.stdout
