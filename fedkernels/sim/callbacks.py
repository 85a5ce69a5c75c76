"""Callbacks of the round loop: everything a run writes or shows, and your own logging.

The loop (``sim/server.py``) calls the hooks of its callbacks in a fixed order, on every process
(``sim.is_main``: the one that evaluates and writes). :class:`Simulation` registers its defaults
around the ones you pass, in this order::

    RunFiles (report.py)      config.yaml, metrics.jsonl, partition report, summary.json/csv,
                              final_model.pt, curves.png
    Provenance (provenance.py) provenance.json and run.log
    Progress (here)           the console: start line, progress bar, round lines, summary
    ... yours ...             (``callbacks=[...]``)
    Checkpoints (checkpoint.py) a checkpoint every ``checkpoint_every`` rounds, after the last, and
                              when a run is stopped; the resume (``on_setup``)

so a round is checkpointed only after every callback has seen it. Hooks (all optional)::

    on_setup(sim)                 the run's state is built (a resumed run's checkpoint loads here)
    on_start(sim)                 before this session's first round
    on_round_end(sim, metrics)    after every round (``sim.start_round`` rounds are done)
    on_interrupt(sim, rnd, rng)   the run stops early at round ``rnd`` (a signal); ``rng``: the torch
                                  RNG state of that round's end (None: the current one)
    on_message(sim, msg, console) a progress line (``console``: also meant for the terminal)
    on_end(sim, summary)          the rounds are over (not after a failure)
    close(sim, status)            however the run ended (status: completed | interrupted | failed | ...)

A plain callable ``cb(round, metrics, model)`` works too: called on the main process after every
round, ``round`` from 1, ``metrics`` the round's dict as written to metrics.jsonl (``accuracy``,
``test_loss``, ``train_loss_mean``, ``global_loss``, ``t_local``, ... and ``agg``, the aggregator's
info), ``model`` the ``nn.Module`` holding the new global model; its optional ``bind(run_dir)`` is
called at the start and ``close()`` at the end::

    def to_wandb(rnd, metrics, model):
        wandb.log({k: v for k, v in metrics.items() if isinstance(v, float)}, step=rnd)
    Simulation(cfg, callbacks=[to_wandb, TensorBoardCallback()]).run()

:class:`TensorBoardCallback` ships here (``pip install tensorboard``; ``fedkernels run --tensorboard``).
"""
from __future__ import annotations

import math
import os
import time
from typing import Any, Dict, Iterator, Optional, Tuple

__all__ = ["Callback", "PerRound", "Progress", "TensorBoardCallback", "as_callback", "format_summary", "scalars"]


class Callback:
    """The hooks of the round loop (module docstring); each does nothing here."""

    def on_setup(self, sim) -> None: ...

    def on_start(self, sim) -> None: ...

    def on_round_end(self, sim, metrics: Dict[str, Any]) -> None: ...

    def on_interrupt(self, sim, rnd: int, rng) -> None: ...

    def on_message(self, sim, msg: str, console: bool) -> None: ...

    def on_end(self, sim, summary: Dict[str, Any]) -> None: ...

    def close(self, sim, status: str) -> None: ...


