"""Plots one per-round metric (mean over seeds) of every method in one or more compare directories:

    python results/scripts/plot_curves.py [--metric global_loss|accuracy|...] OUT.png DIR [DIR ...]

global_loss (the default: the federated objective, log scale, with ln 10 marked) or accuracy (%).
"""
from __future__ import annotations

import glob
import gzip
import json
import os
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def curves(setup_dir, metric="global_loss"):
    out = {}
    for run in sorted(glob.glob(os.path.join(setup_dir, "*-s[0-9]*"))):
        label = os.path.basename(run).rsplit("-s", 1)[0]
        p = os.path.join(run, "metrics.jsonl")
        lines = gzip.open(p + ".gz", "rt") if os.path.exists(p + ".gz") else open(p)
        gl = [json.loads(l).get(metric) for l in lines if l.strip()]
        gl = [np.nan if v is None else v for v in gl]
        out.setdefault(label, []).append(gl)
    return out


def main(argv):
    metric = "global_loss"
    if argv[:1] == ["--metric"]:
        metric, argv = argv[1], argv[2:]
    if len(argv) < 2:
        sys.exit(__doc__)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for d in argv[1:]:
        for label, runs in curves(d, metric).items():
            n = min(len(r) for r in runs)
            m = np.nanmean(np.array([r[:n] for r in runs], dtype=float), axis=0)
            if metric == "accuracy":
                m = 100 * m
            ax.plot(np.arange(1, n + 1), m, label=f"{label} ({len(runs)} seeds)")
    if metric == "global_loss":
        ax.axhline(np.log(10), color="grey", lw=0.8, ls=":", label="ln 10 (start)")
        ax.set_yscale("log")
        ax.set_ylabel("global loss  sum n_i f_i / sum n_i")
    else:
        ax.set_ylabel("test accuracy %" if metric == "accuracy" else metric)
    ax.set_xlabel("round")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(argv[0], dpi=110)
    print(f"wrote {argv[0]}")


if __name__ == "__main__":
    main(sys.argv[1:])
