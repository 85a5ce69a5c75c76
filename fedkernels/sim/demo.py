"""The walking-skeleton demo (``make demo`` = ``python -m fedkernels.sim.demo``).

FedAvg, then a short comparison against the paper methods that are registered (Kuramoto-FedAvg,
FedAWARE, FedECADO, FedPGVC, GC-Fed), on 10 clients holding 2 label shards each of a 12k/2k
subsample of Fashion-MNIST (scikit-learn's digits when /usr/share/datasets/fashion-mnist is
missing), with a small CNN and 1 local epoch. Prints the test accuracy per round, a table at the end,
and writes runs/demo/ (one directory per method, compare.json, the tables compare.csv/.md/.tex and
the figure compare.png/.pdf/.svg).

Options: ``--rounds N``, ``--methods a,b,c`` (default: all demo methods), ``--fedavg-only``,
``--out DIR``, ``--seed S``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from . import presets
from .compare import compare, resolve_methods

FMNIST_DIR = "/usr/share/datasets/fashion-mnist"


def demo_config(rounds=None, seed=0):
    cfg = presets.get("demo")
    if not os.path.isdir(FMNIST_DIR):
        print(f"{FMNIST_DIR} not found: using scikit-learn's digits instead "
              "(install the Debian package dataset-fashion-mnist for the real demo)", flush=True)
        cfg.data.name, cfg.data.train_subset, cfg.data.test_subset = "digits", None, None
        cfg.model.name = "digit_cnn"
        cfg.train.lr = 0.05
        cfg.train.batch_size = 16
    if rounds is not None:
        cfg.rounds = int(rounds)
    cfg.seed = int(seed)
    cfg.progress = False
    # Small batches on a shared 2-core machine: two OpenMP threads fighting other processes are
    # many times slower than one, so use one thread when the machine is already busy.
    try:
        busy = os.getloadavg()[0] >= 1.0
    except OSError:
        busy = False
    if busy or (os.cpu_count() or 1) <= 1:
        cfg.threads = 1
    return cfg


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fedkernels.sim.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--methods", default=None, help="comma-separated demo methods (default: all registered)")
    ap.add_argument("--fedavg-only", action="store_true")
    ap.add_argument("--out", default="runs/demo")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    cfg = demo_config(a.rounds, a.seed)
    known = presets.variants("demo")
    labels = ["fedavg"] if a.fedavg_only else (a.methods.split(",") if a.methods else list(known))
    try:
        methods = resolve_methods(labels, known)     # every method checked before the first run
    except ValueError as e:
        print(f"demo: error: {e}", file=sys.stderr)
        return 2
    print(f"fedkernels demo: {cfg.data.name}, {cfg.num_clients} clients x "
          f"{cfg.partition.options.get('shards_per_client')} label shards, model {cfg.model.name}, "
          f"{cfg.rounds} rounds, {cfg.train.epochs} local epoch(s); methods: {', '.join(m for m, _ in methods)}",
          flush=True)
    out = compare(cfg, methods, seeds=[cfg.seed], out_dir=a.out, verbose=True, preset="demo")
    fed = out["methods"].get("fedavg")
    print(f"\nchance level {100.0 / 10:.0f}%; outputs in {a.out}/ (compare.png/.pdf/.svg, compare.json, "
          f"compare.csv/.md/.tex, one run directory per method); total {time.perf_counter() - t0:.0f}s", flush=True)
    if out.get("failed"):
        print(f"demo: {len(out['failed'])} run(s) failed", file=sys.stderr)
        return 1
    if fed is not None and (fed["stats"]["final_accuracy"]["mean"] or 0) < 0.3:
        print("WARNING: FedAvg did not get well above chance", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
