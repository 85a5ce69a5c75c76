"""The batched executor: a round's clients trained together, as one vmapped computation per local step.

Sequential local training (``sim/trainer.py``) runs each client's mini-batches of 32 one after another,
which on a GPU is a few tiny kernel launches per step. Here the C clients of a chunk keep their weights
stacked as rows of the round's update buffer, ``W = U[s0:s0+C]`` ([C, d], the flat layout of
``FlatSpec``), and every local step is

    G, ce = vmap(grad(loss))(W, X[:, s], Y[:, s], M[:, s])          # [C, d] gradients, one call
    G <- the method's client rule, batched (:class:`BatchedRule`)   # e.g. G += mu (W - x)  (FedProx)
    G <- clip per client (train.grad_clip); wd; momentum            # torch-SGD semantics, per row
    W <- W - lr[:, None] * active[:, None] * step                   # a client past its last step stays put

with ``loss(w, x, y, m) = sum_b m_b ce(f(w, x_b), y_b) / sum_b m_b`` (``torch.func.functional_call``
on the simulation's model; w enters as its per-tensor views [C, *shape] of W, and G is their gradients
concatenated once: differentiating through slices of one [C, d] tensor would zero-fill a [C, d]
temporary per parameter tensor every step, 2.2x slower for a ResNet-18 on the CPU). At the end ``W <- W - x`` turns the rows into the updates in place: the
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
with GroupNorm, no normalisation or BatchNorm, without other buffers and without dropout (its random
masks come from the sequential loop's per-client torch seed), no train-time augmentation. Client rules: FedProx, SCAFFOLD / FedPVR (their control variates), FedNova,
Local GC / GC-Fed (``local_order="pre_wd"``, ``mu="cout"``), FedPGVC (every mode except ``code``,
``nan_policy`` skip | propagate, the default per-sample loss), FedECADO (its T and flows; a client
that still owes its Hutchinson estimate trains sequentially that round), Kuramoto mode C (the phase).
FedAvg, FedAvgM, FedAWARE, Kuramoto S and Global GC have no client rule. Each batched form (a
:class:`~fedkernels.algorithms.base.BatchedRule`) lives beside its rule in fedkernels/algorithms/, whose
class names it in ``batched_form``; a rule class that does not set its own (a user's subclass, which
may change a hook) is not batchable. This module keeps the executor: chunks, minibatches, the SGD step.

BatchNorm (nn.BatchNorm1d/2d/3d with a momentum): its running statistics are float buffers, so the
FlatSpec holds them after the parameters, in columns [dp, d) of every row. While the vmapped gradient
runs, each BatchNorm's forward is :func:`masked_batch_norm`: batch statistics over the client's real
samples only (a short tail batch normalises over its own samples, as in the sequential loop), and the
running statistics that step leaves, returned beside the loss. The optimizer steps columns [0, dp)
only (grad_clip's norm, weight decay and momentum too, as torch.optim sees parameters only); columns
[dp, d) take the new running statistics of every client that ran the step (a rule-skipped step
included: its forward ran). ``num_batches_tracked`` counts every client step, as the shared model does
in the sequential loop. A client with a batch of one sample trains sequentially (torch refuses it
where a BatchNorm sees 1x1 maps); ``momentum=None`` (a cumulative average over the shared model's
batches) and BatchNorm subclasses are refused. SCAFFOLD's delta_c is zero on the buffer columns in both
executors (control_variates.clear_buffers_).

An executor of the round loop (``sim/executors.py``: ``train_local(r, ids, positions, payload_of,
factor)``, ``close()``): per accepted client ``pos, cid, n, payload, loss, steps``, in schedule
order, with the rows written into ``local.buf`` in that order. Clients that cannot be batched
(payload-dependent, e.g. FedECADO's first participation, or an empty client) are trained by the
:class:`~fedkernels.sim.executors.SequentialExecutor` in their place in the schedule.

``clients_at_once`` (config): ``off``; ``N``: batched in chunks of N clients; ``auto`` (default):
batched on CUDA in chunks of as many clients as half the free memory holds (:func:`free_memory`:
CUDA's mem_get_info, the CPU's MemAvailable; :func:`chunk_size`, sized again every round), each client
costing :func:`client_bytes`: its gradient and autograd's accumulation of it, its momentum, and the
bytes autograd saves for one of its batches, measured once at set-up (its weights are its row of the
update buffer, allocated anyway). If not even one client fits, the run stops with one line (RunError);
with ``N`` clients that do not fit, one warning line. Sequential on the CPU
(on 2 shared cores, ``python -m bench.sim_compare --executors``: 0.9x for the 4-client smoke preset,
1.1-2.0x for the 10-client digits MLP presets, 0.9x for a BatchNorm ResNet-18 of width 8 on digits,
whose vmapped convolutions gain nothing on the CPU; bench/results/sim-executors-cpu.json). GPU speed
is not measured yet. A chunk runs as many steps as its longest client (the others are masked): with very
unequal step counts, part of the work is padding.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..flat import clip_rows_, row_norms
from ..errors import RunError
from ..algorithms.base import BatchedRule, Chunk, ClientRule
from .client_errors import BadClientError
from .seeds import client_seed
from .executors import SequentialExecutor, client_failed
from .runstate import LocalTraining

log = logging.getLogger("fedkernels.sim")


def rule_reason(rule: Optional[ClientRule], fixed_steps: bool = False) -> Optional[str]:
    """Why this method's client rule cannot be batched, or None. Its batched form is the one its own
    class sets (``batched_form``, exactly: a subclass may change a hook); ``fixed_steps``: train.steps is set."""
    if rule is None:
        return None
    cls = type(rule)
    form = cls.__dict__.get("batched_form")
    if form is None:
        return f"client rule {cls.__name__} has no batched form (its class sets no batched_form)"
    if hasattr(rule, "state_dict") and hasattr(rule, "load_state_dict"):
        return f"client rule {cls.__name__} keeps per-client state across rounds"
    return form.reason(rule, fixed_steps)


def batch_reason(cfg, model: nn.Module, rule: Optional[ClientRule], transform, criterion) -> Optional[str]:
    """Why this run's clients cannot train batched (one line), or None."""
    t = cfg.train
    if t.optimizer != "sgd":
        return f"train.optimizer={t.optimizer!r} (batched: sgd)"
    if transform is not None:
        return "a train-time transform (data.augment) draws from each client's generator between batches"
    if (
        type(criterion) is not nn.CrossEntropyLoss
        or criterion.weight is not None
        or criterion.label_smoothing
        or criterion.reduction != "mean"
    ):
        return "a criterion other than the default cross-entropy"
    bn_buffers = set()
    for name, mod in model.named_modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            if type(mod) not in BATCH_NORMS:
                return (
                    f"model {type(model).__name__} has {type(mod).__name__} ({name}): batched, BatchNorm "
                    "is nn.BatchNorm1d/2d/3d (a subclass may change its forward)"
                )
            if mod.track_running_stats and mod.momentum is None:
                return (
                    f"model {type(model).__name__} has BatchNorm ({name}) with momentum=None: its cumulative "
                    "average counts the batches of every client the shared model trained"
                )
            bn_buffers.update(f"{name}.{b}" if name else b for b, _ in mod.named_buffers(recurse=False))
        if isinstance(mod, nn.modules.dropout._DropoutNd) and mod.p > 0:
            return (
                f"model {type(model).__name__} has dropout ({name}): its masks come from the sequential "
                "loop's per-client seed"
            )
    other = [n for n, _ in model.named_buffers() if n not in bn_buffers]
    if other:
        return (
            f"model {type(model).__name__} has buffers other than BatchNorm statistics ({other[0]}; "
            "batched: parameters and BatchNorm running statistics)"
        )
    if any(not p.requires_grad for p in model.parameters()):
        return f"model {type(model).__name__} has frozen parameters"
    return rule_reason(rule, t.steps is not None)


