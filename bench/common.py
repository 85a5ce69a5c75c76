"""Timing and roofline helpers shared by the CPU benchmarks, and where their results go.

A benchmark writes its JSON result to ``runs/bench/`` under the current directory (untracked, like
the simulator's ``runs/``); the published results in ``bench/results/`` change only with an explicit
``--out bench/results`` (``--out`` takes a directory or a ``.json`` path: ``output_path``)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from typing import Callable, Dict, List

import torch

PUBLISHED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")  # the committed results
DEFAULT_OUT = os.path.join("runs", "bench")  # relative to the cwd


def add_out_argument(ap) -> None:
    """The one ``--out`` option of every benchmark script."""
    ap.add_argument(
        "--out",
        default=None,
        metavar="DIR|FILE.json",
        help="where the JSON result goes: a directory or a .json path (default: runs/bench/ "
        "under the current directory; `--out bench/results` updates the published results)",
    )


def output_path(out, name: str) -> str:
    """The file a result named ``name`` goes to for ``--out`` = ``out`` (None: the default folder);
    creates its directory."""
    out = DEFAULT_OUT if out is None else str(out)
    path = out if out.endswith(".json") else os.path.join(out, name)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    return path


def timeit(fn: Callable[[], object], repeats: int = 5, warmup: int = 1, min_time: float = 0.0) -> float:
    """Median wall time (s) of ``fn()`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    ts = []
    t_all = time.perf_counter()
    while len(ts) < repeats or (time.perf_counter() - t_all) < min_time:
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
        if len(ts) >= 50:
            break
    return statistics.median(ts)


def compare(
    fns: Dict[str, Callable[[], object]], repeats: int = 9, min_time: float = 0.02, warmup: int = 1
) -> Dict[str, Dict[str, float]]:
    """Times several functions *interleaved* (one sample of each per round), so that load from
    other processes hits all of them alike. Each sample loops a function until ``min_time`` has
    passed (at least once) and records the per-call time. Returns {name: {median_s, min_s, ...}}."""
    for f in fns.values():
        for _ in range(warmup):
            f()
    inner: Dict[str, int] = {}
    for k, f in fns.items():
        t0 = time.perf_counter()
        f()
        dt = time.perf_counter() - t0
        inner[k] = max(1, int(min_time / max(dt, 1e-9))) if dt < min_time else 1
    samples: Dict[str, List[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(inner[k]):
                f()
            samples[k].append((time.perf_counter() - t0) / inner[k])
    return {
        k: {"median_s": statistics.median(v), "min_s": min(v), "repeats": repeats, "inner": inner[k]}
        for k, v in samples.items()
    }


_COPY_BW = None


def copy_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """Measured memory bandwidth of a large tensor copy in bytes/s (read + write counted)."""
    global _COPY_BW
    if _COPY_BW is None:
        n = nbytes // 4
        src = torch.ones(n)
        dst = torch.empty(n)
        t = timeit(lambda: dst.copy_(src), repeats=repeats, warmup=2)
        _COPY_BW = 2 * n * 4 / t
    return _COPY_BW


def machine() -> Dict[str, object]:
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def print_table(rows: List[Dict[str, object]], cols: List[str]) -> None:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.3e}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    w = [max(len(c), *(len(x[i]) for x in cells)) if cells else len(c) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w[i]) for i, c in enumerate(cols)))
    for x in cells:
        print("  ".join(v.ljust(w[i]) for i, v in enumerate(x)))


def write_json(
    name: str, rows: List[Dict[str, object]], extra: Dict[str, object] | None = None, out: str | None = None
) -> str:
    """Writes ``rows`` (+ machine facts and the copy bandwidth) to ``output_path(out, name)``."""
    path = output_path(out, name)
    payload = {"machine": machine(), "copy_bandwidth_GBps": copy_bandwidth() / 1e9, "results": rows}
    if extra:
        payload.update(extra)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    return path


def passes_over_u(agg, K=None) -> int:
    """How many times one round of ``agg`` reads the K x d updates from a source (its declared ``passes(K)``:
    the NaN screen and the update's column-local reads and Gram passes; a per-client table's passes are not U)."""
    return sum(1 for p in agg.passes(K) if p.split(":")[-1] in ("sum", "gram"))