class PerRound(Callback):
    """A plain ``fn(round, metrics, model)`` as a callback (main process only)."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def on_start(self, sim) -> None:
        if hasattr(self.fn, "bind"):
            self.fn.bind(sim.run_dir)

    def on_round_end(self, sim, metrics: Dict[str, Any]) -> None:
        if sim.is_main:
            self.fn(metrics["round"], metrics, sim.global_model())

    def close(self, sim, status: str) -> None:
        if hasattr(self.fn, "close"):
            self.fn.close()


def as_callback(cb) -> Callback:
    """``cb`` itself when it is a :class:`Callback`, else a :class:`PerRound` around the callable."""
    if isinstance(cb, Callback):
        return cb
    if not callable(cb):
        raise ValueError(f"callbacks: {cb!r} is neither a Callback nor a callable cb(round, metrics, model)")
    return PerRound(cb)


def scalars(metrics: Dict[str, Any], prefix: str = "") -> Iterator[Tuple[str, float]]:
    """The finite numbers of a metrics dict as ``(tag, value)``, nested dicts as ``a/b`` (lists skipped)."""
    for k, v in metrics.items():
        if isinstance(v, dict):
            yield from scalars(v, f"{prefix}{k}/")
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and k != "round":
            yield prefix + k, float(v)


class TensorBoardCallback:
    """Writes every round's scalar metrics to a TensorBoard event file (``log_dir``; default:
    ``<run_dir>/tensorboard``, the run directory given when the simulation starts it)."""

    def __init__(self, log_dir: Optional[str] = None):
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401 - needs the tensorboard package
        except ImportError:
            raise ValueError("--tensorboard: the tensorboard package is not installed (pip install tensorboard)") from None
        self.log_dir = log_dir
        self._writer = None

    def bind(self, run_dir: str) -> None:
        if self.log_dir is None:
            self.log_dir = os.path.join(run_dir, "tensorboard")

    def __call__(self, rnd: int, metrics: Dict[str, Any], model) -> None:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter
            self._writer = SummaryWriter(log_dir=self.log_dir or "tensorboard")
        for tag, v in scalars(metrics):
            self._writer.add_scalar(tag, v, rnd)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


# ---- the console ----------------------------------------------------------------------------------
class Progress(Callback):
    """The run's console output (main process): the start line, a progress bar (``progress``;
    default: on a terminal), every evaluated round's line (outside a terminal every round's, with
    the ETA), the summary. Progress lines (``Simulation.say``) reach the terminal when ``verbose``."""

    def __init__(self) -> None:
        self.bar = None

    def on_start(self, sim) -> None:
        from tqdm.auto import tqdm
        self.t_start, self.first = time.perf_counter(), sim.start_round
        sim.say(start_line(sim))
        self.bar = tqdm(total=sim.cfg.rounds, initial=sim.start_round, desc=f"{sim.cfg.algorithm.name}",
                        disable=not sim._progress_enabled(), dynamic_ncols=True)

    def on_message(self, sim, msg: str, console: bool) -> None:
        if not console or not sim.cfg.verbose:
            return
        if self.bar is not None and not self.bar.disable:
            self.bar.write(msg)
        else:
            print(msg, flush=True)

    def on_round_end(self, sim, m: Dict[str, Any]) -> None:
        """The round's line: always for an evaluated round; outside a terminal (no progress bar) one
        line per round with the ETA (in run.log too when the bar is shown)."""
        if self.bar is None:
            return
        self.bar.update(1)
        if "accuracy" in m:
            self.bar.set_postfix(acc=f"{100 * m['accuracy']:.2f}")
        bar = not self.bar.disable
        done = m["round"] - self.first
        eta = (time.perf_counter() - self.t_start) / max(done, 1) * (sim.cfg.rounds - m["round"])
        line = round_line(m, sim.cfg.rounds) + f"  ETA {_hms(eta)}"
        if "accuracy" in m or not bar:
            sim.say(line if not bar else round_line(m, sim.cfg.rounds))
        else:
            sim.say(line, console=False)

    def on_end(self, sim, summary: Dict[str, Any]) -> None:
        self._close_bar()
        sim.say(format_summary(summary))

    def close(self, sim, status: str) -> None:
        self._close_bar()

    def _close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def start_line(sim) -> str:
    cfg = sim.cfg
    what = f"preset {cfg.preset}, method {cfg.method or cfg.algorithm.name}" if cfg.preset else cfg.algorithm.name
    opts = ", ".join(f"{k}={v}" for k, v in cfg.algorithm.options.items())
    return (f"fedkernels run: {what} ({cfg.algorithm.name}{'(' + opts + ')' if opts else ''}); "
            f"{cfg.data.name}, {cfg.partition.scheme} partition, {cfg.num_clients} clients "
            f"({sim.per_round} per round), model {cfg.model.name} (d={sim.spec.d}), "
            f"{cfg.rounds} rounds, seed {cfg.seed}, {sim.device}; outputs: "
            f"{sim.run_dir if sim.write_outputs else '(not written)'}")


def round_line(m: Dict[str, Any], rounds: int) -> str:
    s = f"round {m['round']:4d}/{rounds}"
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
    if s.get("epsilon") is not None:       # a DP run (docs/privacy.md)
        lines.append(f"   differential privacy: epsilon {s['epsilon']:.4g} after the last round (dp-accounting, RDP)")
    if s.get("excluded_total"):
        lines.append(f"   excluded client updates: {s['excluded_total']}")
    if s.get("diverged"):
        lines.append("   DIVERGED: the global model became non-finite")
    if s.get("run_dir"):
        lines.append(f"   outputs: {s['run_dir']}")
    return "\n".join(lines)
