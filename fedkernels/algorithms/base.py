"""Aggregator and ClientRule interfaces, shared validation, and the registry.

An ``Aggregator`` is the server side of a method. It is stateful (``state_dict`` /
``load_state_dict``) and works on flat vectors only:

    new_global, info = agg.aggregate(global_flat, updates, num_examples, client_ids, payloads)

* ``global_flat``: [d] current global model.
* ``updates``: [K, d] matrix, row k = client k's update ``local - global`` (see fedkernels.flat).
* ``num_examples``: K sample counts (> 0); ``client_ids``: K ints naming the clients (state rows);
  ``payloads``: optional K dicts of extra client outputs (control-variate deltas, step counts, ...).

``aggregate`` is the round runner (:mod:`fedkernels.algorithms.runner`: validation, the NaN/Inf screen,
the bad-row policy) around the method's update, ``_aggregate(rin)``; what a method is (its update,
``passes()``, options and ranges, state) lives in its class, what acts around any method in a wrapper
(:mod:`fedkernels.algorithms.wrappers`).

A ``ClientRule`` is the client side of a method that changes local training. The training loop
(fedkernels.sim, or the user's own) calls its hooks; see ``ClientRule`` below.
"""

from __future__ import annotations

import abc
import array
import contextvars
import math
import struct
from dataclasses import dataclass, field, fields, replace
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    Iterator,
    List,
    NamedTuple,
    Optional,
    Sequence,
    Tuple,
    Type,
    TypeVar,
    Union,
)

import torch

from .. import ops
from .._memory import new_vector
from .._types import CoefLike
from ..ops._autograd import needs_grad
from ..ops._checks import has_kernel, tracing  # tracing: also imported from here by the method modules
from ..sources import HOST, ChunkedUpdates, MatrixSource, PackedRows, weighted_sum_block
from . import signature
from .signature import Option, check_options, signature_params, suggest, unknown_option

if TYPE_CHECKING:
    from ..flat import FlatSpec

BAD_UPDATE_POLICIES = ("raise", "exclude")

# the client updates of one round: a [K, d] matrix, K tensors of d elements each, or a K x d matrix source
# read in column chunks (fedkernels.sources: a MatrixSource, or a ChunkedUpdates naming the chunk width)
Updates = Union[torch.Tensor, Sequence[torch.Tensor], MatrixSource, ChunkedUpdates]


def info_values(t: Any) -> Any:
    """A tensor for ``AggResult.info``: a list (a Python number for a 0-d tensor) in eager mode, the
    tensor itself while tracing; anything else as it is."""
    return t if tracing() or not isinstance(t, torch.Tensor) else t.tolist()


def _numbers(code: str, values: Any) -> "array.array":
    """``array.array(code, values)`` ("d": floats, "q": int64): a sequence's numbers packed by ``struct``
    in one C-level pass (2-3x faster than array's own conversion of a list of K numbers); TypeError
    for an entry that is not such a number (OverflowError for an int out of range of "d")."""
    try:
        n = len(values)
    except TypeError:
        return array.array(code, values)
    try:
        b = struct.pack(f"{n}{code}", *values)
    except struct.error as e:
        raise TypeError(f"not a {code!r} number: {e}") from None
    a = array.array(code)
    a.frombytes(b)
    return a


def _f64(a: "array.array") -> torch.Tensor:
    return torch.frombuffer(a, dtype=torch.float64) if len(a) else torch.zeros(0, dtype=torch.float64)


def host_float64(values: Any) -> torch.Tensor:
    """``values`` (a sequence of numbers, or a tensor on any device) as a 1-D float64 host tensor. A
    list of Python numbers is converted in one C-level pass (``array``), not number by number;
    anything else goes through ``torch.as_tensor`` (which raises for what is not numbers)."""
    if isinstance(values, (list, tuple)):
        try:
            return _f64(_numbers("d", values))
        except (TypeError, ValueError, OverflowError, RuntimeError):
            pass  # nested sequences, text, ...: torch's conversion below
    t = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
    return t if t.device.type == "cpu" else t.cpu()


def id_tensor(ids: Sequence[int], device: Any = None) -> torch.Tensor:
    """Client ids (Python ints, e.g. ``RoundInput.client_ids``) as an int64 index tensor in one C-level
    conversion (``torch.tensor`` of a list of K ints costs ~0.15 us per id)."""
    a = _numbers("q", ids)
    t = torch.frombuffer(a, dtype=torch.long) if len(a) else torch.zeros(0, dtype=torch.long)
    return t if device is None or torch.device(device).type == "cpu" else t.to(device)


def payload_numbers(payloads: Sequence[Dict[str, Any]], key: str, default: float = math.nan) -> Optional[torch.Tensor]:
    """[K] float64 host tensor of ``payload[key]`` over a round's payloads (``default`` where absent) in
    one C-level conversion, or None when some entry is not a plain number (text, a tensor of several
    elements, None, ...): the caller then looks at those payloads one by one."""
    try:
        return _f64(_numbers("d", [p.get(key, default) for p in payloads]))
    except (TypeError, ValueError, OverflowError, RuntimeError):
        return None


