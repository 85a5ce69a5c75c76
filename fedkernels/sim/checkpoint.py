"""The simulator's checkpoint directory: one file per round (``ckpt_round_NNNNNN.pt``), the newest
usable one found at resume, old ones pruned. Each file is written and read by
:func:`fedkernels.safe_io.save_checkpoint` / :func:`~fedkernels.safe_io.load_checkpoint`.

File layout: a plain ``torch.save`` archive of a dict holding only tensors and plain Python values
(``torch.load(path, weights_only=True)`` opens it), then one line with its SHA-256 and byte length.

Writing is atomic: a temporary file in the same directory, flushed and fsync'ed, then
``os.replace`` onto the final name (and the directory fsync'ed). A truncated or corrupted file fails
the checksum with a clear :class:`CheckpointError`; :func:`load_latest` then falls back to the
previous checkpoint with a warning.
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

log = logging.getLogger("fedkernels.sim")

__all__ = ["MAGIC", "CheckpointError", "save", "load", "path_for", "list_checkpoints", "load_latest", "prune",
           "completed_rounds", "read_summary"]

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
