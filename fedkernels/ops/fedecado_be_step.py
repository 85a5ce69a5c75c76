"""FedECADO's fused backward-Euler step: ``fedecado_be_step``.

One pass over d (``csrc/cpu/fedecado_be_step.cpp``; CUDA: ``csrc/cuda/fedecado_be_step.cu``);
float64 oracle in :mod:`fedkernels.reference`. The per-client scalars (the thetas and 1/g_i) are
host (CPU) float64 vectors for every device. No derivative: a backward through it raises.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .._types import CoefLike
from . import _autograd as _ag
from ._checks import _host_coef, _matrix, _needs_kernel, _no_grad_through, _same_storage, _tensor

__all__ = ["fedecado_be_step", "BEStepWindow"]


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
    out: Optional[Sequence[torch.Tensor]] = None,
    lte_out: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
    Arithmetic is float64 inside for both dtypes on the CPU. The attempts of one integration window
    (the same xc0, U, Ik, S_off, L): :class:`BEStepWindow` checks those once.
    """
    win = BEStepWindow(
        xc0, U, Ik, S_off, L, xc=xc, Icur=Icur, theta=(theta_new, theta_old, inv_g, dt), out=out, lte_out=lte_out
    )
    return win.step(theta_new, theta_old, inv_g, dt, src=None, dst=0)


