"""Compressed updates on Fashion-MNIST (digits when it is missing): FedAvg with each codec, with and without
error feedback, at two compression levels, against uncompressed FedAvg, over 3 seeds; accuracy against the
bytes the clients sent. Writes runs under runs/compression/ (one directory per run, the simulator's files) and
results/compression/results.json, accuracy_vs_bytes.png, README.md's table (``--report`` rebuilds those from
results.json alone).

    nice python results/compression/run.py            # ~15 min on 2 busy cores
    python results/compression/run.py --report
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

SEEDS = (0, 1, 2)
# (label, compress section): two levels per codec, each with and without error feedback
CODECS = [("none", {})]
for kind, levels in (
    ("int8_block", ({"block": 32}, {"block": 2048})),
    ("fp8", ({"block": 32}, {"block": 2048})),
    ("qsgd", ({"levels": 16, "block": 512}, {"levels": 2, "block": 512})),
    ("topk", ({"ratio": 0.1}, {"ratio": 0.01})),
):
    for opts in levels:
        for ef in (False, True):
            tag = ",".join(f"{k}={v}" for k, v in opts.items())
            CODECS.append((f"{kind}({tag}){'+EF' if ef else ''}", dict(kind=kind, error_feedback=ef, **opts)))


def config(seed: int, comp: dict, data: str) -> dict:
    return {
        "seed": seed,
        "rounds": 20,
        "num_clients": 10,
        "client_loss": "none",
        "checkpoint_every": 0,
        "plots": False,
        "verbose": False,
        "out_dir": os.path.join(ROOT, "runs", "compression"),
        "data": {"name": data, "train_subset": 6000, "test_subset": 2000} if data == "fmnist" else {"name": data},
        "partition": {"scheme": "label_shards", "options": {"shards_per_client": 3}},
        "model": {"name": "mlp" if data == "fmnist" else "mlp_digits"},
        "train": {"epochs": 1, "batch_size": 64, "lr": 0.05, "momentum": 0.9},
        "algorithm": {"name": "fedavg"},
        "compress": comp or {"kind": "none"},
    }


def run_all() -> dict:
    import torch
    from fedkernels.sim import RunConfig, Simulation

    torch.set_num_threads(1)
    data = "fmnist" if os.path.exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz") else "digits"
    from fedkernels.errors import RunError

    out = {"data": data, "method": "fedavg", "rounds": 20, "seeds": list(SEEDS), "runs": {}}
    path = os.path.join(HERE, "results.json")
    if os.path.exists(path):  # a campaign cut short goes on where it stopped
        with open(path) as f:
            out = json.load(f)
    for label, comp in CODECS:
        for seed in SEEDS:
            if any(r["seed"] == seed for r in out["runs"].get(label, [])):
                continue
            cfg = RunConfig.from_dict(config(seed, comp, data)).validate()
            t0 = time.perf_counter()
            sim = Simulation(cfg, overwrite=True)
            try:
                sim.run()
            except RunError as e:  # e.g. every client's update NaN: the run diverged; recorded as such
                out["runs"].setdefault(label, []).append(
                    {"seed": seed, "diverged": str(e).splitlines()[0][:300], "rounds_done": len(sim.metrics)}
                )
                print(f"{label:34s} seed {seed}: diverged ({e})", flush=True)
                with open(path, "w") as f:
                    json.dump(out, f, indent=1)
                continue
            ms = sim.metrics
            d = int(sim.global_flat.numel())
            sent = sum(m.get("bytes_sent", m["num_updates"] * 4 * d) for m in ms)
            out["runs"].setdefault(label, []).append(
                {
                    "seed": seed,
                    "final_accuracy": ms[-1]["accuracy"],
                    "best_accuracy": max(m.get("accuracy", 0) for m in ms),
                    "bytes_sent": int(sent),
                    "dense_bytes": int(sum(m["num_updates"] * 4 * d for m in ms)),
                    "d": d,
                    "seconds": time.perf_counter() - t0,
                    "t_agg": sum(m["t_agg"] for m in ms),
                }
            )
            print(f"{label:34s} seed {seed}: acc {ms[-1]['accuracy']:.4f} bytes {sent / 1e6:.2f} MB", flush=True)
            with open(path, "w") as f:  # after every run: a cut-short campaign keeps what it has
                json.dump(out, f, indent=1)
    return out


def collect(res: dict) -> dict:
    """Adds each run's accuracy curve (from its run directory's metrics.jsonl, when it is there) to ``res``."""
    import yaml

    base = os.path.join(ROOT, "runs", "compression")
    want = {(label, seed): config(seed, comp, res["data"]) for label, comp in CODECS for seed in SEEDS}
    found = {}
    for name in os.listdir(base) if os.path.isdir(base) else []:
        try:
            with open(os.path.join(base, name, "config.yaml")) as f:
                cfg = yaml.safe_load(f)
            with open(os.path.join(base, name, "metrics.jsonl")) as f:
                curve = [json.loads(x).get("accuracy") for x in f if x.strip()]
        except OSError:
            continue
        for (label, seed), c in want.items():
            comp = {k: v for k, v in cfg.get("compress", {}).items() if v not in (None, False)}
            mine = {k: v for k, v in c["compress"].items() if v not in (None, False)}
            if (
                cfg["seed"] == seed
                and cfg["data"].get("train_subset") == c["data"].get("train_subset")
                and comp.get("kind", "none") == mine.get("kind")
                and comp == {**comp, **mine}
                and set(comp) <= set(mine) | {"levels"}
            ):
                found[(label, seed)] = curve
    for label, runs in res["runs"].items():
        for r in runs:
            if (label, r["seed"]) in found:
                r["accuracy_curve"] = found[(label, r["seed"])]
    return res


def _last5(r: dict) -> float:
    c = [a for a in r.get("accuracy_curve", []) if a is not None]
    return sum(c[-5:]) / len(c[-5:]) if c else r["final_accuracy"]


def report(res: dict) -> None:
    import numpy as np

    rows = []
    for label, runs in res["runs"].items():
        diverged = [r for r in runs if "diverged" in r]
        runs = [r for r in runs if "diverged" not in r]
        if not runs:
            rows.append(
                (
                    label + f" (diverged: {len(diverged)} of {len(diverged)} seeds)",
                    0,
                    float("nan"),
                    float("nan"),
                    float("nan"),
                    float("nan"),
                )
            )
            continue
        if diverged:
            label += f" ({len(diverged)} of {len(runs) + len(diverged)} seeds diverged)"
        acc = np.array([_last5(r) for r in runs])
        mb = np.mean([r["bytes_sent"] for r in runs]) / 1e6
        ratio = np.mean([r["dense_bytes"] / r["bytes_sent"] for r in runs])
        sd = acc.std(ddof=1) if len(acc) > 1 else float("nan")
        rows.append((label, len(runs), acc.mean(), sd, mb, ratio))
    lines = [
        "| codec | seeds | accuracy, mean of the last 5 rounds (mean ± sd over seeds) | MB sent (20 rounds) | "
        "compression |",
        "|---|---|---|---|---|",
    ]
    for label, n, m, sd, mb, ratio in rows:
        lines.append(
            f"| {label} | {n} | {m:.4f} ± {sd:.4f} | {mb:.1f} | {ratio:.1f}x |" if n else f"| {label} | 0 | - | - | - |"
        )
    with open(os.path.join(HERE, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = {"none": "black", "int8_block": "tab:blue", "fp8": "tab:orange", "qsgd": "tab:green", "topk": "tab:red"}
    seen = {}
    for label, n, m, sd, mb, ratio in rows:
        if n == 0:
            continue
        kind = label.split("(")[0]
        key = label.split(" (")[0].replace("+EF", "")
        level = seen.setdefault(key, len([k for k in seen if k.startswith(kind)]))
        ef = "+EF" in label.split(" (")[0]
        marker = "*" if kind == "none" else ("o" if level == 0 else "s")
        ax.errorbar(
            mb * (1.04 if ef else 1.0),
            m,
            yerr=0 if sd != sd else sd,
            fmt=marker,
            color=colors[kind],
            mfc=colors[kind] if ef or kind == "none" else "white",
            label=label,
            capsize=2,
            ms=6,
        )
    ax.set_xscale("log")
    ax.set_xlabel("MB sent by the clients in 20 rounds (log scale)")
    ax.set_ylabel("test accuracy, mean of the last 5 rounds")
    ax.set_title(
        f"FedAvg on {res['data']}, 10 clients x 3 label shards, {len(res['seeds'])} seeds (mean ± sd)\n"
        "filled: error feedback; circle / square: first / second compression level"
    )
    ax.legend(fontsize=6, ncol=2, loc="lower right")
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "accuracy_vs_bytes.png"), dpi=130)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--report", action="store_true", help="rebuild the table and figure from results.json")
    a = ap.parse_args()
    if a.report:
        with open(os.path.join(HERE, "results.json")) as f:
            res = collect(json.load(f))
        with open(os.path.join(HERE, "results.json"), "w") as f:
            json.dump(res, f, indent=1)
        report(res)
    else:
        report(collect(run_all()))
