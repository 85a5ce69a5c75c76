"""Client executors: who trains a round's clients (phase 2 of the round loop in ``sim/simulation.py``).

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
payload, loss, steps``, its update written into the next row of the run's buffer (``local.buf``,
``runstate.LocalTraining``) in that order (so ``local.buf.matrix()`` is the round's U). A client that fails goes through :func:`client_failed`
(the bad-client policy): excluded (``excluded``), or the round's ``error``.

Bad clients (``bad_client_policy="exclude"``, the default): a client whose update contains NaN/Inf,
or whose training raises a bad-client error (``client_errors.CLIENT_ERRORS``: a ValueError of its own input,
e.g. no training examples or an invalid learning rate; an ArithmeticError such as a rule's
FloatingPointError; ``BadUpdateError``), is left out of the round and logged (``excluded`` in
metrics.jsonl, in schedule order); the aggregator is built with ``on_bad_update="exclude"`` too: its
first read of U screens the rows (NaN/Inf updates are found there, not by a second pass of the
simulator) and unusable payloads are dropped the same way. With ``"raise"`` each update is screened
as it is written and the first bad client in schedule order stops the run. Any other error of a
client's training (a RuntimeError from torch: out of memory, autograd in a forked process; an
OSError, an ImportError, a bug) is not the client's update: it stops the run (``RunError``, one
line; exit 1 on the CLI) under either policy, in every mode. A round in which every client was
excluded stops the run the same way: nothing was trained.

Implementations: :class:`SequentialExecutor` (here: one client after another in this process),
``batched.BatchedExecutor`` (``clients_at_once``: a chunk of clients as one vmapped computation),
``workers.WorkerExecutor`` (``workers=N``: a pool of forked worker processes). The server picks one
at set-up (``Simulation._build_executor``).

Around the executor, the run's *processes* (:class:`OneProcess` here; torch.distributed ranks:
``distributed_sim.Ranks``) say which positions this process trains, prepare the payloads, exchange
the trained rows into the round's U (phase 3), and own what spans processes: the aggregator's form
(column shards), its state at a checkpoint, the stop agreement, the final barrier::

    procs.attach(agg, local, rounds_done)    # at set-up: the aggregator it returned, the run's
                                             # runstate.LocalTraining, a callable giving the rounds done
    procs.aggregator(agg) -> agg             # the aggregator this process runs (wrapped or not)
    procs.buffer_rows(K), procs.positions(K), procs.payloads(ids, positions) -> payload_of
    procs.exchange(local) -> {"U", "accepted", "payloads", "excluded", "t_local", "t_exchange"}
    procs.stop_agreed(signal) -> bool, procs.collective(when) (a context), procs.barrier(),
    procs.guard_signals(install) -> restore
    procs.aggregator_state(), procs.load_aggregator_state(state), procs.find_checkpoint(dir, device)
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from ..errors import RunError
from . import checkpoint as ckpt
from .client_errors import BadClientError, client_error
from .trainer import train_client
from .runstate import LocalTraining

log = logging.getLogger("fedkernels.sim")

__all__ = ["ClientExecutor", "OneProcess", "SequentialExecutor", "client_failed", "nothing_trained"]


class ClientExecutor(Protocol):
    """What the round loop asks of an executor (module docstring)."""

    def train_local(
        self, r: int, ids: Sequence[int], positions: Sequence[int], payload_of: Callable[[int], Any], factor: float
    ) -> Dict[str, Any]: ...

    def close(self) -> None: ...


def client_failed(
    policy: str, r: int, pos: int, cid: int, reason: str, bad_client: bool, exc: BaseException, excluded: List[Any]
) -> Optional[Tuple[int, str, BaseException]]:
    """The bad-client policy (``"exclude"`` | ``"raise"``) for client ``cid`` (position ``pos``) whose
    training failed with ``reason`` (:func:`~fedkernels.sim.client_errors.client_error`): None when it is
    excluded (logged, ``(pos, record)`` appended to ``excluded``), else the round's ``error`` entry
    ``(pos, message, exception)``: the client's exception under "raise", a RunError for a failure
    that is not a bad client (under either policy)."""
    if not bad_client:
        msg = f"round {r + 1}, client {cid}: {reason} (a failure of the run, not a bad client update; the run stops)"
        err = RunError(msg)
        err.__cause__ = exc
        return pos, msg, err
    if policy == "raise":
        return pos, f"round {r + 1}, client {cid}: {reason}", exc
    log.warning("round %d: excluded client %d: %s", r + 1, cid, reason)
    excluded.append((pos, {"client_id": int(cid), "reason": reason}))
    return None


def nothing_trained(r: int, ids: Sequence[int], excluded: List[Dict[str, Any]]) -> RunError:
    """The error of a round in which every client was excluded (one line: how many, why)."""
    why: Dict[str, int] = {}
    for e in excluded:
        why[str(e.get("reason"))] = why.get(str(e.get("reason")), 0) + 1
    top = "; ".join(f"{k} ({v} client{'s' if v > 1 else ''})" for k, v in list(why.items())[:2])
    more = f"; {len(why) - 2} other reason(s)" if len(why) > 2 else ""
    return RunError(
        f"round {r + 1}: every client was excluded ({len(excluded)} of {len(ids)}: {top}{more}); "
        "nothing was trained, the run stops"
    )


class SequentialExecutor:
    """One client after another in this process (``trainer.train_client``), with a progress bar."""

    def __init__(self, local: LocalTraining) -> None:
        self.local = local

    def train_local(
        self, r: int, ids: Sequence[int], positions: Sequence[int], payload_of: Callable[[int], Any], factor: float
    ) -> Dict[str, Any]:
        from tqdm.auto import tqdm

        local = self.local
        local.sync()
        t0 = time.perf_counter()
        accepted: List[Dict[str, Any]] = []
        excluded: List[Any] = []
        error = None
        for pos in tqdm(
            positions,
            desc=f"round {r + 1} clients{local.tag}",
            leave=False,
            disable=not local.progress,
            dynamic_ncols=True,
        ):
            cid = ids[pos]
            base_lr, epochs = local.hetero.get(cid, r)
            try:
                res = train_client(local, local.buf, cid, r, base_lr, factor, epochs, payload_of(pos))
            except Exception as e:  # noqa: BLE001 - the policy decides
                error = client_failed(local.cfg.bad_client_policy, r, pos, cid, *client_error(e), e, excluded)
                if error is not None:
                    break
                continue
            accepted.append(
                {
                    "pos": pos,
                    "cid": int(cid),
                    "n": float(res.num_examples),
                    "payload": res.payload,
                    "loss": res.train_loss,
                    "steps": res.steps,
                }
            )
        local.sync()
        return {"accepted": accepted, "excluded": excluded, "error": error, "t_local": time.perf_counter() - t0}

    def close(self) -> None:
        pass


class OneProcess:
    """The run's processes when there is one (module docstring): this process trains every position
    of the round into its rows of ``local.buf`` in schedule order, so the exchange moves nothing."""

    rank, world, is_main, tag = 0, 1, True, ""
    saves_alone = True  # a checkpoint needs no other process (a signal may reach one rank only)
    screen_at_write = False  # True: each trained row is screened as it is written, whatever the policy
    aggregate_kwargs: Dict[str, Any] = {}
    state_extra: Dict[str, Any] = {}  # added to a checkpoint's state

    def attach(self, agg, local: LocalTraining, rounds_done: Callable[[], int]) -> None:
        self.agg, self.buf = agg, local.buf

    def aggregator(self, agg):
        return agg

    def buffer_rows(self, K: int) -> int:
        return K

    def positions(self, K: int) -> range:
        return range(K)

    def payloads(self, ids: Sequence[int], mine: range) -> Callable[[int], Any]:
        """Phase 1: ``pos -> payload`` (computed on demand, so no K payloads are held at once)."""
        return lambda pos: self.agg.client_payload(ids[pos])

    def exchange(self, local: Dict[str, Any]) -> Dict[str, Any]:
        """Phase 3: every trained client of the round, in schedule order, as the aggregator takes them.
        Raises the round's error (BadClientError under "raise", or a RunError)."""
        if local["error"] is not None:
            _, msg, exc = local["error"]
            if isinstance(exc, RunError):
                raise exc
            raise BadClientError(msg) from exc
        acc = local["accepted"]
        return {
            "U": self.buf.matrix(),
            "accepted": acc,
            "payloads": [a["payload"] for a in acc],
            "excluded": [e for _, e in local["excluded"]],
            "t_local": local["t_local"],
            "t_exchange": 0.0,
        }

    def stop_agreed(self, signal: Optional[int]) -> bool:
        return signal is not None

    def collective(self, when: str):
        """The context of collectives (none here; ranks turn a lost peer into one line naming it)."""
        return contextlib.nullcontext()

    def guard_signals(self, install: Callable[[], Callable[[], None]]) -> Callable[[], None]:
        """Installs the run's signal handlers (``install``); returns the function that restores them."""
        return install()

    def barrier(self) -> None:
        pass

    def aggregator_state(self) -> Optional[Dict[str, Any]]:
        return self.agg.state_dict()

    def load_aggregator_state(self, state: Dict[str, Any]) -> None:
        self.agg.load_state_dict(state)

    def find_checkpoint(self, ckpt_dir: str, device):
        """(path, state) of the newest usable checkpoint, or None."""
        return ckpt.load_latest(ckpt_dir, map_location=device)
