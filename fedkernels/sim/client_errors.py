"""Client errors: what one client's local training may raise and still be a bad client (excluded, or
:class:`BadClientError` under ``bad_client_policy="raise"``), as every executor classifies it."""

from __future__ import annotations


class BadClientError(RuntimeError):
    """A client failed and bad_client_policy is "raise"."""


# what one client's training may raise and still be a bad client (excluded, or BadClientError under
# "raise"); BadUpdateError is a ValueError. Anything else stops the run (fedkernels.sim.simulation).
CLIENT_ERRORS = (BadClientError, ValueError, ArithmeticError)


def client_error(e: BaseException):
    """``(reason, bad_client)`` of an exception raised while training one client: the line that names
    it and whether it is that client's bad update (:data:`CLIENT_ERRORS`) or a failure of the run."""
    reason = str(e) if isinstance(e, BadClientError) else f"{type(e).__name__}: {e}"
    return reason, isinstance(e, CLIENT_ERRORS)
