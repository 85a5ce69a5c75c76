"""Algorithm parts shared by several methods, written once (the role of Flower's ``aggregate.py``).

* :func:`client_weights` - how a round's clients are weighted: ``"samples"`` p_k = n_k / sum n, or
  ``"uniform"`` 1/K (the papers' 1/|S|).
* :class:`ServerMomentum` - v <- beta v + sum_k p_k U_k (FedAvgM; FedAWARE's ``fedavgm`` extension);
  :func:`momentum_attr` - its v as a method's declared-state attribute.
* :func:`controlled_entries` / :func:`flat_ranges` - a masked parameter range of the flat vector
  (FedPGVC's and FedPVR's last layers; every parameter for SCAFFOLD); :func:`split_layers` - GC-Fed's
  local / global split of the parameter tensors.
* :class:`ControlVariateRule` and :class:`ControlVariateServer` - SCAFFOLD option-II control
  variates over such a range: SCAFFOLD is the all-parameters case, FedPVR its masked case.
* :func:`check_choice` - the one-line error for an option outside its allowed values.

Declared state (``Aggregator.state_attrs``) lives in ``base.py``.
"""
from __future__ import annotations

import abc

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .. import ops
from ..flat import FlatSpec
from ._fused import fused_sgd_step
from .base import AggResult, Aggregator, ClientContext, ClientRule, RoundInput

WEIGHTINGS = ("samples", "uniform")


def check_choice(method: str, option: str, value, allowed: Sequence) -> None:
    """ValueError naming the method, the option, the value and the allowed values."""
    if value not in allowed:
        raise ValueError(f"{method}: {option} must be one of {tuple(allowed)}, got {value!r}")


# ---- client weighting --------------------------------------------------------------------------
def client_weights(rin: RoundInput, weighting: str) -> torch.Tensor:
    """[K] float64 host weights of the round's clients: n_k / sum n ("samples") or 1/K ("uniform")."""
    if weighting == "uniform":
        return rin.num_examples.new_full((rin.K,), 1.0 / rin.K)
    if weighting == "samples":
        return rin.sample_weights()
    raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")


