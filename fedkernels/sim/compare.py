"""Runs several methods (and seeds) on one setup and tabulates them (``fedkernels compare``).

Every method and option, every run's config and the data set are checked before the first run
(:mod:`.options`, :mod:`.checks`); a bad one is a ValueError naming it (exit 2 on the command line).
Each run goes to ``out_dir/<label>-s<seed>``. Compare resumes: a run folder holding a finished run
of the same config is reused, an interrupted one continues from its checkpoint, and one holding
another config (e.g. another ``rounds``) stops the compare before its first run (give it its own
``out_dir``). Tables are never replaced by worse ones (more failed runs, or every run failed).
The results are written as ``compare.json`` and as tables ``compare.csv`` (one row per method and
metric), ``compare.md`` and ``compare.tex``, with the sample std over seeds (n - 1), a 95% Student-t
CI and, since runs with the same seed share the partition and the client-sampling stream, the paired
difference to the baseline method with its 95% CI and paired-t p value; ``compare.png`` (+ .pdf,
.svg) plots the curves (:func:`.report.plot_curves`).

:func:`method_stats` and :func:`write_tables` are also used by ``results/analyze.py`` on committed
run logs.
"""

from __future__ import annotations

import csv
import glob
import io
import json
import os
import statistics
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from . import stats
from .config import RunConfig, dir_label
from .options import check_algorithm, check_method
from .provenance import auto_threads
from .report import describe_setup, json_safe, plot_curves, write_json_atomic, write_text_atomic

# (summary key, table heading): accuracy metrics, in percent, compared pairwise with the baseline
METRICS: Tuple[Tuple[str, str], ...] = (
    ("final_accuracy", "final acc"),
    ("best_accuracy", "best acc"),
    ("mean_last_10pct_rounds", "mean acc, last 10% of rounds"),
    ("mean_last_10_rounds", "mean acc, last 10 rounds"),
)
# metrics shown in the Markdown/LaTeX tables (the CSV has all)
HEADLINE = ("final_accuracy", "mean_last_10pct_rounds")

Method = Union[str, Tuple[str, Dict[str, Any]]]


def resolve_methods(
    methods: Sequence[Method], known: Optional[Mapping[str, Dict[str, Any]]] = None
) -> List[Tuple[str, Dict[str, Any]]]:
    """``[(label, {"name", "options"})]`` from labels/specs or pairs, every one validated (algorithm
    registered, options valid for its constructor); ValueError naming the first bad one."""
    out: List[Tuple[str, Dict[str, Any]]] = []
    for m in methods:
        if isinstance(m, str):
            label, var = check_method(m, known)
        else:
            label, var = m
            var = {"name": var.get("name"), "options": dict(var.get("options") or {})}
            check_algorithm(var["name"], var["options"], where=f"method {label!r}")
        out.append((label, var))
    labels = [dir_label(lab) for lab, _ in out]
    dup = sorted({lab for lab in labels if labels.count(lab) > 1})
    if dup:
        raise ValueError(
            f"methods: label {dup[0]!r} given twice (each label names one run directory per seed; "
            f"'/' in a label counts as '_')"
        )
    if not out:
        raise ValueError("methods: none given")
    return out


def _check_seeds(seeds: Sequence[Any]) -> List[int]:
    out = []
    for s in seeds:
        if isinstance(s, bool) or not isinstance(s, int):
            raise ValueError(f"seeds: {s!r} is not an integer")
        out.append(int(s))
    if not out:
        raise ValueError("seeds: none given")
    if len(set(out)) != len(out):
        raise ValueError(f"seeds: {out} repeats a seed")
    return out


def method_stats(
    runs: Mapping[str, Mapping[int, Optional[Mapping[str, Any]]]],
    baseline: Optional[str],
    conf: float = 0.95,
    metrics: Sequence[Tuple[str, str]] = METRICS,
) -> Dict[str, Dict[str, Any]]:
    """Per method label: ``{"n_seeds", "stats": {metric: stats.describe}, "paired": {metric:
    stats.paired vs baseline}}`` from ``runs[label][seed] = summary`` (None: a failed run)."""
    if baseline is not None and baseline not in runs:
        raise ValueError(f"baseline {baseline!r} is not one of the methods: {', '.join(runs)}")
    out: Dict[str, Dict[str, Any]] = {}
    for label, by_seed in runs.items():
        vals = {k: {s: (r.get(k) if r else None) for s, r in by_seed.items()} for k, _ in metrics}
        st = {k: stats.describe(list(v.values()), conf) for k, v in vals.items()}
        pr = {}
        if baseline is not None and label != baseline:
            base = runs[baseline]
            for k, _ in metrics:
                bv = {s: (r.get(k) if r else None) for s, r in base.items()}
                pr[k] = stats.paired(vals[k], bv, conf)
        out[label] = {
            "n_seeds": sum(1 for r in by_seed.values() if r),
            "seeds": list(by_seed),
            "stats": st,
            "paired": pr,
        }
    return out