class BEStepWindow:
    """:func:`fedecado_be_step` over the attempts of one integration window (FedECADO's
    ``central_round``): what stays fixed (xc0, U, Ik, S_off, L, the start state (xc, Icur), default
    (xc0, Ik)) is checked once here in Python (types, L, the layout copy, the outputs' storage), with
    :func:`fedecado_be_step`'s rules and messages; the attempts write into output pairs that the window
    owns (allocated on first use, or ``out`` as pair 0), so :meth:`step` checks only its own arguments
    (the host vectors, dt, which state it reads and which pair it writes). The tensors' shapes, dtypes
    and devices are the native op's checks (a few comparisons per attempt): a bad one raises at the
    first step. Same op, same results as calling :func:`fedecado_be_step` per attempt."""

    def __init__(
        self,
        xc0: torch.Tensor,
        U: torch.Tensor,
        Ik: torch.Tensor,
        S_off: Optional[torch.Tensor],
        L: float,
        xc: Optional[torch.Tensor] = None,
        Icur: Optional[torch.Tensor] = None,
        theta: Optional[Tuple[CoefLike, CoefLike, CoefLike, float]] = None,
        out: Optional[Sequence[torch.Tensor]] = None,
        lte_out: Optional[torch.Tensor] = None,
    ) -> None:
        op = "fedecado_be_step"
        # types and layouts here; shapes, dtypes and devices: the native op (csrc/fedecado_be_step_checks.h)
        U = _matrix(U, op, "U")
        mats = {name: _matrix(M, op, name) for name, M in (("Icur", Ik if Icur is None else Icur), ("Ik", Ik))}
        vecs: Dict[str, Optional[torch.Tensor]] = {}
        for name, v in (("xc", xc0 if xc is None else xc), ("xc0", xc0), ("S_off", S_off)):
            vecs[name] = None if v is None and name == "S_off" else _tensor(v, op, name).contiguous()
        # K and d, read only from a U of the right rank (else the native op raises U's shape error
        # before the host vectors' lengths are checked against them)
        K, d = (U.size(0), U.size(1)) if U.dim() == 2 else (0, 0)
        self._pre: Optional[Tuple[Any, ...]] = None
        if theta is not None:  # (a single call: its vectors and dt checked in fedecado_be_step's order)
            self._pre = theta[:3] + (self._coefs(K, *theta[:3]),)
            _positive(theta[3], op, "dt")
        _positive(L, op, "L")
        _needs_kernel("fedecado_be_step_out", U.device, op)
        _no_grad_through(
            op,
            U,
            mats["Icur"],
            mats["Ik"],
            *[v for v in vecs.values() if v is not None],
            *(() if theta is None else theta[:3]),
        )
        if lte_out is None:
            lte_out = torch.empty(2, dtype=torch.float64, device=U.device)
        elif not isinstance(lte_out, torch.Tensor):
            raise ValueError(f"{op}: lte_out must be a contiguous float64 tensor of shape [2] on {U.device}")
        self.pairs: List[Optional[Tuple[torch.Tensor, torch.Tensor]]] = [None, None]
        if out is not None:
            if not isinstance(out, (tuple, list)) or len(out) != 2:
                raise ValueError(f"{op}: out must be a pair (xc_out [d], I_out [K, d])")
            xo, Io = (_tensor(t, op, name) for t, name in zip(out, ("xc_out", "I_out")))
            ins = [U, mats["Icur"], mats["Ik"]] + [v for v in vecs.values() if v is not None]
            for name, t in (("xc_out", xo), ("I_out", Io)):
                if any(_same_storage(t, x) for x in ins) or (name == "I_out" and _same_storage(xo, Io)):
                    raise ValueError(f"{op}: {name} must not share storage with an input or the other output")
            self.pairs[0] = (xo, Io)
        self.U, self.Ik, self.xc0, self.S_off = U, mats["Ik"], vecs["xc0"], vecs["S_off"]
        self.K, self.d = K, d
        self.start = (vecs["xc"], mats["Icur"])
        self.L, self.lte = float(L), lte_out

    def _coefs(
        self, K: int, theta_new: CoefLike, theta_old: CoefLike, inv_g: CoefLike
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        op = "fedecado_be_step"
        return (
            _host_coef(theta_new, K, op, "theta_new"),
            _host_coef(theta_old, K, op, "theta_old"),
            _host_coef(inv_g, K, op, "inv_g", nonneg=True),
        )

    def pair(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Output pair ``i`` (0 or 1): (x_c' [d], I' [K, d]) buffers of U's dtype and device."""
        p = self.pairs[i]
        if p is None:
            U = self.U
            p = self.pairs[i] = (
                torch.empty(self.d, dtype=U.dtype, device=U.device),
                torch.empty(self.K, self.d, dtype=U.dtype, device=U.device),
            )
        return p

    def step(
        self, theta_new: CoefLike, theta_old: CoefLike, inv_g: CoefLike, dt: float, src: Optional[int], dst: int
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One attempt from state ``src`` (None: the start state; i: output pair i, written by an earlier
        attempt) into output pair ``dst`` (not ``src``). Returns (x_c', I', lte) as fedecado_be_step
        (``lte`` is the window's [2] buffer: read it before the next step)."""
        op = "fedecado_be_step"
        if src is not None and (src == dst or self.pairs[src] is None):
            raise ValueError(
                f"{op}: an attempt reads state {src} and writes pair {dst}: it must read the start "
                "state or a pair written before, and write the other pair"
            )
        xc, Icur = self.start if src is None else self.pair(src)
        pre, self._pre = self._pre, None
        if pre is not None and pre[0] is theta_new and pre[1] is theta_old and pre[2] is inv_g:
            thn, tho, ig = pre[3]  # (checked by the constructor of a single call)
        else:
            thn, tho, ig = self._coefs(self.K, theta_new, theta_old, inv_g)
        _positive(dt, op, "dt")
        _no_grad_through(op, theta_new, theta_old, inv_g)
        xo, Io = self.pair(dst)
        torch.ops.fedkernels.fedecado_be_step_out(
            xc, Icur, self.xc0, self.U, self.Ik, self.S_off, thn, tho, ig, float(dt), self.L, xo, Io, self.lte
        )
        return xo, Io, self.lte


def _positive(x: object, op: str, name: str) -> None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or not x > 0:
        raise ValueError(f"{op}: {name} must be a finite number > 0, got {x!r}")


@torch.library.register_fake("fedkernels::fedecado_be_step")
def _be_step_fake(
    xc: torch.Tensor,
    Icur: torch.Tensor,
    xc0: torch.Tensor,
    U: torch.Tensor,
    Ik: torch.Tensor,
    S_off: Optional[torch.Tensor],
    theta_new: torch.Tensor,
    theta_old: torch.Tensor,
    inv_g: torch.Tensor,
    dt: float,
    L: float,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return U.new_empty((U.size(1),)), U.new_empty((U.size(0), U.size(1))), U.new_empty((2,), dtype=torch.float64)


@torch.library.register_fake("fedkernels::fedecado_be_step_out")
def _be_step_out_fake(
    xc: torch.Tensor,
    Icur: torch.Tensor,
    xc0: torch.Tensor,
    U: torch.Tensor,
    Ik: torch.Tensor,
    S_off: Optional[torch.Tensor],
    theta_new: torch.Tensor,
    theta_old: torch.Tensor,
    inv_g: torch.Tensor,
    dt: float,
    L: float,
    xc_out: torch.Tensor,
    I_out: torch.Tensor,
    lte: torch.Tensor,
) -> None:
    return None


_ag.no_derivative_op("fedecado_be_step", "it is a server-side integrator step, not a training op")
