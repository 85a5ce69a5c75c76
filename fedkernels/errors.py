"""Exceptions shared by every layer (imports nothing from fedkernels).

``BadUpdateError``: a client update is not usable (NaN/Inf, wrong length, no samples). Raised by
the aggregators (``fedkernels.algorithms``) and by the streamed aggregation
(``fedkernels.streaming``); it lives here, below both, so neither imports the other for it.

``RunError``: a run cannot go on, for a reason that is neither the user's input nor one client's
update (a worker process could not start or died, a client failed with an error that is not a
bad-client error, every client of a round was excluded). The CLI prints it as one line, exit 1.
"""

from __future__ import annotations

__all__ = ["BadUpdateError", "RunError"]


class BadUpdateError(ValueError):
    """A client update is not usable (NaN/Inf, wrong length, no samples)."""


class RunError(RuntimeError):
    """The run stops: not bad input, not a bad client to exclude (see the module docstring)."""