def compare(
    base: RunConfig,
    methods: Sequence[Method],
    seeds: Sequence[int] = (0,),
    out_dir: str = "runs/compare",
    rounds: Optional[int] = None,
    verbose: bool = True,
    run_kwargs: Optional[Dict[str, Any]] = None,
    baseline: Optional[str] = None,
    known: Optional[Mapping[str, Dict[str, Any]]] = None,
    title: Optional[str] = None,
    band: str = "std",
    preset: Optional[str] = None,
) -> Dict[str, Any]:
    """Runs every method for every seed (``out_dir/<label>-s<seed>``) and writes ``compare.json``,
    ``compare.csv``, ``compare.md``, ``compare.tex`` and the figure. ``methods`` are labels/specs
    (resolved with ``known``, a preset's variants) or ``(label, {"name", "options"})`` pairs; all
    are validated before the first run. ``title`` (default: :func:`describe_setup`, naming ``preset``)
    heads the figure; ``band`` is its band: sample std, 95% CI or none. ``baseline`` (default: ``fedavg`` when compared, else the
    first method) is the reference of the paired differences. A run that fails is recorded
    (``failed``) and the others go on. Returns the compare.json content."""
    from .simulation import Simulation

    meths = resolve_methods(methods, known)
    seeds = _check_seeds(list(seeds))
    labels = [lab for lab, _ in meths]
    if baseline is None:
        baseline = "fedavg" if "fedavg" in labels else labels[0]
    elif baseline not in labels:
        raise ValueError(f"baseline={baseline!r}: not one of the compared methods ({', '.join(labels)})")
    if band not in ("std", "ci", "none"):
        raise ValueError(f"band={band!r}: expected 'std', 'ci' or 'none'")
    base = base.copy()
    if rounds is not None:
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
            raise ValueError(f"rounds={rounds!r}: expected an integer >= 1")
        base.rounds = int(rounds)
    base.validate()
    why_threads = None
    if base.threads is None and not base.distributed:  # chosen once for every run (part of each one's config)
        base.threads = _existing_threads(out_dir)
        why_threads = f"{base.threads} thread(s) per process, as the runs already in {out_dir}"
        if not base.threads:
            base.threads, why_threads = auto_threads(base.workers)
        if verbose:
            print(f"threads: {why_threads}", flush=True)
    title = title or describe_setup(base, seeds, preset)
    plan = _plan(base, meths, seeds, out_dir, run_kwargs)  # every check before the first run
    os.makedirs(out_dir, exist_ok=True)

    total = len(meths) * len(seeds)
    runs: Dict[str, Dict[int, Optional[Dict[str, Any]]]] = {lab: {} for lab in labels}
    curves: Dict[str, List[List[Dict[str, Any]]]] = {lab: [] for lab in labels}
    failed: List[Dict[str, Any]] = []
    t0 = time.perf_counter()
    k = 0
    for label, seed, cfg, state in plan:
        k += 1
        tr = time.perf_counter()
        if state == "done":  # a finished run of this very config (an earlier compare): reused
            s, metrics = _finished(os.path.join(out_dir, cfg.name))
            if verbose:
                print(f"[{k}/{total}] {label} (seed {seed}): finished earlier, reused", flush=True)
        else:
            if verbose:
                print(
                    f"[{k}/{total}] {label} (seed {seed}) ..."
                    + (" (resumed from its checkpoint)" if state == "resume" else ""),
                    flush=True,
                )
            where = {"run_dir": os.path.join(out_dir, cfg.name), "resume": True} if state == "resume" else {}
            sim = Simulation(cfg, **{**(run_kwargs or {}), **where})
            sim.threads_choice = why_threads
            try:
                s = sim.run()
            except KeyboardInterrupt:
                raise
            except Exception as e:  # noqa: BLE001 - one failing run must not lose the others
                msg = f"{type(e).__name__}: {' '.join(str(e).split())}"
                print(f"[{k}/{total}] {label} (seed {seed}) FAILED: {msg}", flush=True)
                failed.append({"method": label, "seed": seed, "error": msg})
                s = None
            metrics = list(sim.metrics)
        runs[label][seed] = s
        curves[label].append(metrics)
        el = time.perf_counter() - t0
        eta = el / k * (total - k)
        acc = s.get("final_accuracy") if s else None
        print(
            f"[{k}/{total}] done {label} (seed {seed}) in {time.perf_counter() - tr:.0f}s"
            + (f", final acc {100 * acc:.2f}%" if isinstance(acc, (int, float)) else "")
            + f"; elapsed {_hms(el)}, ETA {_hms(eta)}",
            flush=True,
        )

    st = method_stats(runs, baseline)
    methods_out: Dict[str, Any] = {}
    for label, var in meths:
        methods_out[label] = {
            "algorithm": var["name"],
            "options": var.get("options", {}),
            **st[label],
            "rounds_to_target": [(runs[label][s] or {}).get("rounds_to_target") for s in seeds],
            "timing": _timing(runs[label].values()),
            "epsilon": _epsilon(runs[label].values()),
            "runs": [runs[label][s] or {"error": _err(failed, label, s), "seed": s} for s in seeds],
        }
    out: Dict[str, Any] = {
        "preset": preset,
        "title": title,
        "setup": base.to_dict(),
        "seeds": seeds,
        "rounds": base.rounds,
        "target_accuracy": base.target_accuracy,
        "baseline": baseline,
        "conf": 0.95,
        "notes": {
            "std": "sample standard deviation over seeds (n - 1)",
            "ci": "95% Student-t interval of the mean over seeds",
            "paired": "method - baseline per seed (same partition and sampling stream), mean, 95% CI "
            "and two-sided paired t-test p value",
        },
        "methods": methods_out,
        "failed": failed,
        "wall_s": time.perf_counter() - t0,
    }
    keep = _better_tables(out_dir, out)
    if keep:  # never replace an earlier compare's tables with worse ones
        out["kept"] = keep
        print(f"compare: {keep}", flush=True)
        return out
    write_json_atomic(os.path.join(out_dir, "compare.json"), out)
    out["tables"] = write_tables(out, os.path.join(out_dir, "compare"))
    if base.plots:
        out["plot"] = plot_curves(
            {lab: c for lab, c in curves.items() if any(c)},
            os.path.join(out_dir, "compare.png"),
            title=title,
            band=band,
        )
    if verbose:
        print(format_table(out), flush=True)
    return out


