"""Runs a researcher can trust, through the real command (``python -m fedkernels`` children): extending
rounds never changes the rounds already trained, the thread count is part of a run's identity, a run
never silently replaces another, numbers in every float()/YAML 1.2 form, one line for every error a
user or the environment causes, options that do not apply refused, the failure cause in the run
folder, stop messages that say what happens, and a compare that checks first, resumes and keeps its
best tables. Faults that a test cannot cause for real (a full disk, a read-only file system, a signal
at an exact point) are injected into the child before ``fedkernels.sim.cli.main`` runs."""

import json
import os
import sys
import textwrap

import torch
from test_cli_resume import _final, _tree  # the run folder's files with their times; final_model.pt's vector

import cli_process  # tests/cli_process.py: the command in a child forked from a pre-imported interpreter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = ["plots=false", "--no-progress"]
SMALL = ["--preset", "smoke", "data.train_subset=400", "client_loss=none", "threads=1", *QUICK]


def _env():
    return dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")


def fk(*args, cwd, inject: str = ""):
    """``fedkernels ARGS`` in a child; ``inject``: Python run in the child first (a patched fault)."""
    if inject:
        code = (
            textwrap.dedent(inject)
            + f"\nimport sys\nfrom fedkernels.sim.cli import main\nsys.exit(main({list(args)!r}))\n"
        )
        cmd = [sys.executable, "-c", code]
    else:
        cmd = [sys.executable, "-m", "fedkernels", *args]
    return cli_process.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600)


def _prov(run_dir):
    with open(os.path.join(run_dir, "provenance.json")) as f:
        return json.load(f)


def _error_lines(p):
    return [ln for ln in p.stderr.splitlines() if "error" in ln.lower() or "Traceback" in ln]


def _one_error(p, code):
    assert p.returncode == code, (p.returncode, p.stderr[-3000:])
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = _error_lines(p)
    assert len(lines) == 1, p.stderr
    return lines[0]


