"""Redraws every results/<paper>/<setup>/compare.png from the committed run logs (read from the
archives results/runs/<paper>/<setup>.tar.xz and/or the run directories on disk; results/scripts/runstore.py):

    python results/scripts/replot.py [--dpi 90] [SETUP_DIR ...]

with fedkernels.sim.report.plot_curves: per method the mean over seeds and a ± 1 sample-std band
(n - 1), the caption saying so, every logged metric in its own panel (accuracy, test loss, client
train loss, global objective and client-loss variance where logged), integer round ticks, the
FedAWARE explore warm-up shaded and named, and a title naming the setup. PNG only (the committed
results keep no PDF/SVG copies), at plot_curves.FIGURE_DPI (90; a run's own figures have 200) and
re-encoded as 256-colour palette PNGs (plot_curves.shrink_png) to keep the repository small.
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
from fedkernels.sim.config import RunConfig  # noqa: E402
from fedkernels.sim.report import describe_setup, plot_curves  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import runstore  # noqa: E402  (one reader of the archived or on-disk per-round logs)
from plot_curves import FIGURE_DPI, shrink_png  # noqa: E402  (the committed figures: their dpi, palette PNGs)


def replot(setup_dir, dpi=FIGURE_DPI):
    runs = {}
    files = runstore.open_setup(setup_dir)
    for run in files.runs():
        if files.exists(f"{run}/metrics.jsonl"):  # (a gzipped one on disk reads under this name)
            runs.setdefault(run.rsplit("-s", 1)[0], []).append(files.metrics(run))
    if not runs:
        return None
    rel = os.path.relpath(setup_dir, os.path.join(REPO, "results"))
    title = rel
    if files.exists("compare.json"):
        c = files.json("compare.json")
        try:
            cfg = RunConfig.from_dict(c["setup"])
            cfg.rounds = c.get("rounds") or cfg.rounds
            title = f"{rel}: {describe_setup(cfg, c.get('seeds') or [])}"
        except (KeyError, TypeError, ValueError):
            pass
    os.makedirs(setup_dir, exist_ok=True)
    out = plot_curves(runs, os.path.join(setup_dir, "compare.png"), title=title, band="std", formats=("png",), dpi=dpi)
    return shrink_png(out) if out else out


def main(argv):
    dpi = FIGURE_DPI
    if argv[:1] == ["--dpi"]:
        dpi, argv = int(argv[1]), argv[2:]
    dirs = argv or runstore.setup_dirs(os.path.join(REPO, "results"))
    for d in argv:
        if not runstore.open_setup(d).runs():
            print(
                f"replot: SETUP_DIR={d!r} has no run directories, on disk or in {runstore.archive_path(d)}; "
                "expected results/<paper>/<setup>",
                file=sys.stderr,
            )
            return 2
    for d in dirs:
        p = replot(d, dpi)
        if p:
            print(f"wrote {os.path.relpath(p, REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
