"""Pure-PyTorch reference (oracle) for every native op, computed in float64.

These are written for clarity, not speed: the tests compare each native op against the matching
function here on random inputs. They accept the same arguments as the functions in ops.py.
"""
from __future__ import annotations

from typing import Optional

import torch


def _rows_idx(rows, K: int, device) -> torch.Tensor:
    if rows is None:
        return torch.arange(K, device=device)
    return torch.as_tensor(rows, device=device).to(torch.long)


# ---- aggregation core --------------------------------------------------------------------------
def gram(U: torch.Tensor, rows=None) -> torch.Tensor:
    U64 = U.to(torch.float64)
    return U64[_rows_idx(rows, U.size(0), U.device)] @ U64.T


def weighted_sum(U: torch.Tensor, coef, base: Optional[torch.Tensor] = None, alpha: float = 1.0,
                 rows=None, out=None) -> torch.Tensor:
    U64 = U.to(torch.float64)
    r = _rows_idx(rows, U.size(0), U.device)
    c = torch.as_tensor(coef, dtype=torch.float64, device=U.device)
    s = alpha * (c[:, None] * U64[r]).sum(0) if r.numel() else torch.zeros(U.size(1), dtype=torch.float64)
    if base is not None:
        s = base.to(torch.float64) + s
    return s


def finite_rows(U: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(U).all(dim=1) if U.size(1) else torch.ones(U.size(0), dtype=torch.bool)


# ---- min-norm solver (FedAWARE) --------------------------------------------------------------


# ---- small dense linear algebra (FedECADO) ---------------------------------------------------


# ---- gradient centralization (GC-Fed) --------------------------------------------------------


# ---- fused local steps (SCAFFOLD, FedPVR, Local GC) -----------------------------------------


# ---- end of references -----------------------------------------------------------------------
