"""The walking-skeleton demo (``make demo`` = ``python -m fedkernels.sim.demo``).

FedAvg, then a short comparison against the paper methods that are registered (Kuramoto-FedAvg,
FedAWARE, FedECADO, FedPGVC, GC-Fed), on 10 clients holding 2 label shards each of a 12k/2k
subsample of Fashion-MNIST (scikit-learn's digits when /usr/share/datasets/fashion-mnist is
missing), with a small CNN and 1 local epoch: ``fedkernels compare --preset demo``. Prints the test
accuracy per round, a table at the end, where everything is and what to try next. Writes

    runs/demo-<hash>/runs/<method>-s<seed>/   one run directory per method (as `fedkernels run` writes)
    runs/demo-<hash>/compare/                 compare.json, the tables compare.csv/.md/.tex and the
                                              figure compare.png/.pdf/.svg

``<hash>`` is the demo setup's config hash (another ``--rounds``, ``--seed`` or thread count, which
follows the machine's load: another folder).
Options: ``--rounds N``, ``--methods a,b,c`` (default: all demo methods), ``--fedavg-only``,
``--out DIR`` (instead of ``runs/demo-<hash>``), ``--seed S``.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time

from . import presets
from .compare import compare, resolve_methods
from .provenance import auto_threads

FMNIST_DIR = "/usr/share/datasets/fashion-mnist"


def demo_config(rounds=None, seed=0):
    cfg = presets.get("demo")
    if not os.path.isdir(FMNIST_DIR):
        print(
            f"{FMNIST_DIR} not found: using scikit-learn's digits instead "
            "(install the Debian package dataset-fashion-mnist for the real demo)",
            flush=True,
        )
        cfg.data.name, cfg.data.train_subset, cfg.data.test_subset = "digits", None, None
        cfg.model.name = "digit_cnn"
        cfg.train.lr = 0.05
        cfg.train.batch_size = 16
    if rounds is not None:
        cfg.rounds = int(rounds)
    cfg.seed = int(seed)
    cfg.progress = False
    # Small batches on a shared machine: OpenMP threads fighting other processes are many times
    # slower than fewer, so the thread count follows the load (as `fedkernels run` and `compare` do);
    # it is part of the config (another count rounds differently), hence of the folder's hash.
    cfg.threads, why = auto_threads(cfg.workers)
    print(f"threads: {why}", flush=True)
    return cfg


def fedkernels_command() -> str:
    """How the user starts ``fedkernels`` from here: the console script beside this Python (the
    venv's, which need not be activated; relative to the current directory when inside it), else
    ``PYTHON -m fedkernels``."""
    exe = os.path.join(os.path.dirname(sys.executable), "fedkernels")
    if not os.path.exists(exe):
        return f"{sys.executable} -m fedkernels"
    rel = os.path.relpath(exe)
    return rel if not rel.startswith("..") else exe


def move_compare_outputs(src: str, dst: str) -> list:
    """Moves compare's own files (``compare.json``, ``compare.csv/.md/.tex``, ``compare.png/.pdf/.svg``)
    from ``src`` (where compare() writes them beside its runs) into ``dst``; returns the new paths."""
    os.makedirs(dst, exist_ok=True)
    moved = []
    for p in sorted(glob.glob(os.path.join(src, "compare.*"))):
        if os.path.isfile(p):
            q = os.path.join(dst, os.path.basename(p))
            os.replace(p, q)
            moved.append(q)
    return moved


def next_steps(cfg, out: str, runs_dir: str, cmp_dir: str, labels) -> str:
    """The closing lines: where the runs and the comparison are, and the commands to try next."""
    fk = fedkernels_command()
    other = next((m for m in labels if m != "fedavg"), "kuramoto")
    if cfg.data.name == "fmnist":
        one = f"{fk} run --preset demo --method {other}"
        where = f"runs/demo-{other}-s0-<hash>/"
    else:  # the demo preset needs Fashion-MNIST; this preset runs on digits anywhere
        one = f"{fk} run --preset kuramoto-digits"
        where = "runs/kuramoto-digits-kuramoto-S0.5-s0-<hash>/"
    return "\n".join(
        [
            f"outputs in {out}/:",
            f"  {runs_dir}/<method>-s{cfg.seed}/   one run per method: metrics.jsonl, summary.json, curves.png, "
            "config.yaml, provenance.json, run.log",
            f"  {cmp_dir}/   compare.png/.pdf/.svg (curves), compare.md/.csv/.tex (table), compare.json",
            "next:",
            f"  {one}    one run; outputs in {where}",
            f"  {fk} presets    every preset, its methods and its time on 2 CPU cores",
        ]
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fedkernels.sim.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--methods", default=None, help="comma-separated demo methods (default: all registered)")
    ap.add_argument("--fedavg-only", action="store_true")
    ap.add_argument("--out", default=None, help="output folder (default: runs/demo-<config hash>)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    cfg = demo_config(a.rounds, a.seed)
    known = presets.variants("demo")
    labels = ["fedavg"] if a.fedavg_only else (a.methods.split(",") if a.methods else list(known))
    try:
        methods = resolve_methods(labels, known)  # every method checked before the first run
        cfg.validate()
    except ValueError as e:
        print(f"demo: error: {e}", file=sys.stderr)
        return 2
    out = a.out or os.path.join(cfg.out_dir, f"demo-{cfg.config_hash()}")
    runs_dir, cmp_dir = os.path.join(out, "runs"), os.path.join(out, "compare")
    print(
        f"fedkernels demo: {cfg.data.name}, {cfg.num_clients} clients x "
        f"{cfg.partition.options.get('shards_per_client')} label shards, model {cfg.model.name}, "
        f"{cfg.rounds} rounds, {cfg.train.epochs} local epoch(s); methods: {', '.join(m for m, _ in methods)}",
        flush=True,
    )
    try:
        res = compare(cfg, methods, seeds=[cfg.seed], out_dir=runs_dir, verbose=True, preset="demo")
    except KeyboardInterrupt:
        print(
            f"demo: interrupted; the finished runs are in {runs_dir}/ (no comparison written)",
            file=sys.stderr,
            flush=True,
        )
        return 130
    move_compare_outputs(runs_dir, cmp_dir)
    fed = res["methods"].get("fedavg")
    print(f"\nchance level {100.0 / 10:.0f}%; total {time.perf_counter() - t0:.0f}s", flush=True)
    print(next_steps(cfg, out, runs_dir, cmp_dir, [m for m, _ in methods]), flush=True)
    if res.get("failed"):
        print(f"demo: {len(res['failed'])} run(s) failed", file=sys.stderr)
        return 1
    if fed is not None and (fed["stats"]["final_accuracy"]["mean"] or 0) < 0.3:
        print("WARNING: FedAvg did not get well above chance", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
