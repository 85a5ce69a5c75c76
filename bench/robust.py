"""The robust rules on the CPU: the selection op (``ops.order_mean`` / ``ops.closest_mean``) against the
one-read floor, plain torch and Flower's aggregate functions, and the registered robust / server-optimiser
methods against their natural baselines, in one interleaved run (bench/common.compare).

At K = 10 and 100 clients of d = 11.2M parameters (ResNet-18; ``--d`` for a smaller quick run):

* op rows: the median (``order_mean(U, (K-1)//2, K//2+1)``), the trimmed mean (beta = 0.1) and Bulyan's
  beta-closest mean (beta = K - 4f, f = K // 10) against the **floor** (``ops.weighted_sum`` on the same U:
  one read of U), ``torch.median(U, 0)``, a ``torch.sort`` trimmed mean (a sorted K x d copy) and
  Flower's ``aggregate_median`` / ``aggregate_trimmed_avg`` (on NumPy lists, one array per client, as
  Flower takes them). Flower's ``aggregate_krum`` (``to_keep=0``: Krum, returns the picked client's arrays;
  ``to_keep=K // 2``: Multi-Krum, their weighted average) and ``aggregate_bulyan`` (K^2 ``np.linalg.norm``
  of flattened copies in a Python loop) run on the same lists (Bulyan only up to K = 20: at K = 100 it is
  theta = 80 Krum rounds, about a minute per call at d = 200k).
* method rows: one whole ``aggregate`` round of every method registered among median, trimmed_mean, krum
  (f = 1), multi-krum (krum, m = K // 2), bulyan, geometric_median, centered_clip, fedadam, fedyogi and
  fedadagrad (methods that are not registered are skipped), krum against ``ops.gram``'s time and
  fedadam/yogi/adagrad against fedavg's aggregate.

Each row has the wall time (``ms``, median of the interleaved samples) and the process CPU time per call
(``cpu_ms``: user + system time of all threads, so with one thread (``--threads 1``) a load-independent
check of the wall ratios on a shared machine); each K's rows record the load average at its start and end.

The torch and Flower baselines sort or stack copies of U (several K x d temporaries): where K x d exceeds
``--baseline-elems`` (default 2.5e8) they run on the first ``baseline-elems / K`` columns and their time is
scaled to d (linear in d: every column is independent); the row says so (``baseline_d``).

Targets (2-core CPU): median and trimmed mean <= 3x the floor at K = 10 and <= 5x at K = 100, and >= 5x
faster than torch.median(U, 0); Krum / Multi-Krum <= 1.3x the Gram's time; FedAdam/Yogi/Adagrad <= 1.3x
FedAvg's aggregate; each >= 10x faster than Flower's. Writes runs/bench/robust.json (``--out``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.common import add_out_argument, compare, print_table, write_json  # noqa: E402
from bench.cpu_hostwork import spec_of  # noqa: E402
from fedkernels import algorithms, ops  # noqa: E402
from fedkernels.ops.select import median_bounds, trim_bounds  # noqa: E402

RESNET18_D = 11_220_132
KRUM_F = 1  # f of the krum / multi-krum / bulyan rows and of Flower's aggregate_krum / aggregate_bulyan
# (row label, registered name, options; "K//2" stands for K // 2)
METHODS = [
    ("median", "median", {}),
    ("trimmed_mean", "trimmed_mean", {"beta": 0.1}),
    ("krum", "krum", {"f": KRUM_F}),
    ("multi-krum", "krum", {"f": KRUM_F, "m": "K//2"}),
    ("bulyan", "bulyan", {"f": KRUM_F}),
    ("geometric_median", "geometric_median", {}),
    ("centered_clip", "centered_clip", {}),
    ("fedadam", "fedadam", {}),
    ("fedyogi", "fedyogi", {}),
    ("fedadagrad", "fedadagrad", {}),
]


def _flower():
    try:
        from flwr.server.strategy import aggregate as fl

        return fl
    except Exception:  # pragma: no cover - flwr is optional
        return None


def _method_round(
    label: str, name: str, opts: Dict[str, Any], U: torch.Tensor, x0: torch.Tensor
) -> Optional[Callable[[], Any]]:
    """One aggregate round of a registered method on U (None when ``name`` is not registered)."""
    if name not in algorithms.available():
        return None
    K, d = U.shape
    o = {k: (K // 2 if v == "K//2" else v) for k, v in opts.items()}
    agg = algorithms.build(name, **o)
    agg.setup(spec_of([(d,)]), num_clients=K, global_flat=x0)
    n = [float(100 + 7 * k) for k in range(K)]
    ids = list(range(K))
    payloads = [{} for _ in range(K)]

    def run():
        return agg.aggregate(x0, U, n, ids, payloads)

    run()  # the first round allocates the method's state
    return run


def bench(K: int, d: int, baseline_elems: float, repeats: int, flower: bool) -> List[Dict[str, Any]]:
    g = torch.Generator().manual_seed(K)
    U = torch.randn(K, d, generator=g) * 1e-3
    x0 = torch.randn(d, generator=g) * 0.1
    coef = torch.full((K,), 1.0 / K, dtype=torch.float64)
    lo_m, hi_m = median_bounds(K)
    lo_t, hi_t = trim_bounds(K, 0.1)
    f = max(1, K // 10)
    beta = K - 4 * f
    db = int(min(d, baseline_elems // K))
    Ub = U[:, :db]
    scale = d / db
    fns: Dict[str, Callable[[], Any]] = {
        "floor:weighted_sum": lambda: ops.weighted_sum(U, coef),
        "op:median": lambda: ops.order_mean(U, lo_m, hi_m),
        "op:trimmed_mean": lambda: ops.order_mean(U, lo_t, hi_t),
        "op:closest_mean": lambda: ops.closest_mean(U, beta),
        "op:gram": lambda: ops.gram(U),
        "torch:median": lambda: torch.median(Ub, 0),
        "torch:sort_trimmed": lambda: torch.sort(Ub, 0).values[lo_t:hi_t].mean(0),
    }
    fl = _flower() if flower else None
    if fl is not None:
        nd = [([Ub[k].numpy()], 1) for k in range(K)]
        fns["flower:aggregate_median"] = lambda: fl.aggregate_median(nd)
        fns["flower:aggregate_trimmed_avg"] = lambda: fl.aggregate_trimmed_avg(nd, 0.1)
        fns["flower:aggregate_krum"] = lambda: fl.aggregate_krum(nd, KRUM_F, 0)
        fns["flower:aggregate_multi_krum"] = lambda: fl.aggregate_krum(nd, KRUM_F, K // 2)
        if 4 * KRUM_F + 3 <= K <= 20:  # theta Krum rounds of K^2 norms each: minutes per call at K = 100
            fns["flower:aggregate_bulyan"] = lambda: fl.aggregate_bulyan(list(nd), KRUM_F, fl.aggregate_krum, to_keep=0)
    skipped = []
    for label, name, opts in METHODS:
        run = _method_round(label, name, opts, U, x0)
        if run is None:
            skipped.append(label)
        else:
            fns["method:" + label] = run
    fedavg = _method_round("fedavg", "fedavg", {}, U, x0)
    if fedavg is not None:
        fns["method:fedavg"] = fedavg
    cpu: Dict[str, List[float]] = {k: [] for k in fns}
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    res = compare({k: _cpu_timed(f, cpu[k]) for k, f in fns.items()}, repeats=repeats, min_time=0.0, warmup=0)
    wall = time.perf_counter() - t0
    load1 = os.getloadavg()
    scales = {k: scale if k.split(":")[0] in ("torch", "flower") else 1.0 for k in fns}
    ms = {k: v["median_s"] * 1e3 * scales[k] for k, v in res.items()}
    cpu_ms = {k: statistics.median(v) * 1e3 * scales[k] for k, v in cpu.items()}
    floor = ms["floor:weighted_sum"]
    rows = []
    for k, v in ms.items():
        kind, name = k.split(":", 1)
        row: Dict[str, Any] = {
            "K": K,
            "d": d,
            "case": k,
            "ms": v,
            "cpu_ms": cpu_ms[k],
            "x_floor": v / floor,
            "baseline_d": db if kind in ("torch", "flower") else d,
        }
        if k == "op:median":
            row["torch_median_over_op"] = ms["torch:median"] / v
            if "flower:aggregate_median" in ms:
                row["flower_over_op"] = ms["flower:aggregate_median"] / v
        if k == "op:trimmed_mean":
            row["torch_sort_over_op"] = ms["torch:sort_trimmed"] / v
            if "flower:aggregate_trimmed_avg" in ms:
                row["flower_over_op"] = ms["flower:aggregate_trimmed_avg"] / v
        if kind == "method":
            if name in ("krum", "multi-krum"):
                row["x_gram"] = v / ms["op:gram"]
                row["cpu_x_gram"] = cpu_ms[k] / cpu_ms["op:gram"]
                fk = "flower:aggregate_krum" if name == "krum" else "flower:aggregate_multi_krum"
                if fk in ms:
                    row["flower_over_method"] = ms[fk] / v
                    row["cpu_flower_over_method"] = cpu_ms[fk] / cpu_ms[k]
            if name in ("fedadam", "fedyogi", "fedadagrad") and "method:fedavg" in ms:
                row["x_fedavg"] = v / ms["method:fedavg"]
            if name == "bulyan" and "flower:aggregate_bulyan" in ms:
                row["flower_over_method"] = ms["flower:aggregate_bulyan"] / v
                row["cpu_flower_over_method"] = cpu_ms["flower:aggregate_bulyan"] / cpu_ms[k]
            if name in ("median", "trimmed_mean"):
                fk = "flower:aggregate_median" if name == "median" else "flower:aggregate_trimmed_avg"
                if fk in ms:
                    row["flower_over_method"] = ms[fk] / v
        rows.append(row)
    rows.append({"K": K, "d": d, "case": "skipped_methods", "skipped": skipped, "wall_s": wall})
    rows.append({"K": K, "d": d, "case": "load", "loadavg_start": load0, "loadavg_end": load1})
    return rows


def _cpu_timed(fn: Callable[[], Any], into: List[float]) -> Callable[[], Any]:
    """``fn`` that also appends each call's process CPU time (s) to ``into``."""

    def run():
        c0 = time.process_time()
        r = fn()
        into.append(time.process_time() - c0)
        return r

    return run