AUTO_DEVICES = ("cuda",)  # where clients_at_once=auto trains batched (elsewhere: sequential)
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def masked_batch_norm(mod: nn.Module, x: torch.Tensor, m: torch.Tensor):
    """``mod`` (a BatchNorm in train mode) on one client's batch ``x`` [B, C, ...] whose samples with
    ``m`` [B] = 0 are padding: the batch statistics over the real samples only (what the sequential
    loop's shorter batch gives), and the running statistics it would leave:

        mean = sum_b m_b x_b / n,  var = sum_b m_b (x_b - mean)^2 / n     (n = sum_b m_b * spatial size)
        y = (x - mean) / sqrt(var + eps) * weight + bias
        running_mean' = (1 - momentum) running_mean + momentum mean
        running_var'  = (1 - momentum) running_var + momentum var n / (n - 1)

    Returns ``(y, (running_mean', running_var'))``, or ``(y, None)`` without running statistics. A client
    with no real sample (past its last step) gets finite values, which the executor discards."""
    red = [0] + list(range(2, x.dim()))
    shape = (1, -1) + (1,) * (x.dim() - 2)
    mb = m.to(x.dtype).reshape((-1,) + (1,) * (x.dim() - 1))
    n = m.sum().to(x.dtype) * (x[0, 0].numel())
    cnt = n.clamp_min(1)
    mean = (x * mb).sum(red) / cnt
    xc = x - mean.view(shape)
    var = (xc.square() * mb).sum(red) / cnt
    y = xc * torch.rsqrt(var + mod.eps).view(shape)
    if mod.affine:
        y = y * mod.weight.view(shape) + mod.bias.view(shape)
    if not mod.track_running_stats:
        return y, None
    mom = float(mod.momentum)
    mean, var = mean.detach(), var.detach()
    rm = mod.running_mean * (1 - mom) + mean * mom
    rv = mod.running_var * (1 - mom) + var * (n / (n - 1).clamp_min(1)) * mom
    return y, (rm, rv)