# ---- server momentum ---------------------------------------------------------------------------
class ServerMomentum:
    """Heavy-ball momentum on the server: ``v <- beta v + sum_k p_k U_k`` in one ``weighted_sum``
    pass that accumulates straight into v. v ([d], dtype and device of the global model) is
    allocated at the first round; ``v`` is the state to save."""

    def __init__(self, beta: float):
        self.beta = float(beta)
        self.v: Optional[torch.Tensor] = None

    def step(self, rin: RoundInput, p: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The same update through ``rin.weighted_sum`` (the pass that screens U's rows in
        ``Aggregator.screen_in_pass`` methods): v is replaced only after that pass, so a round the
        screen restarts has changed nothing."""
        if self.v is None or self.v.shape != like.shape:
            self.v = torch.zeros_like(like)
        v = self.v.to(device=like.device, dtype=like.dtype)
        self.v = rin.weighted_sum(p, base=v.mul(self.beta))
        return self.v

    def update(self, U: torch.Tensor, p: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        if self.v is None or self.v.shape != like.shape:
            self.v = torch.zeros_like(like)
        v = self.v.to(device=like.device, dtype=like.dtype)
        v.mul_(self.beta)
        ops.weighted_sum(U, p, base=v, out=v)
        self.v = v
        return v


def momentum_attr(holder: str) -> property:
    """The declared-state attribute of a method's :class:`ServerMomentum`: reads and writes the v of
    the ServerMomentum held in attribute ``holder`` (FedAvgM's ``momentum``, FedAWARE's ``ext_momentum``)."""

    def get(self) -> Optional[torch.Tensor]:
        return getattr(self, holder).v

    def set_(self, v: Optional[torch.Tensor]) -> None:
        getattr(self, holder).v = v

    return property(get, set_, doc=f"the server momentum v of {holder} (None before the first round)")


# ---- masked parameter ranges -------------------------------------------------------------------
def controlled_entries(spec, n_ctrl: Union[int, str] = 2, modules: Optional[Sequence[str]] = None):
    """The FlatSpec entries (parameters only, no buffers) of a controlled set (FedPGVC's S_gvc,
    FedPVR's variance-reduced layers).

    ``modules``: explicit module names (exact names, e.g. ``["fc2", "fc3"]``); otherwise the last
    ``n_ctrl`` parameterised non-norm modules counted from the output. Norm modules between the
    first selected module and the output join the set; ones before it stay out. ``n_ctrl="all"``
    selects every parameter (SCAFFOLD)."""
    params = [e for e in spec.entries if not e.is_buffer]
    if isinstance(n_ctrl, str):
        if n_ctrl != "all":
            raise ValueError(f"n_ctrl must be a non-negative int or 'all', got {n_ctrl!r}")
        return params
    order = spec.layer_modules()
    if modules is not None:
        known = set(order)
        unknown = [m for m in modules if m not in known]
        if unknown:
            raise ValueError(f"controlled modules {unknown} are not parameterised modules of the model; "
                             f"known: {order}")
        sel = set(modules)
        return [e for e in params if e.module in sel]
    if not isinstance(n_ctrl, int) or isinstance(n_ctrl, bool) or n_ctrl < 0:
        raise ValueError(f"n_ctrl must be a non-negative int or 'all', got {n_ctrl!r}")
    if n_ctrl == 0:
        return []
    norm_mods = {e.module for e in params if e.kind == "norm"}
    layers = [m for m in order if m not in norm_mods]
    if n_ctrl > len(layers):
        raise ValueError(f"n_ctrl={n_ctrl} but the model has only {len(layers)} parameterised (non-norm) layers")
    first = order.index(layers[-n_ctrl])
    sel = set(order[first:])
    return [e for e in params if e.module in sel]


def _prefix_match(name: str, prefixes: Sequence[str]) -> bool:
    for p in prefixes:
        q = p if p.endswith(".") else p + "."
        if name == p or name.startswith(q):
            return True
    return False


def split_layers(names: Sequence[str], local_layers: str = "all_except",
                 global_layers: Optional[Sequence[str]] = None, lam: Optional[float] = None) -> List[bool]:
    """Per parameter tensor (``names`` in named_parameters order): True = in the local (Local GC) set.

    local_layers: "all_except" (every tensor except those under the module prefixes
    ``global_layers``, matched as exact module prefixes: "fc" does not match "fc1.weight"),
    "first_fraction" (the first floor(lam * L + 1e-9) tensors), "all", "none"."""
    L = len(names)
    if local_layers == "all":
        return [True] * L
    if local_layers == "none":
        return [False] * L
    if local_layers == "first_fraction":
        if lam is None or not 0.0 <= lam <= 1.0:
            raise ValueError(f"split_layers: lam must lie in [0, 1] for 'first_fraction', got {lam!r}")
        n = int(math.floor(lam * L + 1e-9))
        return [i < n for i in range(L)]
    if local_layers == "all_except":
        if not global_layers:
            raise ValueError("split_layers: 'all_except' needs global_layers (module prefixes)")
        hit = [_prefix_match(n, global_layers) for n in names]
        for p in global_layers:
            if not any(_prefix_match(n, [p]) for n in names):
                raise ValueError(f"split_layers: global layer prefix {p!r} matches no parameter; names: {list(names)}")
        return [not h for h in hit]
    raise ValueError(f"split_layers: local_layers must be all_except|first_fraction|all|none, got {local_layers!r}")


def check_n_ctrl(method: str, n_ctrl) -> None:
    if not (isinstance(n_ctrl, str) and n_ctrl == "all") and \
            not (isinstance(n_ctrl, int) and not isinstance(n_ctrl, bool) and n_ctrl >= 0):
        raise ValueError(f"{method}: n_ctrl must be a non-negative int or 'all', got {n_ctrl!r}")


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


# ---- control variates (SCAFFOLD option II over a masked range) ---------------------------------
def control_delta(x: torch.Tensor, y: torch.Tensor, c: Optional[torch.Tensor], lr_sum: float) -> torch.Tensor:
    """Option II: delta_c = c_i^+ - c_i = -c + (x - y) / lr_sum, lr_sum = the summed learning rates of
    the local steps (K lr for a constant lr). x: global, y: local model (controlled part)."""
    if not lr_sum > 0:
        raise ValueError(f"control_delta: lr_sum must be > 0, got {lr_sum}")
    dc = x.sub(y).div_(lr_sum)
    return dc if c is None else dc.sub_(c.to(device=dc.device, dtype=dc.dtype))


def pvr_control_update(x: torch.Tensor, y: torch.Tensor, c: torch.Tensor, c_i: torch.Tensor,
                       num_steps: int, lr: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """(c_i^+, delta_c) for num_steps steps at a constant lr (FedPVR spec §2.6, U6)."""
    if num_steps <= 0 or not lr > 0:
        raise ValueError(f"pvr_control_update: need num_steps > 0 and lr > 0, got {num_steps}, {lr}")
    delta = control_delta(x, y, c, num_steps * lr)
    return c_i + delta, delta


def momentum_steps(tau: float, rho: float = 0.0) -> float:
    """||a||_1 for tau steps of SGD with momentum rho (buf = rho buf + g; w -= lr buf)."""
    tau, rho = float(tau), float(rho)
    if not (0.0 <= rho < 1.0):
        raise ValueError(f"momentum must lie in [0, 1), got {rho}")
    if rho == 0.0:
        return tau
    return (tau - rho * (1.0 - rho ** tau) / (1.0 - rho)) / (1.0 - rho)


def optimizer_lr_momentum(optimizer) -> Tuple[Optional[float], float]:
    """(lr, momentum) of the optimizer's first parameter group ((None, 0) when it has none)."""
    try:
        g = optimizer.param_groups[0]
    except (AttributeError, IndexError, TypeError):
        return None, 0.0
    lr = g.get("lr")
    return (None if lr is None else float(lr)), float(g.get("momentum", 0.0) or 0.0)


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
            raise ValueError(f"{agg.name} client rule: the model has no parameter {missing[0]!r} recorded in the FlatSpec")
        self.params = [p for p in model.parameters() if p.requires_grad]
        x = ctx.global_flat
        c, ci = ctx.payload.get("c"), ctx.payload.get("c_i")
        for key, v in (("c", c), ("c_i", ci)):
            if v is not None and v.numel() != self.d_c:
                raise ValueError(f"{agg.name} client rule: payload {key!r} has {v.numel()} elements, "
                                 f"expected d_c={self.d_c} (the controlled range)")
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
                self.corr[id(p)] = corr[o:o + e.numel].view(e.shape).to(p.dtype)
        self.lr_sum, self._lr, self.momentum = 0.0, None, 0.0

    def _correct_grads(self) -> None:
        sel = [(p.grad, self.corr[id(p)]) for p in self.params if id(p) in self.corr and p.grad is not None]
        if sel:
            with torch.no_grad():
                torch._foreach_add_([g for g, _ in sel], [v for _, v in sel])

    def before_step(self, ctx: ClientContext, model) -> None:
        if not self.aggregator.fused_step:   # fused: the correction is applied inside the native step
            self._correct_grads()

    def step(self, ctx: ClientContext, model, optimizer) -> bool:
        self._lr, self.momentum = optimizer_lr_momentum(optimizer)
        if not self.aggregator.fused_step or not self.corr:
            return False
        if fused_sgd_step(optimizer, self.params, c_add=[self.corr.get(id(p)) for p in self.params]):
            return True           # p -= lr * (g - c_i + c) (+ momentum, wd) in one native pass
        self._correct_grads()      # optimizer not plain SGD: edit the gradients, let it step
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
        if self.ranges == [(0, self.spec.d)]:
            for e in self.spec.entries:                       # buffers carry no control variate
                if e.is_buffer:
                    dc[e.slice] = 0
        out["delta_c"] = dc
        return out


class ControlVariateServer(Aggregator):
    """Server side of SCAFFOLD option II over a masked range of d_c coordinates:

        x   <- x + server_lr * sum_k p_k U_k                 (p: client_weights(weighting))
        c_i <- c_i + delta_c_i                                for the round's clients
        c   <- c + (1/N) sum_{i in S} delta_c_i               (keeps c = mean_i c_i)

    c is [d_c]; the c_i live in an N x d_c table when N is known (``num_clients`` / ``setup``),
    else (unless ``require_num_clients``) in a dict of the clients seen so far with N = their count.
    Subclasses define ``control_layout(spec)`` -> (entries, ranges, d_c) and ``layout_without_spec``."""

    client_rule_cls = ControlVariateRule
    steps_key = "local_steps"
    require_num_clients = False
    state_attrs = ("c", "c_table", "c_rows", "seen")   # the layout (ranges, d_c) is derived from the spec
    screen_in_pass = True                               # _aggregate reads U first, through rin.weighted_sum

    def __init__(self, weighting: str = "uniform", momentum_correction: bool = False, fused_step: bool = True,
                 num_clients: Optional[int] = None, **kw):
        super().__init__(**kw)
        check_choice(self.name, "weighting", weighting, WEIGHTINGS)
        self.weighting = weighting
        self.momentum_correction, self.fused_step = bool(momentum_correction), bool(fused_step)
        self.num_clients = num_clients
        self.c: Optional[torch.Tensor] = None
        self.c_table: Optional[torch.Tensor] = None            # [N, d_c] when N is known
        self.c_rows: Dict[int, torch.Tensor] = {}              # otherwise client id -> [d_c]
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
        if self.num_clients is None and self.require_num_clients:
            raise ValueError(f"{self.name}: needs the number of clients N (num_clients= or setup(num_clients=N))")
        if self.num_clients is not None and self.c_table is None:
            self.c_table = like.new_zeros((self.num_clients, self.d_c))
            for cid, row in self.c_rows.items():
                self.c_table[cid].copy_(row)
            self.c_rows = {}

    def layout_without_spec(self, d: int):
        return [(0, d)], d

    def _ci(self, cid: int, create: bool = False) -> Optional[torch.Tensor]:
        if self.c_table is not None:
            return self.c_table[cid]
        if cid not in self.c_rows and create:
            self.c_rows[cid] = torch.zeros_like(self.c)
        return self.c_rows.get(cid)

    def client_payload(self, client_id: int) -> Dict[str, Any]:
        if self.c is None:
            return {}                      # before the first round: c = c_i = 0
        return {"c": self.c, "c_i": self._ci(int(client_id))}

    def validate(self, global_flat, updates, num_examples, client_ids=None, payloads=None, screen: bool = True):
        if isinstance(global_flat, torch.Tensor) and global_flat.dim() == 1:
            self._alloc(global_flat)
        return super().validate(global_flat, updates, num_examples, client_ids, payloads, screen)

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

    def _aggregate(self, rin: RoundInput) -> AggResult:
        g = rin.global_flat
        p = client_weights(rin, self.weighting)
        new = rin.weighted_sum(p, base=g, alpha=self.server_lr)         # first read of U: screens its rows
        self.seen.update(rin.client_ids)
        N = self.num_clients if self.num_clients is not None else len(self.seen)
        c = self.c
        dcs = [pl["delta_c"] for pl in rin.payloads]
        if any(v.dim() != 1 or v.dtype != c.dtype or v.device != c.device for v in dcs):
            dcs = [v.reshape(-1).to(device=c.device, dtype=c.dtype) for v in dcs]
        if self.c_table is not None:          # c_i += delta_c_i for the round's rows: one foreach op
            rows = self.c_table.unbind(0)
            torch._foreach_add_([rows[cid] for cid in rin.client_ids], dcs)
        else:                                 # N unknown: a dict of the clients seen so far
            for cid, dc in zip(rin.client_ids, dcs):
                self._ci(cid, create=True).add_(dc)
        # sum_i delta_c_i: one fixed-order pass (the deltas arrive as K separate [d_c] tensors)
        dsum = ops.weighted_sum(torch.stack(dcs), torch.ones(len(dcs), dtype=torch.float64))
        c.add_(dsum, alpha=1.0 / N)
        return AggResult(new, {"weights": p.tolist(), "c_scale": 1.0 / N})
