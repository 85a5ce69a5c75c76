"""The batched executor: a round's clients trained together, as one vmapped computation per local step.

Sequential local training (``sim/client.py``) runs each client's mini-batches of 32 one after another,
which on a GPU is a few tiny kernel launches per step. Here the C clients of a chunk keep their weights
stacked as rows of the round's update buffer, ``W = U[s0:s0+C]`` ([C, d], the flat layout of
``FlatSpec``), and every local step is

    G, ce = vmap(grad(loss))(W, X[:, s], Y[:, s], M[:, s])          # [C, d] gradients, one call
    G <- the method's client rule, batched (:class:`BatchedRule`)   # e.g. G += mu (W - x)  (FedProx)
    G <- clip per client (train.grad_clip); wd; momentum            # torch-SGD semantics, per row
    W <- W - lr[:, None] * active[:, None] * step                   # a client past its last step stays put

with ``loss(w, x, y, m) = sum_b m_b ce(f(w, x_b), y_b) / sum_b m_b`` (``torch.func.functional_call``
on the simulation's model). At the end ``W <- W - x`` turns the rows into the updates in place: the
K x d buffer is written directly from the stacked weights, with no copy.

Same minibatches, same order: each client's batch indices are drawn exactly as ``ClientTrainer``
draws them (a generator seeded by ``client_seed(seed, round, cid)``, a fresh ``randperm`` per epoch,
the same batch size, tail batch and ``drop_last``), gathered into an index tensor [C, S_max, B_max]
with a sample mask M (a short tail batch, a client with fewer samples than the batch size, a client
with fewer local steps: masked). The data stay resident on the device; one gather per step. So the
results equal the sequential executor's to fp32 rounding, round by round (tests/test_batched.py).
Unequal local step counts (epochs, hetero epochs, sizes) and per-client learning rates are per-row
vectors; FedNova / FedECADO / SCAFFOLD read each client's real step count.

What trains batched (anything else trains sequentially, with one line saying why, see
:func:`batch_reason`): SGD (momentum, weight decay, Nesterov, grad_clip), cross-entropy, models
without buffers (BatchNorm's running statistics are refused, GroupNorm / no normalisation are fine)
and without dropout (its random masks come from the sequential loop's per-client torch seed), no
train-time augmentation. Client rules: FedProx, SCAFFOLD / FedPVR (their control variates), FedNova,
Local GC / GC-Fed (``local_order="pre_wd"``, ``mu="cout"``), FedPGVC (every mode except ``code``,
``nan_policy`` skip | propagate, the default per-sample loss), FedECADO (its T and flows; a client
that still owes its Hutchinson estimate trains sequentially that round), Kuramoto mode C (the phase).
FedAvg, FedAvgM, FedAWARE, Kuramoto S and Global GC have no client rule. A rule class not listed in
``BATCHED_RULES`` (a user's own) is not batchable.

An executor of the round loop (``sim/executors.py``: ``train_local(r, ids, positions, payload_of,
factor)``, ``close()``): per accepted client ``pos, cid, n, payload, loss, steps``, in schedule
order, with the rows written into ``sim.buf`` in that order. Clients that cannot be batched
(payload-dependent, e.g. FedECADO's first participation, or an empty client) are trained by the
:class:`~fedkernels.sim.executors.SequentialExecutor` in their place in the schedule.

``clients_at_once`` (config): ``off``; ``N``: batched in chunks of N clients; ``auto`` (default):
batched on CUDA in chunks of as many clients as half the free memory holds by an estimate of
(weights, gradients, momentum, activations) per client (:func:`auto_chunk`), sequential on the CPU
(on 2 shared cores, ``python -m bench.sim_compare --executors``: 0.9x for the 4-client smoke preset,
1.2-2.5x for the 10-client digits presets; bench/results/sim-executors-cpu.json). GPU speed is not
measured yet. A chunk runs as many steps as its longest client (the others are masked): with very
unequal step counts, part of the work is padding.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..algorithms.base import ClientRule
from .client import BadClientError, client_seed
from .executors import SequentialExecutor, client_failed

log = logging.getLogger("fedkernels.sim")


# ---------------------------------------------------------------------------------------------
# the chunk being trained
# ---------------------------------------------------------------------------------------------
@dataclass
class Chunk:
    """What a batched rule sees: C clients trained together from the global model ``x``."""

    W: torch.Tensor            # [C, d] stacked weights (rows of the update buffer)
    x: torch.Tensor            # [d] the global model
    lr: torch.Tensor           # [C] learning rates this round (float64, host)
    steps: List[int]           # local steps per client
    epochs: List[Optional[int]]
    payloads: List[Dict[str, Any]]
    client_ids: List[int]
    momentum: float
    weight_decay: float

    @property
    def C(self) -> int:
        return self.W.size(0)


# ---------------------------------------------------------------------------------------------
# the client rules, batched: each acts on the [C, d] gradients of a chunk
# ---------------------------------------------------------------------------------------------
class BatchedRule:
    """The batched form of a ClientRule. Hooks, per local step, in the sequential loop's order:
    ``before_step`` (the rule's loss_term / before_step maths, before grad_clip), ``in_step`` (what a
    fused native step applies after grad_clip), ``skip`` (clients whose step is dropped), and once
    ``begin`` / ``end`` (the payloads). ``needs_rho``: the loss also returns FedPGVC's rho."""

    needs_rho = False
    loss_clip: Optional[float] = None

    def __init__(self, rule: ClientRule, spec, train) -> None:
        self.rule, self.agg, self.spec, self.train = rule, getattr(rule, "aggregator", None), spec, train

    def client_reason(self, payload: Dict[str, Any]) -> Optional[str]:
        """Why this client (by its payload) must train sequentially this round, or None."""
        return None

    def begin(self, ch: Chunk) -> None:
        pass

    def before_step(self, ch: Chunk, G: torch.Tensor, rho: Optional[torch.Tensor], ce: torch.Tensor,
                    m: torch.Tensor, active: torch.Tensor) -> None:
        pass

    def in_step(self, ch: Chunk, G: torch.Tensor) -> None:
        pass

    def skip(self) -> Optional[torch.Tensor]:
        return None

    def end(self, ch: Chunk) -> List[Dict[str, Any]]:
        return [{} for _ in range(ch.C)]

    def fused(self) -> bool:
        """Whether the sequential rule acts in its ``step`` hook, after grad_clip (``fused_step``: the
        native step, or, for an optimizer it cannot fuse, the same edit made there)."""
        return bool(getattr(self.agg, "fused_step", False))


