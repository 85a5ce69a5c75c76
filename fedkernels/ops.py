"""Validated Python API over the native ops (torch.ops.fedkernels.*).

Every function checks its arguments and raises ValueError (TypeError for non-tensors) naming
the argument and what was expected. Non-contiguous inputs are accepted: a matrix only needs a
unit column stride (a column chunk ``U[:, a:b]`` of a contiguous buffer is used without a copy);
anything else is copied once.

NaN policy: the ops do not scan their inputs for NaN/Inf on the hot path; NaN and Inf propagate
as in IEEE arithmetic (a NaN in a selected row of ``U`` makes the matching output entries NaN).
Screening is explicit and cheap: ``finite_rows(U)`` reads U once and says which rows are finite;
the aggregators call it and reject or exclude bad clients before any arithmetic.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch

from . import _native

_native.require()

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
RowsLike = Optional[Union[torch.Tensor, Sequence[int]]]

__all__ = ["gram", "weighted_sum", "finite_rows", "gc_project_", "gc_project", "gc_project_flat_"]


# ---------------------------------------------------------------------------------------------
# validation helpers (shared by every wrapper)
# ---------------------------------------------------------------------------------------------
def _tensor(x, op: str, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _float_dtype(x: torch.Tensor, op: str, name: str) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: {name} must have a floating dtype (float16, bfloat16, float32, float64), got {x.dtype}")


def _matrix(U, op: str, name: str = "U") -> torch.Tensor:
    """A 2-D float matrix with unit column stride (copied once if it has none)."""
    U = _tensor(U, op, name)
    if U.dim() != 2:
        raise ValueError(f"{op}: {name} must be a 2-D [K, d] tensor, got shape {tuple(U.shape)}")
    _float_dtype(U, op, name)
    if U.size(1) > 1 and U.stride(1) != 1:
        U = U.contiguous()
    if U.size(0) > 1 and U.stride(0) < U.size(1):  # e.g. expanded or overlapping rows
        U = U.contiguous()
    return U


def _vector(v, op: str, name: str, length: int, like: torch.Tensor) -> torch.Tensor:
    v = _tensor(v, op, name)
    if v.dim() != 1 or v.size(0) != length:
        raise ValueError(f"{op}: {name} must be a 1-D tensor of length {length}, got shape {tuple(v.shape)}")
    if v.dtype != like.dtype:
        raise ValueError(f"{op}: {name} must have dtype {like.dtype} (the dtype of U), got {v.dtype}")
    if v.device != like.device:
        raise ValueError(f"{op}: {name} is on {v.device} but U is on {like.device}")
    return v


def _rows(rows: RowsLike, K: int, op: str, device: torch.device) -> Optional[torch.Tensor]:
    if rows is None:
        return None
    r = torch.as_tensor(rows, device=device)
    if r.dim() != 1:
        raise ValueError(f"{op}: rows must be a 1-D sequence of row indices, got shape {tuple(r.shape)}")
    if r.numel() and (r.dtype.is_floating_point or r.dtype == torch.bool):
        raise ValueError(f"{op}: rows must hold integer row indices, got dtype {r.dtype}")
    r = r.to(torch.long)
    if r.numel() and (device.type == "cpu") and (int(r.min()) < 0 or int(r.max()) >= K):
        raise ValueError(f"{op}: rows must lie in [0, {K}), got min {int(r.min())} max {int(r.max())}")
    return r.contiguous()


def _coef(coef, n: int, op: str, device: torch.device) -> torch.Tensor:
    c = torch.as_tensor(coef, dtype=torch.float64, device=device) if not isinstance(coef, torch.Tensor) else coef
    if c.dim() != 1 or c.size(0) != n:
        raise ValueError(f"{op}: coef must be a 1-D tensor of length {n} (one per selected row), got shape {tuple(c.shape)}")
    if not c.dtype.is_floating_point:
        c = c.to(torch.float64)
    if c.device != device:
        raise ValueError(f"{op}: coef is on {c.device} but U is on {device}")
    if c.device.type == "cpu" and not bool(torch.isfinite(c).all()):
        raise ValueError(f"{op}: coef must be finite, got {c.tolist() if n <= 16 else 'non-finite entries'}")
    return c


# ---------------------------------------------------------------------------------------------
# aggregation core
# ---------------------------------------------------------------------------------------------
def gram(U: torch.Tensor, rows: RowsLike = None) -> torch.Tensor:
    """Gram matrix ``U[rows] @ U.T`` in float64: shape [K, K] (or [len(rows), K]).

    Accumulates in float64 in a fixed order: the same input gives the same bits with any number
    of threads. For models larger than memory, sum ``gram(U[:, a:b])`` over column chunks.
    """
    U = _matrix(U, "gram")
    r = _rows(rows, U.size(0), "gram", U.device)
    return _shard_sum(torch.ops.fedkernels.gram(U, r))


def weighted_sum(U: torch.Tensor, coef, base: Optional[torch.Tensor] = None, alpha: float = 1.0,
                 rows: RowsLike = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``base + alpha * sum_i coef[i] * U[rows[i]]`` in one pass over the selected rows.

    U: [K, d]; coef: [len(rows)] (read as float64, applied in the accumulation dtype: fp32 for
    fp32/fp16/bf16 inputs, fp64 for fp64); base: optional [d] of U's dtype; out: optional [d]
    contiguous of U's dtype, may be ``base`` itself (in-place apply). Returns out.
    """
    U = _matrix(U, "weighted_sum")
    K, d = U.shape
    r = _rows(rows, K, "weighted_sum", U.device)
    n = K if r is None else r.numel()
    c = _coef(coef, n, "weighted_sum", U.device)
    if not isinstance(alpha, (int, float)) or alpha != alpha or alpha in (float("inf"), float("-inf")):
        raise ValueError(f"weighted_sum: alpha must be a finite number, got {alpha!r}")
    if base is not None:
        base = _vector(base, "weighted_sum", "base", d, U)
        if not base.is_contiguous():
            base = base.contiguous()
    if out is None:
        return torch.ops.fedkernels.weighted_sum(U, c, base, float(alpha), r)
    out = _vector(out, "weighted_sum", "out", d, U)
    if not out.is_contiguous():
        raise ValueError("weighted_sum: out must be contiguous")
    torch.ops.fedkernels.weighted_sum_out(U, c, base, float(alpha), r, out)
    return out


