"""bench/gpu.py runs on the CPU (``--device cpu --quick``), so CI covers the GPU harness itself and
only the numbers are new on the GPU. The real command runs in a subprocess."""

from __future__ import annotations

import json
import os
import sys

import torch

import cli_process  # tests/cli_process.py: the command in a child forked from a pre-imported interpreter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, cwd=ROOT):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("OUT", None)
    return cli_process.run(
        [sys.executable, os.path.join(ROOT, "bench", "gpu.py"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_gpu_bench_harness_runs_on_cpu(tmp_path):
    r = _run("--device", "cpu", "--quick", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    files = list(tmp_path.glob("gpu-*.json"))
    assert len(files) == 1
    doc = json.loads(files[0].read_text())
    assert doc["device"].startswith("cpu") and doc["torch"] == torch.__version__ and doc["quick"] is True
    assert doc["copy_GBps"] > 0
    rows = doc["results"]
    ops = {r["op"] for r in rows}
    assert ops == {
        "copy",
        "weighted_sum",
        "gram",
        "kstats",
        "order_mean",
        "closest_mean",
        "dequant_weighted_sum",
        "sparse_weighted_sum",
        "weighted_sum_noised",
        "server_opt_step_",
        "finite_rows",
        "min_norm",
        "gc_project_",
        "fused_sgd_step_",
        "lu_factor",
        "lu_solve",
        "fedecado_be_step",
        "aggregate",
    }
    for r in rows:
        assert r["ms"] > 0 and r["sizes"], r
        if "bytes_min" in r:
            assert r["GBps"] > 0 and r["pct_copy_bw"] > 0
    baselines = {(r["op"], k) for r in rows for k in r.get("baselines", {})}
    for want in [
        ("weighted_sum", "torch_coef_at_U"),
        ("gram", "torch_fp64_U_UT"),
        ("kstats", "gram_then_Gp"),
        ("order_mean", "torch_median_0"),
        ("order_mean", "torch_sort_trimmed"),
        ("dequant_weighted_sum", "torch_dequantise_then_sum"),
        ("sparse_weighted_sum", "torch_index_add"),
        ("weighted_sum_noised", "weighted_sum_plus_torch_randn"),
        ("server_opt_step_", "torch_elementwise"),
        ("lu_solve", "torch_linalg_lu_solve"),
        ("fused_sgd_step_", "torch_foreach_sgd"),
    ]:
        assert want in baselines, want
    for r in rows:
        for b in r.get("baselines", {}).values():
            assert b["ms"] > 0 and ("GBps" in b) == ("bytes_min" in r)
    gram = [r for r in rows if r["op"] == "gram"]
    assert all(r["bitwise_repeatable"] and r["rel_err_vs_fp64"] < 1e-12 for r in gram)
    kst = [r for r in rows if r["op"] == "kstats"]
    assert kst and all(r["bitwise_repeatable"] and r["rel_err_dot_vs_fp64"] < 1e-12 for r in kst)
    sel = [r for r in rows if r["op"] in ("order_mean", "closest_mean")]
    assert len(sel) == 6 and all(r["bitwise_repeatable"] and r["median_max_abs_err_vs_fp64"] < 1e-6 for r in sel)
    deq = [r for r in rows if r["op"] == "dequant_weighted_sum"]
    # fp32 accumulation of K = 4 rows of |code * scale| <= 1: relative error well under 1e-5
    assert len(deq) == 2 and all(r["bitwise_repeatable"] and r["rows_ok"] and r["rel_err_vs_fp64"] < 1e-5 for r in deq)
    assert all(r["bitwise_repeatable"] for r in rows if r["op"] in ("sparse_weighted_sum", "weighted_sum_noised"))


def test_gpu_bench_whole_aggregate_table(tmp_path):
    """Every registered aggregator runs a whole round with its payloads, at two K, next to the
    one-read floor and plain torch glob + w @ U."""
    from bench.cpu_hostwork import methods

    r = _run("--device", "cpu", "--quick", "--only", "aggregate", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = [x for x in json.loads(next(tmp_path.glob("gpu-*.json")).read_text())["results"] if x["op"] == "aggregate"]
    Ks = sorted({x["sizes"]["K"] for x in rows})
    assert len(Ks) == 2
    for K in Ks:
        at = {x["method"]: x for x in rows if x["sizes"]["K"] == K}
        assert set(at) == set(methods()) | {"torch_glob_plus_w_at_U"}, sorted(at)
        for name in methods():
            x = at[name]
            assert x["ms"] > 0 and x["x_floor"] > 0 and x["floor_ms"] > 0 and x["bytes_min"] == K * x["sizes"]["d"] * 4
            assert x["baselines"]["torch_glob_plus_w_at_U"]["ms"] == at["torch_glob_plus_w_at_U"]["ms"]


def test_gpu_bench_bad_arguments_exit_2(tmp_path):
    r = _run("--device", "cpu", "--quick", "--only", "nope", "--out", str(tmp_path))
    assert r.returncode == 2 and "--only got ['nope']" in r.stderr
    if not torch.cuda.is_available():
        r = _run("--device", "cuda", "--out", str(tmp_path))
        assert r.returncode == 2 and "no CUDA device" in r.stderr
    assert not list(tmp_path.glob("gpu-*.json"))


def test_default_output_is_runs_bench_under_the_cwd(tmp_path):
    """Without --out the result goes to runs/bench/ under the current directory, never into the
    committed bench/results/ (only bench/gpu.sh passes --out bench/results, on a GPU)."""
    published = os.path.join(ROOT, "bench", "results")
    before = {f: os.path.getmtime(os.path.join(published, f)) for f in os.listdir(published)}
    r = _run("--device", "cpu", "--quick", "--only", "weighted_sum", cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert [p.name for p in (tmp_path / "runs" / "bench").glob("gpu-*.json")] != []
    assert {f: os.path.getmtime(os.path.join(published, f)) for f in os.listdir(published)} == before
