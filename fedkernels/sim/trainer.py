"""Local training of one client, with the method's ClientRule hooks.

One model object is reused for every client: its tensors are *bound* to a working flat vector
(``FlatSpec.bind_``), so starting a client from the global model is one copy
(``work.copy_(global_flat)``) and its update ``local - global`` is written straight into its row of
the server's ``UpdateBuffer`` (``write_delta``).

Determinism: everything random in a client's round (mini-batch order, augmentation, dropout) comes
from a generator seeded by ``(seed, round, client_id)`` (:func:`~fedkernels.sim.seeds.client_seed`), so a run is a pure
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
from typing import Any, Callable, Dict, Optional, Sequence

import torch
from torch import nn

from .. import ops
from ..flat import row_norms
from ..algorithms.base import ClientContext, ClientRule
from .client_errors import BadClientError
from .config import TrainConfig
from .seeds import client_seed

log = logging.getLogger("fedkernels.sim")


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
def train_client(local, buf, cid: int, r: int, base_lr: float, factor: float, epochs, payload) -> ClientResult:
    """Trains client ``cid`` in round ``r`` (``local``: the run's ``runstate.LocalTraining``: its
    trainer, the client's rule ``local.rules.get(cid)``) and writes its update into the next row of
    ``buf``. With ``local.screen_at_write`` (bad_client_policy="raise", or an aggregator that does not
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
    if local.screen_at_write:
        if not bool(ops.finite_rows(row.unsqueeze(0))[0]):
            buf.client_ids.pop()
            buf.num_examples.pop()
            raise BadClientError("update contains NaN/Inf")
        if not math.isfinite(res.train_loss):
            log.warning("client %d: non-finite train loss with a finite update", cid)
    return res
