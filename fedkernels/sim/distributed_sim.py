"""The simulator over ``torch.distributed``: ranks train disjoint parts of each round's clients and
aggregate column slices of all the updates.

    torchrun --nproc_per_node 2 -m fedkernels run --preset smoke distributed=true
    # or, from Python, inside an initialised process group (gloo on CPU, NCCL on GPUs):
    summary = DistributedSimulation(cfg).run()

Every rank runs the same config, so every rank holds the same data, partition, model and pre-drawn
client schedule (``sample_schedule``), and the same round loop (``Simulation``); what differs is its
processes object, :class:`Ranks` (phases 1 and 3, the sharded aggregator, checkpoint gather / slice,
the stop agreement, a lost peer). ``DistributedSimulation`` is ``Simulation`` with ``Ranks``.
Per round ``r`` with clients ``ids = schedule[r]``:

1. *Payloads.* Every rank calls ``client_payload(cid)`` for every client of the round, in schedule
   order (a collective for methods whose payloads hold d-sized server state, e.g. SCAFFOLD's
   ``c``/``c_i``: the slices are all-gathered into full vectors).
2. *Local training.* The round's positions ``0..K-1`` are split into ``world`` contiguous blocks of
   near-equal size (:func:`assign_positions`); rank ``q`` trains the clients of block ``q`` into
   its local ``UpdateBuffer`` exactly as the single-process loop does (same seeds, same hooks).
3. *Exchange.* The small per-client facts (position, id, sample count, scalar payload entries,
   train loss, steps, exclusions, errors) are all-gathered as objects. One ``all_to_all_single``
   then sends column block ``[a_s, b_s)`` (``distributed.shard_bounds``, aligned to the FlatSpec's
   tensor boundaries) of every local update row to rank ``s``; because blocks are contiguous in
   schedule order, rank ``s`` receives its ``[K, b_s - a_s]`` slice of *all* updates already in
   schedule order (no reordering copy). Payload tensors with d elements (SCAFFOLD's ``delta_c``)
   are sliced the same way, in a second exchange per dtype.
4. *Aggregation.* Every rank runs ``ShardedAggregator.aggregate`` on its slice (the d-reductions
   of Gram-based methods are all-reduced inside it) and the new global model is all-gathered, so
   every rank holds the full model for the next round.
5. *Evaluation and outputs* happen on rank 0 only (metrics.jsonl, summary, final model, plots).

Agreement with one process: the client schedule is identical, every client's update is computed by
the same code from the same global model and seed, and the rows reach the aggregator in the same
order, so FedAvg-like methods (per-coordinate arithmetic) give the single-process model bit for
bit; Gram-based methods sum per-rank fp64 partials, equal to fp32 rounding (see
``fedkernels.distributed``). Local training uses the rank's intra-op thread count: run both with
the same ``threads`` for bitwise-equal updates.

Checkpoints: every rank's aggregator state is a column slice; at a checkpoint the slices are
gathered and merged into the full state (tensors whose last dimension is the rank's slice width on
every rank are concatenated), so rank 0 writes one ordinary checkpoint, readable by a
single-process run and by a distributed run of any world size (``--resume`` re-slices it).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..distributed import ShardedAggregator
from . import checkpoint as ckpt
from .config import RunConfig
from .client_errors import BadClientError
from .assemble import resolve_device
from .runstate import LocalTraining
from .simulation import Simulation

log = logging.getLogger("fedkernels.sim")

__all__ = [
    "DistributedSimulation",
    "LostRankError",
    "Ranks",
    "assign_positions",
    "init_from_env",
    "merge_sliced_state",
    "slice_state",
]


class LostRankError(RuntimeError):
    """Another rank of the run stopped (killed, or failed with its own error) while this one waited
    for it in a collective (in a round, at a checkpoint, in the stop agreement or the final
    barrier); this rank stops too (its last checkpoint is the one to resume).

    From the moment a rank detects the loss it ignores SIGTERM: torchrun's agent sends SIGTERM to
    the surviving ranks as soon as it sees one fail, and that signal must not cut short the report
    (the one line naming the lost rank) and the exit that follow. The rank is about to exit anyway;
    the agent still SIGKILLs it after its shutdown timeout, so nothing can hang on it."""


def _is_peer_loss(e: BaseException) -> bool:
    """Whether a collective failed because a peer went away (gloo: connection closed/reset; NCCL:
    a DistError from the watchdog)."""
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    msg = str(e).lower()
    return isinstance(e, RuntimeError) and any(
        w in msg for w in ("connection closed", "connection reset", "broken pipe", "gloo", "nccl")
    )


def init_from_env(device: str = "cpu") -> bool:
    """Initialises the default process group from torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``) unless one is already initialised: gloo when the run is on the
    CPU, NCCL on CUDA (each rank then uses GPU ``LOCAL_RANK``). Returns True if it initialised one."""
    if dist.is_initialized():
        return False
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError(
            "distributed=true needs an initialised torch.distributed process group or torchrun's "
            "environment (launch with `python -m torch.distributed.run --nproc_per_node N "
            "-m fedkernels run ... distributed=true`)"
        )
    cuda = resolve_device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    atexit.register(_destroy_own_group)
    return True


def _destroy_own_group() -> None:
    """At exit: destroys the default group :func:`init_from_env` made, while the interpreter is still
    whole. A gloo group left to interpreter finalisation is torn down with its worker threads still
    holding work whose tensors need the GIL, which can abort the process (``terminate called without
    an active exception``, SIGABRT) after the run finished: a finished rank would then exit -6, and
    torchrun would report the whole run failed. Destroying the group is local (no collective), so it
    cannot hang on a rank that is gone."""
    if dist.is_initialized():
        dist.destroy_process_group()


def assign_positions(K: int, world: int) -> List[Tuple[int, int]]:
    """Contiguous ``[start, stop)`` blocks of the round's positions ``0..K-1``, one per rank, sizes
    differing by at most one (the first ``K % world`` ranks get one more)."""
    q, rem = divmod(int(K), int(world))
    out, s = [], 0
    for r in range(world):
        n = q + (1 if r < rem else 0)
        out.append((s, s + n))
        s += n
    return out


# ---- aggregator state: merge the ranks' slices / slice a full state --------------------------------
def merge_sliced_state(states: Sequence[Any], widths: Sequence[int]):
    """One full state from the per-rank states of a sliced aggregator: a tensor leaf whose last
    dimension is ``widths[r]`` on every rank r (with ``sum(widths)`` columns in all) is concatenated
    along it; any other leaf must be the same on every rank and is kept once."""
    first = states[0]
    if isinstance(first, dict):
        return {k: merge_sliced_state([s[k] for s in states], widths) for k in first}
    if isinstance(first, (list, tuple)) and not isinstance(first, str):
        vals = [merge_sliced_state([s[i] for s in states], widths) for i in range(len(first))]
        return type(first)(vals) if isinstance(first, tuple) else vals
    if isinstance(first, torch.Tensor):
        if all(
            isinstance(s, torch.Tensor) and s.dim() >= 1 and s.size(-1) == w and s.shape[:-1] == first.shape[:-1]
            for s, w in zip(states, widths)
        ):
            return torch.cat([s.cpu() for s in states], dim=-1)
        return first
    return first


def slice_state(state: Any, d: int, lo: int, hi: int):
    """The inverse of :func:`merge_sliced_state` for one rank: every tensor leaf whose last
    dimension is ``d`` keeps columns ``[lo, hi)``."""
    if isinstance(state, dict):
        return {k: slice_state(v, d, lo, hi) for k, v in state.items()}
    if isinstance(state, (list, tuple)) and not isinstance(state, str):
        vals = [slice_state(v, d, lo, hi) for v in state]
        return type(state)(vals) if isinstance(state, tuple) else vals
    if isinstance(state, torch.Tensor) and state.dim() >= 1 and state.size(-1) == d and hi - lo != d:
        return state[..., lo:hi].clone()
    return state


class Ranks:
    """The run's processes under torch.distributed (module docstring; the single-process form is
    ``executors.OneProcess``, whose protocol this follows): which positions this rank trains, the
    payload phase (a collective), the exchange, the sharded aggregator, the checkpoint's gather /
    slice, the stop agreement, and a lost peer turned into one line. ``group``: a process group (None:
    the default one, initialised from torchrun's environment when needed). ``align``: slice
    boundaries on tensor ("tensor") or output-row ("row") boundaries."""

    saves_alone = False  # gathering the state is a collective: a signal may reach one rank only
    screen_at_write = True  # each rank screens its own clients' rows (the exchange carries no NaN row)
    aggregate_kwargs = {"gather": True}  # every rank gets the full new model

    def __init__(self, device: str = "cpu", group=None, align: str = "bytes"):
        init_from_env(device)
        self.group, self.align = group, align
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.is_main = self.rank == 0
        self.tag = f" (rank {self.rank})"
        self.state_extra = {"world": self.world}
        self._peer_lost = False
        self.run_dir = ""  # named in the lost-peer line (DistributedSimulation sets it)

    def aggregator(self, agg) -> ShardedAggregator:
        return ShardedAggregator(agg, group=self.group, align=self.align)

    def attach(self, agg: ShardedAggregator, local: LocalTraining, rounds_done: Callable[[], int]) -> None:
        """The run's sharded aggregator, its local training (buffer, FlatSpec, device) and its count
        of rounds done (named in a lost peer's line)."""
        self.agg, self.local, self.rounds_done = agg, local, rounds_done
        stateful = agg.client_rule()
        if stateful is not None and hasattr(stateful, "state_dict") and hasattr(stateful, "load_state_dict"):
            raise ValueError(
                f"distributed=true: {local.cfg.algorithm.name}'s client rule keeps state across rounds; "
                "the distributed simulator does not move client-rule state between ranks"
            )

    def buffer_rows(self, K: int) -> int:
        return max(1, -(-K // self.world))  # this rank's clients: at most ceil(K / world)

    def positions(self, K: int) -> range:
        start, stop = assign_positions(K, self.world)[self.rank]
        return range(start, stop)

    # ---- a lost peer: report it even while torchrun terminates this rank ----------------------------
    def _ignore_sigterm(self) -> None:
        """Called when a peer is lost (see :class:`LostRankError`): SIGTERM is ignored from now on,
        and the run's signal handlers are not restored over it when ``run`` unwinds."""
        self._peer_lost = True
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

    @contextlib.contextmanager
    def collective(self, when: str) -> Iterator[None]:
        """A collective (or several) in which a lost peer becomes :class:`LostRankError`: one line
        saying which rank stopped ``when`` (e.g. "during round 3") and how to resume."""
        try:
            yield
        except (LostRankError, BadClientError):
            raise
        except Exception as e:  # noqa: BLE001 - only a peer's loss is translated
            if not _is_peer_loss(e):
                raise
            self._ignore_sigterm()
            who = f"rank {1 - self.rank}" if self.world == 2 else f"a rank other than {self.rank}"
            raise LostRankError(
                f"{who} of {self.world} stopped {when} (killed, or failed with its own error); "
                f"rank {self.rank} stops too; continue with `fedkernels run --resume "
                f"{self.run_dir}` on {self.world} ranks"
            ) from None

    def guard_signals(self, install: Callable[[], Callable[[], None]]) -> Callable[[], None]:
        """Installs the run's signal handlers; the restore leaves SIGTERM ignored once a peer is lost."""
        self._peer_lost = False
        outer = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        restore = install()

        def restore_unless_lost() -> None:
            if not self._peer_lost:
                restore()
            elif threading.current_thread() is threading.main_thread() and outer[signal.SIGINT] is not None:
                signal.signal(signal.SIGINT, outer[signal.SIGINT])  # SIGTERM stays ignored: on its way out

        return restore_unless_lost

    def stop_agreed(self, sig: Optional[int]) -> bool:
        """A signal seen by any rank stops every rank after this round (a small collective)."""
        with self.collective(f"after round {self.rounds_done()}"):
            return any(f is not None for f in self._all_gather_object(sig))

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    # ---- collectives --------------------------------------------------------------------------------
    def _all_gather_object(self, obj):
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _exchange_columns(
        self, rows: List[torch.Tensor], src: Optional[torch.Tensor], counts: List[int], dtype: torch.dtype
    ) -> torch.Tensor:
        """All-to-all of column slices. This rank sends, for every rank s, columns ``bounds[s]`` of its
        ``counts[rank]`` rows (``src`` [m, d] or the list ``rows`` of [d] tensors); returns the
        ``[sum(counts), hi - lo]`` matrix of every rank's rows (rank order), this rank's columns."""
        agg, local = self.agg, self.local
        bounds = agg.bounds
        lo, hi = agg.lo, agg.hi
        w = hi - lo
        m = counts[self.rank]
        dev = local.device if (agg.ctx.backend != "gloo") else torch.device("cpu")
        send = torch.empty(m * local.spec.d, dtype=dtype, device=dev)
        in_splits, off = [], 0
        for a, b in bounds:
            n = m * (b - a)
            blk = send[off : off + n].view(m, b - a)
            if src is not None:
                blk.copy_(src[:m, a:b])
            else:
                for i, r in enumerate(rows):
                    blk[i].copy_(r.reshape(-1)[a:b])
            in_splits.append(n)
            off += n
        out_splits = [c * w for c in counts]
        recv = torch.empty(sum(out_splits), dtype=dtype, device=dev)
        if self.world == 1:
            recv.copy_(send)
        else:
            dist.all_to_all_single(recv, send, out_splits, in_splits, group=self.group)
        return recv.view(sum(counts), w).to(local.device)

    # ---- the round's phases 1 and 3 ---------------------------------------------------------------------
    def payloads(self, ids: Sequence[int], mine: range) -> Callable[[int], Any]:
        """Every rank calls ``client_payload`` for every client of the round, in schedule order (a
        collective for methods whose payloads hold d-sized server state); keeps its own."""
        sent: Dict[int, Any] = {}
        for pos, cid in enumerate(ids):
            try:
                p = self.agg.client_payload(cid)
            except Exception as e:  # noqa: BLE001 - reported by the rank that trains the client
                p = e
            if pos in mine:
                sent[pos] = p

        def payload_of(pos: int):
            if isinstance(sent[pos], Exception):
                raise sent[pos]
            return sent[pos]

        return payload_of

    def exchange(self, local: Dict[str, Any]) -> Dict[str, Any]:
        """The small facts as objects (all-gather), then the column slices of the update rows and of
        the d-sized payload tensors (all-to-all)."""
        d = self.local.spec.d
        mine, big = [], []  # big: d-sized payload tensors, in (position, key) order
        for a in local["accepted"]:
            small, keys = {}, []
            for k in sorted(a["payload"]):
                v = a["payload"][k]
                if isinstance(v, torch.Tensor) and v.numel() == d:
                    keys.append((k, str(v.dtype).replace("torch.", ""), tuple(v.shape)))
                    big.append(v)
                else:
                    small[k] = v.cpu() if isinstance(v, torch.Tensor) else v
            mine.append(dict(a, payload=small, big=keys))
        t1 = time.perf_counter()
        err = local["error"]
        facts = self._all_gather_object(
            {
                "accepted": mine,
                "excluded": local["excluded"],
                "error": None if err is None else err[:2],
                "t_local": local["t_local"],
            }
        )
        errs = sorted(f["error"] for f in facts if f["error"] is not None)
        if errs:
            raise BadClientError(errs[0][1])
        acc = [a for f in facts for a in f["accepted"]]  # rank order = schedule order
        excluded = [e for _, e in sorted((x for f in facts for x in f["excluded"]), key=lambda x: x[0])]
        buf = self.local.buf.data
        U = self._exchange_columns([], buf, [len(f["accepted"]) for f in facts], buf.dtype)
        payloads = [dict(a["payload"]) for a in acc]
        my_keys = [k for a in mine for k in a["big"]]
        for g in sorted({k[1] for a in acc for k in a["big"]}):
            dt = getattr(torch, g)
            got = self._exchange_columns(
                [t for t, k in zip(big, my_keys) if k[1] == g],
                None,
                [sum(1 for a in f["accepted"] for k in a["big"] if k[1] == g) for f in facts],
                dt,
            )
            i = 0
            for a, p in zip(acc, payloads):
                for k, kdt, _shape in a["big"]:
                    if kdt == g:
                        p[k] = got[i]
                        i += 1
        return {
            "U": U,
            "accepted": acc,
            "payloads": payloads,
            "excluded": excluded,
            "t_local": max(f["t_local"] for f in facts),
            "t_exchange": time.perf_counter() - t1,
        }

    # ---- checkpoints ----------------------------------------------------------------------------------
    def aggregator_state(self) -> Optional[Dict[str, Any]]:
        """The wrapped aggregator's whole state (rank 0; None elsewhere): every rank's slice gathered
        and merged with :func:`merge_sliced_state`. A collective."""
        agg = self.agg
        st = agg.agg.state_dict()
        st = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in st.items()} if isinstance(st, dict) else st
        with self.collective(f"after round {self.rounds_done()}"):
            allst = self._all_gather_object(st)
        if self.rank != 0:
            return None
        return merge_sliced_state(allst, [b - a for a, b in agg.bounds])

    def find_checkpoint(self, ckpt_dir: str, device):
        """Every rank reads the same (full) checkpoint; rank 0 first (load_latest removes the temp
        files of interrupted writes). The ranks must agree on the round."""
        found = ckpt.load_latest(ckpt_dir, map_location="cpu") if self.rank == 0 else None
        dist.barrier(group=self.group)
        if self.rank != 0:
            found = ckpt.load_latest(ckpt_dir, map_location="cpu")
        rounds = self._all_gather_object(None if found is None else int(found[1]["round"]))
        if len(set(rounds)) != 1:
            raise ckpt.CheckpointError(
                f"resume: the ranks found different checkpoints (rounds {rounds}); they must all read {ckpt_dir}"
            )
        return found

    def load_aggregator_state(self, state: Dict[str, Any]) -> None:
        """Keeps this rank's columns of the full aggregator state."""
        loc = slice_state(state, self.local.spec.d, self.agg.lo, self.agg.hi)
        self.agg.agg.load_state_dict(_to_device(loc, self.local.device))


class DistributedSimulation(Simulation):
    """:class:`Simulation` whose processes are the ranks of a torch.distributed group (:class:`Ranks`):
    the round's clients trained on ``world`` ranks (each with the run's executor) and the aggregation
    sharded by columns (module docstring). All ranks construct it with the same config and call
    ``run()`` together; ``run`` returns once rank 0 has written its outputs. ``group``, ``align``:
    see :class:`Ranks`."""

    def __init__(self, cfg: RunConfig, *, group=None, align: str = "bytes", **kw):
        procs = Ranks(cfg.device, group=group, align=align)
        super().__init__(cfg, **kw)
        self.procs, procs.run_dir = procs, self.run_dir
        self.group, self.align, self.world = group, align, procs.world


def _to_device(state, device):
    if isinstance(state, dict):
        return {k: _to_device(v, device) for k, v in state.items()}
    if isinstance(state, list):
        return [_to_device(v, device) for v in state]
    if isinstance(state, tuple):
        return tuple(_to_device(v, device) for v in state)
    if isinstance(state, torch.Tensor) and state.is_floating_point():
        return state.to(device)
    return state
