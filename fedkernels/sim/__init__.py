"""fedkernels.sim: the federated-learning simulator (data, partitions, models, training loop, CLI).

    from fedkernels.sim import RunConfig, Simulation, presets
    cfg = presets.get("demo")                      # or RunConfig(...) with dotted overrides
    summary = Simulation(cfg).run()                # callbacks=[cb]: see fedkernels.sim.callbacks

``Simulation`` and ``run`` (``sim/simulation.py``) and ``RunConfig`` (``sim/config.py``) are loaded on
first use, so ``import fedkernels.sim`` (and the CLI's start-up) does not pay for the round loop.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, List

if TYPE_CHECKING:
    from .config import RunConfig
    from .simulation import Simulation, run

# public name -> the submodule that defines it
_LAZY = {"Simulation": "simulation", "run": "simulation", "RunConfig": "config"}

__all__ = ["RunConfig", "Simulation", "run"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))
