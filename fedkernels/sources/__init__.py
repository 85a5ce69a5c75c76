"""Matrix sources: one interface over a K x d update matrix, in memory or on disk, read in column blocks.

A server receives K client updates of d parameters. Where they live differs (a tensor in memory, a
NumPy / torch memmap, one raw file holding all K rows, one file per client as a real server writes
them on arrival); what an aggregation needs is the same: the columns ``[a, b)`` of all K rows, in
column order, one block at a time. ``MatrixSource`` is that interface:

* ``K``, ``d``, ``dtype`` (float16, bfloat16, float32 or float64), ``shape``;
* ``chunks(chunk_cols, check_finite=False)`` yields ``(a, b, block)`` for ``a = 0, c, 2c, ...`` with
  ``block`` a [K, b - a] CPU tensor whose rows are contiguous (unit column stride; in-memory sources
  give views, file sources a reused staging buffer: the block is valid until the next one). With
  ``check_finite`` each block is screened with ``ops.finite_rows`` and the first client row holding
  NaN/Inf raises ``BadUpdateError`` naming the row (and its file) and the columns;
* ``row_name(k)``: how errors name client row k (``client row 3`` or ``client row 3 (c3.bin)``).

Implementations: ``TensorSource`` (a [K, d] CPU tensor, e.g. from ``torch.from_file``),
``MemmapSource`` (a [K, d] NumPy array or ``np.memmap``; a uint16 memmap read as bfloat16 with
``dtype=torch.bfloat16``, since NumPy has no bfloat16; pages of a disk-backed memmap are released
after each block so the resident set stays bounded), ``RawFileSource`` (a raw little-endian
row-major file, read with ``os.preadv`` into a staging tensor: any of the four dtypes, bf16 included,
no NumPy dtype involved) and ``ClientFilesSource`` (a list of K raw files of d elements each, one per
client row). ``as_source(x, ...)`` builds the right one. ``ChunkedUpdates`` reads a source ``chunk_cols``
columns at a time onto a device (to a GPU through two pinned staging blocks and a copy stream, the
copy of chunk i+1 overlapping the work on chunk i: :func:`overlapped`; ``device="auto"``: the CPU or
the GPU, whichever runs the method's round sooner, :func:`pick_device`); every ``Aggregator.aggregate``
takes either as its ``updates`` (``fedkernels.algorithms.base.RoundInput`` reads them chunk by chunk),
and ``select_rows`` keeps the accepted clients' rows when some are excluded, errors still naming the
original rows.

Validation happens at construction, before anything is read: the dtype, the shape, and for files
their sizes, exactly (a file of another dtype or shape has another size): a short file names the
client row (and file) that is short. Row-by-row reads cost K ``preadv`` calls per block; a file
source reads at least READ_BYTES per block (handed out ``chunk_cols`` columns at a time) into two
staging blocks: a reader thread fills the next while the caller works on the current one
(``prefetch=False``: one block, reads and arithmetic in turn). Measured on the
2-core VM (a 6.4 GB file, K = 16, its pages dropped before each read, other jobs running): ``chunks()``
alone with 64 MB blocks (4 MB per row read) 1.0-1.8 GB/s, ``dd bs=16M`` 0.3-1.3 GB/s; 16 or 64 MB per
row, ``POSIX_FADV_SEQUENTIAL``, the K rows read by 4 or 16 threads, or ``WILLNEED`` two blocks ahead
with ``DONTNEED`` behind (which keeps the page cache from growing by the file's size) were no faster.
What they cost is CPU: buffered reads spend system time copying out of the page cache and reclaiming
it, which a 2-core machine takes from the arithmetic; a file source larger than the available memory
therefore reads with ``O_DIRECT`` (``direct``, see ``_FileRows``): streamed FedAvg over that cold
6.4 GB file, 1 torch thread, took 6.3-12.4 s with direct reads (0.4-1.1 s system CPU) and 23.7-29.5 s
with buffered ones (12.6-14.3 s system CPU).
"""

from __future__ import annotations

import abc
import copy
import functools
import inspect
import itertools
import mmap
import os
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .. import ops
from .._memory import available_bytes
from ..errors import BadUpdateError
from ..ops._checks import has_kernel
from ..ops.weighted_sum import out_dtypes

__all__ = [
    "MatrixSource",
    "TensorSource",
    "MemmapSource",
    "RawFileSource",
    "ClientFilesSource",
    "as_source",
    "ChunkedUpdates",
    "overlapped",
    "CudaCalls",
    "pick_device",
    "cpu_read_gbps",
    "h2d_gbps",
    "cpu_gram_gbps",
    "PASSES",
    "HOST",
    "round_passes",
    "round_seconds",
    "staging_gbps",
    "weighted_sum_block",
    "FLOAT_DTYPES",
    "itemsize",
    "BlockCodeFile",
    "PackedRows",
]

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


def _check_dtype(dtype, what: str) -> torch.dtype:
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
        _check_dtype(U.dtype, "TensorSource")
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


READ_BYTES = 64 << 20  # a file source reads at least this much per block (all K rows: 4 MB per row at K = 16)
ALIGN = 4096  # direct reads (O_DIRECT): file offsets, lengths and buffer addresses in multiples of this


def _aligned(nbytes: int) -> torch.Tensor:
    """A [nbytes] uint8 CPU tensor whose first byte is ALIGN-aligned."""
    t = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = -t.data_ptr() % ALIGN
    return t[skip : skip + nbytes]