class FedProxBatched(BatchedRule):
    """g += mu (w - x) (fedprox.py; the "loss" form has the same gradient)."""

    def before_step(self, ch, G, rho, ce, m, active):
        mu = self.rule.mu
        if mu != 0.0:
            G.add_(ch.W, alpha=mu).sub_(ch.x * mu)

    def end(self, ch):
        return [{"prox_mu": self.rule.mu} for _ in range(ch.C)]


class ControlVariateBatched(BatchedRule):
    """SCAFFOLD / FedPVR (control_variates.ControlVariateRule): g += c - c_i on the controlled range;
    delta_c = -c + (x - y) / lr_sum."""

    def begin(self, ch):
        agg = self.agg
        _, self.ranges, self.d_c = agg.control_layout(self.spec)
        c = [p.get("c") for p in ch.payloads]
        ci = [p.get("c_i") for p in ch.payloads]
        for key, vs in (("c", c), ("c_i", ci)):
            for v in vs:
                if v is not None and v.numel() != self.d_c:
                    raise ValueError(f"{agg.name} client rule: payload {key!r} has {v.numel()} elements, "
                                     f"expected d_c={self.d_c} (the controlled range)")
        self.c = c[0] if c and c[0] is not None else None        # c is the server's one vector
        self.corr = None
        if self.c is not None or any(v is not None for v in ci):
            W = ch.W
            corr = torch.zeros(ch.C, self.d_c, dtype=W.dtype, device=W.device)
            if self.c is not None:
                corr.add_(self.c.to(device=W.device, dtype=W.dtype))
            if any(v is not None for v in ci):
                corr.sub_(torch.stack([v if v is not None else torch.zeros(self.d_c, dtype=W.dtype, device=W.device)
                                       for v in ci]).to(device=W.device, dtype=W.dtype))
            self.corr = corr

    def _correct(self, G):
        if self.corr is None:
            return
        pos = 0
        for a, b in self.ranges:
            G[:, a:b].add_(self.corr[:, pos:pos + b - a])
            pos += b - a

    def before_step(self, ch, G, rho, ce, m, active):
        if not self.fused():
            self._correct(G)

    def in_step(self, ch, G):
        if self.fused():
            self._correct(G)

    def end(self, ch):
        from ..algorithms.control_variates import gather_ranges
        from ..algorithms.parts import momentum_steps
        agg, x = self.agg, ch.x
        K = torch.tensor(ch.steps, dtype=torch.float64)
        div = K * ch.lr.cpu()                                  # sum of the steps' learning rates
        if agg.momentum_correction and ch.momentum:
            div = div * torch.tensor([momentum_steps(k, ch.momentum) / k for k in ch.steps], dtype=torch.float64)
        xs = gather_ranges(x, self.ranges)
        Y = torch.cat([ch.W[:, a:b] for a, b in self.ranges], 1)      # the local models' controlled part
        dc = (xs.unsqueeze(0) - Y).div_(div.to(device=Y.device, dtype=Y.dtype).unsqueeze(1))
        if self.c is not None:
            dc.sub_(self.c.to(device=dc.device, dtype=dc.dtype))
        return [{agg.steps_key: int(k), "delta_c": dc[i]} for i, k in enumerate(ch.steps)]


