"""Sharded aggregation (fedkernels.distributed) on gloo/CPU: 2 and 4 processes on loopback give the
single-process results for every aggregator, round after round (stateful ones included)."""

import os
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from fedkernels import algorithms, ops
from fedkernels.distributed import ShardedAggregator, shard_bounds, shard_spec, sharded
from fedkernels.flat import FlatSpec

N, K, ROUNDS = 7, 5, 3


def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.Flatten(), nn.Linear(12, 9), nn.ReLU(), nn.Linear(9, 4)
    )


# name, options, payload builder (round, client id, d, generator) -> dict
def _pl_scaffold(t, cid, d, g):
    return {"delta_c": torch.randn(d, generator=g) * 0.1}


def _pl_nova(t, cid, d, g):
    return {"local_steps": 1 + (cid * 7 + t) % 5, "momentum": 0.5 if cid % 2 else 0.0}


def _pl_phase(t, cid, d, g):
    return {"phase": 0.3 * cid + 0.1 * t}


def _pl_ecado(t, cid, d, g):
    return {"T": 1.0 + 0.25 * ((cid + t) % 3), "hbar": 0.5}


def _pl_rule(key, value):  # what a client rule sends to show it ran (FedProx mu, Local GC, FedPGVC)
    return lambda t, cid, d, g: {key: value}


CASES = [
    ("fedavg", {}, None),
    ("fedavgm", {"beta": 0.9, "nesterov": True}, None),
    ("fedprox", {"mu": 0.1}, _pl_rule("prox_mu", 0.1)),
    ("scaffold", {}, _pl_scaffold),
    ("fednova", {}, _pl_nova),
    ("kuramoto", {"mode": "S"}, None),
    ("kuramoto", {"mode": "P", "guard": False}, None),
    ("kuramoto", {"mode": "C", "clip": 0.05}, _pl_phase),
    ("fedaware", {"warmup": "startup_full", "extension": "fedavgm"}, None),
    ("fedaware", {"warmup": "explore"}, None),
    ("fedaware", {"warmup": "mask", "normalize": False, "zero_fallback": "na"}, None),
    ("gcfed", {}, _pl_rule("local_gc", 3)),
    ("global_gc", {}, None),
    ("fedpgvc", {}, _pl_rule("pgvc_skipped_steps", 0)),
    ("fedecado", {"lte_norm": "inf"}, _pl_ecado),
    ("fedecado", {"lte_norm": "rms"}, _pl_ecado),
]


def _pl_rule(key, value):  # what a client rule sends to show it ran (FedProx mu, Local GC, FedPGVC)
    return lambda t, cid, d, g: {key: value}


CASES = [c for c in CASES if c[0] in algorithms.available()]


