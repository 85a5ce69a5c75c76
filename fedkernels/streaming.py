"""Aggregation of update matrices larger than memory: the aggregators over a matrix source, and where the
result goes.

Every aggregator takes a matrix source as its ``updates`` (``Aggregator.aggregate(x, src, n, ...)``
with ``src`` a ``fedkernels.sources.MatrixSource`` or a ``ChunkedUpdates``): the method is the same
code, reading U through ``RoundInput.weighted_sum`` / ``gram`` / ``blocks`` chunk by chunk. This module
holds no method logic; it adds, for a user who streams:

* :func:`streamed_fedavg`, :func:`streamed_kuramoto`, :func:`streamed_fedaware`: one round of that
  aggregator over a source (anything ``as_source`` takes), with the result published to ``out`` only
  after the whole round succeeded;
* :func:`momentum_file`: FedAWARE's N x d momentum table as a disk-backed tensor, updated chunk by
  chunk with U (``streamed_fedaware`` installs it in the aggregator; ``FedAWARE(momentum_file=PATH)``
  keeps such a table itself);
* op-level passes: :func:`streamed_weighted_sum`, :func:`streamed_gram`, :func:`streamed_finite_rows`.

``out``: None (the new [d] tensor is returned), a [d] CPU tensor of the result's dtype (may be
``global_flat``; filled after success), or a path (a raw file: a temporary beside it, its blocks
reserved first, is mapped and filled chunk by chunk by the aggregation's result pass (``aggregate(...,
out=)``), then fsynced and renamed into place; the returned tensor is a private, copy-on-write mapping of
the published file). A bad row (NaN/Inf) raises BadUpdateError naming the client row (and its file);
nothing is published (the temporary is removed) and the global model is never modified.
"""

from __future__ import annotations

import os
import warnings
from typing import Optional, Sequence, Union

import torch

from . import ops
from .algorithms.tables import check_path
from .errors import BadUpdateError  # noqa: F401  (raised through the aggregators; re-exported)
from .ops import weighted_sum_chunked  # noqa: F401  (moved to fedkernels.ops; re-exported)
from .sources import ChunkedUpdates, itemsize, weighted_sum_block  # noqa: F401
from .sources.chunked import DEFAULT_CHUNK_BYTES  # noqa: F401

__all__ = [
    "ChunkedUpdates",
    "streamed_gram",
    "streamed_finite_rows",
    "streamed_weighted_sum",
    "streamed_fedavg",
    "streamed_kuramoto",
    "streamed_fedaware",
    "momentum_file",
    "weighted_sum_chunked",
]

OutLike = Union[None, torch.Tensor, str, os.PathLike]


def _as_chunked(src, chunk_cols: Optional[int] = None) -> ChunkedUpdates:
    if isinstance(src, ChunkedUpdates):
        return src
    return ChunkedUpdates(src, chunk_cols=chunk_cols)


def _check_vec(v: torch.Tensor, name: str, what: str, d: int, dtype: Optional[torch.dtype] = None) -> None:
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(v).__name__}")
    if v.dim() != 1 or v.numel() != d or v.device.type != "cpu":
        raise ValueError(f"{what}: {name} must be a [d={d}] CPU tensor, got shape {tuple(v.shape)} on {v.device}")
    if dtype is not None and v.dtype != dtype:
        raise ValueError(f"{what}: {name} must have dtype {dtype}, got {v.dtype}")


