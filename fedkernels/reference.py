"""Pure-PyTorch reference (oracle) for every native op, computed in float64.

These are written for clarity, not speed: the tests compare each native op against the matching
function here on random inputs. They accept the same arguments as the functions in fedkernels.ops.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple, Union, cast

import torch

from ._types import CoefLike, GcMask, RowsLike, ScalarOrCoef, TensorsOrNone


def _rows_idx(rows: RowsLike, K: int, device: Union[str, torch.device, None]) -> torch.Tensor:
    if rows is None:
        return torch.arange(K, device=device)
    return torch.as_tensor(rows, device=device).to(torch.long)


# ---- aggregation core --------------------------------------------------------------------------
def gram(U: torch.Tensor, rows: RowsLike = None) -> torch.Tensor:
    U64 = U.to(torch.float64)
    return U64[_rows_idx(rows, U.size(0), U.device)] @ U64.T


def weighted_sum(
    U: torch.Tensor,
    coef: CoefLike,
    base: Optional[torch.Tensor] = None,
    alpha: float = 1.0,
    rows: RowsLike = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    U64 = U.to(torch.float64)
    r = _rows_idx(rows, U.size(0), U.device)
    c = torch.as_tensor(coef, dtype=torch.float64, device=U.device)
    # alpha scales the coefficients, as in the kernels (alpha = 0 gives base even where the sum would overflow)
    s = ((alpha * c)[:, None] * U64[r]).sum(0) if r.numel() else torch.zeros(U.size(1), dtype=torch.float64)
    if base is not None:
        s = base.to(torch.float64) + s
    return s


def gram_screened(U: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    return gram(U), finite_rows(U)


def weighted_sum_screened(
    U: torch.Tensor,
    coef: CoefLike,
    base: Optional[torch.Tensor] = None,
    alpha: float = 1.0,
    rows: RowsLike = None,
    out: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    r = torch.arange(U.size(0)) if rows is None else torch.as_tensor(rows, dtype=torch.long)
    return weighted_sum(U, coef, base, alpha, rows, out), finite_rows(U.index_select(0, r.to(U.device)))


def finite_rows(U: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(U).all(dim=1) if U.size(1) else torch.ones(U.size(0), dtype=torch.bool)


def kstats(U: torch.Tensor, p: CoefLike) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kuramoto's statistics in two passes (the mean first, then the rows against it), in float64."""
    U64 = U.to(torch.float64)
    mean = torch.as_tensor(p, dtype=torch.float64, device=U.device) @ U64
    return U64 @ mean, (U64 * U64).sum(1), mean @ mean, finite_rows(U)


# ---- min-norm solver (FedAWARE) --------------------------------------------------------------
def _segment(a: float, b: float, c: float, code: bool = False) -> Tuple[float, float]:
    """min over gamma in [0, 1] of |gamma u + (1 - gamma) w|^2 (a=|u|^2, b=<u,w>, c=|w|^2):
    (gamma = weight on u, value). code=True: the authors' 0.999/0.001 corner variant."""
    if code:
        if b >= a:
            return 0.999, a
        if b >= c:
            return 0.001, c
        g = -1.0 * ((b - c) / (a + c - 2.0 * b))
        return g, c + g * (b - c)
    den = a - 2.0 * b + c
    g = 0.5 if not den > 0.0 else min(1.0, max(0.0, (c - b) / den))
    return g, g * g * a + 2.0 * g * (1.0 - g) * b + (1.0 - g) * (1.0 - g) * c


