"""CPU Gram kernel: its two paths against each other and against torch, by shape and thread count.

``gram`` on the CPU has two kernels (csrc/cpu/gram.cpp): ``bcast`` (clients staged transposed,
one element broadcast times vectors along the clients) and ``cols`` (vectors along the columns, one
horizontal sum per entry and sub-chunk). ``auto`` is what
``ops.gram`` runs (it picks one by shape); ``FEDKERNELS_GRAM_PATH`` forces one. Baselines: torch
``U.double() @ U.double().T`` (fp64 like ours, the conversion included) and fp32 ``U @ U.T``.

Times are the fastest single call over interleaved repeats (each ~20 ms of calls of each variant).
``GFMAs`` counts the useful multiply-adds of ``auto`` (K (K + 1) / 2 * d for the symmetric Gram,
k * K * d with rows=). Rows ``rows=perm`` are FedAWARE's call, ``gram(M, rows=participants)`` with
every client participating, in a shuffled order.

Run: python -m bench.cpu_gram [--quick] [--threads 1,2] [--out DIR|FILE.json]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from fedkernels import ops

from .common import add_out_argument, print_table, write_json

VAR = "FEDKERNELS_GRAM_PATH"
SHAPES = [
    (K, d) for K in (4, 10, 16, 32, 100, 1000) for d in (76, 10_000, 1_000_000) if K * d <= 100_000_000
]  # K = 1000, d = 1e6 (4 GB, 5e11 multiply-adds) left out
QUICK = [(4, 76), (16, 10_000), (100, 76), (1000, 76)]


def _with_path(path, fn):
    def run():
        if path is None:
            os.environ.pop(VAR, None)
        else:
            os.environ[VAR] = path
        return fn()

    return run


def _time_min(fns, repeats, min_time=0.02):
    """{name: the fastest single call (s)} over `repeats` interleaved rounds of ~min_time of calls
    each; each fn is a (setup, call) pair, the setup (the path variable) outside the timing. The
    minimum, not a mean: other processes share the cores, and a 2-thread call is as slow as its
    slower thread."""
    best = {k: float("inf") for k in fns}
    inner = {}
    for k, (setup, call) in fns.items():
        setup()
        call()  # warm-up
        t0 = time.perf_counter()
        call()
        inner[k] = max(1, int(min_time / max(time.perf_counter() - t0, 1e-9)))
    for _ in range(repeats):
        for k, (setup, call) in fns.items():
            setup()
            for _ in range(inner[k]):
                t0 = time.perf_counter()
                call()
                best[k] = min(best[k], time.perf_counter() - t0)
    return best


def bench_shape(K, d, rows, repeats):
    U = torch.randn(K, d)
    sym = rows is None
    fns = {
        name: (_with_path(path, lambda: None), lambda: ops.gram(U, rows=rows))
        for name, path in (("auto", None), ("bcast", "bcast"), ("cols", "cols"))
    }
    if sym:
        fns["torch_fp64"] = (lambda: None, lambda: (lambda V: V @ V.T)(U.double()))
        fns["torch_fp32"] = (lambda: None, lambda: U @ U.T)
    saved = os.environ.get(VAR)
    try:
        t = _time_min(fns, repeats)
        os.environ.pop(VAR, None)
        G = ops.gram(U, rows=rows)
    finally:
        os.environ.pop(VAR, None) if saved is None else os.environ.__setitem__(VAR, saved)
    R = U.double()[rows if rows is not None else slice(None)] @ U.double().T
    fma = (K * (K + 1) // 2 if sym else len(rows) * K) * d
    row = {
        "K": K,
        "d": d,
        "rows": "-" if sym else "perm",
        "threads": torch.get_num_threads(),
        **{f"{k}_ms": v * 1e3 for k, v in t.items()},
        "GFMAs": fma / t["auto"] / 1e9,
        "x_vs_cols": t["cols"] / t["auto"],
        "maxrel_err": float(((G - R).abs() / R.abs().max()).max()),
    }
    if sym:
        row["x_vs_torch_fp64"] = t["torch_fp64"] / t["auto"]
        row["x_vs_torch_fp32"] = t["torch_fp32"] / t["auto"]
    return row


def run(quick=False, threads=(1, 2)):
    shapes = QUICK if quick else SHAPES
    n0 = torch.get_num_threads()
    out = []
    try:
        for n in threads:
            torch.set_num_threads(n)
            for K, d in shapes:
                rep = 3 if K * K * d > 1e9 else 7
                out.append(bench_shape(K, d, None, rep))
                if K == 1000 and d == 76:
                    perm = torch.randperm(K, generator=torch.Generator().manual_seed(0))
                    out.append(bench_shape(K, d, perm, rep))
                print(".", end="", flush=True)
    finally:
        torch.set_num_threads(n0)
    print()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="four small shapes")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default: %(default)s)")
    add_out_argument(ap)
    a = ap.parse_args(argv)
    try:
        threads = [int(x) for x in a.threads.split(",") if x]
        if not threads or min(threads) < 1:
            raise ValueError
    except ValueError:
        ap.error(f"--threads: {a.threads!r} is not a comma-separated list of positive integers")
    load = os.getloadavg()
    rows = run(a.quick, threads)
    print_table(
        rows,
        [
            "K",
            "d",
            "rows",
            "threads",
            "auto_ms",
            "bcast_ms",
            "cols_ms",
            "torch_fp64_ms",
            "torch_fp32_ms",
            "GFMAs",
            "x_vs_cols",
            "x_vs_torch_fp64",
            "x_vs_torch_fp32",
            "maxrel_err",
        ],
    )
    extra = {
        "loadavg_1_5_15_min": {"before": load, "after": os.getloadavg()},
        "note": "min over interleaved repeats; other processes share this machine's cores (see loadavg), "
        "which hits the 2-thread rows hardest",
    }
    print("wrote", write_json("cpu-gram.json", rows, extra=extra, out=a.out))


if __name__ == "__main__":
    main()
