"""The simulator's checkpoint directory: one file per round (``ckpt_round_NNNNNN.pt``), the newest
usable one found at resume, old ones pruned. Each file is written and read by
:func:`fedkernels.safe_io.save_checkpoint` / :func:`~fedkernels.safe_io.load_checkpoint`.

File layout: a plain ``torch.save`` archive of a dict holding only tensors and plain Python values
(``torch.load(path, weights_only=True)`` opens it), then one line with its SHA-256 and byte length.

Writing is atomic: a temporary file in the same directory, flushed and fsync'ed, then
``os.replace`` onto the final name (and the directory fsync'ed). A truncated or corrupted file fails
the checksum with a clear :class:`CheckpointError`; :func:`load_latest` then falls back to the
previous checkpoint with a warning.

A simulation writes them through its :class:`Checkpoints` callback: every ``checkpoint_every``
rounds, after the last round (``--resume rounds=N`` extends a run), when a run is stopped by a
signal or a callback (the last completed round); it reads one at set-up (:func:`resume_state`).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..safe_io import MAGIC, CheckpointError
from ..safe_io import load_checkpoint as _load
from ..safe_io import save_checkpoint as _save
from .callbacks import Callback
from .evaluate import non_finite_evaluation

log = logging.getLogger("fedkernels.sim")

__all__ = [
    "MAGIC",
    "CheckpointError",
    "Checkpoints",
    "save",
    "load",
    "path_for",
    "list_checkpoints",
    "load_latest",
    "prune",
    "completed_rounds",
    "read_summary",
    "config_diff",
    "check_resume",
    "already_complete_line",
    "interrupted_line",
    "check_extension",
    "resume_note",
]

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


# config keys that may change on resume without changing the computation (``rounds``: checked by
# check_extension; ``threads`` is not free: another thread count rounds differently)
RESUME_FREE = {
    "name",
    "preset",
    "method",
    "rounds",
    "eval_every",
    "eval_batch_size",
    "out_dir",
    "checkpoint_every",
    "keep_checkpoints",
    "plots",
    "progress",
    "verbose",
    "target_accuracy",
    "client_loss",
    "distributed",
    "workers",
    "clients_at_once",
}


def _lr_factors(train: Dict[str, Any], rounds: int, upto: int) -> List[float]:
    from .trainer import schedule_factor
    from .config import TrainConfig, _from_dict

    t = _from_dict(TrainConfig, train, "train.")
    return [schedule_factor(t, r, rounds) for r in range(upto)]


def check_extension(run_dir: str, old: Dict[str, Any], new, done: int) -> None:
    """A resume of ``run_dir`` (``done`` rounds trained under config dict ``old``) with config ``new``
    must not change the rounds already trained: a learning-rate schedule defined over the planned
    rounds (``cosine``) would give them other values under another ``rounds``. ValueError (one line,
    saying why and what to do) when it would; nothing happens otherwise."""
    r0, r1 = int(old.get("rounds") or 0), int(new.rounds)
    if r0 == r1 or done < 1 or not isinstance(old.get("train"), dict):
        return
    try:
        before = _lr_factors(old["train"], r0, done)
    except (TypeError, ValueError):
        return
    after = _lr_factors(new.to_dict()["train"], r1, done)
    bad = [r for r in range(done) if before[r] != after[r]]
    if bad:
        r, lr = bad[-1], float(new.train.lr)
        raise ValueError(
            f"--resume {run_dir} rounds={r1}: train.lr_schedule={new.train.lr_schedule} is defined over the "
            f"planned rounds ({r0}), so rounds={r1} would change the learning rate of rounds already trained "
            f"(round {r + 1}: {lr * before[r]:.4g} -> {lr * after[r]:.4g}) and the run would equal no "
            f"uninterrupted one; nothing was changed. Start a new run with rounds={r1} instead"
        )


def resume_note(old: Dict[str, Any], new, done: int) -> Optional[str]:
    """What a resume with config ``new`` of a run with config dict ``old`` (``done`` rounds trained)
    changes, in one line; None when nothing changes."""
    parts = []
    diff = config_diff(old, new.to_dict())
    if diff:
        parts.append(
            f"{', '.join(diff)} differ from the run's config: rounds {done + 1}- are computed with the "
            f"new values, so the run will not equal an uninterrupted one"
        )
    r0, r1 = int(old.get("rounds") or 0), int(new.rounds)
    if r1 != r0 and r1 > done:
        sched = new.train.lr_schedule
        why = (
            "the lr is constant"
            if sched == "constant"
            else "the step lr schedule does not depend on rounds"
            if sched == "step"
            else f"the {sched} lr schedule gives them the same values"
        )
        extra = ""
        ev = int(old.get("eval_every") or 1)
        if r1 > r0 and r0 <= done and r0 % ev:
            extra = f" (except round {r0}, evaluated as the last round of the {r0})"
        parts.append(
            f"rounds={r1} (was {r0}): rounds {done + 1}-{r1} will be trained; rounds 1-{done} keep their "
            f"values ({why}); the metrics and model equal an uninterrupted {r1}-round run{extra}"
        )
    free = [k for k in sorted(RESUME_FREE - {"rounds"}) if old.get(k) != new.to_dict().get(k)]
    if free:
        parts.append(f"{', '.join(free)} changed (outputs and how the rounds run, not their results)")
    return "; ".join(parts) or None


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
    why = (
        "checkpoints were off: checkpoint_every=0"
        if n <= 0
        else f"no round reached a checkpoint yet: checkpoint_every={n}"
    )
    return (
        f"--resume {run_dir}: no checkpoint to continue from in "
        f"{os.path.join(run_dir, 'checkpoints')} ({why}); nothing was "
        f"changed. To get one, start the run again with checkpoint_every=1 (a checkpoint after every round, "
        f"and always at Ctrl-C)"
    )


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
    return (
        f"{run_dir}: already complete ({done} rounds done, rounds={rounds}); nothing to do, "
        f"nothing written. To train more rounds: fedkernels run --resume {run_dir} rounds=N (N > {done})"
    )


def interrupted_line(run_dir: str, done: int, written: bool = True) -> str:
    """The one line an interrupted run ends with (``done`` rounds completed): where its last
    checkpoint is, and how to go on."""
    if not written:
        return f"interrupted after round {done}: nothing saved (outputs are off: write_outputs=False)"
    last = list_checkpoints(os.path.join(run_dir, "checkpoints"))
    if last:
        c = last[-1][0]
        lost = "" if c >= done else f" (rounds {c + 1}-{done} will be trained again)"
        return (
            f"interrupted after round {done}: checkpoint at round {c}{lost}; continue with "
            f"`fedkernels run --resume {run_dir}`"
        )
    if done == 0:
        return "interrupted before the first round ended: nothing to resume; start the run again"
    return (
        f"interrupted after round {done}: no checkpoint could be written (rounds 1-{done} will be trained "
        f"again); start the run again with checkpoint_every=1"
    )


class Checkpoints(Callback):
    """A run's checkpoints (a callback of the round loop, on every process: gathering the state may be
    a collective; the main process writes). Writes round ``r`` when ``r % checkpoint_every == 0`` or
    ``r`` is the last round (not after a diverged round), and at an interruption the last completed
    round, once; keeps the newest ``keep_checkpoints``. The resume is the loop's
    (:func:`resume_state`, then ``Simulation.load_state``)."""

    def __init__(self) -> None:
        self.saved_at: Optional[int] = None

    def on_start(self, run) -> None:
        self.saved_at = None

    def on_round_end(self, run, metrics: Dict[str, Any]) -> None:
        rnd, every = metrics["round"], run.cfg.checkpoint_every
        if metrics.get("diverged") or not run.write_outputs or every <= 0 or non_finite_evaluation(metrics):
            return
        if rnd % every == 0 or rnd == run.cfg.rounds:
            self.save(run, rnd)

    def on_interrupt(self, run, rnd: int, rng) -> None:
        if run.write_outputs and self.saved_at != rnd:
            self.save(run, rnd, rng)

    def save(self, run, rnd: int, rng=None) -> Optional[str]:
        """The round-``rnd`` checkpoint of the run (``run``: its ``runstate.RunView``; ``rng``: the torch
        RNG state to record, default the current one). Called on every process; the path on the main
        one, else None."""
        self.saved_at = rnd
        st = run.state(rnd, rng)
        if st is None or not run.is_main:
            return None
        p = save(path_for(run.ckpt_dir, rnd), st)
        prune(run.ckpt_dir, run.cfg.keep_checkpoints)
        return p


def resume_state(
    find: Callable[[str, Any], Optional[Tuple[str, Dict[str, Any]]]], run_dir: str, ckpt_dir: str, cfg, device, d: int
) -> Tuple[str, Dict[str, Any]]:
    """``(path, state)`` of the checkpoint a resumed run continues from: the newest usable one
    (``find(ckpt_dir, device)``: the run's processes' ``find_checkpoint``), checked against the
    config (``cfg``: more rounds only; a differing config is logged) and the model's size ``d``.
    CheckpointError when there is none or it does not fit."""
    found = find(ckpt_dir, device)
    if found is None:
        raise CheckpointError(no_checkpoint_message(run_dir, cfg.checkpoint_every))
    path, st = found
    try:
        check_extension(run_dir, st.get("config") or {}, cfg, int(st["round"]))
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    diff = config_diff(st.get("config", {}), cfg.to_dict())
    if diff:
        log.warning(
            "resume: the config differs from the checkpoint's in %s; the run will not repeat an uninterrupted one",
            ", ".join(diff),
        )
    if st["global"].numel() != d:
        raise CheckpointError(f"{path}: global model has {st['global'].numel()} values, this config's model has {d}")
    return path, st
