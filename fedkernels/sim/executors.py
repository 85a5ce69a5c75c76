"""Client executors: who trains a round's clients (phase 2 of the round loop in ``sim/server.py``).

The round loop (``Simulation.run_round``) draws the round's clients, prepares their payloads, hands
phase 2 to the run's executor, exchanges and aggregates; the executor only trains. Protocol::

    executor.train_local(r, ids, positions, payload_of, factor)
        -> {"accepted": [...], "excluded": [(pos, record), ...], "error": None | (pos, message, exc),
            "t_local": seconds}
    executor.close()                                   # the run ended, however it ended
    executor.evaluate(r, batch_size, clients)          # optional: the evaluation's forward passes
        -> (accuracy, test loss, client losses or None)   # elsewhere (absent: in the main process)

``ids``: the round's client ids (schedule order); ``positions``: the positions of ``ids`` this
process trains (all of them in one process; a rank's block under torch.distributed);
``payload_of(pos)``: the client's payload (an exception it raises counts as that client's);
``factor``: the round's lr schedule factor. Per accepted client, in schedule order: ``pos, cid, n,
payload, loss, steps``, its update written into the next row of ``sim.buf`` in that order (so
``sim.buf.matrix()`` is the round's U). A client that fails goes through :func:`client_failed`
(the bad-client policy): excluded (``excluded``), or the round's ``error``.

Implementations: :class:`SequentialExecutor` (here: one client after another in this process),
``batched.BatchedExecutor`` (``clients_at_once``: a chunk of clients as one vmapped computation),
``workers.WorkerExecutor`` (``workers=N``: a pool of forked worker processes). torch.distributed
ranks (``distributed_sim.DistributedSimulation``) run one of these on their block of positions and
replace the loop's exchange phase. The server picks one at set-up (``Simulation._build_executor``).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from ..errors import RunError
from .client import client_error, train_client

log = logging.getLogger("fedkernels.sim")

__all__ = ["ClientExecutor", "SequentialExecutor", "client_failed"]


class ClientExecutor(Protocol):
    """What the round loop asks of an executor (module docstring)."""

    def train_local(self, r: int, ids: Sequence[int], positions: Sequence[int], payload_of: Callable[[int], Any],
                    factor: float) -> Dict[str, Any]: ...

    def close(self) -> None: ...


def client_failed(policy: str, r: int, pos: int, cid: int, reason: str, bad_client: bool, exc: BaseException,
                  excluded: List[Any]) -> Optional[Tuple[int, str, BaseException]]:
    """The bad-client policy (``"exclude"`` | ``"raise"``) for client ``cid`` (position ``pos``) whose
    training failed with ``reason`` (:func:`~fedkernels.sim.client.client_error`): None when it is
    excluded (logged, ``(pos, record)`` appended to ``excluded``), else the round's ``error`` entry
    ``(pos, message, exception)``: the client's exception under "raise", a RunError for a failure
    that is not a bad client (under either policy)."""
    if not bad_client:
        msg = (f"round {r + 1}, client {cid}: {reason} (a failure of the run, not a bad client update; "
               "the run stops)")
        err = RunError(msg)
        err.__cause__ = exc
        return pos, msg, err
    if policy == "raise":
        return pos, f"round {r + 1}, client {cid}: {reason}", exc
    log.warning("round %d: excluded client %d: %s", r + 1, cid, reason)
    excluded.append((pos, {"client_id": int(cid), "reason": reason}))
    return None


class SequentialExecutor:
    """One client after another in this process (``client.train_client``), with a progress bar."""

    def __init__(self, sim) -> None:
        self.sim = sim

    def train_local(self, r: int, ids: Sequence[int], positions: Sequence[int], payload_of: Callable[[int], Any],
                    factor: float) -> Dict[str, Any]:
        from tqdm.auto import tqdm
        sim = self.sim
        sim._sync()
        t0 = time.perf_counter()
        accepted: List[Dict[str, Any]] = []
        excluded: List[Any] = []
        error = None
        for pos in tqdm(positions, desc=sim._clients_desc(r), leave=False,
                        disable=not sim._progress_enabled(), dynamic_ncols=True):
            cid = ids[pos]
            base_lr, epochs = sim.hetero.get(cid, r)
            try:
                res = train_client(sim, sim.buf, cid, r, base_lr, factor, epochs, payload_of(pos))
            except Exception as e:  # noqa: BLE001 - the policy decides
                error = client_failed(sim.cfg.bad_client_policy, r, pos, cid, *client_error(e), e, excluded)
                if error is not None:
                    break
                continue
            accepted.append({"pos": pos, "cid": int(cid), "n": float(res.num_examples), "payload": res.payload,
                             "loss": res.train_loss, "steps": res.steps})
        sim._sync()
        return {"accepted": accepted, "excluded": excluded, "error": error, "t_local": time.perf_counter() - t0}

    def close(self) -> None:
        pass
