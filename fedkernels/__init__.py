"""fedkernels: federated-learning aggregators for heterogeneous clients, with native kernels.

Layers (top to bottom): sim (simulator, CLI) -> algorithms (aggregators, client rules)
-> flat (model <-> flat vector, K x d update buffer) -> ops (validated native ops)
-> reference (pure-PyTorch oracle) / csrc (C++ and CUDA kernels).
"""
from . import _native
from ._native import build_info
from . import ops, reference
from .flat import FlatSpec, UpdateBuffer

__version__ = "0.1.0"
__all__ = ["ops", "reference", "FlatSpec", "UpdateBuffer", "build_info", "__version__"]
