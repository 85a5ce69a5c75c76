"""CPU benchmark of the aggregation core: weighted_sum and gram against what users run today.

Baselines, all in this process on the same inputs:
* weighted_sum: FL-bench style (per-layer torch.stack + weighted sum), Flower style (NumPy, per
  layer: scaled copies, then reduce(np.add)), FedLab style (stack flat vectors, one reduction),
  torch ``coef @ U``; and the floor (K+2)*4*d bytes / copy bandwidth.
* gram: ``U @ U.T`` in fp32 and in fp64 (with the conversion), accuracy against fp64.
Run: python -m bench.cpu_core [--quick]
"""

from __future__ import annotations

import argparse
from functools import reduce

import numpy as np
import torch

from fedkernels import ops

from .common import add_out_argument, copy_bandwidth, print_table, timeit, write_json

# ResNet-18-like layer size profile (fractions of d), used to split a flat vector into "layers"
_PROFILE = [
    0.0002,
    0.00001,
    0.0033,
    0.0033,
    0.0033,
    0.0033,
    0.0066,
    0.013,
    0.0007,
    0.013,
    0.013,
    0.026,
    0.052,
    0.003,
    0.052,
    0.052,
    0.105,
    0.21,
    0.012,
    0.21,
    0.21,
    0.0046,
    0.00001,
]


def layer_sizes(d: int):
    w = np.array(_PROFILE) / sum(_PROFILE)
    sizes = np.maximum(1, (w * d).astype(np.int64))
    sizes[-1] += d - sizes.sum()
    return [int(s) for s in sizes]


def bench_weighted_sum(K: int, d: int, repeats: int):
    U = torch.randn(K, d)
    base = torch.randn(d)
    n = torch.randint(50, 500, (K,)).double()
    p = n / n.sum()
    sizes = layer_sizes(d)
    # per-client per-layer tensors (what FL-bench / Flower hold): views of U, so no extra memory
    layers = [list(torch.split(U[k], sizes)) for k in range(K)]
    np_layers = [[t.numpy() for t in ls] for ls in layers]
    pf = p.float()
    out = torch.empty(d)

    def ours():
        ops.weighted_sum(U, p, base=base, out=out)

    def flbench():  # FL-bench: for each layer, stack over clients then weighted sum
        res = []
        for li in range(len(sizes)):
            st = torch.stack([layers[k][li] for k in range(K)], dim=-1)
            res.append(base[sum(sizes[:li]) : sum(sizes[: li + 1])] + torch.sum(st * pf, dim=-1))
        return res

    def flower():  # Flower aggregate(): scaled per-layer copies, reduce(np.add), divide
        nn_ = n.numpy()
        tot = nn_.sum()
        weighted = [[layer * nk for layer in ls] for ls, nk in zip(np_layers, nn_)]
        return [reduce(np.add, lu) / tot for lu in zip(*weighted)]

    def fedlab():  # FedLab: stack serialized flat vectors, one weighted reduction
        st = torch.stack([U[k] for k in range(K)])
        return base + torch.sum(st * pf[:, None], dim=0)

    def matvec():
        return base + pf @ U

    bw = copy_bandwidth()
    floor_bytes = (K + 2) * 4 * d
    t = {
        name: timeit(f, repeats=repeats)
        for name, f in [
            ("ours", ours),
            ("torch_coef@U", matvec),
            ("fedlab", fedlab),
            ("flbench", flbench),
            ("flower", flower),
        ]
    }
    return {
        "op": "weighted_sum",
        "K": K,
        "d": d,
        "t_ours_ms": t["ours"] * 1e3,
        "GBps": floor_bytes / t["ours"] / 1e9,
        "pct_copy_bw": 100 * floor_bytes / t["ours"] / bw,
        "x_vs_flbench": t["flbench"] / t["ours"],
        "x_vs_flower": t["flower"] / t["ours"],
        "x_vs_fedlab": t["fedlab"] / t["ours"],
        "x_vs_torch_matvec": t["torch_coef@U"] / t["ours"],
        "t_flbench_ms": t["flbench"] * 1e3,
        "t_flower_ms": t["flower"] * 1e3,
        "t_fedlab_ms": t["fedlab"] * 1e3,
        "t_torch_matvec_ms": t["torch_coef@U"] * 1e3,
    }


def bench_gram(K: int, d: int, repeats: int):
    U = torch.randn(K, d)
    ref = U.double() @ U.double().T
    t_ours = timeit(lambda: ops.gram(U), repeats=repeats)
    t_f32 = timeit(lambda: U @ U.T, repeats=repeats)
    t_f64 = timeit(lambda: (lambda V: V @ V.T)(U.double()), repeats=max(2, repeats // 2))
    G = ops.gram(U)
    G32 = (U @ U.T).double()
    # error relative to sqrt(G_ii G_jj) (the scale of entry ij; off-diagonal entries of random vectors
    # are small by cancellation, so an entrywise ratio would measure the reference's own rounding)
    dg = torch.sqrt(torch.diagonal(ref))
    rel = lambda A: float(((A - ref).abs() / (dg[:, None] * dg[None, :]).clamp_min(1e-300)).max())
    bw = copy_bandwidth()
    return {
        "op": "gram",
        "K": K,
        "d": d,
        "t_ours_ms": t_ours * 1e3,
        "GBps": 4 * K * d / t_ours / 1e9,
        "pct_copy_bw": 100 * 4 * K * d / t_ours / bw,
        "GFLOPs": K * (K + 1) * d / t_ours / 1e9,
        "ratio_to_fp32_mm": t_ours / t_f32,
        "x_vs_fp64_mm": t_f64 / t_ours,
        "relerr_ours": rel(G),
        "relerr_fp32_mm": rel(G32),
        "t_fp32_mm_ms": t_f32 * 1e3,
        "t_fp64_mm_ms": t_f64 * 1e3,
    }


def run(quick: bool = False):
    rep = 3 if quick else 7
    ws_sizes = [(10, 100_000), (16, 1_000_000), (100, 1_000_000)] + ([] if quick else [(16, 10_000_000)])
    gr_sizes = [(10, 100_000), (16, 1_000_000), (100, 1_000_000)] + (
        [] if quick else [(16, 10_000_000), (100, 3_000_000)]
    )
    rows = [bench_weighted_sum(K, d, rep) for K, d in ws_sizes]
    rows += [bench_gram(K, d, rep) for K, d in gr_sizes]
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    add_out_argument(ap)
    a = ap.parse_args(argv)
    rows = run(a.quick)
    print(f"copy bandwidth: {copy_bandwidth() / 1e9:.2f} GB/s, threads {torch.get_num_threads()}")
    print_table(
        [r for r in rows if r["op"] == "weighted_sum"],
        [
            "op",
            "K",
            "d",
            "t_ours_ms",
            "GBps",
            "pct_copy_bw",
            "x_vs_flbench",
            "x_vs_flower",
            "x_vs_fedlab",
            "x_vs_torch_matvec",
        ],
    )
    print_table(
        [r for r in rows if r["op"] == "gram"],
        [
            "op",
            "K",
            "d",
            "t_ours_ms",
            "GBps",
            "GFLOPs",
            "ratio_to_fp32_mm",
            "x_vs_fp64_mm",
            "relerr_ours",
            "relerr_fp32_mm",
        ],
    )
    print("wrote", write_json("cpu-core.json", rows, out=a.out))


if __name__ == "__main__":
    main()
