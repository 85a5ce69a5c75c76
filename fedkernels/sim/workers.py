"""Parallel clients on one machine: ``workers=N`` trains a round's clients in N worker processes.

    fedkernels run --preset demo workers=2          # or cfg.workers = 2; Simulation(cfg).run()

The pool runs the local-training phase (``Simulation.train_local``) and the evaluation's forward
passes (``Simulation.evaluate_round``: test accuracy and loss, the clients' losses); payloads, the
exchange and the aggregation stay in the main process, unchanged.

* *Start.* The pool is started once per run, at the first round, by the ``forkserver`` start
  method, never by a plain ``fork`` of the main process: a process forked after autograd has run
  (with a CUDA build of torch and a visible GPU, the first ``backward`` starts autograd's device
  threads and registers a ``pthread_atfork`` handler) fails its first ``backward`` with "Unable to
  handle autograd's threading in combination with fork-based multiprocessing", and the main process
  has usually run autograd before (an earlier run, a notebook, a test). The fork server is a fresh
  interpreter that imports this module and never runs autograd, so the workers it forks are safe on
  every machine; it is started once per main process (later runs reuse it). A worker receives the
  run's local training (``runstate.LocalTraining``) pickled once (:func:`_worker_state`: the model, FlatSpec, the aggregator's
  configuration without its declared state, client partition, transform), except the large tensors, which stay in shared
  memory: the data set (train and test), the global model vector and the server's ``UpdateBuffer``.
  A worker reads the broadcast global model from the one shared vector and writes its clients'
  updates straight into their rows of the K x d buffer; no d-sized update is pickled. Its model
  trains in a private vector (the model's parameters are views of it, as in one process). Payload
  tensors (SCAFFOLD's ``c``/``c_i``, its ``delta_c``) travel as shared-memory handles
  (``torch.multiprocessing``'s reductions). Each worker says it is ready before the first task, so
  one that cannot start stops the run at once. Consequences: what the workers receive must be
  picklable (a ``model_fn`` model, a ``transform``: module-level classes and functions, not
  lambdas; otherwise ``ValueError`` before any worker starts), and a script that sets
  ``workers > 1`` needs the usual ``if __name__ == "__main__":`` guard (a worker imports the
  script's main module, as with the ``spawn`` start method).
* *A round.* The main process puts one task per client (position, id, lr, epochs, payload) on a
  shared queue, largest client first; idle workers take the next one (dynamic balance). A worker
  trains with the same code as one process (``trainer.train_client``: same hooks, same
  finite-update check) and writes row ``pos`` of the buffer; the main process then packs the rows of
  the accepted clients in schedule order (a copy only when a client was excluded), so the aggregator
  sees exactly the matrix of one process.
* *Evaluation.* The forward passes are split by evaluation batch: one task per batch of
  ``eval_batch_size`` rows (the batches of :func:`fedkernels.sim.evaluate.evaluate` and
  :func:`~fedkernels.sim.evaluate.client_losses`, the same boundaries), from the same queue. A test
  batch returns its number of correct predictions and its float64 summed loss, a client-loss batch
  its float64 per-sample losses; the main process adds them up in batch order exactly as the
  one-process functions do, so accuracy, test loss and client losses are the same bit for bit. With
  fewer batches than workers some workers wait (a batch is never split: another batch shape could
  round differently).
* *Same results.* Every client's randomness comes from ``client_seed(seed, round, client_id)`` and
  it starts from the same global vector, so which process trains it does not matter: ``workers=N``
  gives ``workers=1`` bit for bit at the same per-process thread count (``threads``; CPU kernels
  may round differently at another thread count). Threads per worker: ``threads`` if set, else
  ``cores // N`` (at least 1), so the workers together use the machine's cores.
* *Errors.* A client that raises a bad-client error in a worker is reported back and the
  bad-client policy applies as in one process (``executors.client_failed``: ``exclude``: logged and
  left out; ``raise``: the first failing client in schedule order stops the run). Everything else is
  a failure of the run, never a bad client, under either policy: a worker that cannot start, dies,
  cannot send its result, or fails a client with an error that is not a bad-client error
  (``client_errors.CLIENT_ERRORS``; e.g. a RuntimeError from autograd, an ImportError, a broken pipe) stops
  the run with one line naming the worker and the cause (``RunError``; exit 1 on the CLI). Workers
  ignore SIGINT (the main process finishes the round, as in one process), die with the fork server,
  which ends with the main process (``PR_SET_PDEATHSIG``), and are stopped and joined when the run
  ends, however it ends.

CPU only: with ``device=cuda`` ``workers > 1`` is refused (one process already keeps a GPU busy on
these models).
"""

