"""FedECADO (Agarwal, Joshi, Pileggi): FL as an equivalent circuit integrated by the server.
Spec: docs/specs/fedecado.md (§2 maths, §9.1 authoritative reference, §9.2 test vectors).

Clients integrate dx_i/dt = -w_i grad f_i(x_i) - I_i with forward Euler (plain SGD on w_i f_i plus
the constant flow I_i, ``FedECADORule``) and report their simulated time T_i = sum of the applied
learning rates. The server interpolates/extrapolates each client's trajectory onto one time axis
(Gamma, §2.4), models each client's response to its flow by the aggregate sensitivity
g_i = 1/dt + w_i hbar_i (§2.5) and integrates the central ODEs with Backward Euler (§2.6), choosing
dt by a local-truncation-error test with backtracking (§2.7). Inactive clients keep contributing
their stored ("frozen") flows (§2.10). Units (§2.11): ``grad_weight="normalized"`` uses w_i = N p_i
(default), ``"paper"`` uses w_i = p_i (the paper's literal form, an exact reparametrisation).

The integrator (the arrowhead BE system, its solvers, the LTE control) is ``solver.py``;
the options, the federation's tables, payload checks and the Hutchinson estimate ``options.py`` (both beside this file).
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import replace
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from ... import ops
from ..base import AggResult, Aggregator, BatchedRule, ClientContext, ClientRule, RoundInput, id_tensor, register
from ..parts import check_choice
from .options import (
    SOLVERS,
    Ablations,
    FederationTables,
    Stepping,
    flat_signature,
    flow_sum,
    hutchinson_hbar,
    integrator_options,
    split_flat,
)
from .solver import central_round

log = logging.getLogger("fedkernels")


# ---------------------------------------------------------------------------------------------
# client side
# ---------------------------------------------------------------------------------------------
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


class FedECADOBatched(BatchedRule):
    """FedECADORule, batched: g <- w_i g + I_i; T_i = the sum of the applied learning rates."""

    @classmethod
    def reason(cls, rule, fixed_steps):
        return rule.aggregator.local_training_conflict(1 if fixed_steps else None)  # (refused up front too)

    def client_reason(self, payload):
        if payload.get("need_hbar"):
            return "FedECADO: the client's first participation estimates its Hessian scalar (Hutchinson)"
        return None

    def begin(self, ch):
        W = ch.W
        w = [float(p.get("w", 1.0)) for p in ch.payloads]
        self.w = None if all(v == 1.0 for v in w) else torch.tensor(w, dtype=W.dtype, device=W.device).unsqueeze(1)
        flows = [p.get("I") for p in ch.payloads]
        self.flows = None
        if any(f is not None for f in flows):
            self.flows = torch.stack(
                [f if f is not None else torch.zeros(W.size(1), dtype=W.dtype, device=W.device) for f in flows]
            ).to(device=W.device, dtype=W.dtype)

    def before_step(self, ch, G, rho, ce, m, active):
        if self.w is not None:
            G.mul_(self.w)
        if self.flows is not None:
            G.add_(self.flows)

    def end(self, ch):
        agg = self.agg
        nf = bool(ch.momentum or ch.weight_decay)
        lrs = ch.lr.tolist()
        out = []
        for i, k in enumerate(ch.steps):
            if agg.ablations.time_unit == "epoch":
                T = lrs[i] * float(ch.epochs[i])
            else:
                T = lrs[i] * k
            p: Dict[str, Any] = {"T": T}
            if nf:
                p["non_faithful"] = True
            out.append(p)
        return out


FedECADORule.batched_form = FedECADOBatched


# ---------------------------------------------------------------------------------------------
# server
# ---------------------------------------------------------------------------------------------
@register("fedecado")
class FedECADO(FederationTables, Aggregator):
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
    no_chunked_source = (
        "its backward-Euler integration reads U and the K x d flow table once per attempted step and "
        "accepts or rejects each step on a norm over all d coordinates"
    )
    reads_beyond_weighted_sum = "each update row in its backward-Euler solve (ops.fedecado_be_step)"
    dp_verdict = "its per-client tables and the central ODE solve read the un-noised updates directly"

    option_ranges = {"hutchinson_probes": ">= 1", "hutchinson_batches": ">= 1", "num_clients": ">= 1", "T_bar": "> 0"}

    def __init__(
        self,
        stepping: Optional[Stepping] = None,
        ablations: Optional[Ablations] = None,
        solver: str = "auto",
        hbar=None,
        weights: Optional[Sequence[float]] = None,
        data_sizes: Optional[Sequence[float]] = None,
        num_clients: Optional[int] = None,
        loss_fn=None,
        hutchinson_probes: int = 4,
        hutchinson_batches: int = 2,
        **options,
    ):
        flat_step, flat_abl = split_flat(options)
        super().__init__(**options)
        n = self.name
        if self.server_lr != 1.0:
            raise ValueError(
                f"{n}: server_lr is not used by FedECADO (the BE integration sets the step); got {self.server_lr}"
            )
        self.stepping = replace(stepping or Stepping(), **flat_step)
        self.ablations = replace(ablations or Ablations(), **flat_abl)
        check_choice(n, "solver", solver, SOLVERS)
        self.solver = solver
        self.loss_fn = loss_fn if loss_fn is not None else F.cross_entropy  # (a function: picklable, for workers=N)
        self.hutchinson_probes, self.hutchinson_batches = int(hutchinson_probes), int(hutchinson_batches)
        self._hbar_opt, self._weights_opt, self._sizes_opt = hbar, weights, data_sizes
        self.num_clients = num_clients
        # state (allocated by FederationTables, options.py)
        self.I: Optional[torch.Tensor] = None  # [N, d]
        self.S_all: Optional[torch.Tensor] = None  # [d] float64
        self.t = 0.0
        self.dt_prev: Optional[float] = None
        self.hbar_tab: Optional[torch.Tensor] = None  # [N] float64
        self.hbar_known: Optional[torch.Tensor] = None  # [N] bool
        self.w: Optional[torch.Tensor] = None  # [N] float64
        self.Tmax_hist: List[float] = []
        self.L = self.stepping.L
        self.L_reset_done = self.stepping.L is not None or self.stepping.T_bar is not None

    def local_training_conflict(self, steps: Optional[int]) -> Optional[str]:
        if steps is not None and self.ablations.time_unit == "epoch":
            return "FedECADO time_unit='epoch' counts client time in epochs: unset train.steps or use time_unit=lr_sum"
        return None

    def client_payload(self, client_id: int) -> Dict[str, Any]:
        self._tables()
        cid = int(client_id)
        return {
            "I": None if self.I is None else self.I[cid],
            "w": float(self.w[cid]),
            "need_hbar": bool(self.ablations.hessian in ("hutchinson", "global") and not self.hbar_known[cid]),
        }

    # ---- the round ------------------------------------------------------------------------------------
    def _hbar_for(self, rin: RoundInput, ids: torch.Tensor, sent: List[int]) -> torch.Tensor:
        """[K] float64 hbar of the round's clients (``ids`` on the host); the estimates sent in the rows
        ``sent`` are stored first (one indexed write)."""
        if self._hbar_opt is None and sent:
            at = id_tensor([rin.client_ids[k] for k in sent])
            self.hbar_tab[at] = torch.tensor(
                [float(rin.payloads[k]["hbar"]) for k in sent], dtype=torch.float64
            ).clamp_min(0.0)
            self.hbar_known[at] = True
        if self.ablations.hessian == "global":
            known = self.hbar_tab[self.hbar_known]
            return torch.full((rin.K,), float(known.mean()) if known.numel() else 1.0, dtype=torch.float64)
        return self.hbar_tab.index_select(0, ids)  # (a copy: the table is not aliased)

    def _L_for(self, Tmax: float) -> float:
        if self.L is None:
            Tb = self.stepping.T_bar if self.stepping.T_bar is not None else Tmax
            self.L = self.stepping.c_L * float(Tb) ** 2
        elif not self.L_reset_done and len(self.Tmax_hist) >= 5:
            self.L = self.stepping.c_L * statistics.median(self.Tmax_hist[:5]) ** 2
            self.L_reset_done = True
        return self.L

    def _aggregate(self, rin: RoundInput) -> AggResult:
        dev = rin.device
        hids = id_tensor(rin.client_ids)
        ids = hids.to(dev)
        T, sent = self.payload_columns(rin.payloads)  # T: [K] float64 (host), read once with the checks
        self._cols = None
        if T is None:  # numbers as text, ...: one by one
            T = torch.tensor([float(p["T"]) for p in rin.payloads], dtype=torch.float64)
        Tmin, Tmax = torch.aminmax(T)
        Tmax = float(Tmax)
        ratio = Tmax / float(Tmin)
        if self.ablations.sync:  # no multi-rate: every client is taken to end at T_max
            T = torch.full_like(T, Tmax)
        hbar = self._hbar_for(rin, hids, sent)
        w = self.w.index_select(0, hids)
        L = self._L_for(Tmax)
        Ik = self.I.index_select(0, ids)  # K x d gather
        S_off = None
        Ik_sum = flow_sum(Ik)  # sum of the round's flows at its start
        if self.ablations.inactive == "frozen":
            S_off = (self.S_all - Ik_sum).to(rin.dtype)
        # dt: the carried step; in the first round dt0 (default T_max)
        dt_init = (
            self.dt_prev if self.dt_prev is not None else (self.stepping.dt0 if self.stepping.dt0 is not None else Tmax)
        )
        res = central_round(
            rin.global_flat,
            Ik,
            rin.U,
            T,
            w,
            hbar,
            L,
            self.stepping.delta,
            dt_init,
            S_off,
            **integrator_options(self.stepping, self.ablations, self.solver, self.dt_prev is not None),
        )
        info = {
            "steps": res["steps"],
            "rejects": res["rejects"],
            "dt": res["dt"],
            "truncated": res["truncated"],
            "L": L,
            "T_max": Tmax,
            "max_extrap_ratio": ratio,
            "lte_c": res["lte_c"],
            "lte_I": res["lte_I"],
        }
        xc, Inew = res["xc"], res["I"]
        # finite by the LTE test of every accepted step (central_round's ``finite``), else checked: one
        # native pass over each, one host sync, no K x d temporary
        if not (res["finite"] or bool(ops.finite_rows(xc.unsqueeze(0)).all() & ops.finite_rows(Inew).all())):
            log.warning("%s: central integration produced NaN/Inf; round rolled back", self.name)
            info.update(failed=True)
            return AggResult(rin.global_flat.clone(), info)
        # commit (spec §2.8 step 7)
        self.S_all += flow_sum(Inew) - Ik_sum  # no K x d float64 temporary
        self.I.index_copy_(0, ids, Inew)
        self.t += Tmax
        self.dt_prev = res["dt"]
        self.Tmax_hist.append(Tmax)
        return AggResult(xc, info)


FedECADO.__init__.__signature__ = flat_signature(FedECADO.__init__)
