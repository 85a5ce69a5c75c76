"""Run outputs: JSON-safe conversion, atomic writes, metrics.jsonl, summary.json/csv (round 1 timed
apart), the figures (PNG at 200 dpi + PDF/SVG, Agg backend) and the partition report; written for a
simulation by its :class:`RunFiles` callback."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import sys
import tempfile
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence

import numpy as np
import torch

from .callbacks import Callback

# Keys that vary from run to run (wall-clock), left out when runs are compared for determinism.
TIMING_KEYS = (
    "t_local",
    "t_agg",
    "t_eval",
    "agg_share",
    "wall_s",
    "wall_s_session",
    "t_local_total",
    "t_agg_total",
    "t_eval_total",
    "t_round1_s",
    "t_round_median_s",
    "t_local_median_s",
    "t_agg_median_s",
    "agg_share_incl_round1",
)


def _umask() -> int:
    um = os.umask(0)
    os.umask(um)
    return um


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
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the usual mode
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


def _round_time(m: Dict[str, Any]) -> Optional[float]:
    tl, ta = _num(m.get("t_local")), _num(m.get("t_agg"))
    return None if tl is None or ta is None else tl + ta


def timing_summary(metrics: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Timing of a run with round 1 apart (its warm-up is 2-25x slower than later rounds):
    ``t_round1_s`` (local training + aggregation of round 1), ``t_round_median_s``,
    ``t_local_median_s`` and ``t_agg_median_s`` over the later rounds, ``agg_share`` = aggregation /
    (local + aggregation) summed over the later rounds (all rounds when there is only round 1),
    ``agg_share_incl_round1`` over every round, and the totals ``t_local_total``, ``t_agg_total``,
    ``t_eval_total`` over every round."""

    def tot(key):
        return sum(_num(m.get(key)) or 0.0 for m in metrics)

    first = [m for m in metrics if m.get("round") == 1]
    later = [m for m in metrics if m.get("round") != 1]

    def med(rows, fn):
        v = [x for x in (fn(m) for m in rows) if x is not None]
        return float(np.median(v)) if v else None

    def share(rows):
        tl = sum(_num(m.get("t_local")) or 0.0 for m in rows)
        ta = sum(_num(m.get("t_agg")) or 0.0 for m in rows)
        return ta / (tl + ta) if tl + ta > 0 else None

    tl, ta = tot("t_local"), tot("t_agg")
    return {
        "t_local_total": tl,
        "t_agg_total": ta,
        "t_eval_total": tot("t_eval"),
        "t_round1_s": _round_time(first[0]) if first else None,
        "t_round_median_s": med(later, _round_time),
        "t_local_median_s": med(later, lambda m: _num(m.get("t_local"))),
        "t_agg_median_s": med(later, lambda m: _num(m.get("t_agg"))),
        "agg_share": share(later) if later else share(metrics),
        "agg_share_incl_round1": (ta / (tl + ta)) if tl + ta > 0 else None,
    }


