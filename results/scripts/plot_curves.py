"""Plots one per-round metric of every method in one or more compare directories:

    PYTHONPATH=. python results/scripts/plot_curves.py [--metric global_loss|accuracy|...] [--band std|ci|none] [--dpi 90] OUT.png DIR [DIR ...]

Each DIR is a setup, results/<paper>/<setup>: its runs are read from its archive
results/runs/<paper>/<setup>.tar.xz and/or the run directories on disk (results/scripts/runstore.py).

global_loss (the default: the federated objective, log scale, with ln 10 marked) or accuracy (%).
Each method is drawn as its mean over seeds with a shaded band: ± 1 sample standard deviation
(n - 1; the default) or the 95% Student-t interval of the mean; the caption under the plot says
which, and the legend gives the number of seeds. A PNG is written at FIGURE_DPI (90, the committed
figures' resolution) and re-encoded as a palette PNG (shrink_png). Rounds FedAWARE spent in its explore warm-up
(FedAvg steps by design, from the logged phase) are shaded. The file is written through a
temporary file and a rename (no partial figure on an interrupt).
"""

from __future__ import annotations

import math
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
from fedkernels.sim.report import BANDS, atomic_path, explore_notes, explore_rounds  # noqa: E402
from fedkernels.sim.stats import t_ppf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import runstore  # noqa: E402  (archived or on-disk run directories)

FIGURE_DPI = 90  # the committed figures (results/<paper>/<setup>/*.png; replot.py, this script): small and readable


def shrink_png(path):
    """Re-encodes a figure as a 256-colour palette PNG (same pixels size and dpi, colours within a few
    levels: about a third of the bytes), atomically. The committed figures are stored this way."""
    from PIL import Image

    with Image.open(path) as im:
        im.load()
        dpi = im.info.get("dpi")
        rgb = im.convert("RGBA")
    white = Image.new("RGBA", rgb.size, (255, 255, 255, 255))
    q = (
        Image.alpha_composite(white, rgb)
        .convert("RGB")
        .quantize(256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    )
    with atomic_path(path) as tmp:
        q.save(tmp, format="PNG", optimize=True, **({"dpi": dpi} if dpi else {}))
    return path


def load(run):
    """The per-round records of run directory ``run`` (<setup>/<label>-s<seed>, on disk or archived)."""
    return runstore.open_setup(os.path.dirname(run)).metrics(os.path.basename(run))


def curves(setup_dir, metric="global_loss"):
    """{label: [(rounds, values, explore rounds) per seed]} of one compare directory."""
    out = {}
    files = runstore.open_setup(setup_dir)
    for run in files.runs():
        label = run.rsplit("-s", 1)[0]
        ms = files.metrics(run)
        pts = [
            (m["round"], m[metric]) for m in ms if isinstance(m.get(metric), (int, float)) and math.isfinite(m[metric])
        ]
        if pts:
            out.setdefault(label, []).append((dict(pts), explore_rounds(ms)))
    return out


def main(argv):
    metric, band, dpi = "global_loss", "std", FIGURE_DPI
    while argv[:1] and argv[0].startswith("--"):
        if argv[0] == "--metric":
            metric, argv = argv[1], argv[2:]
        elif argv[0] == "--band":
            band, argv = argv[1], argv[2:]
        elif argv[0] == "--dpi":
            if len(argv) < 2 or not argv[1].isdigit() or int(argv[1]) < 1:
                print(
                    f"plot_curves: --dpi={argv[1] if len(argv) > 1 else ''!r}; expected a positive integer",
                    file=sys.stderr,
                )
                sys.exit(2)
            dpi, argv = int(argv[1]), argv[2:]
        else:
            sys.exit(f"unknown option {argv[0]}\n{__doc__}")
    if len(argv) < 2 or band not in BANDS:
        sys.exit(__doc__)
    for d in argv[1:]:
        if not runstore.open_setup(d).runs():
            print(
                f"plot_curves: DIR={d!r} has no run directories, on disk or in {runstore.archive_path(d)}; "
                "expected a setup results/<paper>/<setup>",
                file=sys.stderr,
            )
            sys.exit(2)
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    scale = 100.0 if metric == "accuracy" else 1.0
    explore, nseeds, markers, i, clipped = {}, set(), "osD^vP*Xh<>", 0, False
    for d in argv[1:]:
        for label, runs in curves(d, metric).items():
            rounds = sorted(set.intersection(*(set(c) for c, _ in runs)))
            Y = scale * np.array([[c[r] for r in rounds] for c, _ in runs], dtype=float)
            n = len(runs)
            nseeds.add(n)
            (line,) = ax.plot(
                rounds,
                Y.mean(0),
                marker=markers[i % len(markers)],
                markersize=3,
                markevery=max(1, len(rounds) // 12),
                lw=1.2,
                label=f"{label} (n={n})",
            )
            i += 1
            if n > 1 and band != "none":
                sd = Y.std(0, ddof=1)
                h = sd if band == "std" else t_ppf(0.975, n - 1) * sd / math.sqrt(n)
                lo = Y.mean(0) - h
                if metric == "global_loss" and (lo <= 0).any():  # log axis: clip at the lowest seed
                    lo, clipped = np.where(lo <= 0, Y.min(0), lo), True
                ax.fill_between(rounds, lo, Y.mean(0) + h, alpha=0.15, color=line.get_color(), lw=0)
            explore[label] = [ex for _, ex in runs]
    spans, notes = explore_notes(explore)
    for lo, hi in spans:
        ax.axvspan(lo - 0.5, hi + 0.5, color="0.5", alpha=0.08, lw=0)
    if metric == "global_loss":
        ax.axhline(np.log(10), color="grey", lw=0.8, ls=":", label="ln 10 (start)")
        ax.set_yscale("log")
        ax.set_ylabel("global loss  Σ n_i f_i / Σ n_i")
    else:
        ax.set_ylabel("test accuracy %" if metric == "accuracy" else metric)
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    k = ",".join(str(x) for x in sorted(nseeds))
    cap = [
        f"Lines: mean over seeds (n = {k}); band: "
        + {
            "std": "± 1 sample standard deviation (n-1)",
            "ci": "95% Student-t confidence interval of the mean",
            "none": "none",
        }[band]
        + (" (log axis: the lower edge is clipped at the lowest seed where mean - sd <= 0)" if clipped else "")
        + "."
    ] + notes
    fig.text(0.01, 0.01, "\n".join(cap), fontsize=7, va="bottom", ha="left", wrap=True)
    fig.tight_layout(rect=(0, 0.03 + 0.03 * len(cap), 1, 1))
    try:
        with atomic_path(argv[0]) as tmp:
            fig.savefig(tmp, dpi=dpi, format=os.path.splitext(argv[0])[1].lstrip(".") or "png")
    finally:
        plt.close(fig)
    if argv[0].lower().endswith(".png"):
        shrink_png(argv[0])
    print(f"wrote {argv[0]}")


if __name__ == "__main__":
    main(sys.argv[1:])
