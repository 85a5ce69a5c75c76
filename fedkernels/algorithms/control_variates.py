"""SCAFFOLD option-II control variates over a masked range of the flat parameter vector, written once:
SCAFFOLD (scaffold.py) is the all-parameters case, FedPVR (fedpvr.py) its last-layers case.

* :func:`flat_ranges` / :func:`gather_ranges` - the controlled entries as merged [start, stop) flat
  ranges (d_c coordinates in all) and the controlled part of a flat vector.
* :func:`control_delta` - option II: delta_c = c_i^+ - c_i = -c + (x - y) / sum_steps lr;
  :func:`pvr_control_update` - (c_i^+, delta_c) at a constant lr (FedPVR spec §2.6, U6).
* :class:`ControlVariateRule` - client: g <- g + (c - c_i) on the controlled parameters every local step.
* :class:`ControlVariateServer` - server: x <- x + server_lr sum_k p_k U_k; c_i += delta_c_i;
  c += (1/N) sum_{i in S} delta_c_i. Subclasses choose the range (``control_layout``).
"""

from __future__ import annotations

import abc
import os
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from .. import ops
from . import tables
from ..flat import FlatSpec
from ._fused import fused_sgd_step
from .base import AggResult, Aggregator, BatchedRule, ClientContext, ClientRule, RoundInput, id_tensor, table_passes
from .parts import WEIGHTINGS, check_choice, client_weights, momentum_steps, optimizer_lr_momentum


def flat_ranges(entries) -> Tuple[List[Tuple[int, int]], int]:
    """Merged [start, stop) flat ranges of ``entries`` (in order) and their total length d_c."""
    out: List[list] = []
    for e in entries:
        if out and out[-1][1] == e.offset:
            out[-1][1] = e.offset + e.numel
        else:
            out.append([e.offset, e.offset + e.numel])
    return [tuple(r) for r in out], sum(e.numel for e in entries)


def gather_ranges(v: torch.Tensor, ranges) -> torch.Tensor:
    """The controlled part of the flat vector ``v`` (a view when it is one range)."""
    if len(ranges) == 1:
        a, b = ranges[0]
        return v[a:b]
    return torch.cat([v[a:b] for a, b in ranges])


def control_delta(x: torch.Tensor, y: torch.Tensor, c: Optional[torch.Tensor], lr_sum: float) -> torch.Tensor:
    """Option II: delta_c = c_i^+ - c_i = -c + (x - y) / lr_sum, lr_sum = the summed learning rates of
    the local steps (K lr for a constant lr). x: global, y: local model (controlled part)."""
    if not lr_sum > 0:
        raise ValueError(f"control_delta: lr_sum must be > 0, got {lr_sum}")
    dc = x.sub(y).div_(lr_sum)
    return dc if c is None else dc.sub_(c.to(device=dc.device, dtype=dc.dtype))


