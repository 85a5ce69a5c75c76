"""The round protocol: one aggregation of a method, from the caller's arguments to the new model.

    res = run_round(method, global_flat, updates, num_examples, client_ids, payloads, out)

(``Aggregator.aggregate`` is this call.) The method is the strategy: its update (``_aggregate``), what it
checks in a payload, its passes and state. The runner owns what every method shares:

1. ``out`` and the updates' form: a [K, d] tensor, a list of K rows, a chunked source (placed on a
   device, ``ChunkedUpdates.aggregate_placed``; its rows' shape checked as a tensor's), or packed
   (compressed) rows (``sources.PackedRows``: ``fedkernels.compress``' codes, ``sources.BlockCodeFile``),
   which a method reads only through ``RoundInput.weighted_sum`` (one pass over the codes, screened in it);
2. validation (:func:`validate`): shapes, dtypes, devices, counts, ids, payloads, and the value screen:
   the finite flags of ``global_flat``, of the rows (unless the method's first pass screens them) and of
   the payload tensors the method reads, computed on the device and copied to the host once;
3. the ``on_bad_update`` policy: raise for the first bad client, or drop the bad rows (one
   ``index_select``) and log them;
4. the update. A method with ``screen_in_pass`` (and every method on a source or packed rows) gets unscreened rows: its
   first read of U through the RoundInput also screens them, and the flags come back here
   (``RoundInput.on_flags``) with ``global_flat``'s and the payloads' in one device-to-host copy; bad rows
   raise, or the round starts again without them (nothing has changed yet);
5. the result: into ``out``, ``info`` completed (``num_clients``, ``excluded``), the round counter advanced.

Its state for one call lives in a :class:`_Round` made by that call, nothing on the method.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .. import ops
from .._types import CoefLike
from ..ops._checks import _float_dtype, _like, host_range, tracing
from ..sources import ChunkedUpdates, MatrixSource, PackedRows
from .buffers import average_buffers
from .base import (
    AggResult,
    BadUpdateError,
    PackedRowsRefused,
    RoundInput,
    Updates,
    UpdatesShape,
    _numbers,
    host_copy_with,
    host_float64,
    id_tensor,
    rows_where,
)

if TYPE_CHECKING:
    from .base import Aggregator

log = logging.getLogger("fedkernels")


class _FlagOwners:
    """Whose payload tensor each NaN/Inf flag of a round screens: segments (key, rows), expanded to
    one (row, key) per flag only when a flag is bad (``pairs``)."""

    def __init__(self, pairs: Sequence[Tuple[int, str]] = ()) -> None:
        self.segs: List[Tuple[str, Sequence[int]]] = [(key, [k]) for k, key in pairs]

    def add(self, key: str, rows: Sequence[int]) -> None:
        self.segs.append((key, rows))

    def pairs(self) -> List[Tuple[int, str]]:
        return [(k, key) for key, rows in self.segs for k in rows]


class Payloads(list):
    """A round's K payload dicts (the caller's, not copies), with ``stacks``: the [K, ...] stacks of the
    payload tensors the screen stacked (``screened_payload_keys``), handed to the method once
    (``Aggregator.payload_stack``) and dropped with their rows."""

    def __init__(self, items: Sequence[Dict[str, Any]] = (), stacks: Optional[Dict[str, torch.Tensor]] = None):
        super().__init__(items)
        self.stacks: Dict[str, torch.Tensor] = {} if stacks is None else stacks


class _Again(Exception):
    """A screening pass found bad rows under ``exclude``: the update starts again on ``rin`` (without them)."""

    def __init__(self, rin: RoundInput) -> None:
        super().__init__("round restarted without the bad rows")
        self.rin = rin


def run_round(
    method: "Aggregator",
    global_flat: torch.Tensor,
    updates: Updates,
    num_examples: CoefLike,
    client_ids: Optional[Sequence[int]] = None,
    payloads: Optional[Sequence[Dict[str, Any]]] = None,
    out: Optional[torch.Tensor] = None,
) -> AggResult:
    """One round of ``method`` (see ``Aggregator.aggregate`` for the arguments, result and errors)."""
    src: Optional[ChunkedUpdates] = None
    packed: Optional[PackedRows] = None
    rows: Union[Updates, UpdatesShape] = updates  # what validate checks: on a source or packed rows, their UpdatesShape
    if out is not None:
        _check_out(method, global_flat, out)
    if (
        isinstance(updates, ChunkedUpdates)
        and isinstance(global_flat, torch.Tensor)
        and (
            updates.placement is not None
            or (
                updates.device != global_flat.device
                and {updates.device.type, global_flat.device.type} <= {"cpu", "cuda"}
            )
        )
    ):
        # device="auto", or chunks delivered to another device than the model's: the round runs
        # there (global_flat moved once, the new model moved back once; info["device"] says where)
        return _into(updates.aggregate_placed(method, global_flat, num_examples, client_ids, payloads), out)
    if isinstance(updates, (MatrixSource, ChunkedUpdates)):
        src, rows = _chunked_source(method, global_flat, updates)
    elif isinstance(updates, PackedRows):
        packed, rows = updates, _packed_shape(method, global_flat, updates)
    if tracing():
        rin = validate(method, global_flat, rows, num_examples, client_ids, payloads, screen=False)
        traced = _into(method._aggregate(rin), out)
        traced.info.setdefault("num_clients", rin.K)
        method.round += 1
        return traced
    if method.screen_in_pass or src is not None or packed is not None:
        # One read of U: the method's first pass over it (RoundInput.weighted_sum / .gram / .kstats) also
        # screens the rows; the on_bad_update policy is applied to those flags at once (raise,
        # or drop the bad rows and run the round again without them: nothing was changed yet).
        # global_flat's flag joins the rows' flags: one device-to-host copy in all. A method
        # without screen_in_pass on a source: a screening pass of its own over the chunks first.
        rnd = _Round(method, defer=True)
        rin = rnd.validate(global_flat, rows, num_examples, client_ids, payloads, screen=False)
        rows_of = None
        if src is not None or packed is not None:  # client id -> row of the source (validate checked the ids)
            rows_of = {c: k for k, c in enumerate(client_ids_of(method, client_ids, rows.size(0)))}
        res: Optional[AggResult] = None
        if rin.K > 0:
            _attach(method, rin, src, rows_of, out, packed)
            rin.unscreened = True
            rin.on_flags = functools.partial(rnd.apply_flags, rin)  # the screening pass's flags, here
            try:
                try:
                    if not method.screen_in_pass:
                        rin.screen()
                    res = method._aggregate(rin)
                except _Again as again:
                    rin = _attach(method, again.rin, src, rows_of, out, packed)
                    res = method._aggregate(rin) if rin.K > 0 else None
            except PackedRowsRefused as e:
                raise ValueError(f"{method.name}: {e}") from None
            if rin.unscreened:  # the method did not read U through rin: screen its rows now
                raise RuntimeError(
                    f"{method.name}: screen_in_pass is set but _aggregate never read U "
                    "through RoundInput.weighted_sum / gram"
                )
            if rin.held is not None:
                raise RuntimeError(
                    f"{method.name}: _aggregate held the rows' finite flags "
                    "(RoundInput.weighted_sum(hold=True)) and never released them (rin.release)"
                )
        elif rnd.g_ok is not None and not bool(rnd.g_ok.cpu()[0]):
            raise _global_nan(method)
    else:
        rin = validate(method, global_flat, rows, num_examples, client_ids, payloads)
        res = method._aggregate(rin) if rin.K > 0 else None
    if res is None:
        res = AggResult(
            global_flat.clone() if out is None else out.copy_(global_flat),
            {"skipped": True, "reason": "no valid client update"},
        )
    res = _into(res, out)
    if rin.K > 0 and not res.info.get("skipped"):  # buffers: the clients' average, whatever the method
        average_buffers(method.spec, rin, res.params)
    res.info.setdefault("num_clients", rin.K)
    if rin.excluded:
        res.info["excluded"] = rin.excluded
    method.round += 1
    return res


def validate(
    method: "Aggregator",
    global_flat: torch.Tensor,
    updates: Union[Updates, UpdatesShape],
    num_examples: CoefLike,
    client_ids: Optional[Sequence[int]] = None,
    payloads: Optional[Sequence[Dict[str, Any]]] = None,
    screen: bool = True,
) -> RoundInput:
    """``Aggregator.validate``: every argument checked, the on_bad_update policy applied to bad clients
    (the value screen's flags copied to the host at once)."""
    return _Round(method, defer=False).validate(global_flat, updates, num_examples, client_ids, payloads, screen)


def screen(
    method: "Aggregator",
    global_flat: torch.Tensor,
    U: Union[torch.Tensor, UpdatesShape],
    n: torch.Tensor,
    payloads: List[Dict[str, Any]],
    rows: bool,
    traced: bool,
) -> Dict[int, str]:
    """The value checks of one round (:meth:`_Round.screen`), copied to the host at once."""
    return _Round(method, defer=False).screen(global_flat, U, n, payloads, rows, traced)


class _Round:
    """One call's protocol state: with ``defer`` (the rows are screened by the method's first pass),
    ``global_flat``'s flag and the payloads' flags wait on the device for the rows' flags (``g_ok``,
    ``pl_flags``), to reach the host with them in one copy."""

    def __init__(self, method: "Aggregator", defer: bool) -> None:
        self.method = method
        self.defer = defer
        self.g_ok: Optional[torch.Tensor] = None  # global_flat's [1] device flag
        self.pl_flags: Optional[Tuple[Optional[torch.Tensor], _FlagOwners]] = None  # (flags, their owners)

    def validate(
        self,
        global_flat: torch.Tensor,
        updates: Union[Updates, UpdatesShape],
        num_examples: CoefLike,
        client_ids: Optional[Sequence[int]] = None,
        payloads: Optional[Sequence[Dict[str, Any]]] = None,
        screen: bool = True,
    ) -> RoundInput:
        m = self.method
        m.prepare_round(global_flat)
        if not isinstance(global_flat, torch.Tensor) or global_flat.dim() != 1:
            raise ValueError(
                f"{m.name}.aggregate: global_flat must be a 1-D tensor, got "
                f"{tuple(global_flat.shape) if isinstance(global_flat, torch.Tensor) else type(global_flat).__name__}"
            )
        d = global_flat.numel()
        traced = tracing()
        if traced:
            screen = False
        bad_len: List[int] = []
        if isinstance(updates, (list, tuple)):
            bad_len = [i for i, u in enumerate(updates) if not isinstance(u, torch.Tensor) or u.numel() != d]
            if bad_len and m.on_bad_update == "raise":
                i = bad_len[0]
                got = (
                    f"has {updates[i].numel()} elements"
                    if isinstance(updates[i], torch.Tensor)
                    else f"is a {type(updates[i]).__name__}, not a tensor"
                )
                raise BadUpdateError(f"{m.name}.aggregate: updates[{i}] {got}, expected d={d} elements")
            updates = (
                torch.stack(
                    [
                        u.reshape(-1) if i not in bad_len else global_flat.new_full((d,), float("nan"))
                        for i, u in enumerate(updates)
                    ]
                )
                if len(updates)
                else global_flat.new_zeros((0, d))
            )
        if isinstance(updates, torch.Tensor) and updates.dim() == 2:
            shape = UpdatesShape.of(updates)
        elif isinstance(updates, UpdatesShape):
            shape, screen = updates, False
        else:
            raise ValueError(
                f"{m.name}.aggregate: updates must be a [K, d] tensor, got "
                f"{tuple(updates.shape) if isinstance(updates, torch.Tensor) else type(updates).__name__}"
            )
        K = shape.K
        if shape.d != d:
            raise BadUpdateError(
                f"{m.name}.aggregate: updates has {shape.d} columns, expected d={d} (len(global_flat))"
            )
        # aggregate's contract: the updates are the global model's (its dtype and device, a float
        # dtype), checked before any state is touched; the ops check their own tensors natively
        _like(shape, f"{m.name}.aggregate", "updates", global_flat, "global_flat")
        _float_dtype(shape, f"{m.name}.aggregate", "updates")
        # Counts, ids and payloads: whole-round conversions and checks (no Python call per client)
        try:
            n = host_float64(num_examples)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(
                f"{m.name}.aggregate: num_examples must be K={K} numbers, got {num_examples!r:.100}"
            ) from None
        if n.numel() != K:
            raise ValueError(f"{m.name}.aggregate: num_examples has {n.numel()} entries, expected K={K}")
        ids = client_ids_of(m, client_ids, K)
        if len(set(ids)) != K:
            raise ValueError(f"{m.name}.aggregate: client_ids must be distinct, got {ids}")
        if m.num_clients is not None and K and not _ids_within(ids, m.num_clients):
            raise ValueError(f"{m.name}.aggregate: client_ids must lie in [0, {m.num_clients}), got {ids}")
        if payloads is None:
            pl = Payloads([{} for _ in range(K)])
        else:  # the caller's dicts, not copies (nothing writes them); other mappings become dicts
            pl = Payloads(payloads)
            if set(map(type, pl)) - {dict}:
                pl = Payloads([dict(p) for p in pl])
        if len(pl) != K:
            raise ValueError(f"{m.name}.aggregate: payloads has {len(pl)} entries, expected K={K}")

        reasons = self.screen(global_flat, updates, n, pl, screen and K > 0, traced)
        for k in bad_len:  # (with d = 0 the NaN placeholder row is empty: flag wrong lengths directly)
            reasons[k] = f"update has the wrong number of elements (expected d={d})"
        return self.apply_policy(global_flat, updates, n, ids, pl, reasons, [])

    def screen(
        self,
        global_flat: torch.Tensor,
        U: Union[torch.Tensor, UpdatesShape],
        n: torch.Tensor,
        payloads: List[Dict[str, Any]],
        rows: bool,
        traced: bool,
    ) -> Dict[int, str]:
        """The value checks of one round, {row: reason} for the bad clients (eager only; raises
        ValueError for a non-finite global_flat). No per-client tensor op and one device-to-host
        copy for the whole round: the finite flags of global_flat, of the rows of U (when
        ``rows``) and of the payload tensors under ``screened_payload_keys`` are computed on the
        device (one native ``finite_rows`` pass each: a key's tensors are stacked once, kept in
        ``payloads.stacks`` for the method, or, when they differ in shape, dtype or device, one
        ``_foreach_norm`` per dtype and device) and copied to the host together (with ``defer``:
        later, with the rows' flags). Order of the reasons per client: row, num_examples, payload
        tensors, ``check_payloads``."""
        m = self.method
        stacks = payloads.stacks if isinstance(payloads, Payloads) else {}
        stacks.clear()
        if traced:
            return {}
        K, dev = U.size(0), U.device
        flags = [ops.finite_rows(global_flat.unsqueeze(0))]  # [1]
        if rows:
            assert isinstance(U, torch.Tensor)  # (a source's rows: its own pass)
            flags.append(ops.finite_rows(U))  # [K]
        where, where_other = _FlagOwners(), _FlagOwners()  # whose payload each flag screens
        other: List[torch.Tensor] = []  # flags on another device than U's (copied after flags)
        for key in m.screened_payload_keys:
            S = _stack_payloads(payloads, key) if K else None
            if S is not None:
                stacks[key] = S
                if S[0].numel():  # (empty ones are finite)
                    ok = ops.finite_rows(S.reshape(K, -1))
                    (flags if S.device == dev else other).append(ok)
                    (where if S.device == dev else where_other).add(key, range(K))
                continue
            # ragged, mixed or missing: the floating tensors among them, max |x| per tensor
            # (NaN/Inf iff x has a NaN/Inf); what is missing or not a tensor is check_payload's
            found = [(k, p[key]) for k, p in enumerate(payloads) if isinstance(p.get(key), torch.Tensor)]
            found = [(k, v) for k, v in found if v.is_floating_point() and v.numel()]
            by_dev: Dict[Tuple[torch.device, torch.dtype], List[Tuple[int, torch.Tensor]]] = {}
            for k, v in found:
                by_dev.setdefault((v.device, v.dtype), []).append((k, v))
            for (dv, _), kv in by_dev.items():
                with torch.no_grad():
                    amax = torch.stack(torch._foreach_norm([v for _, v in kv], float("inf")))
                ok = torch.isfinite(amax.to(torch.float32) if amax.dtype != torch.float64 else amax)
                (flags if dv == dev else other).append(ok)
                (where if dv == dev else where_other).add(key, [k for k, _ in kv])
        where.segs += where_other.segs
        if self.defer and not other:
            # checked with the rows' flags after the screening pass (run_round / apply_flags)
            self.g_ok = flags[0]
            self.pl_flags = (torch.cat(flags[1:]) if len(flags) > 1 else None, where)
            host = torch.ones(1, dtype=torch.bool)
        else:
            host = torch.cat([f.to(torch.bool) for f in flags]).cpu()  # the one sync
            host = torch.cat([host] + [o.cpu() for o in other]) if other else host
        if not bool(host[0]):
            raise _global_nan(m)
        reasons: Dict[int, str] = {}
        pos = 1
        if rows:
            for k in (~host[1 : 1 + K]).nonzero().reshape(-1).tolist():
                reasons[k] = "update contains NaN/Inf"
            pos += K
        lo, hi = host_range(n)  # one reduction when all are good
        if not (lo > 0 and hi < math.inf):
            for k in rows_where(~((n > 0) & torch.isfinite(n))):  # host tensor, vectorised
                reasons.setdefault(k, f"num_examples must be > 0, got {float(n[k])}")
        bad = rows_where(~host[pos:])
        pairs = where.pairs() if bad else []
        for j in bad:
            k, key = pairs[j]
            reasons.setdefault(k, f"payload {key!r} contains NaN/Inf")
        for k, r in m.check_payloads(payloads).items():  # the method's own checks
            reasons.setdefault(k, r)
        return reasons

    def apply_flags(
        self, rin: RoundInput, ok: torch.Tensor, carry: Optional[torch.Tensor] = None
    ) -> Optional[torch.Tensor]:
        """The rows' flags from a screening pass, with global_flat's and the payload tensors'
        (deferred by ``screen``): one host copy; bad clients raise, or are dropped and the round
        starts again (``_Again``). A row flagged by a Gram diagonal is confirmed on its own values
        (a float64 row whose squared norm overflows is finite). Returns ``carry`` on the host: off the
        CPU it rides in the same copy (its bytes and the flags' packed into one buffer)."""
        K, g_ok, pp = rin.K, self.g_ok, self.pl_flags
        parts = [g_ok.to(ok.device) if g_ok is not None else ok.new_ones(1), ok]
        if pp is not None and pp[0] is not None:
            parts.append(pp[0].to(ok.device))
        flags = torch.cat(parts)
        if carry is None or carry.device.type == "cpu":
            host = flags.cpu()  # the one sync
        else:
            host, carry = host_copy_with(flags, carry)  # the one sync
        if not bool(host[0]):
            raise _global_nan(self.method)
        bad = (~host[1 : 1 + K]).nonzero().reshape(-1)
        if bad.numel() and rin.src is None and rin.packed is None and rin.dtype == torch.float64:
            # (a source's and packed rows' flags are exact)
            bad = bad[~ops.finite_rows(rin.U.index_select(0, bad.to(rin.device))).cpu()]
        what = "compressed update" if rin.packed is not None else "update"
        reasons = {k: f"{what} contains NaN/Inf" for k in bad.tolist()}
        bad_pl = rows_where(~host[1 + K :]) if pp is not None else []
        pairs = pp[1].pairs() if pp is not None and bad_pl else []
        for j in bad_pl:
            k, key = pairs[j]
            reasons.setdefault(k, f"payload {key!r} contains NaN/Inf")
        if reasons:
            raise _Again(
                self.apply_policy(
                    rin.global_flat, rin.updates, rin.num_examples, rin.client_ids, rin.payloads, reasons, rin.excluded
                )
            )
        return carry

    def apply_policy(
        self,
        global_flat: torch.Tensor,
        updates: Union[torch.Tensor, UpdatesShape],
        n: torch.Tensor,
        ids: List[int],
        pl: List[Dict[str, Any]],
        reasons: Dict[int, str],
        excluded: List[Dict[str, Any]],
    ) -> RoundInput:
        """The on_bad_update policy for the rows in ``reasons`` ({row: reason}): raise for the first,
        or drop them all (one index_select) and log each; ``excluded`` lists earlier exclusions."""
        m = self.method
        if reasons:
            if m.on_bad_update == "raise":
                k = min(reasons)
                raise BadUpdateError(
                    f"{m.name}.aggregate: client {ids[k]} (row {k}): {reasons[k]}; "
                    f"pass on_bad_update='exclude' to drop such clients instead"
                )
            keep = [k for k in range(len(ids)) if k not in reasons]
            new = [{"client_id": ids[k], "reason": reasons[k]} for k in sorted(reasons)]
            for e in new:
                log.warning("%s: excluded client %d: %s", m.name, e["client_id"], e["reason"])
            excluded = list(excluded) + new
            fl, owners = self.pl_flags if self.pl_flags is not None else (None, _FlagOwners())
            if fl is not None:
                # deferred payload flags follow their clients to the new row numbers
                at = {k: i for i, k in enumerate(keep)}
                where = owners.pairs()
                sel = [j for j, (k, _) in enumerate(where) if k in at]
                self.pl_flags = (
                    fl.index_select(0, torch.tensor(sel, dtype=torch.long, device=fl.device)),
                    _FlagOwners([(at[where[j][0]], where[j][1]) for j in sel]),
                )
            idx = torch.tensor(keep, dtype=torch.long, device=updates.device)
            updates = updates.index_select(0, idx) if isinstance(updates, torch.Tensor) else updates.keep(len(keep))
            n = n[keep]
            ids = [ids[k] for k in keep]
            stacks = pl.stacks if isinstance(pl, Payloads) else {}
            # stacked payloads follow their rows too
            pl = Payloads(
                [pl[k] for k in keep], {key: S.index_select(0, idx.to(S.device)) for key, S in stacks.items()}
            )
        return RoundInput(global_flat, updates, n, ids, pl, excluded)


def _global_nan(method: "Aggregator") -> ValueError:
    return ValueError(f"{method.name}.aggregate: global_flat contains NaN/Inf")


def _stack_payloads(payloads: List[Dict[str, Any]], key: str) -> Optional[torch.Tensor]:
    """``payload[key]`` of every client stacked, when they are tensors of one shape, floating
    dtype and device; else None."""
    col = [p.get(key) for p in payloads]
    try:
        S = torch.stack(col) if col else None  # type: ignore[arg-type]  # a None entry raises TypeError
    except (TypeError, RuntimeError):
        return None
    return S if S is not None and S.is_floating_point() else None


def _ids_within(ids: List[int], N: int) -> bool:
    """All of the K ints ``ids`` lie in [0, N) (one C-level min/max, not two passes in Python)."""
    lo, hi = torch.aminmax(id_tensor(ids))
    return int(lo) >= 0 and int(hi) < N


def client_ids_of(method: "Aggregator", client_ids: Any, K: int) -> List[int]:
    """K ints naming the clients (default 0..K-1); ValueError unless they are K integers."""
    if client_ids is None:
        return list(range(K))
    given = client_ids.tolist() if isinstance(client_ids, torch.Tensor) else client_ids  # one copy, not K
    try:
        ids = _numbers("q", given).tolist()  # ints only, in one pass (a float or text raises)
    except (TypeError, ValueError, OverflowError, RuntimeError):
        try:  # integral floats, 0-d tensors, ...: one by one
            ids = [int(c) for c in given]
            bad = any(c != i for c, i in zip(given, ids))
        except (TypeError, ValueError, RuntimeError, AttributeError):
            bad = True
        if bad:
            raise ValueError(
                f"{method.name}.aggregate: client_ids must be K={K} integers, got {client_ids!r:.100}"
            ) from None
    if len(ids) != K:
        raise ValueError(f"{method.name}.aggregate: client_ids has {len(ids)} entries, expected K={K}")
    return ids


def _chunked_source(
    method: "Aggregator", global_flat: torch.Tensor, updates: Union[MatrixSource, ChunkedUpdates]
) -> Tuple[ChunkedUpdates, UpdatesShape]:
    """(the source as chunks delivered to global_flat's device, the UpdatesShape ``validate`` checks).
    A source's dtype is global_flat's, or bf16/fp16 under a float32/float64 model (summed in the
    model's dtype)."""
    what = f"{method.name}.aggregate"
    if method.no_chunked_source is not None:
        raise ValueError(
            f"{what}: updates from a chunked source ({updates!r}) are not supported: "
            f"{method.no_chunked_source}; pass a [K, d] tensor"
        )
    if tracing():
        raise ValueError(
            f"{what}: updates from a chunked source cannot be traced (torch.compile / export); pass a [K, d] tensor"
        )
    if not isinstance(global_flat, torch.Tensor) or global_flat.dim() != 1:
        raise ValueError(
            f"{what}: global_flat must be a 1-D tensor, got "
            f"{tuple(global_flat.shape) if isinstance(global_flat, torch.Tensor) else type(global_flat).__name__}"
        )
    d, gdt, dev = global_flat.numel(), global_flat.dtype, global_flat.device
    if isinstance(updates, MatrixSource):
        src = ChunkedUpdates(updates, device=dev)
    elif updates.device != dev and not (updates.device.type == dev.type == "cpu"):
        raise ValueError(
            f"{what}: updates ({updates!r}) delivers its chunks to {updates.device} but "
            f"global_flat is on {dev}: pass ChunkedUpdates(..., device={str(dev)!r})"
        )
    else:
        src = updates
    if src.d != d:
        raise ValueError(f"{what}: updates ({src!r}) has d={src.d} columns, expected d={d} (len(global_flat))")
    if src.dtype != gdt and not (
        src.dtype in (torch.float16, torch.bfloat16) and gdt in (torch.float32, torch.float64)
    ):
        raise ValueError(
            f"{what}: updates ({src!r}) has dtype {src.dtype}, expected global_flat's {gdt} "
            "(or bfloat16/float16 under a float32/float64 model)"
        )
    return src, UpdatesShape(src.K, d, gdt, dev)


def _attach(
    method: "Aggregator",
    rin: RoundInput,
    src: Optional[ChunkedUpdates],
    rows_of: Optional[Dict[int, int]],
    out: Optional[torch.Tensor] = None,
    packed: Optional[PackedRows] = None,
) -> RoundInput:
    """Gives ``rin`` its source rows or packed rows (the accepted clients' rows of ``src`` / ``packed``) and the
    caller's ``out``."""
    if src is not None and rows_of is not None:
        rin.src = src.select_rows([rows_of[c] for c in rin.client_ids])
        rin.stop_at_bad = method.on_bad_update == "raise"
    if packed is not None and rows_of is not None:
        keep = [rows_of[c] for c in rin.client_ids]
        rin.packed = packed if keep == list(range(packed.K)) else packed.select(keep)
    rin.out = out
    return rin


def _packed_shape(method: "Aggregator", global_flat: torch.Tensor, rows: PackedRows) -> UpdatesShape:
    """The UpdatesShape ``validate`` checks for packed rows: K x d in global_flat's dtype and device (their weighted
    sums are computed in its precision)."""
    what = f"{method.name}.aggregate"
    if tracing():
        raise ValueError(f"{what}: compressed rows cannot be traced (torch.compile / export); pass a [K, d] tensor")
    if not isinstance(global_flat, torch.Tensor) or global_flat.dim() != 1:
        raise ValueError(
            f"{what}: global_flat must be a 1-D tensor, got "
            f"{tuple(global_flat.shape) if isinstance(global_flat, torch.Tensor) else type(global_flat).__name__}"
        )
    if rows.d != global_flat.numel():
        raise ValueError(
            f"{what}: the compressed rows have d={rows.d} columns, expected d={global_flat.numel()} (len(global_flat))"
        )
    return UpdatesShape(rows.K, rows.d, global_flat.dtype, global_flat.device)


def _check_out(method: "Aggregator", global_flat: torch.Tensor, out: Any) -> None:
    """``aggregate``'s ``out``: a [d] contiguous tensor of global_flat's dtype and device, apart from it."""
    what = f"{method.name}.aggregate"
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"{what}: out must be a [d] tensor or None, got {type(out).__name__}")
    if not isinstance(global_flat, torch.Tensor):
        return  # (validate names global_flat)
    d = global_flat.numel()
    if (
        out.dim() != 1
        or out.numel() != d
        or out.dtype != global_flat.dtype
        or out.device != global_flat.device
        or not out.is_contiguous()
    ):
        raise ValueError(
            f"{what}: out must be a contiguous [d={d}] tensor of global_flat's dtype "
            f"{global_flat.dtype} on {global_flat.device}, got shape {tuple(out.shape)} {out.dtype} "
            f"on {out.device}{'' if out.is_contiguous() else ' (not contiguous)'}"
        )
    if d and out.untyped_storage().data_ptr() == global_flat.untyped_storage().data_ptr():
        raise ValueError(
            f"{what}: out shares memory with global_flat (the method reads global_flat while it "
            "writes out): pass another tensor, or copy the result into global_flat afterwards"
        )


def _into(res: AggResult, out: Optional[torch.Tensor]) -> AggResult:
    """``res`` with its params in ``out`` (copied unless the method's result pass wrote them there)."""
    if out is None or res.params is out:
        return res
    return AggResult(out.copy_(res.params), res.info)
