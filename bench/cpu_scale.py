"""Beyond one process on this CPU: sharded aggregation vs number of ranks, and a model larger than
comfortable in memory aggregated from disk in bounded memory.

    python -m bench.cpu_scale [--quick] [--big-d 100000000] [--big-k 32] [--dir /tmp]

1. ``ranks``: FedAvg and Kuramoto (mode S) through ``ShardedAggregator`` on 1, 2 and 4 gloo
   processes (loopback); each rank holds only its [K, d/world] slice. Time = the slowest rank's
   median; throughput = bytes of U / time.
2. ``disk``: a K x d float32 update matrix written to a raw file, then aggregated in a fresh process
   from an ``np.memmap`` (chunk pages released after use) by the aggregators over that source:
   ``build("fedavg").aggregate(x, src, n)`` (one pass) and ``build("kuramoto")`` (Gram pass + sum
   pass). Peak RSS from ``resource.getrusage`` (ru_maxrss, includes the [d] global and result vectors).
Writes cpu-scale.json (``--out``; bench/common.py).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from bench.common import add_out_argument, passes_over_u, print_table, write_json


# ---- 1. ranks ------------------------------------------------------------------------------------------
def _rank_worker(rank, world, init_file, d, K, repeats, out_file):
    import torch.distributed as dist
    from fedkernels import algorithms
    from fedkernels.distributed import ShardedAggregator

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    res = {}
    for name, opts in (("fedavg", {}), ("kuramoto", {"mode": "S"})):
        sa = ShardedAggregator(algorithms.build(name, **opts))
        sa.setup(d=d)
        w = sa.hi - sa.lo
        g = torch.Generator().manual_seed(rank)
        U = torch.randn(K, w, generator=g)
        x = torch.zeros(w)
        n = list(range(10, 10 + K))
        ts = []
        for i in range(repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            sa.aggregate(x, U, n)
            dist.barrier()
            if i:
                ts.append(time.perf_counter() - t0)
        res[name] = statistics.median(ts)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


def bench_ranks(d, K, worlds, repeats):
    import torch.multiprocessing as mp

    rows = []
    for world in worlds:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "out.json")
            mp.spawn(_rank_worker, args=(world, os.path.join(tmp, "init"), d, K, repeats, out), nprocs=world)
            res = json.load(open(out))
        for name, t in res.items():
            rows.append(
                {
                    "part": "ranks",
                    "method": name,
                    "world": world,
                    "d": d,
                    "K": K,
                    "time_s": t,
                    "GBps": K * d * 4 / t / 1e9,
                }
            )
    base = {r["method"]: r["time_s"] for r in rows if r["world"] == 1}
    for r in rows:
        r["speedup_vs_1"] = base.get(r["method"], r["time_s"]) / r["time_s"]
    return rows


# ---- 2. disk -------------------------------------------------------------------------------------------
def write_matrix(path, K, d, chunk=1 << 22):
    g = torch.Generator().manual_seed(0)
    common = torch.randn(chunk, generator=g).numpy()
    noise = torch.randn(chunk, generator=g).numpy()
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for k in range(K):
            for a in range(0, d, chunk):
                w = min(chunk, d - a)
                row = (0.05 * common[:w] + 0.1 * np.roll(noise, 7919 * k + a // chunk)[:w]).astype(np.float32)
                f.write(row.tobytes())
    return time.perf_counter() - t0


def _disk_child(path, K, d, chunk_cols, method):
    """Runs in a fresh process: one streamed aggregation from the memmap; prints a JSON line."""
    from fedkernels import algorithms
    from fedkernels.sources import ChunkedUpdates

    mm = np.memmap(path, dtype=np.float32, mode="r+", shape=(K, d))  # r+: chunks used without a copy
    src = ChunkedUpdates(mm, chunk_cols=chunk_cols)
    x = torch.zeros(d)
    n = list(range(10, 10 + K))
    agg = algorithms.build(method)  # the aggregator itself, over the source
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    agg.aggregate(x, src, n)
    passes = passes_over_u(agg, K)  # the method's own declaration (fedavg: 1; kuramoto: 2)
    t = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        json.dumps(
            {
                "time_s": t,
                "passes": passes,
                "peak_rss_MB": rss / 1024,
                "rss_before_MB": rss0 / 1024,
                "staging_MB": src.staging_bytes / 2**20,
            }
        )
    )


def bench_disk(d, K, directory, chunk_cols):
    path = os.path.join(directory, f"fedkernels_U_{K}x{d}.f32")
    rows = []
    try:
        tw = write_matrix(path, K, d)
        size = K * d * 4
        for method in ("fedavg", "kuramoto"):
            cmd = [
                sys.executable,
                "-c",
                f"from bench.cpu_scale import _disk_child; _disk_child({path!r}, {K}, {d}, {chunk_cols}, {method!r})",
            ]
            out = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                check=True,
                cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            )
            r = json.loads(out.stdout.strip().splitlines()[-1])
            r.update(
                part="disk",
                method=method,
                d=d,
                K=K,
                file_GB=size / 1e9,
                write_s=tw,
                GBps=r["passes"] * size / r["time_s"] / 1e9,
                chunk_cols=chunk_cols,
                matrix_vs_peak_rss=size / (r["peak_rss_MB"] * 2**20),
            )
            rows.append(r)
    finally:
        if os.path.exists(path):
            os.remove(path)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rank-d", type=int, default=8_000_000)
    ap.add_argument("--rank-k", type=int, default=16)
    ap.add_argument("--big-d", type=int, default=100_000_000)
    ap.add_argument("--big-k", type=int, default=32)
    ap.add_argument("--chunk-cols", type=int, default=1 << 20)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--skip-disk", action="store_true")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.rank_d, args.big_d, args.big_k = 1_000_000, 5_000_000, 8
    rows = bench_ranks(args.rank_d, args.rank_k, (1, 2, 4), 3 if args.quick else 5)
    print_table(rows, ["method", "world", "d", "K", "time_s", "GBps", "speedup_vs_1"])
    if not args.skip_disk:
        disk = bench_disk(args.big_d, args.big_k, args.dir, args.chunk_cols)
        print_table(disk, ["method", "d", "K", "file_GB", "time_s", "passes", "GBps", "peak_rss_MB", "staging_MB"])
        rows += disk
    path = write_json(
        "cpu-scale.json",
        rows,
        {
            "note": "ranks: gloo on loopback, each rank holds its [K, d/world] "
            "slice; disk: np.memmap source, fresh process per method"
        },
        out=args.out,
    )
    print("wrote", path)


if __name__ == "__main__":
    main()
