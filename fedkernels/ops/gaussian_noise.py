"""The Gaussian noise of the differential-privacy mechanism: ``add_gaussian_noise_``,
``weighted_sum_noised``, ``philox_normal``.

``N(seed, counter, j)`` is a standard normal that is a pure function of the seed, a counter (the DP
wrapper passes the round) and the column ``j``: Philox4x32-10 of the column pair ``j // 2`` and
Box-Muller, written once as host/device code (``csrc/cuda/gaussian_noise.cuh``) for the CPU kernel
(``csrc/cpu/gaussian_noise.cpp``) and the CUDA kernels, so every device, thread count and chunking
draws the same noise bits, and a resumed run draws the same noise. float64 oracle with the same bits:
``fedkernels.reference.philox_normal``. Not a cryptographic generator: see docs/privacy.md.

The noise is added in the output write: ``weighted_sum_noised`` is ``weighted_sum`` (same pass, same
arguments) plus ``sigma * N`` per column; ``add_gaussian_noise_`` noises a vector in place (for a
method whose new model is not a weighted sum). Rounding: a float64 result gets ``fma(sigma, n, v)``,
any other dtype ``v + float(sigma * n)`` in float32, then one rounding to the dtype.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .._types import CoefLike, RowsLike
from . import _autograd as _ag
from ._checks import fake_devices, fake_size, _finite_number, _matrix, _needs_kernel, _no_grad_through, _tensor
from .reductions import active_reducer
from .weighted_sum import _host_rows_coef, _result_args

__all__ = ["add_gaussian_noise_", "weighted_sum_noised", "philox_normal", "MAX_COUNTER"]

MAX_COUNTER = (1 << 63) - 1  # seed, counter and offset are non-negative int64 (read as uint64 by the kernels)


def _noise_args(op: str, sigma: object, seed: object, counter: object, offset: object) -> float:
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not math.isfinite(sigma) or sigma < 0:
        raise ValueError(f"{op}: sigma must be a finite number >= 0, got {sigma!r}")
    for name, v in (("seed", seed), ("counter", counter), ("offset", offset)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_COUNTER:
            raise ValueError(f"{op}: {name} must be an int in [0, 2^63 - 1], got {v!r}")
    if active_reducer() is not None:
        raise ValueError(
            f"{op}: not available in sharded mode (a column shard's index is not its global column); "
            "noise the gathered result, or pass offset= with the shard's first column"
        )
    return float(sigma)


def add_gaussian_noise_(x: torch.Tensor, sigma: float, seed: int, counter: int, offset: int = 0) -> torch.Tensor:
    """In place: ``x[j] += sigma * N(seed, counter, offset + j)`` over x's flat (contiguous) index ``j``;
    returns x. x: float16/bfloat16/float32/float64 on any device with a kernel; ``offset``: the global
    column of x[0] when x is a block of a longer vector (the noise of a vector does not depend on how it
    is cut). ``sigma = 0`` leaves x unchanged. Not differentiable."""
    op = "add_gaussian_noise_"
    x = _tensor(x, op, "x")  # its dtype and contiguity: the native op's (csrc/gaussian_noise_checks.h)
    s = _noise_args(op, sigma, seed, counter, offset)
    _needs_kernel("add_gaussian_noise_", x.device, op)
    _no_grad_through(op, x)
    torch.ops.fedkernels.add_gaussian_noise_(x, s, seed, counter, offset)
    return x


def weighted_sum_noised(
    U: torch.Tensor,
    coef: CoefLike,
    base: Optional[torch.Tensor] = None,
    alpha: float = 1.0,
    rows: RowsLike = None,
    *,
    sigma: float,
    seed: int,
    counter: int,
    offset: int = 0,
) -> torch.Tensor:
    """``base + alpha * sum_i coef[i] U[rows[i]] + sigma * N(seed, counter, offset + j)`` per column j, in
    one pass over the selected rows (the noise drawn and added in the output write). Arguments and
    result dtype as :func:`fedkernels.ops.weighted_sum`; ``sigma = 0`` gives weighted_sum's bits. The
    central-DP aggregate of DP-FedAvg: ``coef`` = the clip factors / m, ``sigma`` = z C / m. Not
    differentiable."""
    op = "weighted_sum_noised"
    U = _matrix(U, op)
    _needs_kernel(op, U.device, op)
    r, c = _host_rows_coef(U, rows, coef, op)
    a = _finite_number(alpha, op, "alpha")
    s = _noise_args(op, sigma, seed, counter, offset)
    _, base = _result_args(None, base, op)
    _no_grad_through(op, U, c, base)
    return torch.ops.fedkernels.weighted_sum_noised(U, c, base, a, r, s, seed, counter, offset)


def philox_normal(n: int, seed: int, counter: int, j0: int = 0) -> torch.Tensor:
    """The normals themselves, ``N(seed, counter, j0 + i)`` for i < n, float64 on the CPU (the bits every
    kernel adds; ``fedkernels.reference.philox_normal`` computes the same bits in Python)."""
    op = "philox_normal"
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{op}: n must be an int >= 0, got {n!r}")
    _noise_args(op, 0.0, seed, counter, j0)
    return torch.ops.fedkernels.philox_normal(n, seed, counter, j0)


# ---- fake (meta) kernels, so the ops work under torch.compile / opcheck ----------------------------
@torch.library.register_fake("fedkernels::add_gaussian_noise_")
def _noise_fake(x: torch.Tensor, sigma: float, seed: int, counter: int, offset: int = 0) -> None:
    return None


@torch.library.register_fake("fedkernels::weighted_sum_noised")
def _wsn_fake(
    U: torch.Tensor,
    coef: torch.Tensor,
    base: Optional[torch.Tensor],
    alpha: float,
    rows: Optional[torch.Tensor],
    sigma: float,
    seed: int,
    counter: int,
    offset: int = 0,
) -> torch.Tensor:
    fake_devices("weighted_sum_noised", U, "U is on", base=base)
    return U.new_empty((fake_size(U, 1),), dtype=base.dtype if base is not None else U.dtype)


@torch.library.register_fake("fedkernels::philox_normal")
def _pn_fake(n: int, seed: int, counter: int, j0: int = 0) -> torch.Tensor:
    return torch.empty((n,), dtype=torch.float64)


_ag.no_derivative_op("weighted_sum_noised", "the noise has no derivative; differentiate ops.weighted_sum instead")
