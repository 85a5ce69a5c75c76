"""GPU benchmarks of the fedkernels CUDA ops (run by bench/gpu.sh on a lent H100).

For every op: median time over many CUDA-event-timed calls after a warm-up, with inputs rotated
so that repeated calls do not run from L2 (inputs below ~4x L2 size get several copies), the
bytes the op must move at least, achieved GB/s, % of the measured device-to-device copy
bandwidth, and speed-ups over the torch composition a user would write and over the per-layer
Python loop. Writes bench/results/gpu-<device>.json (and $OUT/gpu-<device>.json when $OUT is set)
and prints a table last.

Targets (DESIGN / issue): memory-bound ops >= 85% of copy bandwidth; gram >= fp32 torch.mm
(TF32 off); min_norm K=1000 < 1 ms; FedAvg of 100 clients x 11M params < 5 ms.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import fedkernels  # noqa: E402
from fedkernels import ops  # noqa: E402

DEV = "cuda"
RESULTS: list = []


# ---- timing ---------------------------------------------------------------------------------------
def l2_bytes() -> int:
    try:
        return int(torch.cuda.get_device_properties(0).L2_cache_size)
    except Exception:
        return 50 << 20


def copies_needed(nbytes: int) -> int:
    """Input sets to rotate so the working set exceeds 4x L2 (at most 8 sets)."""
    return max(1, min(8, -(-4 * l2_bytes() // max(nbytes, 1))))


def time_fns(fns, warmup: int = 5, reps: int = 30, max_seconds: float = 20.0) -> float:
    """Median milliseconds of one call, cycling through fns (one closure per rotated input set)."""
    for i in range(max(warmup, len(fns))):
        fns[i % len(fns)]()
    torch.cuda.synchronize()
    times = []
    t_start = time.perf_counter()
    for r in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fns[r % len(fns)]()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
        if time.perf_counter() - t_start > max_seconds and len(times) >= 5:
            break
    return statistics.median(times)


def record(op, case, ms, nbytes=None, flops=None, copy_gbs=None, baselines=None, extra=None):
    row = {"op": op, "case": case, "ms": ms}
    if nbytes:
        row["bytes_min"] = nbytes
        row["GBps"] = nbytes / ms / 1e6
        if copy_gbs:
            row["pct_copy_bw"] = 100.0 * row["GBps"] / copy_gbs
    if flops:
        row["flops"] = flops
        row["TFLOPs"] = flops / ms / 1e9
    if baselines:
        row["baselines_ms"] = baselines
        row["speedup"] = {k: v / ms for k, v in baselines.items() if v}
    if extra:
        row.update(extra)
    RESULTS.append(row)
    sp = " ".join(f"{k}x{v:.2f}" for k, v in row.get("speedup", {}).items())
    bw = f"{row['GBps']:8.1f} GB/s {row.get('pct_copy_bw', 0):5.1f}%" if nbytes else " " * 23
    print(f"{op:14s} {case:34s} {ms:9.4f} ms {bw}  {sp}", flush=True)
    return row


def free():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


# ---- copy bandwidth -------------------------------------------------------------------------------
def bench_copy(quick: bool) -> float:
    n = (1 << 28) if not quick else (1 << 26)  # 1 GiB / 256 MiB of fp32
    a = torch.randn(n, device=DEV)
    b = torch.empty_like(a)
    ms = time_fns([lambda: b.copy_(a)], reps=20)
    gbs = 2 * a.numel() * 4 / ms / 1e6
    record("copy", f"d2d {a.numel() * 4 >> 20} MiB", ms, nbytes=2 * a.numel() * 4)
    del a, b
    free()
    return gbs


# ---- model layer sizes for the per-layer baselines -------------------------------------------------
def layer_shapes(name: str):
    try:
        import torchvision

        if name == "resnet18":
            m = torchvision.models.resnet18(num_classes=100)
        elif name == "vgg11":
            m = torchvision.models.vgg11(num_classes=100)
        else:
            raise ValueError(name)
        return [tuple(p.shape) for p in m.parameters()]
    except Exception:
        # torchvision missing: ResNet-18-like conv/linear shapes
        shapes = [(64, 3, 7, 7), (64,), (64,)]
        cin = 64
        for cout in (64, 128, 256, 512):
            for blk in range(2):
                shapes += [(cout, cin if blk == 0 else cout, 3, 3), (cout,), (cout,), (cout, cout, 3, 3), (cout,), (cout,)]
                if blk == 0 and cin != cout:
                    shapes += [(cout, cin, 1, 1), (cout,), (cout,)]
            cin = cout
        return shapes + [(100, 512), (100,)]


def numel(s):
    n = 1
    for x in s:
        n *= x
    return n


# ---- weighted_sum (FedAvg apply) ------------------------------------------------------------------
def bench_weighted_sum(copy_gbs, quick):
    d = 11_220_132 if not quick else 2_000_003
    shapes = layer_shapes("resnet18")
    for K in ((10, 100) if not quick else (10, 32)):
        for dtype in (torch.float32, torch.bfloat16):
            U = torch.randn(K, d, device=DEV).to(dtype)
            esz = U.element_size()
            nb = (K + 2) * d * esz
            sets = copies_needed(nb)
            Us = [U] + [torch.randn_like(U, dtype=torch.float32).to(dtype) for _ in range(sets - 1)]
            coef = torch.rand(K, device=DEV, dtype=torch.float64)
            coef /= coef.sum()
            w = torch.randn(d, device=DEV).to(dtype)
            out = torch.empty_like(w)
            ms = time_fns([lambda u=u: ops.weighted_sum(u, coef, base=w, out=out) for u in Us])
            c32 = coef.to(dtype)
            base = {}
            base["torch_gemv"] = time_fns([lambda u=u: torch.add(w, c32 @ u, out=out) for u in Us])
            # per-layer loop, as an FL framework would aggregate a state dict
            offs, o = [], 0
            for s in shapes:
                n = numel(s)
                if o + n > d:
                    break
                offs.append((o, o + n))
                o += n
            offs.append((o, d))

            def per_layer(u):
                for a, b in offs:
                    out[a:b] = w[a:b] + (c32[:, None] * u[:, a:b]).sum(0)

            base["per_layer_loop"] = time_fns([lambda u=u: per_layer(u) for u in Us], reps=10)
            record("weighted_sum", f"K={K} d={d} {str(dtype)[6:]}", ms, nbytes=nb, flops=2 * K * d,
                   copy_gbs=copy_gbs, baselines=base,
                   extra={"target": "FedAvg 100x11M < 5 ms; >= 85% copy bw"})
            del U, Us, w, out
            free()


# ---- gram ---------------------------------------------------------------------------------------
def bench_gram(copy_gbs, quick):
    d = 11_220_132 if not quick else 2_000_003
    torch.backends.cuda.matmul.allow_tf32 = False
    for K in ((10, 16, 32, 100) if not quick else (10, 32)):
        U = torch.randn(K, d, device=DEV)
        nb = K * d * 4
        sets = copies_needed(nb)
        Us = [U] + [torch.randn_like(U) for _ in range(sets - 1)]
        ms = time_fns([lambda u=u: ops.gram(u) for u in Us], reps=20)
        base = {"torch_mm_fp32_notf32": time_fns([lambda u=u: u @ u.T for u in Us], reps=20)}
        if K <= 32:
            U64 = U.double()
            base["torch_mm_fp64"] = time_fns([lambda: U64 @ U64.T], reps=10)
            del U64
        G1, G2 = ops.gram(U), ops.gram(U)
        same = bool(torch.equal(G1, G2))
        ref = (U.double() @ U.double().T)
        rel = float((G1 - ref).norm() / ref.norm())
        del ref
        record("gram", f"K={K} d={d} fp32", ms, nbytes=nb, flops=2 * K * K * d, copy_gbs=copy_gbs, baselines=base,
               extra={"bitwise_repeatable": same, "rel_err_vs_fp64": rel,
                      "target": ">= torch.mm fp32 (TF32 off) speed"})
        del U, Us
        free()


# ---- finite_rows ----------------------------------------------------------------------------------
def bench_finite_rows(copy_gbs, quick):
    d = 11_220_132 if not quick else 2_000_003
    K = 100 if not quick else 16
    U = torch.randn(K, d, device=DEV)
    nb = K * d * 4
    ms = time_fns([lambda: ops.finite_rows(U)])
    base = {"torch_isfinite_all": time_fns([lambda: torch.isfinite(U).all(1)])}
    record("finite_rows", f"K={K} d={d} fp32", ms, nbytes=nb, copy_gbs=copy_gbs, baselines=base)
    del U
    free()


# ---- min_norm -------------------------------------------------------------------------------------
def bench_min_norm(quick):
    for K in ((10, 100, 1000) if not quick else (10, 100)):
        g = torch.Generator(device="cpu").manual_seed(K)
        M = torch.randn(K, 2 * K, generator=g, dtype=torch.float64) + 0.3
        G = (M @ M.T)
        G /= G.diagonal().max()
        Gd = G.to(DEV)
        for method in ("fw", "away"):
            def run():
                return torch.ops.fedkernels.min_norm(Gd, 1000, 1e-6, 1e-12, method, "best_pair", False, None)

            ms = time_fns([run], warmup=3, reps=10)
            lam, it, gap = run()
            torch.cuda.synchronize()
            # host solve (what ops.min_norm does), wall clock including the device->host copy
            t0 = time.perf_counter()
            for _ in range(3):
                lam_h, it_h, gap_h = ops.min_norm(Gd, max_iter=1000, tol=1e-6, tol_abs=1e-12, method=method,
                                                  polish=False)
            host_ms = (time.perf_counter() - t0) / 3 * 1e3
            q_gpu = float(lam.cpu() @ G @ lam.cpu())
            q_cpu = float(lam_h.cpu() @ G @ lam_h.cpu())
            record("min_norm", f"K={K} {method} tol_rel=1e-6", ms, baselines={"host_cpu_op": host_ms},
                   extra={"iterations": int(it), "gap": float(gap), "q_gpu": q_gpu, "q_cpu": q_cpu,
                          "cpu_iterations": it_h, "target": "K=1000 < 1 ms"})


# ---- gc_project_ ----------------------------------------------------------------------------------
def bench_gc(copy_gbs, quick):
    for model in (("resnet18", "vgg11") if not quick else ("resnet18",)):
        shapes = layer_shapes(model)
        n_total = sum(numel(s) for s in shapes)
        nb = 2 * n_total * 4
        sets = copies_needed(nb // 2)
        tsets = [[torch.randn(s, device=DEV) for s in shapes] for _ in range(sets)]
        ms = time_fns([lambda ts=ts: ops.gc_project_(ts, "skip") for ts in tsets])

        def loop(ts):
            for t in ts:
                if t.dim() > 1:
                    t.sub_(t.mean(dim=tuple(range(1, t.dim())), keepdim=True))

        base = {"per_tensor_loop": time_fns([lambda ts=ts: loop(ts) for ts in tsets])}
        record("gc_project_", f"{model} ({len(shapes)} tensors, {n_total} params)", ms, nbytes=nb,
               copy_gbs=copy_gbs, baselines=base)
        del tsets
        free()


# ---- LU -------------------------------------------------------------------------------------------
def bench_lu(copy_gbs, quick):
    for n, B, m in ((11, 10_000, 1_000), (33, 1_000, 10_000), (4, 1_000_000, 1)):
        if quick and B * n * m > 2e7:
            continue
        A = torch.randn(B, n, n, device=DEV) + n * torch.eye(n, device=DEV)
        R = torch.randn(B, n, m, device=DEV)
        ms_f = time_fns([lambda: torch.ops.fedkernels.lu_factor(A)], reps=10)
        LU, piv, _ = torch.ops.fedkernels.lu_factor(A)
        ms_s = time_fns([lambda: torch.ops.fedkernels.lu_solve(LU, piv, R)], reps=10)
        bf = {"torch_lu_factor": time_fns([lambda: torch.linalg.lu_factor(A)], reps=5)}
        LUt, pivt = torch.linalg.lu_factor(A)
        bs = {"torch_lu_solve": time_fns([lambda: torch.linalg.lu_solve(LUt, pivt, R)], reps=5)}
        record("lu_factor", f"n={n} B={B}", ms_f, nbytes=2 * B * n * n * 4, copy_gbs=copy_gbs, baselines=bf)
        record("lu_solve", f"n={n} B={B} m={m}", ms_s, nbytes=B * (n * n + 2 * n * m) * 4, copy_gbs=copy_gbs,
               baselines=bs)
        del A, R, LU, LUt
        free()


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    ap.add_argument("--only", default="", help="comma list: copy,weighted_sum,gram,finite_rows,min_norm,gc,lu")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device; nothing to do")
        return 0
    info = fedkernels.build_info()
    if not info.get("cuda"):
        print("bench/gpu.py: fedkernels was built without CUDA; nothing to do")
        return 1
    only = set(filter(None, args.only.split(",")))
    want = lambda k: not only or k in only  # noqa: E731
    prop = torch.cuda.get_device_properties(0)
    dev_name = torch.cuda.get_device_name(0)
    print(f"device {dev_name}, {prop.multi_processor_count} SMs, {prop.total_memory >> 30} GiB, L2 {l2_bytes() >> 20} MiB")
    print(f"{'op':14s} {'case':34s} {'time':>12s} {'achieved':>23s}  speed-ups")
    copy_gbs = bench_copy(args.quick)
    if want("weighted_sum"):
        bench_weighted_sum(copy_gbs, args.quick)
    if want("gram"):
        bench_gram(copy_gbs, args.quick)
    if want("finite_rows"):
        bench_finite_rows(copy_gbs, args.quick)
    if want("min_norm"):
        bench_min_norm(args.quick)
    if want("gc"):
        bench_gc(copy_gbs, args.quick)
    if want("lu"):
        bench_lu(copy_gbs, args.quick)
    doc = {"device": dev_name, "sms": prop.multi_processor_count, "l2_bytes": l2_bytes(),
           "copy_GBps": copy_gbs, "torch": torch.__version__, "cuda": torch.version.cuda,
           "build_info": info, "python": platform.python_version(), "quick": args.quick, "results": RESULTS}
    slug = "".join(c if c.isalnum() else "-" for c in dev_name).strip("-").lower()
    paths = [os.path.join(ROOT, "bench", "results", f"gpu-{slug}.json")]
    if os.environ.get("OUT"):
        paths.append(os.path.join(os.environ["OUT"], f"gpu-{slug}.json"))
    for p in paths:
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "w") as f:
            json.dump(doc, f, indent=1)
    print("wrote", ", ".join(paths))
    print("\nsummary (ms, % of copy bandwidth, speed-up over the torch composition):")
    for r in RESULTS:
        sp = ", ".join(f"{k} {v:.2f}x" for k, v in r.get("speedup", {}).items())
        pct = f"{r['pct_copy_bw']:.0f}%" if "pct_copy_bw" in r else "-"
        print(f"  {r['op']:13s} {r['case']:38s} {r['ms']:9.4f} ms  {pct:>5s}  {sp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