def _face_polish(G: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """Exact minimisation over the affine hull of supp(lam) (bordered KKT system, least squares),
    then the ratio-test move toward it; a blocking vertex leaves the support and it repeats."""
    K = G.size(0)
    for _ in range(K):
        S = torch.nonzero(lam > 0).flatten()
        n = S.numel()
        if n <= 1:
            break
        A = torch.zeros(n + 1, n + 1, dtype=torch.float64)
        A[:n, :n] = G[S][:, S]
        A[:n, n] = 1.0
        A[n, :n] = 1.0
        rhs = torch.zeros(n + 1, dtype=torch.float64)
        rhs[n] = 1.0
        x = torch.linalg.lstsq(A, rhs[:, None], driver="gelsd").solution[:n, 0]
        cur = lam[S]
        dirn = x - cur
        neg = dirn < 0
        ratios = torch.where(neg, -cur / torch.where(neg, dirn, torch.ones_like(dirn)), torch.full_like(dirn, 2.0))
        tmax, blk = float(ratios.min()), int(torch.argmin(ratios))
        block = tmax < 1.0
        tmax = min(tmax, 1.0)
        new = lam.clone()
        new[S] = (cur + tmax * dirn).clamp_min(0.0)
        if block:
            new[S[blk]] = 0.0
        new = new / new.sum()
        if float(new @ G @ new) > float(lam @ G @ lam):
            break
        lam = new
        if not block:
            break
    return lam


def min_norm(
    G: torch.Tensor,
    max_iter: int = 1000,
    tol: float = 1e-12,
    method: str = "away",
    init: str = "best_pair",
    tol_abs: float = 1e-15,
    polish: bool = True,
    lam0: Optional[CoefLike] = None,
    scale: Optional[CoefLike] = None,
) -> Tuple[torch.Tensor, int, float]:
    """Frank-Wolfe min-norm point (fedaware.md section 2.6), written plainly in float64.

    Same arguments and result as ops.min_norm: (lam [K] float64, iterations, gap); with ``scale`` s
    the problem is that of s_i s_j (G + G^T) / 2."""
    G = G.detach().to(device="cpu", dtype=torch.float64)
    G = 0.5 * (G + G.T)
    if scale is not None:
        s = torch.as_tensor(scale, dtype=torch.float64).reshape(-1)
        G = G * torch.outer(s, s)
    K = G.size(0)
    Gl = G.tolist()
    lam = torch.zeros(K, dtype=torch.float64)
    code = method == "code_compat"
    if K == 1:
        lam[0] = 1.0
        v = G @ lam
        return lam, 0, float(lam @ v - v.min())
    if lam0 is not None:
        lam = torch.as_tensor(lam0, dtype=torch.float64).clone()
        lam = lam / lam.sum()
    elif init == "best_pair" or code:
        best, pair = float("inf"), (0, 1, 0.5)
        for i in range(K):
            for j in range(i + 1, K):
                g, val = _segment(Gl[i][i], Gl[i][j], Gl[j][j], code)
                if val < best:
                    best, pair = val, (i, j, g)
        lam[pair[0]], lam[pair[1]] = pair[2], 1.0 - pair[2]
    else:
        lam[int(torch.argmin(torch.diagonal(G)))] = 1.0
    it = 0
    if code:
        if K >= 3:
            while it < max_iter:
                v = G @ lam
                t = int(torch.argmin(v))
                nc, _ = _segment(float(lam @ v), float(v[t]), Gl[t][t], True)
                new = nc * lam
                new[t] += 1.0 - nc
                if float((new - lam).abs().sum()) < 1e-5:
                    break
                lam = new
                it += 1
    else:
        thr_abs = tol_abs * float(torch.diagonal(G).abs().max())
        v = G @ lam
        q = float(lam @ v)
        while True:
            if it > 0 and it % 64 == 0:
                if polish and method != "fw":
                    lam = _face_polish(G, lam)
                v = G @ lam
                q = float(lam @ v)
            t = int(torch.argmin(v))  # first index on ties
            supp = lam > 0
            vs = torch.where(supp, v, torch.full_like(v, -float("inf")))
            a = int(torch.argmax(vs))
            vt, va = float(v[t]), float(v[a])
            gap = q - vt
            if not gap > tol * q + thr_abs:
                break
            if it >= max_iter:
                if polish and method != "fw":
                    lam = _face_polish(G, lam)
                break
            if method == "pairwise":
                if a == t or not va - vt > 0.0:
                    break
                den = Gl[t][t] - 2.0 * Gl[t][a] + Gl[a][a]
                gmax = float(lam[a])
                gamma = min(gmax, (va - vt) / den) if den > 0.0 else gmax
                if not gamma > 0.0:
                    break
                lam[t] += gamma
                lam[a] = 0.0 if gamma >= gmax else lam[a] - gamma
                v = v + gamma * (G[:, t] - G[:, a])
            elif method == "fw" or gap >= va - q or float(lam[a]) >= 1.0:
                den = q - 2.0 * vt + Gl[t][t]
                gamma = min(1.0, gap / den) if den > 0.0 else 1.0
                if not gamma > 0.0:
                    break
                if gamma >= 1.0:
                    lam = torch.zeros_like(lam)
                    lam[t] = 1.0
                    v = G[:, t].clone()
                else:
                    lam = (1.0 - gamma) * lam
                    lam[t] += gamma
                    v = (1.0 - gamma) * v + gamma * G[:, t]
            else:  # away step
                la = float(lam[a])
                gmax = la / (1.0 - la)
                den = q - 2.0 * va + Gl[a][a]
                gamma = min(gmax, (va - q) / den) if den > 0.0 else gmax
                if not gamma > 0.0:
                    break
                lam = (1.0 + gamma) * lam
                lam[a] = 0.0 if gamma >= gmax else lam[a] - gamma
                v = (1.0 + gamma) * v - gamma * G[:, a]
            q = float(lam @ v)
            it += 1
    v = G @ lam
    return lam, it, float(lam @ v - v.min())


# ---- small dense linear algebra (FedECADO) ---------------------------------------------------
def lu_factor_ex(A: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LAPACK getf2 (partial pivoting, lowest index on ties, 1-based pivots, info = first zero
    pivot) written as a plain loop in float64. Returns (LU, pivots int32, info int32)."""
    batched = A.dim() == 3
    As = A.to(torch.float64).reshape(-1, A.size(-1), A.size(-1)).clone()
    n = As.size(-1)
    piv = torch.zeros(As.size(0), n, dtype=torch.int32)
    info = torch.zeros(As.size(0), dtype=torch.int32)
    for b in range(As.size(0)):
        a = As[b]
        for k in range(n):
            col = a[k:, k].abs()
            p = k + int(torch.nonzero(col == col.max())[0])  # first maximum
            piv[b, k] = p + 1
            if a[p, k] != 0:
                if p != k:
                    a[[k, p]] = a[[p, k]]
                a[k + 1 :, k] /= a[k, k]
            elif info[b] == 0:
                info[b] = k + 1
            a[k + 1 :, k + 1 :] -= torch.outer(a[k + 1 :, k], a[k, k + 1 :])
    if not batched:
        return As[0], piv[0], info[0]
    return As, piv, info


def lu_factor(A: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    LU, piv, info = lu_factor_ex(A)
    if bool((info != 0).any()):
        raise ValueError("lu_factor: A is singular")
    return LU, piv


def lu_solve(LU: torch.Tensor, pivots: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """X = A^{-1} R from (LU, pivots): row swaps, unit-lower then upper triangular solves, float64."""
    batched = LU.dim() == 3
    LUs = LU.to(torch.float64).reshape(-1, LU.size(-1), LU.size(-1))
    Ps = pivots.to(torch.long).reshape(LUs.size(0), -1)
    Rs = R.to(torch.float64).reshape(LUs.size(0), R.size(-2), R.size(-1))
    out = []
    for b in range(LUs.size(0)):
        x = Rs[b].clone()
        for i in range(x.size(0)):
            p = int(Ps[b, i]) - 1
            if p != i:
                x[[i, p]] = x[[p, i]]
        x = torch.linalg.solve_triangular(LUs[b], x, upper=False, unitriangular=True)
        x = torch.linalg.solve_triangular(LUs[b], x, upper=True)
        out.append(x)
    X = torch.stack(out)
    return X if batched else X[0]


def arrowhead_solve(
    a: ScalarOrCoef, b: ScalarOrCoef, c: ScalarOrCoef, alpha: float, r0: torch.Tensor, R: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Dense oracle: builds the (K+1) x (K+1) arrowhead matrix and solves it with torch.linalg.solve."""
    K = R.size(0)
    f64 = lambda v: (
        torch.as_tensor(v, dtype=torch.float64).expand(K)
        if torch.as_tensor(v).dim() == 0
        else torch.as_tensor(v, dtype=torch.float64)
    )
    a, b, c = f64(a), f64(b), f64(c)
    M = torch.zeros(K + 1, K + 1, dtype=torch.float64)
    M[0, 0] = alpha
    M[0, 1:] = b
    M[1:, 0] = c
    M[1:, 1:] = torch.diag(a)
    Z = torch.linalg.solve(M, torch.cat([r0.to(torch.float64)[None], R.to(torch.float64)]))
    return Z[0], Z[1:]


def fedecado_be_step(
    xc: torch.Tensor,
    Icur: torch.Tensor,
    xc0: torch.Tensor,
    U: torch.Tensor,
    Ik: torch.Tensor,
    S_off: Optional[torch.Tensor],
    theta_new: CoefLike,
    theta_old: CoefLike,
    inv_g: CoefLike,
    dt: float,
    L: float,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One FedECADO BE attempt in float64, literally as spec fedecado.md §2.6/§2.7: Gamma_i at tau
    and tau + dt, the dense (K+1) x (K+1) system M z = R solved by torch.linalg.solve, and the LTE
    from the sensitivity-model client states x~_i (inf-norm; NaN -> +inf). Returns (x_c', I', lte [2])."""
    # dtype given up front: a list of Python floats would otherwise become float32 first
    f = lambda t: t.to(torch.float64) if isinstance(t, torch.Tensor) else torch.as_tensor(t, dtype=torch.float64)  # noqa: E731
    xc, Icur, xc0, U, Ik = f(xc), f(Icur), f(xc0), f(U), f(Ik)
    thn, tho, ig = f(theta_new), f(theta_old), f(inv_g)
    K, d = U.shape
    S = torch.zeros(d, dtype=torch.float64) if S_off is None else f(S_off)
    c = dt / L
    G_new = xc0[None] + thn[:, None] * U  # Gamma_i(tau + dt)
    G_old = xc0[None] + tho[:, None] * U  # Gamma_i(tau)
    a = 1.0 + c * ig  # 1 + dt / (L g_i)
    M = torch.zeros(K + 1, K + 1, dtype=torch.float64)
    M[0, 0] = 1.0
    M[0, 1:] = -dt
    M[1:, 0] = c
    M[1:, 1:] = torch.diag(a)
    R = torch.cat([(xc + dt * S)[None], Icur + c * (G_new + ig[:, None] * Ik)])
    Z = torch.linalg.solve(M, R)
    xn, In = Z[0], Z[1:]
    inf_nan = lambda t: torch.where(torch.isnan(t), torch.full_like(t, math.inf), t.abs())  # noqa: E731
    lte_c = 0.5 * dt * float(inf_nan(In.sum(0) - Icur.sum(0)).max()) if d else 0.0
    xt_new = G_new - (In - Ik) * ig[:, None]
    xt_old = G_old - (Icur - Ik) * ig[:, None]
    e = (xt_new - xn[None]) - (xt_old - xc[None])
    lte_I = 0.5 * dt / L * float(inf_nan(e).max()) if e.numel() else 0.0
    return xn, In, torch.tensor([lte_c, lte_I], dtype=torch.float64)


# ---- gradient centralization (GC-Fed) --------------------------------------------------------
def _row_mean(x64: torch.Tensor, dims: Tuple[int, ...]) -> torch.Tensor:
    """Mean over ``dims`` (keepdim) without spurious overflow: each row is divided by a power of two
    s with s <= max|x| < 2 s (exact), averaged, and multiplied back. Every partial sum of the M scaled
    terms stays below 2 M, so a row of finite values always gets its finite mean (the exact mean lies
    in [min x, max x]), whatever order torch sums in; a plain fp64 ``mean`` of a row near the fp64
    maximum can overflow in a partial sum (+Inf and -Inf in two lanes give NaN). The scaling only
    loses the bits of elements below 2**-1022 s (absolute error <= 2**-1074 s per element)."""
    amax = x64.abs().amax(dim=dims, keepdim=True)  # non-finite rows: s is irrelevant, NaN/Inf propagate
    s = torch.ldexp(torch.ones_like(amax), torch.frexp(amax).exponent - 1)
    return (x64 / s).mean(dim=dims, keepdim=True) * s


def _gc_one(x: torch.Tensor, vector_policy: str, min_fanin: int) -> torch.Tensor:
    x64 = x.detach().to(torch.float64)
    if x.dim() == 0 or x.numel() == 0:
        return x64.clone()
    if x.dim() == 1:
        if vector_policy == "skip" or x.numel() < min_fanin:
            return x64.clone()
        return x64 - _row_mean(x64, (0,))
    if x.numel() // x.size(0) < min_fanin:
        return x64.clone()
    return x64 - _row_mean(x64, tuple(range(1, x.dim())))


def gc_project(tensors: Sequence[torch.Tensor], vector_policy: str = "skip", min_fanin: int = 2) -> List[torch.Tensor]:
    """float64 GC: ``x - x.mean(dim=tuple(range(1, x.ndim)), keepdim=True)`` with the policies of
    GC-Fed §2.1 (1-D: skip or centre the whole vector; 0-D, empty, fan-in < min_fanin: unchanged).
    The mean is taken on power-of-two-scaled rows (:func:`_row_mean`), so a finite row never gets
    a NaN/Inf mean from an overflowing partial sum."""
    return [_gc_one(x, vector_policy, min_fanin) for x in tensors]


def gc_project_(tensors: Sequence[torch.Tensor], vector_policy: str = "skip", min_fanin: int = 2) -> List[torch.Tensor]:
    """In-place form of :func:`gc_project` (computed in float64, written back in each tensor's dtype)."""
    for x, y in zip(tensors, gc_project(tensors, vector_policy, min_fanin)):
        x.copy_(y)
    return list(tensors)


# ---- fused local steps (SCAFFOLD, FedPVR, Local GC) -----------------------------------------
def fused_sgd_step_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_bufs: Optional[Sequence[torch.Tensor]] = None,
    *,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    first_step: bool = False,
    c_add: Optional[TensorsOrNone] = None,
    c_sub: Optional[TensorsOrNone] = None,
    gc_mask: GcMask = None,
    vector_policy: str = "skip",
    min_fanin: int = 2,
) -> List[torch.Tensor]:
    """float64 reference of ops.fused_sgd_step_: d = GC(g) + c_add - c_sub + wd*p; buf = d (first
    step) or momentum*buf + d; p -= lr*buf. Writes p (and buf) back in their dtypes."""
    n = len(params)
    if gc_mask is None or gc_mask is False:
        mask = [False] * n
    elif gc_mask is True:
        mask = [True] * n
    else:
        mask = list(gc_mask)
    for i, p in enumerate(params):
        p64 = p.detach().to(torch.float64)
        g = grads[i].to(torch.float64)
        if mask[i]:
            g = _gc_one(g, vector_policy, min_fanin)
        d = g + weight_decay * p64
        ca = None if c_add is None else c_add[i]
        cs = None if c_sub is None else c_sub[i]
        if ca is not None:
            d = d + ca.to(torch.float64)
        if cs is not None:
            d = d - cs.to(torch.float64)
        if momentum != 0:
            b = cast(Sequence[torch.Tensor], momentum_bufs)[i]  # required with momentum (as in ops)
            d = d if first_step else momentum * b.to(torch.float64) + d
            b.copy_(d)
        p.copy_(p64 - lr * d)
    return list(params)


def corrected_sgd_step_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    c: TensorsOrNone,
    c_i: Optional[TensorsOrNone] = None,
    momentum_bufs: Optional[Sequence[torch.Tensor]] = None,
    *,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    first_step: bool = False,
    subset: Optional[Sequence[int]] = None,
) -> List[torch.Tensor]:
    n = len(params)
    keep = [True] * n if subset is None else [False] * n
    if subset is not None:
        subset = list(subset)
        if subset and all(isinstance(s, bool) for s in subset):
            keep = cast(List[bool], subset)
        else:
            for s in subset:
                keep[s] = True
    ca = [x if k else None for x, k in zip(c, keep)]
    cs = None if c_i is None else [x if k else None for x, k in zip(c_i, keep)]
    return fused_sgd_step_(
        params,
        grads,
        momentum_bufs,
        lr=lr,
        momentum=momentum,
        weight_decay=weight_decay,
        first_step=first_step,
        c_add=ca,
        c_sub=cs,
    )


def gc_sgd_step_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_bufs: Optional[Sequence[torch.Tensor]] = None,
    *,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    first_step: bool = False,
    gc_mask: GcMask = True,
    vector_policy: str = "skip",
    min_fanin: int = 2,
) -> List[torch.Tensor]:
    return fused_sgd_step_(
        params,
        grads,
        momentum_bufs,
        lr=lr,
        momentum=momentum,
        weight_decay=weight_decay,
        first_step=first_step,
        gc_mask=gc_mask,
        vector_policy=vector_policy,
        min_fanin=min_fanin,
    )


# ---- end of references -----------------------------------------------------------------------


# ---- differential-privacy noise (csrc/cuda/gaussian_noise.cuh) ---------------------------------
_M32 = 0xFFFFFFFF


def _mulhilo32(a: int, b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of a * b for a constant a and uint32 values b (held in int64), exactly:
    b split in 16-bit halves so no int64 product overflows."""
    bl, bh = b & 0xFFFF, b >> 16
    p1, p2 = a * bl, a * bh  # < 2^48 each
    t = p1 + ((p2 & 0xFFFF) << 16)  # < 2^49
    return (p2 >> 16) + (t >> 32), t & _M32


def philox4x32_10(ctr: Sequence[torch.Tensor], key: Tuple[int, int]) -> List[torch.Tensor]:
    """Philox4x32-10 (Random123) of the counters ``ctr`` (four int64 tensors of uint32 words) with
    ``key`` (two uint32): the four output words, in int64 integer ops only."""
    c = [torch.as_tensor(x, dtype=torch.int64) & _M32 for x in ctr]
    k0, k1 = key[0] & _M32, key[1] & _M32
    for r in range(10):
        if r > 0:
            k0, k1 = (k0 + 0x9E3779B9) & _M32, (k1 + 0xBB67AE85) & _M32
        hi0, lo0 = _mulhilo32(0xD2511F53, c[0])
        hi1, lo1 = _mulhilo32(0xCD9E8D57, c[2])
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
    return c


def _fma(a: float, b: float, c: float) -> float:
    """a * b + c rounded once (exact rational arithmetic; CPython's int division rounds correctly)."""
    from fractions import Fraction

    return float(Fraction(a) * Fraction(b) + Fraction(c))


def _log_unit(u: float) -> float:
    m, e = math.frexp(u)
    if m < 0.70710678118654752440:
        m, e = m * 2.0, e - 1
    f = m - 1.0
    s = f / (2.0 + f)
    z = s * s
    p = 1.0 / 23.0
    for k in (21, 19, 17, 15, 13, 11, 9, 7, 5, 3):
        p = _fma(p, z, 1.0 / k)
    lnm = 2.0 * _fma(s, z * p, s)
    de = float(e)
    return _fma(de, 6.93147180369123816490e-01, _fma(de, 1.90821492927058770002e-10, lnm))


def _sincos_octant(x: float) -> Tuple[float, float]:
    z = x * x
    ps = -1.0 / math.factorial(17)
    for k, sg in ((15, 1), (13, -1), (11, 1), (9, -1), (7, 1), (5, -1), (3, 1)):
        ps = _fma(ps, z, sg / math.factorial(k))
    s = _fma(-(x * z), ps, x)
    pc = 1.0 / math.factorial(18)
    for k, sg in ((16, -1), (14, 1), (12, -1), (10, 1), (8, -1), (6, 1), (4, -1), (2, 1)):
        pc = _fma(pc, z, sg / math.factorial(k))
    return s, _fma(-z, pc, 1.0)


def _box_muller(x0: int, x1: int, x2: int, x3: int) -> Tuple[float, float]:
    u1 = (float(((x1 & 0xFFFFF) << 32) | x0) + 0.5) * 2.0**-52
    w = float(((x3 & 0x3FFFFFFF) << 22) | (x2 >> 10)) * 2.0**-52
    q = x3 >> 30
    hi = w > 0.5
    sv, cv = _sincos_octant((1.0 - w if hi else w) * 1.57079632679489661923)
    sn, cs = (cv, sv) if hi else (sv, cv)
    s1, c1 = (cs, -sn) if q & 1 else (sn, cs)
    s2, c2 = (-s1, -c1) if q & 2 else (s1, c1)
    rho = math.sqrt(-2.0 * _log_unit(u1))
    return rho * c2, rho * s2


def philox_normal(n: int, seed: int, counter: int, j0: int = 0) -> torch.Tensor:
    """N(seed, counter, j) for j = j0 .. j0 + n - 1 as float64: Philox4x32-10 of the column pair j // 2
    (key = the seed's 32-bit halves, counter = (pair lo, pair hi, counter lo, counter hi)) and the same
    Box-Muller steps as csrc/cuda/gaussian_noise.cuh, evaluated with correctly rounded float64
    operations (fma exact): the same bits as the native kernels. Slow (per element); for tests."""
    if n <= 0:
        return torch.zeros(0, dtype=torch.float64)
    p = torch.arange(j0 // 2, (j0 + n - 1) // 2 + 1, dtype=torch.int64)
    ctr = [p & _M32, p >> 32, torch.full_like(p, counter & _M32), torch.full_like(p, (counter >> 32) & _M32)]
    x = philox4x32_10(ctr, (seed & _M32, (seed >> 32) & _M32))
    cols = [v.tolist() for v in x]
    vals: List[float] = []
    for i in range(p.numel()):
        vals.extend(_box_muller(cols[0][i], cols[1][i], cols[2][i], cols[3][i]))
    off = j0 - 2 * (j0 // 2)
    return torch.tensor(vals[off : off + n], dtype=torch.float64)


def _noise_like(x: torch.Tensor, sigma: float, seed: int, counter: int) -> torch.Tensor:
    """x + sigma * N(seed, counter, j) over x's flat elements, with the kernels' rounding: fp64 x as one
    fma, any other dtype as float(x) + float(sigma * n), then rounded to x's dtype."""
    flat = x.reshape(-1)
    nz = philox_normal(flat.numel(), seed, counter)
    if x.dtype == torch.float64:
        out = torch.tensor([_fma(sigma, n, v) for n, v in zip(nz.tolist(), flat.tolist())], dtype=torch.float64)
    else:
        out = flat.float() + (sigma * nz).float()
    return out.to(x.dtype).reshape(x.shape)


def add_gaussian_noise_(x: torch.Tensor, sigma: float, seed: int, counter: int) -> torch.Tensor:
    """In place: x[j] += sigma * N(seed, counter, j) (x's flat index j); returns x."""
    x.copy_(_noise_like(x, sigma, seed, counter))
    return x


def weighted_sum_noised(
    U: torch.Tensor,
    coef: CoefLike,
    base: Optional[torch.Tensor] = None,
    alpha: float = 1.0,
    rows: RowsLike = None,
    sigma: float = 0.0,
    seed: int = 0,
    counter: int = 0,
) -> torch.Tensor:
    """float64: base + alpha * sum_i coef[i] U[rows[i]] + sigma * N(seed, counter, j)."""
    s = weighted_sum(U, coef, base, alpha, rows).to(torch.float64)
    return s + sigma * philox_normal(s.numel(), seed, counter)


# ---- adaptive server optimiser (FedAdam / FedYogi / FedAdagrad) --------------------------------
def server_opt_step(
    io: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    x: torch.Tensor,
    *,
    rule: str,
    lr: float,
    beta_1: float = 0.0,
    beta_2: float = 0.0,
    tau: float = 1e-9,
    from_model: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 reference of ops.server_opt_step_, Flower's FedOpt arithmetic (fedadam.py / fedyogi.py /
    fedadagrad.py) on float64 copies: returns (new model, m, v) in float64; the inputs are not modified.
    g = io (or io - x), m = beta_1 m + (1 - beta_1) g, v per ``rule``, new = x + lr m / (sqrt(v) + tau)."""
    x64 = x.detach().to(torch.float64)
    g = io.detach().to(torch.float64)
    if from_model:
        g = g - x64
    m1 = beta_1 * m.to(torch.float64) + (1.0 - beta_1) * g
    v0 = v.to(torch.float64)
    if rule == "adam":
        v1 = beta_2 * v0 + (1.0 - beta_2) * (g * g)
    elif rule == "yogi":
        v1 = v0 - (1.0 - beta_2) * (g * g) * torch.sign(v0 - g * g)
    elif rule == "adagrad":
        v1 = v0 + g * g
    else:
        raise ValueError(f"server_opt_step: unknown rule {rule!r}")
    return x64 + lr * m1 / (torch.sqrt(v1) + tau), m1, v1


# ---- per-column selection (coordinate-wise median, trimmed mean, Bulyan) -------------------------
def _selected64(U: torch.Tensor, rows: RowsLike) -> torch.Tensor:
    idx = _rows_idx(rows, U.size(0), U.device)
    return U.index_select(0, idx).to(torch.float64)


def order_mean(U: torch.Tensor, lo: int, hi: int, rows: RowsLike = None) -> torch.Tensor:
    """Per column, the mean of the sorted (ascending) values at positions lo..hi-1 of the rows ``rows``
    (torch.sort, float64); NaN for a column with a NaN among them."""
    X = _selected64(U, rows)
    out = torch.sort(X, dim=0).values[lo:hi].sum(0) / (hi - lo)
    return torch.where(torch.isnan(X).any(0), torch.full_like(out, math.nan), out)


def order_mean_screened(U: torch.Tensor, lo: int, hi: int, rows: RowsLike = None) -> Tuple[torch.Tensor, torch.Tensor]:
    return order_mean(U, lo, hi, rows), finite_rows(U.index_select(0, _rows_idx(rows, U.size(0), U.device)))


def closest_mean(U: torch.Tensor, beta: int, rows: RowsLike = None) -> torch.Tensor:
    """Per column, the mean of the ``beta`` values closest to m = (x_a + x_{k//2}) / 2, a = (k-1)//2 (the
    median of the sorted values x; x_a / 2 + x_{k//2} / 2 where that sum overflows), distances |x - m| in float64, equal distances taken in ascending
    value order (a stable sort of the distances of the sorted values); NaN for a column with a NaN/Inf."""
    X = _selected64(U, rows)
    k = X.size(0)
    S = torch.sort(X, dim=0).values
    m = (S[(k - 1) // 2] + S[k // 2]) * 0.5
    m = torch.where(torch.isfinite(m), m, S[(k - 1) // 2] * 0.5 + S[k // 2] * 0.5)  # the sum overflowed
    order = torch.sort((S - m).abs(), dim=0, stable=True).indices[:beta]
    out = S.gather(0, order).sum(0) / beta
    return torch.where(torch.isfinite(X).all(0), out, torch.full_like(out, math.nan))


def closest_mean_screened(U: torch.Tensor, beta: int, rows: RowsLike = None) -> Tuple[torch.Tensor, torch.Tensor]:
    return closest_mean(U, beta, rows), finite_rows(U.index_select(0, _rows_idx(rows, U.size(0), U.device)))


def dequantize_blocks(Q: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """float64 [K, d]: scales[k, j // block] * Q[k, j] (int8 or float8_e4m3fn codes, exact in float64)."""
    d = Q.size(1)
    s = scales.to(torch.float64).repeat_interleave(block, dim=1)[:, :d]
    return s * Q.to(torch.float64)


def dequant_weighted_sum(
    Q: torch.Tensor,
    scales: torch.Tensor,
    coef: CoefLike,
    block: int,
    base: Optional[torch.Tensor] = None,
    alpha: float = 1.0,
    rows: RowsLike = None,
    out_dtype: Optional[torch.dtype] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(base + alpha * sum_i coef_i dequant(Q)[rows_i] in float64, the rows' flags: every scale finite and
    no NaN code)."""
    D = dequantize_blocks(Q, scales, block)
    r = _rows_idx(rows, Q.size(0), Q.device)
    ok = torch.isfinite(scales.index_select(0, r)).all(1) & ~torch.isnan(D.index_select(0, r)).any(1)
    return weighted_sum(D, coef, base, alpha, rows), ok


def sparse_weighted_sum(
    idx: torch.Tensor,
    val: torch.Tensor,
    offsets: object,
    coef: CoefLike,
    d: int,
    base: Optional[torch.Tensor] = None,
    alpha: float = 1.0,
    rows: RowsLike = None,
    out_dtype: Optional[torch.dtype] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(base + alpha * sum_i coef_i scatter(list rows_i) in float64, each list's finite flag): the lists
    densified one by one (index_add_ sums duplicates)."""
    o = torch.as_tensor(offsets, dtype=torch.int64).cpu()
    K = o.numel() - 1
    dense = torch.zeros(K, d, dtype=torch.float64)
    ok = torch.ones(K, dtype=torch.bool)
    for k in range(K):
        a, b = int(o[k]), int(o[k + 1])
        v = val[a:b].cpu().to(torch.float64)
        dense[k].index_add_(0, idx[a:b].cpu().to(torch.int64), v)
        ok[k] = bool(torch.isfinite(v).all())
    r = _rows_idx(rows, K, "cpu")
    b64 = None if base is None else base.cpu()
    return weighted_sum(dense, coef, b64, alpha, rows), ok.index_select(0, r)