class _FileRows(MatrixSource):
    """Shared by the file sources: row k is read from ``self._where(k) = (file index, byte offset)``
    with ``os.preadv`` into a [K, chunk_cols] staging tensor (any dtype: bytes are copied, no NumPy
    dtype needed).

    ``direct``: read with ``O_DIRECT`` (the disk DMAs into the staging block: no copy out of the page
    cache, no page-cache pages to allocate and reclaim, the cache is left to the rest of the machine).
    None (default): when the source is larger than the available memory (its pages could not stay
    cached for a next pass anyway). Measured on the 2-core VM, a cold 6.4 GB file, K = 16: buffered
    reads spent 3.4-9.2 s of system CPU, direct ones none. Direct reads need the rows' byte offsets
    to be multiples of the itemsize and to step by the same amount modulo ALIGN (true of both file
    sources); the staging rows are then spaced so that each row's first byte lands at an address
    congruent to its file offset, and each row is one aligned read straight into place. A file system
    that refuses O_DIRECT at open, ``pin_memory``, or offsets that do not fit: buffered reads.
    ``read_mode``: how the last pass read ("buffered" or "direct")."""

    paths: List[str]
    _CODE_DTYPES: Tuple[torch.dtype, ...] = ()  # non-float element types a subclass reads (BlockCodeFile's codes)

    def __init__(self, dtype, pin_memory: bool = False, prefetch: bool = True, direct: Optional[bool] = None):
        self.dtype = dtype if dtype in self._CODE_DTYPES else _check_dtype(dtype, type(self).__name__)
        self._es = itemsize(self.dtype)
        self._pin = bool(pin_memory)
        self.prefetch = bool(prefetch)
        if direct is not None and not isinstance(direct, bool):
            raise ValueError(f"{type(self).__name__}: direct must be None, True or False, got {direct!r}")
        self.direct = direct
        self.read_mode: Optional[str] = None
        self._stage: List[torch.Tensor] = []
        self._dstage: List[torch.Tensor] = []

    @abc.abstractmethod
    def _where(self, k: int) -> Tuple[int, int]:
        """(file index, byte offset) of row k's first element."""

    def _staging(self, chunk_cols: int, n: int) -> List[torch.Tensor]:
        if len(self._stage) < n or self._stage[0].size(1) < chunk_cols:
            pin = self._pin and torch.cuda.is_available()
            self._stage = [torch.empty(self.K, chunk_cols, dtype=self.dtype, pin_memory=pin) for _ in range(n)]
        return self._stage[:n]

    def _read(self, fds, st: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """Columns [a, b) of every row into ``st`` (K preadv calls; they release the GIL)."""
        raw = st.view(torch.uint8).numpy()  # [K, chunk_cols * itemsize] bytes
        es = self._es
        nb = (b - a) * es
        for k in range(self.K):
            f, off = self._where(k)
            dst = memoryview(raw[k, :nb])
            pos, got = off + a * es, 0
            while got < nb:
                r = os.preadv(fds[f], [dst[got:]], pos + got)
                if r <= 0:  # the file shrank after validation
                    self._short(k, f, pos + got)
                got += r
        return st[:, : b - a]

    def _short(self, k: int, f: int, at: int):
        raise OSError(f"{type(self).__name__}: short read of {self.row_name(k)} from {self.paths[f]} at byte {at}")

    # ---- direct reads ------------------------------------------------------------------------------------
    def _direct_stride(self, chunk_cols: int) -> Optional[int]:
        """Bytes between two staging rows for direct reads (at least a row's block + 2 ALIGN, congruent
        modulo ALIGN to the step between two rows' file offsets), or None when the offsets do not allow it."""
        if self._pin or not hasattr(os, "O_DIRECT"):
            return None
        if self.direct is None:
            free = available_bytes("cpu")
            if free is None or self.nbytes <= free:
                return None
        elif not self.direct:
            return None
        es, w0 = self._es, self._where(0)[1]
        g = (self._where(1)[1] - w0) % ALIGN if self.K > 1 else 0
        if w0 % es or any((self._where(k)[1] - w0 - k * g) % ALIGN for k in range(self.K)):
            return None
        return (chunk_cols * es + 2 * ALIGN) // ALIGN * ALIGN + g

    def _read_direct(self, fds, buf: torch.Tensor, a: int, b: int, stride: int) -> torch.Tensor:
        """Columns [a, b) of every row by direct reads into ``buf`` (ALIGN-aligned): row k's bytes land at
        ``base + k * stride`` with ``base`` congruent to row 0's file offset, so each row is one aligned
        read (up to ALIGN - 1 bytes before and after it land in the gap between rows)."""
        es = self._es
        nb = (b - a) * es
        mv = memoryview(buf.numpy())
        base = (self._where(0)[1] + a * es) % ALIGN
        for k in range(self.K):
            f, off = self._where(k)
            pos = off + a * es
            head = pos % ALIGN  # = (base + k * stride) % ALIGN
            dst = base + k * stride - head  # aligned
            need, want = head + nb, -(-(head + nb) // ALIGN) * ALIGN
            got = 0
            while got < need:
                r = os.preadv(fds[f], [mv[dst + got : dst + want]], pos - head + got)
                if r <= 0:  # the file shrank after validation
                    self._short(k, f, pos - head + got)
                got += r
        rows = buf[base : base + (self.K - 1) * stride + nb].view(self.dtype)
        return rows.as_strided((self.K, b - a), (stride // es, 1))

    def _open(self, chunk_cols: int, n: int):
        """(fds, n staging buffers, read function) of one pass: direct reads where ``_direct_stride``
        allows them and the files open with O_DIRECT, else buffered reads."""
        stride = self._direct_stride(chunk_cols)
        fds: List[int] = []
        if stride is not None:
            try:
                for p in self.paths:
                    fds.append(os.open(p, os.O_RDONLY | os.O_DIRECT))
            except OSError:  # (a file system without O_DIRECT)
                for fd in fds:
                    os.close(fd)
                fds, stride = [], None
        if stride is None:
            self.read_mode = "buffered"
            return [os.open(p, os.O_RDONLY) for p in self.paths], self._staging(chunk_cols, n), self._read
        self.read_mode = "direct"
        size = self.K * stride + 2 * ALIGN
        if len(self._dstage) < n or self._dstage[0].numel() < size:
            self._dstage = [_aligned(size) for _ in range(n)]
        return fds, self._dstage[:n], functools.partial(self._read_direct, stride=stride)

    def _blocks(self, chunk_cols):
        """Reads of at least READ_BYTES (all K rows; a whole number of chunks, or all of d), handed out
        ``chunk_cols`` columns at a time (views of the staging block): the disk sees large requests
        whatever width the caller works in."""
        per = max(1, READ_BYTES // max(1, self.K * self._es * chunk_cols))
        read_cols = min(per * chunk_cols, self.d)
        for a0, b0, blk in self._reads(read_cols):
            for a in range(a0, b0, chunk_cols):
                b = min(b0, a + chunk_cols)
                yield a, b, blk[:, a - a0 : b - a0]

    def _reads(self, read_cols):
        """With ``prefetch`` (default) a reader thread fills the other of two staging blocks with the
        next columns while the caller works on this one (disk reads overlap the arithmetic)."""
        spans = [(a, min(self.d, a + read_cols)) for a in range(0, self.d, read_cols)]
        n = 1 if not self.prefetch or len(spans) == 1 else 2
        fds, bufs, read = self._open(read_cols, n)
        try:
            if n == 1:
                for a, b in spans:
                    yield a, b, read(fds, bufs[0], a, b)
                return
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(1, thread_name_prefix="fedkernels-read") as pool:
                nxt = pool.submit(read, fds, bufs[0], *spans[0])
                for i, (a, b) in enumerate(spans):
                    blk = nxt.result()  # block i; the caller has finished with block i-1
                    if i + 1 < len(spans):
                        nxt = pool.submit(read, fds, bufs[(i + 1) % 2], *spans[i + 1])
                    yield a, b, blk
        finally:
            for fd in fds:
                os.close(fd)


class RawFileSource(_FileRows):
    """One raw little-endian row-major file holding K x d elements of ``dtype`` after ``offset``
    header bytes. Its size must be exactly ``offset + K * d * itemsize``: a short file names the first
    client row that is incomplete; a longer one (another dtype or shape) is refused too."""

    def __init__(
        self,
        path: PathLike,
        K: int,
        d: int,
        dtype: torch.dtype = torch.float32,
        offset: int = 0,
        pin_memory: bool = False,
        prefetch: bool = True,
        direct: Optional[bool] = None,
    ):
        super().__init__(dtype, pin_memory, prefetch, direct)
        what = "RawFileSource"
        self.K, self.d = check_pos_int(K, what, "K"), check_pos_int(d, what, "d")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"{what}: offset must be an int >= 0, got {offset!r}")
        self.path, self.offset = os.fspath(path), offset
        self.paths = [self.path]
        if not os.path.isfile(self.path):
            raise ValueError(f"{what}: path {self.path!r} is not a file")
        size, row = os.path.getsize(self.path), self.d * self._es
        need = offset + self.K * row
        if size < need:
            k = max(0, (size - offset)) // row
            raise ValueError(
                f"{what}: {self.path} has {size} bytes, need {need} for K={self.K} x d={self.d} "
                f"{self.dtype} (+{offset} header): client row {k} is short (ends at byte "
                f"{offset + (k + 1) * row})"
            )
        if size > need:
            raise ValueError(
                f"{what}: {self.path} has {size} bytes, expected exactly {need} for K={self.K} x "
                f"d={self.d} {self.dtype} (+{offset} header): wrong dtype or shape?"
            )

    def _where(self, k):
        return 0, self.offset + k * self.d * self._es


class ClientFilesSource(_FileRows):
    """K raw little-endian files of d elements of ``dtype`` each, client row k from ``paths[k]`` (as a
    server stores the updates it receives). Each size must be exactly ``d * itemsize``; an error names
    the client row and its file."""

    def __init__(
        self,
        paths: Sequence[PathLike],
        d: int,
        dtype: torch.dtype = torch.float32,
        pin_memory: bool = False,
        prefetch: bool = True,
        direct: Optional[bool] = None,
    ):
        super().__init__(dtype, pin_memory, prefetch, direct)
        what = "ClientFilesSource"
        if isinstance(paths, (str, os.PathLike)) or not len(paths):
            raise ValueError(f"{what}: paths must be a non-empty list of files (one per client row), got {paths!r}")
        self.paths = [os.fspath(p) for p in paths]
        self.K, self.d = len(self.paths), check_pos_int(d, what, "d")
        need = self.d * self._es
        for k, p in enumerate(self.paths):
            if not os.path.isfile(p):
                raise ValueError(f"{what}: {self.row_name(k)}: {p!r} is not a file")
            size = os.path.getsize(p)
            if size != need:
                kind = "short" if size < need else "too long (wrong dtype or d?)"
                raise ValueError(
                    f"{what}: {self.row_name(k)} is {kind}: {p} has {size} bytes, expected {need} "
                    f"(d={self.d} x {self.dtype})"
                )

    def row_name(self, k: int) -> str:
        return f"client row {k} ({self.paths[k]})"

    def _where(self, k):
        return k, 0


# ---- chunk plumbing: a source read in column chunks on a device -----------------------------------------
DEFAULT_CHUNK_BYTES = 64 << 20  # staging memory per chunk (all K rows) delivered to a device
# ... and on the CPU: a method's per-chunk temporaries (FedAWARE's gathered table rows) stay below glibc's
# largest mmap threshold (32 MB), so malloc reuses them instead of mapping (and faulting in) fresh pages
# for every chunk: the streamed FedAWARE round at K = 16, d = 1e8 bf16 took 2.35M page faults and
# 16.7-26.7 s with 64 MB chunks, 43-48K and 11.9-16.8 s with 16 MB ones (file reads stay READ_BYTES)
CPU_CHUNK_BYTES = 16 << 20


class ChunkedUpdates:
    """A K x d update matrix read ``chunk_cols`` columns at a time: what ``Aggregator.aggregate`` takes
    as ``updates`` besides a tensor (a bare ``MatrixSource`` is wrapped with the default width).

    source: a ``MatrixSource`` or what :func:`as_source` takes: a [K, d] CPU tensor, a [K, d] NumPy
    array / np.memmap, a path to a raw row-major file (then ``K``, ``d``, ``dtype`` (default float32)
    and optionally ``offset`` in bytes are required) or a list of per-client files (``d`` and
    ``dtype``). chunk_cols: columns per chunk (default, for all K rows: ``CPU_CHUNK_BYTES`` on the CPU,
    ``DEFAULT_CHUNK_BYTES`` of staging on a device). device: where chunks are delivered (default CPU); to a CUDA device through two pinned
    staging blocks and a copy stream, overlapped with the caller's work (:func:`overlapped`);
    ``"auto"``: the CPU or the GPU, whichever runs a round of ``method`` on this host-resident source
    sooner (:func:`pick_device`: ``method`` an aggregator, or its passes; default one weighted sum), the
    choice and its reason in ``placement`` (None for a given device); ``Aggregator.aggregate`` picks again
    for its own method (:meth:`aggregate_placed`), runs there and returns its result on ``global_flat``'s
    device, with ``info["device"]`` the choice and its reason.
    """

    def __init__(
        self,
        source,
        K: Optional[int] = None,
        d: Optional[int] = None,
        dtype: Optional[torch.dtype] = None,
        chunk_cols: Optional[int] = None,
        device=None,
        offset: int = 0,
        method=None,
    ):
        self.placement: Optional[str] = None
        self.auto = isinstance(device, str) and device == "auto"  # aggregate_placed picks again for its method
        try:
            self.device = torch.device("cpu" if device is None or self.auto else device)
        except (RuntimeError, TypeError):
            raise ValueError(
                f"ChunkedUpdates: device must be 'auto', a device name ('cpu', 'cuda', 'cuda:1') or a "
                f"torch.device, got {device!r}"
            ) from None
        self.source: MatrixSource = as_source(source, K, d, dtype, offset, what="ChunkedUpdates")
        self.K, self.d, self.dtype = self.source.K, self.source.d, self.source.dtype
        for name, v, got in (("K", K, self.K), ("d", d, self.d)):
            if v is not None and v != got:
                raise ValueError(f"ChunkedUpdates: {name}={v} but the source has {name}={got}")
        if self.auto:
            self.device, self.placement = pick_device(method, self.source)
        self._cols_given = chunk_cols is not None
        if chunk_cols is None:
            per = CPU_CHUNK_BYTES if self.device.type == "cpu" else DEFAULT_CHUNK_BYTES
            chunk_cols = max(1024, per // max(1, self.K * itemsize(self.dtype)))
        self.chunk_cols = min(check_pos_int(chunk_cols, "ChunkedUpdates", "chunk_cols"), max(self.d, 1))

    @property
    def shape(self) -> Tuple[int, int]:
        return (self.K, self.d)

    @property
    def staging_bytes(self) -> int:
        return self.K * self.chunk_cols * itemsize(self.dtype)

    def row_name(self, k: int) -> str:
        return self.source.row_name(k)

    def select_rows(self, rows: Sequence[int]) -> "ChunkedUpdates":
        """The same reader (width, device) over the rows ``rows`` of the source."""
        sel = self.source.select_rows(rows)
        return self if sel is self.source else ChunkedUpdates(sel, chunk_cols=self.chunk_cols, device=self.device)

    def on(self, device) -> "ChunkedUpdates":
        """This reader delivering to ``device`` (itself if it already does)."""
        device = torch.device(device)
        if device == self.device or (device.type == self.device.type == "cpu"):
            return self
        return ChunkedUpdates(self.source, chunk_cols=self.chunk_cols, device=device)

    def chunks(self) -> Iterator[Block]:
        """Yields ``(a, b, U[:, a:b])`` on ``device`` in column order; valid until the next one. A
        chunk already on ``device`` is yielded as is; to CUDA the copies overlap the caller's work."""
        blocks = iter(self.source.chunks(self.chunk_cols))
        first = next(blocks, None)
        if first is None:
            return
        blocks = itertools.chain([first], blocks)
        if self.device.type == "cuda" and first[2].device != self.device:
            yield from overlapped(blocks, self.K, self.chunk_cols, self.dtype, CudaCalls(self.device))
            return
        for a, b, c in blocks:  # on the CPU, or already on the device: no staging
            yield a, b, (c if c.device == self.device or self.device.type == "cpu" else c.to(self.device))

    def aggregate_placed(self, aggregator, global_flat: torch.Tensor, num_examples, client_ids=None, payloads=None):
        """``aggregator.aggregate(global_flat, updates, ...)`` run on ``self.device``, or with ``device="auto"``
        where :func:`pick_device` puts a round of that aggregator (``Aggregator.aggregate``'s hook):
        ``global_flat`` (and tensors in ``payloads``) moved there once if it lives elsewhere, the new model
        moved back once to ``global_flat``'s device, and ``info["device"]`` set to the choice and its reason
        (for a given device: ``"<device>: as given"``)."""
        dev, placement = self.device, self.placement
        if self.auto:
            dev, placement = pick_device(aggregator, self.source)
        cols = self.chunk_cols if self._cols_given or dev == self.device else None  # (a default width: the device's)
        fixed = ChunkedUpdates(self.source, chunk_cols=cols, device=dev)
        home = global_flat.device if isinstance(global_flat, torch.Tensor) else dev
        g = global_flat.to(dev) if home != dev else global_flat  # (a bad global_flat: aggregate names it)
        if payloads is not None and home != dev:
            payloads = [
                {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in p.items()} if isinstance(p, dict) else p
                for p in payloads
            ]
        params, info = res = aggregator.aggregate(g, fixed, num_examples, client_ids, payloads)
        info["device"] = placement if placement is not None else f"{dev}: as given"
        return type(res)(params.to(home) if params.device != home else params, info)

    def __repr__(self) -> str:
        return f"ChunkedUpdates({self.source!r}, chunk_cols={self.chunk_cols}, device={self.device})"


# ---- host -> CUDA: copies overlapped with compute --------------------------------------------------------
class CudaCalls:
    """The CUDA calls :func:`overlapped` makes (a CPU test drives the same schedule with fake streams
    and events): the caller's (compute) stream, one copy stream per device, pinned and device buffers,
    events."""

    _copy_streams: Dict[torch.device, "torch.cuda.Stream"] = {}

    def __init__(self, device: torch.device):
        self.device = device
        self.compute = torch.cuda.current_stream(device)
        if device not in self._copy_streams:
            self._copy_streams[device] = torch.cuda.Stream(device)
        self.copy = self._copy_streams[device]

    def buffers(self, numel: int, dtype: torch.dtype) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """Two flat pinned host buffers and two flat device buffers of ``numel`` elements."""
        host = [torch.empty(numel, dtype=dtype, pin_memory=True) for _ in range(2)]
        dev = [torch.empty(numel, dtype=dtype, device=self.device) for _ in range(2)]
        for t in dev:  # once freed, their memory also waits for the copy stream's work
            t.record_stream(self.copy)
        return host, dev

    def fill(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)  # host memcpy into pinned memory

    def h2d(self, dst: torch.Tensor, src: torch.Tensor):
        """Copies ``src`` (pinned) to ``dst`` on the copy stream; returns the event of its end."""
        with torch.cuda.stream(self.copy):
            dst.copy_(src, non_blocking=True)
        return self.record(self.copy)

    def record(self, stream):
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def wait(self, stream, ev) -> None:  # device side: ``stream`` runs on after ``ev``
        stream.wait_event(ev)

    def sync(self, ev) -> None:  # host side: returns after ``ev``
        ev.synchronize()


def overlapped(blocks: Iterable[Block], K: int, width: int, dtype: torch.dtype, cuda) -> Iterator[Block]:
    """Host blocks ``(a, b, [K, b - a])`` (at most ``width`` columns) delivered to the device with the
    copies overlapped: before chunk i is yielded, chunk i+1 is staged into pinned buffer host[(i+1) % 2]
    and its host-to-device copy into dev[(i+1) % 2] is queued on the copy stream, so it runs while the
    caller's kernels on chunk i run on the compute stream. Reuse is ordered by events:

    * host[s] is refilled only after the copy out of it finished (``sync`` on ``copied[s]``, host side);
    * dev[s] is overwritten only after the compute that read it finished (the copy stream waits on
      ``used[s]``, recorded on the compute stream when the caller asks for the next chunk);
    * chunk i is yielded after the compute stream waits on its copy (``copied[s]``).

    A yielded chunk is a contiguous [K, b - a] view of a device buffer, valid until the next one; the
    caller consumes it on the compute stream (the current stream). ``cuda``: :class:`CudaCalls`."""
    host, dev = cuda.buffers(K * width, dtype)
    copied: List[Any] = [None, None]  # event: the last copy host[s] -> dev[s] finished
    used: List[Any] = [None, None]  # event: the compute on the chunk in dev[s] finished

    def issue(i: int, a: int, b: int, c: torch.Tensor):
        s, n = i % 2, K * (b - a)
        if copied[s] is not None:
            cuda.sync(copied[s])  # host[s] is free again
        h, d = host[s][:n].view(K, b - a), dev[s][:n].view(K, b - a)
        cuda.fill(h, c)
        if used[s] is not None:
            cuda.wait(cuda.copy, used[s])  # dev[s] is free again
        copied[s] = cuda.h2d(d, h)
        return a, b, d, s

    it = iter(blocks)
    first = next(it, None)
    cur = None if first is None else issue(0, *first)
    i = 0
    while cur is not None:
        following = next(it, None)
        nxt = None if following is None else issue(i + 1, *following)
        a, b, d, s = cur
        cuda.wait(cuda.compute, copied[s])  # the caller's kernels see the whole chunk
        yield a, b, d
        used[s] = cuda.record(cuda.compute)
        cur, i = nxt, i + 1


# ---- device="auto": the CPU or the GPU, whichever runs the method's round on a host matrix sooner ---------
PROBE_BYTES = 64 << 20
GRAM_PROBE_FMAS = 1 << 27  # at most this many fused multiply-adds per timed call of the Gram probe
_BANDWIDTH: Dict[str, float] = {}  # GB/s measured once per process: "cpu", "h2d", "stage", "gram:K"

# A round as device="auto" weighs it: the passes an aggregator makes (``Aggregator.passes()``, in order), each
# costed in B, the bytes of U (K x d x its itemsize): (B read by the CPU at cpu_read_gbps(), B at cpu_gram_gbps(K),
# whether the pass reads B of host data, U or payloads, so over the link when the round runs on the GPU). A table's
# passes are counted on its K round rows (as if N = K: more clients only add CPU work) and cost nothing on the GPU,
# where the table lives with the model; prefixed HOST they run on the host wherever the round runs (a table kept
# in host memory or in a file): the same CPU time on both sides, nothing over the link.
PASSES: Dict[str, Tuple[int, int, bool]] = {
    "sum": (1, 0, True),  # a column-local read of U: weighted_sum, the NaN screen, an EMA of U into a table
    "gram": (0, 1, True),  # U's K x K Gram matrix (fp64 accumulation)
    "table": (2, 0, False),  # a table's K round rows read and written (FedAWARE's momenta, SCAFFOLD's c_i)
    "table_gram": (0, 1, False),  # those rows' Gram against the table (FedAWARE)
    "table_sum": (1, 0, False),  # a weighted sum over those rows (FedAWARE's step, SCAFFOLD's sum of delta_c)
    "payload": (1, 0, True),  # K client payloads of d elements each (SCAFFOLD's delta_c): stacked, sent to the GPU
}
HOST = "host:"


def _kind(p: str) -> str:
    """A pass's entry in PASSES (its name without the HOST prefix)."""
    return p[len(HOST) :] if p.startswith(HOST) else p


def cpu_read_gbps() -> float:
    """GB/s of the CPU op ``ops.weighted_sum`` reading a host [16, PROBE_BYTES / 64] fp32 matrix (best of
    three, with torch's current thread count); measured once per process."""
    if "cpu" not in _BANDWIDTH:
        U = torch.ones(16, PROBE_BYTES // 64)
        coef = torch.full((16,), 1 / 16, dtype=torch.float64)
        _BANDWIDTH["cpu"] = U.numel() * 4 / _best(lambda: ops.weighted_sum(U, coef)) / 1e9
    return _BANDWIDTH["cpu"]


def cpu_gram_gbps(K: int) -> float:
    """GB/s of U's bytes through the CPU op ``ops.gram`` on a host [K, n] fp32 matrix, n columns holding at
    most a CPU chunk (CPU_CHUNK_BYTES: what the op gets per chunk of a source on the CPU) and GRAM_PROBE_FMAS
    fused multiply-adds (K (K + 1) / 2 per column) (best of three, with torch's current thread count);
    measured once per process and K. Near the read rate at small K, it falls as 1/K where the Gram is
    compute-bound."""
    K = check_pos_int(K, "cpu_gram_gbps", "K")
    key = f"gram:{K}"
    if key not in _BANDWIDTH:
        n = max(256, min(CPU_CHUNK_BYTES // (4 * K), GRAM_PROBE_FMAS // (K * (K + 1) // 2)))
        U = torch.ones(K, n)
        _BANDWIDTH[key] = U.numel() * 4 / _best(lambda: ops.gram(U)) / 1e9
    return _BANDWIDTH[key]


def h2d_gbps() -> float:
    """GB/s of a pinned host-to-device copy of PROBE_BYTES to the current CUDA device (best of three);
    measured once per process."""
    if "h2d" not in _BANDWIDTH:
        src = torch.empty(PROBE_BYTES // 4, pin_memory=True)
        dst = torch.empty_like(src, device="cuda")
        _BANDWIDTH["h2d"] = PROBE_BYTES / _best(lambda: dst.copy_(src, non_blocking=True), torch.cuda.synchronize) / 1e9
    return _BANDWIDTH["h2d"]


def staging_gbps() -> float:
    """GB/s of the host copy into pinned memory that stages each chunk for the link (best of three);
    measured once per process."""
    if "stage" not in _BANDWIDTH:
        src, dst = torch.ones(PROBE_BYTES // 4), torch.empty(PROBE_BYTES // 4, pin_memory=True)
        _BANDWIDTH["stage"] = PROBE_BYTES / _best(lambda: dst.copy_(src)) / 1e9
    return _BANDWIDTH["stage"]


def _best(fn: Callable[[], Any], wait: Callable[[], Any] = lambda: None) -> float:
    """The shortest of three timed calls of ``fn`` (then ``wait``), after one untimed."""
    fn()
    wait()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        fn()
        wait()
        best = min(best, time.perf_counter() - t)
    return best


def round_passes(method, K: Optional[int] = None) -> Tuple[Tuple[str, ...], str]:
    """(the passes, a label) of ``method`` for a round of ``K`` clients (None: not known): None (one weighted
    sum, what a caller naming no method gets), an aggregator (its ``passes(K)``, or ``passes()`` where it takes
    no K, labelled by its ``name``) or a sequence of pass names; ValueError naming a pass that is not in PASSES
    (optionally prefixed HOST)."""
    if method is None:
        return ("sum",), "one weighted sum"
    if isinstance(method, (list, tuple)):
        passes, label = tuple(method), "passes"
    elif callable(getattr(method, "passes", None)):
        takes_k = "K" in inspect.signature(method.passes).parameters
        passes = tuple(method.passes(K) if takes_k else method.passes())
        label = str(getattr(method, "name", type(method).__name__))
    else:
        raise TypeError(
            f"pick_device: method must be an aggregator (with passes()), a sequence of pass names or "
            f"None, got {type(method).__name__}"
        )
    for p in passes:
        if not isinstance(p, str) or _kind(p) not in PASSES:
            raise ValueError(
                f"pick_device: {label} declares the pass {p!r}; expected one of {sorted(PASSES)}, "
                f"optionally prefixed {HOST!r}"
            )
    return passes, label


def round_seconds(passes: Sequence[str], K: int) -> Tuple[float, float, int]:
    """(CPU seconds, seconds of host work on the GPU path, reads of U over the link on the GPU path) per GB
    of U of a round of ``passes`` over a host [K, d] matrix, from the probed CPU rates (PASSES)."""
    cpu, host, link_reads = 0.0, 0.0, 0
    for p in passes:
        on_host = p.startswith(HOST)
        r, g, reads_u = PASSES[_kind(p)]
        t = (r / cpu_read_gbps() if r else 0.0) + (g / cpu_gram_gbps(K) if g else 0.0)
        cpu += t
        if on_host:
            host += t
        elif reads_u:
            link_reads += 1
    return cpu, host, link_reads


def pick_device(method=None, data=None) -> Tuple[torch.device, str]:
    """Where one round of ``method`` on ``data`` runs sooner, and why (one short string with both estimates).

    method: an aggregator (what a round does with U: its ``passes()``, see PASSES), a sequence of pass names,
    or None (one weighted sum). data: the [K, d] updates: a tensor, a ``MatrixSource`` or a ``ChunkedUpdates``
    (None: a host matrix of K = 16 rows, 1 GB). Data already on a CUDA device: that device. No CUDA: the
    CPU. Otherwise the CPU time (per pass: its bytes over the probed CPU rate of that pass,
    :func:`cpu_read_gbps` / :func:`cpu_gram_gbps` at data's K) against the GPU time (the bytes of U over
    the link for each pass that reads U from the host, the slower of the two overlapped stages a chunk goes
    through: :func:`staging_gbps` into pinned memory, :func:`h2d_gbps` over the link; plus the passes that
    stay on the host; the GPU's own compute counted as nothing): the faster, the CPU on a tie. Each rate is
    probed once per process. The source itself (a disk, a memmap) is read the same way for both; a bf16/fp16
    matrix is costed by its bytes at the fp32 rates."""
    K, nbytes, where = 16, 10**9, torch.device("cpu")
    if isinstance(data, torch.Tensor):
        K, nbytes, where = (data.size(0) if data.dim() else 1), data.numel() * data.element_size(), data.device
    elif isinstance(data, (MatrixSource, ChunkedUpdates)):
        src = data.source if isinstance(data, ChunkedUpdates) else data
        K, nbytes = src.K, src.nbytes
    elif data is not None:
        raise TypeError(
            f"pick_device: data must be a tensor, a MatrixSource or a ChunkedUpdates, got {type(data).__name__}"
        )
    passes, label = round_passes(method, K)
    if where.type == "cuda":
        return where, f"{where}: the data is already there"
    if not torch.cuda.is_available():
        return torch.device("cpu"), "cpu: no CUDA device"
    gb = nbytes / 1e9
    cpu, host, link_reads = round_seconds(passes, max(K, 1))
    link = min(h2d_gbps(), staging_gbps())
    cpu, host, gpu = gb * cpu, gb * host, gb * (host + link_reads / link)
    rates = f"reads {cpu_read_gbps():.1f} GB/s"
    if any(PASSES[_kind(p)][1] for p in passes):
        rates += f", Gram at K={K} {cpu_gram_gbps(max(K, 1)):.1f} GB/s"
    on_gpu = f"{link_reads} read{'s' if link_reads != 1 else ''} of U at the staged host-to-device {link:.1f} GB/s"
    if host:
        on_gpu += f" + {host:.3g} s on the host"
    dev = torch.device("cpu") if cpu <= gpu else torch.device("cuda", torch.cuda.current_device())
    return dev, (
        f"{dev}: host source, {label} [{', '.join(passes)}] on {nbytes / 1e9:.3g} GB: CPU ~{cpu:.3g} s "
        f"({rates}) {'<=' if cpu <= gpu else '>'} GPU ~{gpu:.3g} s ({on_gpu})"
    )


CONVERT_COLS = 1 << 17  # columns per cache-sized block when a chunk's dtype is converted (the fallback)


def weighted_sum_block(
    c: torch.Tensor,
    coef,
    base: Optional[torch.Tensor],
    alpha: float,
    dst: torch.Tensor,
    rows: Optional[torch.Tensor] = None,
    screen: bool = False,
) -> Optional[torch.Tensor]:
    """``dst = base + alpha * sum_i coef_i c[rows_i]`` for one column block ``c`` of U, in ``dst``'s dtype
    (``ops.weighted_sum``: column-local, so the blocks of a matrix give the bits of the whole). A
    bf16/fp16 block summed into fp32/fp64 goes through the op in one pass, widened (and screened) in its
    kernel (``out_dtypes`` in fedkernels/ops/weighted_sum.py); where that cannot be used (a non-contiguous
    ``dst``, a device without the kernel) it is converted CONVERT_COLS columns at a time (a cache-sized
    scratch, not a copy of the block). Both give the bits of converting the block whole. With ``screen``
    returns the [K] finite-row flags of ``c`` (from the same pass where a kernel does both)."""
    odt = dst.dtype
    bb = None if base is None else base.to(device=dst.device, dtype=odt)
    if odt in out_dtypes(c.dtype) and dst.is_contiguous() and dst.device == c.device:  # into dst, no temporary
        if screen and rows is None and has_kernel("weighted_sum_screened_out", c.device):
            return ops.weighted_sum_screened(c, coef, base=bb, alpha=alpha, out=dst)[1]
        if has_kernel("weighted_sum_out", c.device):
            ok = ops.finite_rows(c) if screen else None
            ops.weighted_sum(c, coef, base=bb, alpha=alpha, rows=rows, out=dst)
            return ok
    if c.dtype == odt:
        if screen and rows is None and has_kernel("weighted_sum_screened", c.device):
            res, ok = ops.weighted_sum_screened(c, coef, base=bb, alpha=alpha)
            dst.copy_(res)
            return ok
        ok = ops.finite_rows(c) if screen else None
        dst.copy_(ops.weighted_sum(c, coef, base=bb, alpha=alpha, rows=rows))
        return ok
    ok = ops.finite_rows(c) if screen else None
    if rows is not None:
        c = c.index_select(0, rows.to(c.device))
    w = c.size(1)
    scratch = torch.empty(c.size(0), min(w, CONVERT_COLS), dtype=odt, device=c.device)
    for j in range(0, w, CONVERT_COLS):
        e = min(w, j + CONVERT_COLS)
        s = scratch[:, : e - j]
        s.copy_(c[:, j:e])
        dst[j:e].copy_(ops.weighted_sum(s, coef, base=None if bb is None else bb[j:e], alpha=alpha))
    return ok


def as_source(
    x,
    K: Optional[int] = None,
    d: Optional[int] = None,
    dtype: Optional[torch.dtype] = None,
    offset: int = 0,
    what: str = "source",
) -> MatrixSource:
    """A MatrixSource from a MatrixSource (returned as is), a [K, d] CPU tensor, a NumPy array /
    memmap, a path to a raw file (``K``, ``d`` and ``dtype`` required; default float32) or a list of
    per-client files (``d`` required)."""
    if isinstance(x, MatrixSource):
        return x
    if isinstance(x, torch.Tensor):
        if dtype is not None and x.dtype != dtype:
            raise ValueError(f"{what}: the tensor has dtype {x.dtype}, expected {dtype}")
        return TensorSource(x)
    if isinstance(x, np.ndarray):
        return MemmapSource(x, dtype=dtype)
    if isinstance(x, (str, os.PathLike)):
        if K is None or d is None:
            raise ValueError(f"{what}: a file source needs K and d (got K={K}, d={d})")
        return RawFileSource(x, K, d, torch.float32 if dtype is None else dtype, offset=offset)
    if isinstance(x, (list, tuple)) and x and all(isinstance(p, (str, os.PathLike)) for p in x):
        if d is None:
            raise ValueError(f"{what}: a list of client files needs d")
        return ClientFilesSource(x, d, torch.float32 if dtype is None else dtype)
    raise TypeError(
        f"{what}: source must be a MatrixSource, a tensor, an ndarray/memmap, a path or a list of "
        f"per-client paths, got {type(x).__name__}"
    )


class _CodeRows(RawFileSource):
    """A raw file of K x d int8 / float8_e4m3fn codes (BlockCodeFile's), read like any file source."""

    _CODE_DTYPES = (torch.int8, torch.float8_e4m3fn)


class PackedRows(abc.ABC):
    """K update rows in a packed (compressed) form, one of the round runner's input forms: ``agg.aggregate(g,
    rows, ...)`` runs a method whose server reads U only through ``RoundInput.weighted_sum`` on them, each weighted
    sum one pass over the packed rows (``weighted_sum``: ``(base + alpha * sum_k coef_k row_k, ok)``, ``ok`` the
    rows' NaN/Inf flags of that pass); the runner's validation, screen, bad-row policy and re-run apply as to dense
    rows (``select(keep)``: the rows kept). Implemented by ``fedkernels.compress``' ``BlockRows`` / ``SparseRows``
    and by :class:`BlockCodeFile`.

    Dense columns may travel alongside (``with_dense_columns(ranges, V)``: V [K, sum of the ranges' widths],
    uncompressed): the model's buffers (BatchNorm statistics), whose average the runner takes from them
    (``algorithms.buffers``), the same bits as from dense rows. Without them, ``dense_columns`` decodes those
    columns from the packed rows where the form can (``decoded_columns``)."""

    dense_side: Optional[Tuple[Tuple[Tuple[int, int], ...], torch.Tensor]] = None  # (column ranges, [K, n] values)

    K: int
    d: int

    @abc.abstractmethod
    def weighted_sum(
        self,
        coef: Any,
        base: Optional[torch.Tensor] = None,
        alpha: float = 1.0,
        rows: Any = None,
        out_dtype: Optional[torch.dtype] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(base + alpha * sum_i coef[i] row_{rows[i]}, ok)`` from one pass over the packed rows (``rows``
        None: all K), ``ok`` each selected row's finite flag from the same pass."""

    @abc.abstractmethod
    def select(self, keep: Sequence[int]) -> "PackedRows":
        """The rows ``keep`` (in that order) in the same packed form, dense columns carried along."""

    def decoded_columns(self, ranges: Sequence[Tuple[int, int]]) -> Optional[torch.Tensor]:
        """The rows' values in the column ``ranges``, decoded ([K, n] float32), or None where the form cannot."""
        return None

    def with_dense_columns(self, ranges: Sequence[Tuple[int, int]], V: torch.Tensor) -> "PackedRows":
        """These rows with ``V`` ([K, n]: the rows' uncompressed values in the column ``ranges``, in order) alongside."""
        rg = tuple((int(a), int(b)) for a, b in ranges)
        n = sum(b - a for a, b in rg)
        if not all(0 <= a < b <= self.d for a, b in rg) or V.dim() != 2 or tuple(V.shape) != (self.K, n):
            raise ValueError(
                f"{type(self).__name__}.with_dense_columns: V must be [K={self.K}, {n}] for column "
                f"ranges {list(rg)} within d={self.d}, got {tuple(V.shape)}"
            )
        out = copy.copy(self)
        out.dense_side = (rg, V)
        return out

    def dense_columns(self, ranges: Sequence[Tuple[int, int]]) -> Optional[torch.Tensor]:
        """[K, n]: the values in the column ``ranges`` sent alongside (when they are those ranges), else decoded."""
        if self.dense_side is not None and self.dense_side[0] == tuple((int(a), int(b)) for a, b in ranges):
            return self.dense_side[1]
        return self.decoded_columns(ranges)

    def _carry(self, out: "PackedRows", keep: Sequence[int]) -> "PackedRows":
        """``out`` (``select(keep)``'s rows) with the dense columns of the rows kept."""
        if self.dense_side is not None:
            rg, V = self.dense_side
            out.dense_side = (rg, V.index_select(0, torch.as_tensor(list(keep), dtype=torch.long, device=V.device)))
        return out


class BlockCodeFile(PackedRows):
    """K compressed rows on disk: a raw file of K x d int8 or float8_e4m3fn codes (row-major, one byte each) and
    their float32 scales, one per ``block`` columns ([K, ceil(d / block)]: a tensor, or a raw float32 file read
    into memory, 4 / block of the codes' bytes). A round over it reads the codes once, in column blocks (READ_BYTES
    per block, ``O_DIRECT`` as the other file sources decide), each block summed by ``ops.dequant_weighted_sum``:
    a d = 1e9, K = 16 int8 round reads 16 GB where a bf16 file holds 32. It has the interface of
    ``fedkernels.compress.BlockRows`` (:class:`PackedRows`), so ``agg.aggregate(g, file, ...)`` (or
    ``compress.aggregate_compressed``) runs a weighted-sum method (FedAvg, FedAvgM, ...) on it unchanged; the
    result is a [d] tensor in memory (float32 or float64)."""

    def __init__(
        self,
        codes: PathLike,
        scales: Union[PathLike, torch.Tensor],
        K: int,
        d: int,
        block: int,
        dtype: torch.dtype = torch.int8,
        direct: Optional[bool] = None,
        prefetch: bool = True,
        rows: Optional[Sequence[int]] = None,
    ):
        what = "BlockCodeFile"
        if dtype not in _CodeRows._CODE_DTYPES:
            raise ValueError(f"{what}: dtype must be torch.int8 or torch.float8_e4m3fn, got {dtype!r}")
        self.block = check_pos_int(block, what, "block")
        self.codes = _CodeRows(codes, K, d, dtype=dtype, prefetch=prefetch, direct=direct)
        nb = -(-d // self.block)
        if isinstance(scales, torch.Tensor):
            S = scales
        else:
            p = os.fspath(scales)
            if not os.path.isfile(p) or os.path.getsize(p) != 4 * K * nb:
                have = os.path.getsize(p) if os.path.isfile(p) else "no file"
                raise ValueError(
                    f"{what}: scales file {p!r} must hold K x ceil(d / block) = {K} x {nb} float32 "
                    f"({4 * K * nb} bytes), got {have}"
                )
            S = torch.from_file(p, shared=False, size=K * nb, dtype=torch.float32).view(K, nb)
        if S.dtype != torch.float32 or tuple(S.shape) != (K, nb):
            raise ValueError(
                f"{what}: scales must be float32 [K, ceil(d / block)] = [{K}, {nb}], got {S.dtype} {tuple(S.shape)}"
            )
        self.scales = S.contiguous()
        self._rows = None if rows is None else [int(r) for r in rows]

    @property
    def K(self) -> int:
        return self.codes.K if self._rows is None else len(self._rows)

    @property
    def d(self) -> int:
        return self.codes.d

    @property
    def nbytes(self) -> int:
        """Bytes a round reads: the selected rows' codes (the whole file is read; rows are skipped in the sum)."""
        return self.codes.K * self.codes.d + self.scales.numel() * 4

    def select(self, keep: Sequence[int]) -> "BlockCodeFile":
        base = list(range(self.codes.K)) if self._rows is None else self._rows
        out = object.__new__(BlockCodeFile)
        out.block, out.codes, out.scales = self.block, self.codes, self.scales
        out._rows = [base[k] for k in keep]
        return self._carry(out, keep)

    def chunk_cols(self) -> int:
        per_row = max(1, READ_BYTES // max(self.codes.K, 1))
        return max(self.block, per_row // self.block * self.block)

    def weighted_sum(
        self,
        coef: Any,
        base: Optional[torch.Tensor] = None,
        alpha: float = 1.0,
        rows: Any = None,
        out_dtype: Optional[torch.dtype] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(base + alpha * sum_i coef_i dequant(row_i), ok)`` over the file in column blocks (rows: the
        selected rows' positions, as ``ops.dequant_weighted_sum``'s)."""
        sel = self._rows
        if rows is not None:
            r = [int(x) for x in (rows.tolist() if isinstance(rows, torch.Tensor) else rows)]
            sel = [(sel[x] if sel is not None else x) for x in r]
        n = self.codes.K if sel is None else len(sel)
        odt = base.dtype if base is not None else (out_dtype or torch.float32)
        out = torch.empty(self.d, dtype=odt)
        ok = torch.ones(n, dtype=torch.bool)
        B = self.block
        for a, b, Q in self.codes.chunks(self.chunk_cols()):
            S = self.scales[:, a // B : -(-b // B)]
            o, f = ops.dequant_weighted_sum(
                Q,
                S,
                coef,
                B,
                base=None if base is None else base[a:b],
                alpha=alpha,
                rows=sel,
                out_dtype=None if base is not None else odt,
            )
            out[a:b] = o
            ok &= f
        return out, ok
