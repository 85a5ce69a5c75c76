"""No per-client host work on an aggregate's hot path: the number of tensor ops
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

import cli_process  # tests/cli_process.py: the command in a child forked from a pre-imported interpreter


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
    assert sum(large.values()) > 0  # the counter sees the aggregate at all


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
    """One host copy of all finite flags per round (global model, rows, payload tensors)."""
    calls = []
    real = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: calls.append(self.shape) or real(self, *a, **k))
    ((_, run, _),) = aggregator_cases(50, spec_of(TINY), only={name})
    calls.clear()
    run()
    assert len(calls) == 1, calls


def _host_copies(monkeypatch):
    """Records every ``Tensor.cpu()`` and every ``Tensor.to("cpu")``: the calls that are device-to-host
    copies (syncs) when the tensor is on a GPU (on the CPU they are no-ops, but the call is made the
    same way on every device). (``.to(other.device)`` is not recorded: on a GPU it stays there.) Also
    every call of the sharding-aware reductions that return a Python value (``ops.any_`` / ``all_`` /
    ``dot`` / ``sqnorm``): each reads a device result on the host."""
    calls = []
    cpu, to = torch.Tensor.cpu, torch.Tensor.to
    from fedkernels import ops

    for name in ("any_", "all_", "dot", "sqnorm"):

        def rec(*a, _f=getattr(ops, name), _n=name, **k):
            calls.append((_n, tuple(a[0].shape)))
            return _f(*a, **k)

        monkeypatch.setattr(ops, name, rec)

    def to_cpu(dev):
        return isinstance(dev, str) and torch.device(dev).type == "cpu"

    def rec_to(self, *a, **k):
        if any(to_cpu(x) for x in a[:1]) or to_cpu(k.get("device")):
            calls.append(("to", tuple(self.shape)))
        return to(self, *a, **k)

    monkeypatch.setattr(
        torch.Tensor, "cpu", lambda self, *a, **k: calls.append(("cpu", tuple(self.shape))) or cpu(self, *a, **k)
    )
    monkeypatch.setattr(torch.Tensor, "to", rec_to)
    return calls


@pytest.mark.parametrize("mode", ["S", "P"])
def test_kuramoto_brings_its_stats_to_the_host_with_the_flags(monkeypatch, mode):
    """Kuramoto (modes S and P): one device-to-host copy per aggregate, the kstats pass's statistics in
    the same copy as the finite flags (RoundInput.kstats), not a second one for them."""
    from fedkernels import algorithms

    g = torch.Generator().manual_seed(1)
    K, d = 40, 23
    U, x = torch.randn(K, d, generator=g), torch.randn(d, generator=g)
    agg = algorithms.build("kuramoto", mode=mode, kappa0=0.5)
    agg.aggregate(x, U, [1.0 + k for k in range(K)])  # first round outside the count
    calls = _host_copies(monkeypatch)
    agg.aggregate(x, U, [1.0 + k for k in range(K)])
    assert len(calls) == 1, calls


@pytest.mark.parametrize("clip", [10.0, 1e-4])
def test_kuramoto_mode_c_brings_the_clamp_flag_to_the_host_with_the_flags(monkeypatch, clip):
    """Kuramoto mode C: one device-to-host copy per aggregate, the clamp's "clipped" flag in the same
    copy as the finite flags (weighted_sum(hold=True) + RoundInput.release), not a second sync; the
    flag and the result as before (the clamp fires at clip=1e-4 only)."""
    from fedkernels import algorithms

    g = torch.Generator().manual_seed(2)
    K, d = 40, 23
    U, x = torch.randn(K, d, generator=g), torch.randn(d, generator=g)
    pl = [{"phase": 0.1 * k} for k in range(K)]
    agg = algorithms.build("kuramoto", mode="C", kappa0=0.5, clip=clip)
    first = agg.aggregate(x, U, [1.0 + k for k in range(K)], payloads=pl)  # first round outside the count
    calls = _host_copies(monkeypatch)
    res = agg.aggregate(x, U, [1.0 + k for k in range(K)], payloads=pl)
    assert len(calls) == 1, calls
    assert res.info["clipped"] is first.info["clipped"] is (clip < 1)
    assert torch.equal(res.params, first.params)


def test_a_method_that_holds_the_flags_must_release_them():
    """weighted_sum(hold=True) without RoundInput.release is an error, not an unscreened round."""
    from fedkernels.algorithms.base import AggResult, Aggregator

    class Forgets(Aggregator):
        name = "forgets"
        screen_in_pass = True

        def _aggregate(self, rin):
            return AggResult(rin.weighted_sum([1.0] * rin.K, base=rin.global_flat, hold=True), {})

    U = torch.randn(3, 5)
    U[1, 2] = float("nan")
    with pytest.raises(RuntimeError, match=r"held the rows' finite flags .* never released them"):
        Forgets().aggregate(torch.zeros(5), U, [1, 1, 1])


def test_host_copy_with_packs_flags_and_carry_exactly(monkeypatch):
    """The packed copy (used off the CPU) gives back the flags and the carried tensor bit for bit, in
    one copy."""
    from fedkernels.algorithms.base import host_copy_with

    G = torch.randn(7, 7, dtype=torch.float64)
    G[2, 3] = float("nan")
    flags = torch.tensor([True, False, True, True, False])
    calls = _host_copies(monkeypatch)
    f, c = host_copy_with(flags, G)
    assert len(calls) == 1
    assert torch.equal(f, flags) and f.dtype == torch.bool
    assert c.shape == G.shape and c.dtype == G.dtype
    assert torch.equal(c.view(torch.int64), G.view(torch.int64))  # same bits, NaN included


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["fedavg", "fedavgm", "fedprox", "fednova", "scaffold", "global_gc", "kuramoto"])
def test_one_sync_per_aggregate_on_gpu(name):
    from fedkernels import build_info

    if not build_info().get("cuda"):
        pytest.skip("fedkernels built without CUDA")
    ((_, run, _),) = aggregator_cases(64, spec_of(TINY), device="cuda", only={name})
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


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kuramoto_mode_c_one_sync_on_gpu():
    from fedkernels import algorithms, build_info

    if not build_info().get("cuda"):
        pytest.skip("fedkernels built without CUDA")
    g = torch.Generator().manual_seed(3)
    U, x = torch.randn(64, 76, generator=g).cuda(), torch.randn(76, generator=g).cuda()
    agg = algorithms.build("kuramoto", mode="C", clip=1e-4)
    run = lambda: agg.aggregate(x, U, [1.0] * 64, payloads=[{"phase": 0.1 * k} for k in range(64)])  # noqa: E731
    run()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            res = run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(m.message) for m in w if "synchroniz" in str(m.message).lower()]
    assert len(syncs) <= 1, syncs
    assert res.info["clipped"] is True


SCREEN_IN_PASS = {
    "fedavg": ["weighted_sum_screened"],
    "fedprox": ["weighted_sum_screened"],
    "fednova": ["weighted_sum_screened"],
    "fedavgm": ["weighted_sum_screened"],
    "fedpgvc": ["weighted_sum_screened"],
    "scaffold": ["weighted_sum_screened"],
    "fedpvr": ["weighted_sum_screened"],
    "global_gc": ["weighted_sum_screened"],
    "local_gc": ["weighted_sum_screened"],
    "gcfed": ["weighted_sum_screened"],
    "kuramoto": ["kstats", "weighted_sum"],  # stats pass (screens) + weighting pass
    "fedaware": ["gram"],
}  # ELUD Gram pass (screens); the step reads M


@pytest.mark.parametrize("name", sorted(SCREEN_IN_PASS))
def test_methods_read_U_once_per_pass(name):
    """The NaN/Inf screen rides inside the method's first pass over U: no separate finite_rows
    read."""
    ((_, run, info),) = aggregator_cases(30, spec_of(TINY), only={name})
    ptr = info["U"].data_ptr()

    class Reads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.passes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if (
                str(func.namespace) == "fedkernels"
                and args
                and isinstance(args[0], torch.Tensor)
                and args[0].dim() == 2
                and args[0].data_ptr() == ptr
            ):
                self.passes.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    with Reads() as r:
        run()
    assert r.passes == ["fedkernels." + p for p in SCREEN_IN_PASS[name]], r.passes


def _python_calls(K: int, name: str) -> collections.Counter:
    """Python-level function calls (per function) of one aggregate of K clients (sys.setprofile)."""
    import sys

    ((_, run, _),) = aggregator_cases(K, spec_of(TINY), only={name})
    calls: collections.Counter = collections.Counter()

    def prof(frame, event, arg):
        if event == "call":
            calls[f"{frame.f_code.co_filename}:{frame.f_code.co_name}"] += 1

    sys.setprofile(prof)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize("name", methods())
def test_python_calls_per_aggregate_do_not_grow_with_clients(name):
    """No Python function call per client (a per-client check_payload, a generator over the rows, a
    per-client helper): the calls of one aggregate are the same for K = 10 and K = 200."""
    small, large = _python_calls(10, name), _python_calls(200, name)
    grown = {f: (small.get(f, 0), n) for f, n in large.items() if n > small.get(f, 0) + 2}
    assert not grown, f"{name}: Python calls per aggregate grow with K (K=10 -> K=200): {grown}"
    assert sum(large.values()) > 0


def test_call_counter_sees_a_per_client_check():
    """The counter catches what the test above forbids: a payload check called once per client."""
    from fedkernels.algorithms.fedprox import FedProx

    orig = FedProx.suspect_payloads
    FedProx.suspect_payloads = lambda self, payloads: None  # every row checked one by one
    try:
        small, large = _python_calls(10, "fedprox"), _python_calls(200, "fedprox")
    finally:
        FedProx.suspect_payloads = orig
    assert sum(large.values()) > sum(small.values()) + 100


def test_every_payload_check_has_its_whole_round_form():
    """A class that extends check_payload (the wording, one client) extends suspect_payloads (which
    rows to check, whole-round) too, or its new rule would never run."""
    from fedkernels.algorithms.base import _REGISTRY, Aggregator

    for cls in set(_REGISTRY.values()):
        for k in cls.__mro__:
            if k is Aggregator or not issubclass(k, Aggregator):
                continue
            if "check_payload" in vars(k):
                assert "suspect_payloads" in vars(k), f"{k.__name__} has check_payload but no suspect_payloads"


def _payload_variants(d_c):
    nan = float("nan")
    good = {
        "local_steps": 5,
        "momentum": 0.5,
        "prox_mu": 0.01,
        "pgvc_skipped_steps": 0,
        "local_gc": 1,
        "T": 0.1,
        "phase": 0.5,
        "delta_c": torch.zeros(d_c),
    }
    bad = [
        {},
        {"local_steps": 0},
        {"local_steps": nan},
        {"local_steps": "x"},
        {"local_steps": "3"},
        {"local_steps": torch.tensor(4.0)},
        {"local_steps": torch.ones(2)},
        {"momentum": 1.0},
        {"momentum": -0.1},
        {"a_norm": 2.0},
        {"a_norm": 0.0},
        {"a_norm": nan, "local_steps": 3},
        {"prox_mu": 0.02},
        {"prox_mu": None},
        {"T": 0.0},
        {"T": -1.0},
        {"T": float("inf")},
        {"T": "a"},
        {"T": "0.5"},
        {"hbar": 1.0},
        {"hbar": nan},
        {"phase": nan},
        {"phase": "x"},
        {"phase": None},
        {"delta_c": torch.zeros(d_c + 1)},
        {"delta_c": 3.0},
        {"delta_c": None},
        {"delta_c": torch.zeros(d_c, dtype=torch.float64)},
    ]
    out = []
    for b in bad:
        p = dict(good)
        for k, v in b.items():
            p[k] = v
        if not b:
            p = {}
        out.append(p)
    for key in good:  # each key missing alone
        out.append({k: v for k, v in good.items() if k != key})
    return [dict(good)] + out


@pytest.mark.parametrize("name", methods() + ["kuramoto_C"])
def test_whole_round_payload_checks_equal_the_per_client_rule(name):
    """check_payloads (column checks picking the rows, check_payload wording them) rejects exactly the
    rows that check_payload, called on every row, rejects, with the same reasons."""
    from fedkernels import algorithms
    from fedkernels.algorithms import runner
    from bench.cpu_hostwork import OPTIONS

    opts = dict(OPTIONS.get(name, {}), **({"mode": "C"} if name == "kuramoto_C" else {}))
    agg = algorithms.build("kuramoto" if name == "kuramoto_C" else name, **opts)
    x = torch.zeros(spec_of(TINY).d)
    agg.setup(spec_of(TINY), num_clients=64, global_flat=x)
    if hasattr(agg, "_alloc"):
        agg._alloc(x)
    pl = _payload_variants(getattr(agg, "d_c", None) or 4)
    every = {k: r for k, r in ((k, agg.check_payload(p)) for k, p in enumerate(pl)) if r}
    runner.screen(agg, x, torch.zeros(len(pl), x.numel()), torch.ones(len(pl), dtype=torch.float64), pl, False, False)
    assert agg.check_payloads(pl) == every
    assert not agg.check_payloads([pl[0]] * 5)  # the all-good round: nothing checked one by one


def test_fednova_whole_round_a_norm_matches_the_formula():
    from fedkernels.algorithms.fednova import FedNova
    from fedkernels.algorithms.parts import momentum_steps
    from fedkernels.algorithms.base import RoundInput

    pl = [
        {"local_steps": 5},
        {"local_steps": 7, "momentum": 0.9},
        {"a_norm": 2.5, "local_steps": 1},
        {"local_steps": 3, "momentum": 0.0},
        {"local_steps": 7, "momentum": 0.9},
        {"local_steps": 2},
    ]
    agg = FedNova(local_momentum=0.5)
    rin = RoundInput(
        torch.zeros(3), torch.zeros(len(pl), 3), torch.ones(len(pl), dtype=torch.float64), list(range(len(pl))), pl
    )
    want = [momentum_steps(5, 0.5), momentum_steps(7, 0.9), 2.5, 3.0, momentum_steps(7, 0.9), momentum_steps(2, 0.5)]
    assert agg.a_norms(rin).tolist() == want


@pytest.mark.parametrize("bad", ["row", "delta", "ragged"])
def test_stacked_payloads_follow_the_clients_left_after_exclusion(bad):
    """SCAFFOLD's delta_c are stacked once by the screen; when a client is dropped (a NaN row found
    in the weighted-sum pass, a NaN delta, or deltas of mixed lengths) the round equals the round of
    the other clients alone."""
    from fedkernels import algorithms

    g = torch.Generator().manual_seed(3)
    K, d = 5, 6
    U, D = torch.randn(K, d, generator=g), torch.randn(K, d, generator=g)
    pl = [{"delta_c": D[k].clone(), "local_steps": 3} for k in range(K)]
    if bad == "row":
        U[2, 1] = float("nan")
    elif bad == "delta":
        pl[2]["delta_c"][0] = float("inf")
    else:
        pl[2]["delta_c"] = torch.zeros(d + 1)
    a = algorithms.build("scaffold", on_bad_update="exclude", num_clients=8)
    new, info = a.aggregate(torch.zeros(d), U, [1] * K, [0, 1, 2, 3, 4], pl)
    keep = [0, 1, 3, 4]
    b = algorithms.build("scaffold", num_clients=8)
    want, _ = b.aggregate(torch.zeros(d), U[keep], [1] * 4, keep, [pl[k] for k in keep])
    assert [e["client_id"] for e in info["excluded"]] == [2]
    assert torch.equal(new, want) and torch.equal(a.c, b.c) and torch.equal(a.c_table, b.c_table)


def test_fedaware_solver_symmetrises_once_with_the_same_result():
    """FedAWARE leaves (G + G^T) / 2 to ops.min_norm (which solves on it, same bits) instead of making
    that N x N pass twice; a custom solver still gets the symmetrised G. Both give the same lambda and
    step, bit for bit, on a cached Gram that is not exactly symmetric."""
    from fedkernels import algorithms, ops

    g = torch.Generator().manual_seed(11)
    N, d = 9, 13
    M = torch.randn(N, d, generator=g, dtype=torch.float64) + 0.2
    seen = []

    def custom(G, *a, **k):
        seen.append(torch.equal(G, G.T))
        return ops.min_norm(G, *a, **k)

    out = []
    for solver in (None, custom):
        agg = algorithms.build("fedaware", num_clients=N, warmup="startup_full", elud=False, solver=solver)
        x = torch.zeros(d, dtype=torch.float64)
        agg.aggregate(x, M, [1.0] * N)
        agg.Gm += torch.randn(N, N, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 1e-9
        new, info = agg.aggregate(x, M * 0.5, [1.0] * N)
        out.append((new, info["lam"], info["coef"]))
    assert seen == [True, True]
    (a, la, ca), (b, lb, cb) = out
    assert torch.equal(a, b) and la == lb and ca == cb


def test_bench_methods_option(tmp_path):
    """bench/cpu_hostwork.py --methods times only the named methods; an unknown name is refused."""
    import json
    import sys

    out = tmp_path / "h.json"
    r = cli_process.run(
        [
            sys.executable,
            "-m",
            "bench.cpu_hostwork",
            "--clients",
            "20",
            "--quick",
            "--methods",
            "fedavg,kuramoto",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert [row["method"] for row in json.loads(out.read_text())["results"]] == ["fedavg", "kuramoto"]
    r = cli_process.run(
        [sys.executable, "-m", "bench.cpu_hostwork", "--methods", "fedavg,nope", "--out", str(tmp_path / "x.json")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "nope is not a method" in r.stderr
    assert not (tmp_path / "x.json").exists()