def summarize(metrics: Sequence[Dict[str, Any]], rounds: int, target: Optional[float] = None) -> Dict[str, Any]:
    """Final/best accuracy, the mean accuracy over the evaluations in the last 10% of the rounds
    (``mean_last_10pct_rounds``: rounds > R - ceil(R/10)) and in the last 10 rounds
    (``mean_last_10_rounds``: rounds > R - 10), R being the last round run (the configured ``rounds``
    sets the 10% window); rounds-to-target; timing with round 1 apart (:func:`timing_summary`)."""
    ev = [m for m in metrics if _num(m.get("accuracy")) is not None]
    acc = [m["accuracy"] for m in ev]
    s: Dict[str, Any] = {"rounds_completed": len(metrics), "rounds": rounds}
    if ev:
        b = int(np.argmax(acc))
        last = max(int(m["round"]) for m in metrics)

        def tail(window):
            return float(np.mean([m["accuracy"] for m in ev if m["round"] > last - window] or acc[-1:]))

        s.update(
            final_accuracy=acc[-1],
            final_round=ev[-1]["round"],
            final_test_loss=ev[-1].get("test_loss"),
            best_accuracy=acc[b],
            best_round=ev[b]["round"],
            mean_last_10pct_rounds=tail(max(1, int(math.ceil(0.1 * rounds)))),
            mean_last_10_rounds=tail(10),
        )
    else:
        s.update(
            final_accuracy=None,
            final_round=None,
            final_test_loss=None,
            best_accuracy=None,
            best_round=None,
            mean_last_10pct_rounds=None,
            mean_last_10_rounds=None,
        )
    s["target_accuracy"] = target
    s["rounds_to_target"] = None
    if target is not None:
        for m in ev:
            if m["accuracy"] >= target:
                s["rounds_to_target"] = m["round"]
                break
    s.update(timing_summary(metrics))
    s.update(
        excluded_total=sum(len(m.get("excluded", []) or []) for m in metrics),
        diverged=any(m.get("diverged") for m in metrics),
    )
    eps = [m["epsilon"] for m in metrics if "epsilon" in m]
    if eps:  # a DP run: the epsilon of the released models after the last round
        s["epsilon"] = eps[-1]
    return s


