"""Redraws every results/<paper>/<setup>/compare.png from the committed run logs:

    python results/scripts/replot.py [--dpi 110] [SETUP_DIR ...]

with fedkernels.sim.report.plot_curves: per method the mean over seeds and a ± 1 sample-std band
(n - 1), the caption saying so, every logged metric in its own panel (accuracy, test loss, client
train loss, global objective and client-loss variance where logged), integer round ticks, the
FedAWARE explore warm-up shaded and named, and a title naming the setup. PNG only (the committed
results keep no PDF/SVG copies), at a lower dpi than a run's own figures to keep the repository small.
"""
from __future__ import annotations

import glob
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
from fedkernels.sim.config import RunConfig  # noqa: E402
from fedkernels.sim.report import describe_setup, plot_curves  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plot_curves import load  # noqa: E402  (one reader of the gzipped per-round logs)


def replot(setup_dir, dpi=110):
    runs = {}
    for run in sorted(glob.glob(os.path.join(setup_dir, "*-s[0-9]*"))):
        if os.path.isdir(run) and (os.path.exists(os.path.join(run, "metrics.jsonl.gz"))
                                   or os.path.exists(os.path.join(run, "metrics.jsonl"))):
            runs.setdefault(os.path.basename(run).rsplit("-s", 1)[0], []).append(load(run))
    if not runs:
        return None
    cj = os.path.join(setup_dir, "compare.json")
    rel = os.path.relpath(setup_dir, os.path.join(REPO, "results"))
    title = rel
    if os.path.exists(cj):
        with open(cj) as f:
            c = json.load(f)
        try:
            cfg = RunConfig.from_dict(c["setup"])
            cfg.rounds = c.get("rounds") or cfg.rounds
            title = f"{rel}: {describe_setup(cfg, c.get('seeds') or [])}"
        except (KeyError, TypeError, ValueError):
            pass
    return plot_curves(runs, os.path.join(setup_dir, "compare.png"), title=title, band="std", formats=("png",),
                       dpi=dpi)


def main(argv):
    dpi = 110
    if argv[:1] == ["--dpi"]:
        dpi, argv = int(argv[1]), argv[2:]
    dirs = argv or sorted(d for d in glob.glob(os.path.join(REPO, "results", "*", "*")) if os.path.isdir(d))
    for d in dirs:
        p = replot(d, dpi)
        if p:
            print(f"wrote {os.path.relpath(p, REPO)}")


if __name__ == "__main__":
    main(sys.argv[1:])
