"""Timing and copy-bandwidth helpers for the GC / fused-step benchmarks (bench/cpu_gc.py).

Kept separate from bench/common.py (written on another branch); the two can be unified later.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List

import torch


def timeit(fn: Callable[[], object], repeats: int = 11, warmup: int = 2, min_time: float = 0.0) -> Dict[str, float]:
    """Median / min wall time of ``fn()`` in seconds over ``repeats`` runs (after ``warmup`` runs).

    When a single call is shorter than ``min_time`` it is looped ``inner`` times per sample and the
    per-call time is reported, so tiny ops are not dominated by the timer.
    """
    for _ in range(warmup):
        fn()
    inner = 1
    if min_time > 0:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if dt < min_time:
            inner = max(1, int(min_time / max(dt, 1e-9)))
    samples: List[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner)
    return {"median_s": statistics.median(samples), "min_s": min(samples), "repeats": repeats, "inner": inner}


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 7) -> float:
    """Measured memory copy bandwidth in GB/s, counting read + write (2 * nbytes per copy)."""
    n = nbytes // 4
    src = torch.randn(n)
    dst = torch.empty_like(src)
    t = timeit(lambda: dst.copy_(src), repeats=repeats, warmup=2)
    return 2 * nbytes / t["median_s"] / 1e9


def compare(fns: Dict[str, Callable[[], object]], repeats: int = 9, min_time: float = 0.02,
            warmup: int = 1) -> Dict[str, Dict[str, float]]:
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
    return {k: {"median_s": statistics.median(v), "min_s": min(v), "repeats": repeats, "inner": inner[k]}
            for k, v in samples.items()}
