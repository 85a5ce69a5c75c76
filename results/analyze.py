"""Builds results/summary.json and results/tables.md from the `fedkernels compare` outputs under results/.

    .venv/bin/python results/analyze.py          # run from the checkout root, after the compare runs

Reads every results/<paper>/<setup>/compare.json and the per-run metrics.jsonl (mechanism statistics:
Kuramoto guard/weights, FedAWARE e-LUD, FedECADO BE steps, first-difference spikiness, rounds to a
target) and, where present, final_model.pt (FedPGVC head-weight magnitudes; read before the .pt files
are deleted).
"""
from __future__ import annotations

import glob
import json
import math
import os
import sys

import numpy as np

ROOT = os.environ.get("RESULTS_ROOT", os.path.dirname(os.path.abspath(__file__)))
TARGETS = {"kuramoto": None, "fedaware": None, "fedecado": None, "fedpgvc": 0.85, "gcfed": 0.80}


def ms(v):
    v = [x for x in v if x is not None and isinstance(x, (int, float)) and math.isfinite(x)]
    if not v:
        return None, None
    return float(np.mean(v)), float(np.std(v))


def fmt(m, s, k=100.0, nd=2):
    if m is None:
        return "n/a"
    if abs(k * m) >= 1e4 or abs(k * s) >= 1e4:
        return f"{k * m:.3g} ± {k * s:.3g}"
    return f"{k * m:.{nd}f} ± {k * s:.{nd}f}"


def load_metrics(run_dir):
    p = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(p):
        return [json.loads(l) for l in open(p) if l.strip()]
    if os.path.exists(p + ".gz"):   # committed runs keep their per-round log gzipped
        import gzip
        return [json.loads(l) for l in gzip.open(p + ".gz", "rt") if l.strip()]
    return []


def head_stats(run_dir):
    """Mean |W| of the first and the last two weight tensors of the final model. Computed from
    final_model.pt and cached in head_stats.json, which stays when the .pt files are deleted."""
    p = os.path.join(run_dir, "final_model.pt")
    cache = os.path.join(run_dir, "head_stats.json")
    if not os.path.exists(p):
        return json.load(open(cache)) if os.path.exists(cache) else None
    import torch
    d = torch.load(p, map_location="cpu", weights_only=False)
    sd = d.get("state_dict", {})
    ws = [k for k in sd if k.endswith("weight")]
    out = {}
    for k in ws[-2:]:
        out[k] = float(sd[k].abs().mean())
    for k in ws[:1]:
        out[k] = float(sd[k].abs().mean())
    with open(cache, "w") as f:
        json.dump(out, f)
    return out