def finite_rows(U: torch.Tensor) -> torch.Tensor:
    """[K] bool: True where row k of U holds only finite values. One read of U, no K x d temporary."""
    U = _matrix(U, "finite_rows")
    return _shard_and(torch.ops.fedkernels.finite_rows(U))


# ---------------------------------------------------------------------------------------------
# fake (meta) kernels, so the ops work under torch.compile / opcheck
# ---------------------------------------------------------------------------------------------
@torch.library.register_fake("fedkernels::gram")
def _gram_fake(U, rows=None):
    k = U.size(0) if rows is None else rows.size(0)
    return U.new_empty((k, U.size(0)), dtype=torch.float64)


@torch.library.register_fake("fedkernels::weighted_sum")
def _wsum_fake(U, coef, base=None, alpha=1.0, rows=None):
    return U.new_empty((U.size(1),))


@torch.library.register_fake("fedkernels::weighted_sum_out")
def _wsum_out_fake(U, coef, base, alpha, rows, out):
    return None


@torch.library.register_fake("fedkernels::finite_rows")
def _finite_rows_fake(U):
    return U.new_empty((U.size(0),), dtype=torch.bool)


# ---- min-norm solver (FedAWARE) --------------------------------------------------------------
__all__ += ["min_norm"]

MIN_NORM_METHODS = ("away", "pairwise", "fw", "code_compat")
MIN_NORM_INITS = ("best_pair", "min_diag")


def min_norm(G: torch.Tensor, max_iter: int = 1000, tol: float = 1e-12, method: str = "away",
             init: str = "best_pair", tol_abs: float = 1e-15, polish: bool = True,
             lam0: Optional[torch.Tensor] = None):
    """Minimum-norm point of the convex hull of K vectors, given their K x K Gram matrix ``G``.

    ``G`` must be positive semi-definite, as every Gram matrix is: for an indefinite ``G`` the
    problem is non-convex and the returned ``lam`` is a stationary point, not the global minimum
    (no eigenvalue check is made on this hot path).

    Solves ``lam = argmin_{lam >= 0, sum lam = 1} lam^T G lam`` in float64 on ``(G + G^T)/2``
    (host solve: G is copied to the CPU once). Returns ``(lam [K] float64 on G's device,
    iterations: int, gap: float)`` where ``gap = q - min_i (G lam)_i`` is the Frank-Wolfe duality
    gap at the returned ``lam`` (``q = lam^T G lam``; ``q - q* <= 2 gap``).

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
    """
    op = "min_norm"
    G = _tensor(G, op, "G")
    if G.dim() != 2 or G.size(0) != G.size(1):
        raise ValueError(f"{op}: G must be a square [K, K] Gram matrix, got shape {tuple(G.shape)}")
    _float_dtype(G, op, "G")
    if G.size(0) == 0:
        raise ValueError(f"{op}: G must be at least 1 x 1 (K >= 1 vectors), got shape {tuple(G.shape)}")
    if method not in MIN_NORM_METHODS:
        raise ValueError(f"{op}: method must be one of {MIN_NORM_METHODS}, got {method!r}")
    if init not in MIN_NORM_INITS:
        raise ValueError(f"{op}: init must be one of {MIN_NORM_INITS}, got {init!r}")
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 0:
        raise ValueError(f"{op}: max_iter must be an int >= 0, got {max_iter!r}")
    for name, t in (("tol", tol), ("tol_abs", tol_abs)):
        if not isinstance(t, (int, float)) or not (0.0 <= float(t) < float("inf")):
            raise ValueError(f"{op}: {name} must be a finite number >= 0, got {t!r}")
    G64 = G.detach().to(device="cpu", dtype=torch.float64).contiguous()
    if not bool(torch.isfinite(G64).all()):
        raise ValueError(f"{op}: G must be finite (got NaN or Inf entries)")
    l0 = None
    if lam0 is not None:
        l0 = _tensor(lam0, op, "lam0").detach().to(device="cpu", dtype=torch.float64).contiguous()
        if l0.dim() != 1 or l0.size(0) != G.size(0):
            raise ValueError(f"{op}: lam0 must be a 1-D tensor of length {G.size(0)}, got shape {tuple(l0.shape)}")
        if not bool(torch.isfinite(l0).all()) or bool((l0 < 0).any()) or not float(l0.sum()) > 0.0:
            raise ValueError(f"{op}: lam0 must be finite, >= 0 and have a positive sum")
    lam, iters, gap = torch.ops.fedkernels.min_norm(G64, max_iter, float(tol), float(tol_abs), method, init,
                                                    bool(polish), l0)
    return lam.to(G.device), int(iters), float(gap)


@torch.library.register_fake("fedkernels::min_norm")
def _min_norm_fake(G, max_iter=1000, tol_rel=1e-12, tol_abs=1e-15, method="away", init="best_pair", polish=True,
                   lam0=None):
    return (G.new_empty((G.size(0),), dtype=torch.float64), G.new_empty((), dtype=torch.long),
            G.new_empty((), dtype=torch.float64))


