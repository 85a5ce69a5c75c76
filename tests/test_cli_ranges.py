"""Every numeric config key and algorithm option is range-checked before anything runs: one line naming the key, the value and the range, exit 2, nothing written."""

import dataclasses
import os
import sys
import typing

import pytest

from fedkernels.sim.cli import main
from fedkernels.sim.config import RANGES, RunConfig

import cli_process  # tests/cli_process.py: the command in a child forked from a pre-imported interpreter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _numeric_keys(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        args = typing.get_args(tp) if typing.get_origin(tp) is typing.Union else (tp,)
        if dataclasses.is_dataclass(tp):
            yield from _numeric_keys(tp, prefix + f.name + ".")
        elif set(args) & {int, float} and set(args) <= {int, float, type(None)}:  # not "auto"|N keys
            yield prefix + f.name


def test_every_numeric_config_key_has_a_range():
    keys = set(_numeric_keys(RunConfig))
    assert keys - set(RANGES) == set(), "numeric config keys without a range in config.RANGES"
    assert set(RANGES) <= keys


@pytest.mark.parametrize(
    "override,expect",
    [
        ("train.lr=-1", "train.lr must be > 0, got -1.0"),
        ("train.lr=.nan", "train.lr must be > 0, got nan"),
        ("train.momentum=1", "train.momentum must be in [0, 1), got 1.0"),
        ("train.weight_decay=-0.1", "train.weight_decay must be >= 0, got -0.1"),
        ("train.batch_size=0", "train.batch_size must be >= 1, got 0"),
        ("train.steps=0", "train.steps must be >= 1, got 0"),
        ("train.epochs=0", "train.epochs must be >= 1, got 0"),
        ("train.lr_gamma=0", "train.lr_gamma must be in (0, 1], got 0.0"),
        ("train.grad_clip=0", "train.grad_clip must be > 0, got 0.0"),
        ("participation=1.5", "participation must be in (0, 1], got 1.5"),
        ("rounds=0", "rounds must be >= 1, got 0"),
        ("num_clients=0", "num_clients must be >= 1, got 0"),
        ("clients_per_round=0", "clients_per_round must be >= 1, got 0"),
        ("eval_every=0", "eval_every must be >= 1, got 0"),
        ("target_accuracy=85", "target_accuracy must be in (0, 1], got 85.0"),
        ("checkpoint_every=-1", "checkpoint_every must be >= 0, got -1"),
        ("data.train_subset=0", "data.train_subset must be >= 1, got 0"),
        ("seed=-3", "seed must be >= 0, got -3"),
        ("algorithm.options.server_lr=0", "algorithm.options.server_lr=0: fedavg expects a number > 0"),
    ],
)
def test_out_of_range_is_one_line_before_anything_runs(tmp_path, capsys, override, expect):
    out = tmp_path / "runs"
    assert main(["run", "--preset", "smoke", override, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"fedkernels run: error: {'invalid config: ' if '.options.' not in override else ''}{expect}", err
    assert not out.exists()


@pytest.mark.parametrize(
    "args,expect",
    [
        (["train.lr=-1"], "fedkernels run: error: invalid config: train.lr must be > 0, got -1.0"),
        (
            ["--method", "kuramoto-C", "algorithm.options.server_lr=-2"],
            "fedkernels run: error: algorithm.options.server_lr=-2: kuramoto expects a number > 0",
        ),
    ],
)
def test_range_errors_through_the_real_command(tmp_path, args, expect):
    p = cli_process.run(
        [sys.executable, "-m", "fedkernels", "run", "--preset", "kuramoto-digits", *args],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith(expect), lines
    assert os.listdir(tmp_path) == []  # nothing written


def test_an_option_that_needs_epochs_with_fixed_steps_is_refused_up_front(tmp_path, capsys):
    """FedECADO's time_unit='epoch' counts client time in epochs: with train.steps set there are no
    epochs to count, so the run is refused before round 1: one line, exit 2, nothing written."""
    out = tmp_path / "runs"
    args = ["run", "--preset", "fedecado-synthetic", "rounds=1", "--out", str(out)]
    assert main(args + ["train.steps=3", "algorithm.options.time_unit=epoch"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "fedkernels run: error: train.steps=3 with algorithm fedecado: FedECADO time_unit='epoch' "
        "counts client time in epochs: unset train.steps or use time_unit=lr_sum"
    ), err
    assert not out.exists()
