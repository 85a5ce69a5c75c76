"""CPU benchmark: gradient centralization (gc_project_) and the fused local steps (fused_sgd_step_).

    python -m bench.cpu_gc [--quick] [--threads N]

GC: ``ops.gc_project_`` over the parameter lists of the specs' models (CNN for CIFAR-10, ResNet-18-GN
and VGG-11 for CIFAR-100; shapes only, from the spec/paper descriptions) against the per-tensor PyTorch
loops a user would write (``g - g.mean(dims, keepdim=True)`` and ``g.sub_(g.mean(...))``). The floor is
2*N*s bytes (read + write once); achieved GB/s is reported against it, as a fraction of a large-tensor
copy bandwidth (``dst.copy_(src)``, 2 bytes moved per byte copied) and of an in-place stream
(``x.mul_(1.0)``, the same access pattern as an in-place GC).

Fused steps: ``fused_sgd_step_`` against the ``torch._foreach_*`` composition (what
``torch.optim.SGD(foreach=True)`` plus a correction does) and against a composition around
``torch._fused_sgd_`` (``SGD(fused=True)``). Floors: SCAFFOLD step with c and c_i and momentum 7*N*s
bytes, Local GC + momentum SGD 5*N*s bytes.

Timings: functions are timed interleaved (one sample of each per round) so that load from other
processes hits all alike; median and min over the rounds are both recorded. Writes
cpu-gc.json (``--out``; bench/common.py).
"""

from __future__ import annotations

import argparse
import os
from typing import Dict, List

import torch

from fedkernels import ops

from .common import add_out_argument, compare, copy_bandwidth, print_table, write_json

# ---- the specs' models as parameter shape lists (named_parameters order) ------------------------------


def cnn_shapes(num_classes: int = 10) -> List[tuple]:
    """FedAvg CNN (GC-Fed §6): conv5x5 3->32, conv5x5 32->64, fc 4096->512, fc 512->C, all with bias."""
    return [(32, 3, 5, 5), (32,), (64, 32, 5, 5), (64,), (512, 4096), (512,), (num_classes, 512), (num_classes,)]


def vgg11_shapes(num_classes: int = 100) -> List[tuple]:
    """torchvision vgg11 without BN: 8 conv3x3 with bias, classifier 25088->4096->4096->C."""
    cfg = [64, 128, 256, 256, 512, 512, 512, 512]
    s, cin = [], 3
    for c in cfg:
        s += [(c, cin, 3, 3), (c,)]
        cin = c
    s += [(4096, 25088), (4096,), (4096, 4096), (4096,), (num_classes, 4096), (num_classes,)]
    return s


def resnet18gn_shapes(num_classes: int = 100) -> List[tuple]:
    """ResNet-18 with GroupNorm, 3x3 stem without bias, fc 512->C: 62 tensors."""
    s = [(64, 3, 3, 3), (64,), (64,)]
    cin = 64
    for w in (64, 128, 256, 512):
        for b in range(2):
            s += [(w, cin, 3, 3), (w,), (w,), (w, w, 3, 3), (w,), (w,)]
            if b == 0 and cin != w:
                s += [(w, cin, 1, 1), (w,), (w,)]
            cin = w
    s += [(num_classes, 512), (num_classes,)]
    return s


MODELS = {
    "cnn_cifar10": (cnn_shapes, 2_156_490),
    "resnet18gn_cifar100": (resnet18gn_shapes, 11_220_132),
    "vgg11_cifar100": (vgg11_shapes, 129_176_036),
}


def _numel(shapes) -> int:
    return sum(torch.Size(s).numel() for s in shapes)


