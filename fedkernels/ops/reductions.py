"""Reductions over d that are sharding-aware: ``dot``, ``sqnorm``, ``all_``, ``any_`` (``any_flag``: on the
device), ``amax_d``,
``mean_d`` (and the K x K / [K] results of ``gram`` / ``kstats`` / ``finite_rows``).

In sharded aggregation (:mod:`fedkernels.distributed`) every d-vector an aggregator sees is this
rank's column slice, so a reduction over d must be combined across ranks. That is explicit here:
a :class:`Reducer` (anything with ``all_reduce_sum`` / ``all_reduce_max`` / ``all_reduce_and``)
is made active for a block with :func:`reduce_across`::

    with ops.reduce_across(shard_ctx):        # fedkernels.distributed.sharded() does this
        G = ops.gram(U_local)                 # K x K partials summed over ranks
        s = ops.sqnorm(v_local)               # summed over ranks

Outside such a block (single process) every function is a plain local reduction with no
overhead. The active reducer is process-wide state owned by this module and changed only by
:func:`reduce_across` (nested blocks restore the outer one); :func:`active_reducer` reads it.
This module never imports :mod:`fedkernels.distributed` (ops sit below it).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Protocol

import torch

from ._checks import _tensor

__all__ = [
    "Reducer",
    "reduce_across",
    "active_reducer",
    "dot",
    "sqnorm",
    "all_",
    "any_",
    "any_flag",
    "amax_d",
    "mean_d",
]


class Reducer(Protocol):
    """Combines per-rank partial results; every rank must make the same sequence of calls."""

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor: ...

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor: ...

    def all_reduce_and(self, mask: torch.Tensor) -> torch.Tensor: ...


_active: Optional[Reducer] = None  # set only by reduce_across()


@contextlib.contextmanager
def reduce_across(reducer: Optional[Reducer]) -> Iterator[Optional[Reducer]]:
    """Within this block, the reductions of :mod:`fedkernels.ops` combine their partial results
    with ``reducer`` (None: local reductions, e.g. to leave a sharded block temporarily)."""
    global _active
    prev = _active
    _active = reducer
    try:
        yield reducer
    finally:
        _active = prev


def active_reducer() -> Optional[Reducer]:
    """The reducer of the innermost :func:`reduce_across` block, or None."""
    return _active


def shard_sum(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over ranks (``t`` itself outside a sharded block)."""
    return t if _active is None else _active.all_reduce_sum(t)


def shard_and(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` and-ed over ranks (``mask`` itself outside a sharded block)."""
    return mask if _active is None else _active.all_reduce_and(mask)


def dot(a: torch.Tensor, b: torch.Tensor) -> float:
    """``<a, b>`` over d, accumulated in float64 (summed across ranks in sharded mode)."""
    a, b = _tensor(a, "dot", "a"), _tensor(b, "dot", "b")
    if a.numel() != b.numel():
        raise ValueError(f"dot: a and b must have the same number of elements, got {a.numel()} and {b.numel()}")
    return float(shard_sum(torch.dot(a.reshape(-1).double(), b.reshape(-1).double()).reshape(1)))


def sqnorm(a: torch.Tensor) -> float:
    """``||a||^2`` over d, accumulated in float64 (summed across ranks in sharded mode)."""
    a = _tensor(a, "sqnorm", "a").reshape(-1).double()
    return float(shard_sum(torch.dot(a, a).reshape(1)))


def all_(mask: torch.Tensor) -> bool:
    """``bool(mask.all())`` over a d-sized mask (logical and across ranks in sharded mode)."""
    m = _tensor(mask, "all_", "mask")
    return bool(shard_and(m.all().reshape(1)))


def any_(mask: torch.Tensor) -> bool:
    """``bool(mask.any())`` over a d-sized mask (logical or across ranks in sharded mode)."""
    return bool(any_flag(mask))


def any_flag(mask: torch.Tensor) -> torch.Tensor:
    """:func:`any_` left on the mask's device: a [1] bool tensor (no host sync; logical or across ranks
    in sharded mode), for a caller that brings it to the host with other values in one copy."""
    m = _tensor(mask, "any_flag", "mask")
    return ~shard_and((~m.any()).reshape(1))


def amax_d(x: torch.Tensor) -> torch.Tensor:
    """``x.amax(dim=-1)`` over the last (d) dimension (max across ranks in sharded mode); d = 0
    gives -inf (the identity of max) instead of an IndexError."""
    x = _tensor(x, "amax_d", "x")
    loc = x.amax(dim=-1) if x.size(-1) else x.new_full(x.shape[:-1], float("-inf"))
    return loc if _active is None else _active.all_reduce_max(loc)


def mean_d(x: torch.Tensor) -> torch.Tensor:
    """``x.mean(dim=-1)`` over the last (d) dimension (global mean across ranks in sharded mode)."""
    x = _tensor(x, "mean_d", "x")
    if _active is None:
        return x.mean(dim=-1)
    s = _active.all_reduce_sum(x.sum(dim=-1, dtype=torch.float64))
    n = float(_active.all_reduce_sum(torch.tensor([float(x.size(-1))], dtype=torch.float64)))
    return (s / n).to(x.dtype)
