"""GPU benchmarks of the fedkernels CUDA ops (run by ``bench/gpu.sh bench`` on a lent GPU).

For every op: the median time of one call after a warm-up, with inputs rotated so that repeated
calls do not run from L2 (inputs below ~4x L2 get several copies), the bytes the op must move at
least, achieved GB/s, % of the measured device-to-device copy bandwidth, and the same for the
torch baselines a user would write: ``coef @ U`` (FedAvg), fp64 ``U @ U.T`` (Gram),
``torch.linalg.lu_solve``, a ``_foreach`` SGD step (the fused local step). Host-bound ops (small
kernels: min_norm, gc_project_, the fused step, LU of small batches) are timed inside a CUDA graph
(20 calls per replay) or, where capture is not possible, as 20 calls per CUDA-event pair.
Writes ``gpu-<device>.json`` to ``--out`` (default runs/bench/ under the current directory, as every
benchmark: bench/common.py; ``bench/gpu.sh`` passes ``--out bench/results``, the published results) and
to $OUT when set, and prints a table.

``--device cpu --quick`` runs the same harness on the CPU with small sizes (perf_counter timing,
no graphs): CI runs it so that only the GPU numbers are new on the GPU.

``aggregate``: one whole round of every registered aggregator (with the client payloads it needs)
at ResNet-18 and VGG-11 sizes, K = 10 and 100, against the one-read floor (K d 4 bytes at the
copy bandwidth: ``x_floor``) and plain torch ``glob + w @ U``.

Targets (docs/design.md): memory-bound ops >= 85% of copy bandwidth; gram at K=100, d=11.2M
within 2x of its memory floor; min_norm K=1000 < 1 ms; FedAvg of 100 clients x 11M params < 5 ms.
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
from bench.common import add_out_argument, output_path  # noqa: E402
from fedkernels import ops  # noqa: E402

DEV = "cuda"
QUICK = False
RESULTS: list = []
CALLS = 20  # calls per timed unit for host-bound ops


# ---- timing ---------------------------------------------------------------------------------------
def is_cuda() -> bool:
    return torch.device(DEV).type == "cuda"


def sync():
    if is_cuda():
        torch.cuda.synchronize()


def l2_bytes() -> int:
    if not is_cuda():
        return 32 << 20
    try:
        return int(torch.cuda.get_device_properties(0).L2_cache_size)
    except Exception:
        return 50 << 20


def copies_needed(nbytes: int) -> int:
    """Input sets to rotate so the working set exceeds 4x L2 (at most 8 sets; 1 on the CPU quick run)."""
    if QUICK and not is_cuda():
        return 1
    return max(1, min(8, -(-4 * l2_bytes() // max(nbytes, 1))))


def _elapsed_ms(fn) -> float:
    if is_cuda():
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        return s.elapsed_time(e)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def time_fns(fns, warmup: int = 5, reps: int = 30, max_seconds: float = 20.0, calls: int = 1) -> float:
    """Median milliseconds of one call, cycling through fns (one closure per rotated input set);
    `calls` calls per timed unit (host-bound ops)."""
    if QUICK and not is_cuda():
        warmup, reps, max_seconds = 1, 3, 2.0
    for i in range(max(warmup, len(fns))):
        fns[i % len(fns)]()
    sync()
    times = []
    t_start = time.perf_counter()
    for r in range(reps):
        f = fns[r % len(fns)]
        if calls == 1:
            times.append(_elapsed_ms(f))
        else:

            def many(f=f):
                for _ in range(calls):
                    f()

            times.append(_elapsed_ms(many) / calls)
        if time.perf_counter() - t_start > max_seconds and len(times) >= 3:
            break
    return statistics.median(times)


def time_host_bound(fn, reps: int = 20):
    """(ms per call, how): a CUDA graph of CALLS calls per replay when capture works, else CALLS
    calls per event pair; on the CPU, plain calls."""
    if not is_cuda():
        return time_fns([fn], reps=reps), "calls"
    try:
        fn()
        sync()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(CALLS):
                fn()
        ms = time_fns([g.replay], warmup=2, reps=reps) / CALLS
        return ms, "cuda_graph"
    except Exception as e:  # capture unsupported by this op: many calls per event pair
        sync()
        print(f"  (graph capture failed: {type(e).__name__}: {str(e)[:80]}; timing {CALLS} calls per event pair)")
        return time_fns([fn], reps=reps, calls=CALLS), "calls_per_event"


def record(op, case, ms, nbytes=None, flops=None, copy_gbs=None, baselines=None, extra=None, sizes=None):
    """One result row; baselines: {name: ms}, each reported with its own GB/s and % of copy bw."""
    row = {"op": op, "case": case, "sizes": sizes or {}, "ms": ms}
    if nbytes:
        row["bytes_min"] = nbytes
        row["GBps"] = nbytes / ms / 1e6
        if copy_gbs:
            row["pct_copy_bw"] = 100.0 * row["GBps"] / copy_gbs
    if flops:
        row["flops"] = flops
        row["TFLOPs"] = flops / ms / 1e9
    if baselines:
        row["baselines"] = {}
        for k, v in baselines.items():
            b = {"ms": v, "speedup": (v / ms) if v and ms else None}
            if nbytes and v:
                b["GBps"] = nbytes / v / 1e6
                if copy_gbs:
                    b["pct_copy_bw"] = 100.0 * b["GBps"] / copy_gbs
            row["baselines"][k] = b
    if extra:
        row.update(extra)
    RESULTS.append(row)
    sp = " ".join(f"{k}x{b['speedup']:.2f}" for k, b in row.get("baselines", {}).items() if b["speedup"])
    bw = f"{row['GBps']:8.1f} GB/s {row.get('pct_copy_bw', 0):5.1f}%" if nbytes else " " * 23
    print(f"{op:14s} {case:34s} {ms:9.4f} ms {bw}  {sp}", flush=True)
    return row


def free():
    sync()
    if is_cuda():
        torch.cuda.empty_cache()


def D(n_full: int, n_quick_gpu: int, n_cpu: int) -> int:
    if not is_cuda():
        return n_cpu
    return n_quick_gpu if QUICK else n_full


# ---- copy bandwidth -------------------------------------------------------------------------------
def bench_copy() -> float:
    n = D(1 << 28, 1 << 26, 1 << 20)  # 1 GiB / 256 MiB / 4 MiB of fp32
    a = torch.randn(n, device=DEV)
    b = torch.empty_like(a)
    ms = time_fns([lambda: b.copy_(a)], reps=20)
    gbs = 2 * a.numel() * 4 / ms / 1e6
    record("copy", f"d2d {a.numel() * 4 >> 20} MiB", ms, nbytes=2 * a.numel() * 4, copy_gbs=gbs, sizes={"n": n})
    del a, b
    free()
    return gbs


# ---- model layer sizes ----------------------------------------------------------------------------
def layer_shapes(name: str):
    """ResNet-18 / VGG-11 parameter shapes (100 classes) without torchvision."""
    if name == "vgg11":
        shapes, cin = [], 3
        for cout in (64, 128, 256, 256, 512, 512, 512, 512):
            shapes += [(cout, cin, 3, 3), (cout,)]
            cin = cout
        return shapes + [(4096, 512 * 7 * 7), (4096,), (4096, 4096), (4096,), (100, 4096), (100,)]
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    cin = 64
    for cout in (64, 128, 256, 512):
        for blk in range(2):
            shapes += [(cout, cin if blk == 0 else cout, 3, 3), (cout,), (cout,), (cout, cout, 3, 3), (cout,), (cout,)]
            if blk == 0 and cin != cout:
                shapes += [(cout, cin, 1, 1), (cout,), (cout,)]
        cin = cout
    return shapes + [(100, 512), (100,)]


def small_shapes():
    """CPU quick run: a few hundred thousand parameters with the same kinds of tensors."""
    return [(32, 3, 3, 3), (32,), (64, 32, 3, 3), (64,), (128, 64, 3, 3), (128,), (10, 2048), (10,)]


def numel(s):
    n = 1
    for x in s:
        n *= x
    return n


# ---- weighted_sum (FedAvg apply) ------------------------------------------------------------------
def bench_weighted_sum(copy_gbs):
    d = D(11_220_132, 2_000_003, 50_003)
    for K in (10, 100) if is_cuda() and not QUICK else (4, 10):
        for dtype in (torch.float32, torch.bfloat16):
            U = torch.randn(K, d, device=DEV).to(dtype)
            esz = U.element_size()
            nb = (K + 2) * d * esz
            sets = copies_needed(nb)
            Us = [U] + [torch.randn(K, d, device=DEV).to(dtype) for _ in range(sets - 1)]
            coef = torch.rand(K, dtype=torch.float64)  # host coefficients, as the algorithms pass them
            coef /= coef.sum()
            w = torch.randn(d, device=DEV).to(dtype)
            out = torch.empty_like(w)
            ms = time_fns([lambda u=u: ops.weighted_sum(u, coef, base=w, out=out) for u in Us])
            c = coef.to(DEV, dtype)
            base = {"torch_coef_at_U": time_fns([lambda u=u: torch.add(w, c @ u, out=out) for u in Us])}
            record(
                "weighted_sum",
                f"K={K} d={d} {str(dtype)[6:]}",
                ms,
                nbytes=nb,
                flops=2 * K * d,
                copy_gbs=copy_gbs,
                baselines=base,
                sizes={"K": K, "d": d, "dtype": str(dtype)[6:]},
                extra={"target": "FedAvg 100x11M < 5 ms; >= 85% copy bw"},
            )
            del U, Us, w, out
            free()


# ---- gram ---------------------------------------------------------------------------------------
def bench_gram(copy_gbs):
    d = D(11_220_132, 2_000_003, 50_003)
    if is_cuda():
        torch.backends.cuda.matmul.allow_tf32 = False
    for K in (10, 16, 32, 100) if is_cuda() and not QUICK else (4, 10):
        U = torch.randn(K, d, device=DEV)
        nb = K * d * 4
        sets = copies_needed(nb)
        Us = [U] + [torch.randn_like(U) for _ in range(sets - 1)]
        ms = time_fns([lambda u=u: ops.gram(u) for u in Us], reps=20)
        U64 = U.double()
        base = {
            "torch_fp64_U_UT": time_fns([lambda: U64 @ U64.T], reps=10),
            "torch_fp32_U_UT_notf32": time_fns([lambda u=u: u @ u.T for u in Us], reps=20),
        }
        G1, G2 = ops.gram(U), ops.gram(U)
        same = bool(torch.equal(G1, G2))
        ref = U64 @ U64.T
        rel = float((G1 - ref).norm() / ref.norm())
        del ref, U64
        record(
            "gram",
            f"K={K} d={d} fp32",
            ms,
            nbytes=nb,
            flops=2 * K * K * d,
            copy_gbs=copy_gbs,
            baselines=base,
            sizes={"K": K, "d": d, "dtype": "float32"},
            extra={
                "bitwise_repeatable": same,
                "rel_err_vs_fp64": rel,
                "target": "K=100: within 2x of the memory floor",
            },
        )
        del U, Us
        free()


# ---- kstats -----------------------------------------------------------------------------------------
def bench_kstats(copy_gbs):
    """Kuramoto's statistics (dot with the p-weighted mean, row norms, ||mean||^2, flags): one read of U.
    Baselines: the K x K Gram then G @ p (the path before ops.kstats) and the fp32 torch ops a user would
    write (mean = p @ U, U @ mean, rows' squared norms: three reads)."""
    d = D(11_220_132, 2_000_003, 50_003)
    if is_cuda():
        torch.backends.cuda.matmul.allow_tf32 = False
    for K in (10, 100) if is_cuda() and not QUICK else (4, 10):
        U = torch.randn(K, d, device=DEV)
        nb = K * d * 4
        sets = copies_needed(nb)
        Us = [U] + [torch.randn_like(U) for _ in range(sets - 1)]
        p = torch.rand(K, dtype=torch.float64)
        p /= p.sum()
        ms = time_fns([lambda u=u: ops.kstats(u, p) for u in Us], reps=20)
        p_dev, p32 = p.to(DEV), p.to(DEV, torch.float32)

        def torch_fp32(u):
            m = p32 @ u
            return u @ m, u.square().sum(1), m @ m

        base = {
            "gram_then_Gp": time_fns([lambda u=u: ops.gram(u) @ p_dev for u in Us], reps=10),
            "torch_fp32_three_reads": time_fns([lambda u=u: torch_fp32(u) for u in Us], reps=20),
        }
        dot, nsq, nbar, _ = ops.kstats(U, p)
        same = bool(torch.equal(dot, ops.kstats(U, p)[0]))
        U64 = U.double()
        m64 = p_dev @ U64
        rel = float((dot - U64 @ m64).norm() / (U64 @ m64).norm())
        del U64, m64
        record(
            "kstats",
            f"K={K} d={d} fp32",
            ms,
            nbytes=nb,
            flops=6 * K * d,
            copy_gbs=copy_gbs,
            baselines=base,
            sizes={"K": K, "d": d, "dtype": "float32"},
            extra={
                "bitwise_repeatable": same,
                "rel_err_dot_vs_fp64": rel,
                "target": "Kuramoto = kstats + weighted_sum <= 2.5x one read of U",
            },
        )
        del U, Us
        free()


# ---- select (order_mean, closest_mean) -------------------------------------------------------------
def bench_select(copy_gbs):
    """Coordinate-wise median, trimmed mean (beta = 0.1) and Bulyan's beta-closest mean: one read of U.
    Baselines: torch.median(U, 0) and a torch.sort trimmed mean (a sorted K x d copy)."""
    d = D(11_220_132, 2_000_003, 50_003)
    for K in (10, 100) if is_cuda() and not QUICK else (4, 10):
        U = torch.randn(K, d, device=DEV)
        nb = K * d * 4
        sets = copies_needed(nb)
        Us = [U] + [torch.randn_like(U) for _ in range(sets - 1)]
        lo_m, hi_m = ops.select.median_bounds(K)
        lo_t, hi_t = ops.select.trim_bounds(K, 0.1)
        beta = max(1, K - 4 * (K // 10))
        med = ops.order_mean(U, lo_m, hi_m)
        same = bool(torch.equal(med, ops.order_mean(U, lo_m, hi_m)))
        from fedkernels import reference

        err = float((med.double() - reference.order_mean(U, lo_m, hi_m)).abs().max())
        for label, fn, base in (
            (
                "median",
                lambda u: ops.order_mean(u, lo_m, hi_m),
                {"torch_median_0": time_fns([lambda u=u: torch.median(u, 0) for u in Us], reps=5)},
            ),
            (
                "trimmed 0.1",
                lambda u: ops.order_mean(u, lo_t, hi_t),
                {
                    "torch_sort_trimmed": time_fns(
                        [lambda u=u: torch.sort(u, 0).values[lo_t:hi_t].mean(0) for u in Us], reps=5
                    )
                },
            ),
            (f"closest beta={beta}", lambda u: ops.closest_mean(u, beta), {}),
        ):
            ms = time_fns([lambda u=u: fn(u) for u in Us], reps=10)
            record(
                "order_mean" if label != f"closest beta={beta}" else "closest_mean",
                f"{label} K={K} d={d} fp32",
                ms,
                nbytes=nb,
                copy_gbs=copy_gbs,
                baselines=base,
                sizes={"K": K, "d": d, "dtype": "float32"},
                extra={
                    "bitwise_repeatable": same,
                    "median_max_abs_err_vs_fp64": err,
                    "target": "median / trimmed mean: one read of U (GPU speed not yet measured)",
                },
            )
        del U, Us
        free()


# ---- the codecs' and privacy's ops, the server optimiser step ---------------------------------------
def bench_codecs(copy_gbs):
    """dequant_weighted_sum (int8 / fp8 e4m3 blocks x fp32 scales summed into fp32: one read of the K d
    codes) against torch's dequantise-then-sum (a K x d fp32 copy), and sparse_weighted_sum of top-1%
    lists against torch's index_add_ into a zero vector."""
    d = D(11_220_132, 2_000_003, 50_003)
    block = 256
    for K in (10, 100) if is_cuda() and not QUICK else (4,):
        nb = -(-d // block)
        coef = torch.rand(K, dtype=torch.float64)
        coef_dev = coef.to(DEV)
        for name, qdt in (("int8", torch.int8), ("fp8_e4m3", torch.float8_e4m3fn)):
            raw = torch.randint(-127, 128, (K, d), device=DEV, dtype=torch.int8)
            Q = raw if qdt == torch.int8 else (raw.float() / 16).to(qdt)
            S = torch.rand(K, nb, device=DEV) / 127
            nbytes = K * d + K * nb * 4
            sets = copies_needed(nbytes)
            Qs = [Q] + [Q.roll(i + 1, 1) for i in range(sets - 1)]
            ms = time_fns([lambda q=q: ops.dequant_weighted_sum(q, S, coef, block) for q in Qs], reps=10)

            def torch_dequant(q):
                full = torch.zeros(K, nb * block, device=DEV)
                full[:, :d] = q.float()
                return coef_dev.float() @ (full.view(K, nb, block) * S[:, :, None]).view(K, -1)[:, :d]

            base = {"torch_dequantise_then_sum": time_fns([lambda q=q: torch_dequant(q) for q in Qs], reps=5)}
            out, ok = ops.dequant_weighted_sum(Q, S, coef, block)
            same = bool(torch.equal(out, ops.dequant_weighted_sum(Q, S, coef, block)[0]))
            rec = Q.double().view(K, -1) if qdt == torch.int8 else Q.to(torch.float64)
            ref = coef.to(DEV) @ (rec * S.double().repeat_interleave(block, 1)[:, :d])
            err = float((out.double() - ref).abs().max() / ref.abs().max())
            record(
                "dequant_weighted_sum",
                f"{name} block={block} K={K} d={d}",
                ms,
                nbytes=nbytes,
                copy_gbs=copy_gbs,
                baselines=base,
                sizes={"K": K, "d": d, "block": block, "codes": name},
                extra={"bitwise_repeatable": same, "rel_err_vs_fp64": err, "rows_ok": bool(ok.all())},
            )
            del Q, Qs, S, raw
            free()
        k = max(1, d // 100)
        idx = [torch.sort(torch.randperm(d, device=DEV)[:k]).values for _ in range(K)]
        val = [torch.randn(k, device=DEV) for _ in range(K)]
        I, V, offs = ops.stack_lists(idx, val)
        nbytes = K * k * (8 + 4) + d * 4
        ms = time_fns([lambda: ops.sparse_weighted_sum(I, V, offs, coef, d)], reps=10)

        def torch_scatter():
            out = torch.zeros(d, device=DEV)
            return out.index_add_(0, I, V * coef_dev.float().repeat_interleave(torch.diff(offs.to(DEV))))

        base = {"torch_index_add": time_fns([torch_scatter], reps=5)}
        out, _ = ops.sparse_weighted_sum(I, V, offs, coef, d)
        same = bool(torch.equal(out, ops.sparse_weighted_sum(I, V, offs, coef, d)[0]))
        record(
            "sparse_weighted_sum",
            f"top-1% K={K} d={d}",
            ms,
            nbytes=nbytes,
            copy_gbs=copy_gbs,
            baselines=base,
            sizes={"K": K, "d": d, "k": k},
            extra={"bitwise_repeatable": same},
        )
        del idx, val, I, V
        free()


def bench_noise(copy_gbs):
    """Central DP's aggregate: weighted_sum_noised (the Gaussian noise drawn in the sum's output write)
    against weighted_sum alone and weighted_sum + torch.randn."""
    d = D(11_220_132, 2_000_003, 50_003)
    for K in (10, 100) if is_cuda() and not QUICK else (4,):
        U = torch.randn(K, d, device=DEV)
        coef = torch.full((K,), 1.0 / K, dtype=torch.float64)
        nb = K * d * 4
        Us = [U] + [torch.randn_like(U) for _ in range(copies_needed(nb) - 1)]
        ms = time_fns([lambda u=u: ops.weighted_sum_noised(u, coef, sigma=0.01, seed=7, counter=3) for u in Us])
        base = {
            "weighted_sum": time_fns([lambda u=u: ops.weighted_sum(u, coef) for u in Us]),
            "weighted_sum_plus_torch_randn": time_fns(
                [lambda u=u: ops.weighted_sum(u, coef).add_(torch.randn(d, device=DEV), alpha=0.01) for u in Us]
            ),
        }
        a = ops.weighted_sum_noised(U, coef, sigma=0.01, seed=7, counter=3)
        same = bool(torch.equal(a, ops.weighted_sum_noised(U, coef, sigma=0.01, seed=7, counter=3)))
        record(
            "weighted_sum_noised",
            f"K={K} d={d} fp32",
            ms,
            nbytes=nb,
            copy_gbs=copy_gbs,
            baselines=base,
            sizes={"K": K, "d": d},
            extra={"bitwise_repeatable": same},
        )
        del U, Us
        free()


def bench_server_opt(copy_gbs):
    """FedAdam's server step: server_opt_step_ (one pass over io, m, v, x) against the same step as
    torch elementwise ops (Flower's arithmetic on tensors)."""
    d = D(11_220_132, 2_000_003, 50_003)
    x = torch.randn(d, device=DEV)
    g = torch.randn(d, device=DEV) * 1e-2
    m, v = torch.zeros(d, device=DEV), torch.zeros(d, device=DEV)
    nbytes = d * 4 * 6  # read io, m, v, x; write io, m, v (io written in place counts once more)

    def ours():
        io = g.clone()
        ops.server_opt_step_(io, m, v, x, rule="adam", lr=0.01, beta_1=0.9, beta_2=0.99, tau=1e-9)

    def plain():
        mm = 0.9 * m + 0.1 * g
        vv = 0.99 * v + 0.01 * g * g
        return x + 0.01 * mm / (vv.sqrt() + 1e-9)

    ms = time_fns([ours])
    base = {"torch_elementwise": time_fns([plain])}
    record(
        "server_opt_step_",
        f"adam d={d} fp32",
        ms,
        nbytes=nbytes,
        copy_gbs=copy_gbs,
        baselines=base,
        sizes={"d": d, "dtype": "float32"},
    )
    del x, g, m, v
    free()


# ---- finite_rows ----------------------------------------------------------------------------------
def bench_finite_rows(copy_gbs):
    d = D(11_220_132, 2_000_003, 50_003)
    K = 100 if is_cuda() and not QUICK else 8
    U = torch.randn(K, d, device=DEV)
    nb = K * d * 4
    ms = time_fns([lambda: ops.finite_rows(U)])
    base = {"torch_isfinite_all": time_fns([lambda: torch.isfinite(U).all(1)])}
    record("finite_rows", f"K={K} d={d} fp32", ms, nbytes=nb, copy_gbs=copy_gbs, baselines=base, sizes={"K": K, "d": d})
    del U
    free()


# ---- min_norm -------------------------------------------------------------------------------------
def bench_min_norm():
    for K in (10, 100, 1000) if is_cuda() and not QUICK else (10, 100):
        g = torch.Generator(device="cpu").manual_seed(K)
        M = torch.randn(K, 2 * K, generator=g, dtype=torch.float64) + 0.3
        G = M @ M.T
        G /= G.diagonal().max()
        Gd = G.to(DEV)
        for method in ("fw", "away"):

            def run():
                return torch.ops.fedkernels.min_norm(Gd, 1000, 1e-6, 1e-12, method, "best_pair", False, None)

            ms, how = time_host_bound(run, reps=5)
            lam, it, gap = run()
            sync()
            q = float(lam.cpu() @ G @ lam.cpu())
            lam_h, it_h, _ = torch.ops.fedkernels.min_norm(G, 1000, 1e-6, 1e-12, method, "best_pair", False, None)
            host_ms = time_fns(
                [lambda: torch.ops.fedkernels.min_norm(G, 1000, 1e-6, 1e-12, method, "best_pair", False, None)], reps=5
            )
            q_h = float(lam_h @ G @ lam_h)
            record(
                "min_norm",
                f"K={K} {method} tol_rel=1e-6",
                ms,
                baselines={"cpu_op": host_ms},
                sizes={"K": K, "method": method},
                extra={
                    "timing": how,
                    "iterations": int(it),
                    "gap": float(gap),
                    "q": q,
                    "q_cpu": q_h,
                    "cpu_iterations": int(it_h),
                    "target": "K=1000 < 1 ms",
                },
            )


# ---- gc_project_ ----------------------------------------------------------------------------------
def bench_gc(copy_gbs):
    for model in ("resnet18", "vgg11") if is_cuda() and not QUICK else ("resnet18",):
        shapes = layer_shapes(model) if is_cuda() else small_shapes()
        n_total = sum(numel(s) for s in shapes)
        nb = 2 * n_total * 4
        ts = [torch.randn(s, device=DEV) for s in shapes]
        ms, how = time_host_bound(lambda: ops.gc_project_(ts, "skip"))

        def loop():
            for t in ts:
                if t.dim() > 1:
                    t.sub_(t.mean(dim=tuple(range(1, t.dim())), keepdim=True))

        base = {"per_tensor_loop": time_host_bound(loop)[0]}
        record(
            "gc_project_",
            f"{model if is_cuda() else 'small'} ({len(shapes)} tensors, {n_total} params)",
            ms,
            nbytes=nb,
            copy_gbs=copy_gbs,
            baselines=base,
            sizes={"tensors": len(shapes), "params": n_total},
            extra={"timing": how},
        )
        del ts
        free()


# ---- fused local SGD step (SCAFFOLD with momentum) --------------------------------------------------
def bench_fused_step(copy_gbs):
    shapes = layer_shapes("resnet18") if is_cuda() else small_shapes()
    n_total = sum(numel(s) for s in shapes)
    mk = lambda: [torch.randn(s, device=DEV) * 0.01 for s in shapes]  # noqa: E731
    p, g, buf, c, ci = mk(), mk(), mk(), mk(), mk()
    nb = 7 * n_total * 4  # read p, g, buf, c, c_i; write p, buf
    lr, mu, wd = 0.01, 0.9, 1e-4

    def fused():
        torch.ops.fedkernels.fused_sgd_step_(p, g, buf, c, ci, [], lr, mu, wd, False, "skip", 2)

    def foreach():  # the torch composition a user would write
        d = torch._foreach_add(g, c)
        torch._foreach_sub_(d, ci)
        torch._foreach_add_(d, p, alpha=wd)
        torch._foreach_mul_(buf, mu)
        torch._foreach_add_(buf, d)
        torch._foreach_add_(p, buf, alpha=-lr)

    ms, how = time_host_bound(fused)
    base = {"torch_foreach_sgd": time_host_bound(foreach)[0]}
    record(
        "fused_sgd_step_",
        f"SCAFFOLD+momentum ({len(shapes)} tensors, {n_total} params)",
        ms,
        nbytes=nb,
        copy_gbs=copy_gbs,
        baselines=base,
        sizes={"tensors": len(shapes), "params": n_total},
        extra={"timing": how},
    )
    del p, g, buf, c, ci
    free()


# ---- LU -------------------------------------------------------------------------------------------
def bench_lu(copy_gbs):
    cases = ((11, 10_000, 1_000), (33, 1_000, 10_000), (4, 1_000_000, 1), (11, 1, 11_220_132))
    for n, B, m in cases:
        if not is_cuda():
            B, m = min(B, 64), min(m, 2_000)
        elif QUICK and B * n * m > 2e7:
            continue
        A = torch.randn(B, n, n, device=DEV, dtype=torch.float64) + n * torch.eye(n, device=DEV, dtype=torch.float64)
        R = torch.randn(B, n, m, device=DEV)
        ms_f, how_f = time_host_bound(lambda: torch.ops.fedkernels.lu_factor(A), reps=10)
        LU, piv, _ = torch.ops.fedkernels.lu_factor(A)
        ms_s = time_fns([lambda: torch.ops.fedkernels.lu_solve(LU, piv, R)], reps=10)
        bf = {"torch_lu_factor": time_fns([lambda: torch.linalg.lu_factor(A)], reps=5)}
        LUt, pivt = torch.linalg.lu_factor(A.float())
        bs = {"torch_linalg_lu_solve": time_fns([lambda: torch.linalg.lu_solve(LUt, pivt, R)], reps=5)}
        sizes = {"n": n, "B": B, "m": m}
        record(
            "lu_factor",
            f"n={n} B={B} fp64",
            ms_f,
            nbytes=2 * B * n * n * 8,
            copy_gbs=copy_gbs,
            baselines=bf,
            sizes=sizes,
            extra={"timing": how_f},
        )
        record(
            "lu_solve",
            f"n={n} B={B} m={m} fp32",
            ms_s,
            nbytes=B * (n * n * 8 + 2 * n * m * 4),
            copy_gbs=copy_gbs,
            baselines=bs,
            sizes=sizes,
        )
        del A, R, LU, LUt
        free()


# ---- fedecado_be_step -------------------------------------------------------------------------------
def bench_be_step(copy_gbs):
    """One fused FedECADO backward-Euler attempt (fedecado_be_step_out into reused buffers). K <= 32
    keeps r_i / q_i in registers, larger K in per-thread shared-memory slots: every input element is
    read once either way, so the floor is (3K + 3) d reads + (K + 1) d writes."""
    d = D(11_220_132, 2_000_003, 50_003)
    for K in (10, 40, 100) if is_cuda() and not QUICK else (4, 40):
        g = torch.Generator(device="cpu").manual_seed(K)
        T = torch.rand(K, generator=g, dtype=torch.float64) + 0.5
        coefs = (T, 0.5 * T, 0.2 * torch.rand(K, generator=g, dtype=torch.float64))  # host per-client scalars
        xc, xc0, S = (torch.randn(d, device=DEV) for _ in range(3))
        Icur, U, Ik = (torch.randn(K, d, device=DEV) for _ in range(3))
        xo, Io = torch.empty(d, device=DEV), torch.empty(K, d, device=DEV)
        lte = torch.empty(2, dtype=torch.float64, device=DEV)
        args = (xc, Icur, xc0, U, Ik, S) + coefs + (0.3, 1.7)
        ms = time_fns([lambda: torch.ops.fedkernels.fedecado_be_step_out(*args, xo, Io, lte)], reps=10)
        nb = ((3 * K + 3) + (K + 1)) * d * 4
        record(
            "fedecado_be_step",
            f"K={K} d={d} fp32",
            ms,
            nbytes=nb,
            copy_gbs=copy_gbs,
            sizes={"K": K, "d": d},
            extra={
                "path": "registers" if K <= 32 else "shared-memory slots",
                "target": "one read of every input element (>= 85% of copy bandwidth)",
            },
        )
        del xc, xc0, S, Icur, U, Ik, xo, Io
        free()


# ---- sanitizer subset ------------------------------------------------------------------------------
def sanitize_subset() -> int:
    """Every CUDA op once on small shapes (vector and scalar paths, both LU kernels, K above the
    block size), synchronised: the workload of ``compute-sanitizer`` memcheck / racecheck in
    ``bench/gpu.sh build-test``. Checks results loosely against the CPU ops so a silent failure shows."""
    dev = "cuda"
    g = torch.Generator().manual_seed(0)
    rn = lambda *s, dt=torch.float32: torch.randn(*s, generator=g, dtype=torch.float64).to(dt)  # noqa: E731
    bad = []

    def close(name, a, b, tol):
        if not torch.allclose(a.detach().cpu().double(), b.detach().cpu().double(), rtol=tol, atol=tol, equal_nan=True):
            bad.append(name)

    for dt in (torch.float32, torch.bfloat16, torch.float64):
        for K, d, off in ((3, 1031, 0), (300, 70, 1), (17, 4099, 0)):
            big = rn(K, d + 3, dt=dt)
            U = big[:, off : off + d]
            coef = torch.rand(K, generator=g, dtype=torch.float64)
            Ud = big.to(dev)[:, off : off + d]
            close(f"weighted_sum {dt} {K}x{d}", ops.weighted_sum(Ud, coef), ops.weighted_sum(U, coef), 2e-2)
            close(f"gram {dt} {K}x{d}", ops.gram(Ud), ops.gram(U), 1e-6)
            close(f"gram rows {dt}", ops.gram(Ud, rows=[0, K - 1]), ops.gram(U, rows=[0, K - 1]), 1e-6)
            close(f"finite_rows {dt}", ops.finite_rows(Ud), ops.finite_rows(U), 0)
            for name, a, b in zip(("dot", "nsq", "nbar", "ok"), ops.kstats(Ud, coef), ops.kstats(U, coef)):
                close(f"kstats {name} {dt} {K}x{d}", a, b, 1e-9 if name != "ok" else 0)
            if K <= 20:  # select: O(K^2) per column on the GPU
                rows = [0, K - 1, K // 2]
                for name, a, b in (
                    (
                        "order_mean",
                        ops.order_mean_screened(Ud, 1, K, rows=rows[:2] + [1] * (K - 2)),
                        ops.order_mean_screened(U, 1, K, rows=rows[:2] + [1] * (K - 2)),
                    ),
                    (
                        "closest_mean",
                        ops.closest_mean_screened(Ud, 2, rows=rows),
                        ops.closest_mean_screened(U, 2, rows=rows),
                    ),
                ):
                    close(f"{name} {dt} {K}x{d}", a[0], b[0], 1e-6)
                    close(f"{name} ok {dt} {K}x{d}", a[1], b[1], 0)
    for N in (40, 200):  # G in shared memory / in global memory (N > 168 on sm_90)
        G = rn(N, N // 2, dt=torch.float64)
        G = G @ G.T / (N // 2) + torch.eye(N, dtype=torch.float64)
        for m in ("fw", "away", "pairwise"):
            lam, _, _ = torch.ops.fedkernels.min_norm(G.to(dev), 2000, 1e-10, 1e-15, m, "best_pair", False, None)
            lam_c, _, _ = torch.ops.fedkernels.min_norm(G, 2000, 1e-10, 1e-15, m, "best_pair", False, None)
            close(f"min_norm {m} N={N}", lam @ G.to(dev) @ lam, lam_c @ G @ lam_c, 1e-6)
    ts = [rn(8, 3, 3, 3), rn(16, 2000), rn(4, 9000), rn(10)]
    close(
        "gc_project",
        torch.cat([t.reshape(-1) for t in ops.gc_project([t.to(dev) for t in ts], "center")]),
        torch.cat([t.reshape(-1) for t in ops.gc_project(ts, "center")]),
        1e-5,
    )
    for n in (5, 33):
        A = rn(6, n, n, dt=torch.float64) + n * torch.eye(n, dtype=torch.float64)
        LU, piv, info = torch.ops.fedkernels.lu_factor(A.to(dev))
        LUc, pivc, _ = torch.ops.fedkernels.lu_factor(A)
        close(f"lu_factor n={n}", LU, LUc, 1e-10)
        R = rn(6, n, 300)
        close(
            f"lu_solve n={n}",
            torch.ops.fedkernels.lu_solve(LU, piv, R.to(dev)),
            torch.ops.fedkernels.lu_solve(LUc, pivc, R),
            1e-4,
        )
    a, b, c = (
        torch.rand(5, generator=g, dtype=torch.float64) + 1,
        -torch.rand(5, generator=g, dtype=torch.float64),
        torch.rand(5, generator=g, dtype=torch.float64),
    )
    r0, R = rn(700), rn(5, 700)
    xg, Ig = torch.ops.fedkernels.arrowhead_solve(a, b, c, 1.0, r0.to(dev), R.to(dev))
    xc, Ic = torch.ops.fedkernels.arrowhead_solve(a, b, c, 1.0, r0, R)
    close("arrowhead x", xg, xc, 1e-5)
    close("arrowhead I", Ig, Ic, 1e-5)
    for K in (3, 40):
        d = 2049
        T = torch.rand(K, generator=g, dtype=torch.float64) + 0.5
        args = [
            rn(d),
            rn(K, d),
            rn(d),
            rn(K, d),
            rn(K, d),
            rn(d),
            T,
            0.5 * T,
            0.2 * torch.rand(K, generator=g, dtype=torch.float64),
            0.3,
            1.7,
        ]
        dev_args = [x.to(dev) if isinstance(x, torch.Tensor) and i < 6 else x for i, x in enumerate(args)]
        outs_g = torch.ops.fedkernels.fedecado_be_step(*dev_args)
        outs_c = torch.ops.fedkernels.fedecado_be_step(*args)
        for i, (x, y) in enumerate(zip(outs_g, outs_c)):
            close(f"be_step K={K} out{i}", x, y, 1e-4)
    shapes = [(8, 3, 3, 3), (8,), (10, 72)]
    p_c = [rn(*s) for s in shapes]
    gr = [rn(*s) for s in shapes]
    bufs = [rn(*s) for s in shapes]
    p_g, gr_g, bufs_g = [t.to(dev) for t in p_c], [t.to(dev) for t in gr], [t.to(dev) for t in bufs]
    for p, gg, bb in ((p_g, gr_g, bufs_g), (p_c, gr, bufs)):
        torch.ops.fedkernels.fused_sgd_step_(p, gg, bb, [], [], [True, False, True], 0.1, 0.9, 1e-3, False, "skip", 2)
    for i in range(len(shapes)):
        close(f"fused_sgd_step_ {i}", p_g[i], p_c[i], 1e-5)
    for K, d, block in ((3, 1031, 256), (17, 4099, 64)):  # the codecs' and privacy's ops
        coef = torch.rand(K, generator=g, dtype=torch.float64)
        Q = torch.randint(-127, 128, (K, d), generator=g, dtype=torch.int8)
        S = torch.rand(K, -(-d // block), generator=g)
        for qn, q in (("int8", Q), ("fp8", (Q.float() / 16).to(torch.float8_e4m3fn))):
            a, b = (
                ops.dequant_weighted_sum(q.to(dev), S.to(dev), coef, block),
                ops.dequant_weighted_sum(q, S, coef, block),
            )
            close(f"dequant_weighted_sum {qn} K={K}", a[0], b[0], 1e-5)
            close(f"dequant_weighted_sum ok {qn} K={K}", a[1], b[1], 0)
        idx = [torch.sort(torch.randperm(d, generator=g)[: d // 7]).values for _ in range(K)]
        I, V, offs = ops.stack_lists(idx, [rn(d // 7) for _ in range(K)])
        close(
            f"sparse_weighted_sum K={K}",
            ops.sparse_weighted_sum(I.to(dev), V.to(dev), offs, coef, d)[0],
            ops.sparse_weighted_sum(I, V, offs, coef, d)[0],
            1e-5,
        )
        U = rn(K, d)
        close(
            f"weighted_sum_noised K={K}",
            ops.weighted_sum_noised(U.to(dev), coef, sigma=0.5, seed=3, counter=K),
            ops.weighted_sum_noised(U, coef, sigma=0.5, seed=3, counter=K),
            1e-5,
        )
        x, gr = rn(d), rn(d)
        for rule in ("adam", "yogi", "adagrad"):
            res = []
            for where in (dev, "cpu"):
                io, m, v = gr.clone().to(where), torch.zeros(d, device=where), torch.full((d,), 1e-6, device=where)
                ops.server_opt_step_(io, m, v, x.to(where), rule=rule, lr=0.1, beta_1=0.9, beta_2=0.99, tau=1e-3)
                res.append(io)
            close(f"server_opt_step_ {rule} d={d}", res[0], res[1], 1e-6)
    torch.cuda.synchronize()
    if bad:
        print("sanitize subset: results differ from the CPU ops:", ", ".join(bad), file=sys.stderr)
        return 1
    print("sanitize subset: every op ran and matched the CPU ops")
    return 0


# ---- whole aggregates ----------------------------------------------------------------------------
def bench_aggregate(copy_gbs):
    """One round of every registered aggregator (bench/cpu_hostwork.py builds each with the client
    payloads it needs), against the one-read floor (K d bytes at the copy bandwidth) and plain torch
    ``glob + w @ U``. ResNet-18 at K = 10 and 100, VGG-11 at K = 10 (and 100 where it fits)."""
    from bench.cpu_hostwork import aggregator_cases, spec_of

    if is_cuda() and not QUICK:
        models = [("resnet18", layer_shapes("resnet18"), (10, 100)), ("vgg11", layer_shapes("vgg11"), (10, 100))]
    elif is_cuda():
        models = [("resnet18", layer_shapes("resnet18"), (10,))]
    else:
        models = [("small", small_shapes(), (4, 10))]
    mem = torch.cuda.get_device_properties(0).total_memory if is_cuda() else None
    for mname, shapes, Ks in models:
        spec = spec_of(shapes)
        d = spec.d
        for K in Ks:
            # U, the payloads' deltas and one N x d state table (+ slack) must fit
            if mem is not None and 4 * K * d * 4 > 0.8 * mem:
                print(f"aggregate      {mname} K={K}: skipped ({4 * K * d * 4 >> 30} GiB > 80% of device memory)")
                continue
            floor_b = K * d * 4
            torch_ms = None
            for name, run, info in aggregator_cases(K, spec, device=DEV):
                if torch_ms is None:
                    U, x0 = info["U"], info["x0"]
                    w = torch.tensor(info["n"], dtype=torch.float32, device=DEV)
                    w /= w.sum()
                    torch_ms = time_fns([lambda: x0 + w @ U], reps=10)
                    record(
                        "aggregate",
                        f"torch glob+w@U {mname} K={K}",
                        torch_ms,
                        nbytes=floor_b,
                        copy_gbs=copy_gbs,
                        sizes={"K": K, "d": d, "model": mname},
                        extra={"method": "torch_glob_plus_w_at_U"},
                    )
                ms = time_fns([run], warmup=2, reps=10)
                floor_ms = floor_b / copy_gbs / 1e6
                record(
                    "aggregate",
                    f"{name} {mname} K={K}",
                    ms,
                    nbytes=floor_b,
                    copy_gbs=copy_gbs,
                    baselines={"torch_glob_plus_w_at_U": torch_ms},
                    sizes={"K": K, "d": d, "model": mname},
                    extra={"method": name, "floor_ms": floor_ms, "x_floor": ms / floor_ms},
                )
            free()


def main(argv=None):
    global DEV, QUICK
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cuda (default) or cpu (CI smoke run)")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    ap.add_argument(
        "--only",
        default="",
        help="comma list: weighted_sum,gram,kstats,select,codecs,noise,server_opt,finite_rows,min_norm,gc,fused_step,lu,be_step,aggregate "
        "(copy always runs)",
    )
    add_out_argument(ap)
    ap.add_argument(
        "--sanitize-subset",
        action="store_true",
        help="run every CUDA op once on small shapes (the compute-sanitizer workload) and exit",
    )
    args = ap.parse_args(argv)
    DEV, QUICK = args.device, args.quick
    if args.sanitize_subset:
        if not torch.cuda.is_available():
            print("bench/gpu.py: --sanitize-subset needs a CUDA device", file=sys.stderr)
            return 2
        return sanitize_subset()
    if not is_cuda():
        torch.set_num_threads(1)  # the CPU smoke run: small sizes, repeatable on a shared CI machine
    info = fedkernels.build_info()
    if is_cuda():
        if not torch.cuda.is_available():
            print("bench/gpu.py: no CUDA device (use --device cpu for the CPU smoke run)", file=sys.stderr)
            return 2
        if not info.get("cuda"):
            print("bench/gpu.py: fedkernels was built without CUDA", file=sys.stderr)
            return 2
    known = {
        "weighted_sum",
        "gram",
        "kstats",
        "select",
        "codecs",
        "noise",
        "server_opt",
        "finite_rows",
        "min_norm",
        "gc",
        "fused_step",
        "lu",
        "be_step",
        "aggregate",
    }
    only = set(filter(None, args.only.split(",")))
    if only - known:
        print(f"bench/gpu.py: --only got {sorted(only - known)}, expected names from {sorted(known)}", file=sys.stderr)
        return 2
    want = lambda k: not only or k in only  # noqa: E731
    if is_cuda():
        prop = torch.cuda.get_device_properties(0)
        dev_name, sms, mem = torch.cuda.get_device_name(0), prop.multi_processor_count, prop.total_memory
    else:
        dev_name, sms, mem = f"cpu-{platform.machine()}", 0, 0
    print(f"device {dev_name}, {sms} SMs, {mem >> 30} GiB, L2 {l2_bytes() >> 20} MiB, quick={QUICK}")
    print(f"{'op':14s} {'case':34s} {'time':>12s} {'achieved':>23s}  speed-ups")
    copy_gbs = bench_copy()
    benches = [
        ("weighted_sum", lambda: bench_weighted_sum(copy_gbs)),
        ("gram", lambda: bench_gram(copy_gbs)),
        ("kstats", lambda: bench_kstats(copy_gbs)),
        ("select", lambda: bench_select(copy_gbs)),
        ("codecs", lambda: bench_codecs(copy_gbs)),
        ("noise", lambda: bench_noise(copy_gbs)),
        ("server_opt", lambda: bench_server_opt(copy_gbs)),
        ("finite_rows", lambda: bench_finite_rows(copy_gbs)),
        ("min_norm", bench_min_norm),
        ("gc", lambda: bench_gc(copy_gbs)),
        ("fused_step", lambda: bench_fused_step(copy_gbs)),
        ("lu", lambda: bench_lu(copy_gbs)),
        ("be_step", lambda: bench_be_step(copy_gbs)),
        ("aggregate", lambda: bench_aggregate(copy_gbs)),
    ]
    for name, fn in benches:
        if want(name):
            fn()
    doc = {
        "device": dev_name,
        "sms": sms,
        "l2_bytes": l2_bytes(),
        "copy_GBps": copy_gbs,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "build_info": info,
        "python": platform.python_version(),
        "quick": QUICK,
        "results": RESULTS,
    }
    slug = "".join(c if c.isalnum() else "-" for c in dev_name).strip("-").lower()
    paths = [output_path(args.out, f"gpu-{slug}.json")]
    if os.environ.get("OUT"):
        paths.append(os.path.join(os.environ["OUT"], f"gpu-{slug}.json"))
    for p in paths:
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "w") as f:
            json.dump(doc, f, indent=1)
    print("wrote", ", ".join(paths))
    print("\nsummary (ms, % of copy bandwidth, speed-up over each torch baseline):")
    for r in RESULTS:
        sp = ", ".join(f"{k} {b['speedup']:.2f}x" for k, b in r.get("baselines", {}).items() if b["speedup"])
        pct = f"{r['pct_copy_bw']:.0f}%" if "pct_copy_bw" in r else "-"
        print(f"  {r['op']:15s} {r['case']:40s} {r['ms']:9.4f} ms  {pct:>5s}  {sp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
