"""No per-client host work on an aggregate's hot path (issue 28 item 2): the number of tensor ops
(and host copies) one aggregate runs must not grow with the number of clients K, for every
registered aggregator with the payloads it needs (bench/cpu_hostwork.py builds the cases). On a
GPU: at most one device-to-host sync per aggregate."""
from __future__ import annotations

import collections
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.cpu_hostwork import TINY, aggregator_cases, methods, spec_of


class OpCounter(TorchDispatchMode):
    """Counts every aten / fedkernels op dispatched inside the block."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _ops_per_aggregate(K: int, only):
    out = {}
    for name, run, _ in aggregator_cases(K, spec_of(TINY), only=only):
        with OpCounter() as c:
            run()
        out[name] = c.ops
    return out


@pytest.mark.parametrize("name", methods())
def test_ops_per_aggregate_do_not_grow_with_clients(name):
    small, large = _ops_per_aggregate(10, {name})[name], _ops_per_aggregate(200, {name})[name]
    # a per-client op adds 190 calls; a branch the data take differently adds one or two
    grown = {op: (small.get(op, 0), n) for op, n in large.items() if n > small.get(op, 0) + 5}
    assert not grown, f"{name}: ops per aggregate grow with K (K=10 -> K=200): {grown}"
    assert sum(large.values()) > 0   # the counter sees the aggregate at all


def test_counter_sees_a_per_client_loop():
    """The counter catches what the test above forbids: a Python loop with one op per client."""
    def per_row(K):
        U = torch.randn(K, 4)
        with OpCounter() as c:
            [bool(torch.isfinite(U[k]).all()) for k in range(K)]
        return sum(c.ops.values())
    assert per_row(200) > per_row(10)


@pytest.mark.parametrize("name", ["scaffold", "fedavg", "fednova", "fedavgm"])
def test_screen_copies_to_host_once(monkeypatch, name):
    """One host copy of all NaN/Inf flags per round (global model, rows, payload tensors)."""
    calls = []
    real = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: calls.append(self.shape) or real(self, *a, **k))
    (_, run, _), = aggregator_cases(50, spec_of(TINY), only={name})
    calls.clear()
    run()
    assert len(calls) == 1, calls


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["fedavg", "fedavgm", "fedprox", "fednova", "scaffold", "global_gc"])
def test_one_sync_per_aggregate_on_gpu(name):
    from fedkernels import build_info
    if not build_info().get("cuda"):
        pytest.skip("fedkernels built without CUDA")
    (_, run, _), = aggregator_cases(64, spec_of(TINY), device="cuda", only={name})
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(x.message) for x in w if "synchroniz" in str(x.message).lower()]
    assert len(syncs) <= 1, syncs


SCREEN_IN_PASS = {"fedavg": ["weighted_sum_screened"], "fedprox": ["weighted_sum_screened"],
                  "fednova": ["weighted_sum_screened"], "fedavgm": ["weighted_sum_screened"],
                  "fedpgvc": ["weighted_sum_screened"], "scaffold": ["weighted_sum_screened"],
                  "fedpvr": ["weighted_sum_screened"], "global_gc": ["weighted_sum_screened"],
                  "local_gc": ["weighted_sum_screened"], "gcfed": ["weighted_sum_screened"],
                  "kuramoto": ["gram", "weighted_sum"],   # Gram pass (screens) + weighting pass
                  "fedaware": ["gram"]}                   # ELUD Gram pass (screens); the step reads M


@pytest.mark.parametrize("name", sorted(SCREEN_IN_PASS))
def test_methods_read_U_once_per_pass(name):
    """The NaN/Inf screen rides inside the method's first pass over U: no separate finite_rows
    read (issue 28 item 1)."""
    (_, run, info), = aggregator_cases(30, spec_of(TINY), only={name})
    ptr = info["U"].data_ptr()

    class Reads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.passes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func.namespace) == "fedkernels" and args and isinstance(args[0], torch.Tensor) \
                    and args[0].dim() == 2 and args[0].data_ptr() == ptr:
                self.passes.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    with Reads() as r:
        run()
    assert r.passes == ["fedkernels." + p for p in SCREEN_IN_PASS[name]], r.passes

