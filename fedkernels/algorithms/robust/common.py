"""Pieces the robust rules share: the per-column selection pass over U (screening the rows in the same
pass, chunk by chunk on a source), the one-line bound checks, the Krum scores on a distance matrix,
and the rows' distances to a point for the iterative rules."""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch

from ... import ops
from ..base import RoundInput, RowScaled

# bytes of the reused [K + 1, w] stack buffer of ``row_dots`` (a column chunk of U and of the vector): few
# chunks, since each is a native call and a parallel region (4 MB chunks measured 2.8x slower at K = 100)
ROW_STACK_BYTES = 64 << 20


def check_int(method: str, option: str, value: int, least: int) -> int:
    """``value`` as an int >= ``least``; one-line ValueError naming the method and option otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{method}: {option} must be an integer >= {least}, got {value!r}")
    return value


def check_positive(method: str, option: str, value: float) -> float:
    v = float(value)
    if not v > 0 or v == float("inf"):
        raise ValueError(f"{method}: {option} must be a finite number > 0, got {value!r}")
    return v


def check_clients(method: str, option: str, value: int, K: int, bound: int, formula: str) -> None:
    """The rule's bound on the round's K clients, checked before U is read."""
    if K < bound:
        raise ValueError(f"{method}: {option}={value} needs K >= {formula} = {bound} clients per round, got K={K}")


def select_pass(
    rin: RoundInput,
    plain: Callable[..., torch.Tensor],
    screened: Callable[..., Tuple[torch.Tensor, torch.Tensor]],
    *args,
    **kw,
) -> torch.Tensor:
    """``plain(U, *args, **kw)`` (a per-column op of ``fedkernels.ops.select``): on a tensor one call,
    the ``screened`` form while the rows are unscreened (its flags go to the policy: raise, or the
    round again without the bad rows); on a source the column chunks in order (screened first by
    ``rin.blocks``; a row-scaled input (``RoundInput.with_row_scale``: a wrapper such as ``norm_bound``)
    too, its scaled rows in bounded blocks). Returns the [d] result (float64 for a float64 U, else float32)."""
    if rin.src is None and not isinstance(rin, RowScaled):
        if rin.unscreened:
            out, ok = screened(rin.U, *args, **kw)
            rin._flags(ok)  # the policy on this pass's flags (may restart the round without bad rows)
            return out
        return plain(rin.U, *args, **kw)
    res = torch.empty(rin.d, dtype=torch.float64 if rin.dtype == torch.float64 else torch.float32, device=rin.device)
    for cols, B in rin.blocks():
        res[cols] = plain(B, *args, **kw)
    return res


def rows_sum(rin: RoundInput, rows: torch.Tensor, w: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """The new model ``global + alpha * sum_i w[i] U[rows[i]]``: on a tensor whose rows are already
    screened (after the method's Gram pass) one ``ops.weighted_sum`` over the selected rows only (m rows
    read, not K; taken in ascending row order, the order of the full sum, whose zero terms add nothing)
    into ``rin.result_vector()``; otherwise (a source, a row-scaled input, unscreened rows) ``rin.weighted_sum``
    with zero weights on the other rows."""
    idx, order = torch.sort(torch.as_tensor(rows, dtype=torch.int64).reshape(-1).cpu())
    wv = torch.as_tensor(w, dtype=torch.float64).reshape(-1).cpu()[order]
    g = rin.global_flat
    if rin.src is None and not isinstance(rin, RowScaled) and not rin.unscreened:
        return ops.weighted_sum(rin.U, wv, base=g, alpha=alpha, rows=idx, out=rin.result_vector())
    coef = torch.zeros(rin.K, dtype=torch.float64)
    coef[idx] = wv
    return rin.weighted_sum(coef, base=g, alpha=alpha)


def step_from(rin: RoundInput, agg: torch.Tensor, lr: float) -> torch.Tensor:
    """The new global model ``global + lr * agg`` in the global model's dtype (``agg``: [d] fp32/fp64);
    for an fp32/fp64 model one add into ``rin.result_vector()``."""
    g = rin.global_flat
    acc = torch.float64 if g.dtype == torch.float64 else torch.float32
    agg = agg.to(device=g.device, dtype=acc)
    if g.dtype == acc:
        return torch.add(g, agg, alpha=lr, out=rin.result_vector())
    return g.to(acc).add(agg, alpha=lr).to(g.dtype)


def sq_distances(G: torch.Tensor) -> torch.Tensor:
    """[K, K] squared distances ``G_ii + G_jj - 2 G_ij`` from the fp64 Gram, clamped at 0 (the
    diagonal is exactly 0)."""
    g = torch.diagonal(G)
    return (g.unsqueeze(1) + g.unsqueeze(0) - 2.0 * G).clamp_min_(0.0)


def krum_scores(D: torch.Tensor, f: int, alive: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Krum's score of each row among the ``alive`` ones (all if None): the sum of the distances to its
    ``max(1, n - f - 2)`` nearest other alive rows (n alive rows), as Flower's ``aggregate_krum``: the row
    sorted, its first entry (itself, 0) skipped. Rows not alive score +inf."""
    K = D.size(0)
    if alive is None:
        alive = torch.ones(K, dtype=torch.bool)
    n = int(alive.sum())
    nc = max(1, n - f - 2)
    Dm = D.masked_fill(~alive.unsqueeze(0), float("inf"))
    s = torch.sort(Dm, dim=1).values[:, 1 : nc + 1].sum(1)
    return s.masked_fill(~alive, float("inf"))