def krum_parts(K: int, d: int, repeats: int) -> List[Dict[str, Any]]:
    """Where a Krum / Multi-Krum round's time goes: its parts timed alone, interleaved with the whole
    rounds, the Gram and the floor (wall and CPU time per call; ``--threads 1`` for load-independent CPU
    times): the screened Gram pass, the runner's screen of the global model, the host scoring on the
    K x K distances and the final sum over the m picked rows into a new model (``result_vector``)."""
    from fedkernels._memory import new_vector
    from fedkernels.algorithms.robust.common import krum_scores, sq_distances

    g = torch.Generator().manual_seed(K)
    U = torch.randn(K, d, generator=g) * 1e-3
    x0 = torch.randn(d, generator=g) * 0.1
    G = ops.gram(U)

    def final_sum(m: int) -> Callable[[], Any]:
        rows, w = torch.arange(m), torch.full((m,), 1.0 / m, dtype=torch.float64)
        return lambda: ops.weighted_sum(U, w, base=x0, rows=rows, out=new_vector(d, x0.dtype, x0.device))

    fns: Dict[str, Callable[[], Any]] = {
        "floor:weighted_sum": lambda: ops.weighted_sum(U, torch.full((K,), 1.0 / K, dtype=torch.float64)),
        "op:gram": lambda: ops.gram(U),
        "part:gram_screened": lambda: ops.gram_screened(U),
        "part:screen_global": lambda: ops.finite_rows(x0.unsqueeze(0)),
        "part:host_scores": lambda: torch.sort(krum_scores(sq_distances(G), KRUM_F), stable=True),
        "part:final_sum_m1": final_sum(1),
        f"part:final_sum_m{K // 2}": final_sum(K // 2),
    }
    for label, name, opts in METHODS[2:4]:
        run = _method_round(label, name, opts, U, x0)
        if run is not None:
            fns["method:" + label] = run
    cpu: Dict[str, List[float]] = {k: [] for k in fns}
    load0 = os.getloadavg()
    res = compare({k: _cpu_timed(f, cpu[k]) for k, f in fns.items()}, repeats=repeats, min_time=0.0, warmup=1)
    gram_ms, gram_cpu = res["op:gram"]["median_s"] * 1e3, statistics.median(cpu["op:gram"]) * 1e3
    rows = []
    for k, v in res.items():
        ms, cms = v["median_s"] * 1e3, statistics.median(cpu[k]) * 1e3
        rows.append(
            {"K": K, "d": d, "case": k, "ms": ms, "cpu_ms": cms, "x_gram": ms / gram_ms, "cpu_x_gram": cms / gram_cpu}
        )
    rows.append({"K": K, "d": d, "case": "load", "loadavg_start": load0, "loadavg_end": os.getloadavg()})
    return rows


def target_verdicts(table: List[Dict[str, Any]]) -> List[str]:
    """One line per target and K: the measured ratio, the target and whether it is met."""
    out: List[str] = []

    def line(what: str, got: Optional[float], op: str, want: float) -> None:
        if got is None:
            return
        ok = got <= want if op == "<=" else got >= want
        out.append(f"target {what}: {got:.2f} {op} {want:g}: {'met' if ok else 'MISSED'}")

    for r in table:
        K, case = r["K"], r["case"]
        if case in ("op:median", "op:trimmed_mean"):
            line(f"K={K} {case} x floor", r["x_floor"], "<=", 3.0 if K <= 10 else 5.0)
            line(
                f"K={K} {case} torch baseline / op",
                r.get("torch_median_over_op", r.get("torch_sort_over_op")),
                ">=",
                5.0,
            )
            line(f"K={K} {case} Flower / op", r.get("flower_over_op"), ">=", 10.0)
        if case in ("method:krum", "method:multi-krum"):
            line(f"K={K} {case} x gram", r.get("x_gram"), "<=", 1.3)
        if case in ("method:fedadam", "method:fedyogi", "method:fedadagrad"):
            line(f"K={K} {case} x fedavg", r.get("x_fedavg"), "<=", 1.3)
        if case.startswith("method:") and "flower_over_method" in r:
            line(f"K={K} {case} Flower / method", r["flower_over_method"], ">=", 10.0)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, default=RESNET18_D, help="parameters per client (default ResNet-18's 11.2M)")
    ap.add_argument("--ks", default="10,100", help="comma list of client counts K")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved samples per case")
    ap.add_argument(
        "--baseline-elems",
        type=float,
        default=2.5e8,
        help="largest K x d the torch / Flower baselines run on (their time is scaled to d)",
    )
    ap.add_argument("--no-flower", action="store_true", help="leave out Flower's functions")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument(
        "--krum-parts",
        action="store_true",
        help="only the breakdown of a Krum / Multi-Krum round into its parts (writes robust-krum-parts.json)",
    )
    add_out_argument(ap)
    args = ap.parse_args(argv)
    try:
        ks = [int(x) for x in args.ks.split(",") if x]
    except ValueError:
        print(f"bench/robust.py: --ks must be a comma list of ints, got {args.ks!r}", file=sys.stderr)
        return 2
    if args.d < 1 or not ks or min(ks) < 1 or args.repeats < 1:
        print(
            f"bench/robust.py: need --d >= 1, --ks >= 1 and --repeats >= 1, got d={args.d} ks={ks} "
            f"repeats={args.repeats}",
            file=sys.stderr,
        )
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    rows: List[Dict[str, Any]] = []
    if args.krum_parts:
        for K in ks:
            rows += krum_parts(K, args.d, args.repeats)
        print_table([r for r in rows if "ms" in r], ["K", "d", "case", "ms", "cpu_ms", "x_gram", "cpu_x_gram"])
        for r in rows:
            if r["case"] == "load":
                print(f"K={r['K']}: load average at start {r['loadavg_start']}, at end {r['loadavg_end']}")
        print(f"wrote {write_json('robust-krum-parts.json', rows, out=args.out)}")
        return 0
    for K in ks:
        rows += bench(K, args.d, args.baseline_elems, args.repeats, not args.no_flower)
    table = [r for r in rows if "ms" in r]
    print_table(
        table,
        [
            "K",
            "d",
            "case",
            "ms",
            "cpu_ms",
            "x_floor",
            "baseline_d",
            "torch_median_over_op",
            "torch_sort_over_op",
            "flower_over_op",
            "x_gram",
            "cpu_x_gram",
            "x_fedavg",
            "flower_over_method",
            "cpu_flower_over_method",
        ],
    )
    for r in rows:
        if r["case"] == "load":
            print(f"K={r['K']}: load average (1, 5, 15 min) at start {r['loadavg_start']}, at end {r['loadavg_end']}")
    for r in rows:
        if r["case"] == "skipped_methods" and r["skipped"]:
            print(f"K={r['K']}: not registered here, skipped: {', '.join(r['skipped'])}")
    verdicts = target_verdicts(table)
    for v in verdicts:
        print(v)
    path = write_json(
        "robust.json",
        rows + [{"case": "verdicts", "lines": verdicts}],
        extra={
            "targets": {
                "median_trimmed_x_floor": {"10": 3.0, "100": 5.0},
                "torch_median_over_op_min": 5.0,
                "krum_x_gram_max": 1.3,
                "server_opt_x_fedavg_max": 1.3,
                "flower_over_min": 10.0,
            }
        },
        out=args.out,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