# ---- small dense linear algebra (FedECADO) ---------------------------------------------------
__all__ += ["lu_factor", "lu_factor_ex", "lu_solve", "arrowhead_solve"]

LU_MAX_N = 64


def _lu_input(A, op: str) -> torch.Tensor:
    A = _tensor(A, op, "A")
    if A.dim() not in (2, 3) or A.size(-1) != A.size(-2):
        raise ValueError(f"{op}: A must be a square [n, n] or batched [B, n, n] matrix, got shape {tuple(A.shape)}")
    if A.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{op}: A must be float32 or float64, got {A.dtype}")
    n = A.size(-1)
    if not 1 <= n <= LU_MAX_N:
        raise ValueError(f"{op}: n must be in [1, {LU_MAX_N}] (small systems; use torch.linalg for larger), got {n}")
    if A.device.type != "cpu":
        raise ValueError(f"{op}: A must be on the CPU, got {A.device}")
    if not bool(torch.isfinite(A).all()):
        raise ValueError(f"{op}: A must be finite (got NaN or Inf entries)")
    return A.contiguous()


def lu_factor_ex(A: torch.Tensor):
    """LU with partial pivoting of small A [n, n] or [B, n, n] (n <= 64), LAPACK getf2 semantics.

    Returns ``(LU, pivots, info)`` like ``torch.linalg.lu_factor_ex``: LU holds the unit-lower L
    below the diagonal and U on and above it (row-major, A's dtype); pivots int32, 1-based, the
    lowest row index on ties; info int32 (per matrix): 0, or k (1-based) where U[k-1, k-1] is the
    first exactly-zero pivot (that column is left unscaled: no NaN).
    """
    A = _lu_input(A, "lu_factor_ex")
    return torch.ops.fedkernels.lu_factor(A)


def lu_factor(A: torch.Tensor):
    """``(LU, pivots)`` of small A (see lu_factor_ex); a singular A raises ValueError naming the
    matrix and the zero pivot."""
    A = _lu_input(A, "lu_factor")
    LU, piv, info = torch.ops.fedkernels.lu_factor(A)
    bad = torch.nonzero(info.reshape(-1)).flatten()
    if bad.numel():
        b = int(bad[0])
        k = int(info.reshape(-1)[b])
        where = f" (matrix {b} of the batch)" if A.dim() == 3 else ""
        raise ValueError(f"lu_factor: A is singular{where}: pivot {k} is zero (U[{k - 1}, {k - 1}] = 0)")
    return LU, piv


def lu_solve(LU: torch.Tensor, pivots: torch.Tensor, R: torch.Tensor,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Solves ``A X = R`` from ``(LU, pivots) = lu_factor(A)``; R [n, m] or [B, n, m] (m may be huge:
    the columns are streamed once, in parallel chunks). float32 R gives float32 X (float64 inside).
    Also accepts torch.linalg.lu_factor's output (any strides). out: optional contiguous tensor of
    R's shape and dtype (reusing it across calls avoids the page faults of a fresh output)."""
    op = "lu_solve"
    LU = _tensor(LU, op, "LU")
    pivots = _tensor(pivots, op, "pivots")
    R = _tensor(R, op, "R")
    if LU.dim() not in (2, 3) or LU.size(-1) != LU.size(-2):
        raise ValueError(f"{op}: LU must be [n, n] or [B, n, n], got shape {tuple(LU.shape)}")
    n = LU.size(-1)
    if not LU.dtype.is_floating_point:
        raise ValueError(f"{op}: LU must have a floating dtype, got {LU.dtype}")
    if pivots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: pivots must be int32 or int64, got {pivots.dtype}")
    if pivots.shape != LU.shape[:-1]:
        raise ValueError(f"{op}: pivots must have shape {tuple(LU.shape[:-1])}, got {tuple(pivots.shape)}")
    if R.dim() != LU.dim() or R.size(-2) != n or (LU.dim() == 3 and R.size(0) != LU.size(0)):
        want = f"[{LU.size(0)}, {n}, m]" if LU.dim() == 3 else f"[{n}, m]"
        raise ValueError(f"{op}: R must be {want}, got shape {tuple(R.shape)}")
    if R.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{op}: R must be float32 or float64, got {R.dtype}")
    if any(t.device.type != "cpu" for t in (LU, pivots, R)):
        raise ValueError(f"{op}: LU, pivots and R must be on the CPU")
    if R.size(-1) > 1 and R.stride(-1) != 1:
        R = R.contiguous()
    if out is None:
        return torch.ops.fedkernels.lu_solve(LU.contiguous(), pivots.contiguous(), R)
    out = _tensor(out, op, "out")
    if out.shape != R.shape or out.dtype != R.dtype or not out.is_contiguous() or out.device != R.device:
        raise ValueError(f"{op}: out must be a contiguous {R.dtype} tensor of shape {tuple(R.shape)} on the CPU")
    torch.ops.fedkernels.lu_solve_out(LU.contiguous(), pivots.contiguous(), R, out)
    return out


def arrowhead_solve(a, b, c, alpha: float, r0: torch.Tensor, R: torch.Tensor):
    """Solves the (K+1) x (K+1) arrowhead system ``[[alpha, b^T], [c, diag(a)]] [x; I] = [r0; R]``
    for every column (r0 [m], R [K, m]) in closed form (Schur complement on x, no fill-in).
    a, b, c: length-K coefficients (read as float64). Returns ``(x [m], I [K, m])`` in R's dtype.
    FedECADO's backward-Euler matrix: alpha = 1, b = -dt, c = dt / L, a_i = 1 + dt / (L g_i).
    """
    op = "arrowhead_solve"
    R = _tensor(R, op, "R")
    if R.dim() != 2:
        raise ValueError(f"{op}: R must be a 2-D [K, m] tensor, got shape {tuple(R.shape)}")
    if R.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{op}: R must be float32 or float64, got {R.dtype}")
    K, m = R.shape
    coefs = []
    for name, v in (("a", a), ("b", b), ("c", c)):
        v = torch.as_tensor(v, dtype=torch.float64)
        if v.dim() == 0:
            v = v.expand(K)
        if v.dim() != 1 or v.size(0) != K:
            raise ValueError(f"{op}: {name} must be a scalar or a length-{K} vector, got shape {tuple(v.shape)}")
        if not bool(torch.isfinite(v).all()):
            raise ValueError(f"{op}: {name} must be finite")
        coefs.append(v.contiguous())
    if bool((coefs[0] == 0).any()):
        raise ValueError(f"{op}: a must be nonzero (the diagonal block is diag(a))")
    if not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"{op}: alpha must be a finite number, got {alpha!r}")
    den = float(alpha) - float((coefs[1] * coefs[2] / coefs[0]).sum())
    if den == 0.0:
        raise ValueError(f"{op}: singular system (Schur complement alpha - sum b c / a = 0)")
    r0 = _vector(r0, op, "r0", m, R)
    if m > 1 and R.stride(1) != 1:
        R = R.contiguous()
    return torch.ops.fedkernels.arrowhead_solve(coefs[0], coefs[1], coefs[2], float(alpha), r0.contiguous(), R)


