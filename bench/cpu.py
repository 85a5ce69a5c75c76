"""All CPU benchmark suites: python -m bench.cpu [--quick] [--only core,linalg,gc,becado,round]

Each suite measures an op against the baselines a user would otherwise run and against the
memory-bandwidth floor, prints a table and writes bench/results/cpu-<suite>.json.
"""
from __future__ import annotations

import argparse
import importlib

SUITES = ["core", "linalg", "gc", "becado", "round"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    ap.add_argument("--only", default=",".join(SUITES), help="comma-separated suites")
    a = ap.parse_args(argv)
    for name in a.only.split(","):
        mod = importlib.import_module(f"bench.cpu_{name}")
        print(f"\n=== {name} ===")
        mod.main(["--quick"] if a.quick else [])


if __name__ == "__main__":
    main()
