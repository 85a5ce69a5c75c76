"""Sharded aggregation over ``torch.distributed``: the K x d update matrix split by columns.

Each rank holds a column slice ``[lo, hi)`` of every client update (and of the global model and
every d-sized server state: momenta, control variates, momentum tables). Per-coordinate work
(``ops.weighted_sum``, EMA updates, axpys) is purely local; the few reductions over d are summed
across ranks:

* ``ops.gram`` (K x K fp64 partials), ``ops.kstats`` (Kuramoto's 2K + 1 fp64 sums in one all-reduce,
  its flags and-ed: each shard's mean is exact, being column-local) and ``ops.finite_rows`` (logical and)
  all-reduce their result when a :func:`sharded` context is active;
* aggregators route any other reduction over a d-vector through ``ops.dot`` / ``ops.sqnorm`` /
  ``ops.all_`` / ``ops.any_``, which do the same.

Everything computed from those K-sized statistics (weights, min-norm solves, guards) is then the
same on every rank, so every aggregator runs unchanged::

    import torch.distributed as dist
    from fedkernels import algorithms, distributed
    dist.init_process_group("gloo", ...)                    # or "nccl" on GPUs
    agg = distributed.ShardedAggregator(algorithms.build("kuramoto"))
    agg.setup(spec, num_clients=N)                          # slice bounds follow spec's tensors
    new_local, info = agg.aggregate(global_flat, U, n, ids) # full [d] / [K, d] inputs are sliced,
                                                            # [d_local] / [K, d_local] used as is
    new_full = agg.gather(new_local)                        # all ranks: the full [d] vector

Slice boundaries (``align``): by default (``"bytes"``) every rank gets a near-equal share of the
bytes of U (the same share of its d columns), each cut placed on the output-channel row boundary
nearest to the ideal one, so a slice is off by at most one row (e.g. FedAvg's CNN, d = 1,663,370,
2 ranks: [0, 832,960) and [832,960, d)). ``"tensor"`` puts every cut on a tensor boundary instead
(whole tensors per rank; unbalanced when a few tensors dominate, e.g. rank 0 got [0, 52,096) of
that CNN). Either way a GC row or a 1-D tensor never straddles two ranks; the rank's aggregator
gets the matching ``ShardSpec`` (offsets relative to ``lo``; ``layer_modules()`` still lists the
whole model). Without a spec the split is even, in multiples of 64 elements. (``"row"`` is the
former name of ``"bytes"``.)

Agreement with one process: weighted sums are bitwise equal (per-coordinate arithmetic); the Gram
matrix is a sum of per-rank fp64 partials, equal to the one-process Gram to fp64 rounding (the
reduction order differs), so weights agree to ~1e-16 relative and results to fp32 rounding.
All ranks always hold identical K-sized statistics (a collective returns the same bits
everywhere), so they take the same branches.
"""

from __future__ import annotations

import bisect
import contextlib
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import ops
from .algorithms.base import AggResult, Aggregator
from .flat import FlatSpec, ParamEntry

__all__ = ["ShardContext", "sharded", "active", "shard_bounds", "shard_spec", "ShardSpec", "ShardedAggregator"]

ALIGNS = ("bytes", "row", "tensor")  # "row": the former name of "bytes" (the same split)
DEFAULT_ALIGN = "bytes"
EVEN_ALIGN = 64  # elements: slice starts of an unstructured split are multiples of this


