"""Differential privacy from the real CLI (subprocess): a DP run writes epsilon on every metrics.jsonl row
and in the summary (dp-accounting's numbers for the run's sampling), client-side clipping runs, and bad dp
input is one line with exit 2 and nothing written; compare's tables show epsilon."""

import json
import os
import sys

import pytest

import cli_process  # tests/cli_process.py: the command in a child forked from a pre-imported interpreter

pytest.importorskip("dp_accounting")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = ["plots=false", "threads=1", "--no-progress", "rounds=2"]


def fk(*args, cwd, timeout=600):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return cli_process.run(
        [sys.executable, "-m", "fedkernels", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def _rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f if x.strip()]


@pytest.mark.parametrize("kind", ["central", "client"])
def test_dp_run_reports_epsilon_every_round(tmp_path, kind):
    from fedkernels.privacy import PrivacyAccountant

    p = fk(
        "run",
        "--preset",
        "smoke",
        *QUICK,
        "--name",
        "dp",
        f"dp.kind={kind}",
        "dp.clip=0.5",
        "dp.noise_multiplier=1.5",
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    run = tmp_path / "runs" / "dp"
    rows = _rows(run)
    acc = PrivacyAccountant(1.5, 4, 4, 1e-5)  # smoke: 4 clients, all 4 every round
    assert [r["epsilon"] for r in rows] == [acc.epsilon_at(1), acc.epsilon_at(2)]
    assert all(r["agg"]["dp_clip"] == 0.5 for r in rows)
    if kind == "client":  # the clients clipped: the server finds nothing over C
        assert all(r["agg"]["dp_clipped"] == 0 for r in rows)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["epsilon"] == acc.epsilon_at(2)
    assert f"epsilon {acc.epsilon_at(2):.4g} after the last round" in p.stdout + p.stderr


@pytest.mark.parametrize(
    "ov,words",
    [
        (["dp.kind=central", "dp.clip=0", "dp.noise_multiplier=1"], ["dp.clip", "> 0", "0"]),
        (["dp.kind=central", "dp.clip=1", "dp.noise_multiplier=-1"], ["dp.noise_multiplier", ">= 0"]),
        (["dp.kind=central", "dp.clip=1", "dp.noise_multiplier=1", "dp.delta=1.5"], ["dp.delta", "(0, 1)"]),
        (["dp.kind=central", "dp.clip=1", "dp.noise_multiplier=1", "dp.delta=0"], ["dp.delta", "(0, 1)"]),
        (
            ["dp.kind=central", "dp.clip=1", "dp.target_epsilon=0.0001", "rounds=500"],
            ["target_epsilon", "cannot be reached"],
        ),
        (["dp.kind=central", "dp.clip=1", "dp.noise_multiplier=1", "algorithm.name=scaffold"], ["scaffold", "refused"]),
        (["dp.kind=central", "dp.clip=1", "dp.noise_multiplier=1", "algorithm.name=fedaware"], ["fedaware", "refused"]),
        (["dp.kind=sideways", "dp.clip=1", "dp.noise_multiplier=1"], ["dp.kind", "central|client|adaptive"]),
        (["dp.kind=central", "dp.clip=1"], ["exactly one of dp.noise_multiplier and dp.target_epsilon"]),
    ],
)
def test_bad_dp_input_is_one_line_exit_2_nothing_written(tmp_path, ov, words):
    p = fk("run", "--preset", "smoke", "plots=false", "--no-progress", *ov, cwd=tmp_path)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, lines
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert not (tmp_path / "runs").exists()


def test_compare_tables_show_epsilon():
    from fedkernels.sim import compare

    stats = {"n": 1, "mean": 0.5, "std": None, "ci_low": None, "ci_high": None}
    r = {"n_seeds": 1, "stats": {k: stats for k, _ in compare.METRICS}, "paired": {}, "timing": {}, "epsilon": 2.345}
    out = {"methods": {"fedavg": r, "plain": dict(r, epsilon=None)}, "baseline": "fedavg", "seeds": [0], "rounds": 2}
    md = compare.markdown_table(out)
    assert "| epsilon |" in md.splitlines()[0] + " |" or "epsilon" in md.splitlines()[0]
    assert "2.35" in md.splitlines()[2] and md.splitlines()[3].rstrip(" |").endswith("-")
    assert "2.35" in compare.format_table(out)