def _existing_threads(out_dir: str) -> Optional[int]:
    """The thread count of the runs an earlier compare left in ``out_dir`` (so that a resumed compare
    keeps their config), or None."""
    for p in sorted(glob.glob(os.path.join(out_dir, "*", "config.yaml"))):
        try:
            t = RunConfig.from_yaml(p).threads
        except (OSError, ValueError):
            continue
        if t:
            return int(t)
    return None


def _plan(base: RunConfig, meths, seeds, out_dir: str, run_kwargs) -> List[Tuple[str, int, RunConfig, str]]:
    """``(label, seed, config, state)`` of every run, state ``new`` | ``resume`` (an interrupted run of
    the same config with a checkpoint) | ``done`` (a finished run of the same config: reused), after
    every check that can be made before the first run: each run's config and options, the data set
    (found and readable), the output folder (writable, and no run folder holding another config)."""
    from .checkpoint import completed_rounds, config_diff, list_checkpoints, read_summary
    from .checks import check_run
    from .config import PRESENTATION_KEYS
    from .report import check_writable_dir

    check_writable_dir(out_dir, "compare folder")
    plan, clash = [], []
    for label, var in meths:
        for seed in seeds:
            cfg = base.copy()
            cfg.seed = int(seed)
            cfg.algorithm.name = var["name"]
            cfg.algorithm.options = dict(var.get("options", {}))
            cfg.name = f"{dir_label(label)}-s{seed}"
            cfg.out_dir = out_dir
            kw = run_kwargs or {}
            check_run(
                cfg,
                data_set=kw.get("train") is None or kw.get("test") is None,
                partition=kw.get("client_indices") is None,
                model=kw.get("model_fn") is None,
            )
            run_dir = os.path.join(out_dir, cfg.name)
            state = "new"
            if os.path.exists(os.path.join(run_dir, "config.yaml")):
                try:
                    old = RunConfig.from_yaml(os.path.join(run_dir, "config.yaml")).to_dict()
                    diff = config_diff(old, cfg.to_dict(), free=PRESENTATION_KEYS)
                except ValueError:
                    diff = ["<unreadable config.yaml>"]
                if diff:
                    clash.append((run_dir, diff))
                elif (
                    completed_rounds(run_dir) >= cfg.rounds
                    and read_summary(run_dir) is not None
                    and os.path.exists(os.path.join(run_dir, "metrics.jsonl"))
                ):
                    state = "done"
                elif list_checkpoints(os.path.join(run_dir, "checkpoints")):
                    state = "resume"
            plan.append((label, int(seed), cfg, state))
    if clash:
        run_dir, diff = clash[0]
        raise ValueError(
            f"{run_dir} holds a run with another config ({', '.join(diff[:4])}"
            f"{', ...' if len(diff) > 4 else ''}){f' (and {len(clash) - 1} more run folders)' if len(clash) > 1 else ''}; "
            f"nothing was run. Give this compare its own folder with --out DIR"
        )
    kw = run_kwargs or {}
    if (kw.get("train") is None or kw.get("test") is None) and any(st != "done" for *_, st in plan):
        _probe_data(base)
    return plan


