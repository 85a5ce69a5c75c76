"""Server aggregators and client rules, built by name. One module per method (``fedavg.py``), or a
folder where the method has companions (``fedecado/``: the method in ``__init__.py`` beside its
``options.py`` and ``solver.py``); what several methods share is ``parts.py`` and
``control_variates.py`` (SCAFFOLD, FedPVR)::

    from fedkernels import algorithms
    agg = algorithms.build("fedavg")
    new_global, info = agg.aggregate(global_flat, U, num_examples, client_ids)

``algorithms.available()`` lists the registered names, ``algorithms.options(name)`` the options of
one with their expected types and defaults, and ``help(algorithms.build)`` every method with its
options (built from the registry at import). Every module and folder in this package is imported
here, and a method registers its classes on import (see base.register).
"""

import importlib
import pkgutil

from .base import (
    AggResult,
    Aggregator,
    BadUpdateError,
    ClientContext,
    ClientRule,
    Option,
    RoundInput,
    available,
    build,
    options,
    register,
)
from .base import _REGISTRY
from .signature import method_table

for _m in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _m != "base" and not _m.startswith("_"):
        importlib.import_module(f"{__name__}.{_m}")

if build.__doc__:  # (python -OO strips docstrings)
    build.__doc__ += (
        "\n    Methods (name(s), class, what it does, its own options with their defaults):\n\n"
        + method_table(_REGISTRY, ("on_bad_update", "server_lr"))
        + "\n"
    )

__all__ = [
    "AggResult",
    "Aggregator",
    "BadUpdateError",
    "ClientContext",
    "ClientRule",
    "Option",
    "RoundInput",
    "available",
    "build",
    "options",
    "register",
]
