"""Run outputs: JSON-safe conversion, metrics.jsonl, summary.json/csv and PNG plots (Agg backend)."""
from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import tempfile
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence

import numpy as np
import torch

# Keys that vary from run to run (wall-clock), left out when runs are compared for determinism.
TIMING_KEYS = ("t_local", "t_agg", "t_eval", "agg_share", "wall_s", "t_local_total", "t_agg_total",
               "t_eval_total")


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """Yields a temporary path beside ``path``; when the block ends normally the file is renamed onto
    ``path`` (``os.replace``), otherwise (an error, a KeyboardInterrupt) it is removed, so ``path``
    holds either its previous content or the complete new one, never a partial file."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    base, ext = os.path.splitext(os.path.basename(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{base}-", suffix=f".tmp{ext}", dir=d)
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_text_atomic(path: str, text: str) -> str:
    """Writes ``text`` to ``path`` through :func:`atomic_path` (flushed and fsync'ed); returns ``path``."""
    with atomic_path(path) as tmp:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    return path


def write_json_atomic(path: str, obj: Any) -> str:
    """``obj`` (made JSON-safe) as indented JSON at ``path``, atomically."""
    return write_text_atomic(path, json.dumps(json_safe(obj), indent=2) + "\n")


def json_safe(obj: Any, max_list: int = 4096) -> Any:
    """Plain JSON values from tensors, numpy values, tuples, dataclasses... NaN/Inf become None/"inf".
    Tensors/arrays with more than ``max_list`` elements are summarised (shape, mean, norm)."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        if math.isnan(obj):
            return None
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, (np.generic,)):
        return json_safe(obj.item(), max_list)
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.numel() <= max_list:
            return json_safe(t.cpu().tolist(), max_list)
        tf = t.double()
        return {"shape": list(t.shape), "mean": json_safe(float(tf.mean())), "norm": json_safe(float(tf.norm()))}
    if isinstance(obj, np.ndarray):
        return json_safe(torch.from_numpy(np.ascontiguousarray(obj)), max_list)
    if isinstance(obj, dict):
        return {str(k): json_safe(v, max_list) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [json_safe(v, max_list) for v in obj]
    if hasattr(obj, "__dataclass_fields__"):
        import dataclasses
        return json_safe(dataclasses.asdict(obj), max_list)
    return str(obj)


def _num(v):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def summarize(metrics: Sequence[Dict[str, Any]], rounds: int, target: Optional[float] = None) -> Dict[str, Any]:
    """Final/best accuracy, mean over the last 10% of rounds and over the last 10 evaluations,
    rounds-to-target, timing totals and the aggregation share, from the per-round metrics."""
    ev = [m for m in metrics if _num(m.get("accuracy")) is not None]
    acc = [m["accuracy"] for m in ev]
    s: Dict[str, Any] = {"rounds_completed": len(metrics), "rounds": rounds}
    if ev:
        b = int(np.argmax(acc))
        cut = rounds - max(1, int(math.ceil(0.1 * rounds)))
        tail = [m["accuracy"] for m in ev if m["round"] > cut] or acc[-1:]
        s.update(final_accuracy=acc[-1], final_test_loss=ev[-1].get("test_loss"),
                 best_accuracy=acc[b], best_round=ev[b]["round"],
                 mean_last_10pct=float(np.mean(tail)), mean_last_10=float(np.mean(acc[-10:])))
    else:
        s.update(final_accuracy=None, final_test_loss=None, best_accuracy=None, best_round=None,
                 mean_last_10pct=None, mean_last_10=None)
    s["target_accuracy"] = target
    s["rounds_to_target"] = None
    if target is not None:
        for m in ev:
            if m["accuracy"] >= target:
                s["rounds_to_target"] = m["round"]
                break
    tl = sum(m.get("t_local", 0.0) or 0.0 for m in metrics)
    ta = sum(m.get("t_agg", 0.0) or 0.0 for m in metrics)
    te = sum(m.get("t_eval", 0.0) or 0.0 for m in metrics)
    s.update(t_local_total=tl, t_agg_total=ta, t_eval_total=te, agg_share=(ta / (tl + ta)) if tl + ta > 0 else None,
             excluded_total=sum(len(m.get("excluded", [])) for m in metrics),
             diverged=any(m.get("diverged") for m in metrics))
    return s


class RunWriter:
    """Writes a run directory: config.yaml, metrics.jsonl (one line per round), summary.json/csv, plots."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        os.makedirs(run_dir, exist_ok=True)
        self.metrics_path = os.path.join(run_dir, "metrics.jsonl")

    def write_config(self, cfg) -> None:
        cfg.to_yaml(os.path.join(self.run_dir, "config.yaml"))

    def reset_metrics(self, metrics: Iterable[Dict[str, Any]] = ()) -> None:
        with open(self.metrics_path, "w") as f:
            for m in metrics:
                f.write(json.dumps(json_safe(m)) + "\n")

    def append(self, m: Dict[str, Any]) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(json_safe(m)) + "\n")

    def write_summary(self, summary: Dict[str, Any]) -> None:
        s = json_safe(summary)
        with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
            json.dump(s, f, indent=2)
        flat = {k: v for k, v in s.items() if not isinstance(v, (dict, list))}
        with open(os.path.join(self.run_dir, "summary.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(flat))
            w.writeheader()
            w.writerow(flat)

    def plot(self, metrics: Sequence[Dict[str, Any]], title: str = "") -> Optional[str]:
        return plot_curves({title or "run": metrics}, os.path.join(self.run_dir, "curves.png"), title=title)


def read_metrics(path: str) -> List[Dict[str, Any]]:
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                out.append(json.loads(line))
    return out


def plot_curves(runs: Dict[str, Any], path: str, title: str = "", band: bool = True) -> Optional[str]:
    """Test accuracy and test loss against round. ``runs`` maps a label to one metrics list, or to a
    list of metrics lists (seeds: mean line and, with ``band``, a min-max band). Returns the path, or
    None when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for label, ms in runs.items():
        seeds = ms if ms and isinstance(ms[0], list) else [ms]
        for ax, key in zip(axes, ("accuracy", "test_loss", "train_loss_mean")):
            curves = []
            for mm in seeds:
                pts = [(m["round"], m[key]) for m in mm if _num(m.get(key)) is not None]
                if pts:
                    curves.append(dict(pts))
            if not curves:
                continue
            rounds = sorted(set.intersection(*(set(c) for c in curves)))
            if not rounds:
                continue
            Y = np.array([[c[r] for r in rounds] for c in curves], dtype=float)
            if key == "accuracy":
                Y = 100 * Y
            line, = ax.plot(rounds, Y.mean(0), label=label)
            if band and len(curves) > 1:
                ax.fill_between(rounds, Y.min(0), Y.max(0), alpha=0.2, color=line.get_color())
    for ax, yl in zip(axes, ("test accuracy (%)", "test loss", "client train loss (mean)")):
        ax.set_xlabel("round")
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
