"""FedECADO (Agarwal, Joshi, Pileggi): FL as an equivalent circuit integrated by the server.
Spec: specs/fedecado.md (§2 maths, §9.1 authoritative reference, §9.2 test vectors).

Clients integrate dx_i/dt = -w_i grad f_i(x_i) - I_i with forward Euler (plain SGD on w_i f_i plus
the constant flow I_i, ``FedECADORule``) and report their simulated time T_i = sum of the applied
learning rates. The server interpolates/extrapolates each client's trajectory onto one time axis
(Gamma, §2.4), models each client's response to its flow by the aggregate sensitivity
g_i = 1/dt + w_i hbar_i (§2.5) and integrates the central ODEs with Backward Euler (§2.6), choosing
dt by a local-truncation-error test with backtracking (§2.7). Inactive clients keep contributing
their stored ("frozen") flows (§2.10). Units (§2.11): ``grad_weight="normalized"`` uses w_i = N p_i
(default), ``"paper"`` uses w_i = p_i (the paper's literal form, an exact reparametrisation).

The per-coordinate BE system is a (K+1) x (K+1) arrowhead matrix shared by all d coordinates; it is
solved by ``_solve_be_system`` (closed form, or LU through ops.lu_factor/ops.lu_solve when present).
For fp32/fp64 CPU tensors and the inf-norm LTE, each whole BE attempt (RHS, solve, LTE maxima) is the
native fused op ``ops.fedecado_be_step`` (solver "auto" -> "fused"), writing into two reused buffers.
"""
from __future__ import annotations

import inspect
import logging
import math
import statistics
from dataclasses import dataclass, fields, replace
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from .. import ops
from .base import AggResult, Aggregator, ClientContext, ClientRule, RoundInput, register
from .parts import check_choice

log = logging.getLogger("fedkernels")

INACTIVE = ("frozen", "exclude")
HESSIANS = ("hutchinson", "identity", "global", "none")


# ---------------------------------------------------------------------------------------------
# the linear solve
# ---------------------------------------------------------------------------------------------
def _native_ok(t: torch.Tensor) -> bool:
    """The native linear-algebra ops take float32/float64 CPU tensors (elsewhere: the torch path)."""
    return t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64)


def _solve_be_system(a: torch.Tensor, dt: float, c: float, b0: torch.Tensor, r: torch.Tensor,
                     solver: str = "auto"):
    """Solves, for every coordinate j, the arrowhead system (spec §2.6)

        x_j - dt * sum_i I_ij = b0_j ;    c * x_j + a_i * I_ij = r_ij   (i = 1..K)

    a: [K] float64 (a_i >= 1); b0: [d]; r: [K, d] (a scratch buffer: may be overwritten).
    Returns (x [d], I [K, d]).

    ``solver``:
    * "auto": the native closed form ``ops.arrowhead_solve`` (one pass) for float32/float64 CPU
      tensors, else the torch closed form below.
    * "closed_form": the torch closed form (Schur complement on the x row = LU without pivoting with
      x ordered last; a_i >= 1 and the Schur denominator >= 1, so it never breaks down).
    * "lu": dense LU of the (K+1) x (K+1) matrix ordered [I_1..I_K, x] (no fill-in), factored once
      and applied to all d right-hand sides: ``ops.lu_factor`` / ``ops.lu_solve`` on the CPU,
      ``torch.linalg.lu_factor`` / ``lu_solve`` elsewhere. Same result as the closed form (to
      rounding); it is the general path a non-arrowhead sensitivity model would need.
    """
    K = r.size(0)
    if solver == "auto":
        if _native_ok(r):
            return ops.arrowhead_solve(a.to(torch.float64), -dt, c, 1.0, b0.contiguous(), r)
        solver = "closed_form"
    if solver != "lu":
        inv_a = (1.0 / a).to(torch.float64)
        acc = ops.weighted_sum(r, inv_a)                   # sum_i r_i / a_i
        den = 1.0 + dt * c * float(inv_a.sum())
        x = (b0 + dt * acc) / den
        # I_i = (r_i - c x) / a_i, written into r
        I = r.sub_(x.unsqueeze(0), alpha=c).mul_(inv_a.to(r.dtype).to(r.device).unsqueeze(1))
        return x, I
    M = torch.zeros(K + 1, K + 1, dtype=torch.float64)
    M[torch.arange(K), torch.arange(K)] = a.to(torch.float64)
    M[:K, K] = c
    M[K, :K] = -dt
    M[K, K] = 1.0
    R = torch.cat([r, b0.unsqueeze(0)], 0)
    if r.device.type == "cpu":
        LU, piv = ops.lu_factor(M)
        Z = ops.lu_solve(LU, piv, R)
    else:
        LU, piv = torch.linalg.lu_factor(M.to(dtype=r.dtype, device=r.device))
        Z = torch.linalg.lu_solve(LU, piv, R)
    return Z[K].clone(), Z[:K].clone()


