"""FedAWARE's options, its momentum table's storage and its diversity statistic, apart from the
method (fedaware/__init__.py).

Options (spec §3 [OURS] defaults): ``alpha`` 0.5; ``normalize`` True (the authors' code; False =
paper text: raw momenta); ``warmup`` "explore" (FedAvg steps until every client has been seen;
the round that completes exploration already uses the AWARE step), "startup_full" (AWARE from
round 0 over all N rows; unseen rows are zero), "mask" (AWARE from round 0 over seen clients
only); ``init`` "ema_from_zero" (code) or "first_update" (m_i := U_i at first participation);
solver ``method`` ("away" = Frank-Wolfe with away steps and face polish (default: the §2.6
stopping rule, but linear convergence where plain Frank-Wolfe zig-zags at O(1/t)); "fw" = the
plain §2.6 Frank-Wolfe; "pairwise"; ``code_compat=True`` selects the authors' solver),
``solver_init`` "best_pair" / "min_diag", ``max_iter`` 1000, ``tol`` 1e-6 (relative), ``tol_abs``
1e-12, ``warm_start`` (start from the previous lam; default False); ``zero_fallback`` "zero"
(origin in the hull: zero step, flagged ``zero_direction``) or "na"; ``variant`` "aware" or "na"
(FedAWARE-NA ablation: x + server_lr sum_i p_i m_i over all clients); ``extension`` None, "fedavg"
or "fedavgm" (the AWARE projection extension: the base method's step G is replaced by
(<G, d>/<d, d>) d; its own state evolves unchanged), ``ext_beta`` (0.7, for fedavgm); ``elud``
(log the empirical local-update diversity: up to ELUD_GRAM_MAX_K participants from their Gram, which
is also the screening pass over U; above it from two fp64 sums in the momentum pass, after a finite_rows
screen); ``num_clients`` (N, or from ``setup``); ``solver`` (a callable with the signature of ``fedkernels.ops.min_norm``; default
ops.min_norm); ``momentum_dtype`` / ``momentum_device`` (storage of the N x d table, default the
global model's: e.g. torch.bfloat16 for half the memory and/or "cpu" for large models on one device);
``momentum_file`` (a path: the table lives in that raw file, mapped on the host, created as zeros at
the first round with its blocks reserved; an existing file is refused unless a state_dict naming it is
loaded). With a file, ``state_dict()`` holds a reference to it (path, shape, dtype, version: the count
of completed momentum updates), not an N x d copy; ``load_state_dict`` reopens the file and refuses it
(one line) when it is missing, of another size, or its marker ``PATH.state`` shows another version
(the table moved on since that checkpoint) or an update that never finished (``algorithms/tables.py``).

A failed momentum update: the table is written column block by column block with U (one block for a
tensor, the source's chunks otherwise), after the rows were screened. An error before the first write
(e.g. the source's first read) leaves the table as it was. An error after it (a read error of a later
chunk) leaves the round's rows new before the failing block and old after it (in the block being written:
either, or (1 - alpha) times the old ones when the in-place update of a run of rows stopped between its two
steps): the aggregator raises a RuntimeError naming the columns and the clients, and then refuses
further rounds and ``state_dict`` (no checkpoint of a torn table); a process that dies there leaves the file's marker at "updating",
which ``load_state_dict`` refuses. Undoing the rows would need a copy of them (k x d), so it is not done.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ... import ops
from ...ops._checks import has_kernel
from ...sources import weighted_sum_block
from ..parts import check_choice

WARMUPS = ("explore", "startup_full", "mask")
INITS = ("ema_from_zero", "first_update")


def check_options(
    name: str,
    alpha: float,
    warmup,
    init,
    method,
    solver_init,
    max_iter,
    tol,
    tol_abs,
    zero_fallback,
    variant,
    extension,
    ext_beta,
    solver,
) -> None:
    """One-line ValueError for the first option outside its range (see the module docstring)."""
    if not (0.0 < float(alpha) <= 1.0):
        raise ValueError(f"fedaware: alpha must lie in (0, 1], got {alpha}")
    for opt, v, allowed in (
        ("warmup", warmup, WARMUPS),
        ("init", init, INITS),
        ("zero_fallback", zero_fallback, ("zero", "na")),
        ("variant", variant, ("aware", "na")),
        ("extension", extension, (None, "fedavg", "fedavgm")),
        ("solver_init", solver_init, ("best_pair", "min_diag")),
    ):
        check_choice(name, opt, v, allowed)
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 0:
        raise ValueError(f"fedaware: max_iter must be an int >= 0, got {max_iter!r}")
    if not (0.0 <= float(tol) < math.inf and 0.0 <= float(tol_abs) < math.inf):
        raise ValueError(f"fedaware: tol and tol_abs must be finite numbers >= 0, got {tol}, {tol_abs}")
    if not (0.0 <= float(ext_beta) < 1.0):
        raise ValueError(f"fedaware: ext_beta must lie in [0, 1), got {ext_beta}")
    if solver is not None and not callable(solver):
        raise ValueError("fedaware: solver must be a callable like fedkernels.ops.min_norm")


def check_num_clients(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"fedaware: num_clients must be a positive int, got {n!r}")
    return n


# ---- the N x d momentum table ------------------------------------------------------------------------
def new_table(N: int, like: torch.Tensor, dtype=None, device=None) -> torch.Tensor:
    """A zero [N, d] table (dtype / device of ``like`` unless given), refused before it is made when
    it cannot fit in memory."""
    from ..._memory import check_alloc

    d = like.numel()
    check_alloc(
        N * d * like.element_size(),
        f"fedaware momentum table N={N} x d={d} {like.dtype}",
        like.device,
        hint="Keep the table in bfloat16 (pass a bfloat16 global model), or "
        "aggregate in column chunks (fedkernels.streaming).",
    )
    return torch.zeros((N, d), dtype=dtype or like.dtype, device=like.device if device is None else device)


TABLE_COLS = 1 << 18  # columns per block when a converted table sum is written into ``out``


def table_weighted_sum(M: torch.Tensor, coef, like, base=None, alpha: float = 1.0, rows=None, out=None) -> torch.Tensor:
    """base + alpha * sum_i coef_i M[rows_i] in ``like = (dtype, device)`` (the global model's): one
    ``weighted_sum`` pass, or converted chunk by chunk for a bf16 / host table. ``out``: a [d] tensor of
    that dtype and device the result is written into (block by block for a converted table on the same
    device: no second [d] vector); the same bits either way (the sum is column-local)."""
    dt, dev = like
    if M.dtype == dt and M.device == dev:
        if out is not None and has_kernel("weighted_sum_out", dev):
            return ops.weighted_sum(M, coef, base=base, alpha=alpha, rows=rows, out=out)
        res = ops.weighted_sum(M, coef, base=base, alpha=alpha, rows=rows)
    elif out is not None and M.device == dev:
        c64 = torch.as_tensor(coef, dtype=torch.float64).reshape(-1).cpu()
        r = None if rows is None else torch.as_tensor(rows, dtype=torch.long)
        for a in range(0, M.size(1), TABLE_COLS):
            b = min(M.size(1), a + TABLE_COLS)
            weighted_sum_block(M[:, a:b], c64, None if base is None else base[a:b], alpha, out[a:b], rows=r)
        return out
    else:
        res = ops.weighted_sum_chunked(M, coef, base=base, alpha=alpha, rows=rows, out_dtype=dt, device=dev)
    return res if out is None else out.copy_(res)


# ---- statistics ------------------------------------------------------------------------------------
# ELUD = mean_i ||g_i||^2 / ||mean_i g_i||^2 = k sum_i ||g_i||^2 / ||sum_i g_i||^2 needs two sums, O(kd). Up to
# ELUD_GRAM_MAX_K participants they come from the k x k Gram of U (trace and sum of G): that pass screens the
# rows too. Above it the Gram's O(k^2 d) costs more than a finite_rows screen plus the two sums, which
# ops.kstats gives (with p = 1: nsq_i = ||g_i||^2, nbar = ||sum_i g_i||^2) from the momentum update's blocks
# (EludSums). 1 thread, 2-core box under load (min of runs, Gram path vs screen + the sums, then computed in
# Python): K = 16, d = 1e7 fp32 219 vs 414 ms; K = 32, d = 1e6 62 vs 84 ms; K = 48 118 vs 107; K = 64 143 vs
# 150; K = 128, d = 1e5 39 vs 20; K = 1000, d = 76 1.8-2.5 vs 0.09.
ELUD_GRAM_MAX_K = 32


def elud_ratio(sq_rows: float, sq_sum: float, k: int):
    """(ratio, sqrt_ratio) from sum_i ||g_i||^2 and ||sum_i g_i||^2 of k rows (None, None when the sum is 0)."""
    if k == 0 or not sq_sum > 0:
        return None, None
    r = (sq_rows / k) / (sq_sum / (k * k))
    return r, math.sqrt(r)


def elud(G_S: torch.Tensor):
    """Empirical local-update diversity of the participants from their [k, k] Gram matrix:
    (ratio, sqrt_ratio) with ratio = mean_i ||g_i||^2 / ||mean_i g_i||^2 (None if the mean is 0)."""
    G = torch.as_tensor(G_S, dtype=torch.float64)
    return elud_ratio(float(torch.diagonal(G).sum()), float(G.sum()), G.size(0))


class EludSums:
    """ELUD's two sums accumulated in fp64 over column blocks of the k participants' updates (the
    momentum pass's blocks): sum_i ||g_i||^2 and ||sum_i g_i||^2, from ``ops.kstats(block, p = 1)`` (its
    nsq and nbar: one native fp64 pass, no temporary; summed across ranks by the op in sharded mode),
    added over the blocks in column order."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.ones = torch.ones(k, dtype=torch.float64)
        self.acc: Optional[torch.Tensor] = None  # [sum_i ||g_i||^2, ||sum_i g_i||^2] on the blocks' device

    def add(self, Ub: torch.Tensor) -> None:
        _, nsq, nbar, _ = ops.kstats(Ub, self.ones)
        part = torch.stack([nsq.sum(), nbar])
        self.acc = part if self.acc is None else self.acc.add_(part)

    def result(self):
        if self.acc is None:
            return None, None
        sq_rows, sq_sum = self.acc.tolist()  # (one device-to-host copy)
        return elud_ratio(sq_rows, sq_sum, self.k)
