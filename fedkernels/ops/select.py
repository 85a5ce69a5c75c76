"""Per-column selection over the update rows: ``order_mean``, ``order_mean_screened``, ``closest_mean``,
``closest_mean_screened`` (coordinate-wise median, trimmed mean, Bulyan's coordinate-wise step).

Per column j of the K x d update matrix ``U``, over the rows ``rows`` (all K if None; k of them), with
x_0 <= ... <= x_{k-1} the column's sorted values:

* ``order_mean(U, lo, hi)`` = (x_lo + ... + x_{hi-1}) / (hi - lo). The median: ``lo = (k - 1) // 2``,
  ``hi = k // 2 + 1`` (even k: the mean of the two middle values, as ``np.median``); the trimmed mean
  with proportion beta: ``lo = int(beta * k)``, ``hi = k - lo`` (``scipy.stats.trim_mean``, Flower's
  ``aggregate_trimmed_avg``). :func:`median_bounds` / :func:`trim_bounds` give them.
* ``closest_mean(U, beta)`` = the mean of the ``beta`` values closest to the column's median
  m = (x_a + x_{k//2}) / 2, a = (k - 1) // 2 (Bulyan, El Mhamdi et al. 2018; Flower's
  ``_aggregate_n_closest_weights`` with ``aggregate_median`` of the selected set as the reference),
  distances |x - m| in float64. At equal distance the smaller value is taken first (Flower's
  ``np.argpartition`` leaves that order unspecified), so the result depends only on the column's values,
  not on the order of the rows.

One read of U (``csrc/cpu/select.cpp``, ``csrc/cuda/select.cu``), no K x d sorted copy; the selected
values are added in float64 and divided once (the median of odd k is its middle value exactly); the
result is float64 for a float64 U, else float32; every column on its own: the same bits for any number
of threads. float64 oracle: ``fedkernels.reference.order_mean`` / ``closest_mean``.

NaN/Inf: the ``_screened`` forms also return ``ok[i] = all(isfinite(U[rows[i]]))`` ([k] bool, exact for
every dtype) from the same pass, as ``weighted_sum_screened``: drop the bad rows and call again. A
column with a NaN among its selected values gives NaN (``order_mean``: +-Inf are ordered values, so a
window that holds one is +-Inf, or NaN for both); ``closest_mean`` gives NaN for a column with any NaN
or Inf. In sharded mode (:func:`fedkernels.ops.reduce_across`) the result is column-local and the flags
are and-ed across the column shards. Not differentiable.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._types import RowsLike
from . import _autograd as _ag
from ._checks import as_op, fake_size, _matrix, _needs_kernel, _selected_rows
from .reductions import shard_and

__all__ = ["order_mean", "order_mean_screened", "closest_mean", "closest_mean_screened", "median_bounds", "trim_bounds"]


def median_bounds(k: int) -> Tuple[int, int]:
    """``(lo, hi)`` of the median of k values for :func:`order_mean`: ``((k - 1) // 2, k // 2 + 1)``."""
    return (k - 1) // 2, k // 2 + 1


def trim_bounds(k: int, beta: float) -> Tuple[int, int]:
    """``(lo, hi)`` of the trimmed mean of k values cutting ``int(beta * k)`` from each end (scipy's
    ``trim_mean``, Flower's ``_trim_mean``; 0 <= beta < 0.5) for :func:`order_mean`."""
    lo = int(beta * k)
    return lo, k - lo


def _int(x: object, op: str, name: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise ValueError(f"{op}: {name} must be an int, got {x!r}")
    return int(x)


def _prepare(U: torch.Tensor, rows: RowsLike, op: str) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[int]]:
    """U in the kernels' layout, rows as a host int64 tensor and k, the number of selected rows: None when
    U or rows has the wrong shape or dtype (the native op raises that error; a range check against a wrong
    k must not pre-empt it)."""
    U = _matrix(U, op)
    _needs_kernel(op.removesuffix("_screened"), U.device, op)  # the native op of op and op_screened
    r, k = _selected_rows(U, rows, op)
    return U, r, k


def _order_args(
    U: torch.Tensor, lo: int, hi: int, rows: RowsLike, op: str
) -> Tuple[torch.Tensor, Optional[torch.Tensor], int, int]:
    U, r, k = _prepare(U, rows, op)
    lo, hi = _int(lo, op, "lo"), _int(hi, op, "hi")
    if k is None:
        return U, r, lo, hi
    if not 0 <= lo < k:
        raise ValueError(f"{op}: lo must be in [0, k) = [0, {k}) (k = the number of selected rows), got lo={lo}")
    if not lo < hi <= k:
        raise ValueError(f"{op}: hi must be in (lo, k] = ({lo}, {k}] (k = the number of selected rows), got hi={hi}")
    return U, r, lo, hi


def _closest_args(
    U: torch.Tensor, beta: int, rows: RowsLike, op: str
) -> Tuple[torch.Tensor, Optional[torch.Tensor], int]:
    U, r, k = _prepare(U, rows, op)
    beta = _int(beta, op, "beta")
    if k is not None and not 1 <= beta <= k:
        raise ValueError(f"{op}: beta must be in [1, k] = [1, {k}] (k = the number of selected rows), got beta={beta}")
    return U, r, beta


def order_mean_screened(U: torch.Tensor, lo: int, hi: int, rows: RowsLike = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(order_mean(U, lo, hi, rows), ok)``: ok[i] = all(isfinite(U[rows[i]])) ([k] bool on U's device)
    from the same pass over U."""
    U, r, lo, hi = _order_args(U, lo, hi, rows, "order_mean_screened")
    out, ok = as_op("order_mean_screened", "order_mean", _ag.call, torch.ops.fedkernels.order_mean, U, lo, hi, r)
    return _ag.no_derivative("order_mean", out, U), shard_and(ok)


def order_mean(U: torch.Tensor, lo: int, hi: int, rows: RowsLike = None) -> torch.Tensor:
    """Per column, the mean of the sorted values at positions ``lo..hi-1`` (0-based, ascending) among the
    rows ``rows`` (all rows if None): [d], float64 for a float64 U, else float32 (see the module).

    U: [K, d] float16/bfloat16/float32/float64 (any row stride); ``0 <= lo < hi <= k``. A column with a
    NaN among the selected values gives NaN; use :func:`order_mean_screened` for the rows' flags.
    """
    U, r, lo, hi = _order_args(U, lo, hi, rows, "order_mean")
    out, _ = _ag.call(torch.ops.fedkernels.order_mean, U, lo, hi, r)
    return _ag.no_derivative("order_mean", out, U)


def closest_mean_screened(U: torch.Tensor, beta: int, rows: RowsLike = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(closest_mean(U, beta, rows), ok)``: ok[i] = all(isfinite(U[rows[i]])) ([k] bool on U's device)
    from the same pass over U."""
    U, r, beta = _closest_args(U, beta, rows, "closest_mean_screened")
    out, ok = as_op("closest_mean_screened", "closest_mean", _ag.call, torch.ops.fedkernels.closest_mean, U, beta, r)
    return _ag.no_derivative("closest_mean", out, U), shard_and(ok)


def closest_mean(U: torch.Tensor, beta: int, rows: RowsLike = None) -> torch.Tensor:
    """Per column, the mean of the ``beta`` values closest to the column's median among the rows ``rows``
    (Bulyan's coordinate-wise step): [d], float64 for a float64 U, else float32 (see the module).

    U: [K, d] float16/bfloat16/float32/float64 (any row stride); ``1 <= beta <= k``. A column with a NaN
    or Inf among the selected values gives NaN; use :func:`closest_mean_screened` for the rows' flags.
    """
    U, r, beta = _closest_args(U, beta, rows, "closest_mean")
    out, _ = _ag.call(torch.ops.fedkernels.closest_mean, U, beta, r)
    return _ag.no_derivative("closest_mean", out, U)


# ---- fake (meta) kernels, so the ops work under torch.compile / opcheck ----------------------------
def _fake(U: torch.Tensor, rows: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    k = fake_size(U, 0) if rows is None else fake_size(rows, 0)
    dt = torch.float64 if U.dtype == torch.float64 else torch.float32
    return U.new_empty((fake_size(U, 1),), dtype=dt), U.new_empty((k,), dtype=torch.bool)


@torch.library.register_fake("fedkernels::order_mean")
def _order_mean_fake(
    U: torch.Tensor, lo: int, hi: int, rows: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    return _fake(U, rows)


@torch.library.register_fake("fedkernels::closest_mean")
def _closest_mean_fake(
    U: torch.Tensor, beta: int, rows: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    return _fake(U, rows)


_ag.no_derivative_op("order_mean", "a selection: differentiate reference.order_mean instead")
_ag.no_derivative_op("closest_mean", "a selection: differentiate reference.closest_mean instead")