def host_copy_with(flags: torch.Tensor, carry: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(flags, carry) on the host in ONE device-to-host copy: the bytes of the bool ``flags`` and of
    ``carry`` (any dtype, same device) packed into one buffer, copied, and viewed back (exact)."""
    c = carry.contiguous()
    nb = c.numel() * c.element_size()
    both = torch.cat([c.reshape(-1).view(torch.uint8), flags.reshape(-1).view(torch.uint8)]).cpu()
    return both[nb:].view(torch.bool), both[:nb].view(c.dtype).view(c.shape)


def rows_where(mask: torch.Tensor) -> List[int]:
    """The row numbers where the [K] bool host tensor ``mask`` is True."""
    return mask.nonzero().reshape(-1).tolist()


class AggResult(NamedTuple):
    params: torch.Tensor  # the new global flat vector
    info: Dict[str, Any]  # what the method wants logged (weights, guards, iterations, excluded...)


from ..errors import BadUpdateError  # noqa: E402,F401  (defined below the algorithms; re-exported here)


@dataclass(frozen=True)
class UpdatesShape:
    """What ``validate`` and the on_bad_update policy read of a round's updates: the [K, d] rows'
    shape, dtype and device, no data. A tensor gives it (``UpdatesShape.of(U)``), a chunked source its
    own (``runner._chunked_source``: K x d in the model's dtype and device, where its chunks are
    summed); dropping rows is ``keep(n)`` (no K x d copy)."""

    K: int
    d: int
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, U: Union[torch.Tensor, "UpdatesShape"]) -> "UpdatesShape":
        return U if isinstance(U, UpdatesShape) else cls(U.size(0), U.size(1), U.dtype, U.device)

    def size(self, dim: int) -> int:
        return (self.K, self.d)[dim]

    def keep(self, n: int) -> "UpdatesShape":
        return replace(self, K=n)


class PackedRowsRefused(ValueError):
    """A method read packed (compressed) rows another way than through ``RoundInput.weighted_sum``."""


@dataclass
class RoundInput:
    """Validated inputs of one aggregation (what ``Aggregator._aggregate`` receives).

    The updates are read only through ``weighted_sum``, ``gram``, ``kstats`` and ``blocks`` (and ``screen``): one
    call on a [K, d] tensor, or chunk by chunk when they come from a chunked source (``src``, a
    ``fedkernels.sources.ChunkedUpdates``; ``updates`` is then their ``UpdatesShape`` and ``U`` raises),
    with the same result: bit for bit for the column-local ``weighted_sum`` and ``blocks``; the Gram and
    Kuramoto's statistics (``kstats``) are summed over the chunks in fp64 in column order. Their shape, dtype and device: ``K``, ``d``,
    ``dtype``, ``device``. Packed (compressed) rows (``packed``, a ``fedkernels.sources.PackedRows``) give only
    ``weighted_sum``, computed from the codes in the model's precision."""

    global_flat: torch.Tensor
    # the accepted clients' [K, d] updates: the tensor, or, when ``src`` is set, their UpdatesShape (no data)
    updates: Union[torch.Tensor, UpdatesShape]
    num_examples: torch.Tensor  # [K] float64 (cpu)
    client_ids: List[int]
    payloads: List[Dict[str, Any]]
    excluded: List[Dict[str, Any]] = field(default_factory=list)  # [{client_id, reason}]
    # Rows not yet screened (methods with ``Aggregator.screen_in_pass``, and every method on a source):
    # the first read of U through ``weighted_sum``, ``gram``, ``kstats`` or ``screen`` below also screens its rows
    # and hands the flags to ``on_flags`` (the round runner's policy) before the method goes on.
    unscreened: bool = False
    # on_flags(ok, carry): ``carry`` (None, or a tensor on ok's device) comes back on the host, brought
    # there in the same device-to-host copy as the flags (RoundInput.gram(host=True), RoundInput.kstats)
    on_flags: Optional[Callable[[torch.Tensor, Optional[torch.Tensor]], Optional[torch.Tensor]]] = None
    src: Optional[ChunkedUpdates] = None  # the rows of U, read in column chunks (None: U is the tensor)
    # the rows of U in a packed (compressed) form (``sources.PackedRows``): read only through ``weighted_sum``
    # (one pass over the packed rows, screened in it); every other read refuses them (``PackedRowsRefused``)
    packed: Optional[PackedRows] = None
    stop_at_bad: bool = False  # a source's screening pass ends at the first bad chunk (policy raise)
    # ``aggregate(..., out=)``: the caller's [d] tensor for the new model. The method's result pass (on a
    # source: the first ``weighted_sum`` with ``base=global_flat``; FedAWARE's table sum) writes into it
    # as it goes (``take_out``); whatever the method returns is copied into it at the end otherwise.
    out: Optional[torch.Tensor] = None
    # ``weighted_sum(..., hold=True)``: the screening pass's flags, kept on the device until ``release``
    held: Optional[torch.Tensor] = field(default=None, repr=False, init=False)
    _hold: bool = field(default=False, repr=False, init=False)

    def take_out(self) -> Optional[torch.Tensor]:
        """The caller's ``out`` tensor for the method's result pass, once (None afterwards, or when the
        caller gave none): a second result-like pass gets a fresh tensor, never the one already handed."""
        out, self.out = self.out, None
        return out

    def result_vector(self) -> torch.Tensor:
        """The [d] tensor (the global model's dtype and device) that the method's result pass writes the
        new model into: the caller's ``out`` when it gave one (:meth:`take_out`), else a new vector, on
        the CPU backed by huge pages from 4 MB up (``fedkernels._memory.new_vector``: the pass that first
        writes it takes one page fault per 2 MB instead of one per 4 KB)."""
        out = self.take_out()
        if out is not None:
            return out
        g = self.global_flat
        return new_vector(self.d, g.dtype, g.device)

    def weighted_sum(
        self, coef: CoefLike, base: Optional[torch.Tensor] = None, alpha: float = 1.0, hold: bool = False
    ) -> torch.Tensor:
        """``ops.weighted_sum(U, coef, base, alpha)``; while the rows are unscreened it is
        ``ops.weighted_sum_screened`` and the flags go to ``on_flags`` (with ``hold``: they stay on the
        device until :meth:`release`, which brings a value computed after this pass to the host in the
        same copy; the method changes no state in between). From a source: chunk by chunk
        into a [d] vector of the global model's dtype and device (a bf16/fp16 source is summed in that
        dtype): the caller's ``out`` for the result pass ``base=global_flat`` (each chunk written as it
        is summed: a path ``out`` of ``fedkernels.streaming`` is a mapped temporary file, so the write
        overlaps the pass), else a fresh one."""
        self._hold = hold and self.unscreened
        try:
            return self._weighted_sum(coef, base, alpha)
        finally:
            self._hold = False

    def _weighted_sum(self, coef: CoefLike, base: Optional[torch.Tensor], alpha: float) -> torch.Tensor:
        if self.packed is not None:  # in the model's precision (fp64 for an fp64 model, else fp32)
            g = self.global_flat
            out_dtype = torch.float64 if g.dtype == torch.float64 else torch.float32
            b = None if base is None else base.to(out_dtype)
            out, ok = self.packed.weighted_sum(
                coef, base=b, alpha=alpha, out_dtype=None if b is not None else out_dtype
            )
            if self.unscreened:
                self._flags(ok)
            return out.to(g.dtype)
        if self.src is not None:
            g = self.global_flat
            given = self.take_out() if base is g else None
            out = given if given is not None else torch.empty(self.d, dtype=g.dtype, device=g.device)
            c64 = torch.as_tensor(coef, dtype=torch.float64).reshape(-1).cpu()  # host coefficients, one copy
            self._stream(
                lambda a, b, c, screen: weighted_sum_block(
                    c, c64, None if base is None else base[a:b], alpha, out[a:b], screen=screen
                )
            )
            return out
        U = self.U
        screened = self.unscreened and has_kernel("weighted_sum_screened", U.device)
        if self.unscreened and not screened:
            self._flags(ops.finite_rows(U))  # no screened kernel for this device: a separate scan
        # the result pass (base: the global model) writes straight into the caller's out (no copy
        # afterwards), unless the sum must stay an ordinary op call (a gradient through it, tracing, a
        # functorch transform). Without an out the op allocates with torch's allocator: a huge-page
        # vector (result_vector) measured ~20% faster per round in steady state but 2-3x slower in a
        # fresh process's first rounds, while the kernel gathers its 2 MB pages.
        into = (
            self.out is not None
            and base is self.global_flat
            and has_kernel("weighted_sum_screened_out" if screened else "weighted_sum_out", U.device)
            and not needs_grad(U, coef, base)
            and not tracing()
            and not torch._C._are_functorch_transforms_active()
        )
        dst = self.take_out() if into else None
        if screened:
            out, ok = ops.weighted_sum_screened(U, coef, base=base, alpha=alpha, out=dst)
            self._flags(ok)
            return out
        return ops.weighted_sum(U, coef, base=base, alpha=alpha, out=dst)

    def release(self, carry: torch.Tensor) -> torch.Tensor:
        """``carry`` (a tensor on U's device) on the host, brought there in one device-to-host copy with
        the flags that ``weighted_sum(..., hold=True)`` held, which then go to ``on_flags`` (the policy:
        raise, or the round again without the bad rows). Without held flags: ``carry`` copied alone."""
        ok, self.held, self._hold = self.held, None, False
        if ok is None:
            return carry.cpu()
        host = self._flags(ok, carry=carry)
        assert host is not None
        return host

    def gram(self, host: bool = False) -> torch.Tensor:
        """``ops.gram(U)`` ([K, K] fp64 on U's device, or on the host with ``host=True``); while the
        rows are unscreened it is ``ops.gram_screened`` and the flags go to ``on_flags``. ``host=True``
        on another device than the CPU: G comes to the host in the flags' device-to-host copy (one
        copy per aggregate, not two). From a source: the chunks' Grams summed in fp64 in column order."""
        if self.packed is not None:
            self._refuse_packed("the Gram matrix")
        if self.src is not None:
            G = torch.zeros(self.K, self.K, dtype=torch.float64, device=self.src.device)

            def add(a: int, b: int, c: torch.Tensor, screen: bool) -> Optional[torch.Tensor]:
                if screen and c.dtype != torch.float64:  # diagonal flags: exact below fp64 (no overflow)
                    Gc, ok = ops.gram_screened(c)
                    G.add_(Gc)
                    return ok
                G.add_(ops.gram(c))
                return None

            self._stream(add)
            return G.cpu() if host else G
        if self.unscreened:
            G, ok = ops.gram_screened(self.U)
            carried = self._flags(ok, carry=G if host else None)
            return G if carried is None else carried
        G = ops.gram(self.U)
        return G.cpu() if host and G.device.type != "cpu" else G

    def kstats(self, p: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``ops.kstats(U, p)``'s ``(dot [K], nsq [K], nbar [])``, float64 on the host: one column-local pass
        over U, no K x K Gram. While the rows are unscreened its flags (exact for every dtype) go to
        ``on_flags``, and the statistics ride in their device-to-host copy (one copy per pass). From a
        source: the chunks' sums added in fp64 in column order (each chunk's mean is exact: column-local)."""
        if self.packed is not None:
            self._refuse_packed("per-row statistics (kstats)")
        K = self.K
        if self.src is not None:
            acc = torch.zeros(2 * K + 1, dtype=torch.float64, device=self.src.device)

            def add(a: int, b: int, c: torch.Tensor, screen: bool) -> Optional[torch.Tensor]:
                dot, nsq, nbar, ok = ops.kstats(c, p)
                acc.add_(torch.cat([dot, nsq, nbar.reshape(1)]))
                return ok if screen else None

            self._stream(add)
            host = acc.cpu()
        else:
            dot, nsq, nbar, ok = ops.kstats(self.U, p)
            stats = torch.cat([dot, nsq, nbar.reshape(1)])
            carried = self._flags(ok, carry=stats) if self.unscreened else None
            host = carried if carried is not None else stats.cpu()
        return host[:K], host[K : 2 * K], host[2 * K]

    def blocks(self, device: Optional[torch.device] = None) -> Iterator[Tuple[slice, torch.Tensor]]:
        """``(cols, U[:, cols])`` for a method's column-local work on U with per-client tables (FedAWARE's
        momenta: ``M[:, cols]``): one block, all of U, for a tensor; the column chunks in order for a
        source. ``device``: where the blocks are wanted (default: where they are). Unscreened rows are
        screened first (``screen``), so the caller may write its tables block by block."""
        if self.packed is not None:
            self._refuse_packed("column blocks")
        if self.unscreened:
            self.screen()
        if self.src is None:
            yield slice(None), self.U if device is None else self.U.to(device)
            return
        src = self.src if device is None else self.src.on(device)  # (host chunks go to a host table directly)
        for a, b, c in src.chunks():
            yield slice(a, b), c

    def screen(self) -> None:
        """The rows' NaN/Inf screen as a read of its own (``ops.finite_rows``), flags to ``on_flags``."""
        if self.packed is not None:
            self._refuse_packed("a screening pass of their own")
        if self.src is not None:
            self._stream(lambda a, b, c, screen: None)
        elif self.unscreened:
            self._flags(ops.finite_rows(self.U))

    def _stream(self, each: Callable[[int, int, torch.Tensor, bool], Optional[torch.Tensor]]) -> None:
        """``each(a, b, U[:, a:b], screen)`` over the source's chunks; while the rows are unscreened each
        chunk is screened too (the flags ``each`` returns when it screened in its own pass, else
        ``ops.finite_rows``); the flags accumulate on the chunks' device; with ``stop_at_bad`` a host
        chunk with a bad row ends the pass there: the rest of U is not read."""
        src = self.src
        assert src is not None
        if not self.unscreened:
            for a, b, c in src.chunks():
                each(a, b, c, False)
            return
        fin = torch.ones(self.K, dtype=torch.bool, device=src.device)
        stop = self.stop_at_bad and src.device.type == "cpu"
        for a, b, c in src.chunks():
            ok = each(a, b, c, True)
            if ok is None:
                ok = ops.finite_rows(c)
            fin &= ok
            if stop and not bool(ok.all()):
                self._flags(fin, (a, b))  # raises (policy raise)
        self._flags(fin)

    def _flags(
        self, ok: torch.Tensor, cols: Optional[Tuple[int, int]] = None, carry: Optional[torch.Tensor] = None
    ) -> Optional[torch.Tensor]:
        """Hands the rows' flags to ``on_flags``; returns ``carry`` (None, or a tensor on ok's device) on
        the host, brought there in the flags' copy. While a ``weighted_sum(..., hold=True)`` runs, the
        flags of its pass are kept in ``held`` instead (``release`` hands them over)."""
        self.unscreened = False
        if self._hold and cols is None and carry is None:
            self.held = ok
            return None
        if self.on_flags is None:
            return None if carry is None else carry.cpu()
        if self.src is None:
            return self.on_flags(ok, carry)
        try:
            return self.on_flags(ok, carry)
        except BadUpdateError as e:  # say where the source holds the bad row
            bad = (~ok.cpu()).nonzero().reshape(-1)
            k = int(bad[0]) if bad.numel() else -1
            if k < 0 or f"(row {k}): update contains NaN/Inf" not in str(e):
                raise
            where = f", columns {cols[0]}..{cols[1] - 1} of d={self.d}" if cols is not None else ""
            raise BadUpdateError(f"{e} (source: {self.src.row_name(k)}{where})") from None

    def _refuse_packed(self, what: str) -> None:
        raise PackedRowsRefused(
            f"compressed rows: this method reads {what} of the updates, which compressed rows "
            "do not give without decompressing them"
        )

    @property
    def U(self) -> torch.Tensor:
        """The [K, d] updates tensor (a round on a chunked source has none: read its rows through
        ``weighted_sum`` / ``gram`` / ``blocks``)."""
        if isinstance(self.updates, torch.Tensor):
            return self.updates
        if self.packed is not None:
            self._refuse_packed("the dense [K, d] tensor")
        raise RuntimeError(
            "the updates come from a chunked source: RoundInput.U holds no data; read the rows "
            "through RoundInput.weighted_sum / gram / blocks (their shape: rin.K, rin.d, rin.dtype, "
            "rin.device)"
        )

    @property
    def K(self) -> int:
        return self.updates.size(0)

    @property
    def d(self) -> int:
        return self.updates.size(1)

    @property
    def dtype(self) -> torch.dtype:
        return self.updates.dtype

    @property
    def device(self) -> torch.device:
        return self.updates.device

    def sample_weights(self) -> torch.Tensor:
        """p_k = n_k / sum n (float64, cpu)."""
        return self.num_examples / self.num_examples.sum()

    def with_row_scale(self, s: torch.Tensor) -> "RoundInput":
        """This round's input with its rows scaled: every pass of a method on the returned RoundInput
        sees ``diag(s) U`` (``s``: [K] finite scales, on the host or U's device), with no K x d copy
        (:class:`RowScaled`). Its screen, state and ``out`` are this one's."""
        return RowScaled(self, s)


