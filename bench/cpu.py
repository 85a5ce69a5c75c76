"""All CPU benchmark suites: python -m bench.cpu [--quick] [--only core,linalg,gc,becado,round] [--out DIR]

Each suite measures an op against the baselines a user would otherwise run and against the
memory-bandwidth floor, prints a table and writes cpu-<suite>.json to runs/bench/ (under the current
directory); `--out bench/results` updates the published results (bench/common.py).
"""

from __future__ import annotations

import argparse
import importlib

from .common import add_out_argument

SUITES = ["core", "linalg", "gc", "becado", "round"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    ap.add_argument("--only", default=",".join(SUITES), help="comma-separated suites (default: all: %(default)s)")
    add_out_argument(ap)
    a = ap.parse_args(argv)
    names = [n for n in a.only.split(",") if n]
    bad = [n for n in names if n not in SUITES]
    if bad or not names:
        ap.error(f"--only: {','.join(bad) or repr(a.only)} is not a suite; expected some of {','.join(SUITES)}")
    if a.out is not None and a.out.endswith(".json") and len(names) > 1:
        ap.error(f"--out: {a.out} is one file but {len(names)} suites write one each; give a directory")
    for name in names:
        mod = importlib.import_module(f"bench.cpu_{name}")
        print(f"\n=== {name} ===")
        mod.main((["--quick"] if a.quick else []) + ([] if a.out is None else ["--out", a.out]))


if __name__ == "__main__":
    main()
