"""Server aggregators and client rules, one module per method, built by name::

    from fedkernels import algorithms
    agg = algorithms.build("fedavg")
    new_global, info = agg.aggregate(global_flat, U, num_examples, client_ids)

Every module in this package registers its classes on import (see base.register).
"""
import importlib
import pkgutil

from .base import (AggResult, Aggregator, BadUpdateError, ClientContext, ClientRule, RoundInput,
                   available, build, register)

for _m in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _m != "base" and not _m.startswith("_"):
        importlib.import_module(f"{__name__}.{_m}")

__all__ = ["AggResult", "Aggregator", "BadUpdateError", "ClientContext", "ClientRule", "RoundInput",
           "available", "build", "register"]