class RunWriter:
    """Writes a run directory: config.yaml, metrics.jsonl (one line per round), summary.json/csv,
    the figure curves.png (+ .pdf, .svg) and the partition report."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        os.makedirs(run_dir, exist_ok=True)
        self.metrics_path = os.path.join(run_dir, "metrics.jsonl")
        self.cfg = None

    def write_config(self, cfg) -> None:
        self.cfg = cfg
        write_text_atomic(os.path.join(self.run_dir, "config.yaml"), cfg.to_yaml())

    def reset_metrics(self, metrics: Iterable[Dict[str, Any]] = ()) -> None:
        with open(self.metrics_path, "w") as f:
            for m in metrics:
                f.write(json.dumps(json_safe(m)) + "\n")

    def append(self, m: Dict[str, Any]) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(json_safe(m)) + "\n")

    def write_summary(self, summary: Dict[str, Any]) -> None:
        s = json_safe(summary)
        write_json_atomic(os.path.join(self.run_dir, "summary.json"), s)
        flat = {k: v for k, v in s.items() if not isinstance(v, (dict, list))}
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=list(flat))
        w.writeheader()
        w.writerow(flat)
        write_text_atomic(os.path.join(self.run_dir, "summary.csv"), buf.getvalue())

    def plot(self, metrics: Sequence[Dict[str, Any]], title: str = "", label: Optional[str] = None) -> Optional[str]:
        """curves.png (+ .pdf, .svg); the title names the setup when the config was written."""
        cfg = self.cfg
        if cfg is not None:
            what = describe_setup(cfg)
            title = f"{title}\n{what}" if title else f"{cfg.algorithm.name}: {what}"
            label = label or cfg.algorithm.name
        return plot_curves({label or title or "run": metrics}, os.path.join(self.run_dir, "curves.png"), title=title)

    def write_partition_report(
        self, labels, parts, num_classes: Optional[int] = None, plot: bool = True
    ) -> Dict[str, Any]:
        return write_partition_report(
            self.run_dir,
            labels,
            parts,
            num_classes,
            plot=plot,
            title=describe_setup(self.cfg) if self.cfg is not None else "",
        )


def check_writable_dir(path: str, what: str = "run directory") -> None:
    """Before anything is computed: ``path`` is (or can be made) a directory this process may write
    in. ValueError (a user error: a file where a directory goes) or PermissionError / OSError(EROFS)
    (the environment), one line naming the path; nothing is created."""
    import errno

    p = os.path.abspath(path)
    if os.path.exists(p) and not os.path.isdir(p):
        raise ValueError(f"{what} {path} is a file, not a directory: choose another --name/--out (or remove it)")
    up = p
    while not os.path.exists(up):
        up = os.path.dirname(up)
    if not os.path.isdir(up):
        raise ValueError(f"{what} {path}: {up} is a file, not a directory: choose another --out/out_dir")
    try:
        ro = bool(os.statvfs(up).f_flag & os.ST_RDONLY)
    except (AttributeError, OSError):
        ro = False
    if ro:
        raise OSError(errno.EROFS, f"{what} {path}: {up} is on a read-only file system; choose another --out")
    if not os.access(up, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, f"{what} {path}: no permission to write in {up}; choose another --out")


def check_run_dir(run_dir: str, cfg, overwrite: bool = False, remove: bool = True) -> None:
    """Never overwrite another run: an existing ``run_dir`` must hold ``cfg`` (presentation keys
    aside), else a ValueError naming the differing keys; ``overwrite`` replaces it instead (its
    checkpoints are removed when ``remove``: on the main process)."""
    from .checkpoint import config_diff
    from .config import PRESENTATION_KEYS, RunConfig

    check_writable_dir(run_dir)
    old_path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(old_path):
        return
    try:
        old = RunConfig.from_yaml(old_path).to_dict()
    except (OSError, ValueError):
        old = None
    diff = ["<unreadable config.yaml>"] if old is None else config_diff(old, cfg.to_dict(), free=PRESENTATION_KEYS)
    if not diff:
        return
    if not overwrite:
        raise ValueError(
            f"run directory {run_dir} holds a run with a different config "
            f"({', '.join(diff[:4])}{', ...' if len(diff) > 4 else ''}); give another --name, "
            "--overwrite to replace it, or --resume to continue it"
        )
    if remove:
        import shutil

        shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)


class RunFiles(Callback):
    """The run directory's files, a callback of the round loop (main process, ``write_outputs``):
    config.yaml, metrics.jsonl (rewritten from the checkpoint's rounds on resume, then one line per
    round) and, on a fresh run, the partition report at the start; summary.json/csv, final_model.pt
    (unless the run was cut short before its last round) and curves.png (``plots``) at the end."""

    def __init__(self) -> None:
        self.writer: Optional[RunWriter] = None

    def on_start(self, run) -> None:
        if not (run.write_outputs and run.is_main):
            return
        self.writer = w = RunWriter(run.run_dir)
        old_rounds = None
        if run.rounds_done > 0:  # a resume: its figure titles name the rounds, which may have changed
            try:
                from .config import RunConfig

                old_rounds = RunConfig.from_yaml(os.path.join(run.run_dir, "config.yaml")).rounds
            except (OSError, ValueError):
                pass
        w.write_config(run.cfg)
        w.reset_metrics(run.metrics)
        if run.rounds_done == 0 or old_rounds != run.cfg.rounds:  # partition.json/.txt (+ .png)
            w.write_partition_report(run.labels, run.parts, plot=bool(run.cfg.plots))

    def on_round_end(self, run, metrics: Dict[str, Any]) -> None:
        if self.writer is not None:
            self.writer.append(metrics)

    def on_end(self, run, summary: Dict[str, Any]) -> None:
        if self.writer is None:
            return
        cfg = run.cfg
        if run.first_round > 0 and isinstance(summary.get("wall_s"), (int, float)):
            # a resumed run: its totals (local training, aggregation) cover every session, so does its wall time
            from .provenance import read as read_provenance

            prev = (read_provenance(run.run_dir) or {}).get("previous") or []
            before = sum(p.get("duration_s") or 0.0 for p in prev if isinstance(p, dict))
            summary["wall_s_session"] = summary["wall_s"]
            summary["wall_s"] = summary["wall_s"] + before
        self.writer.write_summary(summary)
        if run.rounds_done >= cfg.rounds or not run.cut_short:
            self.save_final_model(run)
        if cfg.plots:
            try:
                with run.figures():
                    if self.writer.plot(run.metrics, title=f"{cfg.run_name()} ({cfg.algorithm.name})") is None:
                        run.say(
                            "plots=true but matplotlib is not installed: curves.png not written "
                            "(pip install matplotlib; metrics.jsonl has every round)"
                        )
            except KeyboardInterrupt:
                if run.rounds_done < cfg.rounds:  # a complete run stays complete
                    run.figures_abandoned()
                print(
                    "interrupted while plotting: curves.png not written (metrics.jsonl has every round)",
                    file=sys.stderr,
                )
            except OSError as e:  # e.g. a full disk: the metrics, summary and model are already written
                msg = (
                    f"curves.png not written ({e.strerror or e}); metrics.jsonl, summary.json and the "
                    "checkpoints are complete: free space and plot them from metrics.jsonl"
                )
                run.note_output_error(msg)
                print(f"fedkernels run: error: {msg}", file=sys.stderr, flush=True)

    @staticmethod
    def save_final_model(run) -> str:
        """final_model.pt: the global model as a flat vector and as the model's state_dict."""
        model = run.global_model()
        path = os.path.join(run.run_dir, "final_model.pt")
        torch.save(
            {
                "flat": run.global_flat.detach().cpu().clone(),
                "state_dict": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
                "names": run.names,
                "round": run.rounds_done,
            },
            path,
        )
        return path


