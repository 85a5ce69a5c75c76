"""A cache of decoded dataset files, so a repeat run does not decode the gz images again.

    x, = cached_decode(path, "idx", lambda p: (read_idx(p),))

The arrays a decoder returns for a source file are kept as ``.npy`` files in the cache directory
(``$FEDKERNELS_CACHE``, default ``~/.cache/fedkernels``; ``FEDKERNELS_CACHE=off`` disables it) under
``decoded/``, next to a JSON manifest holding the source's path, size and modification time, and each
array's shape, dtype and Adler-32 checksum. A hit needs the source unchanged and every checksum
right; anything else (missing, stale, truncated or corrupted file, unreadable manifest) decodes the
source again and rewrites the entry (written to temporary names, then renamed: a reader never
sees half an entry). A cache directory that cannot be written only costs the decode (logged once).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import zlib
from pathlib import Path
from typing import Callable, Optional, Sequence, Tuple

import numpy as np

log = logging.getLogger("fedkernels.sim")

__all__ = ["CACHE_ENV", "cache_dir", "cached_decode"]

CACHE_ENV = "FEDKERNELS_CACHE"
_VERSION = 1
_warned = set()


def cache_dir() -> Optional[Path]:
    """The decoded-data cache directory, or None when ``$FEDKERNELS_CACHE`` is ``off``/``0``/empty."""
    env = os.environ.get(CACHE_ENV)
    if env is not None:
        if env.strip().lower() in ("", "0", "off", "false", "no", "none"):
            return None
        return Path(env).expanduser() / "decoded"
    return Path.home() / ".cache" / "fedkernels" / "decoded"


def _checksum(a: np.ndarray) -> int:
    return zlib.adler32(memoryview(np.ascontiguousarray(a)).cast("B"))


def _entry(path: Path, tag: str) -> Tuple[Path, dict]:
    st = path.stat()
    src = {
        "path": str(path.resolve()),
        "size": int(st.st_size),
        "mtime_ns": int(st.st_mtime_ns),
        "tag": tag,
        "version": _VERSION,
    }
    key = hashlib.sha256(json.dumps(src, sort_keys=True).encode()).hexdigest()[:16]
    return Path(f"{path.name}-{tag}-{key}"), src


def _read(base: Path, src: dict) -> Optional[Tuple[np.ndarray, ...]]:
    man = base.with_name(base.name + ".json")
    if not man.is_file():
        return None
    try:
        meta = json.loads(man.read_text())
        if meta.get("source") != src:
            return None
        out = []
        for i, a in enumerate(meta["arrays"]):
            arr = np.load(base.with_name(f"{base.name}.{i}.npy"), allow_pickle=False)
            if list(arr.shape) != a["shape"] or str(arr.dtype) != a["dtype"] or _checksum(arr) != a["adler32"]:
                raise ValueError(f"array {i} does not match its manifest (shape, dtype or checksum)")
            out.append(arr)
        return tuple(out)
    except Exception as e:  # noqa: BLE001 - any damage: decode again
        log.warning("decoded-data cache %s is damaged (%s); decoding the source again", man, e)
        return None


def _write(base: Path, src: dict, arrays: Sequence[np.ndarray]) -> None:
    base.parent.mkdir(parents=True, exist_ok=True)
    metas = []
    for i, a in enumerate(arrays):
        final = base.with_name(f"{base.name}.{i}.npy")
        tmp = final.with_name(final.name + f".tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            np.save(f, np.ascontiguousarray(a), allow_pickle=False)
        os.replace(tmp, final)
        metas.append({"shape": list(a.shape), "dtype": str(a.dtype), "adler32": _checksum(a)})
    man = base.with_name(base.name + ".json")
    tmp = man.with_name(man.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"source": src, "arrays": metas}))
    os.replace(tmp, man)  # the manifest last: it is what makes the entry valid


def cached_decode(path, tag: str, decode: Callable[[Path], Tuple[np.ndarray, ...]]) -> Tuple[np.ndarray, ...]:
    """``decode(path)`` (a tuple of numpy arrays), read from the cache when the source is unchanged
    and the cached arrays check out; otherwise decoded and stored. ``tag`` names the decoder."""
    path = Path(path)
    root = cache_dir()
    if root is None:
        return tuple(decode(path))
    name, src = _entry(path, tag)
    base = root / name
    hit = _read(base, src)
    if hit is not None:
        return hit
    arrays = tuple(decode(path))
    try:
        _write(base, src, arrays)
    except OSError as e:
        if str(root) not in _warned:
            _warned.add(str(root))
            log.info("decoded-data cache %s is not writable (%s); decoding every run (set %s)", root, e, CACHE_ENV)
    return arrays
