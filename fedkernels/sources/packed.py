"""Update rows in a packed (compressed) form (:class:`PackedRows`, one of the round runner's input forms) and
the compressed rows of a file (:class:`BlockCodeFile`)."""

from __future__ import annotations

import abc
import copy
import os
from typing import Any, Optional, Sequence, Tuple, Union

import torch

from .. import ops
from . import files
from .files import RawFileSource
from .matrix import PathLike, check_pos_int


class _CodeRows(RawFileSource):
    """A raw file of K x d int8 / float8_e4m3fn codes (BlockCodeFile's), read like any file source."""

    _CODE_DTYPES = (torch.int8, torch.float8_e4m3fn)


class PackedRows(abc.ABC):
    """K update rows in a packed (compressed) form, one of the round runner's input forms: ``agg.aggregate(g,
    rows, ...)`` runs a method whose server reads U only through ``RoundInput.weighted_sum`` on them, each weighted
    sum one pass over the packed rows (``weighted_sum``: ``(base + alpha * sum_k coef_k row_k, ok)``, ``ok`` the
    rows' finite flags of that pass); the runner's validation, screen, bad-row policy and re-run apply as to dense
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
        per_row = max(1, files.READ_BYTES // max(self.codes.K, 1))
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
