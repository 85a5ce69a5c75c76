"""Aggregation of update matrices larger than memory: the K x d matrix streamed in column chunks.

Sources (``ChunkedUpdates``): a CPU tensor, a NumPy array or ``np.memmap`` (disk-backed; pages
are released after each chunk so the resident set stays bounded), or a raw row-major file
(read with ``os.preadv`` into a reused staging buffer: memory = K x chunk_cols elements). With a
CUDA ``device`` the staging buffer is pinned and each chunk is copied to the device.

* FedAvg-style methods: one streamed pass of ``ops.weighted_sum`` per chunk
  (:func:`streamed_weighted_sum`, :func:`streamed_fedavg`); finite-row screening rides along.
* Gram-based methods: pass 1 accumulates the K x K fp64 Gram (and the finite-row flags) over the
  chunks in a fixed order, the K weights come from it, pass 2 is the weighted sum
  (:func:`streamed_gram`, :func:`streamed_kuramoto`); two reads of U, the floor for
  weight-then-sum methods.

The output ``[d]`` vector (and the base/global model) may itself be any CPU tensor, e.g. one made
with ``torch.from_file`` for models whose single copy does not fit either.
"""
from __future__ import annotations

import mmap
import os
from typing import Iterator, Optional, Tuple, Union

import numpy as np
import torch

from . import ops
from .errors import BadUpdateError
from .ops import weighted_sum_chunked  # noqa: F401  (moved to fedkernels.ops; re-exported)

__all__ = ["ChunkedUpdates", "streamed_gram", "streamed_finite_rows", "streamed_weighted_sum",
           "streamed_fedavg", "streamed_kuramoto", "weighted_sum_chunked"]

DEFAULT_CHUNK_BYTES = 64 << 20   # staging memory per chunk (all K rows)
_NP = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}


