"""Aggregation of update matrices larger than memory: the K x d matrix streamed in column chunks.

The matrix comes from any ``fedkernels.sources.MatrixSource`` (a CPU tensor, a NumPy array /
``np.memmap``, a raw row-major file of float16/bfloat16/float32/float64, or one file per client);
``ChunkedUpdates`` adds the chunk width and the device the chunks are delivered to (pinned staging
and a copy when it is a CUDA device). Every function below also takes what ``as_source`` takes.

* FedAvg-style methods: one streamed pass of ``ops.weighted_sum`` per chunk
  (:func:`streamed_weighted_sum`, :func:`streamed_fedavg`); finite-row screening rides along.
* Gram-based methods: pass 1 accumulates the K x K fp64 Gram (and the finite-row flags) over the
  chunks in a fixed order, the K weights come from it, pass 2 is the weighted sum
  (:func:`streamed_gram`, :func:`streamed_kuramoto`); two reads of U, the floor for
  weight-then-sum methods. :func:`streamed_fedaware` streams FedAWARE's N x d momentum table (a
  host or disk-backed tensor, e.g. :func:`momentum_file`) alongside U.

Dtypes: a bf16/fp16 source is summed in the result's dtype (the global model's; float32 when there
is none), the Gram in fp64. The result ``[d]`` is computed into a fresh buffer and published only
after the whole aggregation succeeded: ``out`` (a tensor) is filled then, a path ``out`` is written
to a temporary file beside it and renamed into place. A bad row (NaN/Inf) raises BadUpdateError
naming the client row before anything is written; the global model is never modified.
"""
from __future__ import annotations

import os
from typing import Iterator, Optional, Sequence, Tuple, Union

import torch

from . import ops
from .errors import BadUpdateError  # noqa: F401  (raised through the sources; re-exported)
from .ops import weighted_sum_chunked  # noqa: F401  (moved to fedkernels.ops; re-exported)
from .sources import MatrixSource, as_source, check_pos_int, itemsize

__all__ = ["ChunkedUpdates", "streamed_gram", "streamed_finite_rows", "streamed_weighted_sum",
           "streamed_fedavg", "streamed_kuramoto", "streamed_fedaware", "momentum_file", "weighted_sum_chunked"]

DEFAULT_CHUNK_BYTES = 64 << 20   # staging memory per chunk (all K rows)
OutLike = Union[None, torch.Tensor, str, os.PathLike]


