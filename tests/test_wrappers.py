"""The wrapper seam (fedkernels.algorithms.wrappers) and its first wrapper, norm bounding: a row-scaled
RoundInput against the explicitly scaled matrix, NormBound around every kind of method against that
method on the explicitly clipped matrix (fp64 reference bounds), state, options, the CLI."""

import json
import os
import sys

import pytest
import torch

from fedkernels import algorithms
from fedkernels.algorithms import wrappers
from fedkernels.algorithms.base import AggResult, Aggregator, BadUpdateError, RoundInput, RowScaled
from fedkernels.algorithms.wrappers import MethodWrapper, NormBound, wrap
from fedkernels.sources import ChunkedUpdates, TensorSource

import cli_process  # tests/cli_process.py: the command in a child forked from a pre-imported interpreter

F64 = torch.float64
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _data(K=5, d=37, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    U = (torch.randn(K, d, generator=g, dtype=F64) * torch.linspace(0.2, 3.0, K, dtype=F64)[:, None]).to(dtype)
    x = torch.randn(d, generator=g, dtype=F64).to(dtype)
    n = [3.0 + k for k in range(K)]
    return x, U, n


def clip_scales(U, M):
    """The fp64 reference scales min(1, M / ||U_k||) of the rows as stored."""
    norms = U.to(F64).norm(dim=1)
    return torch.where(norms > M, M / norms, torch.ones_like(norms))


def clipped(U, M):
    """The explicitly clipped matrix: each s_k u in fp64, rounded once to U's dtype."""
    return (U.to(F64) * clip_scales(U, M)[:, None]).to(U.dtype)


def _pl(opts, K):
    """The payloads a method's client side would send (Kuramoto's mode C: each client's phase)."""
    return [{"phase": 0.3 * k} for k in range(K)] if opts.get("mode") == "C" else None


def sum_bound(dtype, K, scale):
    """The error bound of ops.weighted_sum's K-term sum in its accumulation dtype (fp32 for fp32, fp64 for
    fp64; the coefficients rounded to it): gamma_{K+2} = (K + 2) u per unit of sum_k |c_k u_kj|, u = eps/2."""
    return (K + 2) * torch.finfo(dtype).eps / 2 * scale


def _rin(U, x=None, src=None):
    K, d = U.shape
    x = torch.zeros(d, dtype=U.dtype) if x is None else x
    rin = RoundInput(x, U, torch.ones(K, dtype=F64), list(range(K)), [{} for _ in range(K)])
    if src is not None:
        from fedkernels.algorithms.base import UpdatesShape

        rin = RoundInput(
            x, UpdatesShape.of(U), torch.ones(K, dtype=F64), list(range(K)), [{} for _ in range(K)], src=src
        )
    return rin


# ---- RoundInput.with_row_scale ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunked", [False, True])
def test_row_scale_passes_equal_the_explicitly_scaled_matrix(dtype, chunked):
    x, U, _ = _data(K=6, d=53, dtype=dtype)
    s = torch.tensor([0.5, 1.0, 0.125, 2.0, 0.3, 1e-3], dtype=F64)
    S = U.to(F64) * s[:, None]  # the scaled rows, exact in fp64
    src = ChunkedUpdates(TensorSource(U), chunk_cols=16) if chunked else None
    r = _rin(U, x, src).with_row_scale(s)
    assert isinstance(r, RowScaled) and (r.K, r.d, r.dtype) == (6, 53, dtype)
    p = torch.tensor([0.1, 0.2, 0.05, 0.3, 0.15, 0.2], dtype=F64)
    # weighted_sum: s folded into the coefficients, summed as ops.weighted_sum sums (its dtype's bound)
    ref = (p[:, None] * S).sum(0)
    got = r.weighted_sum(p).to(F64)
    scale = (p[:, None] * S).abs().sum(0)
    assert ((got - ref).abs() <= sum_bound(dtype, 6, scale)).all()
    # gram: s_i s_j G_ij with G the fp64 Gram of U as stored (within fp64 summation error)
    G = r.gram()
    Gref = S @ S.T
    bound = 4 * 53 * 2.0**-53 * (S.abs() @ S.abs().T)
    assert ((G - Gref).abs() <= bound).all()
    # kstats: the scaled rows' (dot, nsq, nbar) from one pass
    dot, nsq, nbar = r.kstats(p)
    m = (p[:, None] * S).sum(0)
    assert ((dot - S @ m).abs() <= 8 * 53 * 2.0**-53 * (S.abs() @ m.abs() + S.abs() @ scale)).all()
    assert ((nsq - (S * S).sum(1)).abs() <= 4 * 53 * 2.0**-53 * (S * S).sum(1)).all()
    assert abs(float(nbar) - float(m @ m)) <= 8 * 53 * 2.0**-53 * float(scale @ scale)
    # blocks and U: each element s_k u rounded once to U's dtype: bitwise the explicitly scaled matrix
    want = S.to(dtype)
    seen = torch.full_like(want, float("nan"))
    for cols, B in r.blocks():
        seen[:, cols] = B
    assert torch.equal(seen, want)
    if not chunked:
        assert torch.equal(r.U, want)


def test_row_scale_shares_the_base_inputs_screen_and_fields():
    _, U, _ = _data(K=3, d=8)
    U[1, 2] = float("nan")
    rin = _rin(U)
    seen = []
    rin.unscreened = True
    rin.on_flags = lambda ok, carry=None: seen.append(ok.clone()) or (None if carry is None else carry.cpu())
    r = rin.with_row_scale(torch.tensor([1.0, 0.5, 2.0], dtype=F64))
    r.kstats(torch.ones(3, dtype=F64))
    assert rin.unscreened is False and r.unscreened is False  # screened once, on the base input
    assert len(seen) == 1 and seen[0].tolist() == [True, False, True]
    assert r.payloads is rin.payloads and r.global_flat is rin.global_flat
    with pytest.raises(ValueError, match="s has 2 entries, expected K=3"):
        rin.with_row_scale(torch.ones(2))


# ---- norm_bound --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_norm_bound_with_a_huge_bound_is_bitwise_the_method(dtype):
    x, U, n = _data(dtype=dtype)
    for name, opts in [
        ("fedavg", {}),
        ("fedavgm", {"beta": 0.9}),
        ("kuramoto", {"mode": "S"}),
        ("kuramoto", {"mode": "C"}),
    ]:
        a, b = algorithms.build(name, **opts), algorithms.build(name, norm_bound=1e30, **opts)
        assert isinstance(b, NormBound) and b.name == name
        for _ in range(2):
            ra, rb = a.aggregate(x, U, n, payloads=_pl(opts, 5)), b.aggregate(x, U, n, payloads=_pl(opts, 5))
            assert torch.equal(ra.params, rb.params), name
            assert rb.info.pop("norm_clipped") == 0 and ra.info == rb.info
        assert a.round == b.round == 2


def test_a_row_scale_of_ones_is_bitwise_the_method():
    """The scaled path itself (every pass through RowScaled) with s = 1 gives the method's bits."""

    class Ones(MethodWrapper):
        def before(self, rin):
            return rin.with_row_scale(torch.ones(rin.K, dtype=F64))

    x, U, n = _data()
    for name, opts in [
        ("fedavg", {}),
        ("kuramoto", {"mode": "P"}),
        ("kuramoto", {"mode": "C"}),
        ("fedaware", {"num_clients": 5}),
    ]:
        a, b = algorithms.build(name, **opts), Ones(algorithms.build(name, **opts))
        for _ in range(2):
            pl = _pl(opts, 5)
            assert torch.equal(a.aggregate(x, U, n, payloads=pl).params, b.aggregate(x, U, n, payloads=pl).params)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunked", [False, True])
def test_norm_bound_fedavg_equals_fedavg_on_the_clipped_matrix(dtype, chunked):
    """x + lr sum_k p_k s_k U_k against the fp64 reference on the clipped rows: the fp64 sum rounded once
    to the model's dtype, plus the fp64 error of the norms (kstats' summation) and of the sum."""
    x, U, n = _data(dtype=dtype)
    M = 1.5
    s = clip_scales(U, M)
    assert 0 < int((s < 1).sum()) < U.size(0)  # some rows clipped, some not
    agg = algorithms.build("fedavg", norm_bound=M, server_lr=0.7)
    upd = ChunkedUpdates(TensorSource(U), chunk_cols=10) if chunked else U
    res = agg.aggregate(x, upd, n)
    p = torch.tensor(n, dtype=F64) / sum(n)
    terms = 0.7 * p[:, None] * U.to(F64) * s[:, None]
    ref = x.to(F64) + terms.sum(0)
    # (the scales' own fp64 error, from kstats' norms: relative ~d 2^-53, far inside the sum's bound)
    bound = sum_bound(dtype, U.size(0) + 1, x.to(F64).abs() + terms.abs().sum(0))
    assert ((res.params.to(F64) - ref).abs() <= bound).all()
    assert res.info["norm_clipped"] == int((s < 1).sum())
    # the same method on the explicitly clipped matrix: apart by at most the rounding of s_k u to the dtype
    plain = algorithms.build("fedavg", server_lr=0.7).aggregate(x, clipped(U, M), n).params.to(F64)
    apart = torch.finfo(dtype).eps * terms.abs().sum(0) + 2 * bound
    assert ((res.params.to(F64) - plain).abs() <= apart).all()


@pytest.mark.parametrize("opts", [{"mode": "P"}, {"mode": "S"}, {"mode": "C"}])
def test_norm_bound_kuramoto_equals_kuramoto_on_the_clipped_matrix(opts):
    """fp64: the folded scales and the explicitly clipped rows differ by fp64 rounding only (relative
    ~1e-15 in every statistic); Kuramoto's weights are smooth in them: 1e-9 is far above that."""
    x, U, n = _data(dtype=F64, K=6, d=41)
    M = 2.0
    a, b = algorithms.build("kuramoto", **opts), algorithms.build("kuramoto", norm_bound=M, **opts)
    for r in range(3):
        Ur = U * (1 + 0.5 * r)
        ra, rb = a.aggregate(x, clipped(Ur, M), n, payloads=_pl(opts, 6)), b.aggregate(x, Ur, n, payloads=_pl(opts, 6))
        torch.testing.assert_close(rb.params, ra.params, rtol=0, atol=1e-9)
        x = ra.params


def test_norm_bound_fedaware_and_a_median_equal_them_on_the_clipped_matrix():
    """FedAWARE (Gram, blocks into its momentum table) and a coordinate median read through blocks
    (selection: exact, so bitwise the median of the explicitly clipped rows)."""

    class BlockMedian(Aggregator):
        name = "block_median"
        screen_in_pass = False

        def _aggregate(self, rin):
            out = rin.global_flat.clone()
            for cols, B in rin.blocks():
                out[cols] += B.median(dim=0).values
            return AggResult(out, {})

    x, U, n = _data(dtype=F64, K=5, d=29)
    M = 1.0
    med, wmed = BlockMedian(), wrap(BlockMedian(), norm_bound=M)
    assert torch.equal(wmed.aggregate(x, U, n).params, med.aggregate(x, clipped(U, M), n).params)
    a = algorithms.build("fedaware", num_clients=8)
    b = algorithms.build("fedaware", num_clients=8, norm_bound=M)
    ids = [[0, 1, 2, 3, 4], [5, 6, 7, 0, 1]]
    for r in range(2):
        ra, rb = a.aggregate(x, clipped(U * (r + 1), M), n, ids[r]), b.aggregate(x, U * (r + 1), n, ids[r])
        torch.testing.assert_close(rb.params, ra.params, rtol=0, atol=1e-9)
        x = ra.params


def test_norm_bound_fedecado_reads_the_scaled_tensor():
    from fedkernels.algorithms.fedecado import FedECADO

    x = torch.zeros(3, dtype=F64)
    U = torch.tensor([[3.0, 0.0, 4.0], [0.1, 0.2, 0.0]], dtype=F64)
    pl = [{"T": 0.5}, {"T": 1.0}]
    kw = dict(L=1.0, num_clients=2, hbar=1.0)
    a, b = FedECADO(**kw), wrap(FedECADO(**kw), norm_bound=1.0)
    assert b.passes() == () and b.no_chunked_source is not None
    ra = a.aggregate(x, clipped(U, 1.0), [1, 1], [0, 1], pl)
    rb = b.aggregate(x, U, [1, 1], [0, 1], pl)
    torch.testing.assert_close(rb.params, ra.params, rtol=0, atol=1e-12)
    assert rb.info["norm_clipped"] == 1


def test_norm_bound_screens_in_its_norm_pass_and_applies_the_policy():
    x, U, n = _data(dtype=torch.float32)
    U[2, 5] = float("inf")
    with pytest.raises(BadUpdateError, match=r"client 2 \(row 2\): update contains NaN/Inf"):
        algorithms.build("fedavg", norm_bound=1.0).aggregate(x, U, n)
    agg = algorithms.build("fedecado", L=1.0, num_clients=5, hbar=1.0, norm_bound=1.0, on_bad_update="exclude")
    keep = [0, 1, 3, 4]
    pl = [{"T": 1.0} for _ in range(5)]
    res = agg.aggregate(x.double(), U.double(), n, payloads=pl)
    assert res.info["excluded"] == [{"client_id": 2, "reason": "update contains NaN/Inf"}]
    ref = algorithms.build("fedecado", L=1.0, num_clients=5, hbar=1.0).aggregate(
        x.double(), clipped(U.double()[keep], 1.0), [n[k] for k in keep], keep, [pl[k] for k in keep]
    )
    torch.testing.assert_close(res.params, ref.params, rtol=0, atol=1e-12)


def test_norm_bound_passes_replace_the_screening_read():
    assert algorithms.build("fedavg", norm_bound=1.0).passes() == ("sum", "sum")
    assert algorithms.build("kuramoto", norm_bound=1.0).passes() == ("sum", "sum", "sum")
    inner = algorithms.build("fedaware", elud=False)
    assert inner.passes(4)[0] == "sum" and not inner.screen_in_pass
    assert wrap(inner, norm_bound=1.0).passes(4) == inner.passes(4)  # the norms' pass is the screen's


def test_wrapper_delegates_the_client_side_payloads_and_options():
    agg = algorithms.build("scaffold", norm_bound=0.5, num_clients=4)
    assert agg.client_rule().aggregator is agg.inner and agg.on_bad_update == "raise"
    d = 6
    x, U, n = torch.zeros(d), torch.randn(3, d), [1, 1, 1]
    pl = [{"delta_c": torch.full((d,), 0.1 * k)} for k in range(3)]
    ref = algorithms.build("scaffold", num_clients=4)
    ra = ref.aggregate(x, clipped(U, 0.5), n, [0, 1, 2], pl)
    rb = agg.aggregate(x, U, n, [0, 1, 2], pl)
    torch.testing.assert_close(rb.params, ra.params, rtol=0, atol=4e-7)
    assert torch.equal(agg.c, ref.c) and torch.equal(agg.client_payload(1)["c_i"], ref.client_payload(1)["c_i"])
    agg.on_bad_update = "exclude"
    assert agg.inner.on_bad_update == "exclude"


def test_state_dict_round_trips_the_inner_state():
    x, U, n = _data()
    a = algorithms.build("fedavgm", beta=0.9, norm_bound=2.0)
    for _ in range(2):
        x = a.aggregate(x, U, n).params
    st = a.state_dict()
    assert st["round"] == 2 and st["inner"]["round"] == 2
    b = algorithms.build("fedavgm", beta=0.9, norm_bound=2.0)
    b.load_state_dict(st)
    assert b.round == 2
    assert torch.equal(a.aggregate(x, U, n).params, b.aggregate(x, U, n).params)
    with pytest.raises(ValueError, match="no 'inner' entry"):
        b.load_state_dict(algorithms.build("fedavgm").state_dict())
    import pickle  # (the simulator's worker processes get the aggregator pickled)

    c = pickle.loads(pickle.dumps(b))
    assert repr(c) == repr(b) and c.inner is not b.inner and torch.equal(c.momentum, b.momentum)


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), "x", True, [1.0]])
def test_a_bad_norm_bound_is_one_line(bad):
    with pytest.raises(ValueError) as e:
        algorithms.build("fedavg", norm_bound=bad)
    msg = str(e.value)
    assert "\n" not in msg and "norm_bound" in msg and msg.startswith("fedavg")