def _probe_data(cfg: RunConfig) -> None:
    """Loads a few examples of the config's data set: a missing or unreadable one stops the compare
    before its first run (DatasetNotFoundError: where it was looked for, how to get it)."""
    from .data import load_dataset

    kw = dict(cfg.data.options)
    kw.update(max_train=50, max_test=50)
    load_dataset(cfg.data.name, root=cfg.data.root, **kw)


def _finished(run_dir: str) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    """(summary, metrics) of a finished run folder."""
    from .checkpoint import read_summary

    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f if line.strip()]
    return read_summary(run_dir) or {}, metrics


def _better_tables(out_dir: str, out: Mapping[str, Any]) -> Optional[str]:
    """Why the tables already in ``out_dir`` are kept instead of ``out``'s (None: write ``out``'s): a
    compare in which every run failed writes no tables; one with failed runs does not replace tables
    of the same methods and seeds with fewer failures."""
    n_failed = len(out.get("failed") or [])
    n_runs = sum(len(m.get("runs") or []) for m in out["methods"].values())
    old_path = os.path.join(out_dir, "compare.json")
    if n_failed == 0:
        return None
    if n_failed >= n_runs:
        return "every run failed: no tables written" + (
            f"; the earlier tables in {out_dir} are kept" if os.path.exists(old_path) else ""
        )
    try:
        with open(old_path) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return None
    if len(old.get("failed") or []) < n_failed:
        return (
            f"{n_failed} run(s) failed: the earlier tables in {out_dir} (with {len(old.get('failed') or [])} "
            "failed) are kept; this compare's runs are in their folders"
        )
    return None


def _err(failed, label, seed):
    return next((f["error"] for f in failed if f["method"] == label and f["seed"] == seed), None)


def _epsilon(summaries) -> Optional[float]:
    """A DP method's epsilon after its last round (the largest over its seeds; None: not a DP run)."""
    eps = [s["epsilon"] for s in summaries if s and s.get("epsilon") is not None]
    return max(eps) if eps else None


def _eps_cell(r: Mapping[str, Any]) -> str:
    e = r.get("epsilon")
    return "-" if e is None else f"{e:.3g}"


