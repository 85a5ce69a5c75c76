"""Packaging: metadata, the sdist's contents, the torch-version check at import, lazy subpackages,
the CLI without the simulator extra. The full sdist -> wheel -> fresh venv smoke test is the CI step
`.ci/wheel_check.sh` (it compiles the extension and installs torch: minutes, not a unit test)."""

import glob
import os
import re
import subprocess
import sys
import tarfile

import pytest

import fedkernels
from fedkernels import _native

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pyproject():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _run(code, env_extra=None, cwd=ROOT):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def test_build_requirements_never_pull_a_torch():
    # an isolated build would resolve its own (on a plain index: CUDA) torch; a pin is the only exception
    reqs = _pyproject()["build-system"]["requires"]
    torch_reqs = [r for r in reqs if r.replace(" ", "").lower().startswith("torch")]
    assert all("==" in r for r in torch_reqs), reqs


def test_runtime_metadata():
    proj = _pyproject()["project"]
    deps = proj["dependencies"]
    assert "torch>=2.11,<2.15" in deps
    base = " ".join(deps).lower()
    for sim_only in ("pyyaml", "tqdm", "matplotlib", "scikit-learn"):
        assert sim_only not in base, f"{sim_only} is a base dependency; it belongs in the sim extra"
        assert any(r.startswith(sim_only) for r in proj["optional-dependencies"]["sim"]), sim_only
    assert proj["license"] == "MIT"  # SPDX expression, not {text = ...}
    assert proj["license-files"] == ["LICENSE"]
    with open(os.path.join(ROOT, "LICENSE")) as f:
        assert f.readline().strip() == "MIT License"
    assert "flower" in proj["optional-dependencies"]


