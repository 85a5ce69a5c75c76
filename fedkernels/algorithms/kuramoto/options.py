"""Kuramoto-FedAvg's options and payload check, apart from the method (kuramoto/__init__.py).

Options: ``mode`` ("S" default, "P" paper-literal, "C" authors' code); ``kappa0`` (default by mode:
S 0.5, P 0.5, C 0.2 = the code's K_t); ``beta`` (kappa decay, default 1.0); ``tau`` (mode P guard,
0.05); ``guard`` (mode P, True); ``clip_delta`` (mode S, True); ``theta_bar`` ("uniform" as the
paper, or "p"); ``clip`` (mode C elementwise clamp, 10.0); ``weighting`` ("samples" p = n/sum n, or
"uniform"); ``server_lr`` (eta_g, 1.0).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

from ..parts import WEIGHTINGS, check_choice

MODES = ("P", "S", "C")
DEFAULT_KAPPA0 = {"P": 0.5, "S": 0.5, "C": 0.2}


def check_options(name: str, mode, kappa0, beta, tau, theta_bar, clip, weighting) -> Tuple[str, float]:
    """One-line ValueError for the first option outside its range; returns (mode, kappa0) with the
    mode upper-cased and kappa0 defaulted by mode."""
    mode = str(mode).upper()
    if mode not in MODES:
        raise ValueError(
            f"kuramoto: mode must be one of {MODES} (P = paper-literal, S = coupled, C = authors' code), got {mode!r}"
        )
    k0 = float(DEFAULT_KAPPA0[mode] if kappa0 is None else kappa0)
    if not math.isfinite(k0) or k0 < 0:
        raise ValueError(f"kuramoto: kappa0 must be a finite number >= 0, got {kappa0}")
    if not (0.0 < float(beta) <= 1.0):
        raise ValueError(f"kuramoto: beta must lie in (0, 1], got {beta}")
    if not (float(tau) >= 0.0):
        raise ValueError(f"kuramoto: tau must be >= 0, got {tau}")
    check_choice(name, "theta_bar", theta_bar, ("uniform", "p"))
    check_choice(name, "weighting", weighting, WEIGHTINGS)
    if not (float(clip) > 0):
        raise ValueError(f"kuramoto: clip must be > 0, got {clip}")
    return mode, k0


def check_phase(payload: Dict[str, Any]) -> Optional[str]:
    """Mode C: the reason a client's payload has no usable ``phase`` (None when it has)."""
    v = payload.get("phase")
    try:
        v = float(v)
    except (TypeError, ValueError):
        return "kuramoto mode C needs payload 'phase' (a number; see KuramotoPhaseRule)"
    if not math.isfinite(v):
        return f"payload 'phase' must be finite, got {v}"
    return None