def _rounds(spec, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(spec.d, generator=g)
    out = []
    for t in range(ROUNDS):
        ids = sorted(torch.randperm(N, generator=g)[:K].tolist())
        U = torch.randn(K, spec.d, generator=g) * 0.1 + 0.05 * torch.randn(spec.d, generator=g)
        n = (torch.randint(5, 50, (K,), generator=g)).tolist()
        out.append((U, n, ids, g.get_state()))
    return x, out


def _run(name, opts, plf, spec, wrap=None):
    """Runs ROUNDS rounds; returns [(params [d], info)]. ``wrap``: a ShardedAggregator factory."""
    x, rounds = _rounds(spec)
    agg = algorithms.build(name, **opts)
    runner = wrap(agg) if wrap else agg
    runner.setup(spec, num_clients=N, global_flat=x)
    res = []
    for t, (U, n, ids, gstate) in enumerate(rounds):
        g = torch.Generator()
        g.set_state(gstate)
        pls = [plf(t, c, spec.d, g) for c in ids] if plf else None
        if wrap:
            new, info = runner.aggregate(x, U, n, ids, pls, gather=True)
        else:
            new, info = runner.aggregate(x, U, n, ids, pls)
        res.append((new, info))
        x = new
    return res


def _close_info(a, b, path=""):
    if isinstance(a, dict):
        assert set(a) == set(b), (path, set(a) ^ set(b))
        for k in a:
            _close_info(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (u, v) in enumerate(zip(a, b)):
            _close_info(u, v, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        if a != a:
            assert b != b, path
        else:
            assert abs(a - b) <= 1e-9 * max(1.0, abs(a)), (path, a, b)
    else:
        assert a == b, (path, a, b)


def _check_cases(spec, group, align):
    for name, opts, plf in CASES:
        ref = _run(name, opts, plf, spec)
        got = _run(name, opts, plf, spec, wrap=lambda a: ShardedAggregator(a, group=group, align=align))
        for t, ((p0, i0), (p1, i1)) in enumerate(zip(ref, got)):
            torch.testing.assert_close(
                p1, p0, rtol=2e-6, atol=2e-7, msg=lambda m: f"{name} {opts} round {t} (align={align}): {m}"
            )
            _close_info(i0, i1, f"{name}{opts} round {t} info")
        if name == "fedavg":  # per-coordinate arithmetic: bitwise equal
            assert all(torch.equal(a[0], b[0]) for a, b in zip(ref, got))


def _worker(rank, world, init_file, errfile):
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        spec = FlatSpec.from_module(_model())
        pair = dist.new_group([0, 1])  # every rank must create it
        _check_cases(spec, None, "row")  # all 4 ranks, row-aligned slices
        if rank < 2:
            _check_cases(spec, pair, "tensor")  # a 2-rank subgroup, tensor-aligned slices
        dist.barrier()
        # the helpers reduce over ranks inside sharded() and are local outside it
        sa = ShardedAggregator(algorithms.build("fedavg"))
        sa.setup(spec)
        v = torch.arange(spec.d, dtype=torch.float32) / spec.d
        w = torch.cos(v * 7)
        loc = sa.local(v)
        with sharded():
            assert abs(ops.sqnorm(loc) - float(v.double().pow(2).sum())) < 1e-9
            assert abs(ops.dot(loc, sa.local(w)) - float(v.double() @ w.double())) < 1e-9
            assert ops.any_(loc > 0.99) == bool((v > 0.99).any())
            assert ops.all_(loc >= 0) and not ops.all_(loc > 0)
            assert float(ops.amax_d(loc)) == float(v.max())
            torch.testing.assert_close(ops.mean_d(loc.reshape(1, -1)), v.mean().reshape(1))
            bad = torch.zeros(3, spec.d)
            bad[1, -1] = float("nan")  # only the last rank sees the NaN
            assert ops.finite_rows(sa.local(bad)).tolist() == [True, False, True]
        assert torch.equal(sa.gather(loc), v)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(f"{errfile}.{rank}", "w") as f:
            f.write(traceback.format_exc())
        raise


def test_sharded_matches_single_process():
    """4 ranks (row-aligned slices) and a 2-rank subgroup (tensor-aligned) vs one process."""
    world = 4
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        errfile = os.path.join(tmp, "err")
        try:
            mp.spawn(_worker, args=(world, init_file, errfile), nprocs=world, join=True)
        except Exception:
            msgs = [open(os.path.join(tmp, f)).read() for f in sorted(os.listdir(tmp)) if f.startswith("err")]
            pytest.fail("worker failed:\n" + "\n".join(msgs))


# ---- slicing (no processes) -----------------------------------------------------------------------
def test_bounds_follow_tensor_and_row_boundaries():
    spec = FlatSpec.from_module(_model())
    offs = {e.offset for e in spec.entries} | {spec.d}
    for world in (1, 2, 3, 4, 7):
        b = shard_bounds(spec.d, world, spec, "tensor")
        assert b[0][0] == 0 and b[-1][1] == spec.d and all(b[i][1] == b[i + 1][0] for i in range(world - 1))
        assert all(lo in offs and hi in offs for lo, hi in b)
        rb = shard_bounds(spec.d, world, spec, "row")
        for lo, hi in rb:
            s = shard_spec(spec, lo, hi)  # raises if a row is cut
            assert s.d == hi - lo and sum(e.numel for e in s.entries) == hi - lo
            assert s.layer_modules() == spec.layer_modules()
            for e in s.entries:
                assert e.numel == (torch.Size(e.shape).numel())
    even = shard_bounds(1000, 3)
    assert even[0] == (0, 320) and even[-1][1] == 1000
    with pytest.raises(ValueError, match="inside an output row"):
        shard_spec(spec, 1, spec.d)
    with pytest.raises(ValueError, match="world"):
        shard_bounds(10, 0)
    with pytest.raises(ValueError, match="align"):
        shard_bounds(10, 2, None, "col")


def test_helpers_are_local_without_a_context():
    a = torch.randn(37, dtype=torch.float32)
    b = torch.randn(37, dtype=torch.float32)
    assert ops.dot(a, b) == pytest.approx(float(a.double() @ b.double()), rel=1e-12)
    assert ops.sqnorm(a) == pytest.approx(float(a.double() @ a.double()), rel=1e-12)
    assert ops.any_(a > 10) is False and ops.all_(a == a) is True
    assert torch.equal(ops.amax_d(a.reshape(1, -1)), a.max().reshape(1))
    assert torch.equal(ops.mean_d(a.reshape(1, -1)), a.reshape(1, -1).mean(-1))
    with pytest.raises(ValueError, match="same number"):
        ops.dot(a, b[:3])


def test_wrapper_needs_initialised_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is active")
    with pytest.raises(RuntimeError, match="not initialised"):
        ShardedAggregator(algorithms.build("fedavg"))


def test_default_split_is_balanced_by_bytes():
    """The default split balances the columns (bytes) per rank, cutting inside
    tensors at output-row boundaries; align="tensor" keeps whole tensors per rank."""
    from fedkernels.distributed import DEFAULT_ALIGN

    assert DEFAULT_ALIGN == "bytes"
    torch.manual_seed(0)
    # small first layers, one dominating tensor: tensor-aligned cuts are badly unbalanced
    m = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(4 * 26 * 26, 500), nn.ReLU(), nn.Linear(500, 10))
    spec = FlatSpec.from_module(m)
    rows = {e.offset: (e.fan_in if len(e.shape) >= 2 else e.numel) for e in spec.entries}
    for world in (2, 3, 4, 7):
        b = shard_bounds(spec.d, world, spec)
        assert b == shard_bounds(spec.d, world, spec, "bytes") == shard_bounds(spec.d, world, spec, "row")
        assert b[0][0] == 0 and b[-1][1] == spec.d and all(b[i][1] == b[i + 1][0] for i in range(world - 1))
        for i in range(1, world):
            cut, ideal = b[i][0], spec.d * i / world
            e = max((e for e in spec.entries if e.offset <= ideal), key=lambda e: e.offset)
            assert abs(cut - ideal) <= rows[e.offset] / 2 + 1, (world, i, cut, ideal)
        for lo, hi in b:
            shard_spec(spec, lo, hi)  # no row is cut
        widths = [hi - lo for lo, hi in b]
        assert max(widths) <= spec.d / world + max(rows.values())
        t = shard_bounds(spec.d, world, spec, "tensor")
        offs = {e.offset for e in spec.entries} | {spec.d}
        assert all(lo in offs and hi in offs for lo, hi in t)
    # the reported imbalance: with whole tensors one of 2 ranks gets nearly all columns, with the
    # default each gets half to within one row of the dominating tensor
    t2 = shard_bounds(spec.d, 2, spec, "tensor")
    b2 = shard_bounds(spec.d, 2, spec)
    assert max(hi - lo for lo, hi in t2) > 0.9 * spec.d
    assert abs(b2[0][1] - spec.d / 2) <= rows[spec.entries[2].offset]