@torch.library.register_fake("fedkernels::lu_factor")
def _lu_factor_fake(A):
    return (torch.empty_like(A, memory_format=torch.contiguous_format), A.new_empty(A.shape[:-1], dtype=torch.int32),
            A.new_empty(A.shape[:-2], dtype=torch.int32))


@torch.library.register_fake("fedkernels::lu_solve")
def _lu_solve_fake(LU, pivots, R):
    return torch.empty_like(R, memory_format=torch.contiguous_format)


@torch.library.register_fake("fedkernels::lu_solve_out")
def _lu_solve_out_fake(LU, pivots, R, out):
    return None


@torch.library.register_fake("fedkernels::arrowhead_solve")
def _arrowhead_fake(a, b, c, alpha, r0, R):
    return R.new_empty((R.size(1),)), R.new_empty((R.size(0), R.size(1)))


__all__ += ["fedecado_be_step"]


def _host_coef(v, K: int, op: str, name: str, nonneg: bool = False) -> torch.Tensor:
    t = torch.as_tensor(v, dtype=torch.float64) if not isinstance(v, torch.Tensor) else v
    if t.dim() != 1 or t.size(0) != K:
        raise ValueError(f"{op}: {name} must be a 1-D sequence of length K = {K} (one per client), got shape {tuple(t.shape)}")
    if not t.dtype.is_floating_point:
        raise ValueError(f"{op}: {name} must be a float tensor, got {t.dtype}")
    if t.device.type != "cpu":
        raise ValueError(f"{op}: {name} must be a CPU (host) tensor: the per-client coefficients are host scalars, got {t.device}")
    t = t.to(torch.float64).contiguous()
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{op}: {name} must be finite, got {t.tolist() if K <= 16 else 'non-finite entries'}")
    if nonneg and bool((t < 0).any()):
        raise ValueError(f"{op}: {name} must be >= 0 (1/g_i; 0 = ECADO limit), got {t.tolist() if K <= 16 else 'negative entries'}")
    return t


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.numel() > 0 and b.numel() > 0 and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def fedecado_be_step(xc: torch.Tensor, Icur: torch.Tensor, xc0: torch.Tensor, U: torch.Tensor, Ik: torch.Tensor,
                     S_off: Optional[torch.Tensor], theta_new, theta_old, inv_g, dt: float, L: float,
                     out: Optional[Sequence[torch.Tensor]] = None, lte_out: Optional[torch.Tensor] = None):
    """One fused FedECADO backward-Euler attempt (spec fedecado.md §2.6, §2.7, §5.3(a)) in one pass
    over d, with no K x d temporaries.

    xc [d] central state, Icur [K, d] current flows, xc0 [d] round-start state, U [K, d] =
    x_end - xc0, Ik [K, d] round-start flows, S_off [d] or None (frozen inactive flows);
    theta_new / theta_old [K]: (tau + dt) / T_i and tau / T_i; inv_g [K] = 1/g_i >= 0 (0 = ECADO
    limit); all three host (CPU) float sequences. dt, L > 0. All tensors share one float32/float64
    dtype and device; matrices need a unit column stride (other layouts are copied once).

    Returns ``(x_c' [d], I' [K, d], lte)`` with lte a float64 tensor [2] = (LTE_c, LTE_I) in the
    inf-norm: LTE_c = dt/2 max_j |sum_i (I'_i - Icur_i)|, LTE_I = dt/(2L) max_ij |e_ij|, e_i =
    (theta_new_i - theta_old_i) U_i - inv_g_i (I'_i - Icur_i) - (x_c' - xc); NaN maps to +inf.
    out: optional (xc_out [d], I_out [K, d]) contiguous buffers (reused across attempts: nothing is
    allocated); they must not share storage with any input. lte_out: optional float64 [2] buffer.
    Arithmetic is float64 inside for both dtypes on the CPU.
    """
    op = "fedecado_be_step"
    U = _matrix(U, op, "U")
    if U.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{op}: U must be float32 or float64, got {U.dtype}")
    K, d = U.shape
    mats = {}
    for name, M in (("Icur", Icur), ("Ik", Ik)):
        M = _matrix(M, op, name)
        if tuple(M.shape) != (K, d):
            raise ValueError(f"{op}: {name} must have shape [K, d] = [{K}, {d}] (the shape of U), got {tuple(M.shape)}")
        if M.dtype != U.dtype or M.device != U.device:
            raise ValueError(f"{op}: {name} must have U's dtype {U.dtype} and device {U.device}, got {M.dtype} on {M.device}")
        mats[name] = M
    vecs = {}
    for name, v in (("xc", xc), ("xc0", xc0), ("S_off", S_off)):
        if v is None and name == "S_off":
            vecs[name] = None
            continue
        vecs[name] = _vector(v, op, name, d, U).contiguous()
    thn = _host_coef(theta_new, K, op, "theta_new")
    tho = _host_coef(theta_old, K, op, "theta_old")
    ig = _host_coef(inv_g, K, op, "inv_g", nonneg=True)
    for name, v in (("dt", dt), ("L", L)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not v > 0:
            raise ValueError(f"{op}: {name} must be a finite number > 0, got {v!r}")
    if U.device.type != "cpu" and not hasattr(torch.ops.fedkernels, "fedecado_be_step"):
        raise ValueError(f"{op}: no kernel for device {U.device}")
    if lte_out is None:
        lte_out = torch.empty(2, dtype=torch.float64, device=U.device)
    elif (not isinstance(lte_out, torch.Tensor) or lte_out.shape != (2,) or lte_out.dtype != torch.float64
          or lte_out.device != U.device or not lte_out.is_contiguous()):
        raise ValueError(f"{op}: lte_out must be a contiguous float64 tensor of shape [2] on {U.device}")
    if out is None:
        xo, Io = torch.empty(d, dtype=U.dtype, device=U.device), torch.empty(K, d, dtype=U.dtype, device=U.device)
    else:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise ValueError(f"{op}: out must be a pair (xc_out [d], I_out [K, d])")
        xo, Io = out
        for name, t, shape in (("xc_out", xo, (d,)), ("I_out", Io, (K, d))):
            t = _tensor(t, op, name)
            if tuple(t.shape) != shape or t.dtype != U.dtype or t.device != U.device or not t.is_contiguous():
                raise ValueError(f"{op}: {name} must be a contiguous {U.dtype} tensor of shape {list(shape)} on "
                                 f"{U.device}, got {tuple(t.shape)} {t.dtype} on {t.device}")
        ins = [U, mats["Icur"], mats["Ik"]] + [v for v in vecs.values() if v is not None]
        for name, t in (("xc_out", xo), ("I_out", Io)):
            if any(_same_storage(t, x) for x in ins) or (name == "I_out" and _same_storage(xo, Io)):
                raise ValueError(f"{op}: {name} must not share storage with an input or the other output")
    torch.ops.fedkernels.fedecado_be_step_out(vecs["xc"], mats["Icur"], vecs["xc0"], U, mats["Ik"], vecs["S_off"],
                                              thn, tho, ig, float(dt), float(L), xo, Io, lte_out)
    return xo, Io, lte_out


@torch.library.register_fake("fedkernels::fedecado_be_step")
def _be_step_fake(xc, Icur, xc0, U, Ik, S_off, theta_new, theta_old, inv_g, dt, L):
    return U.new_empty((U.size(1),)), U.new_empty((U.size(0), U.size(1))), U.new_empty((2,), dtype=torch.float64)


@torch.library.register_fake("fedkernels::fedecado_be_step_out")
def _be_step_out_fake(xc, Icur, xc0, U, Ik, S_off, theta_new, theta_old, inv_g, dt, L, xc_out, I_out, lte):
    return None


# ---- gradient centralization (GC-Fed) --------------------------------------------------------
GC_VECTOR_POLICIES = ("skip", "center")


def _gc_args(tensors, vector_policy, min_fanin, op: str) -> list:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{op}: tensors must be a list or tuple of tensors, got {type(tensors).__name__}")
    if vector_policy not in GC_VECTOR_POLICIES:
        raise ValueError(f"{op}: vector_policy must be 'skip' or 'center', got {vector_policy!r}")
    if isinstance(min_fanin, bool) or not isinstance(min_fanin, int) or min_fanin < 1:
        raise ValueError(f"{op}: min_fanin must be an int >= 1, got {min_fanin!r}")
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: tensors[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{op}: tensors[{i}] must have a floating dtype (float16, bfloat16, float32, "
                             f"float64), got {t.dtype}")
    if tensors:
        dev = tensors[0].device
        for i, t in enumerate(tensors):
            if t.device != dev:
                raise ValueError(f"{op}: all tensors must be on one device; tensors[0] is on {dev}, "
                                 f"tensors[{i}] on {t.device}")
    return tensors


def gc_project_(tensors: Sequence[torch.Tensor], vector_policy: str = "skip", min_fanin: int = 2) -> list:
    """Gradient centralization of many tensors in one call, in place (GC-Fed spec §2.1).

    Every output-channel row ``X[i]`` (dim 0; row length M = numel / size(0)) becomes
    ``X[i] - mean(X[i])``. 1-D tensors (biases, norm weights) are left alone with
    ``vector_policy="skip"`` (standard GC) or centred as one row with ``"center"`` (the GC-Fed code).
    0-D tensors, empty tensors and tensors whose rows are shorter than ``min_fanin`` are unchanged
    (M = 1 would zero the gradient). Sums accumulate in fp32 (fp64 for fp64 tensors) with one rounding
    on the write; results do not depend on the thread count. Any layout is accepted (channels-last
    rows are used in place, other non-contiguous tensors go through a copy); dtypes may be mixed.
    Axis 0 is always the row axis: exclude ConvTranspose weights and embeddings yourself.
    NaN/Inf propagate to the whole row. An empty list is a no-op. Returns the list.
    """
    tensors = _gc_args(tensors, vector_policy, min_fanin, "gc_project_")
    for i, t in enumerate(tensors):
        if t.numel() > 1 and torch._debug_has_internal_overlap(t) == 1:  # 1 = MemOverlap::Yes
            raise ValueError(f"gc_project_: tensors[{i}] has internally overlapping memory (e.g. from expand()) and "
                             "cannot be written in place; clone() it or use gc_project")
    if tensors:
        torch.ops.fedkernels.gc_project_(tensors, vector_policy, min_fanin)
    return tensors


def gc_project(tensors: Sequence[torch.Tensor], vector_policy: str = "skip", min_fanin: int = 2) -> list:
    """Out-of-place :func:`gc_project_`: new tensors (same shapes, dtypes and, for dense inputs, layouts)."""
    tensors = _gc_args(tensors, vector_policy, min_fanin, "gc_project")
    if not tensors:
        return []
    return list(torch.ops.fedkernels.gc_project(tensors, vector_policy, min_fanin))


def gc_project_flat_(vec: torch.Tensor, spec, vector_policy: str = "skip", min_fanin: int = 2,
                     select=None) -> torch.Tensor:
    """Global GC on a flat vector laid out by a :class:`fedkernels.flat.FlatSpec`, in place.

    ``vec`` is ``[d]`` or ``[K, d]`` (each row centred independently, one call for all K). The spec's
    tensors are taken as views of ``vec`` (no copy); ``select(entry) -> bool`` restricts GC to some
    entries (e.g. ``lambda e: not e.is_buffer``; GC-Fed's "complement" scope). Returns ``vec``.
    """
    vec = _tensor(vec, "gc_project_flat_", "vec")
    if vec.dim() not in (1, 2) or vec.size(-1) != spec.d:
        raise ValueError(f"gc_project_flat_: vec must be [d] or [K, d] with d={spec.d}, got shape {tuple(vec.shape)}")
    if vec.size(-1) > 1 and vec.stride(-1) != 1:
        raise ValueError("gc_project_flat_: vec must have unit stride along d (views are taken in place)")
    entries = [e for e in spec.entries if select is None or select(e)]
    rows = [vec] if vec.dim() == 1 else list(vec.unbind(0))
    views = [r[e.offset:e.offset + e.numel].view(e.shape) for r in rows for e in entries]
    gc_project_(views, vector_policy, min_fanin)
    return vec


@torch.library.register_fake("fedkernels::gc_project_")
def _gc_project_inplace_fake(tensors, vector_policy="skip", min_fanin=2):
    return None


@torch.library.register_fake("fedkernels::gc_project")
def _gc_project_fake(tensors, vector_policy="skip", min_fanin=2):
    return [torch.empty_like(t) for t in tensors]




# ---- fused local steps (SCAFFOLD, FedPVR, Local GC) -----------------------------------------
# Native, because it pays (bench/cpu_gc.py, 1 thread, loaded 2-core AVX-512 machine, median time of
# the composition / time of the fused op; CNN 2.2M and ResNet18-GN 11.2M parameters, fp32):
#   SCAFFOLD step (c, c_i, momentum, wd): 2.7-2.8x over the _foreach composition (1.7-2.1x over
#     _foreach correction + torch._fused_sgd_);
#   Local GC + momentum SGD: 2.1-2.6x over gc_project_ + _foreach (1.1-1.3x over gc_project_ +
#     torch._fused_sgd_). Current numbers: bench/results/cpu-gc.json.
__all__ += ["fused_sgd_step_", "corrected_sgd_step_", "gc_sgd_step_"]


def _finite_number(x, op: str, name: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or x != x or x in (float("inf"), float("-inf")):
        raise ValueError(f"{op}: {name} must be a finite number, got {x!r}")
    return float(x)


def _tensor_list(xs, n: int, op: str, name: str, params, optional_entries: bool = False) -> list:
    if isinstance(xs, torch.Tensor) or not isinstance(xs, (list, tuple)):
        raise TypeError(f"{op}: {name} must be a list or tuple of tensors, got {type(xs).__name__}")
    xs = list(xs)
    if len(xs) != n:
        raise ValueError(f"{op}: {name} must have one entry per parameter ({n}), got {len(xs)}")
    out = []
    for i, (x, p) in enumerate(zip(xs, params)):
        if x is None and optional_entries:
            out.append(None)
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{op}: {name}[{i}] must be a torch.Tensor, got {type(x).__name__}")
        if x.shape != p.shape or x.dtype != p.dtype or x.device != p.device:
            raise ValueError(f"{op}: {name}[{i}] must match params[{i}] (shape {tuple(p.shape)}, {p.dtype}, "
                             f"{p.device}), got shape {tuple(x.shape)}, {x.dtype}, {x.device}")
        out.append(x)
    return out


def fused_sgd_step_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                    momentum_bufs: Optional[Sequence[torch.Tensor]] = None, *, lr: float, momentum: float = 0.0,
                    weight_decay: float = 0.0, first_step: bool = False, c_add=None, c_sub=None, gc_mask=None,
                    vector_policy: str = "skip", min_fanin: int = 2) -> list:
    """One SGD step over a list of parameters in one native pass (torch.optim.SGD semantics,
    dampening 0, no Nesterov), with the SCAFFOLD/FedPVR correction and Local GC fused in::

        d   = GC(g) [where gc_mask] + c_add - c_sub [where given] + weight_decay * p
        buf = d (first_step) or momentum * buf + d        (momentum != 0)
        p  -= lr * buf                                     (lr * d when momentum == 0)

    ``params`` and ``momentum_bufs`` are updated in place; ``grads`` is not modified. ``c_add`` and
    ``c_sub`` are None or lists with one tensor-or-None per parameter (None: no correction on that
    tensor, e.g. FedPVR's S_sgd part). ``gc_mask`` is None (no GC), a bool for all, or one bool per
    parameter; GC is per output-channel row of g, as :func:`gc_project_` with ``vector_policy`` and
    ``min_fanin`` (the GC-Fed [CODE] order: GC on the raw gradient, then weight decay, then momentum).
    ``first_step`` initialises the buffers as torch does (buf = d) instead of reading them. Arithmetic
    in fp32 (fp64 for fp64 parameters); all tensors of a parameter share its shape, dtype and device.
    Returns ``params``.
    """
    op = "fused_sgd_step_"
    if isinstance(params, torch.Tensor) or not isinstance(params, (list, tuple)):
        raise TypeError(f"{op}: params must be a list or tuple of tensors, got {type(params).__name__}")
    params = list(params)
    n = len(params)
    for i, p in enumerate(params):
        _tensor(p, op, f"params[{i}]")
        _float_dtype(p, op, f"params[{i}]")
    grads = _tensor_list(grads, n, op, "grads", params)
    lr = _finite_number(lr, op, "lr")
    momentum = _finite_number(momentum, op, "momentum")
    weight_decay = _finite_number(weight_decay, op, "weight_decay")
    if momentum < 0:
        raise ValueError(f"{op}: momentum must be >= 0, got {momentum}")
    if momentum != 0:
        if momentum_bufs is None:
            raise ValueError(f"{op}: momentum_bufs are required when momentum != 0")
        bufs = _tensor_list(momentum_bufs, n, op, "momentum_bufs", params)
    else:
        bufs = []
    ca = [] if c_add is None else _tensor_list(c_add, n, op, "c_add", params, optional_entries=True)
    cs = [] if c_sub is None else _tensor_list(c_sub, n, op, "c_sub", params, optional_entries=True)
    if gc_mask is None or gc_mask is False:
        mask = []
    elif gc_mask is True:
        mask = [True] * n
    else:
        mask = [bool(m) for m in gc_mask]
        if len(mask) != n:
            raise ValueError(f"{op}: gc_mask must have one entry per parameter ({n}), got {len(mask)}")
    if mask and vector_policy not in GC_VECTOR_POLICIES:
        raise ValueError(f"{op}: vector_policy must be 'skip' or 'center', got {vector_policy!r}")
    if isinstance(min_fanin, bool) or not isinstance(min_fanin, int) or min_fanin < 1:
        raise ValueError(f"{op}: min_fanin must be an int >= 1, got {min_fanin!r}")
    if n == 0:
        return params
    # non-contiguous tensors: read-only ones are copied in; mutated ones are copied in and back
    write_back = []
    work_p = []
    for p in params:
        if p.is_contiguous():
            work_p.append(p)
        else:
            c = p.contiguous()
            work_p.append(c)
            write_back.append((p, c))
    work_b = []
    for b in bufs:
        if b.is_contiguous():
            work_b.append(b)
        else:
            c = b.contiguous()
            work_b.append(c)
            write_back.append((b, c))
    grads = [g if g.is_contiguous() else g.contiguous() for g in grads]
    ca = [c if c is None or c.is_contiguous() else c.contiguous() for c in ca]
    cs = [c if c is None or c.is_contiguous() else c.contiguous() for c in cs]
    torch.ops.fedkernels.fused_sgd_step_(work_p, grads, work_b, ca, cs, mask, lr, momentum, weight_decay,
                                         bool(first_step), vector_policy, min_fanin)
    for dst, src in write_back:
        dst.copy_(src)
    return params


def corrected_sgd_step_(params, grads, c, c_i=None, momentum_bufs=None, *, lr: float, momentum: float = 0.0,
                        weight_decay: float = 0.0, first_step: bool = False, subset=None) -> list:
    """SCAFFOLD / FedPVR local step ``p -= lr * (g - c_i + c)`` (with torch-SGD momentum and weight
    decay on the corrected gradient), one native pass.

    ``c`` and ``c_i``: one tensor per parameter (server and client control variates); pass
    ``c_i=None`` when ``c`` already holds the per-round difference ``c - c_i`` (one vector fewer to
    read per step). ``subset``: indices (or a bool list) of the parameters that get the correction
    (FedPVR's S_ctrl); the others take a plain SGD step. Entries of c/c_i outside the subset may be None.
    """
    if isinstance(params, torch.Tensor) or not isinstance(params, (list, tuple)):
        raise TypeError(f"corrected_sgd_step_: params must be a list or tuple of tensors, got {type(params).__name__}")
    n = len(params)
    if subset is None:
        keep = [True] * n
    else:
        subset = list(subset)
        if subset and all(isinstance(s, bool) for s in subset):
            if len(subset) != n:
                raise ValueError(f"corrected_sgd_step_: a bool subset must have {n} entries, got {len(subset)}")
            keep = subset
        else:
            keep = [False] * n
            for s in subset:
                if isinstance(s, bool) or not isinstance(s, int) or not -n <= s < n:
                    raise ValueError(f"corrected_sgd_step_: subset entries must be indices in [0, {n}), got {s!r}")
                keep[s] = True
    if not isinstance(c, (list, tuple)) or len(c) != n:
        raise ValueError(f"corrected_sgd_step_: c must be a list with one entry per parameter ({n})")
    ca = [x if k else None for x, k in zip(c, keep)]
    cs = None
    if c_i is not None:
        if not isinstance(c_i, (list, tuple)) or len(c_i) != n:
            raise ValueError(f"corrected_sgd_step_: c_i must be a list with one entry per parameter ({n})")
        cs = [x if k else None for x, k in zip(c_i, keep)]
    for name, lst in (("c", ca), ("c_i", cs)):
        if lst is not None and any(x is None for x, k in zip(lst, keep) if k):
            raise ValueError(f"corrected_sgd_step_: {name} has None for a parameter in the corrected subset")
    return fused_sgd_step_(params, grads, momentum_bufs, lr=lr, momentum=momentum, weight_decay=weight_decay,
                           first_step=first_step, c_add=ca, c_sub=cs)


def gc_sgd_step_(params, grads, momentum_bufs=None, *, lr: float, momentum: float = 0.0, weight_decay: float = 0.0,
                 first_step: bool = False, gc_mask=True, vector_policy: str = "skip", min_fanin: int = 2) -> list:
    """Local GC + SGD step (GC-Fed §2.2, [CODE] order) in one native pass: per output-channel row
    g~ = g - mean(g) (where ``gc_mask``), d = g~ + wd*p, buf = momentum*buf + d (d on the first
    step), p -= lr*buf. ``grads`` is not modified."""
    return fused_sgd_step_(params, grads, momentum_bufs, lr=lr, momentum=momentum, weight_decay=weight_decay,
                           first_step=first_step, gc_mask=gc_mask, vector_policy=vector_policy,
                           min_fanin=min_fanin)


@torch.library.register_fake("fedkernels::fused_sgd_step_")
def _fused_sgd_step_fake(params, grads, momentum_bufs, c_add, c_sub, gc_mask, lr, momentum, weight_decay,
                         first_step, vector_policy="skip", min_fanin=2):
    return None




# ---- sharded reductions over d (fedkernels.distributed) ---------------------------------------
# When a ``fedkernels.distributed.sharded(...)`` context is active, every d-vector an aggregator
# sees is this rank's column slice. Reductions over d must then be summed across ranks: ``gram``
# and ``finite_rows`` above do it themselves; aggregators route any other reduction over a
# d-vector through the helpers below (single process: plain local reductions, no overhead).
__all__ += ["dot", "sqnorm", "all_", "any_", "amax_d", "mean_d"]

_SHARD = None  # the active fedkernels.distributed.ShardContext, or None (set only by sharded())


def _shard_sum(t: torch.Tensor) -> torch.Tensor:
    return t if _SHARD is None else _SHARD.all_reduce_sum(t)


def _shard_and(mask: torch.Tensor) -> torch.Tensor:
    return mask if _SHARD is None else _SHARD.all_reduce_and(mask)


def dot(a: torch.Tensor, b: torch.Tensor) -> float:
    """``<a, b>`` over d, accumulated in float64 (summed across ranks in sharded mode)."""
    a, b = _tensor(a, "dot", "a"), _tensor(b, "dot", "b")
    if a.numel() != b.numel():
        raise ValueError(f"dot: a and b must have the same number of elements, got {a.numel()} and {b.numel()}")
    return float(_shard_sum(torch.dot(a.reshape(-1).double(), b.reshape(-1).double()).reshape(1)))


def sqnorm(a: torch.Tensor) -> float:
    """``||a||^2`` over d, accumulated in float64 (summed across ranks in sharded mode)."""
    a = _tensor(a, "sqnorm", "a").reshape(-1).double()
    return float(_shard_sum(torch.dot(a, a).reshape(1)))


def all_(mask: torch.Tensor) -> bool:
    """``bool(mask.all())`` over a d-sized mask (logical and across ranks in sharded mode)."""
    m = _tensor(mask, "all_", "mask")
    return bool(_shard_and(m.all().reshape(1)))


def any_(mask: torch.Tensor) -> bool:
    """``bool(mask.any())`` over a d-sized mask (logical or across ranks in sharded mode)."""
    m = _tensor(mask, "any_", "mask")
    return not bool(_shard_and((~m.any()).reshape(1)))


def amax_d(x: torch.Tensor) -> torch.Tensor:
    """``x.amax(dim=-1)`` over the last (d) dimension (max across ranks in sharded mode)."""
    x = _tensor(x, "amax_d", "x")
    if _SHARD is None:   # d = 0: -inf (the identity of max, as in the sharded branch) instead of an IndexError
        return x.amax(dim=-1) if x.size(-1) else x.new_full(x.shape[:-1], float("-inf"))
    loc = x.amax(dim=-1) if x.size(-1) else x.new_full(x.shape[:-1], float("-inf"))
    return _SHARD.all_reduce_max(loc)


def mean_d(x: torch.Tensor) -> torch.Tensor:
    """``x.mean(dim=-1)`` over the last (d) dimension (global mean across ranks in sharded mode)."""
    x = _tensor(x, "mean_d", "x")
    if _SHARD is None:
        return x.mean(dim=-1)
    s = _SHARD.all_reduce_sum(x.sum(dim=-1, dtype=torch.float64))
    n = float(_SHARD.all_reduce_sum(torch.tensor([float(x.size(-1))], dtype=torch.float64)))
    return (s / n).to(x.dtype)


# ---- end of ops ------------------------------------------------------------------------------