def test_version_written_once():
    proj = _pyproject()
    assert "version" not in proj["project"] and "version" in proj["project"]["dynamic"]
    assert proj["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "fedkernels.__version__"}
    r = subprocess.run([sys.executable, "setup.py", "--version"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == fedkernels.__version__


def test_py_typed_is_packaged():
    assert os.path.isfile(os.path.join(os.path.dirname(fedkernels.__file__), "py.typed"))
    assert "py.typed" in _pyproject()["tool"]["setuptools"]["package-data"]["fedkernels"]


def test_setup_without_torch_says_how_to_build():
    code = (
        "import sys; sys.modules['torch'] = None; sys.argv = ['setup.py', '--version']; "
        "exec(compile(open('setup.py').read(), 'setup.py', 'exec'))"
    )
    r = _run(code)
    assert r.returncode != 0
    msg = r.stderr.strip().splitlines()[-1]
    assert "install torch first" in msg and "--no-build-isolation" in msg, r.stderr


def test_sdist_holds_every_source_file(tmp_path):
    r = subprocess.run(
        [sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    (sdist,) = tmp_path.glob("fedkernels-*.tar.gz")
    names = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
    wanted = ["LICENSE", "setup.py", "pyproject.toml", "README.md", "fedkernels/py.typed"]
    wanted += [os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))]  # the README's links
    for dirpath, _, files in os.walk(os.path.join(ROOT, "csrc")):
        wanted += [
            os.path.relpath(os.path.join(dirpath, f), ROOT) for f in files if f.endswith((".h", ".cuh", ".cu", ".cpp"))
        ]
    assert any(w.endswith(".h") for w in wanted) and any(w.endswith(".cu") for w in wanted)
    missing = [w for w in wanted if w not in names]
    assert not missing, f"sdist lacks {missing}"
    assert not any(n.endswith((".so", ".o")) for n in names)


def test_torch_version_check_message():
    _native.check_torch_version("2.13.0", "2.13.1+cpu")  # same major.minor: fine
    with pytest.raises(ImportError) as e:
        _native.check_torch_version("2.12.0", "2.13.0+cpu")
    msg = str(e.value)
    assert "\n" not in msg and "2.12.0" in msg and "2.13.0+cpu" in msg and "rebuild" in msg


def test_recorded_torch_version_is_the_building_torch():
    import torch

    assert _native.recorded_torch_version().split(".")[:2] == torch.__version__.split("+")[0].split(".")[:2]


def test_import_refuses_an_extension_built_for_another_torch():
    # the recorded version is monkeypatched, then the loader module runs its import-time check again
    code = (
        "import importlib, fedkernels._native as n\n"
        "info = n._C.build_info()\n"
        "n._C.build_info = lambda: dict(info, torch_version='2.10.1')\n"
        "importlib.reload(n)\n"
    )
    r = _run(code)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: fedkernels._C was built against torch 2.10.1"), r.stderr
    assert "rebuild" in last


def test_build_info_reports_march_and_dispatch():
    info = fedkernels.build_info()
    assert info["march"] and info["simd_dispatch"] in ("none", "default", "x86-64-v3", "x86-64-v4")
    assert (info["simd_dispatch"] == "none") == (info["march"] == "native")


def test_subpackages_load_lazily():
    code = (
        "import sys, fedkernels\n"
        "lazy = ['algorithms', 'distributed', 'streaming', 'integrations', 'sim']\n"
        "assert not [m for m in lazy if 'fedkernels.' + m in sys.modules], sorted(sys.modules)\n"
        "assert callable(fedkernels.distributed.ShardedAggregator)\n"
        "assert callable(fedkernels.algorithms.build)\n"
        "assert callable(fedkernels.streaming.ChunkedUpdates)\n"
        "assert fedkernels.integrations.__name__ == 'fedkernels.integrations'\n"
        "assert set(lazy) <= set(dir(fedkernels))\n"
        "try:\n    fedkernels.no_such_thing\nexcept AttributeError as e:\n    print('AE', e)\n"
    )
    r = _run(code)
    assert r.returncode == 0, r.stderr
    assert "AE module 'fedkernels' has no attribute 'no_such_thing'" in r.stdout


def test_cli_without_sim_extra_says_what_to_install(tmp_path):
    # an environment without pyyaml: a `yaml` on the path that fails to import as a missing one does
    (tmp_path / "yaml").mkdir()
    (tmp_path / "yaml" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'yaml'\")\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run(
        [sys.executable, "-m", "fedkernels", "info"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300
    )
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "pyyaml" in lines[0] and "[sim]" in lines[0], r.stderr


def test_cli_module_entry_runs():
    r = subprocess.run(
        [sys.executable, "-m", "fedkernels", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
        timeout=300,
    )
    assert r.returncode == 0 and "run" in r.stdout, r.stderr


def _make_vars():
    """The simple `NAME := value` / `NAME ?= value` variables of the Makefile."""
    out = {}
    with open(os.path.join(ROOT, "Makefile")) as f:
        for line in f:
            m = re.match(r"^([A-Z_]+)\s*[:?]=\s*(.*)$", line.rstrip("\n"))
            if m:
                out[m.group(1)] = m.group(2).split()
    return out


def _req_name(req):
    return re.split(r"[<>=!~\[ ;]", req, maxsplit=1)[0].lower()


def test_make_installs_each_extra_where_it_is_needed():
    # the demo gets the sim extra (and nothing of the test extra or Flower: the venv stays small); make
    # test gets the test extra on top, plus `build` for the wheel check
    mk, extras = _make_vars(), _pyproject()["project"]["optional-dependencies"]
    demo = {_req_name(r) for r in mk["DEPS"]}
    test = {_req_name(r) for r in mk["TEST_DEPS"]}
    for req in extras["sim"]:
        assert _req_name(req) in demo, f"make demo does not install {req!r} (sim extra)"
    for req in extras["test"]:
        assert _req_name(req) in test, f"make test does not install {req!r} (test extra)"
        assert _req_name(req) not in demo, f"make demo installs {req!r}, which only the tests need"
    assert "build" in test and "flwr" not in demo and "flwr" in _req_name(mk["FLOWER"][0])
    with open(os.path.join(ROOT, "Makefile")) as f:
        text = f.read()
    demo_stamp = text[text.index("$(VENV)/.stamp-deps:") : text.index("$(VENV)/.stamp-test-deps:")]
    assert "FLOWER" not in demo_stamp and "TEST_DEPS" not in demo_stamp, demo_stamp


def test_make_demo_says_how_to_call_the_command():
    with open(os.path.join(ROOT, "Makefile")) as f:
        text = f.read()
    recipe = text[text.index("\ndemo:") :].split("\n\n", 1)[0]
    assert "source $(VENV)/bin/activate" in recipe and "$(VENV)/bin/fedkernels run" in recipe, recipe


def test_public_functions_are_annotated():
    # py.typed promises types: every public function and method of these modules has annotated
    # parameters and a return annotation (mypy checks these and more, ops included: tests/test_typing.py;
    # this AST check also covers __main__ and the Flower adapter, which mypy does not check yet)
    import ast

    files = [
        "fedkernels/__init__.py",
        "fedkernels/_native.py",
        "fedkernels/__main__.py",
        "fedkernels/flat.py",
        "fedkernels/integrations/flower.py",
    ]
    missing = []
    for f in files:
        tree = ast.parse(open(os.path.join(ROOT, f)).read())
        nodes = list(tree.body)
        nodes += [n for c in tree.body if isinstance(c, ast.ClassDef) and not c.name.startswith("_") for n in c.body]
        for fn in nodes:
            if not isinstance(fn, ast.FunctionDef) or (
                fn.name.startswith("_") and fn.name not in ("__init__", "__getattr__", "__dir__")
            ):
                continue
            a = fn.args
            params = [p for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg not in ("self", "cls")]
            params += [p for p in (a.vararg, a.kwarg) if p is not None]
            bad = [p.arg for p in params if p.annotation is None]
            if bad or fn.returns is None:
                missing.append(f"{f}:{fn.lineno} {fn.name} {bad}{'' if fn.returns else ' (no return type)'}")
    assert not missing, "\n".join(missing)


def test_make_test_runs_the_suite_on_the_cores():
    """`make test` runs pytest-xdist (in the test extra and in TEST_DEPS, checked above) with one worker
    per core, an idle worker taking tests from the other's queue (worksteal)."""
    args = " ".join(_make_vars()["PYTEST_ARGS"])
    assert "-n auto" in args and "--dist worksteal" in args, args
    assert "pytest-xdist" in {_req_name(r) for r in _pyproject()["project"]["optional-dependencies"]["test"]}
