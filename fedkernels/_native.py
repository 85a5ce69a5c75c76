"""Loads the native extension, which registers torch.ops.fedkernels.*.

The extension is compiled against one torch version, and torch has no ABI promise across minor
versions: the import checks that the running torch has the major.minor the build recorded and
raises a one-line ImportError telling the user to rebuild otherwise."""

from __future__ import annotations

import importlib
from typing import Any, Dict, Optional

import torch  # loads libc10/libtorch before the extension

REBUILD = "pip install --no-build-isolation --force-reinstall --no-deps . (or `make build` in a checkout)"

_C: Any = None
_error: Optional[Exception] = None
try:
    _C = importlib.import_module("fedkernels._C")
except ImportError as e:  # pragma: no cover - exercised only on a broken install
    _error = e


def _major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def check_torch_version(built: str, running: str) -> None:
    """Raises a one-line ImportError when the extension was built for another torch major.minor."""
    if _major_minor(built) != _major_minor(running):
        raise ImportError(
            f"fedkernels._C was built against torch {built} but torch {running} is running; torch has no "
            f"ABI promise across minor versions: rebuild fedkernels with this torch: {REBUILD}"
        )


def recorded_torch_version() -> Optional[str]:
    """The torch version the extension was compiled against (None without the extension)."""
    return None if _C is None else str(_C.build_info()["torch_version"])


if _C is not None:
    check_torch_version(str(recorded_torch_version()), torch.__version__)  # not None: _C is loaded
elif _error is not None and "undefined symbol" in str(_error):
    # an extension built for another torch usually fails to load with a missing C++ symbol
    _error = ImportError(
        f"fedkernels._C does not match torch {torch.__version__} ({_error}); rebuild "
        f"fedkernels with this torch: {REBUILD}"
    )


def available() -> bool:
    """True when the compiled extension fedkernels._C was imported."""
    return _C is not None


def require() -> None:
    """Raises ImportError (saying how to build it) when the native extension is missing."""
    if _C is None:
        raise ImportError(
            "fedkernels._C (the native kernels) is not built: run `pip install --no-build-isolation -e .` "
            f"in the repository (or `make build`). Import error: {_error}"
        )


def build_info() -> Dict[str, Any]:
    """Facts about the native build: CUDA compiled, OpenMP, the torch version it was built against
    (``torch_version``) and the running one, the ``-march`` (``march``), the compile-time SIMD level
    and, for portable builds, which runtime-dispatched clone of the hot loops runs (``simd_dispatch``)."""
    require()
    info = dict(_C.build_info())
    info["torch_runtime"] = torch.__version__
    info["num_threads"] = torch.get_num_threads()
    return info
