"""Callbacks of the round loop: everything a run writes or shows, and your own logging.

The loop (``sim/simulation.py``) calls the hooks of its callbacks in a fixed order, on every process
(``run.is_main``: the one that evaluates and writes). A hook receives ``run``, a read-only view of
the run (``runstate.RunView``: ``cfg``, ``run_dir``, ``rounds_done``, ``metrics``, ``global_model()``,
``say(msg)``, ...), never the simulation itself; what a callback reports back is its return value.
:class:`Simulation` registers its defaults around the ones you pass, in this order::

    RunFiles (report.py)      config.yaml, metrics.jsonl, partition report, summary.json/csv,
                              final_model.pt, curves.png
    Provenance (provenance.py) provenance.json and run.log
    Progress (here)           the console: start line, progress bar, round lines, summary
    ... yours ...             (``callbacks=[...]``)
    Checkpoints (checkpoint.py) a checkpoint every ``checkpoint_every`` rounds, after the last, and
                              when a run is stopped; the resume (``on_setup``)

so a round is checkpointed only after every callback has seen it. Hooks (all optional)::

    on_setup(run)                 the run's state is built (before a resumed run's checkpoint loads)
    on_start(run)                 before this session's first round
    after_round(run, metrics)     after every round, before anything is written (``run.rounds_done``
        -> None | (stop, extra)   rounds are done): in the style of pfl-research's
                                  ``after_central_iteration``, it may return ``(stop, extra_metrics)``:
                                  ``extra_metrics`` (a dict of new names) join the round's metrics
                                  (metrics.jsonl), ``stop=True`` ends the run after this round (a
                                  checkpoint of it is written; status "stopped", the final model saved)
    on_round_end(run, metrics)    after every round, once the metrics are final (files, console, checkpoint)
    on_interrupt(run, rnd, rng)   the run stops early at round ``rnd`` (a signal, a callback's stop);
                                  ``rng``: the torch RNG state of that round's end (None: the current one)
    on_message(run, msg, console) a progress line (``console``: also meant for the terminal)
    on_end(run, summary)          the rounds are over (not after a failure)
    close(run, status)            however the run ended (status: completed | interrupted | failed | ...)

A plain callable ``cb(round, metrics, model)`` works too: called on the main process after every
round (its ``after_round``), ``round`` from 1, ``metrics`` the round's dict as written to
metrics.jsonl (``accuracy``, ``test_loss``, ``train_loss_mean``, ``global_loss``, ``t_local``, ...
and ``agg``, the aggregator's info), ``model`` the ``nn.Module`` holding the new global model. It may
return ``(stop, extra_metrics)`` as ``after_round`` does (any other return value is ignored); its
optional ``bind(run_dir)`` is called at the start and ``close()`` at the end::

    def to_wandb(rnd, metrics, model):
        wandb.log({k: v for k, v in metrics.items() if isinstance(v, float)}, step=rnd)
    def early_stop(rnd, metrics, model):          # stop once the test accuracy reaches 90%
        return metrics.get("accuracy", 0.0) >= 0.9, {}
    Simulation(cfg, callbacks=[to_wandb, early_stop, TensorBoardCallback()]).run()

:class:`TensorBoardCallback` ships here (``pip install tensorboard``; ``fedkernels run --tensorboard``).
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Dict, Iterator, Optional, Tuple

__all__ = ["Callback", "PerRound", "Progress", "TensorBoardCallback", "as_callback", "format_summary", "scalars"]


class Callback:
    """The hooks of the round loop (module docstring); each does nothing here. ``run`` is the run's
    read-only ``runstate.RunView``."""

    def on_setup(self, run) -> None: ...

    def on_start(self, run) -> None: ...

    def after_round(self, run, metrics: Dict[str, Any]) -> Optional[Tuple[bool, Dict[str, Any]]]:
        return None

    def on_round_end(self, run, metrics: Dict[str, Any]) -> None: ...

    def on_interrupt(self, run, rnd: int, rng) -> None: ...

    def on_message(self, run, msg: str, console: bool) -> None: ...

    def on_end(self, run, summary: Dict[str, Any]) -> None: ...

    def close(self, run, status: str) -> None: ...


class PerRound(Callback):
    """A plain ``fn(round, metrics, model)`` as a callback (main process only); a ``(stop, extra)``
    it returns is its ``after_round``'s."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __repr__(self) -> str:
        return repr(self.fn)

    def on_start(self, run) -> None:
        if hasattr(self.fn, "bind"):
            self.fn.bind(run.run_dir)

    def after_round(self, run, metrics: Dict[str, Any]) -> Optional[Tuple[bool, Dict[str, Any]]]:
        if not run.is_main:
            return None
        out = self.fn(metrics["round"], metrics, run.global_model())
        if (
            isinstance(out, tuple)
            and len(out) == 2
            and isinstance(out[0], bool)
            and (out[1] is None or isinstance(out[1], dict))
        ):
            return out
        return None

    def close(self, run, status: str) -> None:
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
            raise ValueError(
                "--tensorboard: the tensorboard package is not installed (pip install tensorboard)"
            ) from None
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

    def on_start(self, run) -> None:
        from tqdm.auto import tqdm

        self.t_start, self.first = time.perf_counter(), run.rounds_done
        run.say(start_line(run))
        self.bar = tqdm(
            total=run.cfg.rounds,
            initial=run.rounds_done,
            desc=f"{run.cfg.algorithm.name}",
            disable=not run.progress,
            dynamic_ncols=True,
        )

    def on_message(self, run, msg: str, console: bool) -> None:
        if not console or not run.cfg.verbose:
            return
        if self.bar is not None and not self.bar.disable:
            self.bar.write(msg)
        else:
            print(msg, flush=True)

    def on_round_end(self, run, m: Dict[str, Any]) -> None:
        """The round's line: always for an evaluated round; outside a terminal (no progress bar) one
        line per round with the ETA (in run.log too when the bar is shown)."""
        if self.bar is None:
            return
        self.bar.update(1)
        if "accuracy" in m:
            self.bar.set_postfix(acc=f"{100 * m['accuracy']:.2f}")
        bar = not self.bar.disable
        done = m["round"] - self.first
        eta = (time.perf_counter() - self.t_start) / max(done, 1) * (run.cfg.rounds - m["round"])
        line = round_line(m, run.cfg.rounds) + f"  ETA {_hms(eta)}"
        if "accuracy" in m or not bar:
            run.say(line if not bar else round_line(m, run.cfg.rounds))
        else:
            run.say(line, console=False)

    def on_end(self, run, summary: Dict[str, Any]) -> None:
        self._close_bar()
        run.say(format_summary(summary))

    def close(self, run, status: str) -> None:
        self._close_bar()

    def _close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def start_line(run) -> str:
    cfg = run.cfg
    what = f"preset {cfg.preset}, method {cfg.method or cfg.algorithm.name}" if cfg.preset else cfg.algorithm.name
    opts = ", ".join(f"{k}={v}" for k, v in cfg.algorithm.options.items())
    return (
        f"fedkernels run: {what} ({cfg.algorithm.name}{'(' + opts + ')' if opts else ''}); "
        f"{cfg.data.name}, {cfg.partition.scheme} partition, {cfg.num_clients} clients "
        f"({run.per_round} per round), model {cfg.model.name} (d={run.d}), "
        f"{cfg.rounds} rounds, seed {cfg.seed}, {run.device}; outputs: "
        f"{run.run_dir if run.write_outputs else '(not written)'}"
    )


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

    lines = [
        f"== {s.get('name')} ({s.get('algorithm')}, seed {s.get('seed')}): "
        f"{s.get('rounds_completed')}/{s.get('rounds')} rounds on {s.get('device')}",
        f"   final accuracy {pct(s.get('final_accuracy'))}, best {pct(s.get('best_accuracy'))} "
        f"(round {s.get('best_round')}), mean last 10% {pct(s.get('mean_last_10pct_rounds'))}",
    ]
    if s.get("target_accuracy") is not None:
        lines.append(f"   rounds to {pct(s['target_accuracy'])}: {s.get('rounds_to_target') or 'not reached'}")
    share = s.get("agg_share")
    lines.append(
        f"   local training {s.get('t_local_total', 0):.2f}s, aggregation {s.get('t_agg_total', 0):.3f}s"
        f" ({'n/a' if share is None else f'{100 * share:.2f}%'} of the two), eval "
        f"{s.get('t_eval_total', 0):.2f}s, wall {s.get('wall_s', 0):.1f}s"
    )
    if s.get("epsilon") is not None:  # a DP run (docs/privacy.md)
        lines.append(f"   differential privacy: epsilon {s['epsilon']:.4g} after the last round (dp-accounting, RDP)")
    if s.get("excluded_total"):
        lines.append(f"   excluded client updates: {s['excluded_total']}")
    if s.get("diverged"):
        lines.append("   DIVERGED: the global model became non-finite")
    if s.get("run_dir"):
        lines.append(f"   outputs: {s['run_dir']}")
    return "\n".join(lines)
