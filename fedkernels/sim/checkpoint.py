"""The simulator's checkpoint directory: one file per round (``ckpt_round_NNNNNN.pt``), the newest
usable one found at resume, old ones pruned. Each file is written and read by
:func:`fedkernels.safe_io.save_checkpoint` / :func:`~fedkernels.safe_io.load_checkpoint`.

File layout: a plain ``torch.save`` archive of a dict holding only tensors and plain Python values
(``torch.load(path, weights_only=True)`` opens it), then one line with its SHA-256 and byte length.

Writing is atomic: a temporary file in the same directory, flushed and fsync'ed, then
``os.replace`` onto the final name (and the directory fsync'ed). A truncated or corrupted file fails
the checksum with a clear :class:`CheckpointError`; :func:`load_latest` then falls back to the
previous checkpoint with a warning.

A simulation writes and reads them through its :class:`Checkpoints` callback: every
``checkpoint_every`` rounds, after the last round (``--resume rounds=N`` extends a run), when a run
is stopped by a signal (the last completed round), and the resume at set-up.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import re
from typing import Any, Dict, List, Optional, Tuple

from ..safe_io import MAGIC, CheckpointError
from ..safe_io import load_checkpoint as _load
from ..safe_io import save_checkpoint as _save
from .callbacks import Callback
from .evaluate import non_finite_evaluation

log = logging.getLogger("fedkernels.sim")

__all__ = ["MAGIC", "CheckpointError", "Checkpoints", "save", "load", "path_for", "list_checkpoints", "load_latest",
           "prune", "completed_rounds", "read_summary", "config_diff", "check_resume", "already_complete_line",
           "interrupted_line"]

_NAME = "ckpt_round_{:06d}.pt"
_RE = re.compile(r"ckpt_round_(\d+)\.pt$")


def save(path: str, state: Dict[str, Any]) -> str:
    """Writes ``state`` to ``path`` atomically with a SHA-256 checksum; returns ``path``."""
    return _save(state, path)


def load(path: str, map_location="cpu") -> Dict[str, Any]:
    """Reads and verifies a checkpoint; raises CheckpointError naming the problem."""
    return _load(path, map_location=map_location)


def path_for(ckpt_dir: str, rnd: int) -> str:
    return os.path.join(ckpt_dir, _NAME.format(int(rnd)))


def list_checkpoints(ckpt_dir: str) -> List[Tuple[int, str]]:
    """(round, path) of the checkpoints in ``ckpt_dir``, oldest first."""
    out = []
    for p in glob.glob(os.path.join(ckpt_dir, "ckpt_round_*.pt")):
        m = _RE.search(os.path.basename(p))
        if m:
            out.append((int(m.group(1)), p))
    return sorted(out)


def load_latest(ckpt_dir: str, map_location="cpu") -> Optional[Tuple[str, Dict[str, Any]]]:
    """(path, state) of the newest readable checkpoint; corrupted ones are skipped with a warning.
    None when there is no checkpoint; CheckpointError when every one is unreadable.
    Temp files of writes that a crash interrupted (``.tmp-*.pt``) are removed: at resume nothing else
    writes to this run's directory, and they are never read as checkpoints."""
    for tmp in glob.glob(os.path.join(ckpt_dir, ".tmp-*.pt")):
        try:
            os.unlink(tmp)
            log.warning("removed an unfinished checkpoint write: %s", tmp)
        except OSError:
            pass
    cks = list_checkpoints(ckpt_dir)
    errors = []
    for _, p in reversed(cks):
        try:
            return p, load(p, map_location)
        except CheckpointError as e:
            log.warning("skipping checkpoint: %s; trying the previous one", e)
            errors.append(str(e))
    if errors:
        raise CheckpointError("no usable checkpoint in " + ckpt_dir + ": " + "; ".join(errors))
    return None


def prune(ckpt_dir: str, keep: int) -> None:
    """Keeps the newest ``keep`` checkpoints (keep <= 0: keep all)."""
    if keep <= 0:
        return
    for _, p in list_checkpoints(ckpt_dir)[:-keep]:
        try:
            os.unlink(p)
        except OSError:
            pass


def _read_json(path: str) -> Optional[Dict[str, Any]]:
    try:
        with open(path) as f:
            d = json.load(f)
        return d if isinstance(d, dict) else None
    except (OSError, ValueError):
        return None


def completed_rounds(run_dir: str) -> int:
    """Rounds the run in ``run_dir`` has completed and kept: the newest checkpoint's round, or, for a
    run that ended normally (``"status": "completed"`` in provenance.json), its last round; 0 when
    neither. ``--resume`` of a run with ``rounds`` or more of them has nothing to do."""
    cks = list_checkpoints(os.path.join(run_dir, "checkpoints"))
    done = cks[-1][0] if cks else 0
    prov = _read_json(os.path.join(run_dir, "provenance.json")) or {}
    if prov.get("status") == "completed" and isinstance(prov.get("rounds_completed"), int):
        done = max(done, prov["rounds_completed"])
    return done


def read_summary(run_dir: str) -> Optional[Dict[str, Any]]:
    """``RUN_DIR/summary.json`` as a dict, or None when it is missing or unreadable."""
    return _read_json(os.path.join(run_dir, "summary.json"))


# config keys that may change on resume without changing the computation
RESUME_FREE = {"name", "preset", "method", "rounds", "eval_every", "eval_batch_size", "out_dir", "checkpoint_every",
               "keep_checkpoints", "plots", "progress", "verbose", "threads", "target_accuracy", "client_loss",
               "distributed", "workers", "clients_at_once"}


