"""Safe loading and saving of checkpoints and configs.

* :func:`save_checkpoint` writes atomically (a temporary file in the same directory, flushed and
  fsync'ed, then ``os.replace``; the directory is fsync'ed too) with a SHA-256 checksum of the
  payload stored in the file header.
* :func:`load_checkpoint` verifies the header and checksum, then unpickles with
  ``torch.load(weights_only=True)``: only tensors and plain Python containers/values load; a
  pickle that would import or call anything else (``__reduce__`` gadgets) is refused without
  running it. Truncated or corrupted files raise :class:`CheckpointError` naming the problem.
* :func:`load_config` reads YAML with ``yaml.safe_load`` (no arbitrary Python objects).

The file format and the atomic writer are those of :mod:`fedkernels.sim.checkpoint` (the
simulator's checkpoints); this module is the library-level entry point and reuses that code.
"""
from __future__ import annotations

import os
from typing import Any, Dict

from .sim.checkpoint import MAGIC, CheckpointError
from .sim.checkpoint import load as _load
from .sim.checkpoint import save as _save

__all__ = ["save_checkpoint", "load_checkpoint", "load_config", "CheckpointError", "ConfigError", "MAGIC"]


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
