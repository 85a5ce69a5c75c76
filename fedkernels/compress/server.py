"""The server's round on compressed rows: a registered method whose server needs only weighted sums of the
updates runs unchanged, its ``RoundInput.weighted_sum`` served straight from the compressed rows
(``ops.dequant_weighted_sum`` / ``ops.sparse_weighted_sum``: no dense K x d copy, the NaN/Inf screen in the same
pass). A method that reads the updates any other way (the Gram matrix, per-row statistics, per-client tables of
U's rows, order statistics) is refused before anything is computed, with one line naming what the codec drops.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from ..algorithms.base import AggResult, Aggregator, RoundInput, UpdatesShape
from ..errors import BadUpdateError
from .codecs import Rows

__all__ = ["WEIGHTED_SUM_METHODS", "check_method", "aggregate_compressed", "CompressedRoundInput"]

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
    "gcfed": "per-channel projections of the dense updates", "gc-fed": "per-channel projections of the dense updates",
    "global_gc": "per-channel projections of the dense updates", "local_gc": "per-channel projections of the dense updates",
    "local_gc_only": "per-channel projections of the dense updates",
}


def check_method(method: Union[str, Aggregator], kind: str) -> None:
    """One-line ValueError unless ``method``'s server needs only weighted sums of the updates."""
    name = method if isinstance(method, str) else method.name
    if name in WEIGHTED_SUM_METHODS:
        return
    what = NEEDS.get(name, "more of the updates than a weighted sum")
    raise ValueError(f"compress.kind={kind}: method {name!r} needs {what}, which compressed rows do not give "
                     f"without decompressing them; compression composes with {', '.join(WEIGHTED_SUM_METHODS)}")


class _Refused(ValueError):
    pass


class CompressedRoundInput(RoundInput):
    """A RoundInput whose rows are compressed (``packed``): ``weighted_sum`` runs on them; every other read raises."""

    packed: Any = None

    def _weighted_sum(self, coef: Any, base: Optional[torch.Tensor], alpha: float) -> torch.Tensor:
        g = self.global_flat
        out_dtype = torch.float64 if g.dtype == torch.float64 else torch.float32
        b = None if base is None else base.to(out_dtype)
        out, ok = self.packed.weighted_sum(coef, base=b, alpha=alpha, out_dtype=None if b is not None else out_dtype)
        if self.screen_rows:
            self._flags(ok)
        return out.to(g.dtype)

    def _refuse(self, what: str) -> None:
        raise _Refused(f"compressed rows: this method reads {what} of the updates, which compressed rows do not "
                       "give without decompressing them")

    def gram(self, host: bool = False) -> torch.Tensor:
        self._refuse("the Gram matrix")
        raise AssertionError

    def kstats(self, p: torch.Tensor) -> Any:
        self._refuse("per-row statistics (kstats)")

    def blocks(self, device: Optional[torch.device] = None) -> Any:
        self._refuse("column blocks")

    def screen(self) -> None:
        self._refuse("a separate screening pass")


def aggregate_compressed(agg: Aggregator, global_flat: torch.Tensor, rows: Rows, num_examples: Sequence[float],
                         client_ids: Sequence[int], payloads: Optional[Sequence[Dict[str, Any]]] = None,
                         kind: str = "compressed") -> AggResult:
    """``agg``'s round on compressed rows (row k: client ``client_ids[k]``): the method's own ``_aggregate`` with
    its weighted sums computed from ``rows``. Rows with a NaN/Inf (a non-finite scale or value) are screened in
    that pass: raised as BadUpdateError, or with ``on_bad_update="exclude"`` dropped and the round run again
    without them (``info["excluded"]``). Returns ``AggResult`` as ``Aggregator.aggregate``."""
    check_method(agg, kind)
    ids = [int(c) for c in client_ids]
    excluded: List[Dict[str, Any]] = []
    while True:
        shape = UpdatesShape(rows.K, rows.d, global_flat.dtype, global_flat.device)
        rin = agg.validate(global_flat, shape, num_examples, ids, payloads, screen=False)
        if rin.K == 0:
            res = AggResult(global_flat.clone(), {"skipped": True, "reason": "no valid client update"})
            break
        if rin.K != rows.K:                              # validate dropped clients (bad counts or payloads)
            pos = {c: k for k, c in enumerate(ids)}
            rows = rows.select([pos[c] for c in rin.client_ids])
        crin = CompressedRoundInput(**{f.name: getattr(rin, f.name) for f in fields(RoundInput) if f.init})
        crin.packed = rows
        crin.screen_rows = True
        flags: List[torch.Tensor] = []
        crin.on_flags = lambda ok, carry=None: flags.append(ok.cpu()) or (None if carry is None else carry.cpu())
        try:
            res = agg._aggregate(crin)
        except _Refused as e:
            raise ValueError(f"{agg.name}: {e}") from None
        ok = flags[0] if flags else torch.ones(rin.K, dtype=torch.bool)
        bad = (~ok).nonzero().reshape(-1).tolist()
        if not bad:
            excluded += rin.excluded
            break
        names = [rin.client_ids[k] for k in bad]
        if agg.on_bad_update != "exclude":
            raise BadUpdateError(f"{agg.name}: client {names[0]}'s compressed update contains NaN/Inf")
        excluded += rin.excluded + [{"client_id": c, "reason": "compressed update contains NaN/Inf"} for c in names]
        keep = [k for k in range(rin.K) if k not in set(bad)]
        rows = rows.select(keep)
        ids = [rin.client_ids[k] for k in keep]
        num_examples = [float(rin.num_examples[k]) for k in keep]
        payloads = [rin.payloads[k] for k in keep]
        if not keep:
            res = AggResult(global_flat.clone(), {"skipped": True, "reason": "no valid client update"})
            break
    res.info.setdefault("num_clients", rows.K)
    if excluded:
        res.info["excluded"] = excluded
    agg.round += 1
    return res
