"""Atomic, checksummed checkpoints.

File layout: ``MAGIC`` line, the SHA-256 hex digest of the payload and its byte length on the
second line, then the payload: ``torch.save`` of a dict holding only tensors and plain Python values
(so it loads with ``torch.load(weights_only=True)``).

Writing is atomic: a temporary file in the same directory, flushed and fsync'ed, then
``os.replace`` onto the final name (and the directory fsync'ed). A truncated or corrupted file fails
the checksum with a clear :class:`CheckpointError`; :func:`load_latest` then falls back to the
previous checkpoint with a warning.
"""
from __future__ import annotations

import glob
import hashlib
import io
import logging
import os
import re
import tempfile
from typing import Any, Dict, List, Optional, Tuple

import torch

log = logging.getLogger("fedkernels.sim")

MAGIC = b"FEDKERNELS-CKPT-v1\n"
_NAME = "ckpt_round_{:06d}.pt"
_RE = re.compile(r"ckpt_round_(\d+)\.pt$")


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated, corrupted or not a fedkernels checkpoint."""


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save(path: str, state: Dict[str, Any]) -> str:
    """Writes ``state`` to ``path`` atomically with a SHA-256 checksum; returns ``path``."""
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    digest = hashlib.sha256(payload).hexdigest()
    header = MAGIC + f"{digest} {len(payload)}\n".encode()
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(d)
    return path


def load(path: str, map_location="cpu") -> Dict[str, Any]:
    """Reads and verifies a checkpoint; raises CheckpointError naming the problem."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from None
    if not data.startswith(MAGIC):
        raise CheckpointError(f"{path} is not a fedkernels checkpoint (bad header)")
    rest = data[len(MAGIC):]
    nl = rest.find(b"\n")
    try:
        digest, length = rest[:nl].decode().split()
        length = int(length)
    except (ValueError, UnicodeDecodeError):
        raise CheckpointError(f"{path}: corrupted checkpoint header") from None
    payload = rest[nl + 1:]
    if len(payload) != length:
        raise CheckpointError(f"{path}: truncated checkpoint ({len(payload)} of {length} payload bytes)")
    if hashlib.sha256(payload).hexdigest() != digest:
        raise CheckpointError(f"{path}: checksum mismatch (the file is corrupted)")
    try:
        return torch.load(io.BytesIO(payload), map_location=map_location, weights_only=True)
    except Exception as e:  # a valid checksum but an unloadable payload
        raise CheckpointError(f"{path}: cannot unpickle checkpoint payload: {e}") from None


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
