"""Federated LoRA fine-tuning on Fashion-MNIST, offline: naive vs exact vs fold vs full fine-tuning, with and
without a codec, through the simulator (``fedkernels.sim``'s ``lora.*`` and ``compress.*`` sections).

A small CNN (conv 1->16, conv 16->32, fc 512->128, fc 128->10) is pretrained centrally on classes 0-4
(T-shirt, trouser, pullover, dress, coat), then fine-tuned federatedly on classes 5-9 (sandal, shirt, sneaker,
bag, ankle boot) by K clients with a Dirichlet(alpha) label split (non-IID), every client every round:

- ``full``: every parameter trained and sent (FedAvg);
- ``naive`` / ``exact`` / ``fold``: peft LoRA of rank r on every layer (base frozen), only the adapters trained
  and sent; the server averages A and B separately / re-factorises the average of B_k A_k (FlexLoRA) / folds
  the residual into the base (FedEx-LoRA);
- ``naive-het`` / ``exact-het``: clients of ranks 2, 4, 8 (cycled), server rank 8;
- each homogeneous run also with ``int8_block`` and ``topk`` (ratio 0.1) with error feedback.

Per run: final accuracy on the held-out classes 5-9, bytes sent per round (all clients), mean server
aggregation time, and for LoRA runs the aggregated update's distance to the true average update
s (sum_k p_k B_k A_k - B A) relative to its norm (mean over rounds; naive's is what averaging the factors loses).

    python examples/lora_fmnist.py [--seeds 0,1,2] [--out runs/lora_fmnist]     # ~25 min on 2 busy cores
    python examples/lora_fmnist.py --quick                                       # a smoke run, seconds

Writes ``OUT/results.json`` (every run, every round), ``OUT/table.md`` (means over seeds) and ``OUT/lora_fmnist.png``.
Needs peft and Fashion-MNIST (Debian's dataset-fashion-mnist, or --root DIR with the IDX files).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

CODECS = {
    "none": [],
    "int8_block": ["compress.kind=int8_block"],
    "topk+EF": ["compress.kind=topk", "compress.ratio=0.1", "compress.error_feedback=true"],
}
METHODS = {
    "full": [],
    "naive": ["lora.mode=naive"],
    "exact": ["lora.mode=exact"],
    "fold": ["lora.mode=fold"],
    "naive-het": ["lora.mode=naive", "lora.r=8", "lora.ranks=[2,4,8]"],
    "exact-het": ["lora.mode=exact", "lora.r=8", "lora.ranks=[2,4,8]"],
}


class Net(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 16, 5), nn.Conv2d(16, 32, 5)
        self.fc1, self.fc2 = nn.Linear(512, 128), nn.Linear(128, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 rounds, 4 clients, small data, few runs (a test)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--alpha", type=float, default=0.3, help="Dirichlet concentration of the label split")
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument(
        "--grad-clip",
        type=float,
        default=1.0,
        help="local gradient-norm clip (the new classes' first losses are large)",
    )
    ap.add_argument("--train", type=int, default=1500, help="fine-tuning samples (classes 5-9)")
    ap.add_argument("--test", type=int, default=2000, help="test samples (classes 5-9)")
    ap.add_argument("--pretrain", type=int, default=12000, help="pretraining samples (classes 0-4)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--codecs", default=",".join(CODECS))
    ap.add_argument("--root", default=None, help="directory of the Fashion-MNIST IDX files")
    ap.add_argument("--out", default="runs/lora_fmnist")
    ap.add_argument(
        "--merge",
        default=None,
        help="comma-separated output directories of earlier runs (e.g. one "
        "per seed, run in parallel): only their table and figure are written to --out",
    )
    a = ap.parse_args(argv)
    a.seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    a.methods, a.codecs = a.methods.split(","), a.codecs.split(",")
    for what, got, known in (("--methods", a.methods, METHODS), ("--codecs", a.codecs, CODECS)):
        bad = [x for x in got if x not in known]
        if bad:
            ap.error(f"{what}: unknown {bad[0]!r}; expected some of {', '.join(known)}")
    if a.quick:
        a.seeds, a.rounds, a.clients, a.train, a.test, a.pretrain = a.seeds[:1], 2, 4, 600, 1000, 1000
        a.methods, a.codecs = ["full", "exact", "fold"], ["none", "int8_block"]
    return a


def split(x, y, classes, n, seed):
    keep = torch.isin(y, torch.tensor(classes))
    xs, ys = x[keep], y[keep]
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(len(ys), generator=g)[:n]
    return xs[idx], ys[idx]


def pretrain(x, y, seed, epochs=2):
    torch.manual_seed(seed)
    net = Net()
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for b in torch.randperm(len(y), generator=g).split(64):
            opt.zero_grad()
            F.cross_entropy(net(x[b]), y[b]).backward()
            opt.step()
    return net


def one_run(a, seed, method, codec, data, base_path):
    from fedkernels.sim.config import RunConfig, apply_overrides
    from fedkernels.sim.simulation import Simulation

    train, test = data
    cfg = RunConfig(
        seed=seed,
        rounds=a.rounds,
        num_clients=a.clients,
        threads=1,
        plots=False,
        verbose=False,
        progress=False,
        client_loss="none",
    )
    cfg = apply_overrides(
        cfg,
        [
            "partition.scheme=dirichlet",
            f"partition.options={{alpha: {a.alpha}, min_size: 10}}",
            "train.batch_size=32",
            "train.epochs=1",
            f"train.lr={a.lr}",
            "train.momentum=0.9",
            f"train.grad_clip={a.grad_clip}",
            *METHODS[method],
            *(["lora.alpha=" + str(2 * (8 if "het" in method else a.rank))] if method != "full" else []),
            *([f"lora.r={a.rank}"] if method in ("naive", "exact", "fold") else []),
            *CODECS[codec],
        ],
    )

    def model_fn(num_classes, in_ch, size):
        net = Net(num_classes)
        net.load_state_dict(torch.load(base_path, weights_only=True))
        return net

    sim = Simulation(cfg, train=train, test=test, model_fn=model_fn, write_outputs=False)
    t0 = time.perf_counter()
    s = sim.run()
    rows = sim.metrics
    out = {
        "seed": seed,
        "method": method,
        "codec": codec,
        "final_accuracy": s["final_accuracy"],
        "d": sim.spec.d,
        "wall_s": time.perf_counter() - t0,
        "bytes_sent_per_round": sum(r.get("bytes_sent", len(r["clients"]) * sim.spec.d * 4) for r in rows) / len(rows),
        "t_agg_mean": sum(r["t_agg"] for r in rows) / len(rows),
        "accuracy": [r.get("accuracy") for r in rows],
    }
    rel = [r["agg"].get("relative_error") for r in rows[1:]]  # round 1: B = 0 at the start, no error
    nrel = [r["agg"].get("naive_relative_error") for r in rows[1:]]
    if rel and rel[0] is not None:
        out["relative_error_mean"] = sum(rel) / len(rel)
        out["naive_relative_error_mean"] = sum(nrel) / len(nrel)
    return out


def table(results):
    keys = sorted(
        {(r["method"], r["codec"]) for r in results},
        key=lambda k: (list(METHODS).index(k[0]), list(CODECS).index(k[1])),
    )
    lines = [
        "| method | codec | seeds | final accuracy (%) | bytes sent / round | server agg. time (ms) | "
        "rel. distance to true avg. update | naive's on the same rounds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m, c in keys:
        rs = [r for r in results if r["method"] == m and r["codec"] == c]
        acc = [100 * r["final_accuracy"] for r in rs]
        mu = sum(acc) / len(acc)
        sd = math.sqrt(sum((v - mu) ** 2 for v in acc) / (len(acc) - 1)) if len(acc) > 1 else float("nan")
        b = sum(r["bytes_sent_per_round"] for r in rs) / len(rs)
        t = 1e3 * sum(r["t_agg_mean"] for r in rs) / len(rs)
        rel = [r["relative_error_mean"] for r in rs if "relative_error_mean" in r]
        nrel = [r["naive_relative_error_mean"] for r in rs if "naive_relative_error_mean" in r]
        er = f"{sum(rel) / len(rel):.2e}" if rel else "-"
        ne = f"{sum(nrel) / len(nrel):.2e}" if nrel else "-"
        lines.append(f"| {m} | {c} | {len(rs)} | {mu:.2f} ± {sd:.2f} | {b / 1e3:,.1f} kB | {t:.1f} | {er} | {ne} |")
    return "\n".join(lines) + "\n"


def figure(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    marks = {"none": "o", "int8_block": "s", "topk+EF": "^"}
    for i, m in enumerate(METHODS):  # colour: the method; marker: the codec
        for c in CODECS:
            rs = [r for r in results if r["method"] == m and r["codec"] == c]
            if not rs:
                continue
            acc = sum(r["final_accuracy"] for r in rs) / len(rs)
            b = sum(r["bytes_sent_per_round"] for r in rs) / len(rs)
            ax1.scatter(b, 100 * acc, marker=marks[c], color=f"C{i}", label=f"{m} / {c}")
            if c == "none":
                curve = [sum(r["accuracy"][i] for r in rs) / len(rs) for i in range(len(rs[0]["accuracy"]))]
                ax2.plot(range(1, len(curve) + 1), [100 * v for v in curve], color=f"C{i}", label=m)
    ax1.set_xscale("log")
    ax1.set_xlabel("bytes sent per round (all clients)")
    ax1.set_ylabel("final accuracy on classes 5-9 (%), mean of seeds")
    ax1.legend(fontsize=6, ncol=2)
    ax2.set_xlabel("round")
    ax2.set_ylabel("accuracy, classes 5-9 (%), no codec")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(results, out):
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table(results))
    try:
        figure(results, os.path.join(out, "lora_fmnist.png"))
    except ImportError:
        print("matplotlib not installed: no figure", file=sys.stderr)
    print(table(results))


def main(argv=None) -> int:
    a = parse(argv)
    if a.merge:
        results = []
        for d in a.merge.split(","):
            with open(os.path.join(d, "results.json")) as f:
                results += json.load(f)["results"]
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump({"merged": a.merge.split(","), "results": results}, f, indent=1)
        write_outputs(results, a.out)
        return 0
    from fedkernels.sim.data import load_dataset

    try:
        tr, te = load_dataset("fmnist", root=a.root)
    except (FileNotFoundError, ValueError) as e:
        print(f"lora_fmnist: {e}", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    torch.set_num_threads(1)
    results = []
    t0 = time.perf_counter()
    for seed in a.seeds:
        px, py = split(tr.x, tr.y, [0, 1, 2, 3, 4], a.pretrain, seed)
        base = pretrain(px, py, seed, epochs=1 if a.quick else 2)
        base_path = os.path.join(a.out, f"base_s{seed}.pt")
        torch.save(base.state_dict(), base_path)
        fx, fy = split(tr.x, tr.y, [5, 6, 7, 8, 9], a.train, seed)
        tx, ty = split(te.x, te.y, [5, 6, 7, 8, 9], a.test, seed)
        data = (SimpleNamespace(x=fx, y=fy, num_classes=10), SimpleNamespace(x=tx, y=ty, num_classes=10))
        with torch.no_grad():
            acc0 = float((base(tx).argmax(1) == ty).float().mean())
        print(
            f"seed {seed}: base model pretrained on classes 0-4; its accuracy on classes 5-9: {100 * acc0:.1f}%",
            flush=True,
        )
        for m in a.methods:
            for c in a.codecs if "het" not in m else ["none"]:
                r = one_run(a, seed, m, c, data, base_path)
                results.append(r)
                extra = (
                    f", distance to the true average {r['relative_error_mean']:.2e} (naive "
                    f"{r['naive_relative_error_mean']:.2e})"
                    if "relative_error_mean" in r
                    else ""
                )
                print(
                    f"  {m:9s} {c:10s} acc {100 * r['final_accuracy']:.2f}%  {r['bytes_sent_per_round'] / 1e3:9.1f} kB"
                    f"/round  agg {1e3 * r['t_agg_mean']:.1f} ms{extra}  ({r['wall_s']:.0f} s)",
                    flush=True,
                )
                with open(os.path.join(a.out, "results.json"), "w") as f:
                    json.dump({"args": {k: v for k, v in vars(a).items()}, "results": results}, f, indent=1)
    write_outputs(results, a.out)
    print(f"total {time.perf_counter() - t0:.0f} s; outputs in {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
