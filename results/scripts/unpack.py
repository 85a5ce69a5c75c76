"""Unpacks the committed run directories of results/ setups, to inspect or extend their runs:

    python results/scripts/unpack.py SETUP_DIR [SETUP_DIR ...]   # e.g. results/fedaware/fmnist
    python results/scripts/unpack.py --all

writes the files of results/runs/<paper>/<setup>.tar.xz back into results/<paper>/<setup>/ (the same
as ``tar xJf results/runs/<paper>/<setup>.tar.xz -C results``, but never overwriting a different file
on disk: a run directory already on disk is kept, as it takes precedence over the archived run when
reading). results/analyze.py and the plotting scripts read the archives directly: unpacking is only
needed to look at the files (pack_runs.py packs new or re-run runs together with the archived ones).
Bad input: one line, exit 2.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import runstore  # noqa: E402


def main(argv=None) -> int:
    a, results = runstore.setups_from_cli(__doc__, "every archived setup under results/", argv)
    try:
        dirs = (
            [d for d in runstore.setup_dirs(results) if os.path.exists(runstore.archive_path(d))] if a.all else a.setups
        )
        for d in dirs:
            if not os.path.exists(runstore.archive_path(d)):
                print(f"unpack: SETUP_DIR={d!r} has no archive {runstore.archive_path(d)}", file=sys.stderr)
                return 2
        for d in dirs:
            wrote, kept = runstore.unpack(d)
            print(
                f"unpacked {runstore.archive_path(d)} -> {d} ({len(wrote)} files written"
                + (f"; kept on disk instead of the archive's: {', '.join(kept)}" if kept else "")
                + ")"
            )
    except ValueError as e:
        print(f"unpack: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
