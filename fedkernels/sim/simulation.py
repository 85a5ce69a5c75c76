"""The federated round loop.

    from fedkernels.sim import presets
    from fedkernels.sim.simulation import Simulation
    summary = Simulation(presets.get("smoke")).run()

Per round ``r``: the clients of the pre-drawn sampling stream (:func:`sample_schedule`; it depends
only on the seed, N, the per-round count and the number of rounds, so every method sees the same
client sequence) train locally from the global model and write ``local - global`` into their
rows of one ``UpdateBuffer``; then ``aggregator.aggregate(global, U, n, ids, payloads)`` gives the
new global model. Evaluation (test accuracy and loss; the global model's loss on the clients'
training data and its variance over clients, Kuramoto §2.8) runs every ``eval_every`` rounds and
after the last one.

Who trains the clients is the run's executor (``sim/executors.py``: sequential, batched, a worker
pool); which clients this process trains and how their rows reach the aggregator are the run's
processes (``executors.OneProcess``; torch.distributed ranks: ``distributed_sim.Ranks``). Everything
the run writes or shows (metrics.jsonl, summary, final model, figures, provenance.json, run.log, the
console, checkpoints and the resume) is a callback of the loop (``sim/callbacks.py``).

Bad clients (NaN/Inf updates, a client's own errors) are excluded or stop the run per
``bad_client_policy`` (``sim/executors.py``); any other failure, or a round with every client
excluded, is a ``RunError``. If the global model itself becomes non-finite the run stops early,
``diverged`` is recorded and the outputs are written.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import numpy as np
import torch
from torch import nn

from .. import algorithms
from ..errors import RunError
from ..flat import FlatSpec, UpdateBuffer
from . import assemble, attacks
from .assemble import resolve_device, sample_schedule, torch_settings
from . import checkpoint as ckpt
from . import compression
from . import lora as sim_lora
from .batched import BatchedExecutor, for_run
from .hetero import HeteroCompute
from .trainer import ClientTrainer, schedule_factor
from .evaluate import evaluate_global, non_finite_evaluation
from .callbacks import Callback, Progress, as_callback
from .config import RunConfig
from .executors import OneProcess, SequentialExecutor, nothing_trained
from .provenance import Provenance
from .report import RunFiles, check_run_dir, json_safe, summarize
from .runstate import ClientRules, LocalTraining, RunView, sync
from .stopping import StopRequest

log = logging.getLogger("fedkernels.sim")


class Simulation:
    """One federated run described by a RunConfig.

    Optional injections (tests, notebooks): ``train``/``test`` objects with ``x`` [N,...] float,
    ``y`` [N] int64 and ``num_classes`` (default: ``fedkernels.sim.data.load_dataset``);
    ``model_fn(num_classes, in_channels, input_size) -> nn.Module`` (default:
    ``fedkernels.sim.models.build_model``); ``client_indices`` a list of index arrays (default:
    ``fedkernels.sim.partition.partition``); ``transform(x, generator) -> x`` for train batches.
    ``callbacks``: :class:`~fedkernels.sim.callbacks.Callback` objects or callables
    ``cb(round, metrics, model)`` (which may return ``(stop, extra_metrics)``), run after the default
    ones (run files, provenance, progress) and before the checkpoints (``sim/callbacks.py``). The
    hooks receive what they need, never this object: the executors the run's
    ``runstate.LocalTraining``, the callbacks a read-only ``runstate.RunView`` (``self.view``).
    """

    def __init__(
        self,
        cfg: RunConfig,
        *,
        run_dir: Optional[str] = None,
        resume: bool = False,
        train=None,
        test=None,
        model_fn: Optional[Callable[..., nn.Module]] = None,
        client_indices: Optional[Sequence] = None,
        transform: Optional[Callable] = None,
        write_outputs: bool = True,
        overwrite: bool = False,
        callbacks: Sequence[Union[Callback, Callable[[int, Dict[str, Any], nn.Module], None]]] = (),
    ):
        from .checks import check_run  # keys, values and options: one-line ValueError before any work

        self.cfg = check_run(
            cfg.copy(), data_set=train is None or test is None, partition=client_indices is None, model=model_fn is None
        )
        # client-side DP: each client clips its update to dp.clip as it writes its row (flat.clip_rows_)
        self.client_clip = self.cfg.dp.clip if self.cfg.dp.kind == "client" else None
        # server-side DP in one process: each row's norm taken as the row is written ({client id: norm}),
        # handed to the DP wrapper, whose aggregate then reads U once (other executors: its own norm pass)
        self.dp_norms = (
            {}
            if self.cfg.dp.kind in ("central", "adaptive") and self.cfg.workers == 1 and not self.cfg.distributed
            else None
        )
        self.run_dir = run_dir or os.path.join(self.cfg.out_dir, self.cfg.run_name())
        self.ckpt_dir = os.path.join(self.run_dir, "checkpoints")
        self.resume = resume
        self._train, self._test, self._model_fn = train, test, model_fn
        self._client_indices, self._transform = client_indices, transform
        self.write_outputs = write_outputs
        self.overwrite = overwrite
        self.procs = OneProcess()  # the run's processes (distributed_sim.Ranks: torch.distributed)
        self.callbacks: List[Callback] = [
            RunFiles(),
            Provenance(),
            Progress(),
            *(as_callback(cb) for cb in callbacks),
            ckpt.Checkpoints(),
        ]
        self.metrics: List[Dict[str, Any]] = []
        self.start_round = 0  # rounds completed
        self.client_rules: Optional[ClientRules] = None  # the method's client rules (stateful ones kept)
        self.summary: Optional[Dict[str, Any]] = None
        self.interrupted, self.stop_after = False, None
        self.stopped_by_callback = False  # a callback's after_round asked the run to stop
        self._ready = False
        self.view = RunView(self)  # what the callbacks see of the run (read-only)
        self.stop = StopRequest(self.view)
        self.first_round = 0  # rounds done when this session started (> 0: resumed)
        self.attack: Optional[attacks.Attack] = None

    @property
    def is_main(self) -> bool:
        """True on the process that evaluates and writes (always, in one process)."""
        return self.procs.is_main

    @property
    def rank(self) -> int:
        return self.procs.rank

    @property
    def cut_short(self) -> bool:
        """Whether this session stopped before its rounds were done (a signal, or ``stop_after``)."""
        return self.interrupted or self.stop_after is not None

    # ---- setup -----------------------------------------------------------------------------------
    def _build_aggregator(self):
        cfg = self.cfg
        opts = dict(cfg.algorithm.options)
        opts.setdefault("on_bad_update", cfg.bad_client_policy)
        if cfg.dp.kind is not None:  # the DP wrapper (algorithms.dp) around the method
            opts["dp"] = cfg.dp.options(cfg)
        return algorithms.build(cfg.algorithm.name, **opts)

    def setup(self) -> "Simulation":
        """Data, partition, model, flat space, aggregator, client schedule, update buffer and executor;
        then the callbacks' ``on_setup`` (a resumed run's checkpoint is loaded there)."""
        if self._ready:
            return self
        cfg = self.cfg
        if self.write_outputs and not self.resume:  # never another run's directory (ValueError)
            check_run_dir(self.run_dir, cfg, self.overwrite, remove=self.is_main)
        if cfg.workers > 1:  # the workers' fork server starts while this process sets up
            from . import workers

            workers.prestart()
        self.device = dev = resolve_device(cfg.device)
        self._train, self._test, (x, y, xt, yt), self.num_classes = assemble.load_data(cfg, self._train, self._test)
        parts = assemble.partition_clients(cfg, y, self._train, self._client_indices)
        self.num_examples_all = [int(p.numel()) for p in parts]
        self.x, self.y = x.to(dev), y.to(dev)
        self.xt, self.yt = xt.to(dev), yt.to(dev)
        self.parts = [p.to(dev) for p in parts]
        self.attack = attacks.for_run(cfg)  # Byzantine attackers (label_flip: their labels here)
        if self.attack is not None:
            self.y = self.attack.poison_labels(self.y, self.parts, self.num_classes)
        self.model = model = assemble.build_model(cfg, x, self.num_classes, self._model_fn).to(dev)
        self.lora = sim_lora.for_run(cfg, model)  # lora.*: only the adapters are flat (sim/lora.py)
        self.spec = self.lora.flat if self.lora is not None else FlatSpec.from_module(model)  # params, float buffers
        self.global_flat = self.spec.flatten(model).clone()
        self.trainer = ClientTrainer(
            model,
            self.spec,
            self.x,
            self.y,
            self.parts,
            cfg.train,
            transform=assemble.train_transform(cfg, self._train, self._transform),
        )
        self.hetero = HeteroCompute(cfg.train, cfg.num_clients, cfg.seed)
        self.per_round = cfg.per_round()
        self.schedule = sample_schedule(cfg.seed, cfg.num_clients, self.per_round, cfg.rounds)
        self.agg = self.procs.aggregator(self._build_aggregator())
        self.agg.setup(self.spec, cfg.num_clients, self.global_flat)
        self.compression = compression.build(cfg, self.agg, self.global_flat.numel())  # None: dense updates
        rule = self.agg.client_rule()
        if rule is not None:
            rule.check_model(model, self.spec)  # a model the method cannot train stops here, once
        self.client_rules = ClientRules(self.agg)
        self.buf = UpdateBuffer(self.procs.buffer_rows(self.per_round), self.spec, device=dev, dtype=self.spec.dtype)
        # "exclude": the aggregator's first read of U screens the rows; "raise": each row as it is written
        self.screen_at_write = cfg.bad_client_policy == "raise" or self.procs.screen_at_write
        self.local = LocalTraining(
            cfg=cfg,
            device=dev,
            spec=self.spec,
            model=model,
            trainer=self.trainer,
            global_flat=self.global_flat,
            buf=self.buf,
            hetero=self.hetero,
            rules=self.client_rules,
            screen_at_write=self.screen_at_write,
            client_clip=self.client_clip,
            dp_norms=self.dp_norms,
            x=self.x,
            y=self.y,
            xt=self.xt,
            yt=self.yt,
            parts=self.parts,
            per_round=self.per_round,
            progress=self.progress_enabled(),
            tag=self.procs.tag,
            lora=self.lora if self.lora is not None and self.lora.hetero else None,
        )
        self.procs.attach(self.agg, self.local, lambda: self.start_round)
        self.executor = self._build_executor()
        self._emit("on_setup")
        if self.resume:  # the newest usable checkpoint (sim/checkpoint.py)
            self._restore()
        self.first_round = self.start_round
        self._ready = True
        return self

    def _restore(self) -> None:
        path, st = ckpt.resume_state(
            self.procs.find_checkpoint, self.run_dir, self.ckpt_dir, self.cfg, self.device, self.global_flat.numel()
        )
        self.load_state(st)
        log.info("resumed from %s at round %d", path, self.start_round)
        self.say(f"resumed from {path} (round {self.start_round})")

    def _build_executor(self):
        """Phase 2's executor (``sim/executors.py``): a worker pool (``workers=N``), the batched
        executor (``clients_at_once``, when the run can be batched) or the sequential loop."""
        if self.cfg.workers > 1:
            from .workers import WorkerExecutor

            return WorkerExecutor(self.local)
        return for_run(self.local) or SequentialExecutor(self.local)

    @property
    def batched(self) -> Optional[BatchedExecutor]:
        """The batched executor when the run trains batched, else None."""
        ex = getattr(self, "executor", None)
        return ex if isinstance(ex, BatchedExecutor) else None

    @property
    def pool(self):
        """The running worker pool (``workers=N``, once started), else None."""
        return getattr(getattr(self, "executor", None), "pool", None)

    # ---- the loop's state ------------------------------------------------------------------------------
    def state(self, rnd: int, rng: Optional[torch.Tensor] = None) -> Optional[Dict[str, Any]]:
        """The state after round ``rnd`` as a checkpoint holds it (None off the main process; gathering
        the aggregator's state may be a collective). ``rng``: the torch RNG state (default: the current one)."""
        agg = self.procs.aggregator_state()
        if not self.is_main:
            return None
        return {
            "version": 1,
            "round": int(rnd),
            "global": self.global_flat.detach().cpu().clone(),
            "aggregator": agg,
            "rules": self.client_rules.state_dict(),
            "rng": {"torch": torch.get_rng_state() if rng is None else rng},
            "metrics": json_safe(self.metrics),
            "config": self.cfg.to_dict(),
            **self.procs.state_extra,
            **({"compression": self.compression.codec.state_dict()} if getattr(self, "compression", None) else {}),
            **({"lora": self.lora.state_dict(self.model)} if getattr(self, "lora", None) else {}),
        }

    def load_state(self, st: Dict[str, Any]) -> None:
        """The inverse of :meth:`state` (the resume)."""
        self.global_flat.copy_(st["global"].to(self.global_flat.device))
        self.procs.load_aggregator_state(st["aggregator"])
        self.client_rules.load_state_dict(st.get("rules", {}))
        if "rng" in st and "torch" in st["rng"]:
            torch.set_rng_state(st["rng"]["torch"].cpu())
        self.metrics = list(st.get("metrics", []))
        if getattr(self, "compression", None) is not None:  # the clients' error-feedback residuals
            self.compression.codec.load_state_dict(st.get("compression", {}))
        if getattr(self, "lora", None) is not None:  # fold: the base weights it changed
            self.lora.load_state_dict(self.model, st.get("lora", {}))
        self.start_round = int(st["round"])

    def check_resume(self) -> Optional[Dict[str, Any]]:
        """For ``resume=True``, before anything is loaded or written: the run's summary when it already
        has ``cfg.rounds`` rounds (then ``run`` says so and leaves it untouched), None when there are
        rounds to train; CheckpointError when there is no checkpoint to continue from."""
        return ckpt.check_resume(self.run_dir, self.cfg.rounds, self.cfg.checkpoint_every)

    def global_model(self) -> nn.Module:
        """The model module holding the current global model."""
        self.trainer.work.copy_(self.global_flat)
        return self.model

    # ---- callbacks and progress ---------------------------------------------------------------------
    def _emit(self, hook: str, *args) -> None:
        for cb in self.callbacks:  # in their fixed order (sim/callbacks.py), each with the run's view
            getattr(cb, hook)(self.view, *args)

    def _after_round(self, m: Dict[str, Any]) -> bool:
        """The callbacks' ``after_round`` (pfl-research's ``after_central_iteration``): each may return
        ``(stop, extra_metrics)``; the extra metrics join the round's (a name it already has is a
        ValueError), and whether any asked to stop is returned."""
        stop = False
        for cb in self.callbacks:
            out = cb.after_round(self.view, m)
            if out is None:
                continue
            asked, extra = out
            stop = stop or bool(asked)
            for k, v in (extra or {}).items():
                if k in m:
                    raise ValueError(
                        f"callbacks: {cb!r} returned the metric {k!r}, which round {m['round']} "
                        "already has; expected new names"
                    )
                m[k] = v
        return stop

    def note_interrupted(self) -> None:
        """The session is an interrupted one (e.g. a signal abandoned the figures of an incomplete run)."""
        self.interrupted = True

    def say(self, msg: str, console: bool = True) -> None:
        """A progress line (main process only), to the callbacks' ``on_message``: run.log (timestamped)
        always, the terminal when ``console`` and ``verbose``."""
        if self.is_main:
            self._emit("on_message", msg, console)

    def progress_enabled(self) -> bool:
        """Progress bars: on the main process only, where ``progress`` says (default: a terminal)."""
        p = self.cfg.progress
        return self.is_main and (bool(p) if p is not None else sys.stderr.isatty())

    # ---- one round: phases --------------------------------------------------------------------------
    # payloads -> local training -> exchange -> aggregate -> evaluate; the loop (run) logs. The run's
    # processes (self.procs) say which positions this process trains, prepare the payloads and
    # exchange the rows; the executor trains.
    def train_local(
        self, r: int, ids: Sequence[int], mine: range, payload_of: Callable[[int], Any], factor: float
    ) -> Dict[str, Any]:
        """Phase 2: the executor trains this process's clients into ``self.buf`` (schedule order);
        ``accepted``, ``excluded``, ``error``, ``t_local`` as ``sim/executors.py`` describes."""
        return self.executor.train_local(r, ids, mine, payload_of, factor)

    def apply_aggregate(self, r: int, excluded: List[Dict[str, Any]], U, n, ids, payloads, **kw):
        """Phase 4: aggregates into self.global_flat; returns (info without 'excluded', seconds).
        Clients the aggregator excluded are appended to ``excluded`` and logged."""
        self.stop.committing = True  # from here the round changes the model: a second signal waits
        t1 = time.perf_counter()
        if self.dp_norms is not None:
            self.agg.known_norms = dict(self.dp_norms)
        if getattr(self, "lora", None) is not None:  # LoRA: the adapters' step (sim/lora.py)
            new, info = self.lora.aggregate(
                self.agg, self.global_flat, self.model, getattr(self, "compression", None), U, n, ids, payloads, r, **kw
            )
        elif getattr(self, "compression", None) is not None:  # the rows as the clients compressed them
            new, info = self.compression.aggregate(self.agg, self.global_flat, U, n, ids, payloads, r)
        else:
            new, info = self.agg.aggregate(self.global_flat, U, n, ids, payloads, **kw)
        if new is not self.global_flat:
            self.global_flat.copy_(new)
        sync(self.device)
        t_agg = time.perf_counter() - t1
        info = dict(info)
        for e in info.pop("excluded", []):
            excluded.append(dict(e))
            log.warning("round %d: aggregator excluded client %s: %s", r + 1, e.get("client_id"), e.get("reason"))
        return info, t_agg

    def evaluate_round(self, r: int, m: Dict[str, Any], trained: Sequence[int]) -> None:
        """Phase 5: test accuracy and loss; the global model's loss on the clients' training data,
        its variance and (``client_loss="all"``) the federated objective ``global_loss``."""
        cfg = self.cfg
        te = time.perf_counter()
        self.trainer.work.copy_(self.global_flat)
        who = (
            None
            if cfg.client_loss == "none"
            else list(range(cfg.num_clients))
            if cfg.client_loss == "all"
            else list(trained)
        )
        elsewhere = getattr(self.executor, "evaluate", None)
        if elsewhere is not None:  # e.g. in the worker processes, batch by batch (the same numbers)
            acc, tl, cl = elsewhere(r, cfg.eval_batch_size, who)
        else:  # on the device, one host transfer (sim/evaluate.py)
            acc, tl, cl = evaluate_global(
                self.model, self.xt, self.yt, cfg.eval_batch_size, self.x, self.y, self.parts, who
            )
        m.update(accuracy=acc, test_loss=tl)
        if who is not None:
            if cl:
                m.update(client_loss_mean=float(np.mean(cl)), client_loss_var=float(np.var(cl)))
                if cfg.client_loss == "all":  # the federated objective sum_i n_i f_i / sum_i n_i
                    n = np.asarray(self.num_examples_all, dtype=np.float64)
                    m["global_loss"] = float(np.dot(n, cl) / max(n.sum(), 1.0))
        sync(self.device)
        m["t_eval"] = time.perf_counter() - te

    def run_round(self, r: int) -> Dict[str, Any]:
        """One round, as its phases; returns the round's metrics (the callbacks write them)."""
        cfg = self.cfg
        ids = list(self.schedule[r])
        self.buf.reset()
        if self.dp_norms is not None:
            self.dp_norms.clear()
        factor = schedule_factor(cfg.train, r, cfg.rounds)
        mine = self.procs.positions(len(ids))
        payload_of = self.procs.payloads(ids, mine)  # 1. payloads
        local = self.train_local(r, ids, mine, payload_of, factor)  # 2. local training
        ex = self.procs.exchange(local)  # 3. exchange
        acc, excluded = ex["accepted"], list(ex["excluded"])
        attacked = self.attack.corrupt(r, ex["U"], [a["cid"] for a in acc]) if self.attack is not None else None
        if not acc:  # nothing to aggregate: a run error
            raise nothing_trained(r, ids, excluded)
        seen = len(excluded)
        info, t_agg = self.apply_aggregate(
            r,
            excluded,
            ex["U"],
            [a["n"] for a in acc],  # 4. aggregate
            [a["cid"] for a in acc],
            ex["payloads"],
            **self.procs.aggregate_kwargs,
        )
        if len(excluded) >= len(ids):  # the aggregator excluded the rest
            raise nothing_trained(r, ids, excluded)
        if len(excluded) > seen:  # the aggregator excluded some (e.g. a NaN/Inf row): not among the updates
            dropped = {e["client_id"] for e in excluded[seen:]}
            acc = [a for a in acc if a["cid"] not in dropped]
            at = {c: i for i, c in enumerate(ids)}
            excluded.sort(key=lambda e: at.get(e["client_id"], len(ids)))  # schedule order
        t_agg += ex["t_exchange"]
        t_local = ex["t_local"]
        losses = [a["loss"] for a in acc]
        m: Dict[str, Any] = {
            "round": r + 1,
            "clients": list(ids),
            "num_updates": len(acc),
            "lr": float(cfg.train.lr * factor),
            "train_loss_mean": float(np.mean(losses)) if losses else None,
            "train_loss_var": float(np.var(losses)) if losses else None,
            "local_steps": [a["steps"] for a in acc],
            "t_local": t_local,
            "t_agg": t_agg,
            "agg_share": t_agg / (t_local + t_agg) if t_local + t_agg > 0 else None,
            "excluded": excluded,
        }
        diverged = not bool(torch.isfinite(self.global_flat).all())
        if diverged:
            m["diverged"] = True
        if self.is_main and not diverged and ((r + 1) % cfg.eval_every == 0 or r + 1 == cfg.rounds):
            self.evaluate_round(r, m, [a["cid"] for a in acc])  # 5. evaluate
        m["agg"] = json_safe(info)
        if "epsilon" in info:  # a DP run: the privacy spent so far (dp-accounting), on every row
            m["epsilon"] = info["epsilon"]
        if self.attack is not None:
            m["attack"] = self.attack.record(attacked, info)
        if "bytes_sent" in info:  # compressed updates: what the clients sent
            m["bytes_sent"], m["bytes_dense"] = info["bytes_sent"], info["bytes_dense"]
        return m

    # ---- the run ------------------------------------------------------------------------------------
    def _rounds(self, end: int) -> None:
        """The round loop: rounds ``start_round .. end-1``, each followed by the callbacks (files,
        progress, yours, the checkpoint); stops after a diverged round or an agreed stop signal."""
        for r in range(self.start_round, end):
            self._rng_at_round, self.stop.committing = torch.get_rng_state(), False
            self.stop.running = True  # a signal now: this round finishes first
            with self.procs.collective(f"during round {r + 1}"):
                m = self.run_round(r)
            self.metrics.append(m)
            self.start_round = r + 1
            self.stop.running = False  # between rounds: a signal stops after this one
            asked = self._after_round(m)  # the callbacks' (stop, extra metrics), before anything is written
            self._emit("on_round_end", m)
            if m.get("diverged"):
                self.say(f"round {r + 1}: the global model is not finite; stopping (diverged)")
                return
            bad = non_finite_evaluation(m)
            if bad is not None:  # (sim/checkpoint.py writes no checkpoint of this round)
                raise RunError(
                    f"round {r + 1}: the evaluation is not finite ({bad}) under {self.cfg.algorithm.name}; "
                    "the run stops (its metrics and earlier checkpoints are kept)"
                )
            if self.procs.stop_agreed(self.stop.signal):
                self.interrupted = True
                self._emit("on_interrupt", r + 1, None)  # a checkpoint of this round, if it has none
                return
            if self.procs.stop_agreed(True if asked else None):  # a callback's stop: the run ends here
                self.stopped_by_callback = True
                self.say(f"round {r + 1}: a callback asked to stop; stopping")
                if r + 1 < end:
                    self._emit("on_interrupt", r + 1, None)
                return

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
        summary = self._session(stop_after)
        with self.procs.collective(f"after round {self.start_round}"):
            self.procs.barrier()  # every process returns once the main one has written
        return summary

    def _session(self, stop_after: Optional[int]) -> Dict[str, Any]:
        cfg = self.cfg
        if self.resume and not self._ready:
            done = self.check_resume()
            if done is not None:
                if self.is_main:
                    print(ckpt.already_complete_line(self.run_dir, done["already_complete"], cfg.rounds), flush=True)
                self.summary = done
                return done
        t_start = time.perf_counter()
        self.stop = StopRequest(self.view)  # SIGINT/SIGTERM: stop after the round (sim/stopping.py)
        self._rng_at_round = None  # the torch RNG state at the start of the round under way
        self.interrupted, self.stop_after, self.stopped_by_callback = False, stop_after, False
        restore = self.procs.guard_signals(self.stop.install)
        status = "failed"
        try:
            with torch_settings(cfg):  # threads, deterministic algorithms
                self.setup()
                self._emit("on_start")
                try:
                    self._rounds(cfg.rounds if stop_after is None else min(cfg.rounds, int(stop_after)))
                except KeyboardInterrupt:  # a second signal during local training: the state is round start_round's
                    self.interrupted, clean = True, not self.stop.committing
                    self.stop.committing = True  # further signals wait for this checkpoint
                    if clean and self.procs.saves_alone and self.start_round > self.first_round:
                        self._emit("on_interrupt", self.start_round, self._rng_at_round)
                finally:
                    self.stop.committing = False
            self.summary = summarize(self.metrics, cfg.rounds, cfg.target_accuracy)
            self.summary.update(
                name=cfg.run_name(),
                algorithm=cfg.algorithm.name,
                seed=cfg.seed,
                dataset=cfg.data.name,
                model=cfg.model.name,
                num_clients=cfg.num_clients,
                clients_per_round=self.per_round,
                d=self.spec.d,
                device=str(self.device),
                wall_s=time.perf_counter() - t_start,
                run_dir=self.run_dir if self.write_outputs and self.is_main else None,
            )
            self._emit("on_end", self.summary)
            status = (
                "diverged"
                if self.summary.get("diverged")
                else "completed"
                if self.start_round >= cfg.rounds
                else "interrupted"
                if self.interrupted or self.stop.signal is not None
                else "stopped"
            )
        except KeyboardInterrupt:  # a second signal outside the rounds (setup, the summary): say where things are
            status = "interrupted"
            if self.is_main:
                print(self._interrupted_line(), file=sys.stderr, flush=True)
            raise
        except Exception as e:  # the cause goes into run.log and provenance.json (Provenance.close)
            self.failure = f"{type(e).__name__}: {' '.join(str(e).split())}"
            raise
        finally:
            try:
                if getattr(self, "executor", None) is not None:  # e.g. workers=N: stop and join them, however it ends
                    self.executor.close()
                self._emit("close", status)  # provenance.json's status, run.log's end line
            finally:
                restore()
        if (self.interrupted or self.stop.signal is not None) and status != "completed":
            if self.is_main:
                print(self._interrupted_line(), file=sys.stderr, flush=True)
            raise KeyboardInterrupt
        if self.stop.signal is not None and self.is_main:
            print(
                f"stopped after the last round ({self.start_round}): the run is complete", file=sys.stderr, flush=True
            )
        return self.summary

    def _interrupted_line(self) -> str:
        return ckpt.interrupted_line(self.run_dir, self.start_round, self.write_outputs)


def run(cfg: RunConfig, **kw) -> Dict[str, Any]:
    """Convenience: ``Simulation(cfg, **kw).run()``."""
    return Simulation(cfg, **kw).run()
