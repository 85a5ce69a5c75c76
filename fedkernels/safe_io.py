"""Safe loading and saving of checkpoints and configs.

* :func:`save_checkpoint` writes atomically (a temporary file in the same directory, flushed and
  fsync'ed, then ``os.replace``; the directory is fsync'ed too). The file is a plain ``torch.save``
  archive followed by one checksum line (``FEDKERNELS-CKPT-v2 <sha256> <bytes>``): ``torch.load(path,
  weights_only=True)`` opens it as it is (zip readers ignore trailing bytes), and the checksum
  travels in the same file, so the atomic rename covers both.
* :func:`load_checkpoint` verifies the checksum line, then unpickles with
  ``torch.load(weights_only=True)``: only tensors and plain Python containers/values load; a
  pickle that would import or call anything else (``__reduce__`` gadgets) is refused without
  running it. Truncated or corrupted files raise :class:`CheckpointError` naming the problem.
  Files of the first format (``MAGIC`` header line, then the payload) are still read.
* :func:`load_config` reads YAML with ``yaml.safe_load`` (no arbitrary Python objects).

The simulator's checkpoints (:mod:`fedkernels.sim.checkpoint`) are written and read with these
functions; this module imports nothing from the layers above it.
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
from typing import Any, Dict

import torch

__all__ = ["save_checkpoint", "load_checkpoint", "load_config", "CheckpointError", "ConfigError", "MAGIC", "TRAILER"]

MAGIC = b"FEDKERNELS-CKPT-v1\n"  # the first format's header (read only)
TRAILER = b"FEDKERNELS-CKPT-v2"  # the checksum line after the torch.save archive


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


def _save(path: str, state: Dict[str, Any]) -> str:
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    trailer = b"\n" + TRAILER + f" {hashlib.sha256(payload).hexdigest()} {len(payload)}\n".encode()
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.write(trailer)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(d)
    return path


def _split(path: str, data: bytes):
    """(payload, sha256 hex, length) of a checkpoint file of either format."""
    if data.startswith(MAGIC):  # first format: header line, then the payload
        rest = data[len(MAGIC) :]
        nl = rest.find(b"\n")
        try:
            digest, length = rest[:nl].decode().split()
            return rest[nl + 1 :], digest, int(length)
        except (ValueError, UnicodeDecodeError):
            raise CheckpointError(f"{path}: corrupted checkpoint header") from None
    i = data.rfind(b"\n" + TRAILER + b" ")
    if i < 0:
        raise CheckpointError(
            f"{path} is not a fedkernels checkpoint (bad header) or is truncated: it has no checksum line"
        )
    line = data[i + 1 :]
    if not line.endswith(b"\n"):
        raise CheckpointError(f"{path}: truncated checkpoint (incomplete checksum line)")
    try:
        _, digest, length = line.decode("ascii").split()
        return data[:i], digest, int(length)
    except (ValueError, UnicodeDecodeError):
        raise CheckpointError(f"{path}: checksum mismatch (the checksum line is damaged)") from None


def _load(path: str, map_location="cpu") -> Dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from None
    payload, digest, length = _split(path, data)
    if len(payload) != length:
        raise CheckpointError(f"{path}: truncated checkpoint ({len(payload)} of {length} payload bytes)")
    if hashlib.sha256(payload).hexdigest() != digest:
        raise CheckpointError(f"{path}: checksum mismatch (the file is corrupted)")
    try:
        return torch.load(io.BytesIO(payload), map_location=map_location, weights_only=True)
    except Exception as e:  # a valid checksum but an unloadable payload
        raise CheckpointError(f"{path}: cannot unpickle checkpoint payload: {e}") from None


class ConfigError(ValueError):
    """A config file is missing, not valid YAML, or not a mapping."""


def save_checkpoint(obj: Dict[str, Any], path: str) -> str:
    """Atomically writes ``obj`` (tensors and plain Python values only) to ``path`` with a SHA-256
    checksum; returns ``path``. A crash mid-write leaves the previous file intact."""
    return _save(os.fspath(path), obj)


def load_checkpoint(path: str, map_location="cpu") -> Dict[str, Any]:
    """Reads a file written by :func:`save_checkpoint`; verifies the checksum and loads with
    ``weights_only=True``. Raises CheckpointError for a missing, truncated, corrupted, foreign
    or code-carrying file."""
    return _load(os.fspath(path), map_location=map_location)


def load_config(path: str) -> Dict[str, Any]:
    """A YAML mapping read with ``yaml.safe_load`` (``{}`` for an empty file)."""
    import yaml

    try:
        with open(os.fspath(path)) as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML (only plain data is allowed): {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config must be a YAML mapping, got {type(data).__name__}")
    return data
