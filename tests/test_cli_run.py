"""`fedkernels run` as a user meets it: a preset runs what its
name says, run directories are never overwritten, bad keys/values/options are one line and exit 2
before anything is written, Ctrl-C/SIGTERM checkpoint and exit 130. Every test runs the real command."""

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

import cli_process  # tests/cli_process.py: the command in a child forked from a pre-imported interpreter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = ["plots=false", "threads=1", "--no-progress"]


def _env():
    return dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")


def fk(*args, cwd, timeout=300):
    return cli_process.run(
        [sys.executable, "-m", "fedkernels", *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _one_error_line(p, *words):
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"fedkernels {p.args[3]}: error: "), p.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert "Traceback" not in p.stderr
    return lines[0]


def _config(run_dir):
    with open(os.path.join(run_dir, "config.yaml")) as f:
        return yaml.safe_load(f)


# ---- item 1: a preset runs what its name says, or asks -------------------------------------------
def test_preset_runs_its_own_method_and_method_picks_another(tmp_path):
    args = ["run", "--preset", "kuramoto-digits", "rounds=1", "train.epochs=1", "--quiet", *QUICK]
    p = fk(*args, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    run_dir = json.loads(p.stdout.strip().splitlines()[-1])["run_dir"]
    assert os.path.basename(run_dir).startswith("kuramoto-digits-kuramoto-S0.5-s0-")
    cfg = _config(tmp_path / run_dir)
    assert cfg["algorithm"] == {"name": "kuramoto", "options": {"mode": "S", "kappa0": 0.5}}
    assert cfg["preset"] == "kuramoto-digits" and cfg["method"] == "kuramoto-S0.5"
    # --method LABEL, and algorithm.name=LABEL alike
    for pick in (["--method", "kuramoto-C"], ["algorithm.name=kuramoto-C"]):
        p = fk(*args, *pick, cwd=tmp_path)
        assert p.returncode == 0, p.stderr[-2000:]
        cfg = _config(tmp_path / json.loads(p.stdout.strip().splitlines()[-1])["run_dir"])
        assert cfg["algorithm"]["options"]["mode"] == "C" and cfg["method"] == "kuramoto-C"


def test_demo_preset_runs_its_default_method_where_run_puts_runs(tmp_path):
    """A preset may carry a default method (demo: fedavg); its run directory is the documented
    runs/<preset>-<method>-s<seed>-<hash>, like any other run's."""
    digits = ["data.name=digits", "data.train_subset=null", "data.test_subset=null", "model.name=digit_cnn"]
    p = fk("run", "--preset", "demo", *digits, "rounds=1", "--quiet", *QUICK, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    run_dir = json.loads(p.stdout.strip().splitlines()[-1])["run_dir"]
    assert os.path.dirname(run_dir) == "runs" and os.path.basename(run_dir).startswith("demo-fedavg-s0-"), run_dir
    assert _config(tmp_path / run_dir)["algorithm"]["name"] == "fedavg"
    _one_error_line(
        fk("run", "--preset", "kuramoto-digits", "--method", "kuramoto-S05", cwd=tmp_path),
        "kuramoto-S05",
        "did you mean 'kuramoto-S0.5'",
    )


def test_make_demo_separates_runs_from_the_comparison_and_says_what_next(tmp_path):
    p = cli_process.run(
        [sys.executable, "-m", "fedkernels.sim.demo", "--fedavg-only", "--rounds", "2"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    (out,) = os.listdir(tmp_path / "runs")
    assert out.startswith("demo-") and sorted(os.listdir(tmp_path / "runs" / out)) == ["compare", "runs"]
    assert os.listdir(tmp_path / "runs" / out / "runs") == ["fedavg-s0"]  # no compare file among the runs
    assert (tmp_path / "runs" / out / "runs" / "fedavg-s0" / "metrics.jsonl").exists()
    cmp = sorted(os.listdir(tmp_path / "runs" / out / "compare"))
    assert {"compare.json", "compare.md", "compare.csv", "compare.png"} <= set(cmp), cmp
    lines = p.stdout.splitlines()
    assert f"outputs in runs/{out}/:" in lines
    nxt = lines[lines.index("next:") + 1].split()
    exe = nxt[0] if nxt[1] == "run" else " ".join(nxt[:3])
    assert os.path.isfile(os.path.join(tmp_path, nxt[0])) and "run --preset" in " ".join(nxt), nxt
    assert exe in (os.path.join(os.path.dirname(sys.executable), "fedkernels"), f"{sys.executable} -m fedkernels")


# ---- item 2: never overwrite ---------------------------------------------------------------------------
def test_unique_run_directories_and_no_silent_overwrite(tmp_path):
    base = ["run", "--preset", "smoke", "rounds=1", "--quiet", *QUICK]
    a = fk(*base, cwd=tmp_path)
    b = fk(*base, "train.lr=0.05", cwd=tmp_path)
    assert a.returncode == b.returncode == 0, (a.stderr, b.stderr)
    da, db = (json.loads(p.stdout.strip().splitlines()[-1])["run_dir"] for p in (a, b))
    assert da != db and (tmp_path / da).is_dir() and (tmp_path / db).is_dir()  # a change of lr: a new directory
    assert os.path.basename(da).startswith("smoke-fedavg-s0-")
    # --name: the same directory for a different config is refused, --overwrite replaces it
    assert fk(*base, "--name", "mine", cwd=tmp_path).returncode == 0
    before = open(tmp_path / "runs" / "mine" / "metrics.jsonl").read()
    _one_error_line(
        fk(*base, "--name", "mine", "train.lr=0.05", cwd=tmp_path),
        "runs/mine",
        "different config",
        "train.lr",
        "--overwrite",
    )
    assert open(tmp_path / "runs" / "mine" / "metrics.jsonl").read() == before
    assert _config(tmp_path / "runs" / "mine")["train"]["lr"] == 0.1
    p = fk(*base, "--name", "mine", "train.lr=0.05", "--overwrite", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert _config(tmp_path / "runs" / "mine")["train"]["lr"] == 0.05
    # the same config again may reuse its directory (it computes the same thing)
    assert fk(*base, "--name", "mine", "train.lr=0.05", cwd=tmp_path).returncode == 0


# ---- item 5: one line, exit 2, nothing written ----------------------------------------------------
@pytest.mark.parametrize(
    "override,words",
    [
        ("rounds=abc", ["rounds", "'abc'", "integer"]),
        ("num_clients=abc", ["num_clients", "integer"]),
        ("rounds=2.5", ["rounds", "2.5", "integer"]),
        ("seed=abc", ["seed", "integer"]),
        ("train.lr=abc", ["train.lr", "'abc'", "number"]),
        ("algorithm.options.weighting=1", ["algorithm.options.weighting", "string"]),
        ("algorithm.options.weightin=uniform", ["algorithm.options.weightin", "did you mean 'weighting'"]),
        ("data.options.foo=1", ["data.options.foo", "unknown option"]),
        ("partition.options.alpa=0.1", ["partition.options.alpa", "did you mean 'alpha'"]),
        ("model.options.hiden=[8]", ["model.options.hiden", "did you mean 'hidden'"]),
        ("roudns=3", ["roudns", "did you mean 'rounds'"]),
        ("algorithm.name=fedav", ["fedav", "did you mean 'fedavg'"]),
    ],
)
def test_bad_overrides_are_one_line_before_anything_is_written(tmp_path, override, words):
    _one_error_line(fk("run", "--preset", "smoke", override, cwd=tmp_path), *words)
    assert not (tmp_path / "runs").exists()


def test_kuramoto_option_typo_is_one_line(tmp_path):
    _one_error_line(
        fk("run", "--preset", "kuramoto-digits", "algorithm.options.kapa0=1", cwd=tmp_path),
        "algorithm.options.kapa0",
        "did you mean 'kappa0'",
    )


def test_resume_errors_have_the_usual_prefix(tmp_path):
    _one_error_line(fk("run", "--resume", str(tmp_path / "nowhere"), cwd=tmp_path), "--resume", "config.yaml")
    _one_error_line(fk("run", "--resume", str(tmp_path), "--preset", "smoke", cwd=tmp_path), "--resume")


def test_presets_into_a_closed_pipe(tmp_path):
    p = subprocess.run(
        f"{sys.executable} -m fedkernels presets | head -1",
        shell=True,
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.stdout.strip() == "smoke"
    assert "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, p.stderr


# ---- item 13: every option has help ----------------------------------------------------------------
def test_every_cli_option_has_help():
    import argparse

    from fedkernels.sim.cli import build_parser

    missing = []

    def walk(parser, where):
        for act in parser._actions:
            if isinstance(act, argparse._SubParsersAction):
                for choice in act._choices_actions:
                    if not choice.help:
                        missing.append(f"{where} {choice.dest}")
                for name, sub in act.choices.items():
                    walk(sub, f"{where} {name}")
            elif not isinstance(act, argparse._HelpAction) and not act.help:
                missing.append(f"{where} {'/'.join(act.option_strings) or act.dest}")

    walk(build_parser(), "fedkernels")
    assert not missing, missing
    out = cli_process.run(
        [sys.executable, "-m", "fedkernels", "run", "--help"], env=_env(), capture_output=True, text=True, timeout=60
    ).stdout
    assert "--method" in out and "--overwrite" in out


# ---- item 7: progress outside a terminal -------------------------------------------------------------
def test_start_line_and_one_line_per_round_with_eta(tmp_path):
    p = fk("run", "--preset", "smoke", "rounds=3", "eval_every=2", *QUICK, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert (
        lines[0].startswith("fedkernels run: preset smoke, method fedavg")
        and "outputs: runs/smoke-fedavg-s0-" in lines[0]
    )
    rounds = [x for x in lines if x.startswith("round ")]
    assert [x.split()[1] for x in rounds] == ["1/3", "2/3", "3/3"] and all("ETA" in x for x in rounds)
    assert "acc" not in rounds[0] and "acc" in rounds[1]
    # provenance (sim/provenance.py) and a timestamped run.log
    run_dir = tmp_path / lines[0].split("outputs: ")[1]
    prov = json.loads((run_dir / "provenance.json").read_text())
    assert prov["status"] == "completed" and prov["rounds_completed"] == 3 and "end_time" in prov
    log = (run_dir / "run.log").read_text().splitlines()
    assert log[0].split(" ", 1)[1].startswith("fedkernels run: preset smoke") and log[0][:4].isdigit()
    assert sum(x.split(" ", 1)[1].startswith("round ") for x in log) == 3 and log[-1].endswith(
        "end: completed after round 3"
    )


# ---- item 4: SIGINT / SIGTERM -----------------------------------------------------------------------
def _final(run_dir):
    return torch.load(os.path.join(run_dir, "final_model.pt"), weights_only=True)["flat"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_checkpoints_exits_130_and_resume_is_bit_identical(tmp_path, sig):
    args = ["run", "--preset", "smoke", "rounds=60", "data.train_subset=400", "client_loss=none", *QUICK]
    p = subprocess.Popen(
        [sys.executable, "-m", "fedkernels", *args, "--name", "cut"],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = tmp_path / "runs" / "cut" / "metrics.jsonl"
    t0 = time.time()
    while not (metrics.exists() and metrics.read_text().strip()):
        assert p.poll() is None and time.time() - t0 < 240, "the run ended before it could be interrupted"
        time.sleep(0.05)
    p.send_signal(sig)
    out, err = p.communicate(timeout=240)
    assert p.returncode == 130, (p.returncode, err[-2000:])
    assert "Traceback" not in err
    last = [x for x in err.splitlines() if x.strip()][-1]
    n = int(last.split("interrupted after round ")[1].split(":")[0])
    assert 1 <= n < 60, last  # 60 rounds: the run cannot finish before the signal is handled
    assert f"checkpoint at round {n}; continue with `fedkernels run --resume runs/cut`" in last
    assert (tmp_path / "runs" / "cut" / "checkpoints" / f"ckpt_round_{n:06d}.pt").exists()
    assert json.loads((tmp_path / "runs" / "cut" / "provenance.json").read_text())["status"] == "interrupted"
    r = fk("run", "--resume", "runs/cut", *QUICK[2:], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    ref = fk(*args, "--name", "ref", cwd=tmp_path)
    assert ref.returncode == 0, ref.stderr
    assert torch.equal(_final(tmp_path / "runs" / "cut"), _final(tmp_path / "runs" / "ref"))


def test_interrupt_during_plotting_leaves_no_traceback(tmp_path):
    code = (
        "import os, signal, sys\n"
        "from fedkernels.sim import report\n"
        "def plot(self, *a, **k):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"  # the first Ctrl-C: finish up ...
        "    os.kill(os.getpid(), signal.SIGINT)\n"  # ... the second: abandon (inside the plot)
        "    raise AssertionError('not interrupted')\n"
        "report.RunWriter.plot = plot\n"
        "from fedkernels.sim.cli import main\n"
        "sys.exit(main(['run', '--preset', 'smoke', 'rounds=1', 'threads=1', '--no-progress']))\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240
    )
    # after the last round the first Ctrl-C lets the outputs finish, the second skips the figures: the
    # run is complete (its status too), so it exits 0
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    assert "Traceback" not in p.stderr and "AssertionError" not in p.stderr, p.stderr
    assert "SIGINT again: abandoning the figures; the run is complete" in p.stderr
    assert "interrupted while plotting" in p.stderr
    prov = glob.glob(os.path.join(str(tmp_path), "runs", "*", "provenance.json"))
    with open(prov[0]) as f:
        assert len(prov) == 1 and json.load(f)["status"] == "completed"


def test_run_writes_the_partition_report(tmp_path):
    r = fk("run", "--preset", "smoke", "rounds=1", "plots=false", "--no-progress", "--name", "part", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    info = json.loads((tmp_path / "runs" / "part" / "partition.json").read_text())
    assert len(info["sizes"]) == 4 and sum(info["sizes"]) > 0
    assert (tmp_path / "runs" / "part" / "partition.txt").exists()


def test_signal_stops_compare_with_one_line_and_no_later_run(tmp_path):
    """SIGTERM during `compare`: the running run checkpoints and says so, compare says where the finished
    runs are, exit 130, no traceback, and no later run starts."""
    args = [
        "compare",
        "--preset",
        "smoke",
        "--methods",
        "fedavg,fedprox:mu=0.1",
        "--seeds",
        "0,1",
        "--rounds",
        "400",
        "--out",
        "cmp",
        "data.train_subset=400",
        "client_loss=none",
        *QUICK,
    ]
    p = subprocess.Popen(
        [sys.executable, "-m", "fedkernels", *args],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = tmp_path / "cmp" / "fedavg-s0" / "metrics.jsonl"
    t0 = time.time()
    while not (metrics.exists() and metrics.read_text().strip()):
        assert p.poll() is None and time.time() - t0 < 240, "the compare ended before it could be interrupted"
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=240)
    assert p.returncode == 130, (p.returncode, err[-2000:])
    assert "Traceback" not in err
    lines = [x for x in err.splitlines() if x.strip()]
    assert "interrupted after round" in lines[-2] and "fedavg-s0" in lines[-2], lines[-3:]
    assert lines[-1].startswith("fedkernels compare: interrupted;"), lines[-1]
    assert sorted(os.listdir(tmp_path / "cmp")) == ["fedavg-s0"]
