"""The file sources (``RawFileSource``, ``ClientFilesSource``) and the file reads they share.

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
import functools
import os
from typing import List, Optional, Sequence, Tuple

import torch

from .._memory import available_bytes
from .matrix import MatrixSource, PathLike, check_dtype, check_pos_int, itemsize

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
        self.dtype = dtype if dtype in self._CODE_DTYPES else check_dtype(dtype, type(self).__name__)
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