def write_partition_report(
    run_dir: str, labels, parts: Sequence[Any], num_classes: Optional[int] = None, plot: bool = True, title: str = ""
) -> Dict[str, Any]:
    """The partition of a run: ``partition.json`` (summary statistics, client sizes, the K x C label
    histogram), ``partition.txt`` (the table of :func:`.partition.partition_report`) and, with
    ``plot``, ``partition.png`` (+ .pdf): client sizes and per-client label mix. Returns the JSON
    content. ``labels`` are the training labels and ``parts[k]`` client k's indices into them."""
    from .partition import label_histograms, partition_report, partition_stats

    parts = [np.asarray(p.detach().cpu()) if isinstance(p, torch.Tensor) else np.asarray(p) for p in parts]
    if isinstance(labels, torch.Tensor):
        labels = labels.detach().cpu()
    H = label_histograms(labels, parts, num_classes)
    info = {
        "stats": partition_stats(labels, parts, num_classes),
        "num_classes": int(H.shape[1]),
        "sizes": [int(v) for v in H.sum(1)],
        "label_histogram": H.tolist(),
    }
    write_json_atomic(os.path.join(run_dir, "partition.json"), info)
    write_text_atomic(os.path.join(run_dir, "partition.txt"), partition_report(labels, parts, num_classes) + "\n")
    if plot:
        info_path = plot_partition(H, os.path.join(run_dir, "partition.png"), title=title)
        if info_path:
            info = dict(info, plot=info_path)
    return info


