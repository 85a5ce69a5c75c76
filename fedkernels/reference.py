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
def _gc_one(x: torch.Tensor, vector_policy: str, min_fanin: int) -> torch.Tensor:
    x64 = x.detach().to(torch.float64)
    if x.dim() == 0 or x.numel() == 0:
        return x64.clone()
    if x.dim() == 1:
        if vector_policy == "skip" or x.numel() < min_fanin:
            return x64.clone()
        return x64 - x64.mean()
    if x.numel() // x.size(0) < min_fanin:
        return x64.clone()
    return x64 - x64.mean(dim=tuple(range(1, x.dim())), keepdim=True)


def gc_project(tensors, vector_policy: str = "skip", min_fanin: int = 2) -> list:
    """float64 GC: ``x - x.mean(dim=tuple(range(1, x.ndim)), keepdim=True)`` with the policies of
    GC-Fed §2.1 (1-D: skip or centre the whole vector; 0-D, empty, fan-in < min_fanin: unchanged)."""
    return [_gc_one(x, vector_policy, min_fanin) for x in tensors]


def gc_project_(tensors, vector_policy: str = "skip", min_fanin: int = 2) -> list:
    """In-place form of :func:`gc_project` (computed in float64, written back in each tensor's dtype)."""
    for x, y in zip(tensors, gc_project(tensors, vector_policy, min_fanin)):
        x.copy_(y)
    return list(tensors)




# ---- fused local steps (SCAFFOLD, FedPVR, Local GC) -----------------------------------------


# ---- end of references -----------------------------------------------------------------------