def run_stats(paper, run_dir, target):
    m = load_metrics(run_dir)
    acc = [r["accuracy"] for r in m if r.get("accuracy") is not None]
    st = {"rounds": len(m)}
    if not acc:
        return st
    a = np.array(acc)
    st["final"] = float(a[-1])
    st["best"] = float(a.max())
    n10 = max(1, int(math.ceil(0.1 * len(a))))
    st["last10pct"] = float(a[-n10:].mean())
    st["last10"] = float(a[-10:].mean())
    st["last5"] = float(a[-5:].mean())
    if len(a) > 1:
        d = np.diff(a)
        st["diff_std"] = float(d.std())
        st["diff_min"] = float(d.min())
        h = np.diff(a[len(a) // 2:])
        if len(h):
            st["diff_std_2nd_half"] = float(h.std())
            st["diff_min_2nd_half"] = float(h.min())
    if target is not None:
        hit = [r["round"] for r in m if r.get("accuracy") is not None and r["accuracy"] >= target]
        st["rounds_to_target"] = hit[0] if hit else None
    gl = [r.get("global_loss") for r in m if r.get("global_loss") is not None]
    if gl:
        st["global_loss_final"] = float(gl[-1])
        st["global_loss_min"] = float(np.nanmin(gl))
        st["global_loss_first"] = float(gl[0])
    clv = [r.get("client_loss_var") for r in m if r.get("client_loss_var") is not None]
    if clv:
        st["client_loss_var_r1_10"] = float(np.mean(clv[:10]))
        st["client_loss_var_last5"] = float(np.mean(clv[-5:]))
    aggs = [r.get("agg", {}) for r in m]
    if any("guard_fired" in g for g in aggs):
        gf = [bool(g.get("guard_fired")) for g in aggs if "guard_fired" in g]
        st["guard_fired_frac"] = float(np.mean(gf))
        ratio = [g["ratio"] for g in aggs if g.get("ratio") is not None]
        if ratio:
            st["ratio_median"] = float(np.median(ratio))
        w = [np.array(g["weights"], dtype=float) for g in aggs if g.get("weights")]
        if w:
            st["max_abs_weight_max"] = float(max(np.abs(x).max() for x in w))
            st["max_abs_weight_median"] = float(np.median([np.abs(x).max() for x in w]))
            st["sum_abs_weight_median"] = float(np.median([np.abs(x).sum() for x in w]))
            st["min_weight_min"] = float(min(x.min() for x in w))
            st["neg_weight_rounds_frac"] = float(np.mean([(x < 0).any() for x in w]))
    elif any(g.get("mode") == "C" for g in aggs):
        w = [np.array(g["weights"], dtype=float) for g in aggs if g.get("weights")]
        st["max_abs_weight_median"] = float(np.median([np.abs(x).max() for x in w]))
        st["clipped_frac"] = float(np.mean([bool(g.get("clipped")) for g in aggs]))
    el = [g["elud"] for g in aggs if g.get("elud") is not None and math.isfinite(g["elud"])]
    if el:
        st["elud_mean"] = float(np.mean(el))
        ph = [g.get("phase") for g in aggs]
        st["explore_rounds"] = int(sum(1 for p in ph if p == "explore"))
        ee = [g["elud"] for g in aggs if g.get("phase") == "explore" and g.get("elud") is not None]
        ea = [g["elud"] for g in aggs if g.get("phase") != "explore" and g.get("elud") is not None]
        if ee:
            st["elud_explore_mean"] = float(np.mean(ee))
        if ea:
            st["elud_aware_mean"] = float(np.mean(ea))
    qs = [g["q"] for g in aggs if g.get("q") is not None]
    if qs:   # FedAWARE: ||sum lam_i M_i / ||M_i|| ||^2 = q (normalised Gram), FW gap and iterations
        st["q_sqrt_max"] = float(math.sqrt(max(qs)))
        its = [g["iterations"] for g in aggs if g.get("iterations") is not None]
        # stopped on the gap test before fedaware's default max_iter (1000; none of these runs change it)
        st["fw_converged_frac"] = float(np.mean([i < 1000 for i in its])) if its else None
        gaps = [g["gap"] for g in aggs if g.get("gap") is not None]
        st["fw_gap_max"] = float(max(gaps)) if gaps else None
    if any("steps" in g and "L" in g for g in aggs):
        st["be_steps_mean"] = float(np.mean([g["steps"] for g in aggs if "steps" in g]))
        st["be_rejects_mean"] = float(np.mean([g.get("rejects", 0) for g in aggs if "steps" in g]))
        st["truncated_rounds"] = int(sum(bool(g.get("truncated")) for g in aggs))
        st["L"] = float(aggs[-1]["L"])
        er = [g["max_extrap_ratio"] for g in aggs if g.get("max_extrap_ratio") is not None]
        if er:
            st["extrap_ratio_median"] = float(np.median(er))
            st["extrap_ratio_max"] = float(np.max(er))
    sh = [r.get("agg_share") for r in m if r.get("agg_share") is not None]
    if sh:
        st["agg_share"] = float(np.mean(sh))
    tl = [r.get("test_loss") for r in m]
    st["diverged"] = bool(any(not isinstance(x, (int, float)) or not math.isfinite(x) for x in tl if x is not None))
    if paper == "fedpgvc":
        h = head_stats(run_dir)
        if h:
            st["weight_mean_abs"] = h
    return st


def partial_compare(setup_dir):
    """Stand-in for compare.json when a compare job was stopped early: the finished runs' summaries."""
    runs = sorted(glob.glob(os.path.join(setup_dir, "*-s[0-9]*", "summary.json")))
    if not runs:
        return None
    methods, seeds, cfg, rounds = {}, set(), {}, None
    for sj in runs:
        s = json.load(open(sj))
        label, seed = s["name"].rsplit("-s", 1)
        seeds.add(int(seed))
        rounds = s.get("rounds")
        import yaml
        cfgf = os.path.join(os.path.dirname(sj), "config.yaml")
        if os.path.exists(cfgf):
            cfg = yaml.safe_load(open(cfgf))
        methods.setdefault(label, {"algorithm": s["algorithm"],
                                   "options": (cfg.get("algorithm") or {}).get("options", {})})
    seeds = sorted(seeds)
    for label in methods:
        methods[label]["seeds_done"] = [sd for sd in seeds if os.path.exists(
            os.path.join(setup_dir, f"{label}-s{sd}", "summary.json"))]
    return {"setup": cfg, "seeds": seeds, "rounds": rounds, "methods": methods, "partial": True}


def main():
    summary = {}
    lines = []
    for setup_dir in sorted(d for d in glob.glob(os.path.join(ROOT, "*", "*")) if os.path.isdir(d)):
        cj = os.path.join(setup_dir, "compare.json")
        paper = os.path.basename(os.path.dirname(setup_dir))
        setup = os.path.basename(setup_dir)
        c = json.load(open(cj)) if os.path.exists(cj) else partial_compare(setup_dir)
        if c is None:
            continue
        target = TARGETS.get(paper)
        cfg = c["setup"]
        ent = {"rounds": c["rounds"], "seeds": c["seeds"], "target": target, "partial": bool(c.get("partial")),
               "config": {k: cfg.get(k) for k in ("num_clients", "participation", "clients_per_round", "data",
                                                 "partition", "model", "train", "client_loss")},
               "methods": {}}
        lines.append(f"### {paper} / {setup}  ({c['rounds']} rounds, seeds {c['seeds']})\n")
        head = "| method | final acc % | best acc % | last-10% acc % | last-10-rounds acc % | first-diff std (pp) | first-diff min (pp) |"
        if target is not None:
            head += f" rounds to {int(100 * target)}% (per seed) |"
        lines.append(head)
        lines.append("|" + "---|" * (head.count("|") - 1))
        for label, r in c["methods"].items():
            runs = []
            for s in r.get("seeds_done", c["seeds"]):
                rd = os.path.join(setup_dir, f"{label}-s{s}")
                runs.append(run_stats(paper, rd, target))
            agg = {"algorithm": r["algorithm"], "options": r["options"], "per_seed": runs}
            for key in ("final", "best", "last10pct", "last10", "last5", "diff_std", "diff_min",
                        "client_loss_var_r1_10", "client_loss_var_last5", "guard_fired_frac", "ratio_median",
                        "max_abs_weight_max", "max_abs_weight_median", "sum_abs_weight_median", "min_weight_min",
                        "neg_weight_rounds_frac", "elud_mean", "extrap_ratio_median", "extrap_ratio_max", "L", "explore_rounds", "elud_explore_mean", "elud_aware_mean", "diff_std_2nd_half",
                        "diff_min_2nd_half", "be_steps_mean", "be_rejects_mean", "agg_share",
                        "clipped_frac", "global_loss_final", "global_loss_min", "q_sqrt_max",
                        "fw_converged_frac", "fw_gap_max"):
                vals = [x.get(key) for x in runs]
                if any(v is not None for v in vals):
                    mm, ss = ms(vals)
                    agg[key] = {"mean": mm, "std": ss}
            if target is not None:
                agg["rounds_to_target"] = [x.get("rounds_to_target") for x in runs]
            ent["methods"][label] = agg
            g = lambda k: agg.get(k, {"mean": None, "std": None})
            row = (f"| {label} | {fmt(g('final')['mean'], g('final')['std'])} | {fmt(g('best')['mean'], g('best')['std'])}"
                   f" | {fmt(g('last10pct')['mean'], g('last10pct')['std'])} | {fmt(g('last10')['mean'], g('last10')['std'])}"
                   f" | {fmt(g('diff_std')['mean'], g('diff_std')['std'])} | {fmt(g('diff_min')['mean'], g('diff_min')['std'])} |")
            if target is not None:
                row += " " + ",".join("-" if v is None else str(v) for v in agg["rounds_to_target"]) + " |"
            lines.append(row)
        lines.append("")
        mech = []
        for label, a in ent["methods"].items():
            bits = []
            for key, k, nd in (("global_loss_final", 1, 4), ("global_loss_min", 1, 4), ("client_loss_var_r1_10", 1, 4), ("client_loss_var_last5", 1, 4),
                               ("guard_fired_frac", 1, 3), ("ratio_median", 1, 4),
                               ("max_abs_weight_median", 1, 3), ("max_abs_weight_max", 1, 3),
                               ("sum_abs_weight_median", 1, 3), ("min_weight_min", 1, 3),
                               ("neg_weight_rounds_frac", 1, 3), ("clipped_frac", 1, 3), ("elud_mean", 1, 3),
                               ("explore_rounds", 1, 1), ("elud_explore_mean", 1, 3), ("elud_aware_mean", 1, 3), ("diff_std_2nd_half", 100, 2), ("diff_min_2nd_half", 100, 2),
                               ("q_sqrt_max", 1, 4), ("fw_converged_frac", 1, 3), ("fw_gap_max", 1, 3),
                               ("be_steps_mean", 1, 2), ("extrap_ratio_median", 1, 1), ("extrap_ratio_max", 1, 1), ("L", 1, 2), ("be_rejects_mean", 1, 2), ("agg_share", 100, 3)):
                if key in a and a[key]["mean"] is not None:
                    if key == "fw_gap_max":
                        bits.append(f"{key}={a[key]['mean']:.1e} ± {a[key]['std']:.1e}")
                        continue
                    bits.append(f"{key}={fmt(a[key]['mean'], a[key]['std'], k, nd)}")
            hs = [x.get("weight_mean_abs") for x in a["per_seed"] if x.get("weight_mean_abs")]
            if hs:
                keys = list(hs[0])
                bits.append("mean|W| " + ", ".join(f"{kk}={np.mean([h[kk] for h in hs]):.3g}" for kk in keys))
            if bits:
                mech.append(f"- {label}: " + "; ".join(bits))
        if mech:
            lines.append("Mechanism statistics (mean ± std over seeds):\n")
            lines += mech
            lines.append("")
        summary[f"{paper}/{setup}"] = ent
    with open(os.path.join(ROOT, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(ROOT, "tables.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