class ChunkedUpdates:
    """A K x d update matrix read ``chunk_cols`` columns at a time.

    source: a [K, d] CPU tensor, a [K, d] NumPy array / np.memmap, or a path to a raw row-major
    file (then ``K``, ``d``, ``dtype`` and optionally ``offset`` in bytes are required).
    chunk_cols: columns per chunk (default: ``DEFAULT_CHUNK_BYTES`` of staging for all K rows).
    device: where chunks are delivered (default CPU); pinned staging when it is a CUDA device.
    """

    def __init__(self, source: Union[torch.Tensor, np.ndarray, str, os.PathLike], K: Optional[int] = None,
                 d: Optional[int] = None, dtype: torch.dtype = torch.float32, chunk_cols: Optional[int] = None,
                 device=None, offset: int = 0):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._path = None
        if isinstance(source, (str, os.PathLike)):
            if K is None or d is None:
                raise ValueError("ChunkedUpdates: a file source needs K and d")
            if dtype not in _NP:
                raise ValueError(f"ChunkedUpdates: file dtype must be one of {list(_NP)}, got {dtype}")
            self._path, self.K, self.d, self.dtype, self._offset = os.fspath(source), int(K), int(d), dtype, int(offset)
            need = self._offset + self.K * self.d * torch.empty(0, dtype=dtype).element_size()
            if os.path.getsize(self._path) < need:
                raise ValueError(f"ChunkedUpdates: {self._path} has {os.path.getsize(self._path)} bytes, "
                                 f"need {need} for K={K} x d={d} {dtype}")
            self._src = None
        elif isinstance(source, np.ndarray):
            if source.ndim != 2:
                raise ValueError(f"ChunkedUpdates: source must be [K, d], got shape {source.shape}")
            self._src = source
            self.K, self.d = source.shape
            self.dtype = torch.from_numpy(source[:0, :0].copy()).dtype
        elif isinstance(source, torch.Tensor):
            if source.dim() != 2:
                raise ValueError(f"ChunkedUpdates: source must be [K, d], got shape {tuple(source.shape)}")
            if source.device.type != "cpu":
                raise ValueError("ChunkedUpdates: a tensor source must live on the CPU (use ops directly on devices)")
            self._src = source
            self.K, self.d = source.shape
            self.dtype = source.dtype
        else:
            raise TypeError(f"ChunkedUpdates: source must be a tensor, an ndarray/memmap or a path, got {type(source).__name__}")
        esize = torch.empty(0, dtype=self.dtype).element_size()
        if chunk_cols is None:
            chunk_cols = max(1024, DEFAULT_CHUNK_BYTES // max(1, self.K * esize))
        if isinstance(chunk_cols, bool) or not isinstance(chunk_cols, int) or chunk_cols < 1:
            raise ValueError(f"ChunkedUpdates: chunk_cols must be a positive int, got {chunk_cols!r}")
        self.chunk_cols = min(chunk_cols, max(self.d, 1))
        self._stage = None

    @property
    def shape(self) -> Tuple[int, int]:
        return (self.K, self.d)

    @property
    def staging_bytes(self) -> int:
        return self.K * self.chunk_cols * torch.empty(0, dtype=self.dtype).element_size()

    def _staging(self) -> torch.Tensor:
        if self._stage is None:
            pin = self.device.type == "cuda" and torch.cuda.is_available()
            self._stage = torch.empty(self.K, self.chunk_cols, dtype=self.dtype, pin_memory=pin)
        return self._stage

    def chunks(self) -> Iterator[Tuple[int, int, torch.Tensor]]:
        """Yields ``(a, b, U[:, a:b])`` in column order; the chunk is valid until the next one."""
        if self._path is not None:
            yield from self._file_chunks()
            return
        for a in range(0, self.d, self.chunk_cols):
            b = min(self.d, a + self.chunk_cols)
            if isinstance(self._src, np.ndarray):
                c = torch.from_numpy(self._src[:, a:b]) if self._src.flags.writeable else \
                    torch.from_numpy(np.array(self._src[:, a:b]))
            else:
                c = self._src[:, a:b]
            yield a, b, self._deliver(c)
            self._release(a, b)

    def _deliver(self, c: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return c
        st = self._staging()[:, : c.size(1)]
        st.copy_(c)
        return st.to(self.device, non_blocking=True)

    def _release(self, a: int, b: int) -> None:
        """Drops the pages of a disk-backed np.memmap chunk from this process (bounded RSS)."""
        mm = getattr(self._src, "_mmap", None)
        if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return
        es = self._src.itemsize
        base = getattr(self._src, "offset", 0)
        page = mmap.PAGESIZE
        for k in range(self.K):
            lo = base + (k * self.d + a) * es
            hi = base + (k * self.d + b) * es
            lo_p, hi_p = lo // page * page, (hi + page - 1) // page * page
            try:
                mm.madvise(mmap.MADV_DONTNEED, lo_p, min(hi_p, len(mm)) - lo_p)
            except (OSError, ValueError):
                return

    def _file_chunks(self):
        es = torch.empty(0, dtype=self.dtype).element_size()
        st = self._stage if self._stage is not None else torch.empty(self.K, self.chunk_cols, dtype=self.dtype,
                                                                      pin_memory=self.device.type == "cuda"
                                                                      and torch.cuda.is_available())
        self._stage = st
        fd = os.open(self._path, os.O_RDONLY)
        try:
            for a in range(0, self.d, self.chunk_cols):
                b = min(self.d, a + self.chunk_cols)
                w = b - a
                view = st[:, :w]
                npv = st.numpy()
                for k in range(self.K):
                    dst = memoryview(npv[k, :w]).cast("B")
                    pos, got = self._offset + (k * self.d + a) * es, 0
                    while got < w * es:
                        r = os.preadv(fd, [dst[got:]], pos + got)
                        if r <= 0:
                            raise OSError(f"ChunkedUpdates: short read from {self._path}")
                        got += r
                yield a, b, (view if self.device.type == "cpu" else view.to(self.device, non_blocking=True))
        finally:
            os.close(fd)


def _as_chunked(src, **kw) -> ChunkedUpdates:
    return src if isinstance(src, ChunkedUpdates) else ChunkedUpdates(src, **kw)


def streamed_gram(src, rows=None, with_finite: bool = False):
    """``ops.gram`` of the whole matrix, summed over column chunks in order (fp64 [K, K] on the CPU);
    with ``with_finite`` also the [K] finite-row flags from the same pass."""
    src = _as_chunked(src)
    G, fin = None, torch.ones(src.K, dtype=torch.bool)
    for _, _, c in src.chunks():
        g = ops.gram(c, rows=rows).cpu()
        G = g if G is None else G.add_(g)
        if with_finite:
            fin &= ops.finite_rows(c).cpu()
    if G is None:
        G = torch.zeros(src.K if rows is None else len(rows), src.K, dtype=torch.float64)
    return (G, fin) if with_finite else G


def streamed_finite_rows(src) -> torch.Tensor:
    src = _as_chunked(src)
    fin = torch.ones(src.K, dtype=torch.bool)
    for _, _, c in src.chunks():
        fin &= ops.finite_rows(c).cpu()
    return fin


def streamed_weighted_sum(src, coef, base: Optional[torch.Tensor] = None, alpha: float = 1.0, rows=None,
                          out: Optional[torch.Tensor] = None, check_finite: bool = False):
    """``base + alpha * sum_i coef_i U[rows_i]`` one chunk at a time into ``out`` ([d] CPU, allocated
    if None; may be ``base``). With ``check_finite`` also returns the [K] finite-row flags."""
    src = _as_chunked(src)
    dev = src.device
    if out is None:
        out = torch.empty(src.d, dtype=src.dtype)
    if out.dim() != 1 or out.numel() != src.d:
        raise ValueError(f"streamed_weighted_sum: out must be [d={src.d}], got {tuple(out.shape)}")
    if base is not None and (base.dim() != 1 or base.numel() != src.d):
        raise ValueError(f"streamed_weighted_sum: base must be [d={src.d}], got {tuple(base.shape)}")
    c64 = torch.as_tensor(coef, dtype=torch.float64).cpu()    # host coefficients and rows for every device
    r = None if rows is None else torch.as_tensor(rows, dtype=torch.long).cpu()
    fin = torch.ones(src.K, dtype=torch.bool)
    for a, b, c in src.chunks():
        bb = None if base is None else base[a:b].to(device=dev, dtype=c.dtype)
        res = ops.weighted_sum(c, c64, base=bb, alpha=alpha, rows=r)
        out[a:b].copy_(res)
        if check_finite:
            fin &= ops.finite_rows(c).cpu()
    return (out, fin) if check_finite else out


def _check_finite(fin: torch.Tensor, what: str) -> None:
    if not bool(fin.all()):
        k = int((~fin).nonzero()[0])
        raise BadUpdateError(f"{what}: client row {k} contains NaN/Inf (streamed aggregation rejects the round)")


def streamed_fedavg(global_flat: torch.Tensor, src, num_examples, server_lr: float = 1.0,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """FedAvg ``global + server_lr * sum_k p_k U_k`` in one streamed pass (rows screened for NaN/Inf
    in the same pass; a bad row raises BadUpdateError and ``global_flat`` is left untouched)."""
    n = torch.as_tensor(num_examples, dtype=torch.float64).reshape(-1)
    p = n / n.sum()
    new, fin = streamed_weighted_sum(src, p, base=global_flat, alpha=server_lr, out=out, check_finite=True)
    _check_finite(fin, "streamed_fedavg")
    return new


def streamed_kuramoto(global_flat: torch.Tensor, src, num_examples, aggregator=None,
                      out: Optional[torch.Tensor] = None):
    """Kuramoto-FedAvg (modes S and P) streamed: pass 1 Gram + screening, weights from the Gram as
    ``KuramotoFedAvg`` computes them, pass 2 the weighted sum. ``aggregator``: a KuramotoFedAvg
    whose options (and round counter, advanced here) are used; default mode S. Returns (new, info)."""
    from .algorithms.kuramoto import KuramotoFedAvg, kuramoto_weights
    agg = aggregator if aggregator is not None else KuramotoFedAvg()
    if agg.mode not in ("P", "S"):
        raise ValueError("streamed_kuramoto: modes S and P (mode C needs the elementwise clamp: use ops per chunk)")
    src = _as_chunked(src)
    n = torch.as_tensor(num_examples, dtype=torch.float64).reshape(-1)
    p = n.new_full((src.K,), 1.0 / src.K) if agg.weighting == "uniform" else n / n.sum()
    G, fin = streamed_gram(src, with_finite=True)
    _check_finite(fin, "streamed_kuramoto")
    dot = G @ p
    nsq = torch.diagonal(G).clone()
    nbar = float(p @ dot)
    kt = agg.kappa()
    if agg.mode == "S":
        kap = min(max(kt, 0.0), 1.0)
        a, info = kuramoto_weights(dot, nsq, nbar, p, "S", kap, clip_delta=agg.clip_delta, theta_bar=agg.theta_bar)
        alpha = agg.server_lr
    else:
        kap = kt
        a, info = kuramoto_weights(dot, nsq, nbar, p, "P", kap, tau=agg.tau, theta_bar=agg.theta_bar, guard=agg.guard)
        alpha = agg.server_lr * kt
    new = streamed_weighted_sum(src, a, base=global_flat, alpha=alpha, out=out)
    info.update(mode=agg.mode, kappa=kap, weights=a.tolist(), p=p.tolist(), num_clients=src.K)
    agg.round += 1
    return new, info
