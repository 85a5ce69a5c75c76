"""The server's round on compressed rows: a registered method whose server needs only weighted sums of the
updates runs unchanged, its ``RoundInput.weighted_sum`` served straight from the compressed rows
(``ops.dequant_weighted_sum`` / ``ops.sparse_weighted_sum``: no dense K x d copy, the NaN/Inf screen in the same
pass). The round itself is the round runner's (compressed rows are one of its input forms,
``sources.PackedRows``). Which methods compose with a codec is each method's own declaration
(``Aggregator.reads_beyond_weighted_sum``: None for a method that reads U only through weighted sums, else
what else it reads, e.g. the Gram matrix, per-row statistics, per-client tables of U's rows, order
statistics; a wrapper answers for itself and the method inside it): a method that needs more is refused
before anything is computed, with one line naming the method, the codec and what the codec drops.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from ..algorithms.base import _REGISTRY, AggResult, Aggregator, _lookup
from ..algorithms.wrappers import MethodWrapper
from ..sources import PackedRows

__all__ = ["weighted_sum_methods", "check_method", "aggregate_compressed"]


def weighted_sum_methods() -> List[str]:
    """The registered method names (aliases included) whose server reads the updates only through weighted
    sums (``reads_beyond_weighted_sum`` is None): those that compose with a codec."""
    return sorted(n for n, cls in _REGISTRY.items() if cls.reads_beyond_weighted_sum is None)


def __getattr__(name: str) -> Any:
    # WEIGHTED_SUM_METHODS: weighted_sum_methods() as a tuple, read from the methods' declarations when asked
    if name == "WEIGHTED_SUM_METHODS":
        return tuple(weighted_sum_methods())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_method(method: Union[str, Aggregator], kind: str) -> None:
    """One-line ValueError unless ``method`` (a built aggregator, wrappers included, or a registered name) reads
    the updates only through weighted sums."""
    agg = _lookup(method) if isinstance(method, str) else method
    what = agg.reads_beyond_weighted_sum
    if what is None:
        return
    name, why = method if isinstance(method, str) else method.name, ""
    w = agg
    while isinstance(w, MethodWrapper) and not why:  # the wrapper whose own declaration refuses, if any
        why = f" with {w.option}" if "reads_beyond_weighted_sum" in vars(type(w)) else ""
        w = w.inner
    raise ValueError(
        f"compress.kind={kind}: method {name!r}{why} needs {what}, which compressed rows do not give "
        f"without decompressing them; compression composes with {', '.join(weighted_sum_methods())}"
    )


def aggregate_compressed(
    agg: Aggregator,
    global_flat: torch.Tensor,
    rows: PackedRows,
    num_examples: Sequence[float],
    client_ids: Sequence[int],
    payloads: Optional[Sequence[Dict[str, Any]]] = None,
    kind: str = "compressed",
) -> AggResult:
    """``agg``'s round on compressed rows (row k: client ``client_ids[k]``), after :func:`check_method`:
    ``agg.aggregate(global_flat, rows, ...)``, the round runner's round on packed rows (the method's own
    ``_aggregate``, its weighted sums computed from ``rows``; validation, the NaN/Inf screen in that pass, the
    ``on_bad_update`` policy and its re-run without the bad rows, the buffers' average: as for dense rows).
    Returns ``AggResult`` as ``Aggregator.aggregate``."""
    check_method(agg, kind)
    return agg.aggregate(global_flat, rows, num_examples, client_ids, payloads)
