"""Host work per aggregate: every registered aggregator with K = 1000 clients of a tiny model
(d ~ 64), so that the time is what Python and the host do per round (validation, screening,
per-client state updates), not the arithmetic over U. Target: under 1 ms per aggregate per method,
i.e. no per-client host work (code that validates and updates state client by client takes 13-92 us per
client: bench/results/cpu-hostwork-before.json).

Columns: ``ms`` the aggregate (median), ``native_ms`` the time inside the native
``torch.ops.fedkernels.*`` kernels during one aggregate (min of a few runs: the arithmetic, e.g.
FedAWARE's k x N Gram of its momenta, O(k N d), and its N x N min-norm solve; Kuramoto's one-pass
``kstats``, O(K d)), ``host_ms`` = the fastest sample - native_ms (Python, validation, torch glue and bookkeeping
ops).

``aggregator_cases`` builds every registered method (aliases once) with the client payloads it
needs; ``bench/gpu.py``'s whole-aggregate table uses the same cases.

Run: python -m bench.cpu_hostwork [--clients K] [--quick] [--methods NAME,...] [--baseline FILE.json]
``--methods`` times only the named methods; ``--baseline`` prints a run saved earlier (e.g.
bench/results/cpu-hostwork-before.json, a run of a version with per-client host work) next to
this one, with the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fedkernels import FlatSpec, algorithms
from fedkernels.algorithms.base import _REGISTRY

from .common import add_out_argument, compare, print_table, write_json

# Options a method needs to be built at all (others keep their defaults).
OPTIONS: Dict[str, Dict[str, Any]] = {"local_gc_only": {"lam": 0.5}}


class _Shapes(torch.nn.Module):
    """A module holding parameters of the given shapes (conv-like 4-D weights, linear 2-D, biases
    1-D), one submodule per weight and its bias, so that FlatSpec sees layers and kinds."""

    def __init__(self, shapes) -> None:
        super().__init__()
        i = 0
        layers = []
        while i < len(shapes):
            s = shapes[i]
            m = torch.nn.Module()
            m.weight = torch.nn.Parameter(torch.empty(s))
            i += 1
            if i < len(shapes) and len(shapes[i]) == 1 and len(s) > 1 and shapes[i][0] == s[0]:
                m.bias = torch.nn.Parameter(torch.empty(shapes[i]))
                i += 1
            layers.append(m)
        self.layers = torch.nn.ModuleList(layers)


def spec_of(shapes) -> FlatSpec:
    """A FlatSpec of a model with these parameter shapes (built on the meta device: no memory)."""
    with torch.device("meta"):
        return FlatSpec.from_module(_Shapes(shapes))


TINY = [(8, 4), (8,), (4, 8), (4,)]  # d = 32 + 8 + 32 + 4 = 76


def methods() -> List[str]:
    """One registered name per aggregator class (the class's own name), sorted."""
    return sorted({cls.name for cls in _REGISTRY.values()})


def aggregator_cases(
    K: int, spec: FlatSpec, device="cpu", dtype=torch.float32, seed: int = 0, only=None
) -> Iterator[Tuple[str, Callable[[], Any], Dict[str, Any]]]:
    """Yields (name, aggregate, info) for every registered method (one at a time, so a large
    model's state tables are freed before the next method's are made): ``aggregate()`` runs one
    round of K clients (ids 0..K-1 of a federation of K) on a random update matrix built once. The
    first round (state allocation, FedAWARE's exploration) has already run."""
    g = torch.Generator().manual_seed(seed)
    d = spec.d
    U = (torch.randn(K, d, generator=g) * 1e-3).to(device=device, dtype=dtype)
    x0 = (torch.randn(d, generator=g) * 0.1).to(device=device, dtype=dtype)
    n = [float(100 + 7 * k) for k in range(K)]
    ids = list(range(K))
    for name in methods():
        if only is not None and name not in only:
            continue
        agg = algorithms.build(name, **OPTIONS.get(name, {}))
        agg.setup(spec, num_clients=K, global_flat=x0)
        pl: Dict[str, Any] = {
            "local_steps": 5,
            "num_steps": 5,
            "pgvc_skipped_steps": 0,
            "local_gc": 1,
            "T": 0.1,
            "phase": 0.5,
        }
        if getattr(agg, "mu", None) is not None and isinstance(agg.mu, float):
            pl["prox_mu"] = agg.mu
        d_c = getattr(agg, "d_c", None)
        payloads = None
        if d_c is not None:  # control variates: one [d_c] delta per client
            dc = (torch.randn(K, d_c, generator=g) * 1e-4).to(device=device, dtype=dtype)
            payloads = [dict(pl, delta_c=dc[k]) for k in range(K)]
        else:
            payloads = [dict(pl) for _ in range(K)]

        def run(agg=agg, payloads=payloads):
            return agg.aggregate(x0, U, n, ids, payloads)

        run()
        yield name, run, {"K": K, "d": d, "U": U, "x0": x0, "n": n}
        del agg, run, payloads


class _NativeTime(TorchDispatchMode):
    """Sums the wall time spent inside native fedkernels ops dispatched in the block."""

    def __init__(self) -> None:
        super().__init__()
        self.s = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace != "fedkernels":
            return func(*args, **(kwargs or {}))
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.s += time.perf_counter() - t0
        return out


def native_seconds(fn: Callable[[], Any], repeats: int = 3) -> float:
    """The least time one call of ``fn`` spends inside native fedkernels ops (over ``repeats`` calls)."""
    best = float("inf")
    for _ in range(repeats):
        with _NativeTime() as t:
            fn()
        best = min(best, t.s)
    return best


def run(K: int = 1000, quick: bool = False, only=None) -> List[Dict[str, Any]]:
    rows = []
    spec = spec_of(TINY)
    for name, fn, info in aggregator_cases(K, spec, only=only):
        r = compare({name: fn}, repeats=3 if quick else 7, min_time=0.0 if quick else 0.05)[name]
        t, host = r["median_s"], r["min_s"]
        nat = min(native_seconds(fn, 2 if quick else 5), host)
        host -= nat  # (from the fastest sample: the least noise from other load)
        rows.append(
            {
                "method": name,
                "K": K,
                "d": info["d"],
                "ms": 1e3 * t,
                "us_per_client": 1e6 * t / K,
                "native_ms": 1e3 * nat,
                "host_ms": 1e3 * host,
            }
        )
        print(
            f"{name:16s} {1e3 * t:9.3f} ms  {1e6 * t / K:7.2f} us/client  (native {1e3 * nat:8.3f} ms, "
            f"host {1e3 * host:8.3f} ms)",
            flush=True,
        )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--methods", default=None, metavar="NAME,...", help="only these methods (default: every one)")
    ap.add_argument("--baseline", default=None, help="a cpu-hostwork JSON written earlier, shown as 'before'")
    add_out_argument(ap)
    a = ap.parse_args(argv)
    if a.clients < 1:
        print(f"cpu_hostwork: --clients must be >= 1, got {a.clients}", file=sys.stderr)
        return 2
    only = None
    if a.methods is not None:
        only = [m for m in a.methods.split(",") if m]
        unknown = [m for m in only if m not in methods()]
        if unknown or not only:
            print(
                f"cpu_hostwork: --methods {a.methods!r}: {unknown[0] if unknown else 'no method'} is not a method; "
                f"expected names among {', '.join(methods())}",
                file=sys.stderr,
            )
            return 2
    before = None
    if a.baseline:
        try:
            with open(a.baseline) as f:
                before = {r["method"]: r for r in json.load(f)["results"]}
        except (OSError, ValueError, KeyError) as e:
            print(f"cpu_hostwork: --baseline {a.baseline!r} is not a cpu-hostwork JSON ({e})", file=sys.stderr)
            return 2
    torch.set_num_threads(1)
    rows = run(a.clients, a.quick, None if only is None else set(only))
    cols = ["method", "K", "d", "ms", "us_per_client", "native_ms", "host_ms"]
    if before is not None:
        for r in rows:
            b = before.get(r["method"])
            if b is not None and b.get("K") == r["K"]:
                r["before_ms"] = b["ms"]
                r["speedup"] = b["ms"] / r["ms"]
        cols += ["before_ms", "speedup"]
    print_table(rows, cols)
    print("wrote", write_json("cpu-hostwork.json", rows, {"target_ms": 1.0}, out=a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
