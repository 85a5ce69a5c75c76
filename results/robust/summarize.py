"""Table and figure of the robustness grid (results/robust/grid.jsonl, written by run_grid.py).

    python results/robust/summarize.py        # -> results/robust/table.md, results/robust/robust.png

Final test accuracy per (attack, rule): mean ± sample std over the seeds present (n given); a diverged
run (a non-finite global model) counts as accuracy 0.1 (chance on 10 classes) and is marked. For Krum and
Bulyan also the mean share of rounds' selections that were attackers.
"""

from __future__ import annotations

import json
import os
import statistics
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
RULES = ["fedavg", "median", "trimmed_mean", "krum", "bulyan", "geometric_median", "centered_clip"]
ATTACKS = ["none", "sign_flip", "scale", "gaussian", "alie", "alie_z1.5", "ipm", "ipm100", "label_flip"]


def load(path=os.path.join(HERE, "grid.jsonl")):
    acc, div, sel = defaultdict(list), defaultdict(int), defaultdict(list)
    by_seed = {}
    with open(path) as f:
        for r in map(json.loads, f):
            key = (r["attack"], r["rule"])
            a = r["accuracy"]
            if r["diverged"] or a is None:
                div[key] += 1
                a = 0.1
            acc[key].append(a)
            by_seed[key + (r["seed"],)] = a
            if r.get("selected_per_round"):
                sel[key].append(statistics.mean(r["selected_per_round"]))
    load.by_seed = by_seed
    return acc, div, sel


def paired(key_a, key_b):
    """(mean difference a - b in pp over the seeds both have, two-sided paired t-test p) or None."""
    from scipy.stats import ttest_rel

    bs = load.by_seed
    seeds = sorted(s for (*k, s) in bs if tuple(k) == key_a and key_b + (s,) in bs)
    if len(seeds) < 2:
        return None
    a = [100 * bs[key_a + (s,)] for s in seeds]
    b = [100 * bs[key_b + (s,)] for s in seeds]
    d = statistics.mean(x - y for x, y in zip(a, b))
    if all(abs((x - y) - d) < 1e-12 for x, y in zip(a, b)):
        return d, 0.0 if d else 1.0
    return d, float(ttest_rel(a, b).pvalue)


def paired_table() -> str:
    lines = [
        "Paired differences over the seeds (same seed: same partition, attackers, sampling), in pp, "
        "two-sided paired t-test p: the rule under the attack minus the same rule without attack.",
        "",
        "| attack | " + " | ".join(RULES) + " |",
        "|---" * (len(RULES) + 1) + "|",
    ]
    for a in ATTACKS[1:]:
        row = []
        for r in RULES:
            t = paired((a, r), ("none", r))
            row.append("–" if t is None else f"{t[0]:+.1f} (p={t[1]:.2g})")
        lines.append(f"| {a} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def cell(v, d):
    if not v:
        return "–"
    m = 100 * statistics.mean(v)
    s = 100 * statistics.stdev(v) if len(v) > 1 else 0.0
    return f"{m:.1f} ± {s:.1f}" + (f" ({d} div.)" if d else "")


def table(acc, div, sel) -> str:
    seeds = sorted({len(v) for v in acc.values()})
    lines = [
        f"Final test accuracy (%), mean ± std over seeds (n = {'/'.join(map(str, seeds))}); "
        "Fashion-MNIST, 15 clients, 3 attackers (20%).",
        "",
        "| attack | " + " | ".join(RULES) + " |",
        "|---" * (len(RULES) + 1) + "|",
    ]
    for a in ATTACKS:
        lines.append(f"| {a} | " + " | ".join(cell(acc.get((a, r), []), div.get((a, r), 0)) for r in RULES) + " |")
    lines += [
        "",
        "Attackers among the selected clients (mean per round; Krum picks 1, Bulyan 9 of 15):",
        "",
        "| attack | krum | bulyan |",
        "|---|---|---|",
    ]
    for a in ATTACKS[1:]:
        row = []
        for r in ("krum", "bulyan"):
            v = sel.get((a, r), [])
            row.append(f"{statistics.mean(v):.2f}" if v else "–")
        lines.append(f"| {a} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def figure(acc, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(12, 4.8))
    w = 0.8 / len(RULES)
    x = np.arange(len(ATTACKS))
    for i, r in enumerate(RULES):
        m = [100 * statistics.mean(acc[(a, r)]) if acc.get((a, r)) else np.nan for a in ATTACKS]
        s = [100 * statistics.stdev(acc[(a, r)]) if len(acc.get((a, r), [])) > 1 else 0 for a in ATTACKS]
        ax.bar(x + (i - len(RULES) / 2 + 0.5) * w, m, w, yerr=s, label=r, capsize=2)
    ax.set_xticks(x, ATTACKS)
    ax.set_ylabel("final test accuracy (%)")
    ax.set_ylim(0, 100)
    ax.axhline(10, color="gray", lw=0.8, ls=":")
    ax.set_title("Fashion-MNIST, 20% attackers, 20 rounds: rule x attack (mean ± std over seeds)")
    ax.legend(ncol=len(RULES), fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    acc, div, sel = load()
    t = table(acc, div, sel) + "\n" + paired_table()
    with open(os.path.join(HERE, "table.md"), "w") as f:
        f.write(t)
    figure(acc, os.path.join(HERE, "robust.png"))
    print(t)


if __name__ == "__main__":
    main()