def plot_partition(
    H: np.ndarray, path: str, title: str = "", formats: Sequence[str] = ("png", "pdf"), dpi: int = 200
) -> Optional[str]:
    """Two panels from the K x C label histogram ``H``: client sizes (bars) and the label mix per
    client (stacked bars up to 60 clients, a heat map beyond). Atomic like :func:`plot_curves`."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return None
    H = np.asarray(H)
    K, C = H.shape
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4))
    x = np.arange(K)
    sizes = H.sum(1)
    a1.bar(x, sizes, color="0.4", width=0.8)
    a1.axhline(sizes.mean(), color="C3", lw=0.8, ls="--", label=f"mean {sizes.mean():.0f}")
    a1.set_xlabel("client")
    a1.set_ylabel("training examples")
    a1.set_title("client sizes", fontsize=10)
    a1.legend(fontsize=7)
    a1.xaxis.set_major_locator(MaxNLocator(integer=True))
    if K <= 60:
        cmap = plt.get_cmap("tab10" if C <= 10 else "tab20")
        bottom = np.zeros(K)
        for c in range(C):
            a2.bar(x, H[:, c], bottom=bottom, width=0.8, color=cmap(c % cmap.N), label=str(c))
            bottom += H[:, c]
        a2.set_ylabel("examples per class")
        if C <= 20:  # beside the panel: inside it would cover the last clients' bars
            a2.legend(
                title="class",
                fontsize=6,
                title_fontsize=7,
                ncol=1 if C <= 10 else 2,
                loc="upper left",
                bbox_to_anchor=(1.01, 1.0),
                borderaxespad=0.0,
            )
        a2.xaxis.set_major_locator(MaxNLocator(integer=True))
    else:
        frac = H / np.maximum(sizes[:, None], 1)
        im = a2.imshow(frac.T, aspect="auto", interpolation="nearest", cmap="viridis", origin="lower")
        fig.colorbar(im, ax=a2, label="fraction of the client's examples")
        a2.set_ylabel("class")
    a2.set_xlabel("client")
    a2.set_title("label histogram per client", fontsize=10)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    root, ext = os.path.splitext(path)
    fmt0 = ext.lstrip(".").lower() or "png"
    fmts = [fmt0] + [f for f in formats if f != fmt0]
    try:
        with contextlib.ExitStack() as stack:
            for tgt, fmt in zip([path] + [f"{root}.{f}" for f in fmts[1:]], fmts):
                fig.savefig(stack.enter_context(atomic_path(tgt)), dpi=dpi, format=fmt)
    finally:
        plt.close(fig)
    return path


# Per-round metrics the figures show, when logged: (key, axis label, scale, log axis)
PLOT_METRICS = (
    ("accuracy", "test accuracy (%)", 100.0, False),
    ("test_loss", "test loss", 1.0, False),
    ("train_loss_mean", "client train loss (mean over participants)", 1.0, False),
    ("global_loss", "global objective  Σ n_i f_i / Σ n_i", 1.0, True),
    ("client_loss_var", "variance of client losses (global model)", 1.0, True),
)
BANDS = {
    "std": "mean ± sample std over seeds (n-1)",
    "ci": "mean and 95% Student-t CI over seeds",
    "none": "mean over seeds",
}


def describe_setup(cfg, seeds: Sequence[int] = (), preset: Optional[str] = None) -> str:
    """One line saying what was run: preset, dataset, partition, clients, model, rounds, seeds."""
    p = cfg.partition
    popts = ", ".join(f"{k}={v}" for k, v in (p.options or {}).items())
    part = p.scheme + (f"({popts})" if popts else "")
    per = cfg.per_round()
    sd = ",".join(str(s) for s in seeds) if seeds else str(cfg.seed)
    return (
        f"{preset + ': ' if preset else ''}{cfg.data.name}, {part}, {cfg.num_clients} clients"
        f"{f' ({per}/round)' if per != cfg.num_clients else ''}, {cfg.model.name}, "
        f"{cfg.rounds} rounds, seed{'s' if len(seeds) > 1 else ''} {sd}"
    )


def explore_rounds(metrics: Sequence[Dict[str, Any]]) -> List[int]:
    """Rounds whose aggregation logged ``phase == "explore"`` (FedAWARE's warm-up: FedAvg steps by
    design until every client has been sampled once)."""
    return [int(m["round"]) for m in metrics if isinstance(m.get("agg"), dict) and m["agg"].get("phase") == "explore"]


def explore_notes(per_label: Dict[str, Sequence[Sequence[int]]]):
    """From ``{label: [explore rounds of each seed]}``: the round spans to shade (one per distinct
    span) and one caption line per span naming its methods."""
    groups: Dict[tuple, List[str]] = {}
    for label, seeds in per_label.items():
        lens = [(min(r), max(r)) for r in seeds if r]
        if not lens:
            continue
        lo, hi_min, hi_max = min(a for a, _ in lens), min(b for _, b in lens), max(b for _, b in lens)
        groups.setdefault((lo, hi_min, hi_max), []).append(label)
    spans, lines = [], []
    for (lo, hmin, hmax), labels in groups.items():
        spans.append((lo, hmax))
        across = f"rounds {lo}-{hmax}" if hmin == hmax else f"rounds {lo}-{hmin} to {lo}-{hmax} across seeds"
        lines.append(
            f"{', '.join(labels)}: {across} (shaded) are the explore warm-up, FedAvg steps by design "
            "(the base method's steps with an AWARE extension) until every client has been sampled once"
        )
    return spans, lines


def _band(Y: np.ndarray, band: str):
    """(low, high) of the band around the mean of the rows of Y (seeds), or None."""
    n = Y.shape[0]
    if band == "none" or n < 2:
        return None
    mu, sd = Y.mean(0), Y.std(0, ddof=1)
    if band == "std":
        return mu - sd, mu + sd
    from .stats import t_ppf

    h = t_ppf(0.975, n - 1) * sd / math.sqrt(n)
    return mu - h, mu + h


def plot_curves(
    runs: Dict[str, Any],
    path: str,
    title: str = "",
    band: Any = "std",
    formats: Sequence[str] = ("png", "pdf", "svg"),
    dpi: int = 200,
    notes: Sequence[str] = (),
) -> Optional[str]:
    """Per-round curves of every logged metric of :data:`PLOT_METRICS` (accuracy, test loss, client
    train loss, and the global objective and client-loss variance when logged). ``runs`` maps a
    label to one metrics list or a list of them (seeds): the line is the mean over seeds at the
    rounds every seed evaluated (round 0 included when logged), with markers and integer round
    ticks; ``band`` is ``"std"`` (mean ± sample std), ``"ci"`` (95% t interval) or ``"none"``, and
    the caption says which. Rounds a method spent as FedAvg by design (FedAWARE's explore warm-up,
    from the logged phase) are shaded and named in the caption; ``notes`` adds caption lines.

    Written as ``path`` (PNG, ``dpi``) and beside it in the other ``formats``; every file goes
    through a temporary file and a rename, so an interrupt leaves no partial figure. Returns
    ``path``, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return None
    if band is True or band is None:
        band = "std"
    elif band is False:
        band = "none"
    if band not in BANDS:
        raise ValueError(f"plot_curves: band={band!r}, expected one of {', '.join(BANDS)}")
    norm = {lab: (ms if ms and isinstance(ms[0], list) else [ms]) for lab, ms in runs.items()}
    norm = {lab: [mm for mm in seeds if mm] for lab, seeds in norm.items()}
    panels = [
        p
        for p in PLOT_METRICS
        if any(_num(m.get(p[0])) is not None for seeds in norm.values() for mm in seeds for m in mm)
    ]
    if not panels:
        panels = list(PLOT_METRICS[:1])
    ncol = 2 if len(panels) in (2, 4) else min(3, len(panels))
    nrow = int(math.ceil(len(panels) / ncol))
    fig, axes = plt.subplots(nrow, ncol, figsize=(5.2 * ncol, 3.9 * nrow + 0.9), squeeze=False)
    flat_axes = list(axes.ravel())
    explore: Dict[str, List[List[int]]] = {}
    any_clipped = False
    # Two methods can log identical curves (FedProx with mu = 0 and FedAvg): each method gets its
    # own marker and dash pattern (every other one hollow), and the earlier (lower) ones thicker
    # lines and larger markers, so a curve drawn over another leaves it visible around and through
    # its markers and through the gaps of its line.
    markers = "osD^vP*Xh<>"
    dashes = ("-", "--", "-.", ":")
    nseeds = sorted({len(s) for s in norm.values() if s})
    for i, (label, seeds) in enumerate(norm.items()):
        if not seeds:
            continue
        n = len(seeds)
        color = None
        for ax, (key, _, scale, _) in zip(flat_axes, panels):
            curves = [{m["round"]: m[key] for m in mm if _num(m.get(key)) is not None} for mm in seeds]
            curves = [c for c in curves if c]
            if not curves:
                continue
            rounds = sorted(set.intersection(*(set(c) for c in curves)))
            if not rounds:
                continue
            Y = scale * np.array([[c[r] for r in rounds] for c in curves], dtype=float)
            every = max(1, len(rounds) // 12)
            layer = i % len(dashes)
            (line,) = ax.plot(
                rounds,
                Y.mean(0),
                marker=markers[i % len(markers)],
                markersize=6.0 - 1.0 * layer,
                markevery=every,
                linewidth=2.2 - 0.35 * layer,
                linestyle=dashes[layer],
                color=color,
                markerfacecolor="none" if layer % 2 else None,
                markeredgewidth=1.2,
                label=f"{label} (n={len(curves)})" if len(nseeds) > 1 or n > 1 else label,
            )
            color = line.get_color()
            bd = _band(Y, band)
            if bd is not None:
                lo = bd[0]
                if (Y >= 0).all():  # a loss, variance or accuracy is never negative (nor on a log
                    clipped = lo < 0  # axis): clip mean - sd < 0 at the lowest seed
                    lo = np.where(clipped, Y.min(0), lo)
                    any_clipped = any_clipped or bool(clipped.any())
                ax.fill_between(rounds, lo, bd[1], alpha=0.18, color=color, linewidth=0)
        explore[label] = [explore_rounds(mm) for mm in seeds]
    spans, caption = explore_notes(explore)
    for lo, hi in spans:
        for ax in flat_axes[: len(panels)]:
            ax.axvspan(lo - 0.5, hi + 0.5, color="0.5", alpha=0.08, linewidth=0)
    for ax, (key, yl, _, logy) in zip(flat_axes, panels):
        ax.set_xlabel("round")
        ax.set_ylabel(yl, fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ys = [np.asarray(ln.get_ydata(), dtype=float) for ln in ax.lines]
        if ys and all(np.nanmin(y) > 0 for y in ys):
            lo_, hi_ = min(np.nanmin(y) for y in ys), max(np.nanmax(y) for y in ys)
            if logy or hi_ / lo_ > 1e3:  # a diverged run spans orders of magnitude: log axis
                ax.set_yscale("log")
        ax.grid(alpha=0.3)
    for ax in flat_axes[len(panels) :]:
        ax.set_visible(False)
    if flat_axes[0].lines:
        flat_axes[0].legend(fontsize=7)
    multi = any(len(s) > 1 for s in norm.values())
    if multi:
        k = f"{nseeds[0]}" if len(nseeds) == 1 else f"{min(nseeds)}-{max(nseeds)}"
        first = f"Lines: mean over {k} seeds (n per method in the legend)"
        if band != "none":
            first += "; shaded band: " + (
                "± 1 sample standard deviation (n-1)"
                if band == "std"
                else "95% Student-t confidence interval of the mean"
            )
    elif len([s for s in norm.values() if s]) > 1:
        first = "Lines: one run (a single seed) per method; no band (a spread needs 2 or more seeds)"
    else:
        first = "Line: one run (a single seed); no band (a spread needs 2 or more seeds)"
    if any_clipped:
        first += " (where mean - sd < 0 the lower edge is the lowest seed)"
    cap = [first + "."] + caption + list(notes)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.text(0.01, 0.01, "\n".join(cap), fontsize=7.5, va="bottom", ha="left", wrap=True)
    fig.tight_layout(rect=(0, 0.03 + 0.028 * len(cap), 1, 0.95 if title else 1))
    root, ext = os.path.splitext(path)
    fmts = [ext.lstrip(".").lower() or "png"] + [f for f in formats if f != (ext.lstrip(".").lower() or "png")]
    targets = [path] + [f"{root}.{f}" for f in fmts[1:]]
    try:
        with contextlib.ExitStack() as stack:
            for tgt, fmt in zip(targets, fmts):
                tmp = stack.enter_context(atomic_path(tgt))
                fig.savefig(tmp, dpi=dpi, format=fmt)
    finally:
        plt.close(fig)
    return path