def pvr_control_update(
    x: torch.Tensor, y: torch.Tensor, c: torch.Tensor, c_i: torch.Tensor, num_steps: int, lr: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(c_i^+, delta_c) for num_steps steps at a constant lr (FedPVR spec §2.6, U6)."""
    if num_steps <= 0 or not lr > 0:
        raise ValueError(f"pvr_control_update: need num_steps > 0 and lr > 0, got {num_steps}, {lr}")
    delta = control_delta(x, y, c, num_steps * lr)
    return c_i + delta, delta


class ControlVariateRule(ClientRule):
    """Client side of SCAFFOLD / FedPVR: every local step uses g + (c - c_i) on the controlled
    parameters; ``end`` returns ``{"delta_c": -c + (x - y) / lr_sum, <steps_key>: K}`` over the
    controlled range (buffers carry no control variate).

    lr_sum sums the learning rate of every local step (read from the optimizer, so LR schedulers
    inside a round count). ``momentum_correction``: the divisor becomes lr_sum * ||a||_1 / K, the
    effective number of steps of SGD with momentum (FedNova's a). ``fused_step``: with a plain
    ``torch.optim.SGD`` the corrected step is one native pass (``ops.fused_sgd_step_``)."""

    def begin(self, ctx: ClientContext, model) -> None:
        agg = self.aggregator
        spec = ctx.spec if ctx.spec is not None else FlatSpec.from_module(model)
        self.spec = spec
        entries, self.ranges, self.d_c = agg.control_layout(spec)
        named = dict(model.named_parameters())
        missing = [e.name for e in entries if e.name not in named]
        if missing:
            raise ValueError(
                f"{agg.name} client rule: the model has no parameter {missing[0]!r} recorded in the FlatSpec"
            )
        self.params = [p for p in model.parameters() if p.requires_grad]
        x = ctx.global_flat
        c, ci = ctx.payload.get("c"), ctx.payload.get("c_i")
        for key, v in (("c", c), ("c_i", ci)):
            if v is not None and v.numel() != self.d_c:
                raise ValueError(
                    f"{agg.name} client rule: payload {key!r} has {v.numel()} elements, "
                    f"expected d_c={self.d_c} (the controlled range)"
                )
        self.corr: Dict[int, torch.Tensor] = {}
        if c is not None or ci is not None:
            corr = torch.zeros(self.d_c, dtype=x.dtype, device=x.device)
            if c is not None:
                corr.add_(c.to(device=x.device, dtype=x.dtype))
            if ci is not None:
                corr.sub_(ci.to(device=x.device, dtype=x.dtype))
            starts, pos = [], 0
            for a, b in self.ranges:
                starts.append((a, b, pos))
                pos += b - a
            for e in entries:
                p = named[e.name]
                if not p.requires_grad:
                    continue
                a, _, pos = next(r for r in starts if r[0] <= e.offset < r[1])
                o = pos + e.offset - a
                self.corr[id(p)] = corr[o : o + e.numel].view(e.shape).to(p.dtype)
        self.lr_sum, self._lr, self.momentum = 0.0, None, 0.0

    def _correct_grads(self) -> None:
        sel = [(p.grad, self.corr[id(p)]) for p in self.params if id(p) in self.corr and p.grad is not None]
        if sel:
            with torch.no_grad():
                torch._foreach_add_([g for g, _ in sel], [v for _, v in sel])

    def before_step(self, ctx: ClientContext, model) -> None:
        if not self.aggregator.fused_step:  # fused: the correction is applied inside the native step
            self._correct_grads()

    def step(self, ctx: ClientContext, model, optimizer) -> bool:
        self._lr, self.momentum = optimizer_lr_momentum(optimizer)
        if not self.aggregator.fused_step or not self.corr:
            return False
        if fused_sgd_step(optimizer, self.params, c_add=[self.corr.get(id(p)) for p in self.params]):
            return True  # p -= lr * (g - c_i + c) (+ momentum, wd) in one native pass
        self._correct_grads()  # optimizer not plain SGD: edit the gradients, let it step
        return False

    def after_step(self, ctx: ClientContext, model) -> None:
        self.lr_sum += self._lr if self._lr is not None else float(ctx.lr)
        self._lr = None

    def end(self, ctx: ClientContext, model) -> Dict[str, Any]:
        agg, x, K = self.aggregator, ctx.global_flat, int(ctx.step)
        out: Dict[str, Any] = {agg.steps_key: K}
        if K == 0 or not self.lr_sum > 0:
            out["delta_c"] = torch.zeros(self.d_c, dtype=x.dtype, device=x.device)
            return out
        div = self.lr_sum
        if agg.momentum_correction and self.momentum:
            div *= momentum_steps(K, self.momentum) / K
        y = self.spec.flatten(model).to(device=x.device, dtype=x.dtype)
        dc = control_delta(gather_ranges(x, self.ranges), gather_ranges(y, self.ranges), ctx.payload.get("c"), div)
        out["delta_c"] = clear_buffers_(dc, self.spec, self.ranges)
        return out


def clear_buffers_(dc: torch.Tensor, spec, ranges) -> torch.Tensor:
    """Buffers (BatchNorm statistics) carry no control variate: zeroes their columns of delta_c
    ([d_c] or [C, d_c]) when the controlled range is all of d; returns dc."""
    if ranges == [(0, spec.d)]:
        for e in spec.entries:
            if e.is_buffer:
                dc[..., e.slice] = 0
    return dc


class ControlVariateBatched(BatchedRule):
    """ControlVariateRule, batched (SCAFFOLD / FedPVR): g += c - c_i on the controlled range;
    delta_c = -c + (x - y) / lr_sum."""

    def begin(self, ch):
        agg = self.agg
        _, self.ranges, self.d_c = agg.control_layout(self.spec)
        c = [p.get("c") for p in ch.payloads]
        ci = [p.get("c_i") for p in ch.payloads]
        for key, vs in (("c", c), ("c_i", ci)):
            for v in vs:
                if v is not None and v.numel() != self.d_c:
                    raise ValueError(
                        f"{agg.name} client rule: payload {key!r} has {v.numel()} elements, "
                        f"expected d_c={self.d_c} (the controlled range)"
                    )
        self.c = c[0] if c and c[0] is not None else None  # c is the server's one vector
        self.corr = None
        if self.c is not None or any(v is not None for v in ci):
            W = ch.W
            corr = torch.zeros(ch.C, self.d_c, dtype=W.dtype, device=W.device)
            if self.c is not None:
                corr.add_(self.c.to(device=W.device, dtype=W.dtype))
            if any(v is not None for v in ci):
                corr.sub_(
                    torch.stack(
                        [v if v is not None else torch.zeros(self.d_c, dtype=W.dtype, device=W.device) for v in ci]
                    ).to(device=W.device, dtype=W.dtype)
                )
            self.corr = corr

    def edit(self, G):
        if self.corr is None:
            return
        pos = 0
        for a, b in self.ranges:
            G[:, a:b].add_(self.corr[:, pos : pos + b - a])
            pos += b - a

    def end(self, ch):
        agg, x = self.agg, ch.x
        K = torch.tensor(ch.steps, dtype=torch.float64)
        div = K * ch.lr.cpu()  # sum of the steps' learning rates
        if agg.momentum_correction and ch.momentum:
            div = div * torch.tensor([momentum_steps(k, ch.momentum) / k for k in ch.steps], dtype=torch.float64)
        xs = gather_ranges(x, self.ranges)
        Y = torch.cat([ch.W[:, a:b] for a, b in self.ranges], 1)  # the local models' controlled part
        dc = (xs.unsqueeze(0) - Y).div_(div.to(device=Y.device, dtype=Y.dtype).unsqueeze(1))
        if self.c is not None:
            dc.sub_(self.c.to(device=dc.device, dtype=dc.dtype))
        clear_buffers_(dc, self.spec, self.ranges)
        return [{agg.steps_key: int(k), "delta_c": dc[i]} for i, k in enumerate(ch.steps)]


ControlVariateRule.batched_form = ControlVariateBatched


class ControlVariateServer(Aggregator):
    """Server side of SCAFFOLD option II over a masked range of d_c coordinates:

        x   <- x + server_lr * sum_k p_k U_k                 (p: client_weights(weighting))
        c_i <- c_i + delta_c_i                                for the round's clients
        c   <- c + (1/N) sum_{i in S} delta_c_i               (keeps c = mean_i c_i)

    c is [d_c]; the c_i live in an N x d_c table when N is known (``num_clients`` / ``setup``),
    else (unless ``require_num_clients``) in a dict of the clients seen so far with N = their count.
    The table lives with the global model, or on ``control_device`` (e.g. "cpu": host memory for a
    model on a GPU), or in a raw file mapped on the host (``control_file=PATH``: created as zeros with
    its blocks reserved, needs N; ``state_dict`` then holds a reference to it, checked on loading by its
    marker ``PATH.state``, see ``tables.py``). A round's update of the table is one ``index_add_`` of
    its [K, d_c] deltas (on the table's device): the same bits wherever the table lives.
    Subclasses define ``control_layout(spec)`` -> (entries, ranges, d_c) and ``layout_without_spec``."""

    client_rule_cls = ControlVariateRule
    steps_key = "local_steps"
    require_num_clients = False
    state_attrs = ("c", "c_table", "c_rows", "seen")  # the layout (ranges, d_c) is derived from the spec
    screen_in_pass = True  # _aggregate reads U first, through rin.weighted_sum
    reads_beyond_weighted_sum = None  # x's step is one weighted sum; the control-variate deltas are payloads
    dp_verdict = (
        "its control variates (c and each c_i) are un-noised functions of the clients' updates, sent back to clients"
    )
    screened_payload_keys = ("delta_c",)  # stacked once per round, scanned for NaN/Inf

    option_ranges = {"num_clients": ">= 1"}

    def __init__(
        self,
        weighting: str = "uniform",
        momentum_correction: bool = False,
        fused_step: bool = True,
        num_clients: Optional[int] = None,
        control_device=None,
        control_file: Optional[Union[str, os.PathLike]] = None,
        **kw,
    ):
        super().__init__(**kw)
        check_choice(self.name, "weighting", weighting, WEIGHTINGS)
        if control_device is not None:
            try:
                torch.device(control_device)
            except (RuntimeError, TypeError):
                raise ValueError(
                    f"{self.name}: control_device must be a device (e.g. 'cpu') or None, got {control_device!r}"
                ) from None
        self.control_device = control_device
        self.control_file = tables.check_path(self.name, "control_file", control_file, control_device, "control_device")
        self.table_version = 0  # completed updates of a control_file table
        self.weighting = weighting
        self.momentum_correction, self.fused_step = bool(momentum_correction), bool(fused_step)
        self.num_clients = num_clients
        self.c: Optional[torch.Tensor] = None
        self.c_table: Optional[torch.Tensor] = None  # [N, d_c] when N is known
        self.c_rows: Dict[int, torch.Tensor] = {}  # otherwise client id -> [d_c]
        self.seen: set = set()
        self.ranges: Optional[List[Tuple[int, int]]] = None
        self.d_c: Optional[int] = None

    @abc.abstractmethod
    def control_layout(self, spec):
        """The controlled flat ranges of ``spec`` (SCAFFOLD: every parameter; FedPVR: its last layers)."""

    def setup(self, spec=None, num_clients=None, global_flat=None) -> None:
        super().setup(spec, num_clients if num_clients is not None else self.num_clients, global_flat)
        if global_flat is not None:
            self._alloc(global_flat)

    def _alloc(self, like: torch.Tensor) -> None:
        if self.ranges is None:
            if self.spec is not None:
                _, self.ranges, self.d_c = self.control_layout(self.spec)
            else:
                self.ranges, self.d_c = self.layout_without_spec(like.numel())
        if self.c is None:
            self.c = like.new_zeros(self.d_c)
        if self.num_clients is None and (self.require_num_clients or self.control_file is not None):
            why = " for its control_file table" if self.control_file is not None else ""
            raise ValueError(f"{self.name}: needs the number of clients N{why} (num_clients= or setup(num_clients=N))")
        if self.num_clients is not None and self.c_table is None:
            if self.control_file is not None:
                self.c_table = tables.table_file(
                    self.control_file,
                    self.num_clients,
                    self.d_c,
                    like.dtype,
                    exist_ok=False,
                    what=f"{self.name}: control_file",
                )
                self.table_version = 0
                tables.updated(self.control_file, 0)
            else:
                self.c_table = torch.zeros(
                    (self.num_clients, self.d_c),
                    dtype=like.dtype,
                    device=like.device if self.control_device is None else self.control_device,
                )
            for cid, row in self.c_rows.items():
                self.c_table[cid].copy_(row)
            self.c_rows = {}

    def layout_without_spec(self, d: int):
        return [(0, d)], d

    def state_dict(self) -> Dict[str, Any]:
        """The declared state; a ``control_file`` table as a reference (path, shape, dtype, version)."""
        return tables.state_dict(self, super().state_dict, "c_table", "control_file")

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores the state (a ``control_file`` table reopened after its checks, ``tables.reopen``; an
        in-memory table moved to ``control_device`` or written to this aggregator's ``control_file``)."""
        tables.load_state_dict(self, super().load_state_dict, state, "c_table", "control_file")
        if self.control_file is None and self.control_device is not None and isinstance(self.c_table, torch.Tensor):
            self.c_table = self.c_table.to(self.control_device)

    def _ci(self, cid: int, create: bool = False) -> Optional[torch.Tensor]:
        if self.c_table is not None:
            return self.c_table[cid]
        if cid not in self.c_rows and create:
            self.c_rows[cid] = torch.zeros_like(self.c)
        return self.c_rows.get(cid)

    def client_payload(self, client_id: int) -> Dict[str, Any]:
        if self.c is None:
            return {}  # before the first round: c = c_i = 0
        ci = self._ci(int(client_id))
        if self.control_file is not None and ci is not None:
            ci = ci.clone()  # a view of the file mapping cannot go to worker processes (fd-shared storages)
        return {"c": self.c, "c_i": ci}

    def prepare_round(self, global_flat) -> None:
        if isinstance(global_flat, torch.Tensor) and global_flat.dim() == 1:
            self._alloc(global_flat)

    def check_payload(self, payload: Dict[str, Any]) -> Optional[str]:
        r = super().check_payload(payload)
        if r:
            return r
        dc = payload.get("delta_c")
        if not isinstance(dc, torch.Tensor):
            return self.missing_payload("delta_c", "the client's control-variate change, a [d_c] tensor")
        if self.d_c is not None and dc.numel() != self.d_c:
            return f"payload 'delta_c' has {dc.numel()} elements, expected d={self.d_c} (the length of the controlled range)"
        return None

    def suspect_payloads(self, payloads):
        rows = super().suspect_payloads(payloads)
        S = getattr(payloads, "stacks", {}).get("delta_c")  # the screen stacked them: all tensors, one shape
        if rows is None or S is None or (self.d_c is not None and S[0].numel() != self.d_c):
            return None
        return rows

    def _deltas(self, rin: RoundInput) -> torch.Tensor:
        """[K, d_c] the round's delta_c, in c's dtype and device (one stack)."""
        c = self.c
        try:
            D = self.payload_stack(rin, "delta_c")
        except RuntimeError:  # shapes or devices differ (same numel: checked)
            D = torch.stack([pl["delta_c"].reshape(-1).to(device=c.device, dtype=c.dtype) for pl in rin.payloads])
        return D.reshape(rin.K, -1).to(device=c.device, dtype=c.dtype)

    def update_passes(self, K: Optional[int] = None) -> Tuple[str, ...]:
        """x + sum p U; the K delta_c payloads sent with the round, added to their c_i rows, summed."""
        return ("sum", "payload") + table_passes(self.control_device, self.control_file, "table", "table_sum")

    def _aggregate(self, rin: RoundInput) -> AggResult:
        g = rin.global_flat
        p = client_weights(rin, self.weighting)
        new = rin.weighted_sum(p, base=g, alpha=self.server_lr)  # first read of U: screens its rows
        self.seen.update(rin.client_ids)
        N = self.num_clients if self.num_clients is not None else len(self.seen)
        c = self.c
        D = self._deltas(rin)  # [K, d_c]
        if self.c_table is not None:  # c_i += delta_c_i for the round's rows (distinct): one indexed op
            T = self.c_table
            tables.updating(self.control_file, self.table_version + 1)
            T.index_add_(0, id_tensor(rin.client_ids, T.device), D.to(T.device))
            tables.updated(self.control_file, self.table_version + 1)
            self.table_version += 1
        else:  # N unknown: a dict of the clients seen so far
            for cid, dc in zip(rin.client_ids, D):
                self._ci(cid, create=True).add_(dc)
        # sum_i delta_c_i: one fixed-order pass
        dsum = ops.weighted_sum(D, torch.ones(rin.K, dtype=torch.float64))
        c.add_(dsum, alpha=1.0 / N)
        return AggResult(new, {"weights": p.tolist(), "c_scale": 1.0 / N})
