"""Update codecs: what a client sends instead of its fp32 update row, and the server's sum of what it got.

``make_codec(kind, d, ...)`` builds one of

==============  ==============================================================================================
``int8_block``  int8 codes, one float32 scale (absmax / 127) per block of ``block`` columns (the last block may be
                short); round to nearest. Bytes per row: d + 4 ceil(d / block).
``fp8``         float8 e4m3 codes (``torch.float8_e4m3fn``), one float32 scale (absmax / 448) per block; round to
                nearest even. Bytes per row: d + 4 ceil(d / block).
``qsgd``        QSGD (Alistarh et al. 2017): per bucket of ``block`` columns, ``norm * sign(v) * l / s`` with ``l`` =
                ``floor(|v| s / norm + u)``, ``u`` uniform from a generator seeded by (seed, round, client): unbiased,
                the same bits on every run. ``levels`` = s <= 127, stored as int8 codes and a float32 scale
                norm / s per bucket. Bytes per row: d + 4 ceil(d / block) (the int8 container; the paper's Elias
                coding is smaller).
``topk``        the ``k`` (or ``ratio`` d) entries of largest magnitude, as sorted int32 indices and float32 values.
                Bytes per row: 8 k.
==============  ==============================================================================================

Each codec can keep **error feedback** (Stich et al. 2018, Karimireddy et al. 2019): a per-client residual
``e_i`` (what compression dropped last time) is added to the next update before compressing, ``e_i = v - D(C(v))``
after: kept in memory (``Codec.residuals``, a dict) or, with ``residual_file=PATH``, as an N x d float32 table in a
file like the methods' other per-client tables (``algorithms.tables``: SCAFFOLD's ``control_file``, FedAWARE's
``momentum_file``): created with its blocks reserved on the first round, a version marker ``PATH.state`` written around
each update, referenced (not copied) by ``state_dict`` and reopened, checked, by ``load_state_dict``. Both keep the
same numbers: a run's rows are the same bits either way. Top-k
without it loses most of its accuracy (FedLab's table); the quantisers need it less.

The server sums what it received without a dense copy: ``BlockRows.weighted_sum`` is one
``ops.dequant_weighted_sum`` pass over the codes, ``SparseRows.weighted_sum`` one ``ops.sparse_weighted_sum`` pass
over the lists, both with the rows' finite flags. Both are ``fedkernels.sources.PackedRows``: the round runner takes
them as the updates (``agg.aggregate(g, rows, ...)``). This module imports only ``fedkernels.ops`` and ``sources``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .. import ops
from ..algorithms import tables
from ..sources import PackedRows

__all__ = ["KINDS", "Codec", "BlockRows", "SparseRows", "make_codec", "dense_bytes"]

KINDS = ("int8_block", "fp8", "topk", "qsgd")
DEFAULT_BLOCK = 256
_QMAX = {"int8_block": 127.0, "fp8": 448.0}


def dense_bytes(d: int) -> int:
    """Bytes of one uncompressed float32 update row."""
    return 4 * d


def _seed(*keys: int) -> int:
    h = hashlib.sha256(",".join(str(int(k)) for k in keys).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


@dataclass
class BlockRows(PackedRows):
    """K rows of block codes: ``Q`` [K, d] int8 / float8_e4m3fn, ``scales`` [K, ceil(d / block)] float32."""

    Q: torch.Tensor
    scales: torch.Tensor
    block: int

    @property
    def K(self) -> int:
        return self.Q.size(0)

    @property
    def d(self) -> int:
        return self.Q.size(1)

    def weighted_sum(
        self,
        coef: Any,
        base: Optional[torch.Tensor] = None,
        alpha: float = 1.0,
        rows: Any = None,
        out_dtype: Optional[torch.dtype] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        return ops.dequant_weighted_sum(
            self.Q, self.scales, coef, self.block, base=base, alpha=alpha, rows=rows, out_dtype=out_dtype
        )

    def select(self, keep: Sequence[int]) -> "BlockRows":
        k = torch.as_tensor(list(keep), dtype=torch.long)
        return self._carry(BlockRows(self.Q.index_select(0, k), self.scales.index_select(0, k), self.block), keep)

    def decoded_columns(self, ranges: Sequence[Tuple[int, int]]) -> torch.Tensor:
        """[K, n] float32: the columns of ``dense()`` in ``ranges`` (the same products, without the K x d copy)."""
        cols = torch.cat([torch.arange(a, b) for a, b in ranges]) if ranges else torch.zeros(0, dtype=torch.long)
        return self.scales.index_select(1, cols // self.block) * self.Q.index_select(1, cols).to(torch.float32)

    def dense(self) -> torch.Tensor:
        """float32 [K, d] (tests and the residuals; the server never calls it)."""
        s = self.scales.repeat_interleave(self.block, dim=1)[:, : self.d]
        return s * self.Q.to(torch.float32)

    def nbytes(self) -> List[int]:
        per = self.d * self.Q.element_size() + 4 * self.scales.size(1)
        return [per] * self.K


@dataclass
class SparseRows(PackedRows):
    """K index/value lists (CSR-like): ``idx`` int32, ``val`` float32, ``offsets`` [K + 1]."""

    idx: torch.Tensor
    val: torch.Tensor
    offsets: torch.Tensor
    d: int

    @property
    def K(self) -> int:
        return self.offsets.numel() - 1

    def weighted_sum(
        self,
        coef: Any,
        base: Optional[torch.Tensor] = None,
        alpha: float = 1.0,
        rows: Any = None,
        out_dtype: Optional[torch.dtype] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        return ops.sparse_weighted_sum(
            self.idx, self.val, self.offsets, coef, self.d, base=base, alpha=alpha, rows=rows, out_dtype=out_dtype
        )

    def select(self, keep: Sequence[int]) -> "SparseRows":
        o = self.offsets.tolist()
        return self._carry(
            SparseRows(
                *ops.stack_lists([self.idx[o[k] : o[k + 1]] for k in keep], [self.val[o[k] : o[k + 1]] for k in keep]),
                d=self.d,
            ),
            keep,
        )

    def decoded_columns(self, ranges: Sequence[Tuple[int, int]]) -> torch.Tensor:
        """[K, n] float32: the columns of ``dense()`` in ``ranges`` (each kept entry placed, the others 0)."""
        n = sum(b - a for a, b in ranges)
        out = torch.zeros(self.K, n)
        row = torch.repeat_interleave(torch.arange(self.K), (self.offsets[1:] - self.offsets[:-1]).long())
        idx = self.idx.long()
        at = 0
        for a, b in ranges:
            m = (idx >= a) & (idx < b)
            out.index_put_((row[m], idx[m] - a + at), self.val[m], accumulate=True)
            at += b - a
        return out

    def dense(self) -> torch.Tensor:
        out = torch.zeros(self.K, self.d)
        o = self.offsets.tolist()
        for k in range(self.K):
            out[k].index_add_(0, self.idx[o[k] : o[k + 1]].long(), self.val[o[k] : o[k + 1]])
        return out

    def nbytes(self) -> List[int]:
        n = (self.offsets[1:] - self.offsets[:-1]).tolist()
        return [m * (self.idx.element_size() + self.val.element_size()) for m in n]


Rows = Union[BlockRows, SparseRows]


class Codec:
    """A client-side compressor of update rows (``encode_rows``) with optional error feedback.

    Build it with :func:`make_codec` (checks the options). ``encode_rows(U, client_ids, rnd)`` compresses each
    row of ``U`` [K, d] (row k = client ``client_ids[k]``'s update, in round ``rnd``) and returns the rows as the
    server receives them (:class:`BlockRows` or :class:`SparseRows`), whose ``weighted_sum`` the server runs."""

    def __init__(
        self,
        kind: str,
        d: int,
        block: int,
        k: int,
        error_feedback: bool,
        levels: int,
        seed: int,
        residual_file: Optional[str] = None,
        num_clients: Optional[int] = None,
    ):
        self.kind, self.d, self.block, self.k = kind, d, block, k
        self.error_feedback, self.levels, self.seed = error_feedback, levels, seed
        self.residuals: Dict[int, torch.Tensor] = {}
        # residual_file: the residuals as rows of an [N, d] float32 file table (``table``, mapped on first use);
        # ``has``: the clients whose row holds a residual; ``table_version``: completed updates of the file
        self.residual_file, self.num_clients = residual_file, num_clients
        self.table: Optional[torch.Tensor] = None
        self.has: set = set()
        self.table_version = 0

    def _residual(self, cid: int) -> Optional[torch.Tensor]:
        if self.residual_file is None:
            return self.residuals.get(cid)
        return self.table[cid] if self.table is not None and cid in self.has else None

    def _table(self) -> torch.Tensor:
        if self.table is None:
            self.table = tables.table_file(
                self.residual_file,
                self.num_clients,
                self.d,
                torch.float32,
                exist_ok=False,
                what="compress.residual_file",
            )
            tables.updated(self.residual_file, self.table_version)
        return self.table

    def describe(self) -> str:
        opts = {
            "int8_block": f"block={self.block}",
            "fp8": f"block={self.block}",
            "qsgd": f"levels={self.levels}, block={self.block}",
            "topk": f"k={self.k}",
        }[self.kind]
        return f"{self.kind}({opts}, error_feedback={'on' if self.error_feedback else 'off'})"

    def row_bytes(self) -> int:
        """Bytes one client sends per round."""
        if self.kind == "topk":
            return 8 * self.k
        return self.d + 4 * (-(-self.d // self.block))

    # ---- client side ------------------------------------------------------------------------------
    def encode_rows(self, U: torch.Tensor, client_ids: Sequence[int], rnd: int) -> Rows:
        if U.dim() != 2 or U.size(1) != self.d:
            raise ValueError(f"compress.{self.kind}: updates must be [K, {self.d}], got shape {tuple(U.shape)}")
        if len(client_ids) != U.size(0):
            raise ValueError(f"compress.{self.kind}: {U.size(0)} rows but {len(client_ids)} client ids")
        V = U.detach().to(torch.float32)
        if self.error_feedback:
            if self.residual_file is not None and not all(0 <= int(c) < self.num_clients for c in client_ids):
                raise ValueError(
                    f"compress.residual_file: client ids must lie in [0, {self.num_clients}), got "
                    f"{list(client_ids)!r:.100}"
                )
            V = V.clone()
            for k, cid in enumerate(client_ids):  # each client adds its own residual (client-side work)
                e = self._residual(int(cid))
                if e is not None:
                    V[k].add_(e)
        rows = self._encode(V, client_ids, rnd)
        if self.error_feedback:
            D = rows.dense()
            E = V - D
            fin = torch.isfinite(E).all(1).tolist()
            if self.residual_file is not None:
                T = self._table()
                tables.updating(self.residual_file, self.table_version + 1)
                for k, cid in enumerate(client_ids):
                    if fin[k]:
                        T[int(cid)].copy_(E[k])
                        self.has.add(int(cid))
                    else:
                        self.has.discard(int(cid))
                self.table_version += 1
                tables.updated(self.residual_file, self.table_version)
                return rows
            for k, cid in enumerate(client_ids):  # a NaN/Inf update (excluded by the server) leaves no residual
                if fin[k]:
                    self.residuals[int(cid)] = E[k]
                else:
                    self.residuals.pop(int(cid), None)
        return rows

    def _encode(self, V: torch.Tensor, client_ids: Sequence[int], rnd: int) -> Rows:
        K, d = V.shape
        if self.kind == "topk":
            k = min(self.k, d)
            idx = (
                torch.topk(V.abs(), k, dim=1, sorted=False).indices.sort(dim=1).values
                if K
                else torch.zeros(0, k, dtype=torch.long)
            )
            val = torch.gather(V, 1, idx)
            offsets = torch.arange(K + 1, dtype=torch.int64) * k
            return SparseRows(idx.reshape(-1).to(torch.int32), val.reshape(-1).contiguous(), offsets, d)
        B = self.block
        nb = -(-d // B)
        P = torch.zeros(K, nb * B, dtype=torch.float32)
        P[:, :d] = V
        P = P.view(K, nb, B)
        if self.kind == "qsgd":
            s = float(self.levels)
            norm = P.pow(2).sum(2).sqrt()  # [K, nb]
            u = torch.empty_like(P)
            for k, cid in enumerate(client_ids):  # one seeded stream per client and round
                u[k].uniform_(generator=torch.Generator().manual_seed(_seed(self.seed, rnd, int(cid))))
            safe = torch.where(norm > 0, norm, torch.ones_like(norm))[:, :, None]
            lvl = torch.floor(P.abs() / safe * s + u).clamp_(0, s)
            Q = (torch.sign(P) * lvl).to(torch.int8)
            scales = norm / s
        else:
            qmax = _QMAX[self.kind]
            amax = P.abs().amax(2)  # [K, nb]
            scales = amax / qmax
            # divide (not multiply by 1 / scale: a subnormal scale's inverse overflows and 0 * inf is NaN)
            X = torch.where(scales[:, :, None] > 0, P / torch.where(scales > 0, scales, 1.0)[:, :, None], 0.0)
            Q = (
                torch.round(X).clamp_(-127, 127).to(torch.int8)
                if self.kind == "int8_block"
                else X.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)
            )
        return BlockRows(Q.reshape(K, nb * B)[:, :d].contiguous(), scales.to(torch.float32).contiguous(), B)

    # ---- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The residuals: copies (in memory), or a reference to the file table (``tables.reference``: path, shape,
        dtype, version) and the clients that hold one."""
        if self.residual_file is not None and self.table is not None:
            return {
                "residuals": tables.reference(self.residual_file, self.table, self.table_version),
                "has": sorted(self.has),
            }
        return {"residuals": {int(c): e.clone() for c, e in self.residuals.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """The inverse of :meth:`state_dict`. A referenced file table is reopened after its checks (the same
        path as this codec's ``residual_file``, its marker at the state's version: ValueError otherwise); in-memory
        residuals loaded into a codec with a ``residual_file`` are written to that (new) file, and a file's rows
        into a codec without one are copied into memory."""
        res = state.get("residuals", {})
        if tables.is_reference(res):
            T, path, v = tables.reopen("compress.load_state_dict", "compress.residual_file", res, self.residual_file)
            has = sorted(int(c) for c in state.get("has", []))
            if self.residual_file is None:
                self.residuals = {c: T[c].clone() for c in has}
                return
            self.table, self.residual_file, self.table_version, self.has = T, path, v, set(has)
            return
        loaded = {int(c): e.clone() for c, e in res.items()}
        if self.residual_file is None:
            self.residuals = loaded
        elif loaded:
            T = self._table()
            tables.updating(self.residual_file, self.table_version + 1)
            for c, e in loaded.items():
                T[c].copy_(e)
            self.has = set(loaded)
            self.table_version += 1
            tables.updated(self.residual_file, self.table_version)


def make_codec(
    kind: str,
    d: int,
    block: Optional[int] = None,
    k: Optional[int] = None,
    ratio: Optional[float] = None,
    error_feedback: bool = False,
    levels: int = 16,
    seed: int = 0,
    residual_file: Optional[Any] = None,
    num_clients: Optional[int] = None,
) -> Codec:
    """A :class:`Codec` for rows of ``d`` parameters, its options checked (one-line ValueError naming the option,
    the value and what was expected). ``block``: columns per scale (int8_block, fp8, qsgd; 1..d; default
    min(256, d)); ``k`` (1..d) or ``ratio`` (0 < ratio <= 1, k = max(1, round(ratio d))): top-k's kept entries;
    ``levels``: qsgd's s (1..127); ``error_feedback``: keep per-client residuals; ``seed``: qsgd's stream;
    ``residual_file``: keep the residuals in that file (an [num_clients, d] float32 table) instead of memory."""
    if kind not in KINDS:
        raise ValueError(f"compress.kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    if isinstance(d, bool) or not isinstance(d, int) or d < 1:
        raise ValueError(f"compress: the update length d must be an int >= 1, got {d!r}")
    if not isinstance(error_feedback, bool):
        raise ValueError(f"compress.error_feedback: expected true or false, got {error_feedback!r}")
    bl = 0
    kk = 0
    if kind == "topk":
        if block is not None:
            raise ValueError(
                f"compress.block: topk has no blocks (got block={block!r}); set compress.k or compress.ratio"
            )
        if (k is None) == (ratio is None):
            raise ValueError(
                f"compress.k / compress.ratio: topk needs exactly one of them, got k={k!r}, ratio={ratio!r}"
            )
        if k is not None:
            if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= d:
                raise ValueError(f"compress.k: expected an int in [1, d = {d}], got {k!r}")
            kk = k
        else:
            if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
                raise ValueError(f"compress.ratio: expected a number in (0, 1], got {ratio!r}")
            kk = max(1, min(d, int(round(ratio * d))))
    else:
        if k is not None or ratio is not None:
            raise ValueError(
                f"compress.k / compress.ratio: only topk keeps k entries, got kind={kind!r} with "
                f"k={k!r}, ratio={ratio!r}"
            )
        bl = min(DEFAULT_BLOCK, d) if block is None else block
        if isinstance(bl, bool) or not isinstance(bl, int) or not 1 <= bl <= d:
            raise ValueError(f"compress.block: expected an int in [1, d = {d}] (columns per scale), got {block!r}")
    if kind == "qsgd":
        if isinstance(levels, bool) or not isinstance(levels, int) or not 1 <= levels <= 127:
            raise ValueError(f"compress.levels: expected an int in [1, 127] (qsgd's s, stored as int8), got {levels!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"compress.seed: expected an int, got {seed!r}")
    if residual_file is not None:
        if not error_feedback:
            raise ValueError(
                f"compress.residual_file: set (got {residual_file!r}) but compress.error_feedback is off: "
                "there are no residuals to keep"
            )
        if isinstance(num_clients, bool) or not isinstance(num_clients, int) or num_clients < 1:
            raise ValueError(
                f"compress.residual_file: needs num_clients (the table's rows), an int >= 1, got {num_clients!r}"
            )
        residual_file = tables.check_path("compress", "residual_file", residual_file)
    return Codec(kind, d, bl, kk, error_feedback, int(levels), seed, residual_file, num_clients)
