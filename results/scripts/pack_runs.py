"""Packs the raw run directories of results/ setups into one deterministic archive per setup:

    python results/scripts/pack_runs.py [--keep] SETUP_DIR [SETUP_DIR ...]
    python results/scripts/pack_runs.py [--keep] --all        # every setup with run directories on disk

Each SETUP_DIR = results/<paper>/<setup>; its run directories <label>-s<seed>/ and its compare.json
(+ compare.csv/.md/.tex) go into results/runs/<paper>/<setup>.tar.xz, together with the runs the
existing archive holds that are not on disk (a run on disk replaces the archived run of the same
name: the setup as results/analyze.py reads it). The archive is checked to read back byte-identical
before the packed files are deleted (--keep: leave them). A gzipped file (metrics.jsonl.gz) is stored
gunzipped under its name without .gz (metrics.jsonl): the archive is xz-compressed as a whole.
Figures, schedule.json and other files stay in the setup directory. The same files give the same
bytes (format: results/scripts/runstore.py).
Bad input: one line, exit 2.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import runstore  # noqa: E402


def main(argv=None) -> int:
    a, results = runstore.setups_from_cli(
        __doc__,
        "every setup under results/ with run directories on disk",
        argv,
        extra=[("--keep", "keep the packed files on disk")],
    )
    try:
        dirs = runstore.setup_dirs(results) if a.all else a.setups
    except ValueError as e:  # an archive in the old format
        print(f"pack_runs: {e}", file=sys.stderr)
        return 2
    for d in a.setups:
        if not os.path.isdir(d):
            print(f"pack_runs: SETUP_DIR={d!r} is not a directory; expected results/<paper>/<setup>", file=sys.stderr)
            return 2
    n = 0
    for d in dirs:
        try:
            arc = runstore.pack(d, remove=not a.keep)
        except ValueError as e:
            print(f"pack_runs: {e}", file=sys.stderr)
            return 2
        if arc is None:
            if not a.all:
                print(
                    f"pack_runs: SETUP_DIR={d!r} holds no run directory (<label>-s<seed>); nothing packed",
                    file=sys.stderr,
                )
                return 2
            continue
        n += 1
        print(f"packed {d} -> {arc} ({os.path.getsize(arc)} bytes)")
    if a.all and not n:
        print("pack_runs: no setup under results/ has run directories on disk; nothing packed", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