# ---------------------------------------------------------------------------------------------
# interpolation, one BE attempt, one central round (torch versions of spec §9.1)
# ---------------------------------------------------------------------------------------------
def theta(T: Sequence[float], tau: float, extrap: str = "linear", max_ratio: float = math.inf) -> torch.Tensor:
    """[K] float64 interpolation factors tau / T_i (hold: min(., 1); capped at max_ratio)."""
    th = tau / torch.as_tensor(T, dtype=torch.float64)
    if extrap == "hold":
        th = th.clamp(max=1.0)
    if max_ratio != math.inf:
        th = th.clamp(max=max_ratio)
    return th


def interp(xc0: torch.Tensor, xend: torch.Tensor, T, tau: float, mode: str = "linear") -> torch.Tensor:
    """Gamma_i(tau) = x_c0 + (tau / T_i)(x_end_i - x_c0) (spec §2.4): [K, d]."""
    th = theta(T, tau, mode).to(xend.dtype).to(xend.device)
    return xc0.unsqueeze(0) + th.unsqueeze(1) * (xend - xc0.unsqueeze(0))


def _norm(v: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "inf":
        return ops.amax_d(v.abs())
    return ops.mean_d(v.pow(2)).sqrt()


def _fused_ok(xc, Icur, xc0, U, Ik, S_off, lte_norm: str) -> bool:
    """The native fused attempt (ops.fedecado_be_step) applies: inf-norm LTE and fp32/fp64 CPU
    tensors of one dtype (the torch composition in be_step serves every other case)."""
    if lte_norm != "inf":
        return False
    if U.dtype not in (torch.float32, torch.float64) or U.device.type != "cpu":
        return False
    return all(t.dtype == U.dtype and t.device == U.device for t in (xc, Icur, xc0, Ik) + (() if S_off is None else (S_off,)))


def be_step(xc, Icur, xc0, U, Ik, th_new, th_old, inv_g, dt: float, L: float, S_off=None,
            lte_norm: str = "inf", solver: str = "auto", out=None):
    """One Backward-Euler attempt (spec §2.6/§2.7, reference ``be_step``).

    U = x_end - x_c0 [K, d] (the client updates); th_new/th_old [K] interpolation factors at
    tau + dt and tau; inv_g [K] = 1/g_i (0 = ECADO limit). Returns (x_c', I', LTE_c, LTE_I).

    solver="fused": the native fused op ops.fedecado_be_step (one pass over d, no K x d
    temporaries; needs lte_norm="inf" and fp32/fp64 CPU tensors of one dtype, else ValueError);
    out=(xc_buf [d], I_buf [K, d]) then receives x_c', I' (buffers sharing no storage with the
    inputs). Other solvers: the torch composition below with _solve_be_system's switch (out unused).
    central_round with solver="auto" picks "fused" whenever it applies."""
    if solver == "fused":
        if not _fused_ok(xc, Icur, xc0, U, Ik, S_off, lte_norm):
            raise ValueError("be_step: solver='fused' needs lte_norm='inf', the native op and float32/float64 CPU "
                             "tensors of one dtype")
        xn, In, lte = ops.fedecado_be_step(xc, Icur, xc0, U, Ik, S_off, th_new, th_old, inv_g, float(dt), float(L),
                                           out=out)
        lc, li = ops.amax_d(lte.unsqueeze(1)).tolist()   # max across ranks in sharded mode
        return xn, In, lc, li
    c = dt / L
    dev, dt_ = U.device, U.dtype
    thn = th_new.to(dt_).to(dev).unsqueeze(1)
    ig = inv_g.to(torch.float64)
    a = 1.0 + c * ig                                          # a_i = 1 + dt / (L g_i)
    # r_i = I_i + c (Gamma_i(tau+dt) + Ik_i / g_i),  Gamma = x_c0 + th U
    r = torch.addcmul(xc0.unsqueeze(0), thn, U)
    r.add_(Ik * ig.to(dt_).to(dev).unsqueeze(1)).mul_(c).add_(Icur)
    b0 = xc if S_off is None else xc + dt * S_off
    xn, In = _solve_be_system(a, dt, c, b0, r, solver)
    D = In - Icur
    lte_c = 0.5 * dt * float(_norm(D.sum(0), lte_norm))
    # (x~_i' - x_c') - (x~_i - x_c) = (th'_i - th_i) U_i - (I_i' - I_i)/g_i - (x_c' - x_c)
    e = torch.mul(U, (th_new - th_old).to(dt_).to(dev).unsqueeze(1))
    e.sub_(D.mul_(ig.to(dt_).to(dev).unsqueeze(1))).sub_((xn - xc).unsqueeze(0))
    lte_I = 0.5 * dt / L * float(_norm(e, lte_norm).max())
    return xn, In, lte_c, lte_I


def central_round(xc0, I_act, U, T, w, hbar, L: float, delta: float, dt_init: float, S_off=None,
                  delta_I: Optional[float] = None, beta: float = 0.5, growth: float = 1.0,
                  max_backtracks: int = 30, max_steps: int = 1000, extrap: str = "linear",
                  max_extrap_ratio: float = math.inf, lte_norm: str = "inf", sensitivity: bool = True,
                  dt_min_frac: float = 1e-9, solver: str = "auto", trace: Optional[list] = None) -> Dict[str, Any]:
    """The server's integration over one round window [0, T_max] (spec §2.8 step 5-6, §9.1).

    xc0 [d]; I_act [K, d] the flows of the active clients at the round start (= I^k); U [K, d];
    T, w, hbar: K floats. Returns dict(xc, I, dt, steps, rejects, truncated, lte_c, lte_I).
    solver="auto" uses the native fused attempt (be_step solver="fused") when it applies."""
    Tl = [float(t) for t in T]
    Tmax = max(Tl)
    wv = torch.as_tensor(w, dtype=torch.float64)
    hv = torch.as_tensor(hbar, dtype=torch.float64).clamp(min=0.0)
    dI = delta if delta_I is None else delta_I
    tl, steps, rejects, truncated = 0.0, 0, 0, False
    xc, Ik, Icur = xc0, I_act, I_act
    dt = min(dt_init * growth, Tmax)
    dt_min = dt_min_frac * Tmax
    lte_max = [0.0, 0.0]

    def inv_g(dtt):
        if not sensitivity:
            return torch.zeros_like(wv)
        return 1.0 / (1.0 / dtt + wv * hv)

    # Native fused attempts write into two preallocated (x_c, I) buffer pairs: an attempt writes the
    # pair that is not the current state, a rejection retries into the same pair, an acceptance
    # makes it current (swap). Nothing K x d is allocated per attempt.
    fused = solver in ("auto", "fused") and _fused_ok(xc0, I_act, xc0, U, I_act, S_off, lte_norm)
    if fused:
        solver = "fused"
    bufs: List[Any] = [None, None]
    nxt = 0

    def attempt(dtt):
        th_n = theta(Tl, tl + dtt, extrap, max_extrap_ratio)
        th_o = theta(Tl, tl, extrap, max_extrap_ratio)
        out = None
        if fused:
            if bufs[nxt] is None:
                bufs[nxt] = (torch.empty_like(xc0, memory_format=torch.contiguous_format),
                             torch.empty(U.shape, dtype=U.dtype, device=U.device))
            out = bufs[nxt]
        return be_step(xc, Icur, xc0, U, Ik, th_n, th_o, inv_g(dtt), dtt, L, S_off, lte_norm, solver, out=out)

    while Tmax - tl > 1e-12 * Tmax:
        if steps >= max_steps:        # safety: finish the window in one forced step
            dtt = Tmax - tl
            xc, Icur, lc, li = attempt(dtt)
            nxt ^= 1
            tl, steps, truncated = Tmax, steps + 1, True
            if trace is not None:
                trace.append((tl - dtt, dtt, lc, li, "forced"))
            break
        dtt = min(dt, Tmax - tl)
        clipped = dtt < dt
        for nb in range(max_backtracks + 1):
            xn, In, lc, li = attempt(dtt)
            ok = lc <= delta and li <= dI
            if trace is not None:
                trace.append((tl, dtt, lc, li, "accept" if ok else "reject"))
            if ok or nb == max_backtracks or dtt * beta < dt_min:
                if not ok:
                    log.warning("fedecado: LTE test not met after %d backtracks (dt=%g); step accepted", nb, dtt)
                break
            dtt *= beta
            clipped = False
            rejects += 1
        lte_max = [max(lte_max[0], lc), max(lte_max[1], li)]
        tl += dtt
        xc, Icur = xn, In
        nxt ^= 1
        steps += 1
        if not clipped:
            dt = dtt
    return {"xc": xc, "I": Icur, "dt": dt, "steps": steps, "rejects": rejects, "truncated": truncated,
            "lte_c": lte_max[0], "lte_I": lte_max[1], "T_max": Tmax}


# ---------------------------------------------------------------------------------------------
# client side
# ---------------------------------------------------------------------------------------------
def hutchinson_hbar(loss: torch.Tensor, params: List[torch.Tensor], n_probes: int = 4,
                    generator: Optional[torch.Generator] = None) -> float:
    """Scalar Hessian model tr(H)/d by Hutchinson with Rademacher probes (spec §2.5), clamped >= 0."""
    grads = torch.autograd.grad(loss, params, create_graph=True)
    d = sum(p.numel() for p in params)
    tot = 0.0
    for _ in range(n_probes):
        vs = [(torch.randint(0, 2, p.shape, generator=generator, dtype=torch.int64) * 2 - 1).to(p.dtype).to(p.device)
              for p in params]
        hv = torch.autograd.grad(grads, params, grad_outputs=vs, retain_graph=True)
        tot += float(sum((h * v).sum() for h, v in zip(hv, vs)))
    return max(tot / (n_probes * d), 0.0)


class FedECADORule(ClientRule):
    """Client side (spec §2.3): grad <- w_i grad + I_i before each plain-SGD step; T_i = sum of the
    applied learning rates (``time_unit="epoch"``: T_i = lr * ctx.extras["epochs"]). On its first
    participation (payload ``need_hbar``) the client estimates hbar_i by Hutchinson on its first
    ``hutchinson_batches`` minibatches at the received model and returns it in the payload."""

    def __init__(self, aggregator: "FedECADO"):
        super().__init__(aggregator)

    def begin(self, ctx: ClientContext, model) -> None:
        if ctx.spec is None:
            raise ValueError("FedECADO client rule: ctx.spec (the model's FlatSpec) is required")
        params = dict(model.named_parameters())
        entries = [e for e in ctx.spec.entries if not e.is_buffer]
        self.params = [params[e.name] for e in entries]
        I = ctx.payload.get("I")
        self.flows = None if I is None else [I[e.slice].view(e.shape).to(p.dtype) for e, p in zip(entries, self.params)]
        self.w = float(ctx.payload.get("w", 1.0))
        self.T = 0.0
        self.need_hbar = bool(ctx.payload.get("need_hbar", False))
        self.hbar_est: List[float] = []
        self.non_faithful = False
        self.gen = torch.Generator().manual_seed(1_000_003 * int(ctx.client_id) + 7)

    def loss_term(self, ctx: ClientContext, model) -> Optional[torch.Tensor]:
        agg = self.aggregator
        if self.need_hbar and len(self.hbar_est) < agg.hutchinson_batches and ctx.batch is not None:
            x, y = ctx.batch
            loss = agg.loss_fn(model(x), y)
            self.hbar_est.append(hutchinson_hbar(loss, self.params, agg.hutchinson_probes, self.gen))
        return None

    def before_step(self, ctx: ClientContext, model) -> None:
        grads = [p.grad for p in self.params]
        if self.w != 1.0:
            torch._foreach_mul_(grads, self.w)
        if self.flows is not None:
            torch._foreach_add_(grads, self.flows)

    def step(self, ctx: ClientContext, model, optimizer) -> bool:
        if not self.non_faithful and optimizer is not None:
            for gr in optimizer.param_groups:
                if gr.get("momentum", 0) or gr.get("weight_decay", 0) or "betas" in gr:
                    self.non_faithful = True
        return False

    def after_step(self, ctx: ClientContext, model) -> None:
        self.T += ctx.lr

    def end(self, ctx: ClientContext, model) -> Dict[str, Any]:
        T = self.T
        if self.aggregator.ablations.time_unit == "epoch":
            if "epochs" not in ctx.extras:
                raise ValueError("FedECADO time_unit='epoch' needs ctx.extras['epochs']")
            T = ctx.lr * float(ctx.extras["epochs"])
        out: Dict[str, Any] = {"T": T}
        if self.hbar_est:
            out["hbar"] = sum(self.hbar_est) / len(self.hbar_est)
        if self.non_faithful:
            out["non_faithful"] = True
        return out


# ---------------------------------------------------------------------------------------------
# server
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stepping:
    """The server's time stepping (spec §2.7, §3): inductance ``L`` (None: c_L * T_bar^2 with T_bar
    from ``T_bar`` or round 1's T_max, re-set once to the median of the first 5 rounds), LTE
    tolerances ``delta`` / ``delta_I`` (None = delta; math.inf = fixed steps) measured in ``lte_norm``
    (inf | rms), first step ``dt0`` (None: T_max), backtracking factor ``beta``, step ``growth`` per
    round, and the caps ``max_backtracks`` / ``max_steps``."""
    L: Optional[float] = None
    c_L: float = 2.0
    T_bar: Optional[float] = None
    delta: float = 1e-2
    delta_I: Optional[float] = None
    dt0: Optional[float] = None
    beta: float = 0.5
    growth: float = 1.0
    max_backtracks: int = 30
    max_steps: int = 1000
    lte_norm: str = "inf"

    def __post_init__(self):
        n = "fedecado"
        if self.L is not None and not self.L > 0:
            raise ValueError(f"{n}: L must be > 0, got {self.L!r}")
        if not self.c_L > 0:
            raise ValueError(f"{n}: c_L must be > 0, got {self.c_L!r}")
        if not self.delta > 0 or (self.delta_I is not None and not self.delta_I > 0):
            raise ValueError(f"{n}: delta and delta_I must be > 0 (math.inf = fixed step), got {self.delta!r}, {self.delta_I!r}")
        if not 0 < self.beta < 1:
            raise ValueError(f"{n}: beta must lie in (0, 1), got {self.beta!r}")
        if not self.growth >= 1.0:
            raise ValueError(f"{n}: growth must be >= 1, got {self.growth!r}")
        if self.dt0 is not None and not self.dt0 > 0:
            raise ValueError(f"{n}: dt0 must be > 0, got {self.dt0!r}")
        if int(self.max_backtracks) < 0 or int(self.max_steps) < 1:
            raise ValueError(f"{n}: max_backtracks >= 0 and max_steps >= 1 required")
        check_choice(n, "lte_norm", self.lte_norm, ("inf", "rms"))


@dataclass(frozen=True)
class Ablations:
    """Where the paper is ambiguous or an experiment switches a part off (spec §2.4, §2.5, §2.10,
    §2.11, §8). Defaults are the spec's [OURS] choices; ``Ablations.PAPER_LITERAL`` is the paper's
    literal form: gradient weights w_i = p_i (``grad_weight="paper"``; an exact reparametrisation of
    the default N p_i) and client time T_i = lr_i * epochs (``time_unit="epoch"``).

    ``extrap`` linear | hold, ``max_extrap_ratio`` (inf), ``inactive`` frozen | exclude (flows of
    non-participants), ``grad_weight`` normalized | paper, ``hessian`` hutchinson | identity | global |
    none (none = ECADO limit, 1/g = 0), ``time_unit`` lr_sum | epoch, ``sync`` (True: "no multi-rate",
    every active client's T_i is taken as the round's T_max)."""
    extrap: str = "linear"
    max_extrap_ratio: float = math.inf
    inactive: str = "frozen"
    grad_weight: str = "normalized"
    hessian: str = "hutchinson"
    time_unit: str = "lr_sum"
    sync: bool = False

    def __post_init__(self):
        n = "fedecado"
        for opt, allowed in (("extrap", ("linear", "hold")), ("inactive", INACTIVE),
                             ("grad_weight", ("normalized", "paper")), ("hessian", HESSIANS),
                             ("time_unit", ("lr_sum", "epoch"))):
            check_choice(n, opt, getattr(self, opt), allowed)
        if not self.max_extrap_ratio >= 1.0:
            raise ValueError(f"{n}: max_extrap_ratio must be >= 1, got {self.max_extrap_ratio!r}")
        if not isinstance(self.sync, bool):
            raise ValueError(f"{n}: sync must be True or False, got {self.sync!r}")


Ablations.PAPER_LITERAL = Ablations(grad_weight="paper", time_unit="epoch")
SOLVERS = ("auto", "fused", "closed_form", "lu")
_STEP_KEYS = tuple(f.name for f in fields(Stepping))
_ABL_KEYS = tuple(f.name for f in fields(Ablations))


@register("fedecado")
class FedECADO(Aggregator):
    """FedECADO server (spec §2.8). Clients send payload ``T`` (simulated time, > 0) and, once,
    ``hbar`` (their Hessian scalar). State (§2.9): flows I [N, d], S_all = sum_j I_j (float64),
    central time t, carried dt, hbar per client, L.

    Options, grouped: ``stepping`` (:class:`Stepping`), ``ablations`` (:class:`Ablations`;
    ``Ablations.PAPER_LITERAL`` for the paper's literal form), ``solver`` (the BE linear solve:
    "auto" = the native fused attempt ``ops.fedecado_be_step`` when it applies, else the native
    closed form; "fused"; "closed_form"; "lu" = dense LU through ``ops.lu_factor``/``ops.lu_solve``).
    Every field of the two groups may also be given flat (``build("fedecado", delta=0.1,
    extrap="hold")``, as configs do); a flat option overrides the group's field. The federation:
    ``hbar`` (float or N floats: fixed values), ``weights`` (N explicit w_i), ``data_sizes`` (N sizes
    n_i -> p_i), ``num_clients``; client Hutchinson estimate: ``loss_fn``, ``hutchinson_probes`` 4,
    ``hutchinson_batches`` 2."""

    client_rule_cls = FedECADORule
    state_attrs = ("I", "S_all", "t", "dt_prev", "hbar_tab", "hbar_known", "w", "L", "Tmax_hist", "L_reset_done")

    def __init__(self, stepping: Optional[Stepping] = None, ablations: Optional[Ablations] = None,
                 solver: str = "auto", hbar=None, weights: Optional[Sequence[float]] = None,
                 data_sizes: Optional[Sequence[float]] = None, num_clients: Optional[int] = None, loss_fn=None,
                 hutchinson_probes: int = 4, hutchinson_batches: int = 2, **options):
        flat_step = {k: options.pop(k) for k in _STEP_KEYS if k in options}
        flat_abl = {k: options.pop(k) for k in _ABL_KEYS if k in options}
        super().__init__(**options)
        n = self.name
        if self.server_lr != 1.0:
            raise ValueError(f"{n}: server_lr is not used by FedECADO (the BE integration sets the step); got {self.server_lr}")
        self.stepping = replace(stepping or Stepping(), **flat_step)
        self.ablations = replace(ablations or Ablations(), **flat_abl)
        check_choice(n, "solver", solver, SOLVERS)
        self.solver = solver
        self.loss_fn = loss_fn if loss_fn is not None else (lambda out, y: F.cross_entropy(out, y))
        self.hutchinson_probes, self.hutchinson_batches = int(hutchinson_probes), int(hutchinson_batches)
        self._hbar_opt, self._weights_opt, self._sizes_opt = hbar, weights, data_sizes
        self.num_clients = num_clients
        # state
        self.I: Optional[torch.Tensor] = None          # [N, d]
        self.S_all: Optional[torch.Tensor] = None      # [d] float64
        self.t = 0.0
        self.dt_prev: Optional[float] = None
        self.hbar_tab: Optional[torch.Tensor] = None   # [N] float64
        self.hbar_known: Optional[torch.Tensor] = None  # [N] bool
        self.w: Optional[torch.Tensor] = None          # [N] float64
        self.Tmax_hist: List[float] = []
        self.L = self.stepping.L
        self.L_reset_done = self.stepping.L is not None or self.stepping.T_bar is not None

    # ---- setup / tables -------------------------------------------------------------------------
    def setup(self, spec=None, num_clients=None, global_flat=None) -> None:
        super().setup(spec, num_clients if num_clients is not None else self.num_clients, global_flat)
        self._tables()
        if global_flat is not None:
            self._flows(global_flat)

    def set_data_sizes(self, sizes: Sequence[float]) -> None:
        """n_i of all N clients (sets p_i = n_i / sum n and the gradient weights w_i)."""
        self._sizes_opt = list(sizes)
        self.w = None
        self._tables()

    def _tables(self) -> None:
        N = self.num_clients
        if N is None:
            for o in (self._weights_opt, self._sizes_opt):
                if o is not None:
                    N = self.num_clients = len(o)
            if isinstance(self._hbar_opt, (list, tuple)):
                N = self.num_clients = len(self._hbar_opt)
        if N is None:
            return
        if self.w is None:
            if self._weights_opt is not None:
                w = torch.as_tensor(self._weights_opt, dtype=torch.float64)
            elif self._sizes_opt is not None:
                n = torch.as_tensor(self._sizes_opt, dtype=torch.float64)
                if n.numel() != N or bool((n < 0).any()) or not float(n.sum()) > 0:
                    raise ValueError(f"{self.name}: data_sizes must be N={N} non-negative numbers with a positive sum")
                w = n / n.sum() * (N if self.ablations.grad_weight == "normalized" else 1.0)
            else:
                w = torch.full((N,), 1.0 if self.ablations.grad_weight == "normalized" else 1.0 / N, dtype=torch.float64)
            if w.numel() != N or not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
                raise ValueError(f"{self.name}: weights must be N={N} finite non-negative numbers")
            self.w = w
        if self.hbar_tab is None:
            h = self._hbar_opt
            if h is not None:
                tab = torch.as_tensor(h, dtype=torch.float64).expand(N).clone() if not isinstance(h, (list, tuple)) \
                    else torch.as_tensor(h, dtype=torch.float64)
                if tab.numel() != N or not bool(torch.isfinite(tab).all()):
                    raise ValueError(f"{self.name}: hbar must be a finite float or N={N} finite floats")
                self.hbar_tab, self.hbar_known = tab.clamp(min=0.0), torch.ones(N, dtype=torch.bool)
            else:
                self.hbar_tab = torch.ones(N, dtype=torch.float64)
                self.hbar_known = torch.full((N,), self.ablations.hessian in ("identity", "none"), dtype=torch.bool)

    def _flows(self, global_flat: torch.Tensor) -> None:
        if self.num_clients is None:
            raise ValueError(f"{self.name}: needs the number of clients N (num_clients=, weights=, data_sizes= "
                             f"or setup(num_clients=N))")
        if self.I is None:
            self.I = global_flat.new_zeros((self.num_clients, global_flat.numel()))
            self.S_all = torch.zeros(global_flat.numel(), dtype=torch.float64, device=global_flat.device)

    def client_payload(self, client_id: int) -> Dict[str, Any]:
        self._tables()
        cid = int(client_id)
        return {"I": None if self.I is None else self.I[cid], "w": float(self.w[cid]),
                "need_hbar": bool(self.ablations.hessian in ("hutchinson", "global") and not self.hbar_known[cid])}

    # ---- validation -------------------------------------------------------------------------------
    def check_payload(self, payload: Dict[str, Any]) -> Optional[str]:
        T = payload.get("T")
        if T is None:
            return self.missing_payload("T", "the client's simulated time, the sum of its applied learning rates")
        try:
            T = float(T)
        except (TypeError, ValueError):
            return f"payload 'T' must be a number, got {type(T).__name__}"
        if not (math.isfinite(T) and T > 0):
            return f"payload 'T' must be finite and > 0, got {T}"
        h = payload.get("hbar")
        if h is not None and not math.isfinite(float(h)):
            return f"payload 'hbar' must be finite, got {h}"
        return super().check_payload({k: v for k, v in payload.items() if k != "I"})

    def validate(self, global_flat, updates, num_examples, client_ids=None, payloads=None):
        self._tables()
        if isinstance(global_flat, torch.Tensor) and global_flat.dim() == 1:
            self._flows(global_flat)
        return super().validate(global_flat, updates, num_examples, client_ids, payloads)

    # ---- the round ------------------------------------------------------------------------------------
    def _hbar_for(self, rin: RoundInput) -> torch.Tensor:
        for cid, p in zip(rin.client_ids, rin.payloads):
            if p.get("hbar") is not None and self._hbar_opt is None:
                self.hbar_tab[cid] = max(float(p["hbar"]), 0.0)
                self.hbar_known[cid] = True
        ids = torch.tensor(rin.client_ids, dtype=torch.long)
        if self.ablations.hessian == "global":
            known = self.hbar_tab[self.hbar_known]
            return torch.full((rin.K,), float(known.mean()) if known.numel() else 1.0, dtype=torch.float64)
        return self.hbar_tab[ids].clone()

    def _L_for(self, Tmax: float) -> float:
        if self.L is None:
            Tb = self.stepping.T_bar if self.stepping.T_bar is not None else Tmax
            self.L = self.stepping.c_L * float(Tb) ** 2
        elif not self.L_reset_done and len(self.Tmax_hist) >= 5:
            self.L = self.stepping.c_L * statistics.median(self.Tmax_hist[:5]) ** 2
            self.L_reset_done = True
        return self.L

    def _aggregate(self, rin: RoundInput) -> AggResult:
        dev = rin.U.device
        ids = torch.tensor(rin.client_ids, dtype=torch.long, device=dev)
        T = [float(p["T"]) for p in rin.payloads]
        Tmax = max(T)
        ratio = Tmax / min(T)
        if self.ablations.sync:       # no multi-rate: every client is taken to end at T_max
            T = [Tmax] * len(T)
        hbar = self._hbar_for(rin)
        w = self.w[torch.tensor(rin.client_ids, dtype=torch.long)]
        L = self._L_for(Tmax)
        Ik = self.I.index_select(0, ids)                           # K x d gather
        S_off = None
        if self.ablations.inactive == "frozen":
            S_off = (self.S_all - Ik.sum(0, dtype=torch.float64)).to(rin.U.dtype)
        # dt: the carried step; in the first round dt0 (default T_max)
        dt_init = self.dt_prev if self.dt_prev is not None else (self.stepping.dt0 if self.stepping.dt0 is not None else Tmax)
        res = central_round(rin.global_flat, Ik, rin.U, T, w, hbar, L, self.stepping.delta, dt_init, S_off,
                            delta_I=self.stepping.delta_I, beta=self.stepping.beta,
                            growth=self.stepping.growth if self.dt_prev is not None else 1.0,
                            max_backtracks=self.stepping.max_backtracks, max_steps=self.stepping.max_steps, extrap=self.ablations.extrap,
                            max_extrap_ratio=self.ablations.max_extrap_ratio, lte_norm=self.stepping.lte_norm,
                            sensitivity=self.ablations.hessian != "none", solver=self.solver)
        info = {"steps": res["steps"], "rejects": res["rejects"], "dt": res["dt"], "truncated": res["truncated"],
                "L": L, "T_max": Tmax, "max_extrap_ratio": ratio, "lte_c": res["lte_c"],
                "lte_I": res["lte_I"]}
        xc, Inew = res["xc"], res["I"]
        if not (bool(ops.finite_rows(xc.unsqueeze(0)).all()) and bool(ops.finite_rows(Inew).all())):  # no K x d temp
            log.warning("%s: central integration produced NaN/Inf; round rolled back", self.name)
            info.update(failed=True)
            return AggResult(rin.global_flat.clone(), info)
        # commit (spec §2.8 step 7)
        self.S_all += Inew.sum(0, dtype=torch.float64) - Ik.sum(0, dtype=torch.float64)   # no K x d temporary
        self.I.index_copy_(0, ids, Inew)
        self.t += Tmax
        self.dt_prev = res["dt"]
        self.Tmax_hist.append(Tmax)
        return AggResult(xc, info)


def _flat_signature() -> inspect.Signature:
    """FedECADO's signature with the groups' fields as keyword options (what configs may pass flat),
    so tools that read constructor signatures (config checks, help) see every option."""
    sig = inspect.signature(FedECADO.__init__)
    ps = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    ps += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default)
           for cls in (Stepping, Ablations) for f in fields(cls)]
    ps += [p for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD]
    return sig.replace(parameters=ps)


FedECADO.__init__.__signature__ = _flat_signature()
