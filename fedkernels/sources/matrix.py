"""The matrix-source interface (:class:`MatrixSource`: a K x d matrix read in column blocks), the
in-memory sources (:class:`TensorSource`, :class:`MemmapSource`) and the dtype and argument checks every
source shares (see the package docstring)."""

from __future__ import annotations

import abc
import mmap
import os
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .. import ops
from ..errors import BadUpdateError

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FROM_NP = {
    np.dtype(np.float16): torch.float16,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
}
PathLike = Union[str, os.PathLike]
Block = Tuple[int, int, torch.Tensor]


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def check_dtype(dtype, what: str) -> torch.dtype:
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"{what}: dtype must be one of float16, bfloat16, float32, float64, got {dtype!r}")
    return dtype


def check_pos_int(v, what: str, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{what}: {name} must be a positive int, got {v!r}")
    return int(v)


class MatrixSource(abc.ABC):
    """A K x d matrix read in column blocks (see the module docstring). Subclasses set ``K``, ``d``,
    ``dtype`` and implement ``_blocks(chunk_cols)``."""

    K: int
    d: int
    dtype: torch.dtype

    @property
    def shape(self) -> Tuple[int, int]:
        return (self.K, self.d)

    @property
    def nbytes(self) -> int:
        return self.K * self.d * itemsize(self.dtype)

    def row_name(self, k: int) -> str:
        return f"client row {k}"

    def chunks(self, chunk_cols: int, check_finite: bool = False) -> Iterator[Block]:
        """``(a, b, U[:, a:b])`` in column order; with ``check_finite`` a block with NaN/Inf raises
        BadUpdateError naming the first bad client row and the block's columns."""
        chunk_cols = check_pos_int(chunk_cols, type(self).__name__, "chunk_cols")
        for a, b, blk in self._blocks(min(chunk_cols, max(self.d, 1))):
            if check_finite:
                self.check_rows(ops.finite_rows(blk), (a, b))
            yield a, b, blk

    def check_rows(self, fin: torch.Tensor, cols: Optional[Tuple[int, int]] = None) -> None:
        """Raises BadUpdateError naming the first client row whose ``fin`` flag ([K] bool, from
        ``ops.finite_rows``) is False (and the columns ``cols = (a, b)`` screened, if given)."""
        if not bool(fin.all()):
            k = int((~fin.cpu()).nonzero()[0])
            where = f" (in columns {cols[0]}..{cols[1] - 1} of d={self.d})" if cols is not None else ""
            raise BadUpdateError(
                f"{self.row_name(k)} contains NaN/Inf{where}: the round is rejected and nothing was written"
            )

    @abc.abstractmethod
    def _blocks(self, chunk_cols: int) -> Iterator[Block]:
        """``(a, b, U[:, a:b])`` for consecutive column blocks of at most ``chunk_cols`` columns."""

    def select_rows(self, rows: Sequence[int]) -> "MatrixSource":
        """The rows ``rows`` of this source (in that order) as a source; errors keep naming the original
        rows. The identity selection is the source itself."""
        rows = [int(r) for r in rows]
        return self if rows == list(range(self.K)) else _RowSelection(self, rows)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(K={self.K}, d={self.d}, dtype={self.dtype})"


class _RowSelection(MatrixSource):
    """Rows of another source (an aggregation that excluded clients): each block is the parent's block
    with those rows gathered (a len(rows) x chunk_cols copy); ``row_name`` names the parent's row."""

    def __init__(self, parent: MatrixSource, rows: List[int]):
        if any(not 0 <= r < parent.K for r in rows):
            raise ValueError(f"select_rows: rows must lie in [0, {parent.K}), got {rows}")
        self.parent, self.rows = parent, rows
        self.K, self.d, self.dtype = len(rows), parent.d, parent.dtype
        self._idx = torch.tensor(rows, dtype=torch.long)

    def row_name(self, k: int) -> str:
        return self.parent.row_name(self.rows[k])

    def _blocks(self, chunk_cols):
        for a, b, blk in self.parent._blocks(chunk_cols):
            yield a, b, blk.index_select(0, self._idx)


class TensorSource(MatrixSource):
    """A [K, d] CPU tensor (any float dtype; ``torch.from_file(..., shared=True)`` gives a disk-backed
    one). Blocks are views (no copy); rows are made unit-stride once if they are not."""

    def __init__(self, U: torch.Tensor):
        if not isinstance(U, torch.Tensor):
            raise TypeError(f"TensorSource: U must be a torch.Tensor, got {type(U).__name__}")
        if U.dim() != 2:
            raise ValueError(f"TensorSource: U must be [K, d], got shape {tuple(U.shape)}")
        if U.device.type != "cpu":
            raise ValueError(
                f"TensorSource: U must live on the CPU (aggregate device tensors with the ops directly), got {U.device}"
            )
        check_dtype(U.dtype, "TensorSource")
        self.U = U if U.size(1) <= 1 or U.stride(1) == 1 else U.contiguous()
        self.K, self.d = U.shape
        self.dtype = U.dtype

    def _blocks(self, chunk_cols):
        for a in range(0, self.d, chunk_cols):
            b = min(self.d, a + chunk_cols)
            yield a, b, self.U[:, a:b]


class MemmapSource(MatrixSource):
    """A [K, d] NumPy array or ``np.memmap`` (float16/32/64, or uint16 with ``dtype=torch.bfloat16``).
    A writable array's blocks are views; a read-only one's are copied into a reused staging block.
    A disk-backed memmap's pages are dropped from this process after each block (bounded RSS)."""

    def __init__(self, arr: np.ndarray, dtype: Optional[torch.dtype] = None):
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"MemmapSource: arr must be a NumPy array or np.memmap, got {type(arr).__name__}")
        if arr.ndim != 2:
            raise ValueError(f"MemmapSource: arr must be [K, d], got shape {arr.shape}")
        if dtype == torch.bfloat16:
            if arr.dtype != np.uint16:
                raise ValueError(
                    f"MemmapSource: a bfloat16 memmap is stored as uint16 (NumPy has no bfloat16), got {arr.dtype}"
                )
        else:
            got = _FROM_NP.get(arr.dtype)
            if got is None or (dtype is not None and dtype != got):
                raise ValueError(
                    f"MemmapSource: arr has dtype {arr.dtype}, expected "
                    f"{dtype if dtype is not None else 'float16, float32 or float64'}"
                )
            dtype = got
        self.arr, self.dtype = arr, dtype
        self.K, self.d = arr.shape
        self._stage: Optional[torch.Tensor] = None

    def _blocks(self, chunk_cols):
        bf16 = self.dtype == torch.bfloat16
        for a in range(0, self.d, chunk_cols):
            b = min(self.d, a + chunk_cols)
            view = self.arr[:, a:b]
            if self.arr.flags.writeable:
                t = torch.from_numpy(view)
            else:  # torch needs writable memory: one staging copy
                if self._stage is None or self._stage.size(1) < b - a:
                    self._stage = torch.empty(self.K, chunk_cols, dtype=torch.int16 if bf16 else self.dtype)
                t = self._stage[:, : b - a]
                t.numpy()[...] = view
            yield a, b, (t.view(torch.bfloat16) if bf16 else t)
            self._release(a, b)

    def _release(self, a: int, b: int) -> None:
        mm = getattr(self.arr, "_mmap", None)
        if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return
        es, base, page = self.arr.itemsize, getattr(self.arr, "offset", 0), mmap.PAGESIZE
        for k in range(self.K):
            lo, hi = base + (k * self.d + a) * es, base + (k * self.d + b) * es
            lo_p, hi_p = lo // page * page, (hi + page - 1) // page * page
            try:
                mm.madvise(mmap.MADV_DONTNEED, lo_p, min(hi_p, len(mm)) - lo_p)
            except (OSError, ValueError):
                return
