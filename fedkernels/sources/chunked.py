"""A source read in column chunks on a device (:class:`ChunkedUpdates`, what ``Aggregator.aggregate`` takes
as ``updates`` besides a tensor), the sources it is built from (:func:`as_source`) and one chunk's weighted
sum (:func:`weighted_sum_block`)."""

from __future__ import annotations

import itertools
import os
from typing import Iterator, Optional, Sequence, Tuple

import numpy as np
import torch

from .. import ops
from ..ops._checks import has_kernel
from ..ops.weighted_sum import out_dtypes
from .cost import pick_device
from .files import ClientFilesSource, RawFileSource
from .matrix import Block, MatrixSource, MemmapSource, TensorSource, check_pos_int, itemsize
from .staging import CudaCalls, overlapped

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
    returns the [K] finite flags of ``c`` (from the same pass where a kernel does both)."""
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
