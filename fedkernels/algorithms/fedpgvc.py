"""FedPGVC (Sahoo et al., TMLR) and the FedPVR baseline (Li et al., CVPR 2023). Spec: specs/fedpgvc.md.

FedPGVC changes only local training: on the controlled set S_gvc (the last ``n_ctrl`` parameterised
layers) every local step uses a direction built from the minibatch gradient g and the "gradient
penalty" rho = (1/B) sum_b l_b grad l_b = grad 0.5*mean(l^2) (spec §2.2). rho is a first-order
gradient of a different scalar: the ClientRule gets it with one extra ``autograd.grad`` that walks
only the head (no double backprop). Update modes (spec §2.4, ``mode=``):

* ``hadamard`` (alias ``paper_literal``; paper Eq. 15, Alg. 1): u = rho * g   (default)
* ``additive`` (paper App. §8): u = g + lam * rho
* ``layer_scalar`` (``stat`` = mean | norm): u_l = s_l * g_l, s_l = mean(rho_l) or ||rho_l||_2 per tensor
* ``layer_normalize`` (paper Eq. 9, target ``tau``): u_l = (tau / ||g_l||) g_l
* ``code`` (released script): plain steps, then a one-off multiplicative shrink W_t <- (1 - eta r_t) W_t
* ``lr_matched`` (spec §8 Exp A's matched control, not a FedPGVC variant): u = (1 + lam * lbar) g with
  lbar the running mean of this client's minibatch losses in the current round. It gives the head the
  same average step boost as ``additive`` (rho ~ lbar g) without the per-sample loss weighting.

The server is a plain average (uniform by default, spec §2.3): w <- w + server_lr * sum_k a_k U_k,
one ``ops.weighted_sum`` pass. ``server_rule="eq16_literal"`` gives the paper's Eq. 16 as printed,
(1 - eta_g) w + mean(y), kept only as a regression marker.

FedPVR (spec §2.6) keeps SCAFFOLD option-II control variates on the controlled range only; with
``n_ctrl="all"`` it is SCAFFOLD. The server stores c [d_c] and one c_i row per client id.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from .. import ops
from .base import AggResult, Aggregator, ClientContext, ClientRule, RoundInput, register

PGVC_MODES = ("hadamard", "additive", "layer_scalar", "layer_normalize", "code", "lr_matched")
_MODE_ALIASES = {"paper_literal": "hadamard", "paper": "hadamard"}
NAN_POLICIES = ("skip", "raise", "propagate")


# ---------------------------------------------------------------------------------------------
# layer selection (shared by FedPGVC and FedPVR)
# ---------------------------------------------------------------------------------------------
def controlled_entries(spec, n_ctrl: Union[int, str] = 2, modules: Optional[Sequence[str]] = None):
    """The FlatSpec entries (parameters only, no buffers) of the controlled set S_gvc.

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


def _ctrl_layout(entries) -> Tuple[List[Tuple[int, int]], int]:
    """Merged [start, stop) flat ranges of ``entries`` (in order) and their total length d_c."""
    out: List[list] = []
    for e in entries:
        if out and out[-1][1] == e.offset:
            out[-1][1] = e.offset + e.numel
        else:
            out.append([e.offset, e.offset + e.numel])
    return [tuple(r) for r in out], sum(e.numel for e in entries)


# ---------------------------------------------------------------------------------------------
# update directions (the arithmetic of the fused pgvc_step, spec §5.2, on lists of tensors)
# ---------------------------------------------------------------------------------------------
def pgvc_direction_(grads: List[torch.Tensor], rhos: Optional[List[torch.Tensor]], mode: str,
                    lam: float = 1.0, stat: str = "mean", tau: float = 1.0) -> List[torch.Tensor]:
    """Overwrites each g in ``grads`` with the FedPGVC direction u (spec §2.4); returns grads."""
    if not grads:
        return grads
    if mode == "hadamard":
        torch._foreach_mul_(grads, rhos)
    elif mode == "additive":
        torch._foreach_add_(grads, rhos, alpha=lam)
    elif mode == "layer_scalar":
        if stat == "mean":
            s = [r.mean() for r in rhos]
        else:
            s = list(torch._foreach_norm(rhos))
        torch._foreach_mul_(grads, s)
    elif mode == "layer_normalize":
        norms = torch._foreach_norm(grads)
        # a zero gradient stays zero (no direction to normalise)
        s = [torch.where(n > 0, tau / n.clamp_min(torch.finfo(n.dtype).tiny), torch.zeros_like(n)) for n in norms]
        torch._foreach_mul_(grads, s)
    elif mode == "code":
        pass
    else:
        raise ValueError(f"unknown FedPGVC mode {mode!r}")
    return grads