def test_wrap_options():
    agg = algorithms.build("fedavg")
    assert wrap(agg) is agg and wrap(agg, norm_bound=None) is agg
    with pytest.raises(ValueError, match="unknown option 'norm_bund'; did you mean 'norm_bound'"):
        wrap(agg, norm_bund=1.0)
    assert algorithms.build("fedavg", norm_bound="2.5").norm_bound == 2.5  # number text (configs)
    assert algorithms.options("fedavg")["norm_bound"].default is None
    assert "norm_bound" in wrappers.wrapper_options()
    nested = wrap(wrap(agg, norm_bound=2.0), norm_bound=1.0)
    x, U, n = _data()
    torch.testing.assert_close(
        nested.aggregate(x, U, n).params,
        algorithms.build("fedavg", norm_bound=1.0).aggregate(x, U, n).params,
        rtol=0,
        atol=1e-6,
    )


def test_cli_reaches_norm_bound(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    base = [
        sys.executable,
        "-m",
        "fedkernels",
        "run",
        "--preset",
        "smoke",
        "rounds=1",
        "plots=false",
        "threads=1",
        "--no-progress",
        "--quiet",
    ]
    p = cli_process.run(
        base + ["algorithm.options.norm_bound=0.01"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-2000:]
    run_dir = json.loads(p.stdout.strip().splitlines()[-1])["run_dir"]
    with open(tmp_path / run_dir / "metrics.jsonl") as f:
        row = json.loads(f.readline())
    assert row["agg"]["norm_clipped"] == row["num_updates"] > 0
    p = cli_process.run(
        base + ["algorithm.options.norm_bound=-1"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "algorithm.options.norm_bound=-1" in lines[0], p.stderr


def test_every_method_declares_its_passes_and_ranges_beside_itself():
    """Passes: a declaration counts for its own class's update (a subclass with another _aggregate and no
    declaration of its own cannot be costed). Ranges: each method class's option_ranges, read by the
    simulator's checks along the MRO."""
    from fedkernels.algorithms.fedavg import FedAvg
    from fedkernels.sim.options import option_range

    class Mine(FedAvg):
        name = "mine"

        def _aggregate(self, rin):
            return super()._aggregate(rin)

    assert FedAvg().passes() == ("sum",)
    with pytest.raises(ValueError, match="mine: device='auto' cannot cost this method"):
        Mine().passes()
    from fedkernels.algorithms.fedecado import FedECADO
    from fedkernels.algorithms.gcfed import LocalGC

    assert option_range(LocalGC, "lam") == "[0, 1]" and option_range(LocalGC, "server_lr") == "> 0"
    assert option_range(FedECADO, "T_bar") == "> 0" and option_range(FedAvg, "weighting") is None
    assert option_range(NormBound, "norm_bound") == "> 0"


def _sharded_worker(rank, world, init_file, errfile, M):
    import traceback

    import torch.distributed as dist

    from fedkernels.distributed import ShardedAggregator

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        x, U, n = _data(K=5, d=41)
        for name, opts in [("fedavg", {}), ("kuramoto", {"mode": "S"})]:
            one = algorithms.build(name, norm_bound=M, **opts)
            sh = ShardedAggregator(algorithms.build(name, norm_bound=M, **opts))
            sh.setup(d=41)
            for _ in range(2):
                r1 = one.aggregate(x, U, n)
                r2 = sh.aggregate(x, U, n, gather=True)
                assert r2.info["norm_clipped"] == r1.info["norm_clipped"] > 0, (name, r1.info, r2.info)
                # the norms are the whole rows' (kstats' sums added over the shards): the same scales up to
                # the fp64 order of the shard sums, so the same model to fp32 rounding
                torch.testing.assert_close(r2.params, r1.params, rtol=2e-6, atol=2e-7)
                x = r1.params
        dist.destroy_process_group()
    except BaseException:
        with open(f"{errfile}.{rank}", "w") as f:
            f.write(traceback.format_exc())
        raise


def test_norm_bound_under_sharded_aggregation_clips_by_the_whole_rows_norm(tmp_path):
    """Two ranks each holding half the columns: the norms come from kstats summed across the ranks, so a
    row is clipped by its whole norm (a per-shard norm would clip by less)."""
    import torch.multiprocessing as mp

    init_file, errfile = str(tmp_path / "init"), str(tmp_path / "err")
    try:
        mp.spawn(_sharded_worker, args=(2, init_file, errfile, 1.5), nprocs=2, join=True)
    except Exception:
        msgs = [open(tmp_path / f).read() for f in sorted(os.listdir(tmp_path)) if f.startswith("err")]
        pytest.fail("worker failed:\n" + "\n".join(msgs))


def test_norm_bound_writes_the_callers_out_on_a_source():
    """On a source the method's result pass (after the norms' pass) writes into ``out`` chunk by chunk."""
    x, U, n = _data()
    agg = algorithms.build("fedavg", norm_bound=1.5)
    want = agg.aggregate(x, ChunkedUpdates(TensorSource(U), chunk_cols=8), n).params
    out = torch.empty_like(x)
    res = algorithms.build("fedavg", norm_bound=1.5).aggregate(
        x, ChunkedUpdates(TensorSource(U), chunk_cols=8), n, out=out
    )
    assert res.params is out and torch.equal(out, want)