class _Out:
    """Where a result goes (``out``), checked before anything is read; used as a context manager around
    the aggregation. A path: a temporary file beside it, its blocks reserved up front (``posix_fallocate``:
    a full disk is an OSError here, not a crash in the middle of the pass) and mapped as ``buf``, which
    the aggregation writes chunk by chunk (``Aggregator.aggregate(..., out=buf)``); ``publish`` fsyncs and
    renames it into place and returns a private (copy-on-write) mapping of the published file; a failure
    removes the temporary. A tensor ``out``: filled by ``publish`` (after success); None: the result."""

    def __init__(self, out: OutLike, d: int, dtype: torch.dtype, what: str):
        self.out, self.d, self.dtype = out, d, dtype
        self.tmp: Optional[str] = None
        self.buf: Optional[torch.Tensor] = None
        if isinstance(out, (str, os.PathLike)):
            check_path(what, "out", out)
        elif out is not None:
            _check_vec(out, "out", what, d, dtype)

    def __enter__(self) -> "_Out":
        if isinstance(self.out, (str, os.PathLike)) and self.d:
            self.tmp = f"{os.fspath(self.out)}.tmp-{os.getpid()}"
            fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.posix_fallocate(fd, 0, self.d * itemsize(self.dtype))
            except BaseException:
                os.close(fd)
                os.remove(self.tmp)
                raise
            os.close(fd)
            self.buf = torch.from_file(self.tmp, shared=True, size=self.d, dtype=self.dtype)
        return self

    def __exit__(self, *exc) -> None:
        self.buf = None
        if self.tmp is not None and os.path.exists(self.tmp):
            os.remove(self.tmp)  # (not published: the aggregation failed)

    def publish(self, new: torch.Tensor) -> torch.Tensor:
        if isinstance(self.out, (str, os.PathLike)):
            path = os.fspath(self.out)
            if self.tmp is None:  # d = 0: an empty file
                open(path, "wb").close()
                return new
            if new is not self.buf:  # (the aggregation wrote elsewhere: copy it in)
                self.buf.copy_(new)
            self.buf = None
            fd = os.open(self.tmp, os.O_RDWR)
            try:
                os.fsync(fd)  # the mapped pages are the file's page cache
            finally:
                os.close(fd)
            os.replace(self.tmp, path)
            self.tmp = None
            return torch.from_file(path, shared=False, size=self.d, dtype=self.dtype)
        if self.out is not None:
            return self.out.copy_(new)
        return new


# ---- one round of an aggregator over a source ------------------------------------------------------------
def _round(
    agg, global_flat: torch.Tensor, src, num_examples, client_ids=None, out: OutLike = None, what: str = "streamed"
):
    src = _as_chunked(src)
    _check_vec(global_flat, "global_flat", what, src.d)
    with _Out(out, src.d, global_flat.dtype, what) as dst:  # refuses a bad out before reading U
        new, info = agg.aggregate(global_flat, src, num_examples, client_ids, out=dst.buf)
        return dst.publish(new), info


def streamed_fedavg(
    global_flat: torch.Tensor, src, num_examples, server_lr: float = 1.0, out: OutLike = None
) -> torch.Tensor:
    """``FedAvg(server_lr=...)`` over a source: ``global + server_lr * sum_k p_k U_k`` in one streamed
    pass (rows screened in the same pass)."""
    from .algorithms.fedavg import FedAvg

    return _round(FedAvg(server_lr=server_lr), global_flat, src, num_examples, out=out, what="streamed_fedavg")[0]


def streamed_kuramoto(global_flat: torch.Tensor, src, num_examples, aggregator=None, out: OutLike = None):
    """``KuramotoFedAvg`` over a source (``aggregator``: its options and round counter; default mode S):
    a kstats pass (screening the rows; no K x K Gram) and a sum pass. Returns (new, info)."""
    from .algorithms.kuramoto import KuramotoFedAvg

    agg = aggregator if aggregator is not None else KuramotoFedAvg()
    return _round(agg, global_flat, src, num_examples, out=out, what="streamed_kuramoto")


def streamed_fedaware(
    global_flat: torch.Tensor,
    src,
    num_examples,
    client_ids: Sequence[int],
    aggregator,
    momenta: Optional[torch.Tensor] = None,
    out: OutLike = None,
):
    """One round of the FedAWARE ``aggregator`` over a source. Its momentum table: the aggregator's own
    (``momenta=None``; e.g. ``FedAWARE(momentum_file=PATH)``, a disk table with a checkpointable
    reference), or ``momenta`` ([N, d], e.g. from :func:`momentum_file`), installed as ``aggregator.M``
    at the first call (the same tensor afterwards). Updated chunk by chunk with U. Returns (new, info)."""
    from .algorithms.fedaware import FedAWARE

    what = "streamed_fedaware"
    if not isinstance(aggregator, FedAWARE):
        raise TypeError(f"{what}: aggregator must be a FedAWARE, got {type(aggregator).__name__}")
    if momenta is not None:
        N = aggregator.num_clients
        if N is None:
            raise ValueError(f"{what}: the aggregator needs num_clients=N")
        d = _as_chunked(src).d
        if not isinstance(momenta, torch.Tensor) or tuple(momenta.shape) != (N, d):
            raise ValueError(
                f"{what}: momenta must be a [N={N}, d={d}] tensor, got "
                f"{tuple(getattr(momenta, 'shape', ()))} {type(momenta).__name__}"
            )
        if aggregator.momentum_file is not None:
            raise ValueError(
                f"{what}: the aggregator keeps its table in momentum_file={aggregator.momentum_file!r}; "
                "pass momenta=None"
            )
        if aggregator.M is None:
            aggregator.M = momenta
            aggregator.Gm = torch.zeros(N, N, dtype=torch.float64)
            aggregator.seen = torch.zeros(N, dtype=torch.bool)
            aggregator.n_examples = torch.zeros(N, dtype=torch.float64)
        elif aggregator.M is not momenta:
            raise ValueError(f"{what}: the aggregator already has a momentum table; pass that one as momenta")
    return _round(aggregator, global_flat, src, num_examples, client_ids, out=out, what=what)


