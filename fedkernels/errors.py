"""Exceptions shared by every layer (imports nothing from fedkernels).

``BadUpdateError``: a client update is not usable (NaN/Inf, wrong length, no samples). Raised by
the aggregators (``fedkernels.algorithms``) and by the streamed aggregation
(``fedkernels.streaming``); it lives here, below both, so neither imports the other for it.
"""
from __future__ import annotations

__all__ = ["BadUpdateError"]


class BadUpdateError(ValueError):
    """A client update is not usable (NaN/Inf, wrong length, no samples)."""
