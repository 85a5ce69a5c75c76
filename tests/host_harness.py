"""The host harness of the CUDA kernels' per-thread logic, for each op's tests (no GPU needed).

The kernels in csrc/cuda/<op>.cu call ``__host__ __device__`` functions from csrc/cuda/<op>.cuh (index
and column maths, vector/scalar tails, accumulation types, pivot orders, reduction orders, work plans).
tests/cuda_host/<op>.cpp compiles those headers with g++ (FK_HD defined away) and emulates the kernel's
thread grid around them; tests/cuda_host/main.cpp dispatches the commands (tests/cuda_host/harness.h).
Every ``tests/cuda_host/*.cpp`` is built into one program, as one translation unit (the headers parsed once),
once per set of sources and compiler (cached by their hash in the temporary directory, so parallel workers
and modules share one build), and an op's tests compare its answers with the float64 reference and the CPU op. In a test module::

    @pytest.fixture(scope="module")
    def harness():
        yield from host_harness.session()

What only a GPU run can check (shuffles, shared-memory barriers, vector loads, launch configurations)
is listed in each .cu/.cuh header.
"""

from __future__ import annotations

import glob
import hashlib
import math
import os
import shutil
import subprocess
import tempfile

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_SRC = os.path.join(ROOT, "csrc", "cuda")
HOST_SRC = os.path.join(ROOT, "tests", "cuda_host")
FLAGS = ["-std=c++17", "-O1", "-Wall", "-Werror"]


def build() -> str:
    """The harness program for the current sources: built once, then reused."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++ to build the host harness")
    sources = sorted(glob.glob(os.path.join(HOST_SRC, "*.cpp")))
    inputs = sources + sorted(
        glob.glob(os.path.join(HOST_SRC, "*.h"))
        + glob.glob(os.path.join(CUDA_SRC, "*.cuh"))
        + glob.glob(os.path.join(CUDA_SRC, "*.h"))
    )
    version = subprocess.run(["g++", "--version"], check=True, capture_output=True, text=True).stdout
    h = hashlib.sha256((" ".join(FLAGS) + version).encode())
    for path in inputs:
        with open(path, "rb") as f:
            h.update(os.path.basename(path).encode() + b"\0" + f.read())
    exe = os.path.join(tempfile.gettempdir(), f"fedkernels-host-harness-{h.hexdigest()[:16]}")
    if not os.path.exists(exe):
        part = f"{exe}.{os.getpid()}"
        unity = "".join(f'#include "{os.path.basename(src)}"\n' for src in sources)  # one translation unit
        subprocess.run(
            ["g++", *FLAGS, "-I", CUDA_SRC, "-I", HOST_SRC, "-x", "c++", "-", "-o", part],
            input=unity,
            check=True,
            capture_output=True,
            text=True,
        )
        os.replace(part, exe)  # atomic: a parallel build of the same sources writes the same program
    return exe


def session():
    """A running harness: yields ask(*parts) -> the answer line's fields (asserts it is not ERR)."""
    proc = subprocess.Popen([build()], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(*parts) -> list:
        line = " ".join(_fmt(p) for p in parts)
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
        ans = proc.stdout.readline().split()
        assert ans and ans[0] != "ERR", f"harness: {' '.join(ans)}"
        return ans

    yield ask
    proc.stdin.close()
    proc.wait(timeout=10)


def _fmt(x) -> str:
    if isinstance(x, (list, tuple)):
        return " ".join(_fmt(v) for v in x)
    if isinstance(x, torch.Tensor):
        return _fmt(x.reshape(-1).tolist())
    if isinstance(x, str):
        return x
    if isinstance(x, bool):
        return str(int(x))
    if isinstance(x, int):
        return str(x)
    x = float(x)
    return "nan" if math.isnan(x) else ("inf" if x == math.inf else ("-inf" if x == -math.inf else x.hex()))


def hexf(s: str) -> float:
    """A number of the harness's answer (a C99 hex float, or nan / inf)."""
    return float(s) if s.lstrip("-") in ("nan", "inf") else float.fromhex(s)
