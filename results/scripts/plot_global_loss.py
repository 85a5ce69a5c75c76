"""Plots the federated objective (metrics 'global_loss', mean over seeds, log scale) of every method
in one or more compare directories:

    python results/scripts/plot_global_loss.py OUT.png DIR [DIR ...]
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


def curves(setup_dir):
    out = {}
    for run in sorted(glob.glob(os.path.join(setup_dir, "*-s[0-9]*"))):
        label = os.path.basename(run).rsplit("-s", 1)[0]
        p = os.path.join(run, "metrics.jsonl")
        lines = gzip.open(p + ".gz", "rt") if os.path.exists(p + ".gz") else open(p)
        gl = [json.loads(l).get("global_loss") for l in lines if l.strip()]
        gl = [np.nan if v is None else v for v in gl]
        out.setdefault(label, []).append(gl)
    return out


def main(argv):
    if len(argv) < 2:
        sys.exit(__doc__)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for d in argv[1:]:
        for label, runs in curves(d).items():
            n = min(len(r) for r in runs)
            m = np.nanmean(np.array([r[:n] for r in runs], dtype=float), axis=0)
            ax.plot(np.arange(1, n + 1), m, label=f"{label} ({len(runs)} seeds)")
    ax.axhline(np.log(10), color="grey", lw=0.8, ls=":", label="ln 10 (start)")
    ax.set_yscale("log")
    ax.set_xlabel("round")
    ax.set_ylabel("global loss  sum n_i f_i / sum n_i")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(argv[0], dpi=110)
    print(f"wrote {argv[0]}")


if __name__ == "__main__":
    main(sys.argv[1:])