def code_shrink_(tensors: List[torch.Tensor], r: Sequence[float], eta: float) -> None:
    """The released script's post-training step (spec §2.4 [CODE], U8): W_t <- (1 - eta r_t) W_t."""
    with torch.no_grad():
        torch._foreach_mul_(tensors, [1.0 - eta * float(x) for x in r])


def pvr_control_update(x: torch.Tensor, y: torch.Tensor, c: torch.Tensor, c_i: torch.Tensor,
                       num_steps: int, lr: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """SCAFFOLD option II on the controlled range (spec §2.6, U6): returns (c_i_new, delta_c).

    c_i+ = c_i - c + (x - y)/(tau * lr);  delta_c = c_i+ - c_i.  x = global, y = local (ctrl part)."""
    if num_steps <= 0 or not lr > 0:
        raise ValueError(f"pvr_control_update: need num_steps > 0 and lr > 0, got {num_steps}, {lr}")
    delta = (x - y).div_(num_steps * lr).sub_(c)
    return c_i + delta, delta


def _per_sample_ce(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, target, reduction="none")


# ---------------------------------------------------------------------------------------------
# FedPGVC
# ---------------------------------------------------------------------------------------------
class FedPGVCRule(ClientRule):
    """Client side of FedPGVC (spec §2.5 lines 6-11).

    Needs the per-sample losses of the current minibatch: taken from ``ctx.extras["per_sample_loss"]``
    when the training loop provides it (a [B] tensor attached to the graph), otherwise recomputed
    from the model output (captured by a forward hook, no second forward) with the aggregator's
    ``loss_fn`` (default per-sample cross-entropy) and ``ctx.batch[1]`` as targets.
    ``self.last_rho`` holds rho of the last step (list, one per controlled tensor)."""

    def __init__(self, aggregator: "FedPGVC"):
        super().__init__(aggregator)
        self._hook = None
        self._out = None
        self.ctrl: List[torch.Tensor] = []
        self.last_rho: Optional[List[torch.Tensor]] = None
        self.skipped = 0
        self._skip_step = False
        self.loss_history: List[float] = []

    def begin(self, ctx: ClientContext, model) -> None:
        agg = self.aggregator
        entries = agg.ctrl_entries(ctx.spec)
        params = dict(model.named_parameters())
        self.ctrl = [params[e.name] for e in entries]
        self.skipped = 0
        self.loss_history = []
        if self.ctrl and agg.mode != "code":
            self._hook = model.register_forward_hook(self._capture)

    def _capture(self, module, inputs, output):
        self._out = output

    def _per_sample_loss(self, ctx: ClientContext) -> torch.Tensor:
        ell = ctx.extras.get("per_sample_loss")
        if ell is None:
            if self._out is None or ctx.batch is None:
                raise ValueError("FedPGVC client rule: no per-sample losses (set ctx.extras['per_sample_loss'] "
                                 "or ctx.batch = (inputs, targets) before the forward pass)")
            ell = self.aggregator.loss_fn(self._out, ctx.batch[1])
        if ell.dim() != 1:
            raise ValueError(f"FedPGVC client rule: per-sample loss must be 1-D [B], got shape {tuple(ell.shape)}")
        return ell

    def loss_term(self, ctx: ClientContext, model) -> Optional[torch.Tensor]:
        self._skip_step = False
        if not self.ctrl or self.aggregator.mode in ("code", "layer_normalize"):
            return None
        agg = self.aggregator
        ell = self._per_sample_loss(ctx)
        self._out = None
        if not bool(torch.isfinite(ell).all()):
            if agg.nan_policy == "raise":
                raise FloatingPointError(f"FedPGVC: non-finite per-sample loss at client {ctx.client_id} step {ctx.step}")
            if agg.nan_policy == "skip":
                self._skip_step = True
                self.skipped += 1
                self.last_rho = None
                return None
        w = ell.detach()
        if agg.loss_clip is not None:
            w = w.clamp(max=agg.loss_clip)
        self.loss_history.append(float(w.mean()))
        if agg.mode == "lr_matched":
            return None
        # rho = (1/B) sum_b l_b grad l_b = grad of mean(stopgrad(l) * l): a first-order gradient
        self.last_rho = list(torch.autograd.grad((w * ell).mean(), self.ctrl, retain_graph=True,
                                                 allow_unused=True))
        self.last_rho = [torch.zeros_like(p) if r is None else r for p, r in zip(self.ctrl, self.last_rho)]
        return None

    def before_step(self, ctx: ClientContext, model) -> None:
        agg = self.aggregator
        if not self.ctrl or self._skip_step or agg.mode == "code":
            return
        grads = [p.grad for p in self.ctrl]
        if any(g is None for g in grads):
            raise ValueError("FedPGVC client rule: a controlled parameter has no gradient after backward()")
        if agg.mode == "lr_matched":
            lbar = sum(self.loss_history) / len(self.loss_history)
            torch._foreach_mul_(grads, 1.0 + agg.lam * lbar)
            return
        pgvc_direction_(grads, self.last_rho, agg.mode, agg.lam, agg.stat, agg.tau)

    def step(self, ctx: ClientContext, model, optimizer) -> bool:
        return self._skip_step   # True = the step is dropped (nan_policy "skip")

    def end(self, ctx: ClientContext, model) -> Dict[str, Any]:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        agg = self.aggregator
        out: Dict[str, Any] = {"pgvc_skipped_steps": self.skipped}
        if self.loss_history:
            out["pgvc_mean_loss"] = sum(self.loss_history) / len(self.loss_history)
        if self.ctrl and agg.mode == "code":
            r = self._code_r(ctx, model)
            code_shrink_(self.ctrl, r, agg.code_eta if agg.code_eta is not None else ctx.lr)
        return out

    def _code_r(self, ctx: ClientContext, model) -> List[float]:
        """[CODE] r_t = l_t * mean(G_t), G = grad of the summed loss over the local data, t = tensor index."""
        data = ctx.extras.get("local_data") or ([ctx.batch] if ctx.batch is not None else [])
        if not data:
            raise ValueError("FedPGVC mode 'code' needs ctx.extras['local_data'] (batches) or ctx.batch")
        allp = [p for p in model.parameters() if p.requires_grad]
        G = [torch.zeros_like(p) for p in allp]
        losses = []
        for x, y in data:
            ell = self.aggregator.loss_fn(model(x), y)
            gs = torch.autograd.grad(ell.sum(), allp, allow_unused=True)
            for acc, g in zip(G, gs):
                if g is not None:
                    acc.add_(g)
            losses.append(ell.detach())
        ells = torch.cat(losses)
        idx = {id(p): t for t, p in enumerate(allp)}
        r = []
        for p in self.ctrl:
            t = idx[id(p)]
            r.append(float(ells[t]) * float(G[t].mean()) if t < ells.numel() else 0.0)
        return r


@register("fedpgvc")
class FedPGVC(Aggregator):
    """FedPGVC server (plain average) + client rule (gradient variance control on the last layers).

    Options: ``n_ctrl`` (int >= 0 or "all"; default 2), ``ctrl_modules`` (explicit module names),
    ``mode`` (see module doc; default "hadamard" = paper-literal), ``lam`` (additive), ``stat``
    (layer_scalar: mean|norm), ``tau`` (layer_normalize), ``code_eta`` (code mode; None = client lr),
    ``loss_clip`` (clip l inside rho only), ``loss_fn`` (per-sample loss (out, target) -> [B]),
    ``nan_policy`` (skip|raise|propagate), ``weighting`` (uniform|samples), ``server_rule``
    ("delta" = w + eta_g (ybar - w); "eq16_literal" = (1 - eta_g) w + ybar)."""

    client_rule_cls = FedPGVCRule

    def __init__(self, n_ctrl: Union[int, str] = 2, ctrl_modules: Optional[Sequence[str]] = None,
                 mode: str = "hadamard", lam: float = 1.0, stat: str = "mean", tau: float = 1.0,
                 code_eta: Optional[float] = 0.001, loss_clip: Optional[float] = None, loss_fn=None,
                 nan_policy: str = "skip", weighting: str = "uniform", server_rule: str = "delta", **kw):
        super().__init__(**kw)
        mode = _MODE_ALIASES.get(mode, mode)
        if mode not in PGVC_MODES:
            raise ValueError(f"{self.name}: mode must be one of {PGVC_MODES + tuple(_MODE_ALIASES)}, got {mode!r}")
        if stat not in ("mean", "norm"):
            raise ValueError(f"{self.name}: stat must be 'mean' or 'norm', got {stat!r}")
        if nan_policy not in NAN_POLICIES:
            raise ValueError(f"{self.name}: nan_policy must be one of {NAN_POLICIES}, got {nan_policy!r}")
        if weighting not in ("uniform", "samples"):
            raise ValueError(f"{self.name}: weighting must be 'uniform' or 'samples', got {weighting!r}")
        if server_rule not in ("delta", "eq16_literal"):
            raise ValueError(f"{self.name}: server_rule must be 'delta' or 'eq16_literal', got {server_rule!r}")
        if loss_clip is not None and not loss_clip > 0:
            raise ValueError(f"{self.name}: loss_clip must be > 0 or None, got {loss_clip!r}")
        if not (isinstance(n_ctrl, str) and n_ctrl == "all") and not (isinstance(n_ctrl, int) and n_ctrl >= 0):
            raise ValueError(f"{self.name}: n_ctrl must be a non-negative int or 'all', got {n_ctrl!r}")
        self.n_ctrl, self.ctrl_modules = n_ctrl, (list(ctrl_modules) if ctrl_modules is not None else None)
        self.mode, self.lam, self.stat, self.tau = mode, float(lam), stat, float(tau)
        self.code_eta, self.loss_clip = code_eta, loss_clip
        self.loss_fn = loss_fn if loss_fn is not None else _per_sample_ce
        self.nan_policy, self.weighting, self.server_rule = nan_policy, weighting, server_rule

    def ctrl_entries(self, spec):
        if spec is None:
            raise ValueError(f"{self.name}: the controlled layers need a FlatSpec (call setup(spec=...))")
        return controlled_entries(spec, self.n_ctrl, self.ctrl_modules)

    def weights(self, rin: RoundInput) -> torch.Tensor:
        if self.weighting == "uniform":
            return rin.num_examples.new_full((rin.K,), 1.0 / rin.K)
        return rin.sample_weights()

    def _aggregate(self, rin: RoundInput) -> AggResult:
        a = self.weights(rin)
        base = rin.global_flat
        if self.server_rule == "eq16_literal":
            # (1 - eta_g) w + ybar = (2 - eta_g) w + sum a_k U_k   (paper Eq. 16 as printed)
            new = ops.weighted_sum(rin.U, a.to(rin.U.device), base=base * (2.0 - self.server_lr), alpha=1.0)
        else:
            new = ops.weighted_sum(rin.U, a.to(rin.U.device), base=base, alpha=self.server_lr)
        return AggResult(new, {"weights": a.tolist()})


# ---------------------------------------------------------------------------------------------
# FedPVR (SCAFFOLD-like partial control variates) and SCAFFOLD as its n_ctrl="all" case
# ---------------------------------------------------------------------------------------------
class FedPVRRule(ClientRule):
    """Client side of FedPVR: u_ctrl = g_ctrl + (c - c_i); after training, option-II Delta c_i.

    The rest of the model trains with the loop's optimizer ([PVR] uses momentum 0.9 there and
    momentum 0 on the controlled range; a loop wanting that builds two parameter groups)."""

    def __init__(self, aggregator: "FedPVR"):
        super().__init__(aggregator)
        self.ctrl: List[torch.Tensor] = []
        self.corr: List[torch.Tensor] = []

    def begin(self, ctx: ClientContext, model) -> None:
        agg = self.aggregator
        if ctx.spec is None:
            raise ValueError("FedPVR client rule: ctx.spec (the model's FlatSpec) is required")
        entries = agg.ctrl_entries(ctx.spec)
        params = dict(model.named_parameters())
        self.entries = entries
        self.ctrl = [params[e.name] for e in entries]
        c, c_i = ctx.payload.get("c"), ctx.payload.get("c_i")
        d_c = sum(e.numel for e in entries)
        if c is None or c_i is None or c.numel() != d_c or c_i.numel() != d_c:
            raise ValueError(f"FedPVR client rule: payload needs 'c' and 'c_i' of length d_c={d_c}")
        corr = (c - c_i).to(self.ctrl[0].dtype if self.ctrl else c.dtype)
        self.corr, off = [], 0
        for e, p in zip(entries, self.ctrl):   # once per round, not per step
            self.corr.append(corr[off:off + e.numel].view(e.shape).to(p.device))
            off += e.numel
        self.lr_sum = 0.0

    def before_step(self, ctx: ClientContext, model) -> None:
        if self.ctrl:
            torch._foreach_add_([p.grad for p in self.ctrl], self.corr)

    def after_step(self, ctx: ClientContext, model) -> None:
        self.lr_sum += ctx.lr

    def end(self, ctx: ClientContext, model) -> Dict[str, Any]:
        agg = self.aggregator
        ranges, _ = _ctrl_layout(self.entries)
        x = torch.cat([ctx.global_flat[a:b] for a, b in ranges]).to(torch.float64)
        y = torch.cat([p.detach().reshape(-1) for p in self.ctrl]).to(torch.float64)
        c = ctx.payload["c"].to(torch.float64)
        c_i = ctx.payload["c_i"].to(torch.float64)
        steps = ctx.step
        if steps <= 0:
            return {"delta_c": torch.zeros_like(ctx.payload["c"]), "num_steps": 0}
        # tau * eta = sum of the applied learning rates (equals steps * lr for a constant lr)
        delta = (x - y).div_(self.lr_sum).sub_(c)
        return {"delta_c": delta.to(ctx.payload["c"].dtype), "num_steps": steps}


@register("fedpvr", "scaffold_partial")
class FedPVR(Aggregator):
    """FedPVR server: w <- w + eta_g sum_k a_k U_k (uniform a_k by default);
    c <- c + (|S|/N) mean_k delta_c_k on the controlled range; c_i <- c_i + delta_c_i per client id.

    Options: ``n_ctrl`` (default 2; "all" = SCAFFOLD), ``ctrl_modules``, ``weighting``,
    ``num_clients`` (N; or setup(num_clients=N)). Clients send payload ``delta_c`` [d_c]."""

    client_rule_cls = FedPVRRule

    def __init__(self, n_ctrl: Union[int, str] = 2, ctrl_modules: Optional[Sequence[str]] = None,
                 weighting: str = "uniform", num_clients: Optional[int] = None, **kw):
        super().__init__(**kw)
        if weighting not in ("uniform", "samples"):
            raise ValueError(f"{self.name}: weighting must be 'uniform' or 'samples', got {weighting!r}")
        if not (isinstance(n_ctrl, str) and n_ctrl == "all") and not (isinstance(n_ctrl, int) and n_ctrl >= 0):
            raise ValueError(f"{self.name}: n_ctrl must be a non-negative int or 'all', got {n_ctrl!r}")
        self.n_ctrl, self.ctrl_modules, self.weighting = n_ctrl, ctrl_modules, weighting
        self.num_clients = num_clients
        self.c: Optional[torch.Tensor] = None
        self.c_table: Optional[torch.Tensor] = None    # [N, d_c]
        self._ranges: Optional[List[Tuple[int, int]]] = None
        self._d_c: Optional[int] = None

    def setup(self, spec=None, num_clients=None, global_flat=None) -> None:
        n = num_clients if num_clients is not None else self.num_clients
        super().setup(spec, n, global_flat)
        if global_flat is not None:
            self._layout(global_flat)

    def ctrl_entries(self, spec):
        if spec is None:
            if self.n_ctrl == "all":
                return None
            raise ValueError(f"{self.name}: the controlled layers need a FlatSpec (call setup(spec=...))")
        return controlled_entries(spec, self.n_ctrl, self.ctrl_modules)

    def _layout(self, global_flat: torch.Tensor) -> None:
        if self._ranges is None:
            entries = self.ctrl_entries(self.spec)
            if entries is None:
                self._ranges, self._d_c = [(0, global_flat.numel())], global_flat.numel()
            else:
                self._ranges, self._d_c = _ctrl_layout(entries)
        if self.c is None:
            self.c = global_flat.new_zeros(self._d_c)
        if self.c_table is None:
            if self.num_clients is None:
                raise ValueError(f"{self.name}: needs the number of clients N (num_clients= or setup(num_clients=N))")
            self.c_table = global_flat.new_zeros((self.num_clients, self._d_c))

    @property
    def d_c(self) -> Optional[int]:
        return self._d_c

    def client_payload(self, client_id: int) -> Dict[str, Any]:
        if self.c is None:
            raise ValueError(f"{self.name}: call setup(spec, num_clients, global_flat) before client_payload")
        return {"c": self.c, "c_i": self.c_table[int(client_id)]}

    def check_payload(self, payload: Dict[str, Any]) -> Optional[str]:
        r = super().check_payload(payload)
        if r:
            return r
        dc = payload.get("delta_c")
        if dc is None:
            return "payload 'delta_c' (control-variate change) missing"
        if not isinstance(dc, torch.Tensor) or dc.dim() != 1 or (self._d_c is not None and dc.numel() != self._d_c):
            return f"payload 'delta_c' must be a 1-D tensor of length d_c={self._d_c}"
        return None

    def validate(self, global_flat, updates, num_examples, client_ids=None, payloads=None):
        if isinstance(global_flat, torch.Tensor) and global_flat.dim() == 1:
            self._layout(global_flat)
        return super().validate(global_flat, updates, num_examples, client_ids, payloads)

    def _aggregate(self, rin: RoundInput) -> AggResult:
        K = rin.K
        a = rin.num_examples.new_full((K,), 1.0 / K) if self.weighting == "uniform" else rin.sample_weights()
        dev = rin.U.device
        new = ops.weighted_sum(rin.U, a.to(dev), base=rin.global_flat, alpha=self.server_lr)
        dC = torch.stack([p["delta_c"].to(device=dev, dtype=self.c.dtype) for p in rin.payloads])
        frac = K / float(self.num_clients)
        self.c = ops.weighted_sum(dC, dC.new_full((K,), 1.0 / K, dtype=torch.float64), base=self.c, alpha=frac)
        ids = torch.tensor(rin.client_ids, dtype=torch.long, device=dev)
        self.c_table.index_add_(0, ids, dC)
        return AggResult(new, {"weights": a.tolist(), "c_norm": float(self.c.norm())})

    def state_dict(self) -> Dict[str, Any]:
        s = super().state_dict()
        s.update({"c": None if self.c is None else self.c.clone(),
                  "c_table": None if self.c_table is None else self.c_table.clone(),
                  "ranges": self._ranges, "d_c": self._d_c})
        return s

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.c = None if state.get("c") is None else state["c"].clone()
        self.c_table = None if state.get("c_table") is None else state["c_table"].clone()
        self._ranges = None if state.get("ranges") is None else [tuple(r) for r in state["ranges"]]
        self._d_c = state.get("d_c")
