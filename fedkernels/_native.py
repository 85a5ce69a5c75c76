"""Loads the native extension, which registers torch.ops.fedkernels.*."""
from __future__ import annotations

import importlib

import torch  # noqa: F401  (loads libc10/libtorch before the extension)

_C = None
_error: Exception | None = None
try:
    _C = importlib.import_module("fedkernels._C")
except ImportError as e:  # pragma: no cover - exercised only on a broken install
    _error = e


def available() -> bool:
    """True when the compiled extension fedkernels._C was imported."""
    return _C is not None


def require() -> None:
    if _C is None:
        raise ImportError(
            "fedkernels._C (the native kernels) is not built: run `pip install --no-build-isolation -e .` "
            f"in the repository (or `make build`). Import error: {_error}"
        )


def build_info() -> dict:
    """Facts about the native build: CUDA compiled, OpenMP, torch version, SIMD level."""
    require()
    info = dict(_C.build_info())
    import torch

    info["torch_runtime"] = torch.__version__
    info["num_threads"] = torch.get_num_threads()
    return info
