"""FedECADO's server integrator (spec §2.4-§2.8, §9.1): the interpolation Gamma, one Backward-Euler
attempt on the arrowhead system, and one round's LTE-controlled integration. The method
(fedecado/__init__.py) calls :func:`central_round` once per round; the hot path is the native fused attempt
``ops.fedecado_be_step``; the arrowhead system is solved by ``ops.arrowhead_solve`` (or LU).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Dict, Optional, Sequence, Union

import torch

from ... import ops
from ...ops._checks import has_kernel

log = logging.getLogger("fedkernels")


# ---------------------------------------------------------------------------------------------
# the linear solve
# ---------------------------------------------------------------------------------------------
def _native_ok(t: torch.Tensor) -> bool:
    """The native linear-algebra ops take float32/float64 CPU tensors (elsewhere: the torch path)."""
    return t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64)


def _solve_be_system(a: torch.Tensor, dt: float, c: float, b0: torch.Tensor, r: torch.Tensor, solver: str = "auto"):
    """Solves, for every coordinate j, the arrowhead system (spec §2.6)

        x_j - dt * sum_i I_ij = b0_j ;    c * x_j + a_i * I_ij = r_ij   (i = 1..K)

    a: [K] float64 (a_i >= 1); b0: [d]; r: [K, d] (a scratch buffer: may be overwritten).
    Returns (x [d], I [K, d]).

    ``solver``:
    * "auto": the native closed form ``ops.arrowhead_solve`` (one pass) for float32/float64 CPU
      tensors, else the torch closed form below.
    * "closed_form": the torch closed form (Schur complement on the x row = LU without pivoting with
      x ordered last; a_i >= 1 and the Schur denominator >= 1, so it never breaks down).
    * "lu": dense LU of the (K+1) x (K+1) matrix ordered [I_1..I_K, x] (no fill-in), factored once
      and applied to all d right-hand sides: ``ops.lu_factor`` / ``ops.lu_solve`` on the CPU,
      ``torch.linalg.lu_factor`` / ``lu_solve`` elsewhere. Same result as the closed form (to
      rounding); it is the general path a non-arrowhead sensitivity model would need.
    """
    K = r.size(0)
    if solver == "auto":
        if _native_ok(r):
            return ops.arrowhead_solve(a.to(torch.float64), -dt, c, 1.0, b0.contiguous(), r)
        solver = "closed_form"
    if solver != "lu":
        inv_a = (1.0 / a).to(torch.float64)
        acc = ops.weighted_sum(r, inv_a)  # sum_i r_i / a_i
        den = 1.0 + dt * c * float(inv_a.sum())
        x = (b0 + dt * acc) / den
        # I_i = (r_i - c x) / a_i, written into r
        I = r.sub_(x.unsqueeze(0), alpha=c).mul_(inv_a.to(r.dtype).to(r.device).unsqueeze(1))
        return x, I
    M = torch.zeros(K + 1, K + 1, dtype=torch.float64)
    M[torch.arange(K), torch.arange(K)] = a.to(torch.float64)
    M[:K, K] = c
    M[K, :K] = -dt
    M[K, K] = 1.0
    R = torch.cat([r, b0.unsqueeze(0)], 0)
    if r.device.type == "cpu":
        LU, piv = ops.lu_factor(M)
        Z = ops.lu_solve(LU, piv, R)
    else:
        LU, piv = torch.linalg.lu_factor(M.to(dtype=r.dtype, device=r.device))
        Z = torch.linalg.lu_solve(LU, piv, R)
    return Z[K].clone(), Z[:K].clone()


# ---------------------------------------------------------------------------------------------
# interpolation, one BE attempt, one central round (torch versions of spec §9.1)
# ---------------------------------------------------------------------------------------------
def theta(
    T: Union[Sequence[float], torch.Tensor], tau: float, extrap: str = "linear", max_ratio: float = math.inf
) -> torch.Tensor:
    """[K] float64 interpolation factors tau / T_i (hold: min(., 1); capped at max_ratio); T: K floats
    or a float64 tensor."""
    th = tau / torch.as_tensor(T, dtype=torch.float64)
    if extrap == "hold":
        th = th.clamp(max=1.0)
    if max_ratio != math.inf:
        th = th.clamp(max=max_ratio)
    return th


def interp(xc0: torch.Tensor, xend: torch.Tensor, T, tau: float, mode: str = "linear") -> torch.Tensor:
    """Gamma_i(tau) = x_c0 + (tau / T_i)(x_end_i - x_c0) (spec §2.4): [K, d]."""
    th = theta(T, tau, mode).to(xend.dtype).to(xend.device)
    return xc0.unsqueeze(0) + th.unsqueeze(1) * (xend - xc0.unsqueeze(0))


def _norm(v: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "inf":
        return ops.amax_d(v.abs())
    return ops.mean_d(v.pow(2)).sqrt()


def _fused_ok(xc, Icur, xc0, U, Ik, S_off, lte_norm: str) -> bool:
    """The native fused attempt (ops.fedecado_be_step) applies: inf-norm LTE and fp32/fp64 tensors of
    one dtype on a device with its kernel (CPU, CUDA) (the torch composition in be_step serves every
    other case)."""
    if lte_norm != "inf":
        return False
    dt_, dev = U.dtype, U.device
    if dt_ not in (torch.float32, torch.float64) or not has_kernel("fedecado_be_step_out", dev):
        return False
    return all(t.dtype == dt_ and t.device == dev for t in (xc, Icur, xc0, Ik) + (() if S_off is None else (S_off,)))


def be_step(
    xc,
    Icur,
    xc0,
    U,
    Ik,
    th_new,
    th_old,
    inv_g,
    dt: float,
    L: float,
    S_off=None,
    lte_norm: str = "inf",
    solver: str = "auto",
    out=None,
):
    """One Backward-Euler attempt (spec §2.6/§2.7, reference ``be_step``).

    U = x_end - x_c0 [K, d] (the client updates); th_new/th_old [K] interpolation factors at
    tau + dt and tau; inv_g [K] = 1/g_i (0 = ECADO limit). Returns (x_c', I', LTE_c, LTE_I).

    solver="fused": the native fused op ops.fedecado_be_step (one pass over d, no K x d
    temporaries; needs lte_norm="inf" and fp32/fp64 tensors of one dtype on a device with the op's
    kernel, else ValueError);
    out=(xc_buf [d], I_buf [K, d]) then receives x_c', I' (buffers sharing no storage with the
    inputs). Other solvers: the torch composition below with _solve_be_system's switch (out unused).
    central_round with solver="auto" picks "fused" whenever it applies."""
    if solver == "fused":
        if not _fused_ok(xc, Icur, xc0, U, Ik, S_off, lte_norm):
            raise ValueError(
                "be_step: solver='fused' needs lte_norm='inf', the native op and float32/float64 "
                "tensors of one dtype on a device with its kernel (CPU, CUDA)"
            )
        xn, In, lte = ops.fedecado_be_step(
            xc, Icur, xc0, U, Ik, S_off, th_new, th_old, inv_g, float(dt), float(L), out=out
        )
        lc, li = ops.amax_d(lte.unsqueeze(1)).tolist()  # max across ranks in sharded mode
        return xn, In, lc, li
    c = dt / L
    dev, dt_ = U.device, U.dtype
    thn = th_new.to(dt_).to(dev).unsqueeze(1)
    ig = inv_g.to(torch.float64)
    a = 1.0 + c * ig  # a_i = 1 + dt / (L g_i)
    # r_i = I_i + c (Gamma_i(tau+dt) + Ik_i / g_i),  Gamma = x_c0 + th U
    r = torch.addcmul(xc0.unsqueeze(0), thn, U)
    r.add_(Ik * ig.to(dt_).to(dev).unsqueeze(1)).mul_(c).add_(Icur)
    b0 = xc if S_off is None else xc + dt * S_off
    xn, In = _solve_be_system(a, dt, c, b0, r, solver)
    D = In - Icur
    nc = _norm(D.sum(0), lte_norm)
    # (x~_i' - x_c') - (x~_i - x_c) = (th'_i - th_i) U_i - (I_i' - I_i)/g_i - (x_c' - x_c)
    e = torch.mul(U, (th_new - th_old).to(dt_).to(dev).unsqueeze(1))
    e.sub_(D.mul_(ig.to(dt_).to(dev).unsqueeze(1))).sub_((xn - xc).unsqueeze(0))
    nc, ni = torch.stack([nc, _norm(e, lte_norm).max()]).tolist()  # both norms: one device-to-host copy
    return xn, In, 0.5 * dt * nc, 0.5 * dt / L * ni


def central_round(
    xc0,
    I_act,
    U,
    T,
    w,
    hbar,
    L: float,
    delta: float,
    dt_init: float,
    S_off=None,
    delta_I: Optional[float] = None,
    beta: float = 0.5,
    growth: float = 1.0,
    max_backtracks: int = 30,
    max_steps: int = 1000,
    extrap: str = "linear",
    max_extrap_ratio: float = math.inf,
    lte_norm: str = "inf",
    sensitivity: bool = True,
    dt_min_frac: float = 1e-9,
    solver: str = "auto",
    trace: Optional[list] = None,
) -> Dict[str, Any]:
    """The server's integration over one round window [0, T_max] (spec §2.8 step 5-6, §9.1).

    xc0 [d]; I_act [K, d] the flows of the active clients at the round start (= I^k); U [K, d];
    T, w, hbar: K floats (sequences or tensors). Returns dict(xc, I, dt, steps, rejects, truncated, lte_c, lte_I,
    finite). solver="auto" uses the native fused attempt (be_step solver="fused") when it applies.

    ``finite`` True proves x_c and I finite: every accepted step was a fused attempt with finite LTEs
    (the op maps a NaN to +inf in both maxima; from finite inputs, a non-finite I'_ij makes
    sum_i (I'_i - Icur_i) non-finite at j and a non-finite x'_j makes every e_ij non-finite, so a
    finite LTE_c and LTE_I mean finite outputs; by induction over the steps from the finite round
    start). False: unknown (the caller checks the values)."""
    Tv = torch.as_tensor(T, dtype=torch.float64)  # theta's divisor, made once for every attempt
    Tmax = float(Tv.max())
    wv = torch.as_tensor(w, dtype=torch.float64)
    hv = torch.as_tensor(hbar, dtype=torch.float64).clamp(min=0.0)
    wh = wv * hv  # w_i hbar_i, made once for every attempt
    dI = delta if delta_I is None else delta_I
    tl, steps, rejects, truncated = 0.0, 0, 0, False
    xc, Ik, Icur = xc0, I_act, I_act
    dt = min(dt_init * growth, Tmax)
    dt_min = dt_min_frac * Tmax
    lte_max = [0.0, 0.0]

    def inv_g(dtt):
        if not sensitivity:
            return torch.zeros_like(wv)
        return 1.0 / (1.0 / dtt + wh)

    # Native fused attempts (ops.BEStepWindow: the window's fixed arguments checked once) write into
    # two (x_c, I) buffer pairs: an attempt writes the pair that is not the current state, a rejection
    # retries into the same pair, an acceptance makes it current (swap). Nothing K x d is allocated
    # per attempt; each attempt makes one device-to-host copy (its two LTE maxima).
    fused = solver in ("auto", "fused") and _fused_ok(xc0, I_act, xc0, U, I_act, S_off, lte_norm)
    win = ops.BEStepWindow(xc0, U, I_act, S_off, L) if fused else None
    cur: Optional[int] = None  # the fused state: None = the round start, else the pair it is in
    nxt = 0
    finite = fused  # (see ``finite`` above: proved only for fused attempts)

    th_at = [math.nan, None]  # (tl, theta at tl): the same for every attempt of one step

    def attempt(dtt):
        th_n = theta(Tv, tl + dtt, extrap, max_extrap_ratio)
        if th_at[0] != tl:
            th_at[:] = [tl, theta(Tv, tl, extrap, max_extrap_ratio)]
        th_o = th_at[1]
        if win is not None:
            xn, In, lte = win.step(th_n, th_o, inv_g(dtt), dtt, src=cur, dst=nxt)
            lc, li = ops.amax_d(lte.unsqueeze(1)).tolist()  # max across ranks in sharded mode
            return xn, In, lc, li
        return be_step(xc, Icur, xc0, U, Ik, th_n, th_o, inv_g(dtt), dtt, L, S_off, lte_norm, solver)

    while Tmax - tl > 1e-12 * Tmax:
        if steps >= max_steps:  # safety: finish the window in one forced step
            dtt = Tmax - tl
            xc, Icur, lc, li = attempt(dtt)
            finite = finite and math.isfinite(lc) and math.isfinite(li)
            cur, nxt = nxt, nxt ^ 1
            tl, steps, truncated = Tmax, steps + 1, True
            if trace is not None:
                trace.append((tl - dtt, dtt, lc, li, "forced"))
            break
        dtt = min(dt, Tmax - tl)
        clipped = dtt < dt
        for nb in range(max_backtracks + 1):
            xn, In, lc, li = attempt(dtt)
            ok = lc <= delta and li <= dI
            if trace is not None:
                trace.append((tl, dtt, lc, li, "accept" if ok else "reject"))
            if ok or nb == max_backtracks or dtt * beta < dt_min:
                if not ok:
                    log.warning("fedecado: LTE test not met after %d backtracks (dt=%g); step accepted", nb, dtt)
                break
            dtt *= beta
            clipped = False
            rejects += 1
        lte_max = [max(lte_max[0], lc), max(lte_max[1], li)]
        finite = finite and math.isfinite(lc) and math.isfinite(li)
        tl += dtt
        xc, Icur = xn, In
        cur, nxt = nxt, nxt ^ 1
        steps += 1
        if not clipped:
            dt = dtt
    return {
        "xc": xc,
        "I": Icur,
        "dt": dt,
        "steps": steps,
        "rejects": rejects,
        "truncated": truncated,
        "lte_c": lte_max[0],
        "lte_I": lte_max[1],
        "T_max": Tmax,
        "finite": finite,
    }
