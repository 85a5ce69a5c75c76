"""Argument types shared by the public signatures (imports only torch; every layer may use it).

These are the accepted forms of the small per-client arguments of :mod:`fedkernels.ops` and its
float64 oracle :mod:`fedkernels.reference`; the wrappers check the values at run time.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

__all__ = ["RowsLike", "CoefLike", "ScalarOrCoef", "TensorsOrNone", "GcMask"]

# row indices into U: None (all rows), a 1-D integer tensor or a sequence of ints
RowsLike = Optional[Union[torch.Tensor, Sequence[int]]]
# per-client float coefficients: a 1-D tensor or a sequence of numbers
CoefLike = Union[torch.Tensor, Sequence[float]]
# one number for every client, or one per client (arrowhead_solve's a, b, c)
ScalarOrCoef = Union[float, torch.Tensor, Sequence[float]]
# one tensor-or-None per parameter (a control variate absent on some tensors)
TensorsOrNone = Sequence[Optional[torch.Tensor]]
# Local GC on: None/False (nowhere), True (everywhere) or one bool per parameter
GcMask = Union[None, bool, Sequence[bool]]
