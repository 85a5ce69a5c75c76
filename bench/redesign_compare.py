"""Before/after the #13 redesign, side by side in one run: the same aggregate() calls (and optionally
demo-task simulation rounds) timed in two source trees, old and new, interleaved.

Each tree runs in its own worker subprocess (``PYTHONPATH=<tree>``, 1 thread), which imports that
tree's ``fedkernels`` and native extension and builds identical inputs from one seed. The parent
asks the workers in turn (the order alternates every repetition) for one sample: the median of
``--inner`` aggregate() calls of one method, each started from the same saved aggregator state
(restoring it is not timed). Only one worker computes at a time. Reported per method: the median
over repetitions of each tree's samples, the ratio new/old, and os.getloadavg() before/after.

Old tree: ``git worktree add /tmp/fk-old 913a593`` (the commit before the first #13 commit) and,
since csrc/ changed since, ``python setup.py build_ext --inplace`` there.

Run: OMP_NUM_THREADS=1 nice -n 10 python -m bench.redesign_compare --old /tmp/fk-old [--sim-rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

METHODS = ("fedavg", "kuramoto", "fedaware", "scaffold", "gcfed", "fedecado")


# ------------------------------------------------------------------------------------------------
# worker side (runs inside one tree; imports nothing from bench/)
# ------------------------------------------------------------------------------------------------
def _worker(K: int, hidden: int, inner: int) -> None:
    import torch
    from torch import nn
    torch.set_num_threads(1)
    from fedkernels import FlatSpec, algorithms

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, hidden), nn.ReLU(), nn.Linear(hidden, 256), nn.ReLU(), nn.Linear(256, 10))
    spec = FlatSpec.from_module(model)
    x = spec.flatten(model).float().contiguous()
    d = x.numel()
    U = (torch.randn(K, d) * 1e-3).contiguous()
    n = [100 + 37 * k % 400 for k in range(K)]
    ids = list(range(K))

    def payloads(name):
        if name == "scaffold":
            g = torch.Generator().manual_seed(1)
            dc = [torch.randn(d, generator=g) * 1e-3 for _ in range(K)]
            return [{"delta_c": dc[k], "local_steps": 10} for k in range(K)]
        if name == "gcfed":
            return [{"local_gc": 2} for _ in range(K)]
        if name == "fedecado":
            return [{"T": 0.01 * (5 + k % 3)} for k in range(K)]
        return None

    def build(name):
        opts = {"fedaware": dict(num_clients=K), "scaffold": dict(weighting="uniform"),
                "fedecado": dict(num_clients=K, hbar=1.0)}.get(name, {})
        agg = algorithms.build(name, **opts)
        agg.setup(spec, num_clients=K, global_flat=x)
        return agg

    aggs, states, pls = {}, {}, {}
    for name in METHODS:                       # round 1 (fills tables, ends FedAWARE's exploration)
        agg = build(name)
        pl = payloads(name)
        agg.aggregate(x, U, n, ids, pl)
        aggs[name], states[name], pls[name] = agg, agg.state_dict(), pl

    sim = None
    out = sys.stdout
    sys.stdout = sys.stderr                    # nothing but protocol lines on the pipe
    print(json.dumps({"ready": True, "d": d}), file=out, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "agg":
            name = cmd["method"]
            agg, ts = aggs[name], []
            info = None
            for _ in range(inner):
                agg.load_state_dict(states[name])
                t0 = time.perf_counter()
                res = agg.aggregate(x, U, n, ids, pls[name])
                ts.append(time.perf_counter() - t0)
                info = res.info
            # a checksum of the result: old and new must compute the same numbers
            chk = float(res.params.double().sum())
            extra = {k: info[k] for k in ("steps", "rejects") if k in info}
            print(json.dumps({"t": statistics.median(ts), "sum": chk, **extra}), file=out, flush=True)
        elif cmd["op"] == "sim_setup":
            from fedkernels.sim import presets
            from fedkernels.sim.server import Simulation
            cfg = presets.get("demo")
            sim = Simulation(cfg, write_outputs=False)
            sim.setup()
            print(json.dumps({"ok": True}), file=out, flush=True)
        elif cmd["op"] == "sim_round":
            t0 = time.perf_counter()
            m = sim.run_round(int(cmd["r"]))
            t = time.perf_counter() - t0
            print(json.dumps({"t": t, "accuracy": m.get("accuracy"), "t_agg": m.get("t_agg"),
                              "t_local": m.get("t_local")}), file=out, flush=True)


# ------------------------------------------------------------------------------------------------
# parent
# ------------------------------------------------------------------------------------------------
class Worker:
    def __init__(self, label: str, tree: str, args, K: int):
        env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.label, self.tree = label, tree
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", "--clients", str(K),
                                   "--hidden", str(args.hidden), "--inner", str(args.inner)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd="/")
        self.hello = self.read()

    def read(self):
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.label} ({self.tree}) exited (rc={self.p.wait()})")
        return json.loads(line)

    def ask(self, **cmd):
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        return self.read()

    def close(self):
        try:
            self.p.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.p.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        self.p.wait(timeout=60)


def _git(tree: str) -> str:
    try:
        return subprocess.run(["git", "-C", tree, "log", "-1", "--format=%h %s"], capture_output=True, text=True,
                              timeout=10).stdout.strip()[:100]
    except (OSError, subprocess.SubprocessError):
        return "?"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", help="source tree before the redesign (with its built extension)")
    ap.add_argument("--new", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--clients", default="20", help="K, or several K separated by commas (one worker pair each)")
    ap.add_argument("--hidden", type=int, default=1024, help="MLP 784-hidden-256-10 (1024: d = 1.07e6)")
    ap.add_argument("--reps", type=int, default=7, help="interleaved samples per tree and method")
    ap.add_argument("--inner", type=int, default=3, help="aggregate() calls per sample (median)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--sim-rounds", type=int, default=0, help="demo-task simulation rounds per tree (0: none)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    worker = "--worker" in (sys.argv[1:] if argv is None else argv)
    if not worker:   # a worker runs with PYTHONPATH=<its tree>, whose bench/ may predate bench.common's --out
        from bench.common import add_out_argument, output_path
        add_out_argument(ap)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(int(args.clients), args.hidden, args.inner)
    if not args.old:
        print("redesign_compare: --old is required (the source tree before the redesign)", file=sys.stderr)
        return 2
    methods = [m for m in args.methods.split(",") if m]
    for m in methods:
        if m not in METHODS:
            print(f"redesign_compare: --methods: unknown method {m!r}, expected some of {METHODS}", file=sys.stderr)
            return 2
    Ks = [int(k) for k in str(args.clients).split(",") if k]
    load0 = os.getloadavg()
    t_start = time.time()
    rows, sim_rows = [], []
    for K in Ks:
        workers = {"old": Worker("old", args.old, args, K), "new": Worker("new", args.new, args, K)}
        try:
            d = workers["new"].hello["d"]
            samples = {m: {"old": [], "new": []} for m in methods}
            sums, extras = {m: {} for m in methods}, {m: {} for m in methods}
            for rep in range(args.reps):
                order = ("old", "new") if rep % 2 == 0 else ("new", "old")
                for m in methods:
                    for lab in order:
                        r = workers[lab].ask(op="agg", method=m)
                        samples[m][lab].append(r["t"])
                        sums[m][lab] = r["sum"]
                        extras[m][lab] = {k: v for k, v in r.items() if k not in ("t", "sum")}
                print(f"K={K} rep {rep + 1}/{args.reps} done, load {os.getloadavg()[0]:.2f}", file=sys.stderr,
                      flush=True)
            for m in methods:
                o, nw = statistics.median(samples[m]["old"]), statistics.median(samples[m]["new"])
                rows.append({"method": m, "K": K, "d": d, "old_median_s": o, "new_median_s": nw,
                             "ratio_new_over_old": nw / o, "old_min_s": min(samples[m]["old"]),
                             "new_min_s": min(samples[m]["new"]), "samples_old_s": samples[m]["old"],
                             "samples_new_s": samples[m]["new"], "result_sum_old": sums[m]["old"],
                             "result_sum_new": sums[m]["new"], "same_result": sums[m]["old"] == sums[m]["new"],
                             "info_old": extras[m]["old"], "info_new": extras[m]["new"],
                             "loadavg_after": os.getloadavg()})
            if args.sim_rounds > 0 and K == Ks[-1]:
                for lab in ("old", "new"):
                    workers[lab].ask(op="sim_setup")
                for r in range(args.sim_rounds):
                    order = ("old", "new") if r % 2 == 0 else ("new", "old")
                    row = {"round": r + 1}
                    for lab in order:
                        row[lab] = workers[lab].ask(op="sim_round", r=r)
                    row["ratio_new_over_old"] = row["new"]["t"] / row["old"]["t"]
                    sim_rows.append(row)
                    print(f"sim round {r + 1}: old {row['old']['t']:.2f}s new {row['new']['t']:.2f}s", file=sys.stderr,
                          flush=True)
        finally:
            for w in workers.values():
                w.close()
    load1 = os.getloadavg()
    payload = {
        "what": "median seconds per aggregate() call, old (before #13) vs new tree, interleaved in one run, "
                "1 thread per worker; each call starts from the same saved aggregator state",
        "command": "OMP_NUM_THREADS=1 nice -n 10 python -m bench.redesign_compare " + " ".join(argv or sys.argv[1:]),
        "old_tree": {"path": args.old, "commit": _git(args.old)},
        "new_tree": {"path": args.new, "commit": _git(args.new)},
        "model": f"MLP 784-{args.hidden}-256-10 (float32), K in {Ks} clients, all participating",
        "reps": args.reps, "inner": args.inner,
        "loadavg_before": load0, "loadavg_after": load1, "wall_s": time.time() - t_start,
        "results": rows,
    }
    if sim_rows:
        ts_o = [r["old"]["t"] for r in sim_rows[1:]] or [sim_rows[0]["old"]["t"]]
        ts_n = [r["new"]["t"] for r in sim_rows[1:]] or [sim_rows[0]["new"]["t"]]
        payload["sim_demo"] = {"preset": "demo (fedavg, 10 clients, 1 epoch, eval every round)", "rounds": sim_rows,
                               "median_round_s_old": statistics.median(ts_o),
                               "median_round_s_new": statistics.median(ts_n),
                               "ratio_new_over_old": statistics.median(ts_n) / statistics.median(ts_o),
                               "note": "median over rounds 2.. (round 1 includes warm-up)"}
    path = output_path(args.out, "redesign-compare.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    print(f"{'method':10s} {'K':>3s} {'old ms':>9s} {'new ms':>9s} {'new/old':>8s} same")
    for r in rows:
        print(f"{r['method']:10s} {r['K']:3d} {1e3 * r['old_median_s']:9.2f} {1e3 * r['new_median_s']:9.2f} "
              f"{r['ratio_new_over_old']:8.3f} {r['same_result']}")
    if sim_rows:
        s = payload["sim_demo"]
        print(f"demo round: old {s['median_round_s_old']:.3f}s new {s['median_round_s_new']:.3f}s "
              f"new/old {s['ratio_new_over_old']:.3f}")
    print(f"loadavg before {load0} after {load1}; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