def _hms(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def _timing(summaries) -> Dict[str, Any]:
    """Median over seeds of the round-1 time and of the median later-round time; mean aggregation share."""
    ok = [s for s in summaries if s]

    def med(key):
        v = stats.finite([s.get(key) for s in ok])
        return float(statistics.median(v)) if v else None

    return {
        "t_round1_s": med("t_round1_s"),
        "t_round_median_s": med("t_round_median_s"),
        "agg_share": stats.describe([s.get("agg_share") for s in ok])["mean"],
    }


# ---- tables --------------------------------------------------------------------------------------------
def _pct(v, digits=2):
    return "" if v is None else f"{100 * v:.{digits}f}"


def _p(v):
    if v is None:
        return ""
    return f"{v:.2g}" if v >= 1e-3 else f"{v:.1e}"


def table_rows(out: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """Long-format rows (one per method and metric) of a compare result: mean, sample std, CI, and
    the paired difference to the baseline (in accuracy fractions, not percent), per-seed values."""
    rows = []
    for label, r in out["methods"].items():
        for key, _ in METRICS:
            d = r["stats"][key]
            p = (r.get("paired") or {}).get(key) or {}
            vals = [x.get(key) if "error" not in x else None for x in r.get("runs", [])]
            rows.append(
                {
                    "method": label,
                    "algorithm": r.get("algorithm"),
                    "options": json.dumps(r.get("options") or {}),
                    "metric": key,
                    "n": d["n"],
                    "mean": d["mean"],
                    "std": d["std"],
                    "ci_low": d["ci_low"],
                    "ci_high": d["ci_high"],
                    "baseline": None if label == out.get("baseline") else out.get("baseline"),
                    "diff_mean": p.get("mean_diff"),
                    "diff_std": p.get("std_diff"),
                    "diff_ci_low": p.get("ci_low"),
                    "diff_ci_high": p.get("ci_high"),
                    "diff_n": p.get("n"),
                    "t": p.get("t"),
                    "p": p.get("p"),
                    "significant": p.get("significant"),
                    "values": json.dumps(json_safe(vals)),
                }
            )
    return rows


def _mean_sd(d):
    return stats.fmt_mean_ci(d, 100)


def _ci(d):
    return "" if d.get("ci_low") is None else f"[{_pct(d['ci_low'])}, {_pct(d['ci_high'])}]"


def _diff(p):
    if not p or p.get("mean_diff") is None:
        return ""
    s = f"{100 * p['mean_diff']:+.2f}"
    if p.get("ci_low") is not None:
        s += f" [{100 * p['ci_low']:+.2f}, {100 * p['ci_high']:+.2f}]"
    return s


def _sig(p):
    if not p or p.get("significant") is None:
        return "n/a" if p else ""
    return "yes" if p["significant"] else "no"


def markdown_table(out: Mapping[str, Any]) -> str:
    """The headline metrics as a Markdown table with its legend."""
    base = out.get("baseline")
    head = ["method", "seeds"]
    for key in HEADLINE:
        name = dict(METRICS)[key]
        head += [f"{name} % (mean ± sd)", "95% CI", f"Δ vs {base} (pp) [95% CI]", "p", "sig."]
    dp = any(r.get("epsilon") is not None for r in out["methods"].values())
    head += ["round 1 s", "median round s", "agg share %"] + (["epsilon"] if dp else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for label, r in out["methods"].items():
        row = [label, str(r.get("n_seeds", ""))]
        for key in HEADLINE:
            d, p = r["stats"][key], (r.get("paired") or {}).get(key)
            row += [_mean_sd(d), _ci(d), _diff(p) if label != base else "(baseline)", _p((p or {}).get("p")), _sig(p)]
        t = r.get("timing") or {}
        row += [
            "" if t.get("t_round1_s") is None else f"{t['t_round1_s']:.2f}",
            "" if t.get("t_round_median_s") is None else f"{t['t_round_median_s']:.2f}",
            _pct(t.get("agg_share"), 3),
        ] + ([_eps_cell(r)] if dp else [])
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    lines.append(legend(out))
    return "\n".join(lines) + "\n"


def legend(out: Mapping[str, Any]) -> str:
    n = len(out.get("seeds", []))
    return (
        f"{n} seed(s) ({', '.join(map(str, out.get('seeds', [])))}), {out.get('rounds')} rounds. "
        "mean ± sd: sample standard deviation over seeds (n - 1); 95% CI: Student-t interval of the mean; "
        f"Δ: paired difference to {out.get('baseline')} over the same seeds (same partition and client "
        "sampling), in percentage points, with its 95% t interval; p: two-sided paired t-test; sig.: p < 0.05 "
        "(n/a with fewer than 2 paired seeds). Round 1 (warm-up) is timed apart from the median of the later "
        "rounds; the aggregation share leaves round 1 out."
    )


def _tex(s: str) -> str:
    rep = {
        "\\": r"\textbackslash{}",
        "&": r"\&",
        "%": r"\%",
        "$": r"\$",
        "#": r"\#",
        "_": r"\_",
        "{": r"\{",
        "}": r"\}",
        "~": r"\textasciitilde{}",
        "^": r"\textasciicircum{}",
    }
    return "".join(rep.get(c, c) for c in str(s))


def latex_table(out: Mapping[str, Any]) -> str:
    """A booktabs ``tabular`` of the headline metrics (mean ± sd, paired Δ with 95% CI; † p < 0.05)."""
    base = out.get("baseline")
    cols = "l" + "rr" * len(HEADLINE)
    head = ["Method"] + [
        h for key in HEADLINE for h in (f"{_tex(dict(METRICS)[key])} (\\%)", f"$\\Delta$ vs {_tex(base)} (pp)")
    ]
    lines = [
        f"% {_tex(legend(out))}",
        f"\\begin{{tabular}}{{{cols}}}",
        "\\toprule",
        " & ".join(head) + " \\\\",
        "\\midrule",
    ]
    for label, r in out["methods"].items():
        cells = [_tex(label)]
        for key in HEADLINE:
            d, p = r["stats"][key], (r.get("paired") or {}).get(key)
            ms = _mean_sd(d).replace("±", "$\\pm$")
            cells.append(ms)
            if label == base:
                cells.append("--")
            else:
                c = _diff(p) or "n/a"
                if p and p.get("significant"):
                    c += "$^\\dagger$"
                cells.append(c)
        lines.append(" & ".join(cells) + " \\\\")
    lines += ["\\bottomrule", "\\end{tabular}", ""]
    return "\n".join(lines)


def write_tables(out: Mapping[str, Any], stem: str) -> Dict[str, str]:
    """``STEM.csv`` (long format, all metrics), ``STEM.md`` and ``STEM.tex`` (headline metrics),
    each written atomically; returns the paths."""
    rows = table_rows(out)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]) if rows else ["method"])
    w.writeheader()
    for row in rows:
        w.writerow({k: ("" if v is None else v) for k, v in row.items()})
    paths = {"csv": stem + ".csv", "md": stem + ".md", "tex": stem + ".tex"}
    write_text_atomic(paths["csv"], buf.getvalue())
    write_text_atomic(paths["md"], markdown_table(out))
    write_text_atomic(paths["tex"], latex_table(out))
    return paths