class ChunkedUpdates:
    """A K x d update matrix read ``chunk_cols`` columns at a time.

    source: a ``MatrixSource`` or what ``fedkernels.sources.as_source`` takes: a [K, d] CPU tensor, a
    [K, d] NumPy array / np.memmap, a path to a raw row-major file (then ``K``, ``d``, ``dtype``
    (default float32) and optionally ``offset`` in bytes are required) or a list of per-client files
    (``d`` and ``dtype``). chunk_cols: columns per chunk (default: ``DEFAULT_CHUNK_BYTES`` of staging
    for all K rows). device: where chunks are delivered (default CPU); pinned staging when CUDA.
    """

    def __init__(self, source, K: Optional[int] = None, d: Optional[int] = None,
                 dtype: Optional[torch.dtype] = None, chunk_cols: Optional[int] = None, device=None, offset: int = 0):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.source: MatrixSource = as_source(source, K, d, dtype, offset, what="ChunkedUpdates")
        self.K, self.d, self.dtype = self.source.K, self.source.d, self.source.dtype
        for name, v, got in (("K", K, self.K), ("d", d, self.d)):
            if v is not None and v != got:
                raise ValueError(f"ChunkedUpdates: {name}={v} but the source has {name}={got}")
        if chunk_cols is None:
            chunk_cols = max(1024, DEFAULT_CHUNK_BYTES // max(1, self.K * itemsize(self.dtype)))
        self.chunk_cols = min(check_pos_int(chunk_cols, "ChunkedUpdates", "chunk_cols"), max(self.d, 1))
        self._stage = None

    @property
    def shape(self) -> Tuple[int, int]:
        return (self.K, self.d)

    @property
    def staging_bytes(self) -> int:
        return self.K * self.chunk_cols * itemsize(self.dtype)

    def chunks(self) -> Iterator[Tuple[int, int, torch.Tensor]]:
        """Yields ``(a, b, U[:, a:b])`` on ``device`` in column order; valid until the next one."""
        for a, b, c in self.source.chunks(self.chunk_cols):
            yield a, b, self._deliver(c)

    def _deliver(self, c: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return c
        if self._stage is None:
            self._stage = torch.empty(self.K, self.chunk_cols, dtype=self.dtype,
                                      pin_memory=torch.cuda.is_available())
        st = self._stage[:, : c.size(1)]
        st.copy_(c)
        return st.to(self.device, non_blocking=True)


def _as_chunked(src, chunk_cols: Optional[int] = None) -> ChunkedUpdates:
    if isinstance(src, ChunkedUpdates):
        return src
    return ChunkedUpdates(src, chunk_cols=chunk_cols)


# ---- the result vector: computed aside, published after success -----------------------------------------
def _result_dtype(src: ChunkedUpdates, base: Optional[torch.Tensor]) -> torch.dtype:
    if base is not None:
        return base.dtype
    return torch.float32 if src.dtype in (torch.float16, torch.bfloat16) else src.dtype


def _check_vec(v: torch.Tensor, name: str, what: str, d: int, dtype: Optional[torch.dtype] = None) -> None:
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(v).__name__}")
    if v.dim() != 1 or v.numel() != d or v.device.type != "cpu":
        raise ValueError(f"{what}: {name} must be a [d={d}] CPU tensor, got shape {tuple(v.shape)} on {v.device}")
    if dtype is not None and v.dtype != dtype:
        raise ValueError(f"{what}: {name} must have dtype {dtype}, got {v.dtype}")


class _Result:
    """The [d] result of one aggregation: a fresh buffer (in memory, or a temporary file beside a path
    ``out``) that ``publish`` hands over only after success; ``discard`` removes the temporary."""

    def __init__(self, out: OutLike, d: int, dtype: torch.dtype, what: str):
        self.out, self.tmp = out, None
        if isinstance(out, (str, os.PathLike)):
            path = os.fspath(out)
            folder = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(folder):
                raise ValueError(f"{what}: out {path!r}: folder {folder!r} does not exist")
            if os.path.isdir(path):
                raise ValueError(f"{what}: out {path!r} is a folder, expected a file path (or a tensor)")
            self.tmp = f"{path}.tmp-{os.getpid()}"
            with open(self.tmp, "wb") as f:
                f.truncate(d * itemsize(dtype))
            self.buf = torch.from_file(self.tmp, shared=True, size=d, dtype=dtype)
        else:
            if out is not None:
                _check_vec(out, "out", what, d, dtype)
            self.buf = torch.empty(d, dtype=dtype)

    def publish(self) -> torch.Tensor:
        if self.tmp is not None:
            with open(self.tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(self.tmp, os.fspath(self.out))
            self.tmp = None
            return self.buf
        if self.out is not None:
            return self.out.copy_(self.buf)
        return self.buf

    def discard(self) -> None:
        if self.tmp is not None and os.path.exists(self.tmp):
            os.remove(self.tmp)
        self.tmp = None


def _fill(res: _Result, fill) -> torch.Tensor:
    try:
        fill(res.buf)
    except BaseException:
        res.discard()
        raise
    return res.publish()


# ---- streamed passes ---------------------------------------------------------------------------------------
def _screen(src: ChunkedUpdates, c: torch.Tensor, a: int, b: int, acc: torch.Tensor) -> None:
    """Screens one chunk's rows for NaN/Inf: host chunks raise at once (BadUpdateError naming the client
    row and the columns; the rest of U is not read), device chunks accumulate into ``acc`` (checked
    with one sync at the end of the pass, ``src.source.check_rows(acc)``)."""
    f = ops.finite_rows(c)
    if src.device.type == "cpu":
        src.source.check_rows(f, (a, b))
    else:
        acc &= f


def _gram_pass(src: ChunkedUpdates, rows=None, flags: bool = False, screen: bool = False):
    G = torch.zeros(src.K if rows is None else len(rows), src.K, dtype=torch.float64, device=src.device)
    fin = torch.ones(src.K, dtype=torch.bool, device=src.device)
    for a, b, c in src.chunks():
        G.add_(ops.gram(c, rows=rows))
        if screen:
            _screen(src, c, a, b, fin)
        elif flags:
            fin &= ops.finite_rows(c)
    if screen:
        src.source.check_rows(fin)
    return G.cpu(), fin.cpu()


def streamed_gram(src, rows=None, with_finite: bool = False):
    """``ops.gram`` of the whole matrix, summed over column chunks in order (fp64 [K, K] on the CPU);
    with ``with_finite`` also the [K] finite-row flags from the same pass. Both accumulate on the
    chunks' device and come to the host once, at the end."""
    G, fin = _gram_pass(_as_chunked(src), rows, flags=with_finite)
    return (G, fin) if with_finite else G


def streamed_finite_rows(src) -> torch.Tensor:
    src = _as_chunked(src)
    fin = torch.ones(src.K, dtype=torch.bool, device=src.device)
    for _, _, c in src.chunks():
        fin &= ops.finite_rows(c)
    return fin.cpu()


CONVERT_COLS = 1 << 17   # columns per cache-sized block when a chunk's dtype is converted


def _wsum_chunk(c: torch.Tensor, coef, base_chunk, alpha: float, rows, odt: torch.dtype, dev,
                dst: torch.Tensor) -> None:
    """``dst = base + alpha * sum_i coef_i c[rows_i]`` for one chunk, in dtype ``odt``. A bf16/fp16
    chunk is converted CONVERT_COLS columns at a time (a K x CONVERT_COLS scratch that stays in cache,
    not a K x chunk_cols copy); per coordinate the same bits as converting it whole."""
    bb = None if base_chunk is None else base_chunk.to(device=dev, dtype=odt)
    if c.dtype == odt:
        dst.copy_(ops.weighted_sum(c, coef, base=bb, alpha=alpha, rows=rows))
        return
    if rows is not None:
        c = c.index_select(0, rows.to(c.device))
    w = c.size(1)
    scratch = torch.empty(c.size(0), min(w, CONVERT_COLS), dtype=odt, device=c.device)
    for j in range(0, w, CONVERT_COLS):
        e = min(w, j + CONVERT_COLS)
        s = scratch[:, : e - j]
        s.copy_(c[:, j:e])
        dst[j:e].copy_(ops.weighted_sum(s, coef, base=None if bb is None else bb[j:e], alpha=alpha))


def _sum_pass(src: ChunkedUpdates, coef, base, alpha, rows, buf: torch.Tensor, fin=None,
              screen: bool = False) -> None:
    """One pass of the weighted sum into ``buf``; ``fin``: [K] flags to AND the rows' finiteness
    into; ``screen``: raise on a bad row instead (see ``_screen``)."""
    c64 = torch.as_tensor(coef, dtype=torch.float64).cpu()    # host coefficients and rows for every device
    r = None if rows is None else torch.as_tensor(rows, dtype=torch.long).cpu()
    acc = torch.ones(src.K, dtype=torch.bool, device=src.device)
    for a, b, c in src.chunks():
        if screen:                                 # before the chunk is summed: the first bad chunk stops
            _screen(src, c, a, b, acc)
        elif fin is not None:
            acc &= ops.finite_rows(c)
        _wsum_chunk(c, c64, None if base is None else base[a:b], alpha, r, buf.dtype, src.device, buf[a:b])
    if screen:
        src.source.check_rows(acc)
    if fin is not None:
        fin &= acc.cpu()


def streamed_weighted_sum(src, coef, base: Optional[torch.Tensor] = None, alpha: float = 1.0, rows=None,
                          out: OutLike = None, check_finite: bool = False):
    """``base + alpha * sum_i coef_i U[rows_i]`` one chunk at a time ([d], base's dtype, else float32
    for a bf16/fp16 source). ``out``: None (a new tensor), a [d] CPU tensor (may be ``base``; filled
    after the last chunk) or a path (a raw file, written to a temporary and renamed). With
    ``check_finite`` also returns the [K] finite-row flags (the caller decides)."""
    src = _as_chunked(src)
    what = "streamed_weighted_sum"
    if base is not None:
        _check_vec(base, "base", what, src.d)
    fin = torch.ones(src.K, dtype=torch.bool) if check_finite else None
    res = _Result(out, src.d, _result_dtype(src, base), what)
    new = _fill(res, lambda buf: _sum_pass(src, coef, base, alpha, rows, buf, fin))
    return (new, fin) if check_finite else new


def _check_counts(num_examples, K: int, what: str) -> torch.Tensor:
    n = torch.as_tensor(num_examples, dtype=torch.float64).reshape(-1)
    if n.numel() != K or not bool(torch.isfinite(n).all()) or bool((n < 0).any()) or not float(n.sum()) > 0:
        raise ValueError(f"{what}: num_examples must be {K} finite counts >= 0 with a positive sum, "
                         f"got {num_examples!r}")
    return n


def streamed_fedavg(global_flat: torch.Tensor, src, num_examples, server_lr: float = 1.0,
                    out: OutLike = None) -> torch.Tensor:
    """FedAvg ``global + server_lr * sum_k p_k U_k`` in one streamed pass (rows screened for NaN/Inf
    in the same pass; a bad row raises BadUpdateError naming it, ``global_flat`` and ``out`` are left
    untouched)."""
    src = _as_chunked(src)
    what = "streamed_fedavg"
    _check_vec(global_flat, "global_flat", what, src.d)
    n = _check_counts(num_examples, src.K, what)
    return _fill(_Result(out, src.d, global_flat.dtype, what),      # a bad row raises before publishing
                 lambda buf: _sum_pass(src, n / n.sum(), global_flat, server_lr, None, buf, screen=True))


def streamed_kuramoto(global_flat: torch.Tensor, src, num_examples, aggregator=None, out: OutLike = None):
    """Kuramoto-FedAvg (modes S and P) streamed: pass 1 Gram + screening, weights from the Gram as
    ``KuramotoFedAvg`` computes them, pass 2 the weighted sum. ``aggregator``: a KuramotoFedAvg
    whose options (and round counter, advanced here after success) are used; default mode S.
    Returns (new, info)."""
    from .algorithms.kuramoto import KuramotoFedAvg, kuramoto_weights
    agg = aggregator if aggregator is not None else KuramotoFedAvg()
    if agg.mode not in ("P", "S"):
        raise ValueError("streamed_kuramoto: modes S and P (mode C needs the elementwise clamp: use ops per chunk)")
    src = _as_chunked(src)
    what = "streamed_kuramoto"
    _check_vec(global_flat, "global_flat", what, src.d)
    n = _check_counts(num_examples, src.K, what)
    res = _Result(out, src.d, global_flat.dtype, what)      # refuses a bad out before reading U
    p = n.new_full((src.K,), 1.0 / src.K) if agg.weighting == "uniform" else n / n.sum()
    try:
        G, _ = _gram_pass(src, screen=True)
    except BaseException:
        res.discard()
        raise
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
    new = _fill(res, lambda buf: _sum_pass(src, a, global_flat, alpha, None, buf))
    info.update(mode=agg.mode, kappa=kap, weights=a.tolist(), p=p.tolist(), num_clients=src.K)
    agg.round += 1
    return new, info


# ---- FedAWARE: the momentum table streamed alongside U -------------------------------------------------
def momentum_file(path: Union[str, os.PathLike], N: int, d: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """FedAWARE's [N, d] momentum table as a disk-backed tensor (``torch.from_file``, shared): created
    as a zero (sparse) file if ``path`` does not exist, else opened; its size must be N * d * itemsize."""
    path = os.fspath(path)
    need = int(N) * int(d) * itemsize(dtype)
    if not os.path.exists(path):
        with open(path, "wb") as f:
            f.truncate(need)
    elif os.path.getsize(path) != need:
        raise ValueError(f"momentum_file: {path} has {os.path.getsize(path)} bytes, expected {need} for "
                         f"N={N} x d={d} {dtype}")
    return torch.from_file(path, shared=True, size=int(N) * int(d), dtype=dtype).view(int(N), int(d))


def _ema_chunk(Mc: torch.Tensor, Uc: torch.Tensor, idx: torch.Tensor, first: torch.Tensor, a: float) -> torch.Tensor:
    """The [k, c] new momenta of the participants ``idx`` for one column chunk, computed as
    FedAWARE._update_momenta does in place: m := U (first participation under init=first_update),
    else m <- (1 - a) m + a U (two roundings in M's dtype)."""
    m = Mc.index_select(0, idx)
    old = ~first
    if bool(old.all()):
        return m.mul_(1.0 - a).add_(Uc, alpha=a)
    m[first] = Uc[first].to(m.dtype)
    if bool(old.any()):
        m[old] = m[old].mul_(1.0 - a).add_(Uc[old], alpha=a)
    return m


def streamed_fedaware(global_flat: torch.Tensor, src, num_examples, client_ids: Sequence[int], aggregator,
                      momenta: torch.Tensor, out: OutLike = None):
    """One FedAWARE round with U and the [N, d] momentum table ``momenta`` (a CPU tensor: in memory,
    or disk-backed from :func:`momentum_file`) streamed in column chunks. ``aggregator``: a FedAWARE
    (its options, its N x N Gram cache, seen flags and counts are used and advanced, as its own
    ``aggregate`` does; its in-memory table ``M`` is not used). Supported: every warmup, init and
    variant, zero_fallback; not the ``extension`` options.

    Pass 1 reads U and M: screens U's rows, accumulates the participants' Gram rows of the updated
    table ([k, N], fp64) and the ELUD Gram ([k, k]) without writing anything. Then the host step
    (min-norm solve on the N x N Gram). Pass 2 reads U and M again, writes the participants' momenta
    into ``momenta`` and sums the step. A bad row raises before any state or output changes.
    Returns (new, info)."""
    from .algorithms.fedaware import FedAWARE, elud
    agg = aggregator
    what = "streamed_fedaware"
    if not isinstance(agg, FedAWARE):
        raise TypeError(f"{what}: aggregator must be a FedAWARE, got {type(agg).__name__}")
    if agg.extension is not None:
        raise ValueError(f"{what}: extension={agg.extension!r} is not streamed (use extension=None)")
    src = _as_chunked(src)
    K, d = src.K, src.d
    if src.device.type != "cpu":
        raise ValueError(f"{what}: chunks must be delivered to the CPU (the momentum table is a host tensor), "
                         f"got device {src.device}")
    _check_vec(global_flat, "global_flat", what, d)
    n = _check_counts(num_examples, K, what)
    N = agg.num_clients
    if N is None:
        raise ValueError(f"{what}: the aggregator needs num_clients=N")
    if not isinstance(momenta, torch.Tensor) or tuple(momenta.shape) != (N, d) or momenta.device.type != "cpu":
        raise ValueError(f"{what}: momenta must be a [N={N}, d={d}] CPU tensor, got "
                         f"{tuple(getattr(momenta, 'shape', ()))} {type(momenta).__name__}")
    ids = [int(i) for i in client_ids]
    if len(ids) != K or len(set(ids)) != K or not all(0 <= i < N for i in ids):
        raise ValueError(f"{what}: client_ids must be {K} distinct ids in [0, {N}), got {list(client_ids)!r}")
    if agg.Gm is None:
        agg.Gm = torch.zeros(N, N, dtype=torch.float64)
        agg.seen = torch.zeros(N, dtype=torch.bool)
        agg.n_examples = torch.zeros(N, dtype=torch.float64)
    idx = torch.tensor(ids, dtype=torch.long)
    first = (~agg.seen.index_select(0, idx)) if agg.init == "first_update" else torch.zeros(K, dtype=torch.bool)
    res = _Result(out, d, global_flat.dtype, what)
    info = {}
    try:
        # pass 1: screening, Gram rows of the updated table, ELUD Gram; nothing written
        Gr = torch.zeros(K, N, dtype=torch.float64)
        Gu = torch.zeros(K, K, dtype=torch.float64) if agg.log_elud else None
        for a, b, Uc in src.chunks():
            src.source.check_rows(ops.finite_rows(Uc), (a, b))
            Mn = momenta[:, a:b].clone()
            Mn.index_copy_(0, idx, _ema_chunk(momenta[:, a:b], Uc, idx, first, agg.alpha))
            Gr.add_(ops.gram(Mn, rows=idx).cpu())
            if Gu is not None:
                Gu.add_(ops.gram(Uc).cpu())
    except BaseException:
        res.discard()
        raise
    # host step: the aggregator's state advanced as in FedAWARE._update_momenta, then its solve
    if Gu is not None:
        info["elud"], info["elud_sqrt"] = elud(Gu)
    agg.Gm[idx, :] = Gr
    agg.Gm[:, idx] = Gr.T
    agg.seen[idx] = True
    agg.n_examples[idx] = n
    p = n / n.sum()                                       # sample weights (the explore step)
    exploring = agg.warmup == "explore" and not bool(agg.seen.all())
    info["phase"] = "explore" if exploring else "aware"
    src_rows, coef, alpha = None, None, agg.server_lr     # the step: on U (explore) or on M's rows
    if exploring:
        coef = p
        info.update(weights=p.tolist(), num_seen=int(agg.seen.sum()))
    elif agg.variant == "na":
        src_rows, coef = agg._na_coef()
        info.update(support=src_rows.tolist(), coef=coef.tolist())
    else:
        src_rows, coef, zero_dir = agg.aware_direction(info)
        if zero_dir:
            if agg.zero_fallback == "na":
                src_rows, coef = agg._na_coef()
                info["fallback"] = "na"
            else:
                src_rows, coef, alpha = None, None, 0.0
                info["fallback"] = "zero step"
    odt = global_flat.dtype

    def fill(buf):                                        # pass 2: write the momenta, sum the step
        for a, b, Uc in src.chunks():
            m = _ema_chunk(momenta[:, a:b], Uc, idx, first, agg.alpha)
            momenta[:, a:b].index_copy_(0, idx, m)
            x = global_flat[a:b]
            if exploring:
                _wsum_chunk(Uc, p, x, alpha, None, odt, src.device, buf[a:b])
            elif coef is None:
                buf[a:b].copy_(x)
            else:
                _wsum_chunk(momenta[:, a:b], coef, x, alpha, src_rows, odt, src.device, buf[a:b])
    new = _fill(res, fill)
    return new, info
