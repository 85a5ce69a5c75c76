"""One full server round (aggregation only, synthetic updates) of FedAvg and FedAWARE for K clients
of a ResNet-18-GN-sized model (11.2M parameters, CIFAR-100 head), against the FL-bench-style
per-layer implementation a user would otherwise run.

Run: python -m bench.cpu_round [--quick] [--clients K]
"""

from __future__ import annotations

import argparse
import time

import torch

from fedkernels import FlatSpec, algorithms, ops
from fedkernels.sim.models import build_model

from .common import add_out_argument, copy_bandwidth, print_table, timeit, write_json


def perlayer_fedavg(layers, p):
    """FL-bench style: for each layer, stack the clients' tensors and take the weighted sum."""
    pf = p.float()
    return [torch.sum(torch.stack(ls, dim=-1) * pf, dim=-1) for ls in zip(*layers)]


def perlayer_fedaware(M_layers, layers, p, alpha, solver):
    """Per-layer FedAWARE: momentum EMA per client and layer, Gram summed over layers (fp32 mm),
    min-norm weights, then the weighted sum of normalised momenta per layer."""
    K = len(p)
    for k in range(K):
        for li, g in enumerate(layers[k]):
            M_layers[k][li].mul_(1 - alpha).add_(g, alpha=alpha)
    G = torch.zeros(K, K, dtype=torch.float64)
    for li in range(len(M_layers[0])):
        st = torch.stack([M_layers[k][li].reshape(-1) for k in range(K)])
        G += (st @ st.T).double()
    nrm = torch.sqrt(torch.diagonal(G)).clamp_min(1e-30)
    lam, _, _ = solver(G / nrm[:, None] / nrm[None, :])
    c = (lam / nrm).float()
    return [
        torch.sum(torch.stack([M_layers[k][li] for k in range(K)], dim=-1) * c, dim=-1)
        for li in range(len(M_layers[0]))
    ]


def run(quick: bool = False, clients: int | None = None):
    K = clients or (20 if quick else 100)
    model = build_model("resnet18_gn", num_classes=100, in_channels=3, input_size=32)
    spec = FlatSpec.from_module(model)
    d = spec.d
    torch.manual_seed(0)
    x = spec.flatten(model)
    U = torch.randn(K, d) * 1e-3
    n = torch.randint(100, 600, (K,)).tolist()
    p = torch.tensor(n, dtype=torch.float64) / sum(n)
    layers = [[U[k][e.slice].view(e.shape) for e in spec.entries] for k in range(K)]
    rep = 3 if quick else 5
    bw = copy_bandwidth()
    rows = []

    agg = algorithms.build("fedavg")
    t_ours = timeit(lambda: agg.aggregate(x, U, n), repeats=rep)
    t_base = timeit(lambda: perlayer_fedavg(layers, p), repeats=max(2, rep // 2))

    def row(method: str, t_ours: float, t_base: float, floor: float) -> dict:
        return {
            "method": method,
            "K": K,
            "d": d,
            "t_ours_s": t_ours,
            "t_perlayer_s": t_base,
            "x_vs_perlayer": t_base / t_ours,
            "floor_s": floor / bw,
            "pct_of_floor": 100 * floor / bw / t_ours,
        }

    floor = (K + 2) * 4 * d
    rows.append(row("fedavg", t_ours, t_base, floor))
    # the same round into a caller's reused buffer: the result pass writes there (no fresh [d] vector)
    buf = torch.empty_like(x)
    rows.append(row("fedavg out=", timeit(lambda: agg.aggregate(x, U, n, out=buf), repeats=rep), t_base, floor))

    fa = algorithms.build("fedaware", num_clients=K, elud=False)
    fa.setup(spec, num_clients=K, global_flat=x)
    ids = list(range(K))
    fa.aggregate(x, U, n, ids)  # round 1: fills the momentum table
    t_ours = timeit(lambda: fa.aggregate(x, U, n, ids), repeats=max(2, rep - 2))
    M_layers = [[torch.zeros(e.shape) for e in spec.entries] for _ in range(K)]
    t_base = timeit(lambda: perlayer_fedaware(M_layers, layers, p, 0.5, ops.min_norm), repeats=2, warmup=1)
    # minimal traffic: EMA (read M_S, U_S, write M_S) + Gram (read M) + apply (read M_supp, x; write x)
    floor = 4 * d * (3 * K + K + K + 2)
    rows.append(row("fedaware", t_ours, t_base, floor))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--clients", type=int, default=None)
    add_out_argument(ap)
    a = ap.parse_args(argv)
    rows = run(a.quick, a.clients)
    print(f"copy bandwidth {copy_bandwidth() / 1e9:.2f} GB/s, threads {torch.get_num_threads()}")
    print_table(rows, ["method", "K", "d", "t_ours_s", "t_perlayer_s", "x_vs_perlayer", "floor_s", "pct_of_floor"])
    print("wrote", write_json("cpu-round.json", rows, out=a.out))


if __name__ == "__main__":
    main()
