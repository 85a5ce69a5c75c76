"""CPU benchmark of the compressed-row sums (fedkernels.compress's server passes).

* dequant: ops.dequant_weighted_sum over int8 (and fp8 e4m3) rows with one fp32 scale per 256 columns, into an
  fp32 result, against ops.weighted_sum over the same rows stored fp32 and bf16 (bf16 rows into an fp32 result),
  and against the floor: the int8 pass's bytes (K d codes + K d / 256 scales + the d-float result) over the
  measured copy bandwidth (read + write counted).
* sparse: ops.sparse_weighted_sum over K top-1% lists (int32 indices, fp32 values) against torch's dense route
  ``out = base.clone(); out.index_add_(0, idx, val * coef_per_entry)``, and its floor (nnz (4 + 4) + 8 d bytes).
Shapes: K in {16, 100}, d = 11.2M (ResNet-18's size). Timings interleaved (bench/common.compare).
Run: python -m bench.codecs [--quick] [--K 16 100] [--d N] [--threads N] [--out DIR]; writes codecs.json (runs/bench/ by default).
"""

from __future__ import annotations

import argparse
import gc

import torch

from fedkernels import ops

from .common import add_out_argument, compare, copy_bandwidth, print_table, write_json

BLOCK = 256


def bench_dense_vs_int8(K: int, d: int, bw: float, repeats: int):
    g = torch.Generator().manual_seed(K)
    coef = torch.full((K,), 1.0 / K, dtype=torch.float64)
    base = torch.zeros(d)
    nb = -(-d // BLOCK)
    rows = []
    Q = torch.randint(-127, 128, (K, d), generator=g, dtype=torch.int8)
    S = torch.rand(K, nb, generator=g) * 1e-3
    F8 = Q.to(torch.float8_e4m3fn)
    nbytes8 = K * d + 4 * K * nb + 4 * d
    t = compare(
        {
            "int8": lambda: ops.dequant_weighted_sum(Q, S, coef, BLOCK, base=base),
            "fp8": lambda: ops.dequant_weighted_sum(F8, S, coef, BLOCK, base=base),
        },
        repeats=repeats,
    )
    F8 = None  # (freed: the lambdas above are done with it)
    floor8 = nbytes8 / bw
    for name in ("int8", "fp8"):
        rows.append(
            {
                "op": f"dequant_weighted_sum[{name}]",
                "K": K,
                "d": d,
                "ms": t[name]["median_s"] * 1e3,
                "GBps": nbytes8 / t[name]["median_s"] / 1e9,
                "floor_ms": floor8 * 1e3,
                "x_floor": t[name]["median_s"] / floor8,
            }
        )
    Ubf = Q.to(torch.bfloat16).mul_(1e-3)
    Q = S = None
    gc.collect()
    tb = compare({"bf16": lambda: ops.weighted_sum(Ubf, coef, base=base)}, repeats=repeats)["bf16"]["median_s"]
    U32 = Ubf.float()
    Ubf = None
    gc.collect()
    tf = compare({"fp32": lambda: ops.weighted_sum(U32, coef, base=base)}, repeats=repeats)["fp32"]["median_s"]
    U32 = None
    gc.collect()
    t8 = t["int8"]["median_s"]
    for name, ts, esize in (("bf16", tb, 2), ("fp32", tf, 4)):
        nb_ = K * d * esize + 8 * d
        rows.append(
            {
                "op": f"weighted_sum[{name} rows]",
                "K": K,
                "d": d,
                "ms": ts * 1e3,
                "GBps": nb_ / ts / 1e9,
                "floor_ms": floor8 * 1e3,
                "x_floor": ts / floor8,
                "int8_speedup": ts / t8,
            }
        )
    return rows


def bench_sparse(K: int, d: int, bw: float, repeats: int, ratio: float = 0.01):
    g = torch.Generator().manual_seed(K + 1)
    k = int(ratio * d)
    idx = torch.stack([torch.randperm(d, generator=g)[:k].sort().values for _ in range(K)]).to(torch.int32)
    val = torch.randn(K, k, generator=g)
    offsets = torch.arange(K + 1, dtype=torch.int64) * k
    coef = torch.full((K,), 1.0 / K, dtype=torch.float64)
    base = torch.zeros(d)
    fi, fv = idx.reshape(-1), val.reshape(-1)
    fi64 = fi.long()
    cper = coef.float().repeat_interleave(k)

    def torch_route():
        out = base.clone()
        out.index_add_(0, fi64, fv * cper)
        return out

    t = compare(
        {"fused": lambda: ops.sparse_weighted_sum(fi, fv, offsets, coef, d, base=base), "torch": torch_route},
        repeats=repeats,
    )
    nbytes = K * k * 8 + 8 * d
    floor = nbytes / bw
    return [
        {
            "op": "sparse_weighted_sum[top1%]",
            "K": K,
            "d": d,
            "nnz": K * k,
            "ms": t["fused"]["median_s"] * 1e3,
            "GBps": nbytes / t["fused"]["median_s"] / 1e9,
            "floor_ms": floor * 1e3,
            "x_floor": t["fused"]["median_s"] / floor,
            "torch_ms": t["torch"]["median_s"] * 1e3,
            "speedup_vs_torch": t["torch"]["median_s"] / t["fused"]["median_s"],
        }
    ]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--K", type=int, nargs="+", default=[16, 100])
    ap.add_argument("--d", type=int, default=11_200_000)
    ap.add_argument("--quick", action="store_true", help="K = 16, d = 2M, 3 repeats")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a shared, oversubscribed machine 2 threads measure the waits)",
    )
    add_out_argument(ap)
    a = ap.parse_args(argv)
    Ks, d, repeats = ([16], 2_000_000, 3) if a.quick else (a.K, a.d, 7)
    torch.set_num_threads(a.threads)
    bw = copy_bandwidth()
    rows = []
    for K in Ks:
        rows += bench_dense_vs_int8(K, d, bw, repeats)
        rows += bench_sparse(K, d, bw, repeats)
    print(f"copy bandwidth {bw / 1e9:.2f} GB/s, threads {torch.get_num_threads()}")
    print_table(
        rows, ["op", "K", "d", "ms", "GBps", "floor_ms", "x_floor", "int8_speedup", "torch_ms", "speedup_vs_torch"]
    )
    path = write_json("codecs.json", rows, {"block": BLOCK, "threads": torch.get_num_threads()}, out=a.out)
    print("wrote", path)


if __name__ == "__main__":
    main()
