"""fedkernels compare: validation before any run, progress, statistics and tables."""

import csv
import json
import os
import sys

import pytest

from fedkernels.sim import stats
from fedkernels.sim.compare import METRICS, compare, method_stats, resolve_methods
from fedkernels.sim.presets import get, variants

import cli_process  # tests/cli_process.py: the command in a child forked from a pre-imported interpreter

pytestmark = pytest.mark.usefixtures("one_thread")


def _cli(*args, cwd=None):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return cli_process.run(
        [sys.executable, "-m", "fedkernels", "compare", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=cwd,
    )


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--methods", "fedavg,nosuchmethod"], "method 'nosuchmethod': not a preset method or registered algorithm"),
        (
            ["--methods", "fedavg,kuramoto:kapa0=1"],
            "method 'kuramoto:kapa0=1': option kapa0=1: unknown option of kuramoto; did you mean 'kappa0'?",
        ),
        (
            ["--methods", "fedavg,fedprox:mu=-1"],
            "method 'fedprox:mu=-1': options (fedprox): mu must be a finite number",
        ),
        (
            ["--methods", "fedavg,fedavgm:beta=abc"],
            "method 'fedavgm:beta=abc': option beta='abc': fedavgm expects a number",
        ),
        (["--methods", "fedavg,fedavg"], "label 'fedavg' given twice"),
        (["--methods", "fedavg", "--seeds", "0,x"], "--seeds: 'x' is not an integer"),
        (
            ["--methods", "fedavg,fedavgm", "--baseline", "fedprox"],
            "baseline='fedprox': not one of the compared methods",
        ),
    ],
)
def test_bad_methods_exit_2_before_any_run(tmp_path, args, needle):
    out = tmp_path / "cmp"
    r = _cli("--preset", "smoke", "--out", str(out), "--rounds", "1", "--no-progress", *args)
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedkernels compare: error: "), r.stderr
    assert needle in err[0]
    assert "Traceback" not in r.stderr and not out.exists()  # nothing trained, nothing written


def test_preset_labels_resolve_and_validate():
    meths = resolve_methods(["fedavg", "kuramoto-S0.5", "fedprox:mu=0.1"], variants("kuramoto-fmnist"))
    assert [m[0] for m in meths] == ["fedavg", "kuramoto-S0.5", "fedprox:mu=0.1"]
    assert meths[1][1] == {"name": "kuramoto", "options": {"mode": "S", "kappa0": 0.5}}
    with pytest.raises(ValueError, match="method 'x': option kapa0=1"):
        resolve_methods([("x", {"name": "kuramoto", "options": {"kapa0": 1}})])


def test_method_stats_sample_std_ci_and_paired_vs_baseline():
    fin = {"fedavg": [0.80, 0.82, 0.81], "m": [0.83, 0.84, 0.84]}
    runs = {
        lab: {
            s: {"final_accuracy": v, "best_accuracy": v, "mean_last_10pct_rounds": v - 0.01, "mean_last_10_rounds": v}
            for s, v in enumerate(vals)
        }
        for lab, vals in fin.items()
    }
    runs["m"][1] = None  # a failed run drops its pair
    st = method_stats(runs, "fedavg")
    d = st["fedavg"]["stats"]["final_accuracy"]
    assert d["std"] == pytest.approx(0.01) and d["n"] == 3  # sample std (n - 1), not population
    assert st["fedavg"]["stats"]["mean_last_10pct_rounds"]["mean"] == pytest.approx(0.80)
    p = st["m"]["paired"]["final_accuracy"]
    assert p["keys"] == [0, 2] and p["diffs"] == pytest.approx([0.03, 0.03])
    assert st["m"]["n_seeds"] == 2 and st["fedavg"]["paired"] == {}
    assert set(st["m"]["paired"]) == {k for k, _ in METRICS}
    with pytest.raises(ValueError, match="baseline 'nope'"):
        method_stats(runs, "nope")


