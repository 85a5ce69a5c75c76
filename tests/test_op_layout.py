"""One op, one place: every native op is found by its name in its own files, and in three shared ones.

The op list is read from the sources (each ``m.def`` in csrc/cpu/<stem>.cpp), never from a hand list, so a
new op is held to the checklist of ARCHITECTURE.md ("Adding an op") as soon as its schema exists.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

import fuzz_oracle  # tests/fuzz_oracle.py
from fedkernels import ops, reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")

# an op whose tests share a file with the methods built on it
TEST_FILE = {"server_opt_step": "test_server_opt.py"}


def _read(*parts) -> str:
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


def _schemas() -> dict:
    """{op name: the stem of the CPU file that defines its schema}, from the sources."""
    out = {}
    for name in sorted(os.listdir(os.path.join(CSRC, "cpu"))):
        if name.endswith(".cpp"):
            for op in re.findall(r'm\.def\("([a-z_0-9]+)\(', _read("csrc", "cpu", name)):
                assert op not in out, f"{op} defined twice"
                out[op] = name[:-4]
    return out


def _hooks() -> set:
    """Device-independent test hooks (CompositeExplicitAutograd): no CUDA kernel, no public wrapper."""
    out = set()
    for name in os.listdir(os.path.join(CSRC, "cpu")):
        for block in re.findall(
            r"TORCH_LIBRARY_IMPL\(fedkernels, CompositeExplicitAutograd, m\)\s*\{([^}]*)\}", _read("csrc", "cpu", name)
        ):
            out |= set(re.findall(r'm\.impl\("([a-z_0-9]+)"', block))
    return out


SCHEMAS = _schemas()
HOOKS = _hooks()


def _base(op: str) -> str:
    """The public name of an op: the _out variant is the op's out= argument."""
    return op[: -len("_out")] if op.endswith("_out") else op


def test_one_library_block_and_every_schema_in_its_cpu_file():
    blocks = {}
    for folder, _, files in os.walk(CSRC):
        for name in files:
            src = _read(os.path.relpath(os.path.join(folder, name), ROOT))
            if "TORCH_LIBRARY(fedkernels" in src:
                blocks[name] = src.count("TORCH_LIBRARY(fedkernels")
            if re.search(r'm\.def\("[a-z_0-9]+\(', src):  # a schema (pybind's m.def("build_info", ...) is not)
                assert os.path.basename(folder) == "cpu" and "TORCH_LIBRARY_FRAGMENT(fedkernels, m)" in src, (
                    f"{name}: a schema belongs in csrc/cpu/<op>.cpp, in a TORCH_LIBRARY_FRAGMENT"
                )
    assert blocks == {"fedkernels.cpp": 1}, blocks
    assert len(SCHEMAS) >= 20


def test_the_build_finds_every_kernel_file():
    """setup.py globs csrc/cpu/*.cpp and csrc/cuda/*.cu / *_glue.cpp: a new op needs no edit there."""
    setup = _read("setup.py")
    for pattern in ('"csrc", "cpu", "*.cpp"', '"csrc", "cuda", "*.cu"', '"csrc", "cuda", "*_glue.cpp"'):
        assert pattern in setup, pattern


@pytest.mark.parametrize("op", sorted(SCHEMAS))
def test_every_op_has_its_files_reference_and_fuzz_target(op):
    stem = SCHEMAS[op]
    assert hasattr(torch.ops.fedkernels, op), f"{op}: schema not registered by the built extension"
    test_file = TEST_FILE.get(stem, f"test_{stem}.py")
    tests = _read("tests", test_file)
    assert re.search(rf"\b{_base(op)}\b", tests), f"tests/{test_file} never names {op}"
    assert any(m in tests for m in ("DEVICES", "NEEDS_CUDA", "mark.cuda")), (
        f"tests/{test_file}: no case on cuda (parametrise by device: tests/devices.py)"
    )
    assert os.path.exists(os.path.join(ROOT, "fedkernels", "ops", f"{stem}.py")), f"no fedkernels/ops/{stem}.py"
    base = _base(op)
    assert any(callable(getattr(reference, n, None)) for n in (base, base.rstrip("_"))), (
        f"fedkernels/reference.py has no float64 reference of {op}"
    )
    if op in HOOKS:
        return
    assert base in ops.__all__, f"{base} is not exported by fedkernels/ops/__init__.py"
    assert base in fuzz_oracle.OP_TARGETS or base in fuzz_oracle.FUZZED_VIA, (
        f"tests/fuzz_oracle.py has no target for {base}"
    )
