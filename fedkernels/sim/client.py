"""Local training of one client, with the method's ClientRule hooks.

One model object is reused for every client: its tensors are *bound* to a working flat vector
(``FlatSpec.bind_``), so starting a client from the global model is one copy
(``work.copy_(global_flat)``) and its update ``local - global`` is written straight into its row of
the server's ``UpdateBuffer`` (``write_delta``).

Determinism: everything random in a client's round (mini-batch order, augmentation, dropout) comes
from a generator seeded by ``(seed, round, client_id)`` (:func:`client_seed`), so a run is a pure
function of its config, and a resumed run repeats an uninterrupted one bit for bit.

Hook order (see ``fedkernels.algorithms.base.ClientRule``)::

    rule.begin(ctx, model)
    for each mini-batch:
        ctx.batch = (x, y)
        loss = criterion(model(x), y) + (rule.loss_term(ctx, model) or 0); ctx.loss = loss
        loss.backward()
        rule.before_step(ctx, model)
        [clip_grad_norm_ when train.grad_clip is set]
        if not rule.step(ctx, model, optimizer): optimizer.step()
        ctx.step += 1; rule.after_step(ctx, model)
    payload = rule.end(ctx, model)

``ctx.extras`` holds, before ``begin``: ``epochs`` (this client's local epochs, None when
``train.steps`` is set), ``planned_steps`` (local steps this round), ``batch_size``, ``momentum``,
``weight_decay``, ``optimizer`` (its name), ``base_lr`` (the lr before the round schedule) and
``local_data`` (the client's whole local set in stored order, untransformed, as (x, y) chunks of at
most 1024 samples; a generator: nothing is gathered unless a rule reads it, as FedPGVC's ``code`` mode).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch
from torch import nn

from .. import ops
from ..flat import row_norms
from ..algorithms.base import ClientContext, ClientRule
from .config import TrainConfig

log = logging.getLogger("fedkernels.sim")

# stream tags for derived seeds (distinct streams never share a generator)
STREAM_CLIENT, STREAM_SAMPLING, STREAM_HETERO, STREAM_INIT, STREAM_SUBSET = 1, 2, 3, 4, 5


def derive_seed(seed: int, stream: int, *keys: int) -> int:
    """A 63-bit seed from (seed, stream, keys...) via numpy's SeedSequence (stable across versions)."""
    ss = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(stream)] + [int(k) for k in keys])
    return int(ss.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def client_seed(seed: int, rnd: int, client_id: int) -> int:
    """The seed of client ``client_id``'s local training in round ``rnd``."""
    return derive_seed(seed, STREAM_CLIENT, rnd, client_id)


def schedule_factor(train: TrainConfig, rnd: int, rounds: int) -> float:
    """lr multiplier of round ``rnd`` (0-based) of ``rounds`` for the configured schedule."""
    if train.lr_schedule == "constant":
        return 1.0
    if train.lr_schedule == "step":
        return float(train.lr_gamma) ** (rnd // max(1, int(train.lr_step)))
    if train.lr_schedule == "cosine":
        lo = float(train.lr_min) / float(train.lr) if train.lr > 0 else 0.0
        c = 0.5 * (1.0 + math.cos(math.pi * rnd / max(1, rounds)))
        return lo + (1.0 - lo) * c
    raise ValueError(f"unknown lr_schedule {train.lr_schedule!r}")


class HeteroCompute:
    """Per-client learning rates and epochs (FedECADO §6, eqs. 43-44): lr_i ~ U[lr_range] (or
    log-uniform), E_i ~ U{epochs_range}; drawn once per client per run (``redraw="run"``) or per
    (client, round) (``redraw="round"``), from the run seed, so every method sees the same draws."""

    def __init__(self, train: TrainConfig, num_clients: int, seed: int):
        self.train, self.h, self.seed, self.n = train, train.hetero, int(seed), int(num_clients)
        self._fixed = [self._draw(c, -1) for c in range(self.n)] if self.h.enabled and self.h.redraw == "run" else None

    def _draw(self, cid: int, rnd: int):
        rng = np.random.default_rng(derive_seed(self.seed, STREAM_HETERO, rnd + 1, cid))
        lr = float(self.train.lr)
        if self.h.lr_range is not None:
            lo, hi = float(self.h.lr_range[0]), float(self.h.lr_range[1])
            lr = (
                float(math.exp(rng.uniform(math.log(lo), math.log(hi))))
                if self.h.lr_dist == "loguniform"
                else float(rng.uniform(lo, hi))
            )
        ep = int(self.train.epochs)
        if self.h.epochs_range is not None:
            ep = int(rng.integers(int(self.h.epochs_range[0]), int(self.h.epochs_range[1]) + 1))
        return lr, ep

    def get(self, cid: int, rnd: int):
        """(base lr, epochs) of client ``cid`` in round ``rnd``."""
        if not self.h.enabled:
            return float(self.train.lr), int(self.train.epochs)
        if self._fixed is not None:
            return self._fixed[cid]
        return self._draw(cid, rnd)

    def table(self) -> List[Dict[str, Any]]:
        return [{"client_id": c, "lr": self.get(c, 0)[0], "epochs": self.get(c, 0)[1]} for c in range(self.n)]


@dataclass
class ClientResult:
    client_id: int
    num_examples: int
    train_loss: float  # mean criterion loss over the local steps' samples (without loss_term)
    steps: int
    lr: float
    epochs: Optional[int]
    payload: Dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


class ClientTrainer:
    """Trains clients one at a time on a shared model whose tensors are views of ``self.work``."""

    def __init__(
        self,
        model: nn.Module,
        spec,
        x: torch.Tensor,
        y: torch.Tensor,
        client_indices: Sequence[torch.Tensor],
        train: TrainConfig,
        transform: Optional[Callable] = None,
        criterion: Optional[nn.Module] = None,
    ):
        self.model, self.spec = model, spec
        self.x, self.y = x, y
        self.client_indices = list(client_indices)
        self.train_cfg = train
        self.transform = transform
        self.criterion = criterion or nn.CrossEntropyLoss()
        dev = x.device
        self.work = torch.empty(spec.d, dtype=spec.dtype, device=dev)
        spec.bind_(model, self.work)
        self.device = dev

    def num_examples(self, cid: int) -> int:
        return int(self.client_indices[cid].numel())

    def planned_steps(self, n: int, epochs: int) -> int:
        t = self.train_cfg
        if t.steps is not None:
            return int(t.steps)
        B = min(int(t.batch_size), n)
        per_epoch = n // B if t.drop_last else -(-n // B)
        return max(1, per_epoch) * int(epochs)

    def _optimizer(self, lr: float):
        t = self.train_cfg
        params = [p for p in self.model.parameters() if p.requires_grad]
        if t.optimizer == "adam":
            return torch.optim.Adam(params, lr=lr, weight_decay=t.weight_decay)
        return torch.optim.SGD(
            params,
            lr=lr,
            momentum=t.momentum,
            weight_decay=t.weight_decay,
            nesterov=bool(t.nesterov) and t.momentum > 0,
        )

    def _batches(self, idx: torch.Tensor, steps: int, gen: torch.Generator):
        """Yields index tensors of ``steps`` mini-batches: a fresh permutation per epoch."""
        n, B = idx.numel(), min(int(self.train_cfg.batch_size), idx.numel())
        done = 0
        while done < steps:
            perm = idx[torch.randperm(n, generator=gen).to(idx.device)]
            stop = n - (n % B) if self.train_cfg.drop_last else n
            for s in range(0, stop, B):
                yield perm[s : s + B]
                done += 1
                if done >= steps:
                    return

    def train(
        self,
        cid: int,
        rnd: int,
        global_flat: torch.Tensor,
        lr: float,
        epochs: int,
        seed: int,
        rule: Optional[ClientRule] = None,
        payload: Optional[Dict[str, Any]] = None,
        base_lr: Optional[float] = None,
    ) -> ClientResult:
        """Local training of client ``cid`` from ``global_flat``; the local model is left in
        ``self.work`` (and the model). Raises on unusable input; the server applies its policy."""
        t0 = time.perf_counter()
        idx = self.client_indices[cid]
        n = int(idx.numel())
        if n == 0:
            raise ValueError(f"client {cid} has no training examples")
        t = self.train_cfg
        self.work.copy_(global_flat)
        model = self.model
        model.train()
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)  # dropout and other in-model randomness
        opt = self._optimizer(lr)
        steps = self.planned_steps(n, epochs)
        ctx = ClientContext(
            client_id=int(cid),
            round=int(rnd),
            global_flat=global_flat,
            spec=self.spec,
            lr=float(lr),
            num_examples=n,
            payload=dict(payload or {}),
        )
        ctx.extras.update(
            epochs=None if t.steps is not None else int(epochs),
            planned_steps=steps,
            batch_size=int(t.batch_size),
            momentum=float(t.momentum),
            weight_decay=float(t.weight_decay),
            optimizer=t.optimizer,
            base_lr=float(base_lr if base_lr is not None else lr),
            local_data=((self.x[c], self.y[c]) for c in idx.split(1024)),
        )
        if rule is not None:
            rule.begin(ctx, model)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        seen = 0
        params = [p for p in model.parameters() if p.requires_grad]
        for bidx in self._batches(idx, steps, gen):
            xb, yb = self.x[bidx], self.y[bidx]
            if self.transform is not None:
                xb = self.transform(xb, gen)
            ctx.batch = (xb, yb)
            opt.zero_grad(set_to_none=True)
            out = model(xb)
            data_loss = self.criterion(out, yb)
            loss = data_loss
            if rule is not None:
                extra = rule.loss_term(ctx, model)
                if extra is not None:
                    loss = loss + extra
            ctx.loss = loss
            loss.backward()
            if rule is not None:
                rule.before_step(ctx, model)
            if t.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(params, float(t.grad_clip))
            if rule is None or not rule.step(ctx, model, opt):
                opt.step()
            ctx.step += 1
            if rule is not None:
                rule.after_step(ctx, model)
            loss_sum += data_loss.detach().double() * yb.numel()
            seen += yb.numel()
        out_payload = rule.end(ctx, model) if rule is not None else {}
        ctx.batch = ctx.loss = None
        return ClientResult(
            client_id=int(cid),
            num_examples=n,
            train_loss=float(loss_sum) / max(seen, 1),
            steps=ctx.step,
            lr=float(lr),
            epochs=None if t.steps is not None else int(epochs),
            payload=dict(out_payload or {}),
            seconds=time.perf_counter() - t0,
        )


# ---- one client of a round, as every executor trains it -------------------------------------------
class BadClientError(RuntimeError):
    """A client failed and bad_client_policy is "raise"."""


# what one client's training may raise and still be a bad client (excluded, or BadClientError under
# "raise"); BadUpdateError is a ValueError. Anything else stops the run (fedkernels.sim.simulation).
CLIENT_ERRORS = (BadClientError, ValueError, ArithmeticError)


def client_error(e: BaseException):
    """``(reason, bad_client)`` of an exception raised while training one client: the line that names
    it and whether it is that client's bad update (:data:`CLIENT_ERRORS`) or a failure of the run."""
    reason = str(e) if isinstance(e, BadClientError) else f"{type(e).__name__}: {e}"
    return reason, isinstance(e, CLIENT_ERRORS)


def train_client(local, buf, cid: int, r: int, base_lr: float, factor: float, epochs, payload) -> ClientResult:
    """Trains client ``cid`` in round ``r`` (``local``: the run's ``runstate.LocalTraining``: its
    trainer, the client's rule ``local.rules.get(cid)``) and writes its update into the next row of
    ``buf``. With ``local.screen_clients`` (bad_client_policy="raise", or an aggregator that does not
    screen the rows itself) the row is checked here: BadClientError (row released) when it is not
    finite; otherwise the aggregator's first read of U screens it (``Aggregator.screen_in_pass``)."""
    lora = local.lora  # LoRA with ranks below the server's: the client starts from its rank's share (sim/lora.py)
    start = local.global_flat if lora is None else lora.client_start(cid, local.global_flat)
    res = local.trainer.train(
        cid,
        r,
        start,
        base_lr * factor,
        epochs,
        client_seed(local.cfg.seed, r, cid),
        rule=local.rules.get(cid),
        payload=payload,
        base_lr=base_lr,
    )
    slot = buf.add(cid, res.num_examples)
    row = buf.write_delta(slot, local.model, local.global_flat, local.client_clip)
    if local.dp_norms is not None:  # server-side DP: the row's norm while it is hot
        local.dp_norms[cid] = float(row_norms(row.unsqueeze(0))[0])
    if local.screen_clients:
        if not bool(ops.finite_rows(row.unsqueeze(0))[0]):
            buf.client_ids.pop()
            buf.num_examples.pop()
            raise BadClientError("update contains NaN/Inf")
        if not math.isfinite(res.train_loss):
            log.warning("client %d: non-finite train loss with a finite update", cid)
    return res


def eval_batch(model: nn.Module, xb: torch.Tensor, yb: torch.Tensor, criterion: Optional[nn.Module] = None):
    """One evaluation batch (the caller puts the model in eval mode, under no_grad): the number of
    correct predictions and the float64 summed loss. ``evaluate`` and the workers both sum these in
    batch order, so an evaluation split over worker processes gives the same bits."""
    out = model(xb)
    loss = (criterion or nn.CrossEntropyLoss(reduction="sum"))(out, yb).double()
    return (out.argmax(1) == yb).sum(), loss


def batch_losses(model: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
    """Per-sample float64 cross-entropy of one batch (``client_losses`` and the workers)."""
    return nn.CrossEntropyLoss(reduction="none")(model(xb), yb).double()


@torch.no_grad()
def evaluate(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024, criterion: Optional[nn.Module] = None
):
    """(accuracy, mean loss) of ``model`` on (x, y), in eval mode, in batches."""
    crit = criterion or nn.CrossEntropyLoss(reduction="sum")
    was = model.training
    model.eval()
    correct = torch.zeros((), dtype=torch.int64, device=x.device)
    loss = torch.zeros((), dtype=torch.float64, device=x.device)
    n = y.numel()
    for s in range(0, n, batch_size):
        c, l = eval_batch(model, x[s : s + batch_size], y[s : s + batch_size], crit)
        loss += l
        correct += c
    model.train(was)
    if n == 0:
        return float("nan"), float("nan")
    return int(correct) / n, float(loss) / n


@torch.no_grad()
def client_losses(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    client_indices: Sequence[torch.Tensor],
    clients: Sequence[int],
    batch_size: int = 1024,
) -> List[float]:
    """Loss of the (global) model on each listed client's training data (Kuramoto §2.8: Var_k of these)."""
    was = model.training
    model.eval()
    cl = list(clients)
    if not cl:
        return []
    idx = torch.cat([client_indices[c] for c in cl])
    owner, sizes = sample_owners(client_indices, cl, idx.device)
    sums = torch.zeros(len(cl), dtype=torch.float64, device=x.device)
    for s in range(0, idx.numel(), batch_size):  # on the device, no host sync until the end
        b = idx[s : s + batch_size]
        sums.index_add_(0, owner[s : s + batch_size], batch_losses(model, x[b], y[b]))
    model.train(was)
    counts = sizes.clamp_min(1).to(device=x.device, dtype=torch.float64)
    return (sums / counts).tolist()


def sample_owners(client_indices: Sequence[torch.Tensor], clients: Sequence[int], device="cpu"):
    """``(owner, sizes)``: for the listed clients' samples concatenated in order, the position in
    ``clients`` of each sample's client ([sum n_c] int64 on ``device``), and the [C] sizes (host)."""
    sizes = torch.tensor([client_indices[c].numel() for c in clients], dtype=torch.long)
    owner = torch.repeat_interleave(
        torch.arange(len(sizes), device=device), sizes.to(device), output_size=int(sizes.sum())
    )
    return owner, sizes
