"""The K x K Gram matrix of the update rows: ``gram``, ``gram_screened``.

The first pass of Gram-based aggregators over the K x d update matrix ``U`` (one client per row),
in float64 (``csrc/cpu/gram.cpp``, ``csrc/cuda/gram.cu``); float64 oracle: ``fedkernels.reference.gram``.
``rows`` is a small host vector, checked on the host and handed to the native op as a CPU tensor for
every device of ``U`` (see ``_checks``). In sharded mode (:func:`fedkernels.ops.reduce_across`) the
partial Gram matrices of the column shards are summed across ranks.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import torch

from .._types import RowsLike
from . import _autograd as _ag
from ._checks import as_op, fake_size, _matrix, _matrix_rows, _needs_kernel, _no_grad_through, _rows
from .reductions import shard_sum

__all__ = ["gram", "gram_screened"]


def gram(U: torch.Tensor, rows: RowsLike = None) -> torch.Tensor:
    """Gram matrix ``U[rows] @ U.T`` in float64: shape [K, K] (or [len(rows), K]).

    Accumulates in float64 in a fixed order: the same input gives the same bits with any number
    of threads. For models larger than memory, sum ``gram(U[:, a:b])`` over column chunks.
    Differentiable w.r.t. ``U``.
    """
    U = _matrix(U, "gram")
    _needs_kernel("gram", U.device, "gram")
    return _gram(U, _rows(rows, _matrix_rows(U), "gram"))


def _gram(U: torch.Tensor, rows: Optional[torch.Tensor]) -> torch.Tensor:
    """The native call of :func:`gram` and :func:`gram_screened` (it checks the tensors' properties)."""
    G = _Gram.apply(U, rows) if _ag.needs_grad(U) else _ag.call(torch.ops.fedkernels.gram, U, rows)
    return shard_sum(G)


def gram_screened(U: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(gram(U), ok)``, ok[k] = isfinite(G[k, k]) ([K] bool on U's device): the NaN/Inf screen of
    the rows from the Gram pass itself, no extra read of U. A row with a NaN/Inf has a non-finite
    squared norm; a finite fp16/bf16/fp32 row never does (its squares are exact in float64 and
    cannot overflow it), so the flags are exact for those dtypes. A finite float64 row whose
    squared norm overflows is flagged too: check flagged float64 rows with :func:`finite_rows`
    (the aggregators do). Not differentiable."""
    U = _matrix(U, "gram_screened")
    _needs_kernel("gram", U.device, "gram_screened")
    _no_grad_through("gram_screened", U)
    G = as_op("gram_screened", "gram", _gram, U, None)
    return G, torch.isfinite(torch.diagonal(G)).to(U.device)


# ---- fake (meta) kernels, so the ops work under torch.compile / opcheck ------------------------
@torch.library.register_fake("fedkernels::gram")
def _gram_fake(U: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    K = fake_size(U, 0)
    k = K if rows is None else fake_size(rows, 0)
    return U.new_empty((k, K), dtype=torch.float64)


# ---- derivative (``gG`` = gradient of G): dU = gG^T U[rows] plus gG U scattered into rows
# ((gG + gG^T) U without rows), in float64, returned in U's dtype; vmap: one native call per batch element
def _gram_setup(ctx: Any, inputs: Tuple[Any, ...], output: torch.Tensor) -> None:
    U, rows = inputs
    ctx.save_for_backward(U, rows)


def _gram_backward(ctx: Any, gG: torch.Tensor) -> Tuple[torch.Tensor, None]:
    U, rows = ctx.saved_tensors
    U64 = U.to(torch.float64)
    gG = gG.to(torch.float64)
    if rows is None:
        gU = (gG + gG.transpose(0, 1)) @ U64
    else:
        r = rows.to(U.device)
        gU = gG.transpose(0, 1) @ U64.index_select(0, r)
        gU = gU.index_add(0, r, gG @ U64)
    return gU.to(U.dtype), None


class _Gram(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(U: torch.Tensor, rows: Optional[torch.Tensor]) -> torch.Tensor:
        return torch.ops.fedkernels.gram(U, rows)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: torch.Tensor) -> None:
        _gram_setup(ctx, inputs, output)

    @staticmethod
    def backward(ctx: Any, gG: torch.Tensor) -> Tuple[torch.Tensor, None]:
        return _gram_backward(ctx, gG)


def _gram_vmap(
    info: Any, in_dims: Sequence[Optional[int]], U: torch.Tensor, rows: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, int]:
    dims = (tuple(in_dims) + (None,) * 2)[:2]
    return _ag.vmap_loop(torch.ops.fedkernels.gram, info, dims, (U, rows))


torch.library.register_autograd("fedkernels::gram", _gram_backward, setup_context=_gram_setup)
torch.library.register_vmap("fedkernels::gram", _gram_vmap)
