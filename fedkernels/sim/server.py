"""The federated round loop.

    from fedkernels.sim import presets
    from fedkernels.sim.server import Simulation
    summary = Simulation(presets.get("smoke")).run()

Per round ``r``: the clients of the pre-drawn sampling stream (:func:`sample_schedule`; it depends
only on the seed, N, the per-round count and the number of rounds, so every method sees the same
client sequence) train locally from the global model and write ``local - global`` into their
rows of one ``UpdateBuffer``; then ``aggregator.aggregate(global, U, n, ids, payloads)`` gives the
new global model. Evaluation (test accuracy and loss; the global model's loss on the clients'
training data and its variance over clients, Kuramoto §2.8) runs every ``eval_every`` rounds and
after the last one.

Who trains the clients is the run's executor (``sim/executors.py``: sequential, batched, a worker
pool; ``DistributedSimulation`` runs one on each rank's block and replaces the exchange).

Bad clients (``bad_client_policy="exclude"``, the default): a client whose update contains NaN/Inf,
or whose training raises a bad-client error (``client.CLIENT_ERRORS``: a ValueError of its own input,
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

If the global model itself becomes non-finite the run stops early, ``diverged`` is recorded and
the outputs are written.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch
from torch import nn

from .. import algorithms
from ..errors import RunError
from ..flat import FlatSpec, UpdateBuffer
from . import checkpoint as ckpt
from .batched import BatchedExecutor, for_simulation
from .client import BadClientError, CLIENT_ERRORS  # noqa: F401 - re-exported: their home is client.py
from .client import (STREAM_INIT, STREAM_SAMPLING, STREAM_SUBSET, ClientTrainer, HeteroCompute, client_losses,
                     derive_seed, evaluate, schedule_factor)
from .executors import SequentialExecutor
from .config import PRESENTATION_KEYS, RunConfig
from .report import RunWriter, json_safe, summarize

log = logging.getLogger("fedkernels.sim")


def sample_schedule(seed: int, num_clients: int, per_round: int, rounds: int) -> List[List[int]]:
    """Client ids of every round, drawn up front (uniform without replacement, sorted within a
    round). Round r's draw does not depend on ``rounds``: a longer run extends a shorter one."""
    rng = np.random.default_rng(derive_seed(seed, STREAM_SAMPLING, num_clients, per_round))
    out = []
    for _ in range(rounds):
        if per_round >= num_clients:
            out.append(list(range(num_clients)))
            rng.permutation(num_clients)  # keep the stream aligned whatever per_round is
        else:
            out.append(sorted(int(c) for c in rng.choice(num_clients, per_round, replace=False)))
    return out


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available (use device=cpu or auto)")
    return dev


def _subset(data, n: Optional[int], seed: int, which: int):
    if n is None or n >= len(data.y):
        return data.x, data.y
    g = torch.Generator().manual_seed(derive_seed(seed, STREAM_SUBSET, which))
    idx = torch.randperm(len(data.y), generator=g)[: int(n)].sort().values
    return data.x[idx], data.y[idx]


@contextmanager
def _deterministic(on: bool):
    prev = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    if on:
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        if on:
            torch.use_deterministic_algorithms(prev, warn_only=prev_warn)


# config keys that may change on resume without changing the computation
_RESUME_FREE = {"name", "preset", "method", "rounds", "eval_every", "eval_batch_size", "out_dir", "checkpoint_every",
                "keep_checkpoints", "plots", "progress", "verbose", "threads", "target_accuracy", "client_loss",
                "distributed", "workers", "clients_at_once"}


def _config_diff(old: Dict[str, Any], new: Dict[str, Any], prefix: str = "", free=_RESUME_FREE) -> List[str]:
    out = []
    for k in sorted(set(old) | set(new)):
        if not prefix and k in free:
            continue
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _config_diff(a, b, prefix + k + ".", free)
        elif a != b:
            out.append(prefix + k)
    return out


