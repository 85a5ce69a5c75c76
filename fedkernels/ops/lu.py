"""Small dense linear algebra (FedECADO): ``lu_factor``, ``lu_factor_ex``, ``lu_solve``,
``arrowhead_solve``.

Small systems (n <= LU_MAX_N = 64, many right-hand sides streamed over d): ``csrc/cpu/lu.cpp`` (CUDA:
``csrc/cuda/lu.cu``); float64 oracle in :mod:`fedkernels.reference`. The per-client scalars
(``a, b, c`` of the arrowhead system) are host (CPU) float64 vectors for every device. None of
these ops has a derivative: a backward through them raises.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .. import _native
from .._types import ScalarOrCoef
from . import _autograd as _ag
from ._checks import HOST, _finite_number, _needs_kernel, as_op, _no_grad_through, _tensor, tracing

__all__ = ["lu_factor", "lu_factor_ex", "lu_solve", "arrowhead_solve", "LU_MAX_N"]

LU_MAX_N: int = int(_native._C.build_info()["lu_max_n"])  # defined once: csrc/lu_limits.h (ops/__init__ requires _C)


def _lu_input(A: object, op: str) -> torch.Tensor:
    A = _tensor(A, op, "A")
    # (shape, dtype and n: the native op checks them, csrc/lu_checks.h; the values only of an A it takes)
    takes = A.dim() in (2, 3) and A.size(-1) == A.size(-2) and 1 <= A.size(-1) <= LU_MAX_N
    if takes and A.dtype in (torch.float32, torch.float64) and not tracing():
        if not bool(torch.isfinite(A).all()):
            raise ValueError(f"{op}: A must be finite (got NaN or Inf entries)")
    return A.contiguous()


def lu_factor_ex(A: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LU with partial pivoting of small A [n, n] or [B, n, n] (n <= LU_MAX_N, 64), LAPACK getf2 semantics.

    Returns ``(LU, pivots, info)`` like ``torch.linalg.lu_factor_ex``: LU holds the unit-lower L
    below the diagonal and U on and above it (row-major, A's dtype); pivots int32, 1-based, the
    lowest row index on ties; info int32 (per matrix): 0, or k (1-based) where U[k-1, k-1] is the
    first exactly-zero pivot (that column is left unscaled: no NaN).
    """
    A = _lu_input(A, "lu_factor_ex")
    _needs_kernel("lu_factor", A.device, "lu_factor_ex")
    res = as_op("lu_factor_ex", "lu_factor", _ag.call, torch.ops.fedkernels.lu_factor, A.detach())
    return _ag.no_derivative("lu_factor", res, A)