# ---- FedAWARE's momentum table on disk -------------------------------------------------------------------
def momentum_file(path: Union[str, os.PathLike], N: int, d: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """FedAWARE's [N, d] momentum table as a disk-backed tensor (``torch.from_file``, shared): created
    as zeros, its blocks reserved, if ``path`` does not exist, else opened; its size must be N * d *
    itemsize. (``FedAWARE(momentum_file=PATH)`` does this itself, with a state_dict that references the
    file.)"""
    from .algorithms.tables import table_file

    return table_file(os.fspath(path), N, d, dtype, exist_ok=True, what="momentum_file:")


# ---- op-level passes -------------------------------------------------------------------------------------
def _renamed(what: str, old: str, value: Optional[bool], screen: bool) -> bool:
    """``screen``, or the value given under its former name ``old`` (with a DeprecationWarning)."""
    if value is None:
        return bool(screen)
    warnings.warn(f"{what}: {old}= is now called screen=", DeprecationWarning, stacklevel=3)
    return bool(value)


def streamed_gram(src, rows=None, screen: bool = False, *, with_finite: Optional[bool] = None):
    """``ops.gram`` of the whole matrix, summed over column chunks in order (fp64 [K, K] on the CPU);
    with ``screen`` also the [K] finite flags (the NaN/Inf screen) from the same pass over the
    source. Both accumulate on the chunks' device and come to the host once, at the end.
    ``with_finite``: the former name of ``screen``."""
    screen = _renamed("streamed_gram", "with_finite", with_finite, screen)
    src = _as_chunked(src)
    G = torch.zeros(src.K if rows is None else len(rows), src.K, dtype=torch.float64, device=src.device)
    fin = torch.ones(src.K, dtype=torch.bool, device=src.device)
    for _, _, c in src.chunks():
        G.add_(ops.gram(c, rows=rows))
        if screen:
            fin &= ops.finite_rows(c)
    return (G.cpu(), fin.cpu()) if screen else G.cpu()


def streamed_finite_rows(src) -> torch.Tensor:
    """[K] bool: True where row k of the source holds only finite values (one pass)."""
    src = _as_chunked(src)
    fin = torch.ones(src.K, dtype=torch.bool, device=src.device)
    for _, _, c in src.chunks():
        fin &= ops.finite_rows(c)
    return fin.cpu()


def streamed_weighted_sum(
    src,
    coef,
    base: Optional[torch.Tensor] = None,
    alpha: float = 1.0,
    rows=None,
    out: OutLike = None,
    screen: bool = False,
    *,
    check_finite: Optional[bool] = None,
):
    """``base + alpha * sum_i coef_i U[rows_i]`` one chunk at a time ([d], base's dtype, else float32
    for a bf16/fp16 source). ``out`` as above. With ``screen`` also returns the [K] finite flags
    (the NaN/Inf screen, from the sum's own read of each chunk where a kernel does both; the caller
    decides). ``check_finite``: the former name of ``screen``."""
    what = "streamed_weighted_sum"
    screen = _renamed(what, "check_finite", check_finite, screen)
    src = _as_chunked(src)
    if base is not None:
        _check_vec(base, "base", what, src.d)
    odt = (
        base.dtype
        if base is not None
        else (torch.float32 if src.dtype in (torch.float16, torch.bfloat16) else src.dtype)
    )
    c64 = torch.as_tensor(coef, dtype=torch.float64).reshape(-1).cpu()
    r = None if rows is None else torch.as_tensor(rows, dtype=torch.long).cpu()
    fin = torch.ones(src.K, dtype=torch.bool, device=src.device)
    with _Out(out, src.d, odt, what) as dst:
        new = (
            dst.buf
            if dst.buf is not None and src.device.type == "cpu"
            else torch.empty(src.d, dtype=odt, device=src.device)
        )
        for a, b, c in src.chunks():
            ok = weighted_sum_block(c, c64, None if base is None else base[a:b], alpha, new[a:b], rows=r, screen=screen)
            if screen:
                fin &= ok.to(fin.device)
        new = dst.publish(new.cpu())
    return (new, fin.cpu()) if screen else new