class Simulation:
    """One federated run described by a RunConfig.

    Optional injections (tests, notebooks): ``train``/``test`` objects with ``x`` [N,...] float,
    ``y`` [N] int64 and ``num_classes`` (default: ``fedkernels.sim.data.load_dataset``);
    ``model_fn(num_classes, in_channels, input_size) -> nn.Module`` (default:
    ``fedkernels.sim.models.build_model``); ``client_indices`` a list of index arrays (default:
    ``fedkernels.sim.partition.partition``); ``transform(x, generator) -> x`` for train batches.
    """

    def __init__(self, cfg: RunConfig, *, run_dir: Optional[str] = None, resume: bool = False,
                 train=None, test=None, model_fn: Optional[Callable[..., nn.Module]] = None,
                 client_indices: Optional[Sequence] = None, transform: Optional[Callable] = None,
                 write_outputs: bool = True, overwrite: bool = False,
                 callbacks: Sequence[Callable[[int, Dict[str, Any], nn.Module], None]] = ()):
        from .checks import check_run     # keys, values and options: one-line ValueError before any work
        self.cfg = check_run(cfg.copy(), data_set=train is None or test is None,
                             partition=client_indices is None, model=model_fn is None)
        self.run_dir = run_dir or os.path.join(self.cfg.out_dir, self.cfg.run_name())
        self.resume = resume
        self._train, self._test, self._model_fn = train, test, model_fn
        self._client_indices, self._transform = client_indices, transform
        self.write_outputs = write_outputs
        self.metrics: List[Dict[str, Any]] = []
        self.start_round = 0
        self._ready = False
        self.rules: Dict[int, Any] = {}   # stateful client rules, by client id
        self.summary: Optional[Dict[str, Any]] = None
        self.overwrite = overwrite
        self.callbacks = list(callbacks)     # cb(round, metrics, model) after every round (fedkernels.sim.callbacks)
        self._stop_signal: Optional[int] = None
        self._bar = None
        self._runlog = None
        self._first_round = 0

    # ---- setup -----------------------------------------------------------------------------------
    def _load_data(self):
        cfg = self.cfg
        if self._train is None or self._test is None:
            from .data import GENERATED, dataset_key, load_dataset
            kw = dict(cfg.data.options)
            if dataset_key(cfg.data.name) in GENERATED:
                kw.setdefault("seed", cfg.seed)   # generated data: a new draw per run seed unless pinned
            kw.setdefault("max_train", cfg.data.train_subset)
            kw.setdefault("max_test", cfg.data.test_subset)
            tr, te = load_dataset(cfg.data.name, root=cfg.data.root, **kw)
            self._train, self._test = tr, te
            x, y, xt, yt = tr.x, tr.y, te.x, te.y
        else:  # injected data: a seeded random subset when asked
            x, y = _subset(self._train, cfg.data.train_subset, 0, 0)
            xt, yt = _subset(self._test, cfg.data.test_subset, 0, 1)
        self.num_classes = int(getattr(self._train, "num_classes", int(y.max()) + 1))
        return x, y, xt, yt

    def _partition(self, y: torch.Tensor):
        cfg = self.cfg
        if self._client_indices is not None:
            parts = self._client_indices
        else:
            from .partition import partition
            pseed = cfg.partition.seed if cfg.partition.seed is not None else cfg.seed
            popts = dict(cfg.partition.options)
            if cfg.partition.scheme.lower() == "natural":  # per-sample owners of the data (synthetic)
                popts.setdefault("owners", (getattr(self._train, "meta", None) or {}).get("client_ids"))
            parts = partition(y.cpu().numpy(), cfg.num_clients, cfg.partition.scheme, pseed, **popts)
        if len(parts) != cfg.num_clients:
            raise ValueError(f"partition gave {len(parts)} clients, expected num_clients={cfg.num_clients}")
        return [torch.as_tensor(np.asarray(p), dtype=torch.long) for p in parts]

    def _build_model(self, x: torch.Tensor) -> nn.Module:
        cfg = self.cfg
        in_ch = int(x.shape[1]) if x.dim() >= 2 else 1
        size = int(x.shape[-1]) if x.dim() >= 3 else int(x.shape[-1])
        torch.manual_seed(derive_seed(cfg.seed, STREAM_INIT))
        if self._model_fn is not None:
            return self._model_fn(self.num_classes, in_ch, size)
        from .models import build_model
        mopts = dict(cfg.model.options)
        if x.dim() == 2:  # flat [N, F] rows (synthetic, gmm): MLP / logreg take in_features=F
            mopts.setdefault("in_features", int(x.shape[1]))
        return build_model(cfg.model.name, self.num_classes, in_ch, size, **mopts)

    def _train_transform(self):
        if self._transform is not None or not self.cfg.data.augment:
            return self._transform
        from .data import Augment
        recipe = self.cfg.data.augment if isinstance(self.cfg.data.augment, str) else "auto"
        tr = Augment.for_data(self._train, recipe) if hasattr(self._train, "augment") else None
        if tr is None:
            log.warning("data.augment is set but dataset %r has no train transform; training without one",
                        self.cfg.data.name)
        return tr

    def _build_aggregator(self):
        cfg = self.cfg
        opts = dict(cfg.algorithm.options)
        opts.setdefault("on_bad_update", cfg.bad_client_policy)
        return algorithms.build(cfg.algorithm.name, **opts)

    def _check_run_dir(self) -> None:
        """Never overwrite another run: an existing run directory must hold this config (or
        ``overwrite``, which also removes its checkpoints; or ``resume``)."""
        old_path = os.path.join(self.run_dir, "config.yaml")
        if self.resume or not self.write_outputs or not os.path.exists(old_path):
            return
        try:
            old = RunConfig.from_yaml(old_path).to_dict()
        except (OSError, ValueError):
            old = None
        diff = (["<unreadable config.yaml>"] if old is None else
                _config_diff(old, self.cfg.to_dict(), free=PRESENTATION_KEYS))
        if not diff:
            return
        if not self.overwrite:
            raise ValueError(f"run directory {self.run_dir} holds a run with a different config "
                             f"({', '.join(diff[:4])}{', ...' if len(diff) > 4 else ''}); give another --name, "
                             "--overwrite to replace it, or --resume to continue it")
        if self.is_main:
            import shutil
            shutil.rmtree(os.path.join(self.run_dir, "checkpoints"), ignore_errors=True)

    def setup(self) -> "Simulation":
        if self._ready:
            return self
        cfg = self.cfg
        self._check_run_dir()
        if cfg.workers > 1:        # the workers' fork server starts while this process sets up
            from . import workers
            workers.prestart()
        self.device = resolve_device(cfg.device)
        x, y, xt, yt = self._load_data()
        parts = self._partition(y)
        self.num_examples_all = [int(p.numel()) for p in parts]
        dev = self.device
        self.x, self.y = x.to(dev), y.to(dev)
        self.xt, self.yt = xt.to(dev), yt.to(dev)
        self.parts = [p.to(dev) for p in parts]
        model = self._build_model(x).to(dev)
        self.model = model
        self.spec = FlatSpec.from_module(model)          # parameters and float buffers (BatchNorm statistics)
        self.global_flat = self.spec.flatten(model).clone()
        self.trainer = ClientTrainer(model, self.spec, self.x, self.y, self.parts, cfg.train,
                                     transform=self._train_transform())
        self.hetero = HeteroCompute(cfg.train, cfg.num_clients, cfg.seed)
        self.per_round = cfg.per_round()
        self.schedule = sample_schedule(cfg.seed, cfg.num_clients, self.per_round, cfg.rounds)
        self.agg = self._build_aggregator()
        self.agg.setup(self.spec, cfg.num_clients, self.global_flat)
        rule = self.agg.client_rule()
        if rule is not None:
            rule.check_model(model, self.spec)          # a model the method cannot train stops here, once
        self.buf = UpdateBuffer(self.per_round, self.spec, device=dev, dtype=self.spec.dtype)
        # bad clients: under "exclude" the aggregator's first read of U screens the rows (one pass,
        # Aggregator.screen_in_pass); under "raise" each row is screened as it is written (the first
        # bad client in schedule order stops the run)
        self.screen_clients = cfg.bad_client_policy == "raise"
        self.executor = self._build_executor()
        self.writer = RunWriter(self.run_dir) if self.write_outputs and self.is_main else None
        self.ckpt_dir = os.path.join(self.run_dir, "checkpoints")
        if self.resume:
            self._load_checkpoint()
        self._first_round = self.start_round
        for cb in self.callbacks:
            if hasattr(cb, "bind"):
                cb.bind(self.run_dir)
        if self.writer is not None:
            self.writer.write_config(cfg)
            self.writer.reset_metrics(self.metrics)
            if self.start_round == 0:   # partition.json/.txt (+ .png): client sizes and label mix
                self.writer.write_partition_report(self.y, self.parts, plot=bool(cfg.plots))
        self._ready = True
        return self

    # ---- client rules ---------------------------------------------------------------------------
    def _rule(self, cid: int):
        if cid in self.rules:
            return self.rules[cid]
        rule = self.agg.client_rule()
        if rule is not None and hasattr(rule, "state_dict") and hasattr(rule, "load_state_dict"):
            self.rules[cid] = rule   # stateful across rounds: kept per client and checkpointed
        return rule

    # ---- checkpoints --------------------------------------------------------------------------------
    def aggregator_state(self) -> Optional[Dict[str, Any]]:
        """The aggregator's whole state (the distributed simulator gathers its slices: a collective,
        None off the main process)."""
        return self.agg.state_dict()

    def state(self, rnd: int, rng: Optional[torch.Tensor] = None) -> Optional[Dict[str, Any]]:
        agg = self.aggregator_state()
        if not self.is_main:
            return None
        return {"version": 1, "round": int(rnd), "global": self.global_flat.detach().cpu().clone(),
                "aggregator": agg,
                "rules": {int(c): r.state_dict() for c, r in self.rules.items()},
                "rng": {"torch": torch.get_rng_state() if rng is None else rng},
                "metrics": json_safe(self.metrics), "config": self.cfg.to_dict()}

    def save_checkpoint(self, rnd: int, rng: Optional[torch.Tensor] = None) -> Optional[str]:
        """Writes the round-``rnd`` checkpoint (called on every process: the state may be gathered);
        ``rng``: the torch RNG state to record (default: the current one)."""
        st = self.state(rnd) if rng is None else self.state(rnd, rng=rng)
        if self.writer is None or st is None:
            return None
        p = ckpt.save(ckpt.path_for(self.ckpt_dir, rnd), st)
        ckpt.prune(self.ckpt_dir, self.cfg.keep_checkpoints)
        return p

    def find_checkpoint(self):
        """(path, state) of the newest usable checkpoint, or None."""
        return ckpt.load_latest(self.ckpt_dir, map_location=self.device)

    def load_aggregator_state(self, state: Dict[str, Any]) -> None:
        self.agg.load_state_dict(state)

    def _load_checkpoint(self) -> None:
        found = self.find_checkpoint()
        if found is None:
            raise ckpt.CheckpointError(self._no_checkpoint_message())
        path, st = found
        diff = _config_diff(st.get("config", {}), self.cfg.to_dict())
        if diff:
            log.warning("resume: the config differs from the checkpoint's in %s; the run will not repeat "
                        "an uninterrupted one", ", ".join(diff))
        if st["global"].numel() != self.global_flat.numel():
            raise ckpt.CheckpointError(f"{path}: global model has {st['global'].numel()} values, this "
                                       f"config's model has {self.global_flat.numel()}")
        self.global_flat.copy_(st["global"].to(self.global_flat.device))
        self.load_aggregator_state(st["aggregator"])
        for c, rs in st.get("rules", {}).items():
            rule = self.agg.client_rule()
            rule.load_state_dict(rs)
            self.rules[int(c)] = rule
        if "rng" in st and "torch" in st["rng"]:
            torch.set_rng_state(st["rng"]["torch"].cpu())
        self.metrics = list(st.get("metrics", []))
        self.start_round = int(st["round"])
        log.info("resumed from %s at round %d", path, self.start_round)
        self._print(f"resumed from {path} (round {self.start_round})")

    def _no_checkpoint_message(self) -> str:
        n = self.cfg.checkpoint_every
        why = "checkpoints were off: checkpoint_every=0" if n <= 0 else \
            f"no round reached a checkpoint yet: checkpoint_every={n}"
        return (f"--resume {self.run_dir}: no checkpoint to continue from in "
                f"{os.path.join(self.run_dir, 'checkpoints')} ({why}); nothing was "
                f"changed. To get one, start the run again with checkpoint_every=1 (a checkpoint after every round, "
                f"and always at Ctrl-C)")

    def check_resume(self) -> Optional[Dict[str, Any]]:
        """For ``resume=True``, before anything is loaded or written: the run's summary when it already
        has ``cfg.rounds`` rounds (then ``run`` says so and leaves it untouched), None when there are
        rounds to train; CheckpointError when there is no checkpoint to continue from."""
        done = ckpt.completed_rounds(self.run_dir)
        if done >= self.cfg.rounds:
            s = ckpt.read_summary(self.run_dir) or {"rounds_completed": done, "rounds": self.cfg.rounds}
            s.update(run_dir=self.run_dir, already_complete=done)
            return s
        if not ckpt.list_checkpoints(os.path.join(self.run_dir, "checkpoints")):
            raise ckpt.CheckpointError(self._no_checkpoint_message())
        return None

    def _saves_alone(self) -> bool:
        """Whether this process can write a checkpoint by itself (not when gathering the state is a
        collective, as in the distributed simulator: a signal may reach one rank only)."""
        return type(self).aggregator_state is Simulation.aggregator_state

    def _interrupted_line(self) -> str:
        """The one line an interrupted run ends with: where its last checkpoint is, and how to go on."""
        done = self.start_round
        if not self.write_outputs:
            return f"interrupted after round {done}: nothing saved (outputs are off: write_outputs=False)"
        last = ckpt.list_checkpoints(os.path.join(self.run_dir, "checkpoints"))
        if last:
            c = last[-1][0]
            lost = "" if c >= done else f" (rounds {c + 1}-{done} will be trained again)"
            return (f"interrupted after round {done}: checkpoint at round {c}{lost}; continue with "
                    f"`fedkernels run --resume {self.run_dir}`")
        if done == 0:
            return "interrupted before the first round ended: nothing to resume; start the run again"
        return (f"interrupted after round {done}: no checkpoint could be written (rounds 1-{done} will be trained "
                f"again); start the run again with checkpoint_every=1")

    # ---- output helpers ---------------------------------------------------------------------------
    def _progress_enabled(self) -> bool:
        """Progress bars: on the main process only, where ``progress`` says (default: a terminal)."""
        p = self.cfg.progress
        return self.is_main and (bool(p) if p is not None else sys.stderr.isatty())

    def _print(self, msg: str) -> None:
        """A progress line (main process only): to RUN_DIR/run.log (timestamped) always, to stdout
        when verbose."""
        if not self.is_main:
            return
        log_ = getattr(self, "_runlog", None)
        if log_ is not None:
            log_(msg)
        if not self.cfg.verbose:
            return
        if getattr(self, "_bar", None) is not None and not self._bar.disable:
            self._bar.write(msg)
        else:
            print(msg, flush=True)

    def _clients_desc(self, r: int) -> str:
        return f"round {r + 1} clients"

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- one round: phases --------------------------------------------------------------------------
    # payloads -> local training -> exchange -> aggregate -> evaluate -> log. The single-process and
    # the distributed simulator share every phase; the distributed one overrides which positions this
    # process trains, how payloads are prepared (a collective there) and the exchange.
    @property
    def is_main(self) -> bool:
        """True on the process that evaluates and writes (always, in one process)."""
        return True

    def positions(self, K: int) -> range:
        """The positions of the round's ``K`` clients that this process trains (all of them here)."""
        return range(K)

    def prepare_payloads(self, ids: Sequence[int], mine: range) -> Callable[[int], Any]:
        """Phase 1: a function ``pos -> payload`` for the positions in ``mine`` (computed on demand
        here, so no K payloads are held at once); an exception it raises counts as that client's."""
        return lambda pos: self.agg.client_payload(ids[pos])

    def _build_executor(self):
        """Phase 2's executor (``sim/executors.py``): a worker pool (``workers=N``), the batched
        executor (``clients_at_once``, when the run can be batched) or the sequential loop."""
        if self.cfg.workers > 1:
            from .workers import WorkerExecutor
            return WorkerExecutor(self)
        return for_simulation(self) or SequentialExecutor(self)

    @property
    def batched(self) -> Optional[BatchedExecutor]:
        """The batched executor when the run trains batched, else None."""
        ex = getattr(self, "executor", None)
        return ex if isinstance(ex, BatchedExecutor) else None

    @property
    def _pool(self):
        """The running worker pool (``workers=N``, once started), else None."""
        return getattr(getattr(self, "executor", None), "pool", None)

    def train_local(self, r: int, ids: Sequence[int], mine: range, payload_of: Callable[[int], Any],
                    factor: float) -> Dict[str, Any]:
        """Phase 2: the executor trains this process's clients into ``self.buf`` (schedule order).
        Returns ``accepted`` (per client: pos, cid, n, payload, loss, steps), ``excluded`` ((pos,
        record) pairs), ``error`` ((pos, message, exception) under bad_client_policy="raise", or a
        RunError's for a failure that is not a bad client: ``executors.client_failed``) and ``t_local``."""
        return self.executor.train_local(r, ids, mine, payload_of, factor)

    def nothing_trained(self, r: int, ids: Sequence[int], excluded: List[Dict[str, Any]]) -> RunError:
        """The error of a round in which every client was excluded (one line: how many, why)."""
        why: Dict[str, int] = {}
        for e in excluded:
            why[str(e.get("reason"))] = why.get(str(e.get("reason")), 0) + 1
        top = "; ".join(f"{k} ({v} client{'s' if v > 1 else ''})" for k, v in list(why.items())[:2])
        more = f"; {len(why) - 2} other reason(s)" if len(why) > 2 else ""
        return RunError(f"round {r + 1}: every client was excluded ({len(excluded)} of {len(ids)}: {top}{more}); "
                        "nothing was trained, the run stops")

    def exchange(self, local: Dict[str, Any]) -> Dict[str, Any]:
        """Phase 3: every trained client of the round, in schedule order, as the aggregator takes them:
        ``U`` (rows), ``accepted``, ``payloads``, ``excluded`` records, ``t_local`` (the slowest
        process) and ``t_exchange``. Raises BadClientError for a client error under "raise"."""
        if local["error"] is not None:
            _, msg, exc = local["error"]
            if isinstance(exc, RunError):
                raise exc
            raise BadClientError(msg) from exc
        acc = local["accepted"]
        return {"U": self.buf.matrix(), "accepted": acc, "payloads": [a["payload"] for a in acc],
                "excluded": [e for _, e in local["excluded"]], "t_local": local["t_local"], "t_exchange": 0.0}

    def apply_aggregate(self, r: int, excluded: List[Dict[str, Any]], U, n, ids, payloads, **kw):
        """Phase 4: aggregates into self.global_flat; returns (info without 'excluded', seconds).
        Clients the aggregator excluded are appended to ``excluded`` and logged."""
        self._committing = True    # from here the round changes the model: a second signal waits (run())
        t1 = time.perf_counter()
        new, info = self.agg.aggregate(self.global_flat, U, n, ids, payloads, **kw)
        if new is not self.global_flat:
            self.global_flat.copy_(new)
        self._sync()
        t_agg = time.perf_counter() - t1
        info = dict(info)
        for e in info.pop("excluded", []):
            excluded.append(dict(e))
            log.warning("round %d: aggregator excluded client %s: %s", r + 1, e.get("client_id"), e.get("reason"))
        return info, t_agg

    def aggregate_kwargs(self) -> Dict[str, Any]:
        return {}

    def evaluate_round(self, r: int, m: Dict[str, Any], trained: Sequence[int]) -> None:
        """Phase 5: test accuracy and loss; the global model's loss on the clients' training data,
        its variance and (``client_loss="all"``) the federated objective ``global_loss``."""
        cfg = self.cfg
        te = time.perf_counter()
        self.trainer.work.copy_(self.global_flat)
        who = (None if cfg.client_loss == "none" else
               list(range(cfg.num_clients)) if cfg.client_loss == "all" else list(trained))
        elsewhere = getattr(self.executor, "evaluate", None)
        if elsewhere is not None:   # e.g. in the worker processes, batch by batch (the same numbers)
            acc, tl, cl = elsewhere(r, cfg.eval_batch_size, who)
        else:       # on the device, one host transfer (sim/evaluate.py)
            from .evaluate import evaluate_global
            acc, tl, cl = evaluate_global(self.model, self.xt, self.yt, cfg.eval_batch_size, self.x, self.y,
                                          self.parts, who)
        m.update(accuracy=acc, test_loss=tl)
        if who is not None:
            if cl:
                m.update(client_loss_mean=float(np.mean(cl)), client_loss_var=float(np.var(cl)))
                if cfg.client_loss == "all":   # the federated objective sum_i n_i f_i / sum_i n_i
                    n = np.asarray(self.num_examples_all, dtype=np.float64)
                    m["global_loss"] = float(np.dot(n, cl) / max(n.sum(), 1.0))
        self._sync()
        m["t_eval"] = time.perf_counter() - te

    def run_round(self, r: int) -> Dict[str, Any]:
        """One round, as its phases; returns the round's metrics (phase 6 writes them)."""
        cfg = self.cfg
        ids = list(self.schedule[r])
        self.buf.reset()
        factor = schedule_factor(cfg.train, r, cfg.rounds)
        mine = self.positions(len(ids))
        payload_of = self.prepare_payloads(ids, mine)                  # 1. payloads
        local = self.train_local(r, ids, mine, payload_of, factor)     # 2. local training
        ex = self.exchange(local)                                      # 3. exchange
        acc, excluded = ex["accepted"], list(ex["excluded"])
        if not acc:                                                    # nothing to aggregate: a run error
            raise self.nothing_trained(r, ids, excluded)
        seen = len(excluded)
        info, t_agg = self.apply_aggregate(r, excluded, ex["U"], [a["n"] for a in acc],   # 4. aggregate
                                           [a["cid"] for a in acc], ex["payloads"], **self.aggregate_kwargs())
        if len(excluded) >= len(ids):                                  # the aggregator excluded the rest
            raise self.nothing_trained(r, ids, excluded)
        if len(excluded) > seen:      # the aggregator excluded some (e.g. a NaN/Inf row): not among the updates
            dropped = {e["client_id"] for e in excluded[seen:]}
            acc = [a for a in acc if a["cid"] not in dropped]
            at = {c: i for i, c in enumerate(ids)}
            excluded.sort(key=lambda e: at.get(e["client_id"], len(ids)))   # schedule order
        t_agg += ex["t_exchange"]
        t_local = ex["t_local"]
        losses = [a["loss"] for a in acc]
        m: Dict[str, Any] = {
            "round": r + 1, "clients": list(ids), "num_updates": len(acc),
            "lr": float(cfg.train.lr * factor),
            "train_loss_mean": float(np.mean(losses)) if losses else None,
            "train_loss_var": float(np.var(losses)) if losses else None,
            "local_steps": [a["steps"] for a in acc],
            "t_local": t_local, "t_agg": t_agg,
            "agg_share": t_agg / (t_local + t_agg) if t_local + t_agg > 0 else None,
            "excluded": excluded,
        }
        diverged = not bool(torch.isfinite(self.global_flat).all())
        if diverged:
            m["diverged"] = True
        if self.is_main and not diverged and ((r + 1) % cfg.eval_every == 0 or r + 1 == cfg.rounds):
            self.evaluate_round(r, m, [a["cid"] for a in acc])      # 5. evaluate
        m["agg"] = json_safe(info)
        return m

    # ---- the run ------------------------------------------------------------------------------------
    def run(self, stop_after: Optional[int] = None) -> Dict[str, Any]:
        """Runs the remaining rounds (or up to round ``stop_after``, to simulate an interruption)
        and returns the summary; writes the run directory unless ``write_outputs`` is False.

        SIGINT / SIGTERM: the round under way finishes, a checkpoint of it is written, the outputs
        too, one line says how to continue, and KeyboardInterrupt is raised (the CLI exits 130). A
        second signal abandons the round's local training at once and checkpoints the last completed
        round (a round already aggregating finishes first: the model has changed); no completed
        round is lost.

        ``resume=True``: a run that already has ``rounds`` rounds is left untouched (one line, its
        summary returned); a run without a checkpoint is a CheckpointError before anything is done."""
        from tqdm.auto import tqdm
        cfg = self.cfg
        if self.resume and not self._ready:
            done = self.check_resume()
            if done is not None:
                if self.is_main:
                    n = done["already_complete"]
                    print(f"{self.run_dir}: already complete ({n} rounds done, rounds={cfg.rounds}); nothing to do, "
                          f"nothing written. To train more rounds: fedkernels run --resume {self.run_dir} "
                          f"rounds=N (N > {n})", flush=True)
                self.summary = done
                return done
        t_start = time.perf_counter()
        det = cfg.deterministic if cfg.deterministic is not None else resolve_device(cfg.device).type == "cuda"
        if det and resolve_device(cfg.device).type == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        prev_threads = torch.get_num_threads()
        if cfg.threads:
            torch.set_num_threads(int(cfg.threads))
        self._stop_signal: Optional[int] = None
        self._committing = False     # True while a round changes the model and its outputs: a signal waits
        self._rng_at_round = None    # the torch RNG state at the start of the round under way
        restore = self._install_signal_handlers()
        interrupted, saved_at, status = False, None, "failed"
        try:
            with _deterministic(det):
                self.setup()
                self._start_provenance()
                end = cfg.rounds if stop_after is None else min(cfg.rounds, int(stop_after))
                self._print(self._start_line())
                self._bar = tqdm(total=cfg.rounds, initial=self.start_round, desc=f"{cfg.algorithm.name}",
                                 disable=not self._progress_enabled(), dynamic_ncols=True)
                try:
                    for r in range(self.start_round, end):
                        self._rng_at_round, self._committing = torch.get_rng_state(), False
                        with self._peer_loss_stops(f"during round {r + 1}"):
                            m = self.run_round(r)
                        self.metrics.append(m)
                        if self.writer is not None:
                            self.writer.append(m)
                        self._bar.update(1)
                        self.start_round = r + 1
                        self._report_round(m, t_start)
                        if self.callbacks and self.is_main:
                            self.trainer.work.copy_(self.global_flat)      # the model holds the new global model
                            for cb in self.callbacks:
                                cb(r + 1, m, self.model)
                        if m.get("diverged"):
                            self._print(f"round {r + 1}: the global model is not finite; stopping (diverged)")
                            break
                        if self.write_outputs and cfg.checkpoint_every > 0 and (
                                (r + 1) % cfg.checkpoint_every == 0 or r + 1 == cfg.rounds):
                            self.save_checkpoint(r + 1)        # the last round too: `--resume rounds=N` extends it
                            saved_at = r + 1
                        if self._stop_agreed():
                            interrupted = True
                            if self.write_outputs and saved_at != r + 1:
                                self.save_checkpoint(r + 1)
                                saved_at = r + 1
                            break
                except KeyboardInterrupt:      # a second signal during local training: the state is round start_round's
                    interrupted, clean = True, not self._committing
                    self._committing = True    # further signals wait for this checkpoint
                    if (clean and self.write_outputs and self._saves_alone() and self.start_round > self._first_round
                            and saved_at != self.start_round):
                        self.save_checkpoint(self.start_round, rng=self._rng_at_round)
                        saved_at = self.start_round
                finally:
                    self._committing = False
                    self._bar.close()
                    self._bar = None
            self.summary = summarize(self.metrics, cfg.rounds, cfg.target_accuracy)
            self.summary.update(name=cfg.run_name(), algorithm=cfg.algorithm.name, seed=cfg.seed,
                                dataset=cfg.data.name, model=cfg.model.name, num_clients=cfg.num_clients,
                                clients_per_round=self.per_round, d=self.spec.d, device=str(self.device),
                                wall_s=time.perf_counter() - t_start, run_dir=self.run_dir if self.writer else None)
            if self.writer is not None:
                self.writer.write_summary(self.summary)
                if self.start_round >= cfg.rounds or (stop_after is None and not interrupted):
                    self.save_final_model()
                if cfg.plots:
                    try:
                        self.writer.plot(self.metrics, title=f"{cfg.run_name()} ({cfg.algorithm.name})")
                    except KeyboardInterrupt:
                        interrupted = True
                        print("interrupted while plotting: curves.png not written (metrics.jsonl has every round)",
                              file=sys.stderr)
            self._print(format_summary(self.summary))
            status = ("interrupted" if interrupted or self._stop_signal is not None else
                      "diverged" if self.summary.get("diverged") else
                      "completed" if self.start_round >= cfg.rounds else "stopped")
        except KeyboardInterrupt:     # a second signal outside the rounds (setup, the summary): say where things are
            status = "interrupted"
            if self.is_main:
                print(self._interrupted_line(), file=sys.stderr, flush=True)
            raise
        finally:
            if getattr(self, "executor", None) is not None:   # e.g. workers=N: stop and join them, however the run ends
                self.executor.close()
            self._finish_provenance(status)
            restore()
            if cfg.threads:
                torch.set_num_threads(prev_threads)
        for cb in self.callbacks:
            close = getattr(cb, "close", None)
            if close is not None:
                close()
        if interrupted or self._stop_signal is not None:
            if self.is_main:
                print(self._interrupted_line(), file=sys.stderr, flush=True)
            raise KeyboardInterrupt
        return self.summary

    # ---- provenance and run.log ------------------------------------------------------------------------
    def _start_provenance(self) -> None:
        """provenance.json (versions, commit, hardware, command, start time) and a run.log beside it."""
        self._runlog = None
        if self.writer is None:
            return
        from . import provenance
        provenance.write(self.run_dir, provenance.collect(sys.argv))
        self._runlog = provenance.RunLog(self.run_dir)

    def _finish_provenance(self, status: str) -> None:
        log_ = getattr(self, "_runlog", None)
        if log_ is None:
            return
        from . import provenance
        log_(f"end: {status} after round {self.start_round}")
        log_.close()
        self._runlog = None
        provenance.finish(self.run_dir, status=status, rounds_completed=self.start_round)

    # ---- interruption -------------------------------------------------------------------------------
    def _install_signal_handlers(self) -> Callable[[], None]:
        """SIGINT/SIGTERM set a stop flag (the loop ends after the round); a second one raises
        KeyboardInterrupt. Only in the main thread; returns the function that restores the old ones."""
        import signal
        import threading
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def handler(signum, frame):
            name = signal.Signals(signum).name
            if self._stop_signal is None:
                self._stop_signal = signum
                if self.is_main:
                    keep = f" and keep round {self.start_round}" if self.start_round > 0 else ""
                    print(f"{name}: finishing round {self.start_round + 1} and writing a checkpoint (again to "
                          f"abandon the round{keep})", file=sys.stderr, flush=True)
                return
            if getattr(self, "_committing", False):   # the model already changed: finish the round, then stop
                if self.is_main:
                    print(f"{name}: round {self.start_round + 1} is past local training; stopping as soon as it "
                          "is written", file=sys.stderr, flush=True)
                return
            raise KeyboardInterrupt

        old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}

        def restore():
            for s, h in old.items():
                signal.signal(s, h)
        return restore

    def _peer_loss_stops(self, when: str):
        """The context of the collectives of a round or a checkpoint (none in one process; the
        distributed simulator turns a lost peer into one line naming it)."""
        return contextlib.nullcontext()

    def _stop_agreed(self) -> bool:
        """Whether to stop after this round (every process must agree: see the distributed override)."""
        return self._stop_signal is not None

    # ---- progress ---------------------------------------------------------------------------------
    def _start_line(self) -> str:
        cfg = self.cfg
        what = f"preset {cfg.preset}, method {cfg.method or cfg.algorithm.name}" if cfg.preset else cfg.algorithm.name
        opts = ", ".join(f"{k}={v}" for k, v in cfg.algorithm.options.items())
        return (f"fedkernels run: {what} ({cfg.algorithm.name}{'(' + opts + ')' if opts else ''}); "
                f"{cfg.data.name}, {cfg.partition.scheme} partition, {cfg.num_clients} clients "
                f"({self.per_round} per round), model {cfg.model.name} (d={self.spec.d}), "
                f"{cfg.rounds} rounds, seed {cfg.seed}, {self.device}; outputs: "
                f"{self.run_dir if self.writer is not None or self.write_outputs else '(not written)'}")

    def _report_round(self, m: Dict[str, Any], t_start: float) -> None:
        """The round's line: always for an evaluated round; outside a terminal (no progress bar) one
        line per round with the ETA."""
        if "accuracy" in m and self._bar is not None:
            self._bar.set_postfix(acc=f"{100 * m['accuracy']:.2f}")
        bar = self._bar is not None and not self._bar.disable
        done = m["round"] - self._first_round
        eta = (time.perf_counter() - t_start) / max(done, 1) * (self.cfg.rounds - m["round"])
        line = self._line(m) + f"  ETA {_hms(eta)}"
        if "accuracy" in m or not bar:
            self._print(line if not bar else self._line(m))
        elif self._runlog is not None:
            self._runlog(line)

    def save_final_model(self) -> str:
        self.trainer.work.copy_(self.global_flat)
        path = os.path.join(self.run_dir, "final_model.pt")
        torch.save({"flat": self.global_flat.detach().cpu().clone(),
                    "state_dict": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
                    "names": self.spec.names, "round": self.start_round}, path)
        return path

    def _line(self, m: Dict[str, Any]) -> str:
        s = f"round {m['round']:4d}/{self.cfg.rounds}"
        if "accuracy" in m:
            s += f"  acc {100 * m['accuracy']:6.2f}%  test loss {m['test_loss']:.4f}"
        if m.get("train_loss_mean") is not None:
            s += f"  train loss {m['train_loss_mean']:.4f}"
        if m.get("client_loss_var") is not None:
            s += f"  client-loss var {m['client_loss_var']:.4f}"
        if m.get("global_loss") is not None:
            s += f"  global loss {m['global_loss']:.4f}"
        s += f"  t_local {m['t_local']:.2f}s  t_agg {1e3 * m['t_agg']:.2f}ms"
        if m["excluded"]:
            s += f"  excluded {[e['client_id'] for e in m['excluded']]}"
        return s


