"""Min-norm point solver (FedAWARE): ``min_norm``.

Frank-Wolfe variants on the K x K Gram matrix of the client updates, solved on the host in
float64 (``csrc/cpu/min_norm.cpp``; ``csrc/cuda/min_norm.cu``); float64 oracle:
``fedkernels.reference.min_norm``. The result has no derivative: a backward through it raises.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from . import _autograd as _ag
from ._checks import fake_size, HOST, _tensor, tracing

__all__ = ["min_norm", "MIN_NORM_METHODS", "MIN_NORM_INITS"]

MIN_NORM_METHODS = ("away", "pairwise", "fw", "code_compat")
MIN_NORM_INITS = ("best_pair", "min_diag")


def min_norm(
    G: torch.Tensor,
    max_iter: int = 1000,
    tol: float = 1e-12,
    method: str = "away",
    init: str = "best_pair",
    tol_abs: float = 1e-15,
    polish: bool = True,
    lam0: Optional[torch.Tensor] = None,
    scale: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Union[int, torch.Tensor], Union[float, torch.Tensor]]:
    """Minimum-norm point of the convex hull of K vectors, given their K x K Gram matrix ``G``.

    ``G`` must be positive semi-definite, as every Gram matrix is: for an indefinite ``G`` the
    problem is non-convex and the returned ``lam`` is a stationary point, not the global minimum
    (no eigenvalue check is made on this hot path).

    Solves ``lam = argmin_{lam >= 0, sum lam = 1} lam^T G lam`` in float64 on ``(G + G^T)/2``
    (host solve: G is copied to the CPU once). Returns ``(lam [K] float64 on G's device,
    iterations: int, gap: float)`` where ``gap = q - min_i (G lam)_i`` is the Frank-Wolfe duality
    gap at the returned ``lam`` (``q = lam^T G lam``; ``q - q* <= 2 gap``). Under torch.compile,
    iterations and gap are returned as 0-d tensors (no host sync in the graph).

    method: ``"away"`` (Frank-Wolfe with away steps, default), ``"pairwise"``, ``"fw"`` (plain
    Frank-Wolfe, exact line search) or ``"code_compat"`` (the FedAWARE authors' solver: 0.999/0.001
    corner nudges, stops when ``||dlam||_1 < 1e-5`` and returns the previous iterate).
    Stop rule (all but code_compat): ``gap <= tol * q + tol_abs * max_i G_ii``. init:
    ``"best_pair"`` (best 2-vertex segment, as in MGDA) or ``"min_diag"`` (``e_argmin G_ii``).
    polish (away/pairwise): every 64 iterations and at max_iter, minimise exactly over the affine
    hull of the current support (projected CG + ratio test; q never increases). This removes
    Frank-Wolfe's slow tail on ill-conditioned G; polish=False gives the textbook method.
    lam0: optional warm start (length K, >= 0, positive sum; normalised), e.g. the previous round's
    lam; it replaces ``init``. Ties break toward the smallest index; the same G gives the same bits.
    scale: optional [K] tensor s (finite, > 0): solve on ``s_i s_j (G + G^T)/2`` (= D G D, D = diag(s))
    instead, made in the solver's one symmetrising pass (bit for bit ``(G + G^T) * 0.5 * outer(s, s)``);
    e.g. FedAWARE's normalised Gram with ``s = 1 / sqrt(diag G)``, without two K x K divides by the caller.
    ``gap`` and the stop rule are then those of the scaled matrix.
    """
    op = "min_norm"
    G = _tensor(G, op, "G")
    if method not in MIN_NORM_METHODS:
        raise ValueError(f"{op}: method must be one of {MIN_NORM_METHODS}, got {method!r}")
    if init not in MIN_NORM_INITS:
        raise ValueError(f"{op}: init must be one of {MIN_NORM_INITS}, got {init!r}")
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 0:
        raise ValueError(f"{op}: max_iter must be an int >= 0, got {max_iter!r}")
    for name, t in (("tol", tol), ("tol_abs", tol_abs)):
        if not isinstance(t, (int, float)) or not (0.0 <= float(t) < float("inf")):
            raise ValueError(f"{op}: {name} must be a finite number >= 0, got {t!r}")
    # G's, lam0's and scale's shapes and G's dtype: checked by the native op (read as float64 there).
    # K for lam0's value check only when G has the right shape, so that a wrong G is reported as such.
    K = G.size(0) if G.dim() == 2 and G.size(0) == G.size(1) and G.size(0) >= 1 else None
    Gh = G.to(HOST)  # not detached: backward raises (no derivative)
    # G's finiteness: checked by the native solve in its symmetrising pass (the one read of G; a ValueError
    # naming the first bad entry), not by a scan of its own (0.3 ms at K = 1000)
    l0 = None
    if lam0 is not None:
        l0 = _tensor(lam0, op, "lam0").detach().to(device=HOST, dtype=torch.float64).contiguous()
        right = K is not None and l0.dim() == 1 and l0.size(0) == K
        if (
            right
            and not tracing()
            and (not bool(torch.isfinite(l0).all()) or bool((l0 < 0).any()) or not float(l0.sum()) > 0.0)
        ):
            raise ValueError(f"{op}: lam0 must be finite, >= 0 and have a positive sum")
    s64 = None
    if scale is not None:
        s64 = _tensor(scale, op, "scale").detach().to(device=HOST, dtype=torch.float64).contiguous()
        # finite and > 0: checked by the native solve before its symmetrising pass (a ValueError naming the entry)
    lam, iters, gap = _ag.call(
        torch.ops.fedkernels.min_norm,
        Gh.detach(),
        max_iter,
        float(tol),
        float(tol_abs),
        method,
        init,
        bool(polish),
        l0,
        s64,
    )
    lam = _ag.no_derivative("min_norm", lam, Gh)
    if tracing():  # torch.compile: no host sync; iterations and gap stay 0-d tensors
        return lam.to(G.device), iters, gap
    return lam.to(G.device), int(iters), float(gap)


@torch.library.register_fake("fedkernels::min_norm")
def _min_norm_fake(
    G: torch.Tensor,
    max_iter: int = 1000,
    tol_rel: float = 1e-12,
    tol_abs: float = 1e-15,
    method: str = "away",
    init: str = "best_pair",
    polish: bool = True,
    lam0: Optional[torch.Tensor] = None,
    scale: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        G.new_empty((fake_size(G, 0),), dtype=torch.float64),
        G.new_empty((), dtype=torch.long),
        G.new_empty((), dtype=torch.float64),
    )


_ag.no_derivative_op("min_norm", "the Frank-Wolfe solution is piecewise in G; differentiate a smooth surrogate instead")