from __future__ import annotations

import copy
import dataclasses
import io
import logging
import os
import pickle
import signal
import time
from multiprocessing.connection import wait as mp_wait
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from ..errors import RunError
from .client_errors import client_error
from .evaluate import sample_owners
from .trainer import train_client
from .executors import client_failed
from .runstate import ClientRules, LocalTraining

log = logging.getLogger("fedkernels.sim")

__all__ = ["WorkerExecutor", "WorkerPool", "default_threads", "prestart", "usable_cores"]


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity; ``os.cpu_count()`` where that is unknown)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def default_threads(workers: int, threads: Optional[int] = None) -> int:
    """Intra-op threads per worker: ``threads`` when given, else ``cores // workers`` (at least 1)."""
    if threads:
        return int(threads)
    return max(1, usable_cores() // max(1, int(workers)))


class _RowAt:
    """The part of ``UpdateBuffer`` that ``trainer.train_client`` uses, writing row ``pos`` of the
    shared buffer (the slot is the client's position in the round, not the next free row)."""

    def __init__(self, buf, pos: int):
        self.buf, self.pos = buf, pos
        self.client_ids: List[int] = []
        self.num_examples: List[float] = []

    def add(self, client_id: int, num_examples: float = 1.0) -> int:
        self.client_ids.append(int(client_id))
        self.num_examples.append(float(num_examples))
        return self.pos

    def write_delta(self, slot: int, model, global_flat, clip=None):
        return self.buf.write_delta(slot, model, global_flat, clip)


def _die_with_parent() -> None:
    """This worker ends with the main process, however that ends (SIGKILL included). Its parent is
    the fork server (PR_SET_PDEATHSIG: the kernel kills us when that exits), which lives as long as a
    process it forked does; so a thread also waits on the main process's sentinel (a pipe that
    closes when it exits) and kills this process then."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the parent still stops the workers on every exit path
        pass
    import multiprocessing
    import threading

    main = multiprocessing.parent_process()
    if main is None:
        return

    def watch() -> None:
        mp_wait([main.sentinel])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="fedkernels-watch-main", daemon=True).start()


# imported once by the fork server, so that its workers start with them: the simulator, and
# torch._dynamo, which the first torch.optim optimizer of a process imports (seconds of CPU)
_PRELOAD = ["__main__", __name__, "fedkernels.sim.simulation", "torch._dynamo"]

# ---- what a worker receives --------------------------------------------------------------------------
# the run's runstate.LocalTraining (what trainer.train_client and _eval_batch read); everything else
# (callbacks, metrics, the executor and its pool) stays in the main process


def _storage_key(t: torch.Tensor) -> Optional[int]:
    s = t.untyped_storage()
    return s.data_ptr() if s.nbytes() else None


def _shared(t: torch.Tensor, in_place: bool) -> "torch.UntypedStorage":
    """``t``'s storage in shared memory: moved there (``in_place``: the main process keeps using it,
    the workers write or read it live), or else, where it cannot move (e.g. memory from numpy), a
    shared copy (read-only data)."""
    s = t.untyped_storage()
    if s.is_shared():
        return s
    try:
        s.share_memory_()
        return s
    except RuntimeError:
        if in_place:
            raise
    c = torch.UntypedStorage(s.nbytes()).share_memory_()
    c.copy_(s)
    return c


class _StatePickler(pickle.Pickler):
    """Pickles a tensor that lives in one of ``keys``' storages as a reference to it (a persistent
    id: name and view geometry), every other object by value."""

    def __init__(self, f, keys: Dict[int, str]):
        super().__init__(f, protocol=pickle.HIGHEST_PROTOCOL)
        self.keys = keys

    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor) and type(obj) in (torch.Tensor, nn.Parameter):
            name = self.keys.get(_storage_key(obj))
            if name is not None:
                return (
                    name,
                    obj.dtype,
                    obj.storage_offset(),
                    tuple(obj.shape),
                    obj.stride(),
                    isinstance(obj, nn.Parameter),
                    obj.requires_grad,
                )
        return None


class _StateUnpickler(pickle.Unpickler):
    def __init__(self, f, storages: Dict[str, Any]):
        super().__init__(f)
        self.storages = storages

    def persistent_load(self, pid):
        name, dtype, offset, size, stride, param, requires_grad = pid
        t = torch.empty(0, dtype=dtype).set_(self.storages[name], offset, size, stride)
        if param:
            return nn.Parameter(t, requires_grad=requires_grad)
        return t.requires_grad_() if requires_grad else t


def _worker_state(local: LocalTraining):
    """``(storages, blob)``: the shared-memory storages (data set, global model, update buffer) and
    the pickled rest of what a worker needs (``local``, a ``runstate.LocalTraining``), whose tensors
    in those storages, and in the model's flat vector ``trainer.work`` (private in each worker), are
    references. ValueError when something cannot be pickled."""
    keys: Dict[int, str] = {}
    storages: Dict[str, Any] = {}
    for name, t, in_place in (
        ("global", local.global_flat, True),
        ("buf", local.buf.data, True),
        ("x", local.x, False),
        ("y", local.y, False),
        ("xt", local.xt, False),
        ("yt", local.yt, False),
    ):
        k = _storage_key(t)
        if k is None or k in keys:  # empty, or the same storage as an earlier name
            continue
        storages[name] = _shared(t, in_place)
        keys[_storage_key(t)] = name  # (moved in place: the key after the move)
    keys[_storage_key(local.trainer.work)] = "work"
    # the aggregator's configuration, which its client rule reads; not its declared state (state_attrs:
    # per-client tables, momentum, ...: the server's, K x d for SCAFFOLD), which a rule gets as payloads
    agg = local.rules.agg
    lite_agg = copy.copy(agg)
    for k in getattr(agg, "state_attrs", ()):
        if k in lite_agg.__dict__:
            lite_agg.__dict__[k] = None
    lite = dataclasses.replace(local, rules=ClientRules(lite_agg, local.rules.kept), progress=False)
    f = io.BytesIO()
    try:
        _StatePickler(f, keys).dump(lite)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise ValueError(
            f"workers={local.cfg.workers}: the set-up simulation cannot be sent to the worker "
            f"processes ({type(e).__name__}: {e}); with workers > 1 the model, transform and "
            "aggregator must be picklable (module-level classes and functions, no lambdas), "
            "or use workers=1"
        ) from None
    return storages, f.getvalue()


def _load_state(blob: bytes, storages: Dict[str, Any], work_nbytes: int) -> LocalTraining:
    """The worker's ``LocalTraining`` from :func:`_worker_state`'s output; its model's own flat vector."""
    storages = dict(storages, work=torch.UntypedStorage(work_nbytes))
    return _StateUnpickler(io.BytesIO(blob), storages).load()