def _hms(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def format_summary(s: Dict[str, Any]) -> str:
    def pct(v):
        return f"{100 * v:.2f}%" if isinstance(v, (int, float)) else "n/a"
    lines = [f"== {s.get('name')} ({s.get('algorithm')}, seed {s.get('seed')}): "
             f"{s.get('rounds_completed')}/{s.get('rounds')} rounds on {s.get('device')}",
             f"   final accuracy {pct(s.get('final_accuracy'))}, best {pct(s.get('best_accuracy'))} "
             f"(round {s.get('best_round')}), mean last 10% {pct(s.get('mean_last_10pct_rounds'))}"]
    if s.get("target_accuracy") is not None:
        lines.append(f"   rounds to {pct(s['target_accuracy'])}: {s.get('rounds_to_target') or 'not reached'}")
    share = s.get("agg_share")
    lines.append(f"   local training {s.get('t_local_total', 0):.2f}s, aggregation {s.get('t_agg_total', 0):.3f}s"
                 f" ({'n/a' if share is None else f'{100 * share:.2f}%'} of the two), eval "
                 f"{s.get('t_eval_total', 0):.2f}s, wall {s.get('wall_s', 0):.1f}s")
    if s.get("excluded_total"):
        lines.append(f"   excluded client updates: {s['excluded_total']}")
    if s.get("diverged"):
        lines.append("   DIVERGED: the global model became non-finite")
    if s.get("run_dir"):
        lines.append(f"   outputs: {s['run_dir']}")
    return "\n".join(lines)


def run(cfg: RunConfig, **kw) -> Dict[str, Any]:
    """Convenience: ``Simulation(cfg, **kw).run()``."""
    return Simulation(cfg, **kw).run()
