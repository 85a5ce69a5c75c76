"""Kuramoto's phase statistics in one pass over the update rows: ``kstats``.

``dot_k = <U_k, mean>``, ``nsq_k = ||U_k||^2``, ``nbar = ||mean||^2`` with ``mean = sum_k p_k U_k``, and the
rows' finite flags, from one read of the K x d update matrix ``U`` (``csrc/cpu/kstats.cpp``,
``csrc/cuda/kstats.cu``): everything is column-local (docs/specs/kuramoto_fedavg.md §5.1 KSTATS), so no
K x K Gram matrix is formed. float64 oracle: ``fedkernels.reference.kstats``. ``p`` is a small host
vector, checked on the host and handed to the native op as a CPU tensor for every device of ``U``. In
sharded mode (:func:`fedkernels.ops.reduce_across`) the column shards' sums are added across ranks and
their flags and-ed (each shard's mean is exact: it is column-local).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._types import CoefLike
from . import _autograd as _ag
from ._checks import _coef, fake_size, _matrix, _matrix_rows, _needs_kernel
from .reductions import active_reducer, shard_and, shard_sum

__all__ = ["kstats"]


def kstats(U: torch.Tensor, p: CoefLike) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dot [K], nsq [K], nbar [], ok [K])`` on U's device: with ``mean = sum_k p[k] U[k]``,
    ``dot[k] = <U[k], mean>``, ``nsq[k] = ||U[k]||^2``, ``nbar = ||mean||^2`` (float64, U's elements
    converted exactly, fixed summation order: the same bits with any number of threads), and
    ``ok[k] = all(isfinite(U[k]))`` (exact for every dtype), all from one read of U.

    U: [K, d] float16/bfloat16/float32/float64 (any row stride); p: [K] finite weights (read as float64;
    any values: the Kuramoto aggregator passes p_k = n_k / sum n). A row with a NaN/Inf makes the mean,
    and so every dot and nbar, NaN: drop it (``ok``) and call again. K = 0 or d = 0: zeros and all-True
    flags. Not differentiable.
    """
    U = _matrix(U, "kstats")
    _needs_kernel("kstats", U.device, "kstats")
    c = _coef(p, _matrix_rows(U), "kstats", "p")
    dot, nsq, nbar, ok = _ag.call(torch.ops.fedkernels.kstats, U, c)
    if active_reducer() is None:
        return dot, nsq, nbar, ok
    K = U.size(0)
    s = shard_sum(torch.cat([dot, nsq, nbar.reshape(1)]))  # the column shards' sums: one all-reduce
    return s[:K], s[K : 2 * K], s[2 * K], shard_and(ok)


# ---- fake (meta) kernel, so the op works under torch.compile / opcheck -----------------------------
@torch.library.register_fake("fedkernels::kstats")
def _kstats_fake(U: torch.Tensor, p: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    K = fake_size(U, 0)
    f = U.new_empty((K,), dtype=torch.float64)
    return f, torch.empty_like(f), U.new_empty((), dtype=torch.float64), U.new_empty((K,), dtype=torch.bool)


_ag.no_derivative_op("kstats", "differentiate reference.kstats, or ops.gram and ops.weighted_sum, instead")