class ShardContext:
    """The process group the d-reductions are summed over (None: the default group)."""

    def __init__(self, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "fedkernels.distributed: torch.distributed is not initialised "
                "(call torch.distributed.init_process_group first)"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.backend = dist.get_backend(group)

    def _comm(self, t: torch.Tensor) -> torch.Tensor:
        # gloo reduces host tensors; NCCL device tensors. A fresh contiguous buffer either way.
        if self.backend == "gloo" and t.device.type != "cpu":
            return t.detach().to("cpu").contiguous()
        return t.detach().clone().contiguous()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return t
        x = self._comm(t)
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x.to(t.device)

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return t
        x = self._comm(t)
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x.to(t.device)

    def all_reduce_and(self, mask: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return mask
        bad = self._comm((~mask.bool()).to(torch.int32))
        dist.all_reduce(bad, op=dist.ReduceOp.SUM, group=self.group)
        return (bad == 0).to(mask.device)


@contextlib.contextmanager
def sharded(group=None) -> Iterator[ShardContext]:
    """Within this context ``ops.gram`` / ``ops.kstats`` / ``ops.finite_rows`` / ``ops.dot`` / ``ops.sqnorm`` /
    ``ops.all_`` / ``ops.any_`` reduce across the ranks of ``group`` (a process group, None for the
    default group, or a ShardContext). Every rank must make the same sequence of such calls.
    (The ShardContext is the :class:`fedkernels.ops.Reducer` of an ``ops.reduce_across`` block.)"""
    ctx = group if isinstance(group, ShardContext) else ShardContext(group)
    with ops.reduce_across(ctx):
        yield ctx


def active() -> Optional[ShardContext]:
    """The active ShardContext, or None outside :func:`sharded`."""
    r = ops.active_reducer()
    return r if isinstance(r, ShardContext) else None


# ---- slicing ----------------------------------------------------------------------------------------
def shard_bounds(
    d: int, world: int, spec: Optional[FlatSpec] = None, align: str = DEFAULT_ALIGN
) -> List[Tuple[int, int]]:
    """``world`` contiguous ``[lo, hi)`` column ranges covering ``[0, d)``.

    With ``spec``: ``align="bytes"`` (default) balances the bytes per rank, each cut at the output-row
    boundary nearest to ``i * d / world`` (inside a tensor of dim >= 2; 1-D tensors stay whole), so
    every cut is within half a row (half a 1-D tensor) of the ideal one; ``align="tensor"`` cuts at
    the nearest tensor
    boundary. A rank may get an empty range when the model has fewer rows (tensors) than ranks (its
    slice is then [K, 0]; the ops handle that)."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"shard_bounds: world must be a positive int, got {world!r}")
    if isinstance(d, bool) or not isinstance(d, int) or d < 0:
        raise ValueError(f"shard_bounds: d must be an int >= 0, got {d!r}")
    if align not in ALIGNS:
        raise ValueError(f"shard_bounds: align must be one of {ALIGNS}, got {align!r}")
    if spec is not None and spec.d != d:
        raise ValueError(f"shard_bounds: spec has d={spec.d} but d={d}")
    cuts = [0]
    offs = [e.offset for e in spec.entries] if spec is not None else None
    for i in range(1, world):
        t = (d * i) // world
        if spec is None:
            b = min(d, (t + EVEN_ALIGN // 2) // EVEN_ALIGN * EVEN_ALIGN)
        else:
            j = max(0, bisect.bisect_right(offs, t) - 1)  # the entry holding t
            e = spec.entries[j] if spec.entries else None
            if e is None:
                b = 0
            elif align in ("bytes", "row") and e.numel and len(e.shape) >= 2:
                step = max(e.fan_in, 1)
                b = e.offset + min(e.numel, round((t - e.offset) / step) * step)
            else:
                lo_c, hi_c = e.offset, e.offset + e.numel
                b = lo_c if (t - lo_c) <= (hi_c - t) else hi_c
        cuts.append(max(b, cuts[-1]))
    cuts.append(d)
    return [(cuts[i], cuts[i + 1]) for i in range(world)]


class ShardSpec(FlatSpec):
    """The part of a FlatSpec inside ``[lo, hi)``: entries re-based to offset 0 (a tensor cut at a
    row boundary keeps only its rows). ``full`` is the whole model's spec; ``layer_modules()``
    lists the whole model's modules, so "the last layer" means the same on every rank."""

    def __init__(self, entries: List[ParamEntry], d: int, dtype: torch.dtype, full: FlatSpec, lo: int, hi: int):
        super().__init__(entries=entries, d=d, dtype=dtype)
        self.full, self.lo, self.hi = full, lo, hi

    def layer_modules(self) -> List[str]:
        return self.full.layer_modules()


def shard_spec(spec: FlatSpec, lo: int, hi: int) -> ShardSpec:
    """The entries of ``spec`` within columns ``[lo, hi)``; raises if a cut splits a row."""
    if not (0 <= lo <= hi <= spec.d):
        raise ValueError(f"shard_spec: need 0 <= lo <= hi <= d={spec.d}, got [{lo}, {hi})")
    out = []
    for e in spec.entries:
        a, b = max(lo, e.offset), min(hi, e.offset + e.numel)
        if a >= b:
            continue
        shape = e.shape
        if (a, b) != (e.offset, e.offset + e.numel):
            fi = max(e.fan_in, 1)
            if (a - e.offset) % fi or (b - e.offset) % fi or len(e.shape) < 2:
                raise ValueError(f"shard_spec: [{lo}, {hi}) cuts tensor {e.name!r} inside an output row")
            shape = ((b - a) // fi,) + tuple(e.shape[1:])
        out.append(
            ParamEntry(
                name=e.name,
                module=e.module,
                shape=tuple(shape),
                offset=a - lo,
                numel=b - a,
                kind=e.kind,
                index=e.index,
                layer_from_output=e.layer_from_output,
                is_buffer=e.is_buffer,
            )
        )
    return ShardSpec(out, hi - lo, spec.dtype, spec, lo, hi)


# ---- the wrapper ------------------------------------------------------------------------------------
class ShardedAggregator:
    """Runs any fedkernels Aggregator on this rank's column slice, inside :func:`sharded`.

    All ranks of ``group`` must call ``setup`` / ``aggregate`` / ``gather`` / ``client_payload``
    together with the same K, sample counts, client ids and scalar payloads. The wrapped
    aggregator's d-sized state holds only this rank's slice (``state_dict`` is per rank).
    """

    def __init__(self, aggregator: Aggregator, group=None, align: str = DEFAULT_ALIGN):
        if not isinstance(aggregator, Aggregator):
            raise TypeError(
                f"ShardedAggregator: aggregator must be a fedkernels Aggregator, got {type(aggregator).__name__}"
            )
        if align not in ALIGNS:
            raise ValueError(f"ShardedAggregator: align must be one of {ALIGNS}, got {align!r}")
        self.agg = aggregator
        self.ctx = ShardContext(group)
        self.align = align
        self.d: Optional[int] = None
        self.bounds: Optional[List[Tuple[int, int]]] = None
        self.local_spec: Optional[ShardSpec] = None

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world(self) -> int:
        return self.ctx.world

    @property
    def lo(self) -> int:
        return self.bounds[self.rank][0]

    @property
    def hi(self) -> int:
        return self.bounds[self.rank][1]

    def _bind(self, d: int, spec: Optional[FlatSpec] = None) -> None:
        self.d = int(d)
        self.bounds = shard_bounds(self.d, self.world, spec, self.align)
        self.local_spec = shard_spec(spec, self.lo, self.hi) if spec is not None else None

    def setup(
        self,
        spec: Optional[FlatSpec] = None,
        num_clients: Optional[int] = None,
        global_flat: Optional[torch.Tensor] = None,
        d: Optional[int] = None,
    ) -> None:
        """Fixes the slice (from ``spec``, else ``global_flat`` or ``d``) and sets up the wrapped
        aggregator with the rank's ShardSpec and slice of ``global_flat``."""
        if spec is not None:
            dd = spec.d
        elif global_flat is not None:
            dd = global_flat.numel()
        elif d is not None:
            dd = d
        else:
            raise ValueError("ShardedAggregator.setup: pass spec, global_flat or d (the model size)")
        self._bind(dd, spec)
        self.agg.setup(self.local_spec, num_clients, None if global_flat is None else self.local(global_flat))

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's columns of a full ``[d]`` or ``[K, d]`` tensor (a view, no copy)."""
        if self.bounds is None:
            raise ValueError("ShardedAggregator: call setup() first (or aggregate() with full-size inputs)")
        if x.size(-1) != self.d:
            raise ValueError(f"ShardedAggregator.local: expected last dim d={self.d}, got {tuple(x.shape)}")
        return x[..., self.lo : self.hi]

    def _as_local(self, x: torch.Tensor, name: str) -> torch.Tensor:
        w = self.hi - self.lo
        if x.size(-1) == self.d:
            return x[..., self.lo : self.hi]
        if x.size(-1) == w:
            return x
        raise ValueError(
            f"ShardedAggregator: {name} must have last dim d={self.d} (full) or {w} "
            f"(this rank's slice [{self.lo}, {self.hi})), got shape {tuple(x.shape)}"
        )

    def aggregate(
        self,
        global_flat: torch.Tensor,
        updates,
        num_examples,
        client_ids=None,
        payloads: Optional[Sequence[Dict[str, Any]]] = None,
        gather: bool = False,
    ) -> AggResult:
        """The wrapped aggregator's round on this rank's slice. Full-size inputs are sliced (views);
        payload tensors with d elements are sliced too. Returns the new *local* slice, or the full
        vector with ``gather=True``; ``info`` is identical on every rank."""
        if not isinstance(global_flat, torch.Tensor) or global_flat.dim() != 1:
            raise ValueError("ShardedAggregator.aggregate: global_flat must be a 1-D tensor")
        if self.bounds is None:
            self._bind(global_flat.numel())
        g = self._as_local(global_flat, "global_flat")
        if isinstance(updates, (list, tuple)):
            U = [self._as_local(u.reshape(-1), f"updates[{i}]") for i, u in enumerate(updates)]
        else:
            if not isinstance(updates, torch.Tensor) or updates.dim() != 2:
                raise ValueError(
                    "ShardedAggregator.aggregate: updates must be a [K, d] tensor or a list of [d] tensors"
                )
            U = self._as_local(updates, "updates")
        pl = None
        if payloads is not None:
            pl = []
            for p in payloads:
                q = dict(p)
                for k, v in q.items():
                    if isinstance(v, torch.Tensor) and v.numel() == self.d and self.d != self.hi - self.lo:
                        q[k] = v.reshape(-1)[self.lo : self.hi]
                pl.append(q)
        with sharded(self.ctx):
            res = self.agg.aggregate(g, U, num_examples, client_ids, pl)
        params = self.gather(res.params) if gather else res.params
        return AggResult(params, res.info)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The full ``[d]`` vector from every rank's ``[hi - lo]`` slice (a collective)."""
        w = self.hi - self.lo
        if local.dim() != 1 or local.numel() != w:
            raise ValueError(f"ShardedAggregator.gather: expected this rank's [{w}] slice, got {tuple(local.shape)}")
        if self.world == 1:
            return local.clone()
        wmax = max(b - a for a, b in self.bounds)
        buf = local.new_zeros(wmax)
        buf[:w] = local
        buf = self.ctx._comm(buf)
        parts = [torch.empty_like(buf) for _ in range(self.world)]
        dist.all_gather(parts, buf, group=self.ctx.group)
        full = torch.cat([p[: b - a] for p, (a, b) in zip(parts, self.bounds)])
        return full.to(local.device)

    def client_payload(self, client_id: int) -> Dict[str, Any]:
        """The wrapped aggregator's payload with d-slice tensors gathered to full size (a collective)."""
        pl = dict(self.agg.client_payload(client_id))
        w = self.hi - self.lo
        for k in sorted(pl):
            v = pl[k]
            if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == w and w != self.d:
                pl[k] = self.gather(v)
        return pl

    def client_rule(self):
        return self.agg.client_rule()

    def state_dict(self) -> Dict[str, Any]:
        """The wrapped aggregator's state (this rank's slice) and the slice bounds."""
        return {
            "aggregator": self.agg.state_dict(),
            "bounds": list(self.bounds or []),
            "d": self.d,
            "rank": self.rank,
            "world": self.world,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("world") != self.world or state.get("rank") != self.rank:
            raise ValueError(
                f"ShardedAggregator.load_state_dict: state is for rank {state.get('rank')} of "
                f"{state.get('world')}, this is rank {self.rank} of {self.world}"
            )
        self.d = state["d"]
        self.bounds = [tuple(b) for b in state["bounds"]]
        self.agg.load_state_dict(state["aggregator"])

    def __repr__(self) -> str:
        return f"ShardedAggregator({self.agg!r}, rank={self.rank}/{self.world})"
