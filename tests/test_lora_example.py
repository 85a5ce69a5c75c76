"""examples/lora_fmnist.py --quick runs end to end (a subprocess): pretraining, federated LoRA fine-tuning
per mode with and without a codec, its table and results. Bounds as in test_lora_cli: fold's base + product
is the true average up to fp32 rounding of the stored factors and residuals; exact's best rank-r factors are
no farther from it than naive's rank-r product."""

import json
import os
import sys

import pytest

import cli_process  # tests/cli_process.py: the command in a child forked from a pre-imported interpreter

pytest.importorskip("peft")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_lora_fmnist_quick(tmp_path):
    from fedkernels.sim.data import load_dataset

    try:
        load_dataset("fmnist", max_train=1, max_test=1)
    except (FileNotFoundError, ValueError):
        pytest.skip("Fashion-MNIST is not installed (Debian's dataset-fashion-mnist)")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    p = cli_process.run(
        [sys.executable, os.path.join(ROOT, "examples", "lora_fmnist.py"), "--quick", "--out", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((tmp_path / "results.json").read_text())["results"]
    got = {(r["method"], r["codec"]): r for r in res}
    assert set(got) == {(m, c) for m in ("full", "exact", "fold") for c in ("none", "int8_block")}
    full, lora = got["full", "none"], got["exact", "none"]
    assert lora["d"] < full["d"] / 10  # only the adapters are trained and sent
    assert full["bytes_sent_per_round"] == 4 * full["d"] * 4 and lora["bytes_sent_per_round"] == 4 * lora["d"] * 4
    assert got["exact", "int8_block"]["bytes_sent_per_round"] < lora["bytes_sent_per_round"] / 3
    for c in ("none", "int8_block"):
        f, e = got["fold", c], got["exact", c]
        assert f["relative_error_mean"] < 1e-5 < f["naive_relative_error_mean"]
        assert e["relative_error_mean"] <= e["naive_relative_error_mean"] + 1e-5
    assert "| exact | int8_block | 1 |" in (tmp_path / "table.md").read_text()