class FedNovaBatched(BatchedRule):
    """FedNova's client side only reports its steps and momentum (fednova.py)."""

    def end(self, ch):
        return [{"local_steps": int(k), "momentum": float(ch.momentum)} for k in ch.steps]


class KuramotoPhaseBatched(BatchedRule):
    """Kuramoto mode C: phase = mean over the local steps of the gradient's l2 norm."""

    def begin(self, ch):
        self.sum = torch.zeros(ch.C, dtype=torch.float64, device=ch.W.device)

    def before_step(self, ch, G, rho, ce, m, active):
        self.sum += torch.where(active, torch.linalg.vector_norm(G.double(), dim=1), 0.0)

    def end(self, ch):
        return [{"phase": float(s) / k if k else 0.0} for s, k in zip(self.sum.tolist(), ch.steps)]


class LocalGCBatched(BatchedRule):
    """Local GC (gcfed.py, order "pre_wd", mean "cout"): each local tensor's gradient rows centred."""

    def begin(self, ch):
        agg = self.agg
        entries = [e for e in self.spec.entries if not e.is_buffer]
        mask = agg.local_mask(self.spec)
        self.local = [e for e, k in zip(entries, mask) if k]
        self.rows = []          # (entry, fan-in) of the tensors GC changes
        for e in self.local:
            if e.numel == 0 or len(e.shape) == 0:
                continue
            if len(e.shape) == 1:
                if agg.vector_policy == "skip" or e.numel < agg.min_fanin:
                    continue
                self.rows.append((e, e.numel))
            elif e.numel // e.shape[0] >= agg.min_fanin:
                self.rows.append((e, e.numel // e.shape[0]))

    def _gc(self, G):
        C = G.size(0)
        for e, fan in self.rows:
            v = G[:, e.offset:e.offset + e.numel].view(C, -1, fan)
            v.sub_(v.mean(-1, keepdim=True))

    def fused(self):
        return super().fused() and bool(self.local)

    def before_step(self, ch, G, rho, ce, m, active):
        if not self.fused():
            self._gc(G)

    def in_step(self, ch, G):
        if self.fused():
            self._gc(G)

    def end(self, ch):
        return [{"local_gc": len(self.local)} for _ in range(ch.C)]


class FedPGVCBatched(BatchedRule):
    """FedPGVC (fedpgvc.py) on the controlled set: u = rho * g (hadamard), g + lam rho (additive),
    s_l g_l (layer_scalar), tau g_l / ||g_l|| (layer_normalize), (1 + lam lbar) g (lr_matched);
    rho = grad of sum_b m_b stopgrad(l_b) l_b / sum_b m_b comes from the same vmapped backward."""

    def __init__(self, rule, spec, train):
        super().__init__(rule, spec, train)
        agg = self.agg
        self.ctrl = agg.ctrl_entries(spec)
        self.needs_rho = bool(self.ctrl) and agg.mode in ("hadamard", "additive", "layer_scalar")
        self.loss_clip = agg.loss_clip

    def begin(self, ch):
        dev = ch.W.device
        self.skipped = torch.zeros(ch.C, dtype=torch.int64, device=dev)
        self.hist_sum = torch.zeros(ch.C, dtype=torch.float64, device=dev)
        self.hist_n = torch.zeros(ch.C, dtype=torch.int64, device=dev)
        self._skip = None

    def before_step(self, ch, G, rho, ce, m, active):
        agg = self.agg
        self._skip = None
        if not self.ctrl or agg.mode == "layer_normalize":
            pass
        else:
            ok = (torch.isfinite(ce) | (m == 0)).all(1)
            if agg.nan_policy == "skip":
                self._skip = active & ~ok
                self.skipped += self._skip
            w = ce if self.loss_clip is None else ce.clamp(max=self.loss_clip)
            cnt = m.sum(1).clamp_min(1)
            counted = active if self._skip is None else active & ~self._skip
            self.hist_sum += torch.where(counted, torch.where(m > 0, w, 0.0).sum(1).double() / cnt.double(), 0.0)
            self.hist_n += counted
        if not self.ctrl:
            return
        mode = agg.mode
        if mode == "lr_matched":
            lbar = self.hist_sum / self.hist_n.clamp_min(1)
            f = (1.0 + agg.lam * lbar).to(G.dtype).unsqueeze(1)
            for e in self.ctrl:
                G[:, e.offset:e.offset + e.numel].mul_(f)
            return
        for e in self.ctrl:
            g = G[:, e.offset:e.offset + e.numel]
            if mode == "hadamard":
                g.mul_(rho[:, e.offset:e.offset + e.numel])
            elif mode == "additive":
                g.add_(rho[:, e.offset:e.offset + e.numel], alpha=agg.lam)
            elif mode == "layer_scalar":
                r = rho[:, e.offset:e.offset + e.numel]
                s = r.mean(1) if agg.stat == "mean" else torch.linalg.vector_norm(r, dim=1)
                g.mul_(s.unsqueeze(1))
            elif mode == "layer_normalize":
                n = torch.linalg.vector_norm(g, dim=1)
                s = torch.where(n > 0, agg.tau / n.clamp_min(torch.finfo(n.dtype).tiny), torch.zeros_like(n))
                g.mul_(s.unsqueeze(1))

    def skip(self):
        return self._skip

    def end(self, ch):
        out = []
        sk, hs, hn = self.skipped.tolist(), self.hist_sum.tolist(), self.hist_n.tolist()
        for i in range(ch.C):
            p: Dict[str, Any] = {"pgvc_skipped_steps": int(sk[i])}
            if hn[i]:
                p["pgvc_mean_loss"] = hs[i] / hn[i]
            out.append(p)
        return out


class FedECADOBatched(BatchedRule):
    """FedECADO (fedecado.py): g <- w_i g + I_i; T_i = the sum of the applied learning rates."""

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
            self.flows = torch.stack([f if f is not None else torch.zeros(W.size(1), dtype=W.dtype, device=W.device)
                                      for f in flows]).to(device=W.device, dtype=W.dtype)

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


def _batched_rules() -> Dict[type, type]:
    from ..algorithms.fedecado import FedECADORule
    from ..algorithms.fednova import FedNovaRule
    from ..algorithms.fedpgvc import FedPGVCRule
    from ..algorithms.fedprox import FedProxRule
    from ..algorithms.gcfed import LocalGCRule
    from ..algorithms.kuramoto import KuramotoPhaseRule
    from ..algorithms.control_variates import ControlVariateRule
    return {FedProxRule: FedProxBatched, ControlVariateRule: ControlVariateBatched, FedNovaRule: FedNovaBatched,
            KuramotoPhaseRule: KuramotoPhaseBatched, LocalGCRule: LocalGCBatched, FedPGVCRule: FedPGVCBatched,
            FedECADORule: FedECADOBatched}


BATCHED_RULES = _batched_rules()    # ClientRule class (exactly; a subclass may change a hook) -> batched form


def rule_reason(rule: Optional[ClientRule]) -> Optional[str]:
    """Why this method's client rule cannot be batched, or None."""
    if rule is None:
        return None
    cls = type(rule)
    if cls not in BATCHED_RULES:
        return f"client rule {cls.__name__} has no batched form (fedkernels.sim.batched.BATCHED_RULES)"
    if hasattr(rule, "state_dict") and hasattr(rule, "load_state_dict"):
        return f"client rule {cls.__name__} keeps per-client state across rounds"
    agg = rule.aggregator
    name = getattr(agg, "name", cls.__name__)
    from ..algorithms.fedpgvc import FedPGVCRule, _per_sample_ce
    from ..algorithms.gcfed import LocalGCRule
    if cls is LocalGCRule and (agg.local_order != "pre_wd" or agg.mu != "cout"):
        return f"{name}: local_order={agg.local_order!r} / mu={agg.mu!r} (batched: pre_wd with mu='cout' only)"
    if cls is FedPGVCRule:
        if agg.mode == "code":
            return f"{name}: mode 'code' shrinks after a pass over each client's whole local set"
        if agg.nan_policy == "raise":
            return f"{name}: nan_policy='raise' stops one client at its step"
        if agg.loss_fn is not _per_sample_ce:
            return f"{name}: a custom loss_fn (batched: the per-sample cross-entropy)"
    return None


def batch_reason(cfg, model: nn.Module, rule: Optional[ClientRule], transform, criterion) -> Optional[str]:
    """Why this run's clients cannot train batched (one line), or None."""
    t = cfg.train
    if t.optimizer != "sgd":
        return f"train.optimizer={t.optimizer!r} (batched: sgd)"
    if transform is not None:
        return "a train-time transform (data.augment) draws from each client's generator between batches"
    if type(criterion) is not nn.CrossEntropyLoss or criterion.weight is not None or criterion.label_smoothing \
            or criterion.reduction != "mean":
        return "a criterion other than the default cross-entropy"
    for name, mod in model.named_modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            return (f"model {type(model).__name__} has BatchNorm ({name}): its running statistics are not "
                    "carried per client (GroupNorm or no normalisation trains batched)")
        if isinstance(mod, nn.modules.dropout._DropoutNd) and mod.p > 0:
            return (f"model {type(model).__name__} has dropout ({name}): its masks come from the sequential "
                    "loop's per-client seed")
    if any(True for _ in model.buffers()):
        return f"model {type(model).__name__} has buffers (batched: parameters only)"
    if any(not p.requires_grad for p in model.parameters()):
        return f"model {type(model).__name__} has frozen parameters"
    if rule is not None and type(rule).__name__ == "FedECADORule" and t.steps is not None \
            and rule.aggregator.ablations.time_unit == "epoch":
        return "FedECADO time_unit='epoch' needs epochs (train.steps is set)"
    return rule_reason(rule)


def auto_chunk(device: torch.device, d: int, batch: int, sample_numel: int, K: int, momentum: bool,
               element_size: int = 4) -> int:
    """Clients per chunk: all K on the CPU; on CUDA as many as half the free memory holds by the
    estimate (weights + gradients + step temporaries (+ momentum)) * d + 64 activations per input value."""
    if device.type != "cuda":
        return K
    free, _ = torch.cuda.mem_get_info(device)
    per = element_size * ((4 + int(momentum)) * d + 64 * batch * sample_numel)
    return max(1, min(K, int(0.5 * free) // max(per, 1)))


# ---------------------------------------------------------------------------------------------
# the executor
# ---------------------------------------------------------------------------------------------
class BatchedExecutor:
    """Trains a Simulation's clients in chunks (module docstring). Build with :func:`for_simulation`."""

    def __init__(self, sim, chunk: Optional[int] = None) -> None:
        self.sim = sim
        self.model, self.spec = sim.model, sim.spec
        tr = sim.trainer
        self.x, self.y, self.parts = tr.x, tr.y, tr.client_indices
        self.parts_host = [p.cpu() for p in self.parts]    # drawing batches reads them: no per-client sync
        self.train = sim.cfg.train
        self.chunk = chunk
        rule = sim.agg.client_rule()
        self.form: BatchedRule = BATCHED_RULES[type(rule)](rule, self.spec, self.train) if rule is not None \
            else BatchedRule(None, self.spec, self.train)  # type: ignore[arg-type]
        self.sequential = SequentialExecutor(sim)   # the clients that cannot be batched, in their place
        self._fn = self._grad_fn()

    # ---- the per-client loss, vmapped -------------------------------------------------------------
    def _grad_fn(self):
        from torch.func import functional_call, grad, jacrev, vmap
        model, entries = self.model, self.spec.entries
        rho, clip = self.form.needs_rho, self.form.loss_clip

        def loss(w, x, y, m):
            params = {e.name: w[e.offset:e.offset + e.numel].view(e.shape) for e in entries}
            ce = F.cross_entropy(functional_call(model, params, (x,)), y, reduction="none")
            cnt = m.sum().clamp_min(1)
            ce_m = torch.where(m > 0, ce, 0.0)      # masked samples add nothing, even a non-finite loss
            data = ce_m.sum() / cnt
            if rho:   # FedPGVC's rho: the gradient of mean(stopgrad(l) l) over the batch
                wt = ce_m.detach() if clip is None else ce_m.detach().clamp(max=clip)
                return torch.stack([data, (wt * ce_m).sum() / cnt]), ce.detach()
            return data, ce.detach()

        return vmap(jacrev(loss, has_aux=True) if rho else grad(loss, has_aux=True))

    def probe(self) -> None:
        """One vmapped gradient of two clients on one sample: raises if torch.func cannot run the model."""
        W = self.sim.global_flat.detach().unsqueeze(0).expand(2, -1).contiguous()
        x = self.x[:1].unsqueeze(0).expand(2, *self.x[:1].shape)
        y = self.y[:1].unsqueeze(0).expand(2, 1)
        m = torch.ones(2, 1, dtype=W.dtype, device=W.device)
        self._fn(W, x, y, m)

    # ---- minibatches, as ClientTrainer draws them -------------------------------------------------
    def _indices(self, cids: Sequence[int], steps: Sequence[int], seeds: Sequence[int]):
        """[C, S, B] sample indices and [C, S, B] mask of every client's minibatches (host draws)."""
        t = self.train
        Bs = [min(int(t.batch_size), int(self.parts[c].numel())) for c in cids]
        S, B = max(steps), max(Bs)
        idx = torch.empty(len(cids), S, B, dtype=torch.long)
        msk = torch.zeros(len(cids), S, B, dtype=torch.bool)
        for i, (c, k, sd, b) in enumerate(zip(cids, steps, seeds, Bs)):
            own = self.parts_host[c]
            n = own.numel()
            idx[i] = own[0]                         # masked places hold one of the client's own samples
            gen = torch.Generator().manual_seed(sd)
            stop = n - (n % b) if t.drop_last else n
            nb = -(-stop // b)                      # batches per epoch (the last one may be short)
            done = 0
            while done < k:                         # a fresh permutation per epoch, as ClientTrainer._batches
                perm = own[torch.randperm(n, generator=gen)][:stop]
                take = min(nb, k - done)
                rows = torch.full((nb * b,), -1, dtype=torch.long)
                rows[:stop] = perm
                rows = rows.view(nb, b)[:take]
                ok = rows >= 0
                idx[i, done:done + take, :b] = torch.where(ok, rows, rows[:, :1])
                msk[i, done:done + take, :b] = ok
                done += take
        return idx.to(self.x.device), msk

    # ---- one chunk ------------------------------------------------------------------------------------
    def _train_chunk(self, r: int, items: List[Tuple[int, int, Dict[str, Any], float, int]], factor: float):
        """Trains the chunk's clients into the next rows of sim.buf; returns (accepted, bad) with bad
        the (pos, cid) of clients whose update is not finite (their rows already released)."""
        sim, t, buf = self.sim, self.train, self.sim.buf
        dev, x0 = sim.global_flat.device, sim.global_flat
        C = len(items)
        cids = [c for _, c, _, _, _ in items]
        ns = [int(self.parts[c].numel()) for c in cids]
        epochs = [None if t.steps is not None else int(e) for _, _, _, _, e in items]
        steps = [sim.trainer.planned_steps(n, e) for n, (_, _, _, _, e) in zip(ns, items)]
        seeds = [client_seed(sim.cfg.seed, r, c) for c in cids]
        s0 = buf.count
        for c, n in zip(cids, ns):
            buf.add(c, n)
        W = buf.data[s0:s0 + C]
        W.copy_(x0.to(W.dtype).unsqueeze(0).expand(C, -1))
        lr = torch.tensor([b * factor for _, _, _, b, _ in items], dtype=torch.float64)
        ch = Chunk(W=W, x=x0, lr=lr, steps=steps, epochs=epochs, payloads=[p for _, _, p, _, _ in items],
                   client_ids=cids, momentum=float(t.momentum), weight_decay=float(t.weight_decay))
        form = self.form
        form.begin(ch)
        idx, msk = self._indices(cids, steps, seeds)
        mask = msk.to(device=dev, dtype=W.dtype)
        lr_d = lr.to(device=dev, dtype=W.dtype)
        steps_d = torch.tensor(steps, device=dev)
        mom, wd = float(t.momentum), float(t.weight_decay)
        nesterov = bool(t.nesterov) and mom > 0
        buf_m = torch.zeros_like(W) if mom > 0 else None
        loss_sum = torch.zeros(C, dtype=torch.float64, device=dev)
        self.model.train()
        for s in range(max(steps)):
            ib, m = idx[:, s], mask[:, s]
            xb, yb = self.x[ib], self.y[ib]
            G, ce = self._fn(W, xb, yb, m)
            rho = None
            if form.needs_rho:
                G, rho = G[:, 0], G[:, 1]
            active = steps_d > s
            loss_sum += torch.where(m > 0, ce, 0.0).sum(1).double()
            form.before_step(ch, G, rho, ce, m, active)
            if t.grad_clip is not None:
                norm = torch.linalg.vector_norm(G, dim=1)
                G.mul_((float(t.grad_clip) / (norm + 1e-6)).clamp(max=1.0).unsqueeze(1))
            form.in_step(ch, G)
            skip = form.skip()
            act = active if skip is None else active & ~skip
            a = act.unsqueeze(1)                # a client past its last step (or skipping it) stays put:
            if wd:                              # its d is 0 (even a NaN one), its buffer kept, its lr 0
                G.add_(W, alpha=wd)
            G.masked_fill_(~a, 0.0)
            if buf_m is not None:
                buf_m.mul_(torch.where(a, mom, 1.0).to(W.dtype)).add_(G)
                step = G.add_(buf_m, alpha=mom) if nesterov else buf_m
            else:
                step = G
            W.addcmul_(step, lr_d.unsqueeze(1) * a, value=-1.0)    # no [C, d] temporary
        payloads = form.end(ch)
        W.sub_(x0.to(W.dtype))                 # the rows become the updates local - global
        torch.manual_seed(seeds[-1])           # the global torch RNG as the sequential loop leaves it
        seen = msk.sum((1, 2)).tolist()
        losses = (loss_sum.cpu() / torch.tensor([max(v, 1) for v in seen], dtype=torch.float64)).tolist()
        # the rows are screened here only when the aggregator does not screen them (sim.screen_clients)
        finite = ops.finite_rows(W).tolist() if sim.screen_clients else [True] * C   # one host sync per chunk
        accepted, bad = [], []
        for i, (pos, cid, _, _, _) in enumerate(items):
            if finite[i]:
                accepted.append({"pos": pos, "cid": int(cid), "n": float(ns[i]), "payload": payloads[i],
                                 "loss": losses[i], "steps": steps[i]})
            else:
                bad.append((pos, int(cid)))
        if bad:                                # release the rows of non-finite updates, keep the order
            keep = [i for i in range(C) if finite[i]]
            if keep:
                W[:len(keep)].copy_(W[torch.tensor(keep, device=W.device)])
            del buf.client_ids[s0 + len(keep):], buf.num_examples[s0 + len(keep):]
            for j, i in enumerate(keep):
                buf.client_ids[s0 + j], buf.num_examples[s0 + j] = cids[i], float(ns[i])
        return accepted, bad

    # ---- a round ----------------------------------------------------------------------------------
    def train_local(self, r: int, ids: Sequence[int], mine, payload_of: Callable[[int], Any],
                    factor: float) -> Dict[str, Any]:
        """Phase 2 of the round, batched (module docstring); ``Simulation.train_local``'s return value."""
        sim, cfg = self.sim, self.sim.cfg
        sim._sync()
        t0 = time.perf_counter()
        accepted: List[Dict[str, Any]] = []
        excluded: List[Any] = []
        error = None
        pending: List[Tuple[int, int, Dict[str, Any], float, int]] = []
        cap = self.chunk or auto_chunk(sim.global_flat.device, self.spec.d, int(self.train.batch_size),
                                       int(self.x[0].numel()), len(ids), self.train.momentum > 0,
                                       sim.global_flat.element_size())

        def flush():
            nonlocal error
            if not pending:
                return
            acc, bad = self._train_chunk(r, list(pending), factor)
            accepted.extend(acc)
            for pos, cid in bad:
                reason = "update contains NaN/Inf"
                error = error or client_failed(cfg.bad_client_policy, r, pos, cid, reason, True,
                                               BadClientError(reason), excluded)
            pending.clear()

        for pos in mine:
            if error is not None:
                break
            cid = ids[pos]
            base_lr, epochs = sim.hetero.get(cid, r)
            try:
                payload = payload_of(pos)
                why = None if self.parts[cid].numel() > 0 else "empty"
                why = why or self.form.client_reason(payload)
            except Exception:  # noqa: BLE001 - the sequential loop meets it again and applies the policy
                payload, why = None, "payload"
            if why is None:
                pending.append((pos, cid, payload, base_lr, epochs))
                if len(pending) >= cap:
                    flush()
                continue
            flush()
            if error is not None:
                break
            one = self.sequential.train_local(r, ids, [pos], (lambda p, v=payload: v) if payload is not None
                                              else payload_of, factor)
            accepted.extend(one["accepted"])
            excluded.extend(one["excluded"])
            error = one["error"]
        if error is None:
            flush()
        sim._sync()
        return {"accepted": accepted, "excluded": excluded, "error": error, "t_local": time.perf_counter() - t0}

    def close(self) -> None:
        pass


def for_simulation(sim) -> Optional[BatchedExecutor]:
    """The batched executor for a set-up Simulation, or None (sequential). ``clients_at_once``: "off"
    (False) -> None; "auto" -> batched on CUDA, sequential on the CPU; N -> batched in chunks of N.
    When batched training was asked for (N, or auto on CUDA) and the run cannot do it, one warning
    line says why and the run trains sequentially."""
    cfg = sim.cfg
    v = cfg.clients_at_once
    if v is False or v == "off" or cfg.workers > 1 or getattr(cfg, "distributed", False):
        return None
    if v == "auto" and sim.device.type != "cuda":
        return None
    chunk = None if v == "auto" else int(v)
    rule = sim.agg.client_rule()
    why = batch_reason(cfg, sim.model, rule, sim.trainer.transform, sim.trainer.criterion)
    ex = None
    if why is None:
        try:
            ex = BatchedExecutor(sim, chunk)
            ex.probe()
        except Exception as e:  # noqa: BLE001 - said in one line, then sequential
            why, ex = f"torch.func cannot vmap the model: {type(e).__name__}: {e}", None
    if why is not None:
        log.warning("clients_at_once=%s: training clients one at a time: %s", v, why)
        return None
    log.info("clients_at_once=%s: batched executor, chunks of %s clients", v, chunk or "auto")
    return ex
