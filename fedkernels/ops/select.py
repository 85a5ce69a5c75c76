"""Per-column selection over the update rows: ``order_mean`` (median, trimmed mean) and
``closest_mean`` (Bulyan's "beta values closest to the median"), with ``_screened`` forms that return
the rows' NaN/Inf flags too.

Pure-PyTorch implementation with the agreed API of the native selection op: columns are taken in
chunks (a [k, CHUNK] float64 copy of the selected rows at a time, never K x d), sorted per column with
``torch.sort``, and the selected order statistics summed in float64. Result dtype: float64 for a
float64 ``U``, else float32. Deterministic (a sort and a fixed-order sum per column).
"""
from __future__ import annotations

from typing import Iterator, Optional, Tuple

import torch

from .._types import RowsLike
from ._checks import _matrix, _rows
from .finite_rows import finite_rows

__all__ = ["order_mean", "order_mean_screened", "closest_mean", "closest_mean_screened"]

# float64 elements of one chunk's sorted copy (k rows x columns): 16 MB
CHUNK_ELEMS = 1 << 21


def _out_dtype(U: torch.Tensor) -> torch.dtype:
    return torch.float64 if U.dtype == torch.float64 else torch.float32


def _int(v: object, op: str, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        try:
            if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_floating_point():
                return int(v)
        except (TypeError, ValueError):
            pass
        raise ValueError(f"{op}: {name} must be an int, got {v!r}")
    return int(v)


def _args(U: object, rows: RowsLike, op: str) -> Tuple[torch.Tensor, Optional[torch.Tensor], int]:
    U = _matrix(U, op)
    r = _rows(rows, U.size(0), op)
    k = U.size(0) if r is None else r.numel()
    return U, r, k


def _chunks(U: torch.Tensor, r: Optional[torch.Tensor], k: int) -> Iterator[Tuple[int, int, torch.Tensor]]:
    """(a, b, U[rows, a:b] as float64) over column chunks."""
    d = U.size(1)
    step = max(1, CHUNK_ELEMS // max(k, 1))
    idx = None if r is None else r.to(U.device)
    for a in range(0, d, step):
        b = min(d, a + step)
        c = U[:, a:b] if idx is None else U[:, a:b].index_select(0, idx)
        yield a, b, c.to(torch.float64)


def order_mean(U: torch.Tensor, lo: int, hi: int, rows: RowsLike = None) -> torch.Tensor:
    """[d]: per column, the mean of the ascending-sorted values at positions ``lo..hi-1`` (0-based)
    among the rows ``rows`` (all rows if None). Median of k rows: ``lo = (k-1)//2, hi = k//2 + 1``;
    trimmed mean: ``lo = int(beta*k), hi = k - lo``. ``0 <= lo < hi <= k``. NaN propagates (a NaN
    sorts last, as ``torch.sort`` places it)."""
    U, r, k = _args(U, rows, "order_mean")
    lo, hi = _int(lo, "order_mean", "lo"), _int(hi, "order_mean", "hi")
    if not 0 <= lo < hi <= k:
        raise ValueError(f"order_mean: need 0 <= lo < hi <= k={k} (selected rows), got lo={lo} hi={hi}")
    out = torch.empty(U.size(1), dtype=torch.float64, device=U.device)
    for a, b, c in _chunks(U, r, k):
        s = torch.sort(c, dim=0).values[lo:hi]
        out[a:b] = s.sum(0) / (hi - lo)
    return out.to(_out_dtype(U))


def order_mean_screened(U: torch.Tensor, lo: int, hi: int, rows: RowsLike = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(order_mean(U, lo, hi, rows), ok)``, ok[K] the finite flags of every row of U."""
    out = order_mean(U, lo, hi, rows)
    return out, finite_rows(U)


def closest_mean(U: torch.Tensor, beta: int, rows: RowsLike = None) -> torch.Tensor:
    """[d]: per column, the mean of the ``beta`` values closest to the column's median (the median of
    the selected rows, the mean of the two middle values for an even count, as ``np.median``). Ties in
    the distance to the median go to the smaller value (the first in ascending order)."""
    U, r, k = _args(U, rows, "closest_mean")
    beta = _int(beta, "closest_mean", "beta")
    if not 1 <= beta <= k:
        raise ValueError(f"closest_mean: beta must lie in [1, k={k}] (selected rows), got {beta}")
    out = torch.empty(U.size(1), dtype=torch.float64, device=U.device)
    for a, b, c in _chunks(U, r, k):
        s = torch.sort(c, dim=0).values
        med = (s[(k - 1) // 2] + s[k // 2]) * 0.5
        dist = (s - med).abs()
        pick = torch.sort(dist, dim=0, stable=True).indices[:beta]
        out[a:b] = s.gather(0, pick).sum(0) / beta
    return out.to(_out_dtype(U))


def closest_mean_screened(U: torch.Tensor, beta: int, rows: RowsLike = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(closest_mean(U, beta, rows), ok)``, ok[K] the finite flags of every row of U."""
    out = closest_mean(U, beta, rows)
    return out, finite_rows(U)


