"""The package ships py.typed: its public surface is fully annotated and type-checks.

``python -m mypy`` runs over the modules listed in pyproject's ``[tool.mypy] files`` (ops, flat,
reference, optim, errors, the package root, the Aggregator/ClientRule base) with
``--disallow-untyped-defs --disallow-incomplete-defs``, plus ``tests/typing_usage.py``: user code
that pins the exact types of the public results (``assert_type``) and is then run for real.
"""

import importlib.util
import math
import os
import subprocess
import sys
import tempfile

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USAGE = os.path.join("tests", "typing_usage.py")

# the modules that must be fully annotated: the config may grow, never drop one of these
REQUIRED = {
    "fedkernels/__init__.py",
    "fedkernels/_native.py",
    "fedkernels/errors.py",
    "fedkernels/flat.py",
    "fedkernels/optim.py",
    "fedkernels/reference.py",
    "fedkernels/ops",
    "fedkernels/algorithms/base.py",
}


def _mypy_config():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["mypy"]


def test_mypy_config_covers_the_public_modules():
    cfg = _mypy_config()
    assert REQUIRED <= set(cfg["files"]), sorted(REQUIRED - set(cfg["files"]))
    assert cfg["disallow_untyped_defs"] is True and cfg["disallow_incomplete_defs"] is True
    for f in cfg["files"]:
        assert os.path.exists(os.path.join(ROOT, f)), f


def test_public_api_type_checks():
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (it is in the `test` extra: pip install -e '.[test]' / make)")
    files = list(_mypy_config()["files"]) + [USAGE]
    cache = os.path.join(tempfile.gettempdir(), f"fedkernels-mypy-cache-{os.getuid()}")
    cmd = [
        sys.executable,
        "-m",
        "mypy",
        "--config-file",
        "pyproject.toml",
        "--cache-dir",
        cache,
        "--disallow-untyped-defs",
        "--disallow-incomplete-defs",
        "--no-color-output",
        "--no-error-summary",
        *files,
    ]
    r = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
        env=dict(os.environ, PYTHONPATH=ROOT, MYPY_FORCE_COLOR="0"),
    )
    assert r.returncode == 0 and not r.stdout.strip(), f"mypy found errors:\n{r.stdout}{r.stderr}"


def test_typing_usage_runs():
    # what mypy accepted in typing_usage.py must also work
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    try:
        import typing_usage
        from fedkernels.algorithms import base

        try:
            params, total = typing_usage.run()
        finally:
            base._REGISTRY.pop(typing_usage.NAME, None)
    finally:
        sys.path.remove(os.path.join(ROOT, "tests"))
    assert params.dim() == 1 and params.isfinite().all()
    assert math.isfinite(total)
