"""Evaluation of the global model in one call: test accuracy and loss, and its loss on clients' training
data (``Simulation.evaluate_round``), on the device where the data already is, with one host transfer.

    correct = sum_b #{argmax f(x_b) = y_b},  loss = sum_b CE_sum(f(x_b), y_b)       (float64, batch order)
    client_loss_c = sum_{b} index_add(owner_b, CE(f(x_b), y_b)) / n_c                 (float64)

The test set and the training data are resident on the run's device (``Simulation.setup`` moved them
there once): a batch is a slice (test) or one index gather (clients' samples), never a DataLoader.
The counts and sums stay on the device until the end, where one transfer brings accuracy, test loss
and every client's loss to the host (the per-batch helpers :func:`eval_batch` / :func:`batch_losses`
are the ones the worker processes run).

Rows per forward (:func:`eval_rows`): on the CPU ``eval_batch_size``, the batches ``workers=N`` splits the
evaluation by, so one process and the workers give the same bits; on CUDA as many rows as a quarter
of the free memory holds by the measured output bytes of one row's forward (at least
``eval_batch_size``, at most the whole set): large batches, few launches. Accuracy is then the same
count; the loss sums the same float64 per-batch sums in other batches (equal to fp rounding).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

GPU_DEVICES = ("cuda",)  # where the evaluation takes memory-sized batches (elsewhere: eval_batch_size)


def row_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Output bytes of every module in one forward of one row of ``x`` (eval mode, no grad): an upper
    bound of what one more row of an evaluation batch holds at once."""
    total = [0]

    def hook(mod, inp, out):
        if isinstance(out, torch.Tensor):
            total[0] += out.numel() * out.element_size()

    hs = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        model(x[:1])
    finally:
        for h in hs:
            h.remove()
    return total[0] + x[:1].numel() * x.element_size()


def eval_rows(
    model: nn.Module, x: torch.Tensor, batch_size: int, free: Optional[int] = None, fraction: float = 0.25
) -> int:
    """Rows per evaluation forward (module docstring); ``free``: the device's free bytes (None: asked
    of the device). Call in eval mode under no_grad."""
    n, bs = int(x.size(0)), max(1, int(batch_size))
    if x.device.type not in GPU_DEVICES or n <= bs:
        return bs
    if free is None:
        from .batched import free_memory

        free = free_memory(x.device)
    if free is None:
        return bs
    per = max(1, row_bytes(model, x))
    return int(min(n, max(bs, int(fraction * free) // per)))


@torch.no_grad()
def evaluate_global(
    model: nn.Module,
    x_test: torch.Tensor,
    y_test: torch.Tensor,
    batch_size: int = 1024,
    x: Optional[torch.Tensor] = None,
    y: Optional[torch.Tensor] = None,
    parts: Optional[Sequence[torch.Tensor]] = None,
    clients: Optional[Sequence[int]] = None,
    free: Optional[int] = None,
) -> Tuple[float, float, Optional[List[float]]]:
    """``(accuracy, mean test loss, clients' losses or None)`` of ``model`` in eval mode: the test set,
    and (``clients``, with the training data ``x``, ``y`` and the clients' index tensors ``parts``) the
    mean loss on each listed client's training data, in that order ([] for no client). NaN accuracy
    and loss for an empty test set. One host transfer; rows per forward: :func:`eval_rows`."""
    was = model.training
    model.eval()
    try:
        dev = x_test.device
        n = int(y_test.numel())
        rows = eval_rows(model, x_test, batch_size, free) if n else 1
        correct = torch.zeros((), dtype=torch.float64, device=dev)
        loss = torch.zeros((), dtype=torch.float64, device=dev)
        crit = nn.CrossEntropyLoss(reduction="sum")
        for s in range(0, n, rows):
            c, l = eval_batch(model, x_test[s : s + rows], y_test[s : s + rows], crit)
            loss += l
            correct += c
        out = [correct.unsqueeze(0), loss.unsqueeze(0)]
        cl = None if clients is None else [int(c) for c in clients]
        if cl:
            if x is None or y is None or parts is None:
                raise ValueError("evaluate_global: clients given without the training data x, y and parts")
            idx = torch.cat([parts[c] for c in cl])
            owner, sizes = sample_owners(parts, cl, idx.device)
            sums = torch.zeros(len(cl), dtype=torch.float64, device=x.device)
            rc = eval_rows(model, x, batch_size, free) if idx.numel() else 1
            for s in range(0, idx.numel(), rc):  # one gather per batch, on the device
                b = idx[s : s + rc]
                sums.index_add_(0, owner[s : s + rc], batch_losses(model, x[b], y[b]))
            out.append(sums / sizes.clamp_min(1).to(device=sums.device, dtype=torch.float64))
        host = torch.cat([t.to(dev) for t in out]).tolist()  # the one host transfer
    finally:
        model.train(was)
    acc, tl = (host[0] / n, host[1] / n) if n else (float("nan"), float("nan"))
    return acc, tl, (None if cl is None else host[2:])


def non_finite_evaluation(metrics: dict) -> Optional[str]:
    """What of a round's evaluation is not finite (``"test loss nan"``, ``"accuracy inf"``, ...), or None:
    a model whose test loss is NaN/Inf has gone wrong although its parameters are finite (e.g. a
    BatchNorm variance below 0); the run stops there (``Simulation._rounds``), its checkpoints kept."""
    bad = [
        f"{what} {metrics[key]}"
        for key, what in (("test_loss", "test loss"), ("accuracy", "accuracy"))
        if isinstance(metrics.get(key), float) and not np.isfinite(metrics[key])
    ]
    return ", ".join(bad) or None


# ---- batch by batch: the per-batch steps the worker processes run too ----------------------------
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
