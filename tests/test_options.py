"""sim.options: algorithm names and options checked against the registry and constructor signatures."""

import math

import pytest

from fedkernels import algorithms
from fedkernels.sim import presets
from fedkernels.sim.options import algorithm_class, check_algorithm, check_method, normalize_options, signature_params


def _one_line_error(fn, *args, **kw) -> str:
    with pytest.raises(ValueError) as ei:
        fn(*args, **kw)
    msg = str(ei.value)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("name", algorithms.available())
def test_every_registered_algorithm_accepts_its_defaults(name):
    required = {"local_gc_only": {"lam": 0.5}}  # its lam has no default
    check_algorithm(name, required.get(name, {}))
    params = signature_params(algorithm_class(name))
    # the base class keywords are reached through **kw
    assert "on_bad_update" in params and "server_lr" in params


def test_valid_options_pass():
    check_algorithm("kuramoto", {"mode": "S", "kappa0": 0.5, "guard": False})
    check_algorithm("fedprox", {"mu": 0.001, "prox": "loss"})
    check_algorithm("fedpgvc", {"n_ctrl": "all", "mode": "code"})
    check_algorithm("fedpgvc", {"n_ctrl": 3})
    check_algorithm("gcfed", {"global_layers": ["fc.weight"]})
    check_algorithm("FedAvg", {"server_lr": 1})  # int for a float, case-insensitive name
    check_algorithm("kuramoto", {"kappa0": None})  # Optional[float]


def test_unknown_algorithm_suggests_close_name():
    msg = _one_line_error(check_algorithm, "fedavgg", {})
    assert "algorithm.name='fedavgg'" in msg and "did you mean 'fedavg'" in msg


def test_unknown_option_names_key_value_and_suggestion():
    msg = _one_line_error(check_algorithm, "kuramoto", {"kapa0": 1})
    assert msg.startswith("algorithm.options.kapa0=1: unknown option of kuramoto")
    assert "did you mean 'kappa0'" in msg and "clip_delta" in msg


@pytest.mark.parametrize(
    "name,opts,expect",
    [
        ("kuramoto", {"kappa0": "abc"}, "algorithm.options.kappa0='abc': kuramoto expects a number or null"),
        ("fedaware", {"max_iter": 2.5}, "algorithm.options.max_iter=2.5: fedaware expects an integer"),
        ("fedaware", {"normalize": "yes"}, "algorithm.options.normalize='yes': fedaware expects a bool"),
        ("fedaware", {"max_iter": True}, "algorithm.options.max_iter=True: fedaware expects an integer"),
        ("fedpgvc", {"n_ctrl": 1.5}, "algorithm.options.n_ctrl=1.5: fedpgvc expects an integer or a string"),
        ("fedavg", {"server_lr": "x"}, "algorithm.options.server_lr='x': fedavg expects a number"),
        ("fedprox", {"prox": 3}, "algorithm.options.prox=3: fedprox expects a string"),
        ("gcfed", {"global_layers": "fc"}, "algorithm.options.global_layers='fc': gcfed expects a list"),
    ],
)
def test_wrong_type_is_one_line(name, opts, expect):
    assert _one_line_error(check_algorithm, name, opts).startswith(expect)


def test_constructor_checks_run_too():
    # choices and ranges are the constructor's own checks: they are reported now, on one line
    msg = _one_line_error(check_algorithm, "kuramoto", {"mode": "Q"})
    assert msg.startswith("algorithm.options (kuramoto): mode must be one of") and "'Q'" in msg
    msg = _one_line_error(check_algorithm, "fedprox", {"mu": -1})
    assert "mu must be a finite number >= 0" in msg
    check_algorithm("kuramoto", {"mode": "Q"}, construct=False)  # signature check alone passes


def test_number_text_is_accepted_for_floats_and_normalized():
    # YAML 1.1 reads 1e-3 as a string; a float option takes it, normalize_options converts it
    check_algorithm("fedprox", {"mu": "1e-3"})
    assert normalize_options("fedprox", {"mu": "1e-3", "prox": "grad"}) == {"mu": 1e-3, "prox": "grad"}
    assert math.isinf(normalize_options("fedecado", {"max_extrap_ratio": "inf"})["max_extrap_ratio"])
    # but not for an int option, and not for text that is no number
    _one_line_error(check_algorithm, "fedaware", {"max_iter": "10"})
    _one_line_error(check_algorithm, "fedprox", {"mu": "small"})
    # a str member of a Union keeps the text
    assert normalize_options("fedpgvc", {"n_ctrl": "all"}) == {"n_ctrl": "all"}


def test_missing_required_option_is_reported():
    msg = _one_line_error(check_algorithm, "local_gc_only", {})
    assert msg.startswith("algorithm.options (local_gc_only): lam must lie in [0, 1]")