def _send(conn, msg) -> None:
    try:
        conn.send(msg)
    except (OSError, ValueError, pickle.PicklingError):
        pass


def _eval_batch(local: LocalTraining, job: Dict[str, Any], s: int, e: int, cache: Dict[str, Any]):
    """One evaluation batch of the global model (rows ``s:e``): ``(correct, float64 loss sum)`` of the
    test set, or the float64 per-sample losses of the listed clients' training data (as numpy).
    ``evaluate.eval_batch`` / ``evaluate.batch_losses``, the per-batch steps of ``evaluate.evaluate`` and
    ``evaluate.client_losses``."""
    from .evaluate import batch_losses, eval_batch

    model = local.model
    local.trainer.work.copy_(local.global_flat)  # the model's tensors are views of work
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            if job["what"] == "test":
                correct, loss = eval_batch(model, local.xt[s:e], local.yt[s:e])
                return int(correct), float(loss)
            if cache.get("job") != job["id"]:  # the clients' rows, once per evaluation
                cache["job"] = job["id"]
                cache["idx"] = torch.cat([local.parts[c] for c in job["clients"]])
            b = cache["idx"][s:e]
            return batch_losses(model, local.x[b], local.y[b]).cpu().numpy()
    finally:
        model.train(was)


def _worker_main(
    index: int,
    threads: int,
    flags: Dict[str, Any],
    storages: Dict[str, Any],
    work_nbytes: int,
    blob: bytes,
    tasks,
    conn,
) -> None:
    """One worker: rebuilds the run's local training (:func:`_load_state`), says ("ready", index), then takes
    ("train", round, factor, pos, cid, base_lr, epochs, payload) and ("eval", job, batch, start, stop)
    tasks until None. A failure outside a task's own work is sent as ("fatal", index, message)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process decides when to stop
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with_parent()
    try:
        torch.set_num_threads(int(threads))
        torch.set_default_dtype(flags["default_dtype"])
        torch.set_float32_matmul_precision(flags["matmul_precision"])
        if flags["deterministic"]:  # (only then: the call imports torch._inductor, 1.4 s of CPU)
            torch.use_deterministic_algorithms(True, warn_only=flags["warn_only"])
        t_loaded = time.time() - flags["t_launch"]
        local = _load_state(blob, storages, work_nbytes)
        del blob
    except Exception as e:  # noqa: BLE001 - the main process stops the run with it
        _send(conn, ("fatal", index, f"could not start: {type(e).__name__}: {e}"))
        conn.close()
        return
    cache: Dict[str, Any] = {}
    try:
        conn.send(("ready", index, (time.time() - flags["t_launch"], t_loaded)))
        while True:
            task = tasks.get()
            if task is None:
                break
            if task[0] == "eval":
                _, job, k, s, e = task
                try:
                    msg = ("eval", k, _eval_batch(local, job, s, e, cache))
                except Exception as ex:  # noqa: BLE001 - the main process raises it
                    msg = ("eval_err", k, f"{type(ex).__name__}: {ex} (in worker {index}, pid {os.getpid()})")
                conn.send(msg)
                continue
            _, r, factor, pos, cid, base_lr, epochs, payload = task
            try:
                if isinstance(payload, BaseException):
                    raise payload
                res = train_client(local, _RowAt(local.buf, pos), cid, r, base_lr, factor, epochs, payload)
                msg = (
                    "ok",
                    pos,
                    {
                        "pos": pos,
                        "cid": int(cid),
                        "n": float(res.num_examples),
                        "payload": res.payload,
                        "loss": res.train_loss,
                        "steps": res.steps,
                    },
                )
            except Exception as e:  # noqa: BLE001 - reported to the main process, which applies the policy
                reason, bad = client_error(e)
                if not bad:
                    reason += f" (in worker {index}, pid {os.getpid()})"
                try:
                    pickle.dumps(e)
                    exc: BaseException = e
                except Exception:  # noqa: BLE001
                    exc = RuntimeError(reason)
                msg = ("err", pos, (int(cid), reason, bad, exc))
            conn.send(msg)
    except (KeyboardInterrupt, EOFError, BrokenPipeError):
        pass
    except Exception as e:  # noqa: BLE001 - e.g. a result that cannot be pickled: the run stops
        _send(conn, ("fatal", index, f"failed: {type(e).__name__}: {e}"))
    finally:
        try:
            conn.close()
        except OSError:
            pass


def prestart() -> None:
    """Starts the fork server now, without waiting for it: its imports (torch, the simulator,
    torch._dynamo: seconds) overlap the main process's set-up. Idempotent; ``WorkerPool.start``
    calls it too."""
    from multiprocessing import forkserver

    forkserver.set_forkserver_preload(_PRELOAD)  # (read when the fork server starts: once per main process)
    forkserver.ensure_running()


class WorkerPool:
    """N forked worker processes training the clients of a set-up run (``local``: its
    ``runstate.LocalTraining``; module docstring). ``start()`` once after the run's set-up;
    ``train_local(...)`` per round; ``close()`` always."""

    def __init__(self, local: LocalTraining, workers: int, threads: Optional[int] = None):
        if int(workers) < 2:
            raise ValueError(
                f"WorkerPool: workers must be >= 2, got {workers!r} (workers=1 trains in the main process)"
            )
        if local.device.type != "cpu":
            raise ValueError(
                f"workers={workers}: parallel worker processes run on the CPU only, got device "
                f"{local.device} (use workers=1 on a GPU)"
            )
        self.local, self.n = local, int(workers)
        self.threads = default_threads(self.n, threads)
        self.procs: List[Any] = []
        self.conns: List[Any] = []
        self.tasks = None
        self.t_start = 0.0
        self.t_ready: List[Any] = []  # per worker: (seconds to ready, seconds before its state loaded)
        self._jobs = 0

    def start(self) -> "WorkerPool":
        """Starts the N workers from the fork server (module docstring) and waits until each has
        rebuilt the run's local training; RunError naming the worker when one cannot start."""
        import torch.multiprocessing as tmp

        t0 = time.perf_counter()
        local = self.local
        storages, blob = _worker_state(local)
        prestart()
        ctx = tmp.get_context("forkserver")
        flags = {
            "default_dtype": torch.get_default_dtype(),
            "matmul_precision": torch.get_float32_matmul_precision(),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "t_launch": time.time(),
        }
        work_nbytes = local.trainer.work.untyped_storage().nbytes()
        self.tasks = ctx.SimpleQueue()
        try:
            for i in range(self.n):
                recv, send = ctx.Pipe(duplex=False)
                p = ctx.Process(
                    target=_worker_main,
                    args=(i, self.threads, flags, storages, work_nbytes, blob, self.tasks, send),
                    name=f"fedkernels-worker-{i}",
                    daemon=True,
                )
                p.start()
                send.close()
                self.procs.append(p)
                self.conns.append(recv)
            ready = self._collect(self.n, "while starting")  # every worker: ("ready", index)
        except BaseException:
            self.close()
            raise
        self.t_start = time.perf_counter() - t0
        self.t_ready = [v for _, v in ready.values()]
        return self

    @property
    def pids(self) -> List[int]:
        return [p.pid for p in self.procs]

    # ---- one round --------------------------------------------------------------------------------
    def train_local(
        self, r: int, ids: Sequence[int], mine: range, payload_of: Callable[[int], Any], factor: float
    ) -> Dict[str, Any]:
        """``Simulation.train_local`` run by the workers: the same return value."""
        local = self.local
        t0 = time.perf_counter()
        order = []
        for pos in mine:
            cid = ids[pos]
            base_lr, epochs = local.hetero.get(cid, r)
            steps = local.trainer.planned_steps(max(1, local.trainer.num_examples(cid)), epochs)
            order.append((-steps, pos, cid, base_lr, epochs))
        order.sort()  # longest client first (the order does not change any result)
        for _, pos, cid, base_lr, epochs in order:
            try:
                payload = payload_of(pos)
            except Exception as e:  # noqa: BLE001 - counts as the client's failure, as in one process
                payload = e
            self.tasks.put(("train", r, factor, pos, cid, base_lr, epochs, payload))
        results = self._collect(len(order), f"during round {r + 1}")
        # schedule order; the accepted clients' rows packed at the front of the buffer
        buf = local.buf
        accepted: List[Dict[str, Any]] = []
        excluded: List[Any] = []
        error = None
        for pos in mine:
            kind, val = results[pos]
            if kind == "err":  # the policy of one process (a bad client, or a run error)
                error = client_failed(local.cfg.bad_client_policy, r, pos, *val, excluded)
                if error is not None:
                    break
                continue
            slot = buf.add(val["cid"], val["n"])
            if slot != pos:
                buf.data[slot].copy_(buf.data[pos])
            accepted.append(val)
        return {"accepted": accepted, "excluded": excluded, "error": error, "t_local": time.perf_counter() - t0}

    def _collect(self, pending: int, when: str) -> Dict[int, Any]:
        """``pending`` replies ``(kind, key, value)``, as {key: (kind, value)}; a worker that dies or
        reports a failure of its own ("fatal") stops the run (RunError naming it and ``when``)."""
        results: Dict[int, Any] = {}
        live = {c: i for i, c in enumerate(self.conns)}
        sentinels = {p.sentinel: i for i, p in enumerate(self.procs)}

        def take(conn) -> int:  # the replies waiting in conn: how many
            got = 0
            try:
                while conn in live and conn.poll():
                    kind, key, val = conn.recv()
                    if kind == "fatal":
                        raise RunError(
                            f"workers={self.n}: worker {key} (pid {self.procs[key].pid}) {val} {when}; the run stops"
                        )
                    results[key] = (kind, val)
                    got += 1
            except EOFError:
                live.pop(conn)
            return got

        while pending:
            ready = mp_wait(list(live) + list(sentinels))
            for obj in sorted(ready, key=lambda o: o not in live):  # replies before deaths
                if obj in live:
                    pending -= take(obj)
                elif obj in sentinels:
                    i = sentinels[obj]
                    pending -= take(self.conns[i])  # its last words (a "fatal" line)
                    p = self.procs[i]
                    p.join(0.1)
                    hint = (
                        ' (its error is above; a script that sets workers > 1 needs `if __name__ == "__main__":`)'
                        if when == "while starting"
                        else ""
                    )
                    raise RunError(
                        f"workers={self.n}: worker {i} (pid {p.pid}) exited with code {p.exitcode} "
                        f"{when}{hint}; the run stops"
                    )
        return results

    def _run_batches(self, r: int, jobs: Sequence[Any], batch_size: int) -> List[List[Any]]:
        """The batches ``[s, s + batch_size)`` of every ``(job, rows)`` in the workers, all on the queue
        at once (one wait); per job, its batches' results in batch order."""
        keys = []
        for j, (job, n) in enumerate(jobs):
            for s in range(0, n, batch_size):
                keys.append((j, s))
                self.tasks.put(("eval", job, len(keys) - 1, s, min(s + batch_size, n)))
        results = self._collect(len(keys), f"during round {r + 1}")
        out: List[List[Any]] = [[] for _ in jobs]
        for k, (j, _) in enumerate(keys):
            kind, val = results[k]
            if kind != "eval":
                raise RunError(f"workers={self.n}: evaluation of round {r + 1} failed in a worker: {val}")
            out[j].append(val)
        return out

    def evaluate(self, r: int, batch_size: int, clients: Optional[Sequence[int]] = None):
        """``Simulation.evaluate_round``'s forward passes in the workers: ``(accuracy, test loss,
        client losses or None)``, equal bit for bit to ``evaluate.evaluate`` and ``evaluate.client_losses``
        (``clients``: whose training-data loss, None for none) at the same threads per process."""
        local = self.local
        bs = int(batch_size)
        self._jobs += 1
        n = int(local.yt.numel())
        who = None if clients is None else [int(c) for c in clients]
        jobs: List[Any] = []
        owner = None
        if who:
            parts = local.parts
            owner = sample_owners(parts, who)[0]
            jobs.append(({"id": self._jobs, "what": "clients", "clients": who}, int(owner.numel())))
        jobs.append(({"id": self._jobs, "what": "test"}, n))
        *per, test = self._run_batches(r, jobs, bs)
        loss = torch.zeros((), dtype=torch.float64)
        correct = 0
        for c, l in test:  # in batch order, as evaluate.evaluate accumulates
            correct += c
            loss += l
        acc, tl = (correct / n, float(loss) / n) if n else (float("nan"), float("nan"))
        if who is None:
            return acc, tl, None
        if not who:
            return acc, tl, []
        sums = torch.zeros(len(who), dtype=torch.float64)
        for k, l in enumerate(per[0]):  # as evaluate.client_losses: index_add_ batch by batch
            sums.index_add_(0, owner[k * bs : (k + 1) * bs], torch.from_numpy(l))
        counts = torch.tensor([max(local.parts[c].numel(), 1) for c in who], dtype=torch.float64)
        return acc, tl, (sums / counts).tolist()

    # ---- shutdown ---------------------------------------------------------------------------------
    def close(self, timeout: float = 5.0) -> None:
        """Stops every worker: a stop task each, then join; terminate / kill what is left. Idempotent."""
        procs, self.procs = self.procs, []
        if not procs:
            return
        try:
            for p in procs:
                if p.is_alive():
                    self.tasks.put(None)
        except (OSError, ValueError):
            pass
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(1.0)
            if p.is_alive():
                p.kill()
                p.join(1.0)
        for c in self.conns:
            try:
                c.close()
            except OSError:
                pass
        self.conns = []

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class WorkerExecutor:
    """The executor of ``workers=N`` (``sim/executors.py``): the run's :class:`WorkerPool`, started at
    the first round (``pool``: None until then and once closed); local training and the evaluation's
    forward passes in the workers."""

    def __init__(self, local: LocalTraining) -> None:
        self.local = local
        self.pool: Optional[WorkerPool] = None

    def _started(self) -> WorkerPool:
        if self.pool is None:
            cfg = self.local.cfg
            pool = WorkerPool(self.local, cfg.workers, cfg.threads).start()
            self.pool = pool
            log.info(
                "workers=%d: started (pids %s, %d thread(s) each) in %.3fs",
                pool.n,
                pool.pids,
                pool.threads,
                pool.t_start,
            )
        return self.pool

    def train_local(
        self, r: int, ids: Sequence[int], positions: Sequence[int], payload_of: Callable[[int], Any], factor: float
    ) -> Dict[str, Any]:
        return self._started().train_local(r, ids, positions, payload_of, factor)

    def evaluate(self, r: int, batch_size: int, clients: Optional[Sequence[int]] = None):
        return self._started().evaluate(r, batch_size, clients)

    def close(self) -> None:
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.close()