def _tensors(shapes, seed: int, dtype=torch.float32) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def inplace_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """In-place stream bandwidth (bytes/s, read + write counted): x.mul_(1.0) over a large tensor."""
    x = torch.ones(nbytes // 4)
    r = compare({"mul_": lambda: x.mul_(1.0)}, repeats=repeats, min_time=0.0)
    return 2 * nbytes / r["mul_"]["median_s"]


# ---- GC ------------------------------------------------------------------------------------------------
def bench_gc(model: str, repeats: int, bw_copy: float, bw_inplace: float) -> List[Dict[str, object]]:
    fn, expected = MODELS[model]
    shapes = fn()
    assert _numel(shapes) == expected, (model, _numel(shapes), expected)
    ts = _tensors(shapes, seed=1)
    gc_ts = [t for t in ts if t.dim() >= 2]  # vector_policy="skip": the tensors GC touches
    n = _numel([t.shape for t in gc_ts])
    nbytes = 2 * n * 4

    def ours():
        ops.gc_project_(ts, "skip")

    def loop():  # out-of-place per-tensor loop (the GC-Fed code's formulation)
        return [g - g.mean(dim=tuple(range(1, g.dim())), keepdim=True) for g in gc_ts]

    def loop_inplace():
        for g in gc_ts:
            g.sub_(g.mean(dim=tuple(range(1, g.dim())), keepdim=True))

    r = compare(
        {"fedkernels.gc_project_": ours, "torch loop g - g.mean()": loop, "torch loop g.sub_(g.mean())": loop_inplace},
        repeats=repeats,
        min_time=0.05,
    )
    base_med = r["fedkernels.gc_project_"]["median_s"]
    base_min = r["fedkernels.gc_project_"]["min_s"]
    rows = []
    for impl, t in r.items():
        rows.append(
            {
                "bench": "gc_project_",
                "model": model,
                "impl": impl,
                "tensors": len(ts),
                "N": n,
                "bytes_floor": nbytes,
                "median_ms": t["median_s"] * 1e3,
                "min_ms": t["min_s"] * 1e3,
                "GBps": nbytes / t["median_s"] / 1e9,
                "GBps_best": nbytes / t["min_s"] / 1e9,
                "pct_copy_bw": 100 * nbytes / t["median_s"] / bw_copy,
                "pct_inplace_bw": 100 * nbytes / t["median_s"] / bw_inplace,
                "ours_speedup_median": t["median_s"] / base_med,
                "ours_speedup_min": t["min_s"] / base_min,
            }
        )
    return rows


# ---- fused local steps ---------------------------------------------------------------------------------
def bench_steps(model: str, repeats: int) -> List[Dict[str, object]]:
    fn, _ = MODELS[model]
    shapes = fn()
    n = _numel(shapes)
    P, G, B, C, Ci = (_tensors(shapes, seed=s) for s in range(5))
    lr, mu, wd = 0.01, 0.9, 1e-5
    mask = [True] * len(shapes)
    sgd_kw = dict(
        weight_decay=wd, momentum=mu, lr=lr, dampening=0.0, nesterov=False, maximize=False, is_first_step=False
    )

    def scaf_ours():
        ops.corrected_sgd_step_(P, G, C, Ci, B, lr=lr, momentum=mu, weight_decay=wd)

    def scaf_foreach():  # corrected grad, then SGD(foreach=True)'s ops
        d = torch._foreach_add(G, C)
        torch._foreach_sub_(d, Ci)
        torch._foreach_add_(d, P, alpha=wd)
        torch._foreach_mul_(B, mu)
        torch._foreach_add_(B, d)
        torch._foreach_add_(P, B, alpha=-lr)

    def scaf_fused_sgd():  # corrected grad (foreach), then SGD(fused=True)'s kernel
        d = torch._foreach_add(G, C)
        torch._foreach_sub_(d, Ci)
        torch._fused_sgd_(P, d, B, **sgd_kw)

    G2 = [g.clone() for g in G]  # GC baselines centre the gradient in place (ours leaves it alone)

    def gc_ours():
        ops.gc_sgd_step_(P, G, B, lr=lr, momentum=mu, weight_decay=wd, gc_mask=mask)

    def gc_foreach():
        ops.gc_project_(G2, "skip")
        torch._foreach_add_(G2, P, alpha=wd)  # (the composition may overwrite its gradient copy)
        torch._foreach_mul_(B, mu)
        torch._foreach_add_(B, G2)
        torch._foreach_add_(P, B, alpha=-lr)

    def gc_fused_sgd():
        ops.gc_project_(G2, "skip")
        torch._fused_sgd_(P, G2, B, **sgd_kw)

    def gc_loop():  # the GC-Fed code: per-tensor GC, then SGD(foreach=True)
        for g in G2:
            if g.dim() > 1:
                g.sub_(g.mean(dim=tuple(range(1, g.dim())), keepdim=True))
        torch._foreach_add_(G2, P, alpha=wd)
        torch._foreach_mul_(B, mu)
        torch._foreach_add_(B, G2)
        torch._foreach_add_(P, B, alpha=-lr)

    rows = []
    for step, floor, fns, ours_key in (
        (
            "scaffold_step (c, c_i, momentum, wd)",
            7 * n * 4,
            {
                "fedkernels.corrected_sgd_step_": scaf_ours,
                "_foreach composition": scaf_foreach,
                "_foreach corr + torch._fused_sgd_": scaf_fused_sgd,
            },
            "fedkernels.corrected_sgd_step_",
        ),
        (
            "local_gc_step (GC, momentum, wd)",
            5 * n * 4,
            {
                "fedkernels.gc_sgd_step_": gc_ours,
                "gc_project_ + _foreach": gc_foreach,
                "gc_project_ + torch._fused_sgd_": gc_fused_sgd,
                "per-tensor GC loop + _foreach": gc_loop,
            },
            "fedkernels.gc_sgd_step_",
        ),
    ):
        r = compare(fns, repeats=repeats, min_time=0.05)
        om, on = r[ours_key]["median_s"], r[ours_key]["min_s"]
        for impl, t in r.items():
            rows.append(
                {
                    "bench": step,
                    "model": model,
                    "impl": impl,
                    "tensors": len(shapes),
                    "N": n,
                    "bytes_floor": floor,
                    "median_ms": t["median_s"] * 1e3,
                    "min_ms": t["min_s"] * 1e3,
                    "GBps": floor / t["median_s"] / 1e9,
                    "GBps_best": floor / t["min_s"] / 1e9,
                    "ours_speedup_median": t["median_s"] / om,
                    "ours_speedup_min": t["min_s"] / on,
                }
            )
    return rows


def run(quick: bool = False) -> List[Dict[str, object]]:
    """All rows of the GC and fused-step benchmarks (quick: CNN and ResNet-18-GN, fewer repeats)."""
    repeats = 5 if quick else 9
    bw_copy = copy_bandwidth()
    bw_in = inplace_bandwidth()
    rows = []
    gc_models = ["cnn_cifar10", "resnet18gn_cifar100"] + ([] if quick else ["vgg11_cifar100"])
    for m in gc_models:
        rows += bench_gc(m, repeats, bw_copy, bw_in)
    for m in ["cnn_cifar10", "resnet18gn_cifar100"]:  # VGG-11 x 5 vectors would take 2.6 GB
        rows += bench_steps(m, repeats)
    for r in rows:
        r["copy_GBps"] = bw_copy / 1e9
        r["inplace_GBps"] = bw_in / 1e9
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CNN and ResNet-18-GN only, fewer repeats")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    add_out_argument(ap)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = run(quick=a.quick)
    bw_copy, bw_in = rows[0]["copy_GBps"], rows[0]["inplace_GBps"]
    print(
        f"copy bandwidth {bw_copy:.1f} GB/s, in-place stream {bw_in:.1f} GB/s, threads {torch.get_num_threads()}, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    gc_rows = [r for r in rows if r["bench"] == "gc_project_"]
    print_table(
        gc_rows,
        [
            "model",
            "impl",
            "N",
            "median_ms",
            "min_ms",
            "GBps",
            "pct_copy_bw",
            "pct_inplace_bw",
            "ours_speedup_median",
            "ours_speedup_min",
        ],
    )
    print()
    print_table(
        [r for r in rows if r["bench"] != "gc_project_"],
        ["bench", "model", "impl", "median_ms", "min_ms", "GBps", "ours_speedup_median", "ours_speedup_min"],
    )
    extra = {
        "threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()),
        "quick": a.quick,
        "inplace_bandwidth_GBps": bw_in,
        "notes": "GC bytes floor 2*N*4 over the tensors GC touches (vector_policy='skip'); fused steps floors "
        "7*N*4 (SCAFFOLD with c, c_i, momentum) and 5*N*4 (Local GC + momentum). ours_speedup = "
        "time(impl) / time(fedkernels). Interleaved timing on a shared machine: compare min and median.",
    }
    print("wrote", write_json("cpu-gc.json", rows, extra, out=a.out))
    return rows


if __name__ == "__main__":
    main()
