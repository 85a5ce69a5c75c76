"""FedECADO's fused backward-Euler step: ``fedecado_be_step``.

One pass over d (``csrc/cpu/fedecado_be_step.cpp``; CUDA: ``csrc/cuda/fedecado_be_step.cu``);
float64 oracle in :mod:`fedkernels.reference`. The per-client scalars (the thetas and 1/g_i) are
host (CPU) float64 vectors for every device. No derivative: a backward through it raises.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple

import torch

from .._types import CoefLike
from . import _autograd as _ag
from ._checks import _host_coef, _matrix, _needs_kernel, _no_grad_through, _same_storage, _tensor, _vector

__all__ = ["fedecado_be_step"]


def fedecado_be_step(xc: torch.Tensor, Icur: torch.Tensor, xc0: torch.Tensor, U: torch.Tensor, Ik: torch.Tensor,
                     S_off: Optional[torch.Tensor], theta_new: CoefLike, theta_old: CoefLike, inv_g: CoefLike,
                     dt: float, L: float, out: Optional[Sequence[torch.Tensor]] = None,
                     lte_out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
    mats: Dict[str, torch.Tensor] = {}
    for name, M in (("Icur", Icur), ("Ik", Ik)):
        M = _matrix(M, op, name)
        if tuple(M.shape) != (K, d):
            raise ValueError(f"{op}: {name} must have shape [K, d] = [{K}, {d}] (the shape of U), got {tuple(M.shape)}")
        if M.dtype != U.dtype or M.device != U.device:
            raise ValueError(f"{op}: {name} must have U's dtype {U.dtype} and device {U.device}, got {M.dtype} on {M.device}")
        mats[name] = M
    vecs: Dict[str, Optional[torch.Tensor]] = {}
    for name, v in (("xc", xc), ("xc0", xc0), ("S_off", S_off)):
        if v is None and name == "S_off":
            vecs[name] = None
            continue
        vecs[name] = _vector(v, op, name, d, U).contiguous()
    thn = _host_coef(theta_new, K, op, "theta_new")
    tho = _host_coef(theta_old, K, op, "theta_old")
    ig = _host_coef(inv_g, K, op, "inv_g", nonneg=True)
    for name, x in (("dt", dt), ("L", L)):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or not x > 0:
            raise ValueError(f"{op}: {name} must be a finite number > 0, got {x!r}")
    _needs_kernel("fedecado_be_step_out", U.device, op)
    _no_grad_through(op, U, mats["Icur"], mats["Ik"], *[v for v in vecs.values() if v is not None],
                     theta_new, theta_old, inv_g)
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
def _be_step_fake(xc: torch.Tensor, Icur: torch.Tensor, xc0: torch.Tensor, U: torch.Tensor, Ik: torch.Tensor,
                  S_off: Optional[torch.Tensor], theta_new: torch.Tensor, theta_old: torch.Tensor,
                  inv_g: torch.Tensor, dt: float, L: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return U.new_empty((U.size(1),)), U.new_empty((U.size(0), U.size(1))), U.new_empty((2,), dtype=torch.float64)


@torch.library.register_fake("fedkernels::fedecado_be_step_out")
def _be_step_out_fake(xc: torch.Tensor, Icur: torch.Tensor, xc0: torch.Tensor, U: torch.Tensor, Ik: torch.Tensor,
                      S_off: Optional[torch.Tensor], theta_new: torch.Tensor, theta_old: torch.Tensor,
                      inv_g: torch.Tensor, dt: float, L: float, xc_out: torch.Tensor, I_out: torch.Tensor,
                      lte: torch.Tensor) -> None:
    return None


_ag.no_derivative_op("fedecado_be_step", "it is a server-side integrator step, not a training op")