def format_table(out: Mapping[str, Any]) -> str:
    """The terminal table: headline metrics as mean ± sample std and the paired Δ vs the baseline."""
    tgt = out.get("target_accuracy")
    base = out.get("baseline")
    head = ["method"]
    for key in HEADLINE:
        head += [f"{dict(METRICS)[key]} %", f"Δ vs {base} [95% CI]", "p"]
    if tgt is not None:
        head.append(f"rounds to {100 * tgt:.0f}%")
    dp = any(r.get("epsilon") is not None for r in out["methods"].values())
    head += ["round 1 s", "median round s", "agg share %"] + (["epsilon"] if dp else [])
    rows = []
    for label, r in out["methods"].items():
        row = [label]
        for key in HEADLINE:
            p = (r.get("paired") or {}).get(key)
            row += [
                _mean_sd(r["stats"][key]),
                "(baseline)" if label == base else (_diff(p) or "n/a"),
                _p((p or {}).get("p")),
            ]
        if tgt is not None:
            row.append(",".join("-" if v is None else str(v) for v in r.get("rounds_to_target", [])))
        t = r.get("timing") or {}
        row += [
            "n/a" if t.get("t_round1_s") is None else f"{t['t_round1_s']:.2f}",
            "n/a" if t.get("t_round_median_s") is None else f"{t['t_round_median_s']:.2f}",
            "n/a" if t.get("agg_share") is None else f"{100 * t['agg_share']:.3f}",
        ] + ([_eps_cell(r)] if dp else [])
        rows.append(row)
    w = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(k) for c, k in zip(cells, w))  # noqa: E731
    n = len(out.get("seeds", []))
    txt = [
        f"== {n} seed(s), {out.get('rounds')} rounds"
        + (" (mean ± sample std over seeds; Δ: paired difference, pp)" if n > 1 else ""),
        line(head),
        line(["-" * k for k in w]),
    ]
    txt += [line(r) for r in rows]
    for f in out.get("failed", []):
        txt.append(f"FAILED: {f['method']} seed {f['seed']}: {f['error']}")
    return "\n".join(txt)
