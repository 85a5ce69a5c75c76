"""The NaN/Inf screen of the update rows: ``finite_rows``.

One read of the K x d update matrix ``U`` (``csrc/cpu/finite_rows.cpp``, ``csrc/cuda/finite_rows.cu``);
float64 oracle: ``fedkernels.reference.finite_rows``. In sharded mode (:func:`fedkernels.ops.reduce_across`)
the flags of the column shards are combined across ranks.
"""

from __future__ import annotations

import torch

from ._checks import fake_size, _matrix, _needs_kernel
from .reductions import shard_and

__all__ = ["finite_rows"]


def finite_rows(U: torch.Tensor) -> torch.Tensor:
    """[K] bool: True where row k of U holds only finite values. One read of U, no K x d temporary.

    U: [K, d] float16/bfloat16/float32/float64 (any row stride; the native op checks it)."""
    U = _matrix(U, "finite_rows")
    _needs_kernel("finite_rows", U.device, "finite_rows")
    return shard_and(torch.ops.fedkernels.finite_rows(U))


# ---- fake (meta) kernels, so the ops work under torch.compile / opcheck ------------------------
@torch.library.register_fake("fedkernels::finite_rows")
def _finite_rows_fake(U: torch.Tensor) -> torch.Tensor:
    return U.new_empty((fake_size(U, 0),), dtype=torch.bool)
