"""Merges the run directories of one compare setup into another (more seeds of the same cells):

    python results/scripts/merge_setups.py SRC_SETUP DST_SETUP      (from the checkout root, like matched_server_lr.py:
                                                                     the schedule paths in config.yaml are relative to it)

Moves every SRC/<label>-s<seed> run directory into DST (refusing a seed DST already has). Where both
have a ``schedule.json`` (matched server-lr controls, results/scripts/matched_server_lr.py), the SRC
schedule's per-seed runs are appended to DST's and the moved runs' ``config.yaml`` is pointed at DST's
schedule (the numbers for their seeds are the same). DST's compare.json/compare.png, which describe the
old seeds only, are removed: results/analyze.py then reads the run directories, and
results/scripts/replot.py redraws compare.png. SRC is removed. Each run's provenance.json keeps the
command that produced it.

Archived setups (results/runs/<paper>/<setup>.tar.xz, results/scripts/runstore.py) are unpacked
first; when SRC or DST was archived, SRC's archive is deleted and DST is packed again afterwards.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import runstore  # noqa: E402  (archived or on-disk run directories)


def merge(src: str, dst: str) -> None:
    src_runs = runstore.open_setup(src, cached=False).runs()
    if not src_runs:
        raise SystemExit(f"merge_setups: {src} has no run directories (on disk or in {runstore.archive_path(src)})")
    clash = sorted(set(src_runs) & set(runstore.open_setup(dst, cached=False).runs()))
    if clash:
        raise SystemExit(f"merge_setups: {dst} already has {clash[0]}")
    sched_src, sched_dst = os.path.join(src, "schedule.json"), os.path.join(dst, "schedule.json")
    if os.path.exists(sched_src) != os.path.exists(sched_dst):
        raise SystemExit(f"merge_setups: only one of {src}, {dst} has a schedule.json")
    merged = None
    if os.path.exists(sched_src):
        a, b = json.load(open(sched_dst)), json.load(open(sched_src))
        if a.get("method") != b.get("method") or "runs" not in a or "runs" not in b:
            raise SystemExit("merge_setups: the schedules differ in method or are per-round means (no 'runs')")
        if {r["seed"] for r in a["runs"]} & {r["seed"] for r in b["runs"]}:
            raise SystemExit("merge_setups: the schedules share a seed")
        a["runs"] = a["runs"] + b["runs"]
        merged = a
    archived = [d for d in (src, dst) if os.path.exists(runstore.archive_path(d))]
    for d in archived:  # the archived runs not on disk (never overwrites a file on disk)
        runstore.unpack(d)
    runs = sorted(glob.glob(os.path.join(src, "*-s[0-9]*")))
    os.makedirs(dst, exist_ok=True)
    for r in runs:
        t = os.path.join(dst, os.path.basename(r))
        shutil.move(r, t)
        if merged is not None:
            cfg = os.path.join(t, "config.yaml")
            txt = open(cfg).read()
            old, new = os.path.relpath(sched_src), os.path.relpath(sched_dst)
            if old not in txt:
                raise SystemExit(f"merge_setups: {cfg} does not name {old}")
            with open(cfg, "w") as f:
                f.write(txt.replace(old, new))
        print(f"moved {r} -> {t}")
    if merged is not None:
        with open(sched_dst, "w") as f:
            json.dump(merged, f)
    for name in ("compare.json", "compare.png"):
        p = os.path.join(dst, name)
        if os.path.exists(p):
            os.remove(p)
    shutil.rmtree(src)
    if archived:
        for d in archived:
            os.remove(runstore.archive_path(d))  # everything it held is on disk (unpacked above)
        print(f"packed {dst} -> {runstore.pack(dst)}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    merge(sys.argv[1], sys.argv[2])