def config_diff(old: Dict[str, Any], new: Dict[str, Any], prefix: str = "", free=RESUME_FREE) -> List[str]:
    """The dotted keys whose values differ between two config dicts (top-level keys in ``free`` skipped)."""
    out = []
    for k in sorted(set(old) | set(new)):
        if not prefix and k in free:
            continue
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_diff(a, b, prefix + k + ".", free)
        elif a != b:
            out.append(prefix + k)
    return out


def no_checkpoint_message(run_dir: str, checkpoint_every: int) -> str:
    n = checkpoint_every
    why = "checkpoints were off: checkpoint_every=0" if n <= 0 else \
        f"no round reached a checkpoint yet: checkpoint_every={n}"
    return (f"--resume {run_dir}: no checkpoint to continue from in "
            f"{os.path.join(run_dir, 'checkpoints')} ({why}); nothing was "
            f"changed. To get one, start the run again with checkpoint_every=1 (a checkpoint after every round, "
            f"and always at Ctrl-C)")


def check_resume(run_dir: str, rounds: int, checkpoint_every: int) -> Optional[Dict[str, Any]]:
    """Before a resumed run loads or writes anything: its summary when it already has ``rounds``
    rounds (``already_complete`` added), None when there are rounds to train; CheckpointError when
    there is no checkpoint to continue from."""
    done = completed_rounds(run_dir)
    if done >= rounds:
        s = read_summary(run_dir) or {"rounds_completed": done, "rounds": rounds}
        s.update(run_dir=run_dir, already_complete=done)
        return s
    if not list_checkpoints(os.path.join(run_dir, "checkpoints")):
        raise CheckpointError(no_checkpoint_message(run_dir, checkpoint_every))
    return None


def already_complete_line(run_dir: str, done: int, rounds: int) -> str:
    """What ``--resume`` of a run that already has ``rounds`` rounds says (it changes nothing)."""
    return (f"{run_dir}: already complete ({done} rounds done, rounds={rounds}); nothing to do, "
            f"nothing written. To train more rounds: fedkernels run --resume {run_dir} rounds=N (N > {done})")


def interrupted_line(run_dir: str, done: int, written: bool = True) -> str:
    """The one line an interrupted run ends with (``done`` rounds completed): where its last
    checkpoint is, and how to go on."""
    if not written:
        return f"interrupted after round {done}: nothing saved (outputs are off: write_outputs=False)"
    last = list_checkpoints(os.path.join(run_dir, "checkpoints"))
    if last:
        c = last[-1][0]
        lost = "" if c >= done else f" (rounds {c + 1}-{done} will be trained again)"
        return (f"interrupted after round {done}: checkpoint at round {c}{lost}; continue with "
                f"`fedkernels run --resume {run_dir}`")
    if done == 0:
        return "interrupted before the first round ended: nothing to resume; start the run again"
    return (f"interrupted after round {done}: no checkpoint could be written (rounds 1-{done} will be trained "
            f"again); start the run again with checkpoint_every=1")


class Checkpoints(Callback):
    """A simulation's checkpoints (a callback of the round loop, on every process: gathering the state
    may be a collective; the main process writes). Writes round ``r`` when ``r % checkpoint_every ==
    0`` or ``r`` is the last round (not after a diverged round), and at an interruption the last
    completed round, once; keeps the newest ``keep_checkpoints``. ``on_setup`` of a resumed run loads
    the newest usable one into the simulation (``Simulation.load_state``)."""

    def __init__(self) -> None:
        self.saved_at: Optional[int] = None

    def on_setup(self, sim) -> None:
        if sim.resume:
            self.restore(sim)

    def on_start(self, sim) -> None:
        self.saved_at = None

    def on_round_end(self, sim, metrics: Dict[str, Any]) -> None:
        rnd, every = metrics["round"], sim.cfg.checkpoint_every
        if metrics.get("diverged") or not sim.write_outputs or every <= 0 or non_finite_evaluation(metrics):
            return
        if rnd % every == 0 or rnd == sim.cfg.rounds:
            self.save(sim, rnd)

    def on_interrupt(self, sim, rnd: int, rng) -> None:
        if sim.write_outputs and self.saved_at != rnd:
            self.save(sim, rnd, rng)

    def save(self, sim, rnd: int, rng=None) -> Optional[str]:
        """The round-``rnd`` checkpoint of ``sim`` (``rng``: the torch RNG state to record; default
        the current one). Called on every process; the path on the main one, else None."""
        self.saved_at = rnd
        st = sim.state(rnd, rng)
        if st is None or not sim.is_main:
            return None
        p = save(path_for(sim.ckpt_dir, rnd), st)
        prune(sim.ckpt_dir, sim.cfg.keep_checkpoints)
        return p

    @staticmethod
    def restore(sim) -> None:
        found = sim.procs.find_checkpoint(sim.ckpt_dir, sim.device)
        if found is None:
            raise CheckpointError(no_checkpoint_message(sim.run_dir, sim.cfg.checkpoint_every))
        path, st = found
        diff = config_diff(st.get("config", {}), sim.cfg.to_dict())
        if diff:
            log.warning("resume: the config differs from the checkpoint's in %s; the run will not repeat "
                        "an uninterrupted one", ", ".join(diff))
        if st["global"].numel() != sim.global_flat.numel():
            raise CheckpointError(f"{path}: global model has {st['global'].numel()} values, this "
                                  f"config's model has {sim.global_flat.numel()}")
        sim.load_state(st)
        log.info("resumed from %s at round %d", path, sim.start_round)
        sim.say(f"resumed from {path} (round {sim.start_round})")