def row_dots(rin: RoundInput, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, float]:
    """(U x, ||U_k||^2, ||x||^2): [K] float64 host tensors and a float from one read of U, by the native
    ``ops.kstats`` on column chunks of the stack [U; x] (each chunk copied once into a reused buffer of
    at most ROW_STACK_BYTES: with p = e_K the kstats mean is x's chunk exactly, so its dots are the
    rows' dots with x and its nsq the rows' squared norms, every product exact and summed in float64 in
    a fixed order; the chunks are added in column order). On a tensor with unscreened rows the chunks'
    flags screen them (no separate pass; the policy gets them once, after the pass); on a source or a
    row-scaled input the rows are screened first (``rin.blocks``)."""
    K = rin.K
    acc = torch.zeros(2 * K + 2, dtype=torch.float64, device=rin.device)  # on U's device: no copy per chunk
    p = torch.zeros(K + 1, dtype=torch.float64)
    p[K] = 1.0
    screen = rin.src is None and not isinstance(rin, RowScaled) and rin.unscreened
    blocks = [(slice(None), rin.U)] if screen else rin.blocks()
    ok_all: Optional[torch.Tensor] = None
    for cols, B in blocks:
        xb = x[cols].to(B.device)
        dt = torch.float64 if torch.float64 in (B.dtype, xb.dtype) else torch.float32
        width = max(1, ROW_STACK_BYTES // ((K + 1) * (8 if dt == torch.float64 else 4)))
        buf = torch.empty(K + 1, min(width, B.size(1)), dtype=dt, device=B.device)
        for a in range(0, B.size(1), width):
            w = min(width, B.size(1) - a)
            S = buf[:, :w]
            S[:K].copy_(B[:, a : a + w])
            S[K].copy_(xb[a : a + w])
            dot, nsq, _, ok = ops.kstats(S, p)
            acc[: K + 1].add_(dot.to(acc.device))
            acc[K + 1 :].add_(nsq.to(acc.device))
            if screen:
                ok_all = ok[:K] if ok_all is None else ok_all & ok[:K]
    if screen:  # the flags and the sums to the host in one copy
        ok = ok_all if ok_all is not None else torch.ones(K, dtype=torch.bool, device=acc.device)
        host = rin._flags(ok, carry=acc)
        acc = host if host is not None else acc.cpu()
    else:
        acc = acc.cpu()
    return acc[:K].clone(), acc[K + 1 : 2 * K + 1].clone(), float(acc[2 * K + 1])


def selected_ids(rin: RoundInput, rows: Sequence[int]) -> list:
    """The client ids of the round's rows ``rows``."""
    return [rin.client_ids[k] for k in rows]