def test_options_must_be_a_mapping():
    msg = _one_line_error(check_algorithm, "fedavg", ["server_lr"])
    assert "expected a mapping" in msg


def test_check_method_accepts_preset_labels_names_and_inline_options():
    known = presets.variants("kuramoto-fmnist")
    assert check_method("kuramoto-S0.5", known) == (
        "kuramoto-S0.5",
        {"name": "kuramoto", "options": {"mode": "S", "kappa0": 0.5}},
    )
    assert check_method("fedprox:mu=0.1", known) == ("fedprox:mu=0.1", {"name": "fedprox", "options": {"mu": 0.1}})
    label, var = check_method("fedavg", {})
    assert label == "fedavg" and var == {"name": "fedavg", "options": {}}


def test_check_method_errors_name_the_method():
    known = presets.variants("kuramoto-fmnist")
    msg = _one_line_error(check_method, "kuramoto-S0.7", known)
    assert msg.startswith("method 'kuramoto-S0.7': not a preset method or registered algorithm")
    assert "did you mean 'kuramoto-S0.5'" in msg
    msg = _one_line_error(check_method, "kuramoto:kapa0=1", known)
    assert msg.startswith("method 'kuramoto:kapa0=1': option kapa0=1: unknown option of kuramoto")
    msg = _one_line_error(check_method, "fedprox:mu", known)
    assert "key=value" in msg


def _numeric_options(cls):
    import typing
    from fedkernels.algorithms.signature import is_real as _is_real

    for k, (ann, default) in signature_params(cls).items():
        args = typing.get_args(ann) if typing.get_origin(ann) is typing.Union else (ann,)
        if _is_real(default) or int in args or float in args:
            yield k


@pytest.mark.parametrize("name", algorithms.available())
def test_every_numeric_option_is_range_checked(name):
    """No numeric option takes -1 or NaN silently (the range comes from
    sim.options.OPTION_RANGES or from the aggregator's own constructor check)."""
    required = {"local_gc_only": {"lam": 0.5}}
    keys = list(_numeric_options(algorithm_class(name)))
    assert "server_lr" in keys
    for k in keys:
        for bad in (-1, float("nan")):
            _one_line_error(check_algorithm, name, {**required.get(name, {}), k: bad})


@pytest.mark.parametrize(
    "name,opts,expect",
    [
        ("fedavg", {"server_lr": 0}, "algorithm.options.server_lr=0: fedavg expects a number > 0"),
        ("gcfed", {"momentum": 1.0}, "algorithm.options.momentum=1.0: gcfed expects a number in [0, 1)"),
        ("fedaware", {"max_iter": 0}, "algorithm.options.max_iter=0: fedaware expects a number >= 1"),
        ("fedpgvc", {"tau": "-1e-3"}, "algorithm.options.tau='-1e-3': fedpgvc expects a number > 0"),
    ],
)
def test_out_of_range_option_is_one_line(name, opts, expect):
    assert _one_line_error(check_algorithm, name, opts) == expect
    # the edge of each range is accepted (n_ctrl=0 is FedPGVC's neutral setting)
    check_algorithm("fedavg", {"server_lr": 1e-9})
    check_algorithm("gcfed", {"momentum": 0.0})
    check_algorithm("fedpgvc", {"n_ctrl": 0, "lam": 0.0})


_COUNT_RUN = r"""
import collections, json, os, sys
import fedkernels.algorithms.base as base
import fedkernels.sim.checks as checks
import fedkernels.sim.config as config
from fedkernels.sim.cli import main

n = collections.Counter()


def counted(label, f):
    def g(*a, **k):
        n[label] += 1
        return f(*a, **k)

    return g


config.RunConfig.validate = counted("config", config.RunConfig.validate)
import fedkernels.sim.options as options

options.check_algorithm = checks.check_algorithm = counted("options", options.check_algorithm)
base.check_options = counted("signature", base.check_options)
base.build = counted("build", base.build)
import fedkernels.algorithms as algorithms

algorithms.build = base.build
os.chdir(sys.argv[1])
rc = main(["run", "--preset", "smoke", "rounds=1", "plots=false", "threads=1", "--no-progress", "--quiet", "--name", "c"])
print(json.dumps(dict(n, rc=rc)))
"""


def test_a_cli_run_validates_its_config_and_options_once(tmp_path):
    """``fedkernels run --preset smoke``: the config (the preset with its method and overrides) is validated
    once, the algorithm options once (checks.check_algorithm, which constructs the method to run its own
    checks), and each construction checks the options against the signature once (build, not again in
    Aggregator.__new__); the run's own aggregator is the second build. (Before: 3, 3, 4 and 8.)"""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1")
    p = subprocess.run(
        [sys.executable, "-c", _COUNT_RUN, str(tmp_path)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    n = json.loads(p.stdout.strip().splitlines()[-1])
    assert n == {"config": 1, "options": 1, "build": 2, "signature": 2, "rc": 0}, n
