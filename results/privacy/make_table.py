"""The privacy-utility table and figure of results/privacy from the sweep's compare outputs.

    python results/privacy/make_table.py [RUNS_DIR]      # default: runs/privacy (run_all.sh's outputs)

Reads RUNS_DIR/compare-{nonprivate,8,4,2,1}/compare.json (whatever exists), writes beside this script:
table.md, summary.json, privacy_utility.png/.pdf.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
LEVELS = ["nonprivate", "8", "4", "2", "1"]


def _noise_multiplier(run_dir: str):
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            first = json.loads(f.readline())
        return first.get("agg", {}).get("dp_noise_multiplier")
    except OSError:
        return None


def main(runs: str = "runs/privacy") -> None:
    rows = []
    for lv in LEVELS:
        path = os.path.join(runs, f"compare-{lv}", "compare.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            d = json.load(f)
        for label, m in d["methods"].items():
            st = m["stats"]["final_accuracy"]
            runs_ = [r for r in m.get("runs", []) if "error" not in r]
            rows.append(
                {
                    "target_epsilon": None if lv == "nonprivate" else float(lv),
                    "method": label,
                    "n_seeds": m["n_seeds"],
                    "final_acc_mean": st["mean"],
                    "final_acc_std": st["std"],
                    "final_acc_ci": [st["ci_low"], st["ci_high"]],
                    "epsilon": m.get("epsilon"),
                    "noise_multiplier": _noise_multiplier(runs_[0]["run_dir"]) if runs_ else None,
                    "per_seed": [r.get("final_accuracy") for r in runs_],
                }
            )
    with open(os.path.join(HERE, "summary.json"), "w") as f:
        json.dump(rows, f, indent=1)
    lines = [
        "| target epsilon | method | seeds | final accuracy % (mean ± sd) | epsilon reached | noise multiplier z |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        sd = "" if r["final_acc_std"] is None else f" ± {100 * r['final_acc_std']:.2f}"
        lines.append(
            f"| {'none' if r['target_epsilon'] is None else r['target_epsilon']:g} | {r['method']} | "
            f"{r['n_seeds']} | {100 * r['final_acc_mean']:.2f}{sd} | "
            f"{'-' if r['epsilon'] is None else format(r['epsilon'], '.3f')} | "
            f"{'-' if r['noise_multiplier'] is None else format(r['noise_multiplier'], '.3f')} |"
            if r["target_epsilon"] is not None
            else f"| none | {r['method']} | {r['n_seeds']} | {100 * r['final_acc_mean']:.2f}{sd} | - | - |"
        )
    with open(os.path.join(HERE, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for method in dict.fromkeys(r["method"] for r in rows):
        pts = sorted((r["target_epsilon"], r) for r in rows if r["method"] == method and r["target_epsilon"])
        if pts:
            ax.errorbar(
                [e for e, _ in pts],
                [100 * r["final_acc_mean"] for _, r in pts],
                yerr=[100 * (r["final_acc_std"] or 0) for _, r in pts],
                marker="o",
                capsize=3,
                label=method,
            )
        base = [r for r in rows if r["method"] == method and r["target_epsilon"] is None]
        if base:
            ax.axhline(100 * base[0]["final_acc_mean"], ls=":", lw=1, color=ax.lines[-1].get_color() if pts else None)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("epsilon (delta = 1e-5), 30 rounds")
    ax.set_ylabel("final test accuracy %")
    ax.set_title("Fashion-MNIST, 100 of 1000 clients/round, central DP, C = 1\n(dotted: non-private)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    for ext in ("png", "pdf"):
        fig.savefig(os.path.join(HERE, f"privacy_utility.{ext}"), dpi=150)


if __name__ == "__main__":
    main(*sys.argv[1:])
