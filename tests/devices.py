"""What the op tests share to run one case on every device, in the style of pytorch/extension-cpp.

An op's tests live in its own ``tests/test_<op>.py``; a case whose data and unpacking do not depend on the
device takes ``dev`` from ``@pytest.mark.parametrize("dev", DEVICES)``: the cpu case runs everywhere (so a
bug in a test's data or unpacking shows on a CPU machine, not first on a GPU), the cuda case is marked
``cuda`` and skipped at collection time without a CUDA device or without the CUDA build of fedkernels
(``fedkernels.build_info()['cuda']``). Tests of CUDA-only behaviour (host vectors, device asserts) use
``cuda_only``. On a GPU machine: ``python -m pytest -m cuda tests/``.
"""

from __future__ import annotations

import re

import pytest
import torch

import fedkernels


def cuda_build() -> bool:
    """A CUDA device and the CUDA build of fedkernels."""
    if not torch.cuda.is_available():
        return False
    try:
        return bool(fedkernels.build_info().get("cuda", False))
    except Exception:  # pragma: no cover - broken install
        return False


NEEDS_CUDA = [
    pytest.mark.cuda,
    pytest.mark.skipif(not cuda_build(), reason="needs a CUDA device and the CUDA build of fedkernels"),
]
DEV = "cuda"
DEVICES = ["cpu", pytest.param(DEV, marks=NEEDS_CUDA)]
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def cuda_only(test):
    for mark in NEEDS_CUDA:
        test = mark(test)
    return test


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def randn(dev: str, *shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    """The same values on every device: drawn on the CPU in float64, then cast and moved."""
    return torch.randn(*shape, generator=gen(seed), dtype=torch.float64).to(dtype).to(dev)


def one_line(exc, match, fn, *args, **kwargs):
    """fn(*args) raises exc with a one-line message matching the regex ``match``."""
    with pytest.raises(exc) as e:
        fn(*args, **kwargs)
    msg = str(e.value)
    assert msg and "\n" not in msg.strip(), f"not one line: {msg!r}"
    assert re.search(match, msg), f"{msg!r} does not match {match!r}"


def settle(dev: str) -> None:
    if dev == DEV:
        torch.cuda.synchronize()  # an asynchronous CUDA error would surface here
