"""Runs several methods (and seeds) on one setup and tabulates them (``fedkernels compare``)."""
from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import algorithms
from .config import RunConfig
from .report import json_safe, plot_curves
from .server import Simulation


def _ms(vals: Sequence[Optional[float]]) -> Tuple[Optional[float], Optional[float]]:
    """(mean, population std) of the finite values; std None for fewer than two."""
    v = [x for x in vals if isinstance(x, (int, float)) and math.isfinite(x)]
    if not v:
        return None, None
    return float(np.mean(v)), (float(np.std(v)) if len(v) > 1 else None)


def _fmt(m, s, pct=True):
    if m is None:
        return "n/a"
    k = 100.0 if pct else 1.0
    return f"{k * m:.2f} ± {k * s:.2f}" if s is not None else f"{k * m:.2f}"


def compare(base: RunConfig, methods: Sequence[Tuple[str, Dict[str, Any]]], seeds: Sequence[int] = (0,),
            out_dir: str = "runs/compare", rounds: Optional[int] = None, verbose: bool = True,
            skip_unknown: bool = True, run_kwargs: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Runs every (label, {"name", "options"}) method for every seed; each run goes to
    ``out_dir/<label>-s<seed>``. Returns and writes ``out_dir/compare.json`` (per-method mean and std
    of final/best accuracy, per-run summaries) and ``out_dir/compare.png``; prints a table."""
    os.makedirs(out_dir, exist_ok=True)
    avail = set(algorithms.available())
    results: Dict[str, Any] = {}
    curves: Dict[str, List[List[Dict[str, Any]]]] = {}
    skipped = []
    for label, var in methods:
        if var["name"].lower() not in avail:
            msg = f"skipping {label!r}: algorithm {var['name']!r} is not registered (available: {', '.join(sorted(avail))})"
            if not skip_unknown:
                raise ValueError(msg)
            print(msg, flush=True)
            skipped.append(label)
            continue
        runs = []
        curves[label] = []
        for seed in seeds:
            cfg = base.copy()
            cfg.seed = int(seed)
            if rounds is not None:
                cfg.rounds = int(rounds)
            cfg.algorithm.name = var["name"]
            cfg.algorithm.options = dict(var.get("options", {}))
            cfg.name = f"{label}-s{seed}"
            cfg.out_dir = out_dir
            if verbose:
                print(f"--- {label} (seed {seed}) ---", flush=True)
            sim = Simulation(cfg, **(run_kwargs or {}))
            try:
                s = sim.run()
            except Exception as e:  # one failing method must not lose the others
                print(f"{label} (seed {seed}) failed: {type(e).__name__}: {e}", flush=True)
                s = {"error": f"{type(e).__name__}: {e}", "seed": seed}
            runs.append(s)
            curves[label].append(sim.metrics)
        fm, fs = _ms([r.get("final_accuracy") for r in runs])
        bm, bs = _ms([r.get("best_accuracy") for r in runs])
        lm, ls = _ms([r.get("mean_last_10pct") for r in runs])
        am, _ = _ms([r.get("agg_share") for r in runs])
        rt = [r.get("rounds_to_target") for r in runs]
        results[label] = {"algorithm": var["name"], "options": var.get("options", {}),
                          "final_mean": fm, "final_std": fs, "best_mean": bm, "best_std": bs,
                          "last10pct_mean": lm, "last10pct_std": ls, "agg_share_mean": am,
                          "rounds_to_target": rt, "runs": runs}
    out = {"setup": base.to_dict(), "seeds": list(seeds), "rounds": rounds or base.rounds,
           "target_accuracy": base.target_accuracy, "methods": results, "skipped": skipped}
    with open(os.path.join(out_dir, "compare.json"), "w") as f:
        json.dump(json_safe(out), f, indent=2)
    if base.plots and curves:
        out["plot"] = plot_curves({k: v for k, v in curves.items() if any(v)}, os.path.join(out_dir, "compare.png"),
                                  title=f"{base.data.name}: {len(seeds)} seed(s)")
    if verbose:
        print(format_table(out), flush=True)
    return out


def format_table(out: Dict[str, Any]) -> str:
    tgt = out.get("target_accuracy")
    head = ["method", "final acc %", "best acc %", "last-10% acc %"]
    if tgt is not None:
        head.append(f"rounds to {100 * tgt:.0f}%")
    head.append("agg share %")
    rows = []
    for label, r in out["methods"].items():
        row = [label, _fmt(r["final_mean"], r["final_std"]), _fmt(r["best_mean"], r["best_std"]),
               _fmt(r["last10pct_mean"], r["last10pct_std"])]
        if tgt is not None:
            row.append(",".join("-" if v is None else str(v) for v in r["rounds_to_target"]))
        row.append("n/a" if r["agg_share_mean"] is None else f"{100 * r['agg_share_mean']:.3f}")
        rows.append(row)
    w = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(k) for c, k in zip(cells, w))
    n = len(out.get("seeds", []))
    txt = [f"== {n} seed(s), {out.get('rounds')} rounds" + (" (mean ± std over seeds)" if n > 1 else ""), line(head),
           line(["-" * k for k in w])]
    txt += [line(r) for r in rows]
    if out.get("skipped"):
        txt.append(f"skipped (not registered): {', '.join(out['skipped'])}")
    return "\n".join(txt)
