"""Benchmarks as a user runs them: `fedkernels bench` from any directory of a source checkout, a clear
one-line refusal from an installed package without bench/, and results that go to runs/bench/ (never
over the published bench/results/ unless asked with --out). Subprocesses, other working directories."""

import hashlib
import os
import subprocess
import sys

import pytest

import cli_process  # tests/cli_process.py: the command in a child forked from a pre-imported interpreter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PUBLISHED = os.path.join(ROOT, "bench", "results")


def _snapshot(folder):
    """{name: sha256} of the files of ``folder`` (the published results)."""
    out = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def _run(args, cwd, pythonpath=ROOT, timeout=300):
    env = dict(os.environ, PYTHONPATH=pythonpath, OMP_NUM_THREADS="1")
    run = cli_process.run if pythonpath == ROOT else subprocess.run  # another fedkernels: a fresh interpreter
    return run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


@pytest.fixture
def published_untouched():
    before = _snapshot(PUBLISHED)
    yield
    assert _snapshot(PUBLISHED) == before, "a benchmark changed the published bench/results/"


def test_bench_help_from_another_directory_lists_quick_out_and_the_suite_options(tmp_path, published_untouched):
    r = _run(["-m", "fedkernels", "bench", "--suite", "cpu", "--help"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "--quick" in r.stdout and "--out" in r.stdout and "runs/bench/" in r.stdout
    assert "options of the suite (bench.cpu)" in r.stdout and "--only" in r.stdout  # the checkout's suite ran
    assert not (tmp_path / "runs").exists()


def test_bad_suite_option_is_one_error_before_anything_is_written(tmp_path, published_untouched):
    r = _run(["-m", "fedkernels", "bench", "--suite", "cpu", "--quick", "--only", "nosuch"], cwd=tmp_path)
    assert r.returncode == 2
    assert (
        r.stderr.strip()
        .splitlines()[-1]
        .endswith("--only: nosuch is not a suite; expected some of core,linalg,gc,becado,round")
    ), r.stderr
    r = _run(["-m", "fedkernels", "bench", "--suite", "cpu", "--only", "core,gc", "--out", "x.json"], cwd=tmp_path)
    assert r.returncode == 2 and "--out: x.json is one file but 2 suites" in r.stderr, r.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "x.json").exists()


def test_benchmark_results_go_to_runs_bench_of_the_cwd(tmp_path, published_untouched):
    # a whole (tiny) benchmark run: the fuzzing campaign with 2 cases, from another directory
    r = _run(["-m", "bench.fuzz", "--cases", "2", "--timeout", "60"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "runs" / "bench" / "fuzz.json").is_file()
    assert "wrote runs/bench/fuzz.json" in r.stdout


def test_out_is_a_directory_or_a_json_path(tmp_path, monkeypatch):
    sys.path.insert(0, ROOT)
    from bench import common

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(common, "_COPY_BW", 1e10)  # no bandwidth measurement in a unit test
    assert common.write_json("cpu-x.json", [{"a": 1}]) == os.path.join("runs", "bench", "cpu-x.json")
    assert common.write_json("cpu-x.json", [], out=str(tmp_path / "pub")) == str(tmp_path / "pub" / "cpu-x.json")
    assert common.write_json("cpu-x.json", [], out="sub/mine.json") == "sub/mine.json"
    assert (tmp_path / "runs" / "bench" / "cpu-x.json").is_file() and (tmp_path / "sub" / "mine.json").is_file()
    assert common.output_path("bench/results", "fuzz.json") == os.path.join("bench", "results", "fuzz.json")


def test_installed_package_without_bench_says_where_the_suites_are(tmp_path, published_untouched):
    # fedkernels importable from a folder with no bench/ beside it (as from a wheel); the cwd holds a
    # decoy `bench` package that must never run
    site = tmp_path / "site"
    site.mkdir()
    os.symlink(os.path.join(ROOT, "fedkernels"), site / "fedkernels")
    work = tmp_path / "work"
    (work / "bench").mkdir(parents=True)
    (work / "bench" / "__init__.py").write_text("")
    (work / "bench" / "cpu.py").write_text("open('DECOY_RAN', 'w').close()\ndef main():\n    return 0\n")
    r = _run(["-m", "fedkernels", "bench", "--suite", "cpu", "--quick"], cwd=work, pythonpath=str(site))
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "not installed with the package" in lines[0] and "source checkout" in lines[0]
    assert not (work / "DECOY_RAN").exists() and not (work / "runs").exists()