# columns per block of a row-scaled tensor's blocks (RowScaled.blocks): the scaled copy is K x BLOCK_COLS
SCALED_BLOCK_ELEMS = 1 << 22


class RowScaled(RoundInput):
    """``RoundInput.with_row_scale(s)``: a round input whose passes see ``diag(s) U`` while U stays as
    it is. Each pass is the base input's pass (the same screen, flags, ``out`` and source), its
    arithmetic adjusted:

    * ``weighted_sum(c)`` = ``base.weighted_sum(c * s)`` (s folded into the fp64 coefficients);
    * ``gram()`` = ``s_i s_j G_ij``;
    * ``kstats(p)``: with ``m = sum_k p_k s_k U_k`` (the mean of the scaled rows), ``base.kstats(p * s)``
      gives ``<U_k, m>``, ``||U_k||^2`` and ``||m||^2``; the scaled rows' statistics are
      ``s_k <U_k, m>``, ``s_k^2 ||U_k||^2`` and ``||m||^2``;
    * ``blocks()``: column blocks of the scaled rows, each a copy of its chunk, ``s_k u`` rounded once
      from float64 to U's dtype (a tensor's U in blocks of ``SCALED_BLOCK_ELEMS`` elements);
    * ``screen()``: the base's (a finite scale keeps a finite row finite);
    * ``U``: a scaled K x d copy, for a method that reads the tensor itself (FedECADO).

    Every field (the rows, counts, ids, payloads, the screen's state) is the base input's: reading or
    setting one here reads or sets it there."""

    base: RoundInput  # the input whose passes and fields these are
    s: torch.Tensor  # [K] float64 row scales

    def __init__(self, base: RoundInput, s: Any) -> None:  # (not the dataclass' __init__: no fields of its own)
        st = torch.as_tensor(s, dtype=torch.float64).reshape(-1)
        if st.numel() != base.K:
            raise ValueError(f"RoundInput.with_row_scale: s has {st.numel()} entries, expected K={base.K}")
        object.__setattr__(self, "base", base)
        object.__setattr__(self, "s", st)

    def __setattr__(self, key: str, value: Any) -> None:
        setattr(self.base, key, value)

    def __repr__(self) -> str:
        return f"RowScaled(K={self.K}, d={self.d})"

    def _s(self, device: Any) -> torch.Tensor:
        return self.s if self.s.device == torch.device(device) else self.s.to(device)

    def take_out(self) -> Optional[torch.Tensor]:
        return self.base.take_out()

    def weighted_sum(
        self, coef: CoefLike, base: Optional[torch.Tensor] = None, alpha: float = 1.0, hold: bool = False
    ) -> torch.Tensor:
        c = torch.as_tensor(coef, dtype=torch.float64).reshape(-1)
        return self.base.weighted_sum(c * self._s(c.device), base=base, alpha=alpha, hold=hold)

    def release(self, carry: torch.Tensor) -> torch.Tensor:
        return self.base.release(carry)

    def gram(self, host: bool = False) -> torch.Tensor:
        G = self.base.gram(host=host)
        s = self._s(G.device)
        return G * torch.outer(s, s)

    def kstats(self, p: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self._s("cpu")
        dot, nsq, nbar = self.base.kstats(torch.as_tensor(p, dtype=torch.float64).reshape(-1).cpu() * s)
        return dot * s, nsq * (s * s), nbar

    def blocks(self, device: Optional[torch.device] = None) -> Iterator[Tuple[slice, torch.Tensor]]:
        for cols, c in self.base.blocks(device):
            if self.base.src is not None or c.numel() <= SCALED_BLOCK_ELEMS:
                yield cols, self._scaled(c)
                continue
            width = max(1, SCALED_BLOCK_ELEMS // max(1, c.size(0)))
            for a in range(0, c.size(1), width):
                b = min(c.size(1), a + width)
                yield slice(a, b), self._scaled(c[:, a:b])

    def _scaled(self, c: torch.Tensor) -> torch.Tensor:
        """``diag(s) c``: each product in float64, rounded once to c's dtype."""
        s = self._s(c.device).unsqueeze(1)
        return (c * s) if c.dtype == torch.float64 else (c.to(torch.float64) * s).to(c.dtype)

    def screen(self) -> None:
        self.base.screen()

    @property
    def U(self) -> torch.Tensor:
        U = self.base.U
        out = torch.empty_like(U)
        for cols, c in self.blocks():
            out[:, cols] = c
        return out

    def sample_weights(self) -> torch.Tensor:
        return self.base.sample_weights()


def _delegate(name: str) -> property:
    """A RowScaled field: the base input's (K, d, dtype, device follow from its ``updates``)."""

    def get(self: RowScaled) -> Any:
        return getattr(self.base, name)

    def put(self: RowScaled, value: Any) -> None:
        setattr(self.base, name, value)

    return property(get, put)


for _f in fields(RoundInput):
    setattr(RowScaled, _f.name, _delegate(_f.name))


def table_passes(device: Any, path: Any, *passes: str) -> Tuple[str, ...]:
    """A per-client table's passes (``Aggregator.update_passes``), prefixed HOST when the table stays in host
    memory or a file."""
    on_host = path is not None or (device is not None and torch.device(device).type == "cpu")
    return tuple(HOST + p for p in passes) if on_host else passes


class Aggregator(abc.ABC):
    """Base class of every server-side method. Subclasses implement ``_aggregate``."""

    name = "base"
    client_rule_cls: Optional[Type[ClientRule]] = None
    # True for methods whose first read of U is RoundInput.weighted_sum, gram or kstats, before
    # any change of state: that pass also screens the rows (no separate finite_rows read of U).
    screen_in_pass = False

    # the ranges of numeric options that the constructor does not check itself, for the simulator's checks
    # before a run (fedkernels.sim.options; "> a", ">= a", "[a, b)" as config.RANGES): merged along the MRO
    option_ranges: Dict[str, str] = {"server_lr": "> 0"}

    def __new__(cls, *args: Any, **options: Any) -> "Aggregator":
        # The options' types are checked here, so that a direct ``KuramotoFedAvg(kappa0="x")`` gets
        # the same one-line error as ``build("kuramoto", kappa0="x")`` (which also converts number
        # text first, having checked them: not again here): see fedkernels.algorithms.signature.
        if _CHECKED_BY_BUILD.get() is not cls:
            check_options(cls.name, cls, options, required=False)
        return super().__new__(cls)

    def __init__(self, on_bad_update: str = "raise", server_lr: float = 1.0, **unknown: Any) -> None:
        if unknown:
            key = sorted(unknown)[0]
            raise ValueError(unknown_option(self.name, signature_params(type(self)), key, unknown[key]))
        if on_bad_update not in BAD_UPDATE_POLICIES:
            raise ValueError(f"on_bad_update must be one of {BAD_UPDATE_POLICIES}, got {on_bad_update!r}")
        self.on_bad_update = on_bad_update
        try:
            lr = float(server_lr)
        except (TypeError, ValueError):
            lr = math.nan
        if isinstance(server_lr, bool) or not math.isfinite(lr) or lr <= 0:
            raise ValueError(f"{self.name}: server_lr must be a finite number > 0, got {server_lr!r}")
        self.server_lr = lr
        self.round = 0
        self.num_clients: Optional[int] = None
        self.spec: Optional[FlatSpec] = None

    # ---- lifecycle --------------------------------------------------------------------------------
    def setup(
        self,
        spec: Optional[FlatSpec] = None,
        num_clients: Optional[int] = None,
        global_flat: Optional[torch.Tensor] = None,
    ) -> None:
        """Called once before the first round by a simulator that knows the whole federation.

        ``spec``: the FlatSpec of the model (layer-aware methods need it); ``num_clients``: N,
        the number of client ids (stateful methods size their tables with it)."""
        self.spec = spec
        self.num_clients = num_clients

    def client_rule(self) -> Optional[ClientRule]:
        """A fresh ClientRule for local training, or None if the method trains like FedAvg."""
        return self.client_rule_cls(self) if self.client_rule_cls is not None else None

    def local_training_conflict(self, steps: Optional[int]) -> Optional[str]:
        """Why this method's options cannot work with the simulator's local training (``steps``: a
        fixed number of local steps instead of epochs, or None), or None. Checked before a run."""
        return None

    def client_payload(self, client_id: int) -> Dict[str, Any]:
        """What the server sends a client besides the global model (e.g. control variates)."""
        return {}

    # ---- aggregation ------------------------------------------------------------------------------
    def aggregate(
        self,
        global_flat: torch.Tensor,
        updates: Updates,
        num_examples: CoefLike,
        client_ids: Optional[Sequence[int]] = None,
        payloads: Optional[Sequence[Dict[str, Any]]] = None,
        out: Optional[torch.Tensor] = None,
    ) -> AggResult:
        """One round of the method: the new global model from the clients' updates.

        Arguments (K clients, d parameters):

        * ``global_flat``: [d] tensor, the current global model (a floating dtype: float32,
          float64, bfloat16 or float16; on any device with the native ops: CPU or CUDA); read,
          never written.
        * ``updates``: a [K, d] tensor (row k = client k's ``local - global``), or a list of K
          tensors of d elements each (any shape; stacked into one [K, d] copy). Same dtype and
          device as ``global_flat``. K = 0 is allowed (the round is skipped). Or a K x d matrix source
          read in column chunks (:mod:`fedkernels.sources`: a ``MatrixSource`` such as a
          ``RawFileSource`` / ``ClientFilesSource`` / ``MemmapSource``, or a ``ChunkedUpdates`` naming
          the chunk width and delivering to ``global_flat``'s device; dtype that of ``global_flat``, or
          bf16/fp16 under a float32/float64 model): the same method, the same result (bit for bit where
          the maths is column-local; Gram-based weights up to the fp64 summation order over chunks);
          a bad row is named with its source row (and file) and columns. A method that cannot run
          chunked (``no_chunked_source``: FedECADO) refuses a source at once.
        * ``num_examples``: K sample counts (> 0): a tensor (any device; copied to the host as
          float64) or a sequence of numbers.
        * ``client_ids``: K distinct ints naming the clients (the rows of per-client state;
          within ``[0, num_clients)`` once ``setup(num_clients=N)`` ran). Default ``0..K-1``.
        * ``payloads``: K dicts of what each client's ``ClientRule.end`` returned (control-variate
          deltas, local step counts, simulated time, ...), in the order of ``updates``; default
          K empty dicts. Methods that need an entry say which when it is missing.
        * ``out``: optional [d] contiguous tensor of ``global_flat``'s dtype and device, not sharing
          memory with it, that receives the new model (``params`` is then ``out``). The method's result
          pass (a ``RoundInput.weighted_sum`` on global_flat, or a write into
          ``RoundInput.result_vector()``) writes into it: on a source each chunk as it is computed
          (no second [d] vector; a file mapping such as ``fedkernels.streaming``'s temporary output
          fills while the pass runs); a method whose result is not such a pass has it copied in. If
          ``aggregate`` raises, ``out``'s contents are undefined (``fedkernels.streaming`` publishes its
          file only after success).

        Returns ``AggResult(params, info)``: ``params`` a new [d] tensor (never ``global_flat``
        itself; ``out`` when given) with the dtype and device of ``global_flat``; ``info`` a dict of
        what the method logs (weights, guard flags, solver iterations, ...) with at least ``num_clients`` (the K
        that were aggregated), ``excluded`` (``[{client_id, reason}]``) when clients were dropped
        and ``skipped``/``reason`` when no update was usable (``params`` is then a copy of
        ``global_flat``). The method's state (momentum, control variates, round counter) advances.

        Errors: ValueError naming the argument for a wrong shape, dtype, device, count, id or a
        NaN/Inf ``global_flat``, or naming what is missing when the method needs ``setup(...)``
        first (the model's FlatSpec, the number of clients). A client whose update has NaN/Inf or
        the wrong length, whose count is not > 0 or whose payload is unusable raises
        :class:`~fedkernels.errors.BadUpdateError` (a ValueError) with ``on_bad_update="raise"``
        (default); with ``"exclude"`` it is dropped, logged and listed in ``info["excluded"]``.

        Under ``torch.compile`` / ``torch.export`` (see :func:`tracing`) the shape,
        dtype, device and option checks still run at trace time, but the value checks (NaN/Inf
        screening of rows, results and payloads, sample counts > 0) are skipped: the eager call
        raises on bad values, a compiled one propagates them. ``info`` then holds tensors where
        the eager call gives lists."""
        return _runner.run_round(self, global_flat, updates, num_examples, client_ids, payloads, out)

    @abc.abstractmethod
    def _aggregate(self, rin: RoundInput) -> AggResult:
        """The method's arithmetic on validated inputs (rin.K >= 1)."""

    # Why this method cannot aggregate updates read in column chunks (None: it can); such a method
    # refuses a source at once, before anything is read.
    no_chunked_source: Optional[str] = None

    # What this method's update reads of U that weighted sums of its rows do not give, in words, or None: it
    # reads U only through RoundInput.weighted_sum, so it runs on packed (compressed) rows as on dense ones
    # (``sources.PackedRows``). A codec refuses a method that says what it needs, before anything is computed,
    # with these words (``fedkernels.compress.check_method``); a method that does not declare it is refused.
    reads_beyond_weighted_sum: Optional[str] = "more of the updates than a weighted sum"

    # The differential-privacy wrapper's verdict on this method (``fedkernels.algorithms.dp``): "private" when its
    # update reads U through exactly one weighted sum with coefficients that do not depend on the updates and
    # keeps or sends back no un-noised function of them (the wrapper accepts it), else why not, in words.
    dp_verdict: str = (
        "it has no differential-privacy verdict yet (its update is not known to be one weighted sum with "
        "data-independent weights)"
    )

    def update_passes(self, K: Optional[int] = None) -> Optional[Tuple[str, ...]]:
        """What this method's update (``_aggregate``) does with U from a source besides the NaN/Inf screen, in
        order, for a round of ``K`` clients (None: not known), as ``device="auto"`` weighs it (the pass names
        and their costs: ``fedkernels.sources.PASSES``; a per-client table's: :func:`table_passes`). Each
        method declares it beside its ``_aggregate``; None: not declared."""
        return None

    def passes(self, K: Optional[int] = None) -> Tuple[str, ...]:
        """What one round of ``K`` clients (None: not known) does with U from a source, in order, as
        ``device="auto"`` weighs it (:func:`fedkernels.sources.pick_device`; the names: ``sources.PASSES``):
        the NaN/Inf screen's own read of U for a method without ``screen_in_pass``, then :meth:`update_passes`
        (a declaration counts for the ``_aggregate`` of its own class or a base: a subclass with its own
        update declares its own); none for a method that refuses a source. A method defined outside this
        package declares ``update_passes`` or overrides this (with or without ``K``); without either
        ``device="auto"`` raises ValueError (a given device still works)."""
        if self.no_chunked_source is not None:
            return ()
        mro = type(self).__mro__
        update = next(k for k in mro if "_aggregate" in vars(k))
        declared = next(k for k in mro if "update_passes" in vars(k))
        own = self.update_passes(K) if declared is not Aggregator and issubclass(declared, update) else None
        if own is None:
            raise ValueError(
                f"{self.name}: device='auto' cannot cost this method: declare what a round does with "
                "U by overriding Aggregator.passes() (pass names: fedkernels.sources.PASSES), or pass "
                "ChunkedUpdates(..., device='cpu') or device='cuda'"
            )
        return (() if self.screen_in_pass else ("sum",)) + tuple(own)

    def prepare_round(self, global_flat: Any) -> None:
        """Called by the round runner first, with the caller's ``global_flat`` (not yet checked): a
        method sizes what it keeps per model here (SCAFFOLD's c, FedECADO's flows)."""

    def validate(
        self,
        global_flat: torch.Tensor,
        updates: Union[Updates, UpdatesShape],
        num_examples: CoefLike,
        client_ids: Optional[Sequence[int]] = None,
        payloads: Optional[Sequence[Dict[str, Any]]] = None,
        screen: bool = True,
    ) -> RoundInput:
        """Checks every argument; applies the on_bad_update policy to bad clients (the round runner's
        validation, :func:`fedkernels.algorithms.runner.validate`). ``screen=False`` skips the NaN/Inf
        scan of the update rows (see ``screen_in_pass``). ``updates`` may be an :class:`UpdatesShape`
        (the rows of a chunked source): its shape, dtype and device are checked as a tensor's, its rows
        are screened by the source pass (not here)."""
        return _runner.validate(self, global_flat, updates, num_examples, client_ids, payloads, screen)

    def missing_payload(self, key: str, what: str) -> str:
        """The one message for a payload entry the method's client side should have sent."""
        return (
            f"{self.name} needs payload {key!r} ({what}) from its client side: train the client with "
            f"rule = agg.client_rule() (hooks: fedkernels.algorithms.ClientRule) and pass what "
            f"rule.end(ctx, model) returns as its entry of payloads"
        )

    def check_payload(self, payload: Dict[str, Any]) -> Optional[str]:
        """The reason one client's payload is unusable, or None (subclasses extend): the wording of
        each rule, in plain Python on the payload's structure and scalars. A round calls it only on
        the rows :meth:`suspect_payloads` names; the NaN/Inf screen of the payload tensors the method
        reads (``screened_payload_keys``) is batched over the round by the round runner (``runner._Round.screen``)."""
        return None

    def suspect_payloads(self, payloads: List[Dict[str, Any]]) -> Optional[List[int]]:
        """The rows whose payload :meth:`check_payload` may reject, from whole-round column checks
        (``payload_numbers``, key presence; no Python call per client), or None for every row. A
        class that extends ``check_payload`` extends this too (a superset of the rows it rejects,
        ``super()``'s included); the default: no row (``check_payload`` accepts everything)."""
        return []

    def check_payloads(self, payloads: List[Dict[str, Any]]) -> Dict[int, str]:
        """{row: reason} for the round's unusable payloads: ``check_payload`` on the suspect rows."""
        sus = self.suspect_payloads(payloads)
        rows = range(len(payloads)) if sus is None else sorted(set(sus))
        reasons = {}
        for k in rows:
            r = self.check_payload(payloads[k])
            if r:
                reasons[k] = r
        return reasons

    # payload keys whose tensors the method reads: each round's are stacked once ([K, ...], shared
    # with the method through ``payload_stack``) and scanned for NaN/Inf in one native pass
    screened_payload_keys: Tuple[str, ...] = ()

    def payload_stack(self, rin: RoundInput, key: str) -> torch.Tensor:
        """The round's ``payload[key]`` tensors stacked, [K, ...]: the stack the screen made for the
        NaN/Inf screen (``rin.payloads.stacks``, handed over once: it is not kept), else a new one."""
        S = getattr(rin.payloads, "stacks", {}).pop(key, None)
        return S if S is not None else torch.stack([p[key] for p in rin.payloads])

    # ---- state ------------------------------------------------------------------------------------
    # Declared state: the attribute names a method carries across rounds. ``state_dict`` copies them
    # (tensors cloned, dicts/lists/sets copied; a set is stored as a sorted list) and
    # ``load_state_dict`` restores them, so no method writes this boilerplate itself.
    state_attrs: Tuple[str, ...] = ()

    def state_dict(self) -> Dict[str, Any]:
        """Everything needed to continue identically: tensors and plain Python values only."""
        st: Dict[str, Any] = {"round": self.round, "num_clients": self.num_clients}
        for k in self.state_attrs:
            st[k] = _copy_state(getattr(self, k))
        return st

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.round = int(state["round"])
        self.num_clients = state.get("num_clients")
        for k in self.state_attrs:
            if k in state:
                v = _copy_state(state[k])
                setattr(self, k, set(v) if isinstance(getattr(self, k, None), set) else v)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _copy_state(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, dict):
        return {(int(k) if isinstance(k, (int, torch.Tensor)) else k): _copy_state(x) for k, x in v.items()}
    if isinstance(v, set):
        return sorted(v)
    if isinstance(v, (list, tuple)):
        return [_copy_state(x) for x in v]
    return v


@dataclass
class ClientContext:
    """What a ClientRule sees during one client's local training in one round."""

    client_id: int
    round: int
    global_flat: torch.Tensor  # [d] the global model the client started from (read-only)
    spec: Any  # FlatSpec of the model
    lr: float  # the client's learning rate this round
    num_examples: int
    payload: Dict[str, Any]  # Aggregator.client_payload(client_id)
    step: int = 0  # local steps taken so far (the loop increments it)
    batch: Any = None  # the current (inputs, targets)
    loss: Optional[torch.Tensor] = None  # the current loss (after loss_term)
    extras: Dict[str, Any] = field(default_factory=dict)  # scratch space for the rule


class ClientRule:
    """Client-side hooks. The local loop does, per step::

        rule.begin(ctx, model)                       # once, before the first step
        loss = criterion(model(x), y) + (rule.loss_term(ctx, model) or 0)
        loss.backward()
        rule.before_step(ctx, model)                 # transform p.grad in place
        if not rule.step(ctx, model, optimizer):     # a rule may do the step itself
            optimizer.step()
        ctx.step += 1; rule.after_step(ctx, model)
        ...
        payload = rule.end(ctx, model)               # once; dict sent with the update

    Every hook has a no-op default.

    ``batched_form``: the :class:`BatchedRule` that does the same maths for a chunk of clients at once
    (the simulator's batched executor), set on the rule's own class; a subclass (which may change a
    hook) trains sequentially unless it sets its own.
    """

    batched_form: Optional[Type[BatchedRule]] = None

    def __init__(self, aggregator: Optional[Aggregator] = None) -> None:
        self.aggregator = aggregator

    def check_model(self, model: torch.nn.Module, spec: FlatSpec) -> None:
        """Called once by a simulator before the first round with the global model: raises
        ValueError for a model this rule cannot train, so a run stops at once with one line instead
        of failing (or, under an exclude policy, dropping) every client of every round."""

    def begin(self, ctx: ClientContext, model: torch.nn.Module) -> None:
        pass

    def loss_term(self, ctx: ClientContext, model: torch.nn.Module) -> Optional[torch.Tensor]:
        return None

    def before_step(self, ctx: ClientContext, model: torch.nn.Module) -> None:
        pass

    def step(self, ctx: ClientContext, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bool:
        return False

    def after_step(self, ctx: ClientContext, model: torch.nn.Module) -> None:
        pass

    def end(self, ctx: ClientContext, model: torch.nn.Module) -> Dict[str, Any]:
        return {}


# ---- a client rule, batched: C clients' local steps at once (fedkernels.sim.batched runs it) ----
@dataclass
class Chunk:
    """What a batched rule sees: C clients trained together from the global model ``x``."""

    W: torch.Tensor  # [C, d] stacked weights (rows of the update buffer)
    x: torch.Tensor  # [d] the global model
    lr: torch.Tensor  # [C] learning rates this round (float64, host)
    steps: List[int]  # local steps per client
    epochs: List[Optional[int]]
    payloads: List[Dict[str, Any]]
    client_ids: List[int]
    momentum: float
    weight_decay: float

    @property
    def C(self) -> int:
        return self.W.size(0)


class BatchedRule:
    """The batched form of a ClientRule (its class names it in ``batched_form``), run by the batched
    executor (fedkernels.sim.batched) on the [C, d] gradients of a chunk. Hooks, per local step, in
    the sequential loop's order: ``before_step`` (the rule's loss_term / before_step maths, before
    grad_clip), ``in_step`` (what a fused native step applies after grad_clip), ``skip`` (clients whose
    step is dropped), and once ``begin`` / ``end`` (the payloads); ``reason`` / ``client_reason``: why a
    rule's options / a client's payload cannot train batched. ``needs_rho``: the loss also returns
    FedPGVC's rho."""

    needs_rho = False
    loss_clip: Optional[float] = None

    def __init__(self, rule: Optional[ClientRule], spec: FlatSpec) -> None:
        self.rule, self.agg, self.spec = rule, getattr(rule, "aggregator", None), spec

    @classmethod
    def reason(cls, rule: ClientRule, fixed_steps: bool) -> Optional[str]:
        """Why this rule's options cannot train batched (one line), or None. ``fixed_steps``: the run
        trains a fixed number of steps (``train.steps``) instead of epochs."""
        return None

    def client_reason(self, payload: Dict[str, Any]) -> Optional[str]:
        """Why this client (by its payload) must train sequentially this round, or None."""
        return None

    def begin(self, ch: Chunk) -> None:
        pass

    def edit(self, G: torch.Tensor) -> None:
        """The rule's gradient edit, made where the sequential rule makes it (the defaults of
        ``before_step`` / ``in_step``): before grad_clip, or after it when the rule is :meth:`fused`."""

    def before_step(
        self,
        ch: Chunk,
        G: torch.Tensor,
        rho: Optional[torch.Tensor],
        ce: torch.Tensor,
        m: torch.Tensor,
        active: torch.Tensor,
    ) -> None:
        if not self.fused():
            self.edit(G)

    def in_step(self, ch: Chunk, G: torch.Tensor) -> None:
        if self.fused():
            self.edit(G)

    def skip(self) -> Optional[torch.Tensor]:
        return None

    def end(self, ch: Chunk) -> List[Dict[str, Any]]:
        return [{} for _ in range(ch.C)]

    def fused(self) -> bool:
        """Whether the sequential rule acts in its ``step`` hook, after grad_clip (``fused_step``: the
        native step, or, for an optimizer it cannot fuse, the same edit made there)."""
        return bool(getattr(self.agg, "fused_step", False))


# ---- registry ------------------------------------------------------------------------------------
_REGISTRY: Dict[str, Callable[..., Aggregator]] = {}


_AggT = TypeVar("_AggT", bound=Type[Aggregator])
# the class whose options ``build`` has just checked (signature.check_options), while it constructs it
_CHECKED_BY_BUILD: "contextvars.ContextVar[Optional[object]]" = contextvars.ContextVar(
    "_checked_by_build", default=None
)


def register(name: str, *aliases: str) -> Callable[[_AggT], _AggT]:
    """Class decorator: makes the aggregator available as ``build(name, **options)``."""

    def deco(cls: _AggT) -> _AggT:
        for n in (name,) + aliases:
            key = n.lower()
            if key in _REGISTRY and _REGISTRY[key] is not cls:
                raise ValueError(f"aggregator name {n!r} registered twice")
            _REGISTRY[key] = cls
        cls.name = name
        return cls

    return deco


def build(name: str, **options: Any) -> Aggregator:
    """An aggregator by registered name (case-insensitive), e.g. ``build("kuramoto", mode="S", kappa0=0.5)``.

    Every method takes ``on_bad_update`` ("raise" default, or "exclude": drop a client whose
    update or payload is bad and log it) and ``server_lr`` (the server step, default 1.0); the
    others are its own. The options are checked against the method's constructor before it runs
    (:mod:`fedkernels.algorithms.signature`): an unknown option, or a value of the wrong type,
    raises ValueError naming the method, the option, the value and what was expected; the
    constructor then checks choices and ranges. ``options(name)`` gives each option's expected
    type and default; the method's class docstring (``help(cls)``) and module say what each does.
    An unknown name raises ValueError listing ``available()``.

    A wrapper's option (:mod:`fedkernels.algorithms.wrappers`: ``norm_bound=M``) returns the method
    inside that wrapper, e.g. ``build("fedavg", norm_bound=5.0)``; None adds none.
    """
    cls = _lookup(name)
    from . import wrappers  # (wrappers builds on this module: imported when called)

    wrapping = wrappers.split_options(name.lower(), options)
    checked = check_options(name.lower(), cls, options)
    token = _CHECKED_BY_BUILD.set(cls)  # (Aggregator.__new__ does not check them a second time)
    try:
        agg = cls(**checked)
    finally:
        _CHECKED_BY_BUILD.reset(token)
    return wrappers.wrap(agg, **wrapping)


def options(name: str) -> Dict[str, Option]:
    """``{option: Option(type, default, required)}`` of the method registered as ``name``: what
    ``build(name, **options)`` accepts (the common ``on_bad_update`` and ``server_lr`` and the
    wrappers' options included)."""
    from . import wrappers

    return {**signature.options(_lookup(name)), **wrappers.options()}


def _lookup(name: str) -> Callable[..., Aggregator]:
    cls = _REGISTRY.get(name.lower()) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(
            f"unknown aggregator {name!r}; {suggest(name, _REGISTRY)}known: {', '.join(sorted(_REGISTRY))}"
        )
    return cls


def available() -> List[str]:
    """The registered aggregator names (lower case, aliases included)."""
    return sorted(_REGISTRY)


from . import runner as _runner  # noqa: E402  (the round protocol; it builds on the classes above)
