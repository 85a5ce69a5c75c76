"""SCAFFOLD (Karimireddy et al., 2020), option II control variates.

Server state: the global control variate c [d] and one c_i [d] per client id. With ``num_clients``
known from ``setup`` the c_i live in an N x d table, allocated at first use; otherwise in a dict
holding only the clients seen so far. Unseen clients have c_i = 0.

Client (``ScaffoldRule``): receives ``{"c", "c_i"}`` from ``client_payload``; before every local
step it corrects the gradient ``g <- g - c_i + c``; at the end it returns
``delta_c = c_i^+ - c_i = -c + (x - y_i) / (K lr)`` (option II; x = global model, y_i = local
model, K = local steps, lr = the client's learning rate). With ``momentum_correction=True`` the
divisor K is replaced by the effective number of steps of SGD with momentum (see fednova).

Server round (S = accepted clients, N = number of clients):

    x <- x + server_lr * sum_i p_i U_i                 (p: sample weights, or 1/|S| with weighting="uniform")
    c_i <- c_i + delta_c_i   for i in S
    c <- c + (1/N) * sum_{i in S} delta_c_i            (= (|S|/N) mean delta_c; keeps c = mean_i c_i)

When N is unknown, N is the number of distinct clients seen so far. The first round (c = c_i = 0)
is FedAvg with ``server_lr``.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from .. import ops
from ..flat import FlatSpec
from ._fused import fused_sgd_step
from .base import AggResult, ClientContext, ClientRule, RoundInput, register
from .fedavg import FedAvg
from .fednova import momentum_steps, optimizer_momentum
from .fedprox import param_flat_pairs


class ScaffoldRule(ClientRule):
    """Gradient correction g - c_i + c, and option-II control-variate delta in ``end``."""

    def __init__(self, aggregator=None, momentum_correction: Optional[bool] = None, fused: Optional[bool] = None):
        super().__init__(aggregator)
        # fused=True: use the native corrected SGD step when the optimizer is plain torch SGD
        self.fused = bool(fused if fused is not None else getattr(aggregator, "fused_step", True))
        self.momentum_correction = bool(momentum_correction if momentum_correction is not None
                                        else getattr(aggregator, "momentum_correction", False))

    def begin(self, ctx: ClientContext, model) -> None:
        c = ctx.payload.get("c")
        ci = ctx.payload.get("c_i")
        x = ctx.global_flat
        corr = None
        if c is not None or ci is not None:
            corr = torch.zeros_like(x)
            if c is not None:
                corr.add_(c.to(device=x.device, dtype=x.dtype))
            if ci is not None:
                corr.sub_(ci.to(device=x.device, dtype=x.dtype))
        ctx.extras["scaffold_corr"] = corr
        ctx.extras["scaffold_pairs"] = param_flat_pairs(ctx, model, corr) if corr is not None else None

    def before_step(self, ctx: ClientContext, model) -> None:
        if "scaffold_pairs" not in ctx.extras:
            self.begin(ctx, model)
        if not self.fused:          # unfused: g <- g - c_i + c here, then the optimizer steps
            self._correct_grads(ctx)
        # fused: the correction is applied in step(), inside the native SGD update

    def _correct_grads(self, ctx: ClientContext) -> None:
        pairs = ctx.extras.get("scaffold_pairs")
        if pairs is None:
            return
        sel = [(p.grad, v) for p, v in zip(*pairs) if p.grad is not None]
        if sel:
            with torch.no_grad():
                torch._foreach_add_([g for g, _ in sel], [v.to(g.dtype) for g, v in sel])

    def step(self, ctx: ClientContext, model, optimizer) -> bool:
        ctx.extras["momentum"] = optimizer_momentum(optimizer)
        pairs = ctx.extras.get("scaffold_pairs")
        if not self.fused or pairs is None:
            return False
        params, views = pairs
        if fused_sgd_step(optimizer, params, c_add=[v.to(p.dtype) for p, v in zip(params, views)]):
            return True          # p -= lr * (g - c_i + c) (+ momentum, wd) in one native pass
        self._correct_grads(ctx)  # optimizer not plain SGD: edit the gradients, let it step
        return False

    def end(self, ctx: ClientContext, model) -> Dict[str, Any]:
        spec = ctx.spec if ctx.spec is not None else FlatSpec.from_module(model)
        x = ctx.global_flat
        K = int(ctx.step)
        rho = float(ctx.extras.get("momentum", 0.0)) if self.momentum_correction else 0.0
        steps = momentum_steps(K, rho) if K > 0 else 0.0
        if K == 0 or ctx.lr == 0:
            return {"delta_c": torch.zeros_like(x), "local_steps": K}
        y = spec.flatten(model).to(device=x.device, dtype=x.dtype)
        dc = x.sub(y).mul_(1.0 / (steps * float(ctx.lr)))       # (x - y) / (K lr)
        c = ctx.payload.get("c")
        if c is not None:
            dc.sub_(c.to(device=x.device, dtype=x.dtype))
        for e in spec.entries:                                   # buffers carry no control variate
            if e.is_buffer:
                dc[e.slice] = 0
        return {"delta_c": dc, "local_steps": K}


@register("scaffold")
class Scaffold(FedAvg):
    """SCAFFOLD with option-II control variates (see module docstring).

    Options: ``server_lr`` (default 1.0), ``weighting`` ("samples" default, "uniform" = the paper's
    1/|S|; the c update is always the paper's uniform (1/N) sum), ``momentum_correction`` (default
    False). Payload per client: ``delta_c`` ([d] tensor, required). ``fused_step`` (default True): the
    client rule does ``p -= lr * (g - c_i + c)`` (with the optimizer's momentum and weight decay) in one
    native pass (``ops.fused_sgd_step_``) when the optimizer is plain ``torch.optim.SGD``.
    """

    screen_after_pure = False   # keeps state across rounds: screen the rows first

    client_rule_cls = ScaffoldRule

    def __init__(self, momentum_correction: bool = False, fused_step: bool = True, **kw):
        super().__init__(**kw)
        self.momentum_correction = bool(momentum_correction)
        self.fused_step = bool(fused_step)  # clients use the native corrected SGD step when they can
        self.c: Optional[torch.Tensor] = None
        self.c_table: Optional[torch.Tensor] = None           # [N, d] when num_clients is known
        self.c_rows: Dict[int, torch.Tensor] = {}             # otherwise, client id -> [d]
        self.seen: set = set()
        self._expect_d: Optional[int] = None

    def setup(self, spec=None, num_clients=None, global_flat=None) -> None:
        super().setup(spec, num_clients, global_flat)
        if global_flat is not None:
            self._alloc(global_flat)

    # ---- state tables ----------------------------------------------------------------------------
    def _alloc(self, like: torch.Tensor) -> None:
        if self.c is None:
            self.c = torch.zeros_like(like)
        if self.num_clients is not None and self.c_table is None:
            self.c_table = like.new_zeros((self.num_clients, like.numel()))
            for cid, row in self.c_rows.items():
                self.c_table[cid].copy_(row)
            self.c_rows = {}

    def _ci(self, cid: int, create: bool = False) -> Optional[torch.Tensor]:
        if self.c_table is not None:
            return self.c_table[cid]
        if cid not in self.c_rows and create:
            self.c_rows[cid] = torch.zeros_like(self.c)
        return self.c_rows.get(cid)

    def client_payload(self, client_id: int) -> Dict[str, Any]:
        if self.c is None:
            return {}
        return {"c": self.c, "c_i": self._ci(int(client_id))}

    # ---- aggregation -----------------------------------------------------------------------------
    def validate(self, global_flat, updates, num_examples, client_ids=None, payloads=None) -> RoundInput:
        self._expect_d = global_flat.numel() if isinstance(global_flat, torch.Tensor) else None
        return super().validate(global_flat, updates, num_examples, client_ids, payloads)

    def check_payload(self, payload: Dict[str, Any]) -> Optional[str]:
        r = super().check_payload(payload)
        if r:
            return r
        dc = payload.get("delta_c")
        if not isinstance(dc, torch.Tensor):
            return "scaffold needs payload 'delta_c' (a [d] tensor from ScaffoldRule.end)"
        if self._expect_d is not None and dc.numel() != self._expect_d:
            return f"payload 'delta_c' has {dc.numel()} elements, expected d={self._expect_d}"
        return None

    def _aggregate(self, rin: RoundInput) -> AggResult:
        g = rin.global_flat
        self._alloc(g)
        p = self.weights(rin)
        new = ops.weighted_sum(rin.U, p.to(rin.U.device), base=g, alpha=self.server_lr)
        self.seen.update(rin.client_ids)
        N = self.num_clients if self.num_clients is not None else len(self.seen)
        dsum = torch.zeros_like(g)
        for cid, pl in zip(rin.client_ids, rin.payloads):
            dc = pl["delta_c"].reshape(-1).to(device=g.device, dtype=g.dtype)
            self._ci(cid, create=True).add_(dc)
            dsum.add_(dc)
        self.c.add_(dsum, alpha=1.0 / N)
        return AggResult(new, {"weights": p.tolist(), "c_scale": 1.0 / N})

    # ---- state -----------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        st = super().state_dict()
        st["c"] = None if self.c is None else self.c.clone()
        st["c_table"] = None if self.c_table is None else self.c_table.clone()
        st["c_rows"] = {int(k): v.clone() for k, v in self.c_rows.items()}
        st["seen"] = sorted(self.seen)
        return st

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.c = None if state.get("c") is None else state["c"].clone()
        self.c_table = None if state.get("c_table") is None else state["c_table"].clone()
        self.c_rows = {int(k): v.clone() for k, v in state.get("c_rows", {}).items()}
        self.seen = set(int(s) for s in state.get("seen", []))
