"""Per-client state tables kept in a file: an N x d table (FedAWARE's momenta, SCAFFOLD / FedPVR's control
variates c_i) as a raw row-major file mapped on the host (``torch.from_file``, shared: writes go to the
file), for tables larger than the device or the RAM. Used by ``fedaware/`` (``momentum_file=``) and
``control_variates.py`` (``control_file=``).

* :func:`check_path`: the option's value (a path whose folder exists; the table is a host mapping, so
  the method's device option for it must be None or the CPU), one-line ValueError otherwise.
* :func:`table_file`: the [N, d] mapping, a new file created as zeros with its blocks reserved
  (``posix_fallocate``: a full disk is an error at creation, not a crash in the middle of a round) and,
  when it fits in memory, its pages mapped up front (:func:`page_in`).
* A marker ``PATH.state`` holds ``"<version> updating|done"``: the version counts the completed updates
  of the table; :func:`updating` / :func:`updated` write it around each update, so a process that died
  while writing the table leaves "updating" behind.
* ``state_dict`` holds a reference (:func:`reference`: path, shape, dtype, version), not an N x d copy;
  :func:`reopen` checks the file's size and marker against it (another version: the table changed after
  that state was saved; "updating": an update never finished) and maps it again.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Dict, Optional, Tuple

import torch

from .._memory import available_bytes

MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault a range in, writable, in one call
PAGE_IN_FRACTION = 0.5  # a new table is paged in when it takes at most this share of the available memory


def check_path(name: str, option: str, path: Any, device: Any = None, device_option: str = "") -> Optional[str]:
    """``option``'s value: None, or a file path whose folder exists (a host mapping: ``device`` must be None
    or the CPU)."""
    if path is None:
        return None
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ValueError(f"{name}: {option} must be a file path or None, got {path!r}")
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{name}: {option} {path!r}: folder {folder!r} does not exist")
    if os.path.isdir(path):
        raise ValueError(f"{name}: {option} {path!r} is a folder, expected a file path")
    if device is not None and torch.device(device).type != "cpu":
        raise ValueError(
            f"{name}: {option} keeps the table in a host mapping of the file, so {device_option} "
            f"must be None or 'cpu', got {device!r}"
        )
    return path


def table_file(
    path: str, N: int, d: int, dtype: torch.dtype, exist_ok: bool = True, what: str = "table file"
) -> torch.Tensor:
    """An [N, d] table of ``dtype`` mapped from the raw file ``path``. A missing file is created as zeros
    with its blocks reserved; an existing one (only with ``exist_ok``) must have exactly N * d * itemsize
    bytes."""
    N, d = int(N), int(d)
    need = N * d * torch.empty(0, dtype=dtype).element_size()
    created = not os.path.exists(path)
    if not created:
        if not exist_ok:
            raise ValueError(
                f"{what} {path!r} already exists: remove it, or load the aggregator's state_dict to "
                "continue from the table it holds"
            )
        if os.path.getsize(path) != need:
            raise ValueError(
                f"{what} {path!r} has {os.path.getsize(path)} bytes, expected {need} for N={N} x d={d} {dtype}"
            )
    else:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            if need:
                os.posix_fallocate(fd, 0, need)
        except OSError as e:
            os.close(fd)
            os.remove(path)
            raise ValueError(f"{what} {path!r}: cannot reserve {need} bytes for N={N} x d={d} {dtype}: {e}") from None
        os.close(fd)
    if not need:
        return torch.zeros(N, d, dtype=dtype)
    table = torch.from_file(path, shared=True, size=N * d, dtype=dtype).view(N, d)
    if created:
        page_in(table)
    return table


def page_in(table: torch.Tensor) -> bool:
    """Maps every page of a new (zero) file table, writable, in one ``madvise(MADV_POPULATE_WRITE)``
    call, when the table takes at most PAGE_IN_FRACTION of the available memory (a larger one would be
    evicted before its round reads it). Without it, a round's first strided read and write of each
    4 KB page of the table are two page faults. On the 2-core VM (load 1), a streamed FedAWARE round
    (K = N = 16, d = 1e8, bf16 file and table, 16 MB chunks), three interleaved pairs: 16.3-17.3 s with
    the page-in (7.8-10.5 s system CPU, 75-80K page faults), 17.9-21.0 s without (11.6-15.3 s, 145-205K).
    Returns whether it paged in (False: too large, or a kernel without the call; the pages then fault
    in as before, with the same contents)."""
    nbytes = table.numel() * table.element_size()
    free = available_bytes("cpu")
    if free is None or nbytes > PAGE_IN_FRACTION * free:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc.madvise(table.data_ptr(), nbytes, MADV_POPULATE_WRITE) == 0
    except (OSError, AttributeError):
        return False


def _write_marker(path: str, version: int, status: str) -> None:
    tmp = f"{path}.state.tmp"
    with open(tmp, "w") as f:
        f.write(f"{version} {status}\n")
    os.replace(tmp, f"{path}.state")


def updating(path: Optional[str], version: int) -> None:
    """Before an update that makes ``version`` (no-op for a table that is not a file)."""
    if path is not None:
        _write_marker(path, version, "updating")


def updated(path: Optional[str], version: int) -> None:
    """After the update that made ``version`` (or, with the previous version, after one that wrote nothing)."""
    if path is not None:
        _write_marker(path, version, "done")


def read_marker(path: str) -> Optional[Tuple[int, str]]:
    """(version, status) of the table file ``path``, or None when it has no marker."""
    try:
        with open(f"{path}.state") as f:
            v, status = f.read().split()
        return int(v), status
    except (OSError, ValueError):
        return None


def reference(path: str, table: torch.Tensor, version: int) -> Dict[str, Any]:
    """What ``state_dict`` holds for a file table (plain values: ``torch.load(weights_only=True)`` opens it)."""
    return {
        "file": os.path.abspath(path),
        "shape": list(table.shape),
        "dtype": str(table.dtype).replace("torch.", ""),
        "version": int(version),
    }


def is_reference(v: Any) -> bool:
    return isinstance(v, dict) and "file" in v and "version" in v


def reopen(what: str, option: str, ref: Dict[str, Any], own: Optional[str]) -> Tuple[torch.Tensor, str, int]:
    """(table, path, version) of the file a state's reference names, after checking it: the same path as
    the aggregator's own ``option`` (if set), the marker at the reference's version and done, the size."""
    path, v = ref.get("file"), ref.get("version")
    dtype = getattr(torch, str(ref.get("dtype")), None)
    shape = ref.get("shape")
    if (
        not isinstance(path, str)
        or not isinstance(dtype, torch.dtype)
        or not isinstance(v, int)
        or not (isinstance(shape, (list, tuple)) and len(shape) == 2)
    ):
        raise ValueError(f"{what}: a table reference must hold file, shape, dtype and version, got {ref!r:.200}")
    if own is not None and os.path.abspath(own) != path:
        raise ValueError(f"{what}: the state's table is {path!r}, this aggregator's {option} is {own!r}")
    if not os.path.isfile(path):
        raise ValueError(f"{what}: the state's table {path!r} does not exist")
    mark = read_marker(path)
    if mark != (v, "done"):
        now = "has no marker" if mark is None else f"is at version {mark[0]} ({mark[1]})"
        raise ValueError(
            f"{what}: {option} {path!r} {now}, the state expects version {v} (done): the table changed "
            "after this state was saved, or an update never finished"
        )
    return table_file(path, *shape, dtype, exist_ok=True, what=f"{what}: {option}"), path, v


# ---- an aggregator's state_dict with a file table -----------------------------------------------------------
# The aggregator keeps the table in attribute ``attr``, its file path in ``option`` (None: not a file) and the
# count of completed updates in ``table_version``.
def state_dict(agg: Any, base_state_dict: Any, attr: str, option: str) -> Dict[str, Any]:
    """``base_state_dict()`` with the file table ``attr`` as a :func:`reference` instead of a copy."""
    table, path = getattr(agg, attr), getattr(agg, option)
    if path is None or table is None:
        return base_state_dict()
    setattr(agg, attr, None)
    try:
        st = base_state_dict()
    finally:
        setattr(agg, attr, table)
    st[attr] = reference(path, table, agg.table_version)
    return st


def load_state_dict(agg: Any, base_load: Any, state: Dict[str, Any], attr: str, option: str) -> None:
    """``base_load(state)``; a referenced table file is reopened (:func:`reopen`); an in-memory table
    loaded into an aggregator with a file ``option`` is written to that (new) file."""
    what = f"{agg.name}.load_state_dict"
    ref, own = state.get(attr), getattr(agg, option)
    if not is_reference(ref):
        base_load(state)
        table = getattr(agg, attr)
        if own is not None and table is not None:
            f = table_file(own, *table.shape, table.dtype, exist_ok=False, what=f"{agg.name}: {option}")
            setattr(agg, attr, f.copy_(table))
            agg.table_version = 0
            updated(own, 0)
        return
    table, path, v = reopen(what, option, ref, own)
    base_load(dict(state, **{attr: None}))
    setattr(agg, attr, table)
    setattr(agg, option, path)
    agg.table_version = v
