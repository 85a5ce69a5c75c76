"""The server's round on compressed rows: a registered method whose server needs only weighted sums of the
updates runs unchanged, its ``RoundInput.weighted_sum`` served straight from the compressed rows
(``ops.dequant_weighted_sum`` / ``ops.sparse_weighted_sum``: no dense K x d copy, the NaN/Inf screen in the same
pass). The round itself is the round runner's (compressed rows are one of its input forms,
``sources.PackedRows``); this module says which methods compose with a codec: a method that reads the updates any
other way (the Gram matrix, per-row statistics, per-client tables of U's rows, order statistics) is refused before
anything is computed, with one line naming what the codec drops.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Union

import torch

from ..algorithms.base import AggResult, Aggregator
from ..sources import PackedRows

__all__ = ["WEIGHTED_SUM_METHODS", "check_method", "aggregate_compressed"]

# methods whose server reads U only through RoundInput.weighted_sum (their _aggregate: the weighted mean of the
# updates, with the method's own coefficients, momentum or control-variate payloads, which are not compressed)
WEIGHTED_SUM_METHODS = ("fedavg", "fedprox", "fedavgm", "fednova", "scaffold", "scaffold_partial", "fedpvr")

# what the refused methods read of the rows, that a compressed row does not give without decompressing it
NEEDS = {
    "kuramoto": "each update's dot product with the weighted mean and its norm (ops.kstats)",
    "kuramoto_fedavg": "each update's dot product with the weighted mean and its norm (ops.kstats)",
    "fedaware": "the updates' Gram matrix and per-client momentum tables of their rows",
    "fedecado": "each update row in its backward-Euler solve (ops.fedecado_be_step)",
    "fedpgvc": "per-row projections of the updates",
    "gcfed": "per-channel projections of the dense updates",
    "gc-fed": "per-channel projections of the dense updates",
    "global_gc": "per-channel projections of the dense updates",
    "local_gc": "per-channel projections of the dense updates",
    "local_gc_only": "per-channel projections of the dense updates",
}


def check_method(method: Union[str, Aggregator], kind: str) -> None:
    """One-line ValueError unless ``method``'s server needs only weighted sums of the updates."""
    name = method if isinstance(method, str) else method.name
    if name in WEIGHTED_SUM_METHODS:
        return
    what = NEEDS.get(name, "more of the updates than a weighted sum")
    raise ValueError(
        f"compress.kind={kind}: method {name!r} needs {what}, which compressed rows do not give "
        f"without decompressing them; compression composes with {', '.join(WEIGHTED_SUM_METHODS)}"
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