def lu_factor(A: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(LU, pivots)`` of small A (see lu_factor_ex); a singular A raises ValueError naming the
    matrix and the zero pivot."""
    A = _lu_input(A, "lu_factor")
    _needs_kernel("lu_factor", A.device, "lu_factor")
    LU, piv, info = _ag.no_derivative("lu_factor", _ag.call(torch.ops.fedkernels.lu_factor, A.detach()), A)
    bad = torch.nonzero(info.reshape(-1)).flatten()
    if bad.numel():
        b = int(bad[0])
        k = int(info.reshape(-1)[b])
        where = f" (matrix {b} of the batch)" if A.dim() == 3 else ""
        raise ValueError(f"lu_factor: A is singular{where}: pivot {k} is zero (U[{k - 1}, {k - 1}] = 0)")
    return LU, piv


def lu_solve(
    LU: torch.Tensor, pivots: torch.Tensor, R: torch.Tensor, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Solves ``A X = R`` from ``(LU, pivots) = lu_factor(A)``; R [n, m] or [B, n, m] (m may be huge:
    the columns are streamed once, in parallel chunks). float32 R gives float32 X (float64 inside).
    Also accepts torch.linalg.lu_factor's output (any strides). out: optional contiguous tensor of
    R's shape and dtype (reusing it across calls avoids the page faults of a fresh output)."""
    op = "lu_solve"
    LU = _tensor(LU, op, "LU")
    pivots = _tensor(pivots, op, "pivots")
    R = _tensor(R, op, "R")
    # (shapes, dtypes and devices: the native op checks them, csrc/lu_checks.h)
    _needs_kernel("lu_solve" if out is None else "lu_solve_out", R.device, op)
    if R.dim() >= 1 and R.size(-1) > 1 and R.stride(-1) != 1:
        R = R.contiguous()
    if out is None:
        return _ag.no_derivative(
            "lu_solve",
            _ag.call(torch.ops.fedkernels.lu_solve, LU.detach().contiguous(), pivots.contiguous(), R.detach()),
            LU,
            R,
        )
    out = _tensor(out, op, "out")
    _no_grad_through("lu_solve(out=...)", LU, R, out)
    torch.ops.fedkernels.lu_solve_out(LU.contiguous(), pivots.contiguous(), R, out)
    return out


def arrowhead_solve(
    a: ScalarOrCoef, b: ScalarOrCoef, c: ScalarOrCoef, alpha: float, r0: torch.Tensor, R: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Solves the (K+1) x (K+1) arrowhead system ``[[alpha, b^T], [c, diag(a)]] [x; I] = [r0; R]``
    for every column (r0 [m], R [K, m]) in closed form (Schur complement on x, no fill-in).
    a, b, c: length-K coefficients (read as float64). Returns ``(x [m], I [K, m])`` in R's dtype.
    FedECADO's backward-Euler matrix: alpha = 1, b = -dt, c = dt / L, a_i = 1 + dt / (L g_i).
    """
    op = "arrowhead_solve"
    R = _tensor(R, op, "R")
    # (shapes, dtypes and devices: the native op checks them, csrc/lu_checks.h; K is read only from
    # an R of the right rank, else the native op raises R's shape error before a, b and c are checked)
    K = R.size(0) if R.dim() == 2 else None
    coefs = []
    for v in (a, b, c):
        v = (
            v.to(device=HOST, dtype=torch.float64)
            if isinstance(v, torch.Tensor)
            else torch.as_tensor(v, dtype=torch.float64)
        )  # not detached: a backward through the op raises
        if K is not None and v.dim() == 0:
            v = v.expand(K)
        coefs.append(v.contiguous())
    # (the values only of coefficients of the right length: the native op checks the lengths)
    shaped = K is not None and all(v.dim() == 1 and v.size(0) == K for v in coefs)
    if shaped and not tracing():
        for name, v in zip("abc", coefs):
            if not bool(torch.isfinite(v).all()):
                raise ValueError(f"{op}: {name} must be finite")
    alpha = _finite_number(alpha, op, "alpha")
    if shaped and not tracing():
        if bool((coefs[0].detach() == 0).any()):
            raise ValueError(f"{op}: a must be nonzero (the diagonal block is diag(a))")
        den = float(alpha) - float((coefs[1] * coefs[2] / coefs[0]).detach().sum())
        if den == 0.0:
            raise ValueError(f"{op}: singular system (Schur complement alpha - sum b c / a = 0)")
    r0 = _tensor(r0, op, "r0")
    _needs_kernel("arrowhead_solve", R.device, op)
    if K is not None and R.size(1) > 1 and R.stride(1) != 1:
        R = R.contiguous()
    res = _ag.call(
        torch.ops.fedkernels.arrowhead_solve,
        *(v.detach() for v in coefs),
        float(alpha),
        r0.detach().contiguous(),
        R.detach(),
    )
    return _ag.no_derivative("arrowhead_solve", res, *coefs, r0, R)


@torch.library.register_fake("fedkernels::lu_factor")
def _lu_factor_fake(A: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.empty_like(A, memory_format=torch.contiguous_format),
        A.new_empty(A.shape[:-1], dtype=torch.int32),
        A.new_empty(A.shape[:-2], dtype=torch.int32),
    )


@torch.library.register_fake("fedkernels::lu_solve")
def _lu_solve_fake(LU: torch.Tensor, pivots: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(R, memory_format=torch.contiguous_format)


@torch.library.register_fake("fedkernels::lu_solve_out")
def _lu_solve_out_fake(LU: torch.Tensor, pivots: torch.Tensor, R: torch.Tensor, out: torch.Tensor) -> None:
    return None


@torch.library.register_fake("fedkernels::arrowhead_solve")
def _arrowhead_fake(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, alpha: float, r0: torch.Tensor, R: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    return R.new_empty((R.size(1),)), R.new_empty((R.size(0), R.size(1)))


_ag.no_derivative_op("lu_factor", "use torch.linalg.lu_factor for gradients")
_ag.no_derivative_op("lu_solve", "use torch.linalg.lu_solve for gradients")
_ag.no_derivative_op("arrowhead_solve", "solve with torch.linalg.solve on the dense matrix for gradients")