# ---- 1. extending rounds keeps the past -----------------------------------------------------------------
def test_cosine_extension_is_refused_and_a_step_extension_equals_a_straight_run(tmp_path):
    p = fk("run", *SMALL, "rounds=3", "train.lr_schedule=cosine", "checkpoint_every=1", "--name", "cos", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    before = _tree(tmp_path / "runs" / "cos")
    r = fk("run", "--resume", "runs/cos", "rounds=5", "--no-progress", cwd=tmp_path)
    line = _one_error(r, 2)
    assert "lr_schedule=cosine" in line and "rounds already trained" in line and "rounds=5" in line
    assert _tree(tmp_path / "runs" / "cos") == before  # nothing touched

    step = ["train.lr_schedule=step", "train.lr_gamma=0.5", "checkpoint_every=1"]
    assert fk("run", *SMALL, "rounds=2", *step, "--name", "st", cwd=tmp_path).returncode == 0
    part = os.stat(tmp_path / "runs" / "st" / "partition.json").st_mtime_ns
    r = fk("run", "--resume", "runs/st", "rounds=4", "--no-progress", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert os.stat(tmp_path / "runs" / "st" / "partition.json").st_mtime_ns != part  # its report names the rounds
    with open(tmp_path / "runs" / "st" / "summary.json") as f:
        s = json.load(f)  # the wall time covers both sessions, as the other totals do
    assert s["wall_s"] > s["wall_s_session"] > 0
    assert (
        "note: rounds=4 (was 2): rounds 3-4 will be trained; rounds 1-2 keep their values (the step lr "
        "schedule does not depend on rounds); the metrics and model equal an uninterrupted 4-round run"
    ) in r.stderr
    assert fk("run", *SMALL, "rounds=4", *step, "--name", "st4", cwd=tmp_path).returncode == 0
    assert torch.equal(_final(tmp_path / "runs" / "st"), _final(tmp_path / "runs" / "st4"))


# ---- 2, 3, 4. the thread count is part of the identity; no silent replacement; chosen for the load ----
def test_threads_are_part_of_the_run_and_a_finished_run_is_never_replaced(tmp_path):
    base = [a for a in SMALL if a != "threads=1"] + ["rounds=1", "--quiet"]
    dirs = []
    for t in ("1", "2", "1"):
        p = fk("run", *base, f"threads={t}", cwd=tmp_path)
        assert p.returncode == 0, p.stderr[-2000:]
        dirs.append(json.loads(p.stdout.strip().splitlines()[-1])["run_dir"])
    assert dirs[0] != dirs[1] and dirs[0] == dirs[2]  # another thread count: another run folder
    assert _prov(tmp_path / dirs[1])["threads"]["per_process"] == 2

    assert fk("run", *base, "threads=1", "--name", "x", cwd=tmp_path).returncode == 0
    before = _tree(tmp_path / "runs" / "x")
    p = fk("run", *base, "threads=2", "--name", "x", cwd=tmp_path)  # other results into a finished run's folder
    line = _one_error(p, 2)
    assert "threads" in line and "--overwrite" in line
    assert _tree(tmp_path / "runs" / "x") == before

    p = fk("run", *[a for a in base if a != "--quiet"], "--name", "auto", cwd=tmp_path)  # by default: for the load
    assert p.returncode == 0, p.stderr[-2000:]
    with open(tmp_path / "runs" / "auto" / "config.yaml") as f:
        assert "threads: null" not in f.read()
    how = _prov(tmp_path / "runs" / "auto")["threads"]["how"]
    assert "load" in how and "threads: " in p.stdout


# ---- 5. numbers as people write them -------------------------------------------------------------------
def test_numbers_in_float_and_yaml_1_2_forms(tmp_path):
    (tmp_path / "c.yaml").write_text(
        textwrap.dedent("""\
        rounds: 1e0
        num_clients: 4
        threads: 1
        plots: false
        client_loss: none
        data: {name: digits, train_subset: 4.0e2}
        model: {name: mlp, options: {hidden: [8]}}
        train: {lr: 5e-2, weight_decay: 1.0e-6}
        """)
    )
    p = fk(
        "run", "c.yaml", "train.momentum=1e-1", "eval_batch_size=1.0e3", "--name", "n", "--no-progress", cwd=tmp_path
    )
    assert p.returncode == 0, p.stderr[-2000:]
    import yaml

    with open(tmp_path / "runs" / "n" / "config.yaml") as f:
        c = yaml.safe_load(f)
    assert (c["rounds"], c["data"]["train_subset"], c["eval_batch_size"]) == (1, 400, 1000)
    assert (c["train"]["lr"], c["train"]["weight_decay"], c["train"]["momentum"]) == (0.05, 1e-6, 0.1)


# ---- 6, 8, 11. one line for what a user or the environment gets wrong ---------------------------------------
def test_one_line_errors_before_anything_runs(tmp_path):
    (tmp_path / "bad.yaml").write_text("rounds: 2\ntrain:\n  lr: [0.1\nseed: 1\n")
    line = _one_error(fk("run", "bad.yaml", cwd=tmp_path), 2)
    assert "bad.yaml" in line and "YAML syntax error at line 4" in line

    (tmp_path / "afile").write_text("x")
    line = _one_error(fk("run", *SMALL, "out_dir=afile", cwd=tmp_path), 2)
    assert "afile is a file" in line
    os.makedirs(tmp_path / "runs")
    (tmp_path / "runs" / "X").write_text("x")
    line = _one_error(fk("run", *SMALL, "--name", "X", cwd=tmp_path), 2)
    assert "runs/X is a file" in line

    ro = """
        import os
        real = os.statvfs
        class RO:
            f_flag = os.ST_RDONLY
        os.statvfs = lambda p: RO()
    """
    line = _one_error(fk("run", *SMALL, "--out", "/tmp/never-here", cwd=tmp_path, inject=ro), 1)
    assert "read-only file system" in line

    line = _one_error(fk("run", *SMALL, "rounds", cwd=tmp_path), 2)
    assert "'rounds'" in line and "rounds=VALUE" in line
    line = _one_error(fk("run", *SMALL, "partition.options.alpha=-1", cwd=tmp_path), 2)
    assert "partition.options.alpha=-1 does not apply to partition.scheme=iid" in line
    line = _one_error(fk("run", *SMALL, "train.lr_min=0.001", cwd=tmp_path), 2)
    assert "train.lr_min=0.001 does not apply to train.lr_schedule=constant" in line
    assert sorted(os.listdir(tmp_path / "runs")) == ["X"]  # nothing written by any of them


def test_a_full_disk_at_plotting_is_one_line_and_loses_nothing(tmp_path):
    full = """
        import errno
        from fedkernels.sim import report
        def plot_curves(*a, **k):
            raise OSError(errno.ENOSPC, "No space left on device")
        report.plot_curves = plot_curves
    """
    args = [a for a in SMALL if a != "plots=false"] + ["plots=true", "--name", "full"]
    p = fk("run", *args, cwd=tmp_path, inject=full)
    line = _one_error(p, 1)
    assert "No space left on device" in line and "curves.png" in line
    d = tmp_path / "runs" / "full"
    for f in ("summary.json", "metrics.jsonl", "final_model.pt", "config.yaml"):
        assert (d / f).exists(), f
    assert _prov(d)["status"] == "completed"


# ---- 9. the failure cause in the run folder ----------------------------------------------------------
def test_the_failure_cause_is_in_run_log_and_provenance(tmp_path):
    p = fk("run", *SMALL, "rounds=1", "train.lr=1e30", "--name", "nan", cwd=tmp_path)
    assert p.returncode == 1 and "every client was excluded" in p.stderr
    d = tmp_path / "runs" / "nan"
    assert _prov(d)["status"] == "failed" and "every client was excluded" in _prov(d)["error"]
    last = (d / "run.log").read_text().strip().splitlines()[-1]
    assert "end: failed after round 0: RunError: round 1: every client was excluded" in last


# ---- 10. stop messages that say what will happen and what did --------------------------------------------
def _kill(patch: str) -> str:
    return "import os, signal\nfrom fedkernels.sim import report, simulation\n" + textwrap.dedent(patch)


def test_a_signal_after_the_last_round_leaves_a_complete_run(tmp_path):
    patch = """
    real = report.RunFiles.on_end
    def on_end(self, sim, summary):
        os.kill(os.getpid(), signal.SIGTERM)
        real(self, sim, summary)
    report.RunFiles.on_end = on_end
    """
    p = fk("run", *SMALL, "--name", "t", cwd=tmp_path, inject=_kill(patch))
    assert p.returncode == 0, p.stderr[-2000:]
    assert "SIGTERM: all 2 rounds are done" in p.stderr and "the run is complete" in p.stderr
    assert "finishing round 3" not in p.stderr
    assert _prov(tmp_path / "runs" / "t")["status"] == "completed"


def test_a_signal_between_rounds_says_which_round_is_kept(tmp_path):
    patch = """
    real = report.RunFiles.on_round_end
    def on_round_end(self, sim, m):
        real(self, sim, m)
        if m["round"] == 1:
            os.kill(os.getpid(), signal.SIGINT)
    report.RunFiles.on_round_end = on_round_end
    """
    p = fk("run", *SMALL, "rounds=3", "--name", "b", cwd=tmp_path, inject=_kill(patch))
    assert p.returncode == 130, p.stderr[-2000:]
    assert "SIGINT: stopping after round 1, with its checkpoint" in p.stderr
    assert "finishing round 2" not in p.stderr and "interrupted after round 1: checkpoint at round 1" in p.stderr


def test_the_second_ctrl_c_is_acknowledged(tmp_path):
    patch = """
    real = simulation.Simulation.train_local
    def train_local(self, r, *a, **k):
        if r == 1:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, r, *a, **k)
    simulation.Simulation.train_local = train_local
    """
    p = fk("run", *SMALL, "rounds=3", "--name", "c", cwd=tmp_path, inject=_kill(patch))
    assert p.returncode == 130, p.stderr[-2000:]
    assert (
        "SIGINT: finishing round 2, then writing a checkpoint and stopping (again to abandon it and keep round 1)"
        in p.stderr
    )
    assert "SIGINT again: abandoning round 2; keeping round 1" in p.stderr
    assert "interrupted after round 1: checkpoint at round 1" in p.stderr
    assert _prov(tmp_path / "runs" / "c")["status"] == "interrupted"


# ---- 7. compare: checks first, resumes, keeps its best tables --------------------------------------------------
CMP = [
    "compare",
    "--preset",
    "smoke",
    "--methods",
    "fedavg,fedavgm",
    "data.train_subset=400",
    "client_loss=none",
    "threads=1",
    "--no-progress",
    "--out",
    "cmp",
]


def test_compare_checks_the_data_set_before_the_first_run(tmp_path):
    p = fk(
        "compare",
        "--preset",
        "smoke",
        "data.name=fmnist",
        f"data.root={tmp_path / 'none'}",
        "--out",
        "cmp",
        "--no-progress",
        cwd=tmp_path,
    )
    assert p.returncode == 2, p.stderr[-2000:]
    assert "Traceback" not in p.stderr and "[1/1]" not in p.stdout
    assert not os.path.exists(tmp_path / "cmp")


def test_compare_resumes_refuses_other_rounds_and_keeps_better_tables(tmp_path):
    stop = """
    import os, signal
    from fedkernels.sim import report
    real = report.RunFiles.on_round_end
    def on_round_end(self, sim, m):
        real(self, sim, m)
        if sim.cfg.algorithm.name == "fedavgm" and m["round"] == 1:
            os.kill(os.getpid(), signal.SIGINT)
    report.RunFiles.on_round_end = on_round_end
    """
    p = fk(*CMP, cwd=tmp_path, inject=stop)  # Ctrl-C in the second run
    assert p.returncode == 130, p.stderr[-2000:]
    p = fk(*CMP, cwd=tmp_path)  # the same command continues
    assert p.returncode == 0, p.stderr[-2000:]
    assert "fedavg (seed 0): finished earlier, reused" in p.stdout
    assert "fedavgm (seed 0) ... (resumed from its checkpoint)" in p.stdout
    tables = _tree(tmp_path / "cmp")

    p = fk(*CMP, "--rounds", "3", cwd=tmp_path)  # another config into the same folder
    line = _one_error(p, 2)
    assert "holds a run with another config (rounds)" in line and "--out" in line
    assert _tree(tmp_path / "cmp") == tables

    import shutil

    shutil.rmtree(tmp_path / "cmp" / "fedavgm-s0")
    fail = """
    from fedkernels.errors import RunError
    from fedkernels.sim import simulation
    def run_round(self, r):
        raise RunError("injected")
    simulation.Simulation.run_round = run_round
    """
    p = fk(*CMP, cwd=tmp_path, inject=fail)  # a worse compare: its tables are not written
    assert p.returncode == 1, p.stderr[-2000:]
    assert "earlier tables" in p.stdout
    after = _tree(tmp_path / "cmp")
    assert {k: v for k, v in after.items() if k.startswith("compare.")} == {
        k: v for k, v in tables.items() if k.startswith("compare.")
    }


def test_run_method_takes_what_compare_takes(tmp_path):
    p = fk("run", *SMALL, "rounds=1", "--method", "kuramoto:kappa0=0.5", "--name", "m", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    import yaml

    with open(tmp_path / "runs" / "m" / "config.yaml") as f:
        algo = yaml.safe_load(f)["algorithm"]
    assert algo == {"name": "kuramoto", "options": {"kappa0": 0.5}}


def test_plots_without_matplotlib_are_said(tmp_path):
    no_mpl = """
        import sys
        sys.modules["matplotlib"] = None
    """
    args = [a for a in SMALL if a != "plots=false"] + ["plots=true", "rounds=1", "--name", "np"]
    p = fk("run", *args, cwd=tmp_path, inject=no_mpl)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "plots=true but matplotlib is not installed: curves.png not written" in p.stdout + p.stderr


def test_a_full_disk_mid_run_is_one_line_with_its_cause_in_the_run_folder(tmp_path):
    full = """
        import errno
        from fedkernels.sim import checkpoint
        def save(path, state):
            raise OSError(errno.ENOSPC, "No space left on device", path)
        checkpoint.save = save
    """
    p = fk("run", *SMALL, "checkpoint_every=1", "--name", "disk", cwd=tmp_path, inject=full)
    line = _one_error(p, 1)
    assert "No space left on device: runs/disk/checkpoints/ckpt_round_000001.pt" in line
    prov = _prov(tmp_path / "runs" / "disk")
    assert prov["status"] == "failed" and "OSError" in prov["error"] and "No space left" in prov["error"]


def test_an_extension_redraws_the_figures_with_the_new_round_count(tmp_path):
    """partition.png's title names the rounds: after `--resume DIR rounds=4` it is the figure of a straight
    4-round run (bytes equal: the Agg PNG holds no time), not the 2-round one; curves.png is redrawn too."""
    args = [a for a in SMALL if a != "plots=false"] + [
        "plots=true",
        "train.lr_schedule=step",
        "checkpoint_every=1",
        "--name",
        "ext",
    ]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert fk("run", *args, "rounds=2", cwd=tmp_path / "a").returncode == 0
    run = tmp_path / "a" / "runs" / "ext"
    two = {f: (run / f).read_bytes() for f in ("partition.png", "curves.png")}
    r = fk("run", "--resume", "runs/ext", "rounds=4", "--no-progress", cwd=tmp_path / "a")
    assert r.returncode == 0, r.stderr[-2000:]
    assert fk("run", *args, "rounds=4", cwd=tmp_path / "b").returncode == 0
    straight = tmp_path / "b" / "runs" / "ext"
    assert (run / "partition.png").read_bytes() == (straight / "partition.png").read_bytes() != two["partition.png"]
    assert (run / "curves.png").read_bytes() != two["curves.png"]