def test_compare_end_to_end_tables_progress_and_failures(tmp_path, capsys, monkeypatch):
    from fedkernels.sim import simulation

    real_run = simulation.Simulation.run

    def run(self, *a, **k):  # one run fails: recorded, the others go on
        if self.cfg.algorithm.name == "fedavgm" and self.cfg.seed == 1:
            raise RuntimeError("injected\nfailure")
        return real_run(self, *a, **k)

    monkeypatch.setattr(simulation.Simulation, "run", run)
    base = get("smoke")
    base.progress = False
    base.verbose = False
    res = compare(
        base,
        ["fedavg", "fedavgm:beta=0.5", "fedprox:mu=0.1"],
        seeds=[0, 1],
        out_dir=str(tmp_path),
        rounds=1,
        preset="smoke",
    )
    out = capsys.readouterr().out
    assert "[1/6] fedavg (seed 0) ..." in out and "[6/6] done fedprox:mu=0.1 (seed 1)" in out and "ETA" in out
    assert "FAILED: RuntimeError: injected failure" in out
    assert res["failed"] == [{"method": "fedavgm:beta=0.5", "seed": 1, "error": "RuntimeError: injected failure"}]
    assert res["baseline"] == "fedavg" and res["title"].startswith("smoke: digits, iid, 4 clients, mlp, 1 rounds")
    j = json.loads((tmp_path / "compare.json").read_text())
    fa = [r["final_accuracy"] for r in j["methods"]["fedavg"]["runs"]]
    fp = [r["final_accuracy"] for r in j["methods"]["fedprox:mu=0.1"]["runs"]]
    d = j["methods"]["fedavg"]["stats"]["final_accuracy"]
    assert d["mean"] == pytest.approx(sum(fa) / 2)
    assert d["std"] == pytest.approx(abs(fa[0] - fa[1]) / 2**0.5)  # sample std of two values
    p = j["methods"]["fedprox:mu=0.1"]["paired"]["final_accuracy"]
    assert p["mean_diff"] == pytest.approx(stats.paired(fp, fa)["mean_diff"]) and p["n"] == 2
    assert j["methods"]["fedavgm:beta=0.5"]["n_seeds"] == 1
    assert j["methods"]["fedavgm:beta=0.5"]["runs"][1]["error"].startswith("RuntimeError")
    t = j["methods"]["fedavg"]["timing"]
    assert t["t_round1_s"] > 0 and t["t_round_median_s"] is None  # one round: no later rounds
    for f in ("compare.csv", "compare.md", "compare.tex", "compare.png", "compare.pdf", "compare.svg"):
        assert (tmp_path / f).exists(), f
    rows = list(csv.DictReader(open(tmp_path / "compare.csv")))
    assert len(rows) == 3 * len(METRICS)
    row = next(r for r in rows if r["method"] == "fedprox:mu=0.1" and r["metric"] == "final_accuracy")
    assert row["baseline"] == "fedavg" and float(row["diff_mean"]) == pytest.approx(p["mean_diff"])
    md = (tmp_path / "compare.md").read_text()
    assert "| fedavg | 2 |" in md and "sample standard deviation" in md and "paired" in md
    tex = (tmp_path / "compare.tex").read_text()
    assert "\\begin{tabular}" in tex and "fedprox:mu=0.1" in tex and "$\\pm$" in tex


def test_presets_show_a_time_estimate():
    from fedkernels.sim import presets

    e = presets.estimate("kuramoto-digits")
    assert e["rounds"] == presets.get("kuramoto-digits").rounds
    assert e["s_per_run"] == pytest.approx(e["s_per_round"] * e["rounds"]) and e["source"].startswith("results/")
    assert presets.estimate("kuramoto-cifar10") is None
    r = cli_process.run([sys.executable, "-m", "fedkernels", "presets"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0
    times = [ln for ln in r.stdout.splitlines() if ln.strip().startswith("time:")]
    assert len(times) == len(presets.names())
    assert any("s/round" in t and "estimate" in t for t in times) and any("not measured" in t for t in times)


def test_label_with_a_path_separator_stays_one_run_directory(tmp_path):
    # e.g. fedavg:server_lr_schedule=dir/x.json: the label names one directory, never a nested one
    base = get("smoke")
    base.progress = False
    base.verbose = False
    compare(
        base,
        [("sched/a", {"name": "fedavg", "options": {}})],
        seeds=[0],
        out_dir=str(tmp_path),
        rounds=1,
        preset="smoke",
    )
    assert (tmp_path / "sched_a-s0" / "summary.json").exists() and not (tmp_path / "sched").exists()
    with pytest.raises(ValueError, match="given twice"):
        compare(
            base,
            [("x/y", {"name": "fedavg", "options": {}}), ("x_y", {"name": "fedavg", "options": {}})],
            seeds=[0],
            out_dir=str(tmp_path / "two"),
            rounds=1,
            preset="smoke",
        )
    assert not (tmp_path / "two").exists()


def test_run_name_of_a_label_with_a_path_separator():
    cfg = get("smoke")
    cfg.method = "fedavg:server_lr_schedule=dir/x.json"
    assert "/" not in cfg.run_name() and "dir_x.json" in cfg.run_name()