def free_memory(device: torch.device) -> Optional[int]:
    """Bytes free for a chunk on ``device``: CUDA's ``mem_get_info``; on the CPU the kernel's
    MemAvailable (/proc/meminfo), else the available physical pages; None when nothing says."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None


def client_bytes(d: int, dp: int, activations: int, momentum: bool, rho: bool = False, element_size: int = 4) -> int:
    """Working memory of one client of a chunk beyond its row of the update buffer (its weights): the
    gradient (two with FedPGVC's rho) and autograd's accumulation of it (2 d), the momentum of the
    parameters (dp), and ``activations``, the bytes autograd saves for one batch (measured at set-up)."""
    return element_size * ((2 + (2 if rho else 1)) * d + (dp if momentum else 0)) + int(activations)


def chunk_size(free: Optional[int], per_client: int, K: int, device: Any = "", fraction: float = 0.5) -> int:
    """Clients per chunk (``clients_at_once=auto``): as many as ``fraction`` of the free bytes hold at
    ``per_client`` bytes each, at most K (all K when the free memory is unknown). Raises RunError
    (one line) when not even one client fits."""
    if free is None:
        return K
    n = int(fraction * free) // max(int(per_client), 1)
    if n < 1:
        raise RunError(
            f"clients_at_once=auto: one client needs about {per_client / 2**20:.1f} MiB of working "
            f"memory on {device or 'the device'} and {free / 2**20:.1f} MiB are free (the chunk may use "
            f"{fraction:.0%}); free memory, or train with clients_at_once=off"
        )
    return min(K, n)


# ---------------------------------------------------------------------------------------------
# the executor
# ---------------------------------------------------------------------------------------------
class BatchedExecutor:
    """Trains a run's clients in chunks (module docstring). Build with :func:`for_run`."""

    def __init__(self, local: LocalTraining, chunk: Optional[int] = None) -> None:
        self.local = local
        self.model, self.spec = local.model, local.spec
        tr = local.trainer
        self.x, self.y, self.parts = tr.x, tr.y, tr.client_indices
        self.parts_host = [p.cpu() for p in self.parts]  # drawing batches reads them: no per-client sync
        self.train = local.cfg.train
        self.chunk = chunk
        rule = local.rules.fresh()
        self.form: BatchedRule = (
            type(rule).__dict__["batched_form"](rule, self.spec) if rule is not None else BatchedRule(None, self.spec)
        )
        self.sequential = SequentialExecutor(local)  # the clients that cannot be batched, in their place
        # BatchNorm: its running statistics are the flat vector's trailing buffer columns [dp, d)
        self.bns = {n: m for n, m in self.model.named_modules() if isinstance(m, BATCH_NORMS)}
        self.buffer_entries = [e for e in self.spec.entries if e.is_buffer]
        self.dp = min((e.offset for e in self.buffer_entries), default=self.spec.d)  # (FlatSpec: buffers last)
        self._bn_box: Dict[str, Any] = {}
        self._buffer_names = {e.name for e in self.buffer_entries}
        self._fn = self._grad_fn()

    # ---- the per-client loss, vmapped -------------------------------------------------------------
    def _grad_fn(self):
        from torch.func import functional_call, grad, jacrev, vmap

        model, entries, bufs, box = self.model, self.spec.entries, self.buffer_entries, self._bn_box
        rho, clip = self.form.needs_rho, self.form.loss_clip

        def loss(p, b, x, y, m):  # p: the parameters, b: the buffers, by name (one client)
            params = {**p, **b}
            box.update(m=m, out={})  # read by the BatchNorms' masked forward (_bn_patch)
            ce = F.cross_entropy(functional_call(model, params, (x,)), y, reduction="none")
            cnt = m.sum().clamp_min(1)
            ce_m = torch.where(m > 0, ce, 0.0)  # masked samples add nothing, even a non-finite loss
            data = ce_m.sum() / cnt
            aux = ce.detach()
            if self.bns:  # the running statistics after this step, flat
                new = box["out"]
                aux = (aux, torch.cat([new.get(e.name, params[e.name]).detach().reshape(-1) for e in bufs]))
            if rho:  # FedPGVC's rho: the gradient of mean(stopgrad(l) l) over the batch
                wt = ce_m.detach() if clip is None else ce_m.detach().clamp(max=clip)
                return torch.stack([data, (wt * ce_m).sum() / cnt]), aux
            return data, aux

        self._loss = loss
        return vmap(jacrev(loss, has_aux=True) if rho else grad(loss, has_aux=True))

    def split(self, W: torch.Tensor):
        """``(p, b)``: views of the [C, d] rows as per-tensor [C, *shape] parameters and buffers, by name.
        The gradient is taken per parameter tensor (a gradient through slices of one [C, d] tensor
        would add a zero-filled [C, d] temporary per parameter tensor, every step)."""
        C = W.size(0)
        views = {e.name: W[:, e.offset : e.offset + e.numel].view(C, *e.shape) for e in self.spec.entries}
        return (
            {k: v for k, v in views.items() if k not in self._buffer_names},
            {e.name: views[e.name] for e in self.buffer_entries},
        )

    @contextlib.contextmanager
    def _bn_patch(self):
        """While the vmapped gradient runs, each BatchNorm's forward is :func:`masked_batch_norm` on the
        current client's mask; its new running statistics go to ``_bn_box["out"]`` (nothing is written)."""
        box = self._bn_box

        def forward(name, mod, inp):
            y, st = masked_batch_norm(mod, inp, box["m"])
            if st is not None:
                pre = f"{name}." if name else ""
                box["out"][pre + "running_mean"], box["out"][pre + "running_var"] = st
            return y

        for name, mod in self.bns.items():
            mod.forward = lambda inp, _n=name, _m=mod: forward(_n, _m, inp)
        try:
            yield
        finally:
            for mod in self.bns.values():
                del mod.forward
            box.clear()

    def grads(self, W, xb, yb, m):
        """``(G, ce, stats)``: the [C, d] (FedPGVC's rho: [C, 2, d]) gradients of the chunk's losses, the
        per-sample losses and, with BatchNorm, the [C, d - dp] running statistics after the step (else None)."""
        p, b = self.split(W)
        with self._bn_patch():
            g, aux = self._fn(p, b, xb, yb, m)
        ce, stats = aux if self.bns else (aux, None)
        lead = W.shape[:1] + ((2,) if self.form.needs_rho else ())  # [C] or [C, 2] before d
        parts = [g[e.name].reshape(*lead, -1) for e in self.spec.entries if not e.is_buffer]
        if self.dp < self.spec.d:  # buffers: no gradient
            parts.append(W.new_zeros(*lead, self.spec.d - self.dp))
        return torch.cat(parts, dim=-1), ce, stats

    def probe(self) -> None:
        """One vmapped gradient of two clients on one sample: raises if torch.func cannot run the model.
        Then measures the bytes autograd saves for one client's batch (``per_client``, :func:`client_bytes`)."""
        W = self.local.global_flat.detach().unsqueeze(0).expand(2, -1).contiguous()
        x = self.x[:1].unsqueeze(0).expand(2, *self.x[:1].shape)
        y = self.y[:1].unsqueeze(0).expand(2, 1)
        m = torch.ones(2, 1, dtype=W.dtype, device=W.device)
        self.grads(W, x, y, m)
        B = min(int(self.train.batch_size), int(self.x.size(0)))
        w = self.local.global_flat.detach().clone().requires_grad_(True)
        own, saved = w.untyped_storage().data_ptr(), [0]

        def pack(t):
            if t.untyped_storage().data_ptr() != own:  # the weights are the buffer's row: not counted
                saved[0] += t.numel() * t.element_size()
            return t

        p, b = self.split(w.unsqueeze(0))
        with self._bn_patch(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            self._loss(
                {k: v[0] for k, v in p.items()},
                {k: v[0] for k, v in b.items()},
                self.x[:B],
                self.y[:B],
                torch.ones(B, dtype=w.dtype, device=w.device),
            )
        self.activation_bytes = saved[0]
        self.per_client = client_bytes(
            self.spec.d, self.dp, saved[0], self.train.momentum > 0, self.form.needs_rho, w.element_size()
        )

    def single_sample_batch(self, cid: int) -> Optional[str]:
        """Why client ``cid`` trains sequentially under BatchNorm: a batch of one sample, which torch's
        BatchNorm refuses where its spatial size is 1 (the sequential loop applies the bad-client policy)."""
        if not self.bns:
            return None
        t, n = self.train, int(self.parts_host[cid].numel())
        b = min(int(t.batch_size), n)
        if b == 1 or (not t.drop_last and n % b == 1):
            return "a batch of one sample with BatchNorm"
        return None

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
            idx[i] = own[0]  # masked places hold one of the client's own samples
            gen = torch.Generator().manual_seed(sd)
            stop = n - (n % b) if t.drop_last else n
            nb = -(-stop // b)  # batches per epoch (the last one may be short)
            done = 0
            while done < k:  # a fresh permutation per epoch, as ClientTrainer._batches
                perm = own[torch.randperm(n, generator=gen)][:stop]
                take = min(nb, k - done)
                rows = torch.full((nb * b,), -1, dtype=torch.long)
                rows[:stop] = perm
                rows = rows.view(nb, b)[:take]
                ok = rows >= 0
                idx[i, done : done + take, :b] = torch.where(ok, rows, rows[:, :1])
                msk[i, done : done + take, :b] = ok
                done += take
        return idx.to(self.x.device), msk

    # ---- one chunk ------------------------------------------------------------------------------------
    def _train_chunk(self, r: int, items: List[Tuple[int, int, Dict[str, Any], float, int]], factor: float):
        """Trains the chunk's clients into the next rows of local.buf; returns (accepted, bad) with bad
        the (pos, cid) of clients whose update is not finite (their rows already released)."""
        local, t, buf = self.local, self.train, self.local.buf
        dev, x0 = local.global_flat.device, local.global_flat
        C = len(items)
        cids = [c for _, c, _, _, _ in items]
        ns = [int(self.parts[c].numel()) for c in cids]
        epochs = [None if t.steps is not None else int(e) for _, _, _, _, e in items]
        steps = [local.trainer.planned_steps(n, e) for n, (_, _, _, _, e) in zip(ns, items)]
        seeds = [client_seed(local.cfg.seed, r, c) for c in cids]
        s0 = buf.count
        for c, n in zip(cids, ns):
            buf.add(c, n)
        W = buf.data[s0 : s0 + C]
        W.copy_(x0.to(W.dtype).unsqueeze(0).expand(C, -1))
        lr = torch.tensor([b * factor for _, _, _, b, _ in items], dtype=torch.float64)
        ch = Chunk(
            W=W,
            x=x0,
            lr=lr,
            steps=steps,
            epochs=epochs,
            payloads=[p for _, _, p, _, _ in items],
            client_ids=cids,
            momentum=float(t.momentum),
            weight_decay=float(t.weight_decay),
        )
        form = self.form
        form.begin(ch)
        idx, msk = self._indices(cids, steps, seeds)
        mask = msk.to(device=dev, dtype=W.dtype)
        lr_d = lr.to(device=dev, dtype=W.dtype)
        steps_d = torch.tensor(steps, device=dev)
        mom, wd = float(t.momentum), float(t.weight_decay)
        nesterov = bool(t.nesterov) and mom > 0
        dp = self.dp
        Wp, Wb = W[:, :dp], W[:, dp:]  # the optimizer steps the parameters; BatchNorm sets Wb
        buf_m = torch.zeros_like(Wp) if mom > 0 else None
        loss_sum = torch.zeros(C, dtype=torch.float64, device=dev)
        self.model.train()
        for s in range(max(steps)):
            ib, m = idx[:, s], mask[:, s]
            xb, yb = self.x[ib], self.y[ib]
            G, ce, stats = self.grads(W, xb, yb, m)
            rho = None
            if form.needs_rho:
                G, rho = G[:, 0], G[:, 1]
            active = steps_d > s
            loss_sum += torch.where(m > 0, ce, 0.0).sum(1).double()
            form.before_step(ch, G, rho, ce, m, active)
            Gp = G[:, :dp]  # (a rule may have written into the buffer columns)
            if t.grad_clip is not None:
                norm = torch.linalg.vector_norm(Gp, dim=1)
                Gp.mul_((float(t.grad_clip) / (norm + 1e-6)).clamp(max=1.0).unsqueeze(1))
            form.in_step(ch, G)
            skip = form.skip()
            act = active if skip is None else active & ~skip
            a = act.unsqueeze(1)  # a client past its last step (or skipping it) stays put:
            if wd:  # its d is 0 (even a NaN one), its buffer kept, its lr 0
                Gp.add_(Wp, alpha=wd)
            Gp.masked_fill_(~a, 0.0)
            if buf_m is not None:
                buf_m.mul_(torch.where(a, mom, 1.0).to(W.dtype)).add_(Gp)
                step = Gp.add_(buf_m, alpha=mom) if nesterov else buf_m
            else:
                step = Gp
            Wp.addcmul_(step, lr_d.unsqueeze(1) * a, value=-1.0)  # no [C, d] temporary
            if stats is not None:  # the forward ran (even for a skipped step): new statistics
                Wb.copy_(torch.where(active.unsqueeze(1), stats, Wb))
        payloads = form.end(ch)
        W.sub_(x0.to(W.dtype))  # the rows become the updates local - global
        if self.local.client_clip is not None:  # client-side DP clipping, each row as written
            clip_rows_(W, self.local.client_clip)
        if self.local.dp_norms is not None:  # server-side DP: the rows' norms while hot
            self.local.dp_norms.update(zip(buf.client_ids[s0 : s0 + C], row_norms(W).tolist()))
        for mod in self.bns.values():  # one more batch per client step, as the shared model counts
            if mod.num_batches_tracked is not None:
                mod.num_batches_tracked.add_(sum(steps))
        torch.manual_seed(seeds[-1])  # the global torch RNG as the sequential loop leaves it
        seen = msk.sum((1, 2)).tolist()
        losses = (loss_sum.cpu() / torch.tensor([max(v, 1) for v in seen], dtype=torch.float64)).tolist()
        # the rows are screened here only when the aggregator does not screen them (LocalTraining.screen_at_write)
        finite = ops.finite_rows(W).tolist() if local.screen_at_write else [True] * C  # one host sync per chunk
        accepted, bad = [], []
        for i, (pos, cid, _, _, _) in enumerate(items):
            if finite[i]:
                accepted.append(
                    {
                        "pos": pos,
                        "cid": int(cid),
                        "n": float(ns[i]),
                        "payload": payloads[i],
                        "loss": losses[i],
                        "steps": steps[i],
                    }
                )
            else:
                bad.append((pos, int(cid)))
        if bad:  # release the rows of non-finite updates, keep the order
            keep = [i for i in range(C) if finite[i]]
            if keep:
                W[: len(keep)].copy_(W[torch.tensor(keep, device=W.device)])
            del buf.client_ids[s0 + len(keep) :], buf.num_examples[s0 + len(keep) :]
            for j, i in enumerate(keep):
                buf.client_ids[s0 + j], buf.num_examples[s0 + j] = cids[i], float(ns[i])
        return accepted, bad

    # ---- a round ----------------------------------------------------------------------------------
    def train_local(
        self, r: int, ids: Sequence[int], mine, payload_of: Callable[[int], Any], factor: float
    ) -> Dict[str, Any]:
        """Phase 2 of the round, batched (module docstring); ``Simulation.train_local``'s return value."""
        local, cfg = self.local, self.local.cfg
        local.sync()
        t0 = time.perf_counter()
        accepted: List[Dict[str, Any]] = []
        excluded: List[Any] = []
        error = None
        pending: List[Tuple[int, int, Dict[str, Any], float, int]] = []
        dev = local.global_flat.device
        cap = self.chunk or chunk_size(free_memory(dev), self.per_client, len(mine), dev)

        def flush():
            nonlocal error
            if not pending:
                return
            acc, bad = self._train_chunk(r, list(pending), factor)
            accepted.extend(acc)
            for pos, cid in bad:
                reason = "update contains NaN/Inf"
                error = error or client_failed(
                    cfg.bad_client_policy, r, pos, cid, reason, True, BadClientError(reason), excluded
                )
            pending.clear()

        for pos in mine:
            if error is not None:
                break
            cid = ids[pos]
            base_lr, epochs = local.hetero.get(cid, r)
            try:
                payload = payload_of(pos)
                why = None if self.parts[cid].numel() > 0 else "empty"
                why = why or self.single_sample_batch(cid) or self.form.client_reason(payload)
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
            one = self.sequential.train_local(
                r, ids, [pos], (lambda p, v=payload: v) if payload is not None else payload_of, factor
            )
            accepted.extend(one["accepted"])
            excluded.extend(one["excluded"])
            error = one["error"]
        if error is None:
            flush()
        local.sync()
        return {"accepted": accepted, "excluded": excluded, "error": error, "t_local": time.perf_counter() - t0}

    def close(self) -> None:
        pass


def for_run(local: LocalTraining) -> Optional[BatchedExecutor]:
    """The batched executor for a set-up run (``local``: its ``runstate.LocalTraining``), or None (sequential). ``clients_at_once``: "off"
    (False) -> None; "auto" -> batched on CUDA, sequential on the CPU; N -> batched in chunks of N.
    When batched training was asked for (N, or auto on CUDA) and the run cannot do it, one warning
    line says why and the run trains sequentially."""
    cfg = local.cfg
    v = cfg.clients_at_once
    if v is False or v == "off" or cfg.workers > 1 or getattr(cfg, "distributed", False):
        return None
    if v == "auto" and local.device.type not in AUTO_DEVICES:
        return None
    chunk = None if v == "auto" else int(v)
    rule = local.rules.fresh()
    why = batch_reason(cfg, local.model, rule, local.trainer.transform, local.trainer.criterion)
    ex = None
    if why is None:
        try:
            ex = BatchedExecutor(local, chunk)
            ex.probe()
        except Exception as e:  # noqa: BLE001 - said in one line, then sequential
            why, ex = f"torch.func cannot vmap the model: {type(e).__name__}: {e}", None
    if why is not None:
        log.warning("clients_at_once=%s: training clients one at a time: %s", v, why)
        return None
    dev = local.global_flat.device
    free, mib = free_memory(dev), ex.per_client / 2**20
    if chunk is None:
        fits = chunk_size(free, ex.per_client, local.per_round, dev)  # RunError when not even one client fits
        log.info(
            "clients_at_once=auto: batched executor, chunks of up to %d clients (%.1f MiB each, %s MiB free)",
            fits,
            mib,
            "?" if free is None else f"{free / 2**20:.0f}",
        )
    elif free is not None and chunk * ex.per_client > free:
        log.warning(
            "clients_at_once=%d: %d clients need about %.0f MiB of working memory on %s, %.0f MiB are "
            "free: a smaller N (or auto) avoids running out",
            chunk,
            chunk,
            chunk * mib,
            dev,
            free / 2**20,
        )
    else:
        log.info("clients_at_once=%d: batched executor (%.1f MiB per client)", chunk, mib)
    return ex
