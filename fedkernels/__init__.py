"""fedkernels: federated-learning aggregators for heterogeneous clients, with native kernels.

Layers (top to bottom): sim (simulator, CLI) -> integrations (Flower), distributed, streaming
-> algorithms (aggregators, client rules) -> flat (model <-> flat vector, K x d update buffer)
-> ops (validated native ops) -> reference (pure-PyTorch oracle) / csrc (C++ and CUDA kernels).

``import fedkernels`` loads the native ops and the flat layer only; the subpackages
``algorithms``, ``distributed``, ``streaming``, ``sources``, ``integrations`` and ``sim`` are imported on first
attribute access (``fedkernels.distributed.ShardedAggregator`` works without importing it first).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, List

from . import _native
from ._native import build_info
from . import ops, reference
from .flat import FlatSpec, UpdateBuffer

# The single source of the version (pyproject.toml reads it from here without importing the package).
__version__ = "0.1.0"

_LAZY_SUBMODULES = ("algorithms", "distributed", "streaming", "sources", "integrations", "sim", "optim")

__all__ = ["ops", "reference", "FlatSpec", "UpdateBuffer", "build_info", "__version__", *_LAZY_SUBMODULES]

if TYPE_CHECKING:  # static checkers see the submodules as attributes
    from . import algorithms, distributed, integrations, optim, sim, sources, streaming


def __getattr__(name: str) -> Any:
    """Imports ``fedkernels.<name>`` on first access for the lazily loaded subpackages."""
    if name in _LAZY_SUBMODULES:
        module = importlib.import_module(f".{name}", __name__)
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_LAZY_SUBMODULES))
