"""CPU benchmark of one FedECADO backward-Euler attempt (spec fedecado.md §5.2, §5.3(a)).

* fused: ops.fedecado_be_step into reused output buffers (what central_round does: one pass over d,
  no K x d temporaries), through fedecado.be_step(solver="fused", out=...).
* torch: the previous path, fedecado.be_step(solver="auto") = torch composition (RHS, LTE terms)
  around the native ops.arrowhead_solve, with its K x d temporaries.
Shapes: K in {5, 10, 32}, d in {1e5, 1e6} (fp32); FedECADO's sizes K in {40, 100}, d = 1e6 + 1 (fused
only: the torch composition's K x d temporaries are 400 MB each at K = 100); and K = 1000, d in {64, 76, 80}
(whether the time per element is flat in d when d is not a multiple of the vector width). Floor: 16 (K + 1) d
bytes (reads xc, xc0, S_off, U, Icur, Ik; writes x', I') against the measured copy bandwidth.
Threads {1, 2} (--threads), the copy bandwidth measured at each thread count.
Run: python -m bench.cpu_becado [--quick] [--threads 1 2] [--out DIR]; writes cpu-becado.json (bench/common.py).
"""

from __future__ import annotations

import argparse
import os

import torch

from fedkernels.algorithms.fedecado import solver as fe

from .common import add_out_argument, print_table, timeit, write_json


def _copy_bw() -> float:
    """Copy bandwidth (bytes/s, read + write counted) at the current thread count (not cached)."""
    n = (256 << 20) // 4
    src, dst = torch.ones(n), torch.empty(n)
    return 2 * n * 4 / timeit(lambda: dst.copy_(src), repeats=5, warmup=2)


def _inputs(K: int, d: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(K * 7 + d)
    rn = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    T = torch.rand(K, generator=g, dtype=torch.float64) + 0.5
    tl, dt, L = 0.1, 0.05, 1.0
    ig = 1.0 / (1.0 / dt + torch.rand(K, generator=g, dtype=torch.float64))
    return (rn(d), rn(K, d), rn(d), rn(K, d), rn(K, d), fe.theta(T, tl + dt), fe.theta(T, tl), ig, dt, L, rn(d))


def bench_one(K: int, d: int, repeats: int, bw: float, with_torch: bool = True):
    a = _inputs(K, d)
    out = (torch.empty(d), torch.empty(K, d))
    fused = lambda: fe.be_step(*a, solver="fused", out=out)  # noqa: E731
    xf, If, lcf, lif = fused()
    t_f = timeit(fused, repeats=repeats, warmup=1)
    nbytes = 16 * (K + 1) * d
    row = {
        "op": "be_step",
        "K": K,
        "d": d,
        "dtype": "float32",
        "threads": torch.get_num_threads(),
        "fused_ms": t_f * 1e3,
        "ns_per_element": t_f * 1e9 / (K * d),
        "GBps": nbytes / t_f / 1e9,
        "copy_GBps": bw / 1e9,
        "pct_copy_bw": 100 * nbytes / t_f / bw,
        "lte_fused": [lcf, lif],
    }
    if with_torch:
        old = lambda: fe.be_step(*a, solver="auto")  # noqa: E731
        xt, It, lct, lit = old()
        t_t = timeit(old, repeats=max(3, repeats // 2), warmup=1)
        row.update(
            {
                "torch_ms": t_t * 1e3,
                "speedup_vs_torch": t_t / t_f,
                "torch_pct_copy_bw": 100 * nbytes / t_t / bw,
                "max_abs_diff_vs_torch": max(float((xf - xt).abs().max()), float((If - It).abs().max())),
                "lte_torch": [lct, lit],
            }
        )
    return row


def run(quick: bool = False, threads=(1, 2)):
    rep = 5 if quick else 9
    rows = []
    t0 = torch.get_num_threads()
    try:
        for th in threads:
            torch.set_num_threads(th)
            bw = _copy_bw()
            for d in (100_000, 1_000_000):
                for K in (5, 10) + (() if quick else (32,)):
                    rows.append(bench_one(K, d, rep, bw))
            for K in () if quick else (40, 100):
                rows.append(bench_one(K, 1_000_001, 3, bw, with_torch=False))
            for d in (64, 76, 80):
                rows.append(bench_one(1000, d, 20 * rep, bw))
    finally:
        torch.set_num_threads(t0)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    add_out_argument(ap)
    a = ap.parse_args(argv)
    load = os.getloadavg()[0]
    rows = run(a.quick, tuple(a.threads))
    print(f"load average before the run: {load:.2f} (the machine's cores are shared: timings are noisy)")
    print_table(
        rows,
        [
            "threads",
            "K",
            "d",
            "fused_ms",
            "ns_per_element",
            "torch_ms",
            "speedup_vs_torch",
            "GBps",
            "pct_copy_bw",
            "torch_pct_copy_bw",
            "copy_GBps",
            "max_abs_diff_vs_torch",
        ],
    )
    path = write_json(
        "cpu-becado.json", rows, {"bytes_formula": "16 (K + 1) d (fp32)", "loadavg_1min": load}, out=a.out
    )
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
