"""device="auto" (fedkernels.sources.pick_device): the CPU or the GPU by the method's cost.

No GPU here: the probes and torch.cuda.is_available are replaced by fixed rates, so the decision logic is
checked (sum-only vs Gram methods, a per-client table on the device or on the host, data already on the
device, no CUDA); the runs themselves stay on the CPU. The real GPU path: GPU speed not measured."""

import pytest
import torch

from fedkernels import algorithms
from fedkernels.sources import chunked, cost
from fedkernels.algorithms.base import _REGISTRY, Aggregator, AggResult
from fedkernels.sources import PASSES, ChunkedUpdates, TensorSource, pick_device, round_passes

K, D = 5, 1001
GB = K * D * 4 / 1e9
# options a registered method cannot be built without
REQUIRED = {"local_gc_only": {"lam": 0.5}}


def _U(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(K, D, generator=g) * 0.1


@pytest.fixture
def rates(monkeypatch):
    """A CUDA machine with fixed rates (GB/s): set ``rates.read``, ``.gram``, ``.h2d``, ``.stage``; the Gram
    probe's K values land in ``rates.gram_k``."""

    class R:
        read, gram, h2d, stage = 20.0, 3.0, 12.0, 30.0
        gram_k = []

    r = R()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cost, "cpu_read_gbps", lambda: r.read)
    monkeypatch.setattr(cost, "cpu_gram_gbps", lambda k: r.gram_k.append(k) or r.gram)
    monkeypatch.setattr(cost, "h2d_gbps", lambda: r.h2d)
    monkeypatch.setattr(cost, "staging_gbps", lambda: r.stage)
    return r


def _no_probe(*a):
    raise AssertionError("probed")


# ---- the decision -----------------------------------------------------------------------------------------
def test_no_cuda_is_the_cpu_without_probing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("cpu_read_gbps", "cpu_gram_gbps", "h2d_gbps", "staging_gbps"):
        monkeypatch.setattr(cost, name, _no_probe)
    for method in (None, algorithms.build("kuramoto"), algorithms.build("fedaware")):
        assert pick_device(method, _U()) == (torch.device("cpu"), "cpu: no CUDA device")
    cu = ChunkedUpdates(_U(), device="auto", method=algorithms.build("kuramoto"))
    assert cu.device == torch.device("cpu") and cu.placement == "cpu: no CUDA device"
    assert ChunkedUpdates(_U(), device="cpu").placement is None


@pytest.mark.parametrize(
    "read, h2d, stage, want",
    [
        (105.0, 51.9, 80.0, "cpu"),  # a 16-core H100 machine: the CPU op beats the link
        (10.0, 51.9, 80.0, "cuda:0"),  # a few cores: the link wins
        (52.0, 52.0, 90.0, "cpu"),  # a tie stays on the host
        (40.0, 51.9, 30.0, "cpu"),
    ],
)  # the host copy into pinned memory is the slower stage of the link
def test_one_sum_compares_the_read_rate_with_the_staged_link(rates, read, h2d, stage, want):
    rates.read, rates.h2d, rates.stage = read, h2d, stage
    dev, why = pick_device()
    link = min(h2d, stage)
    assert str(dev) == want and why.startswith(want + ": host source, one weighted sum [sum] on 1 GB: ")
    assert f"CPU ~{1 / read:.3g} s (reads {read:.1f} GB/s)" in why
    assert f"GPU ~{1 / link:.3g} s (1 read of U at the staged host-to-device {link:.1f} GB/s)" in why
    assert ("<=" in why) == (want == "cpu") and rates.gram_k == []  # no Gram: not probed
    cu = ChunkedUpdates(_U(), device="auto")
    assert str(cu.device) == want and cu.placement.startswith(want + ": host source")


class _GramThenSum(Aggregator):
    """A method with a Gram pass then a sum (what Kuramoto did before its kstats pass), as a user's method
    declares it: Aggregator.passes() overridden."""

    name = "gram_then_sum"

    def passes(self):
        return ("gram", "sum")

    def _aggregate(self, rin):
        return AggResult(rin.weighted_sum(rin.sample_weights(), base=rin.global_flat), {})


def test_a_gram_method_goes_to_the_gpu_where_a_sum_stays_on_the_cpu(rates):
    """Read 20 GB/s, Gram 3 GB/s, link 12 GB/s: FedAvg's one read is faster on the CPU (1/20 < 1/12 s per GB),
    a Gram + sum on the GPU (1/3 + 1/20 > 2/12); the Gram rate is probed at the data's K. Kuramoto (its
    column-local kstats pass, then the sum: two reads) stays on the CPU (2/20 < 2/12)."""
    U = _U()
    dev, why = pick_device(algorithms.build("fedavg"), U)
    assert dev == torch.device("cpu") and why.startswith("cpu: host source, fedavg [sum] on ")
    assert f"CPU ~{GB / 20:.3g} s (reads 20.0 GB/s) <= GPU ~{GB / 12:.3g} s (1 read of U at" in why
    dev, why = pick_device(_GramThenSum(), U)
    assert dev == torch.device("cuda", 0) and why.startswith("cuda:0: host source, gram_then_sum [gram, sum] on ")
    assert (
        f"CPU ~{GB * (1 / 3 + 1 / 20):.3g} s (reads 20.0 GB/s, Gram at K={K} 3.0 GB/s) > "
        f"GPU ~{GB * 2 / 12:.3g} s (2 reads of U at the staged host-to-device 12.0 GB/s)"
    ) in why
    assert set(rates.gram_k) == {K}
    # Kuramoto, modes S and C: two column-local reads, no Gram: the CPU
    for mode in ("S", "C"):
        dev, why = pick_device(algorithms.build("kuramoto", mode=mode), U)
        assert dev == torch.device("cpu") and why.startswith("cpu: host source, kuramoto [sum, sum] on "), why
    # the same, K from a source and from a ChunkedUpdates
    rates.gram_k.clear()
    assert pick_device(_GramThenSum(), ChunkedUpdates(TensorSource(U[:3])))[0].type == "cuda"
    assert rates.gram_k and set(rates.gram_k) == {3}


def test_a_table_on_the_host_counts_on_both_sides(rates):
    """FedAWARE without ELUD (screen, momenta pass, table Gram, table sum): with its table on the device the GPU
    only pays U's two reads over the link; kept on the host, the table work costs the same on both sides and
    the CPU, saving the link, wins."""
    host_work = GB * (1 / 20 + 2 / 20 + 1 / 3 + 1 / 20)  # host:sum, host:table, host:table_gram, host:table_sum
    dev, why = pick_device(algorithms.build("fedaware", elud=False), _U())
    assert dev.type == "cuda" and "fedaware [sum, sum, table, table_gram, table_sum]" in why
    assert f"> GPU ~{GB * 2 / 12:.3g} s (2 reads of U at" in why
    dev, why = pick_device(algorithms.build("fedaware", elud=False, momentum_device="cpu"), _U())
    assert dev.type == "cpu" and "[sum, host:sum, host:table, host:table_gram, host:table_sum]" in why
    assert (
        f"CPU ~{GB / 20 + host_work:.3g} s (reads 20.0 GB/s, Gram at K={K} 3.0 GB/s) <= "
        f"GPU ~{GB / 12 + host_work:.3g} s (1 read of U at the staged host-to-device 12.0 GB/s + "
        f"{host_work:.3g} s on the host)"
    ) in why


def test_data_already_on_the_device_stays_there(rates):
    class OnCuda(torch.Tensor):  # a CPU tensor that says it is on cuda:1 (no GPU here)
        @property
        def device(self):
            return torch.device("cuda", 1)

    rates.read = 1000.0  # even a CPU that reads faster than the link
    for method in (None, algorithms.build("fedavg"), algorithms.build("kuramoto")):
        assert pick_device(method, _U().as_subclass(OnCuda)) == (
            torch.device("cuda", 1),
            "cuda:1: the data is already there",
        )


def test_bad_arguments_name_what_was_expected():
    with pytest.raises(ValueError, match=r"pick_device: passes declares the pass 'sums'; expected one of"):
        pick_device(("sum", "sums"))
    with pytest.raises(
        TypeError,
        match=r"pick_device: method must be an aggregator \(with passes\(\)\), a sequence "
        r"of pass names or None, got str",
    ):
        pick_device("fedavg")
    with pytest.raises(
        TypeError,
        match=r"pick_device: data must be a tensor, a MatrixSource or a ChunkedUpdates, "
        r"got list",
    ):
        pick_device(None, [[1.0]])
    with pytest.raises(ValueError, match=r"ChunkedUpdates: device must be 'auto'.*got 'gpu'"):
        ChunkedUpdates(_U(), device="gpu")
    with pytest.raises(ValueError, match=r"got 3\.5"):
        ChunkedUpdates(_U(), device=3.5)


# ---- the probes -------------------------------------------------------------------------------------------
def test_probes_measure_once_per_process_and_k(monkeypatch):
    from fedkernels import ops

    monkeypatch.setattr(cost, "_BANDWIDTH", {})
    monkeypatch.setattr(cost, "PROBE_BYTES", 4 << 20)
    monkeypatch.setattr(chunked, "CPU_CHUNK_BYTES", 4 << 20)
    calls = {"weighted_sum": 0, "gram": 0}

    def counted(op, real):
        def f(*a, **k):
            calls[op] += 1
            return real(*a, **k)

        return f

    for op in calls:
        monkeypatch.setattr(ops, op, counted(op, getattr(ops, op)))
    r = cost.cpu_read_gbps()
    g16 = cost.cpu_gram_gbps(16)
    assert r > 0 and g16 > 0 and calls == {"weighted_sum": 4, "gram": 4}  # one warm-up, three timed each
    assert cost.cpu_read_gbps() == r and cost.cpu_gram_gbps(16) == g16 and calls["gram"] == 4
    cost.cpu_gram_gbps(200)
    assert calls["gram"] == 8 and set(cost._BANDWIDTH) == {"cpu", "gram:16", "gram:200"}  # no CUDA: no link probe


# ---- every method declares its passes, and they are what it does --------------------------------------------
def test_every_registered_method_declares_its_passes():
    """Fails for a newly registered method that base._ROUND_PASSES does not cover (device="auto" could not
    cost it)."""
    for name, cls in sorted(_REGISTRY.items()):
        agg = cls(**REQUIRED.get(name, {}))
        passes, label = round_passes(agg)  # valid names (ValueError otherwise)
        assert label == cls.name
        if cls.no_chunked_source is None:
            assert passes and passes[0] in ("sum", "gram"), name  # every round reads U (the screen at least)
        else:
            assert passes == (), name


def test_a_method_that_declares_nothing_is_refused_by_auto_only():
    class Mine(Aggregator):
        name = "mine"

        def _aggregate(self, rin):
            return AggResult(rin.weighted_sum(rin.sample_weights(), base=rin.global_flat), {})

    x = torch.zeros(D)
    with pytest.raises(
        ValueError,
        match=r"mine: device='auto' cannot cost this method: declare what a round does "
        r"with U by overriding Aggregator.passes\(\)",
    ):
        Mine().aggregate(x, ChunkedUpdates(_U(), device="auto"), [1] * K)
    new, info = Mine().aggregate(x, ChunkedUpdates(_U(), device="cpu"), [1] * K)  # a given device: as before
    assert info["num_clients"] == K


def _u_reads(monkeypatch):
    """Counts the passes over a TensorSource's rows (each ``chunks`` iteration)."""
    n = [0]
    real = TensorSource._blocks

    def counted(self, chunk_cols):
        n[0] += 1
        return real(self, chunk_cols)

    monkeypatch.setattr(TensorSource, "_blocks", counted)
    return n


@pytest.mark.parametrize(
    "name, opts, payload",
    [
        ("fedavg", {}, None),
        ("fedavgm", {"nesterov": True}, None),
        ("kuramoto", {}, None),
        ("kuramoto", {"mode": "C", "kappa0": 0.5}, "phase"),
        ("fedaware", {"num_clients": K}, None),
        ("fedaware", {"num_clients": K, "elud": False, "extension": "fedavg"}, None),
        ("fedaware", {"num_clients": K, "momentum_device": "cpu"}, None),
    ],
)
def test_declared_reads_of_u_are_the_rounds_reads(monkeypatch, name, opts, payload):
    """A round on a source reads U as many times as its declared passes that read U (PASSES[p][2], host
    passes included: they read U on the host)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    agg = algorithms.build(name, **opts)
    passes, _ = round_passes(agg)
    declared = sum(PASSES[cost._kind(p)][2] for p in passes)
    n = _u_reads(monkeypatch)
    payloads = [{"phase": 0.1 * k} for k in range(K)] if payload else None
    cu = ChunkedUpdates(_U(), chunk_cols=300, device="auto")
    new, info = agg.aggregate(torch.zeros(D), cu, [1.0 + k for k in range(K)], payloads=payloads)
    assert n[0] == declared, (passes, n[0])
    assert info["device"] == "cpu: no CUDA device" and torch.isfinite(new).all()


# ---- Aggregator.aggregate picks for its own method ------------------------------------------------------------
@pytest.mark.parametrize("name", ["fedavg", "kuramoto"])
def test_auto_aggregation_gives_the_same_result_and_says_where(monkeypatch, name):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    U = _U()
    x = torch.randn(D)
    n = [3, 7, 1, 9, 4]
    ref, ref_info = algorithms.build(name).aggregate(x, U, n)
    cu = ChunkedUpdates(U, chunk_cols=100, device="auto")
    agg = algorithms.build(name)
    new, info = cu.aggregate_placed(agg, x, n)
    torch.testing.assert_close(new, ref, rtol=1e-6, atol=1e-7)
    if name == "fedavg":
        assert torch.equal(new, ref)
    assert info["device"] == "cpu: no CUDA device" and new.device == x.device and agg.round == 1
    with pytest.raises(ValueError, match="global_flat must be a 1-D tensor"):
        cu.aggregate_placed(agg, x.view(7, 143), n)


def test_aggregate_picks_again_for_its_method(rates):
    """ChunkedUpdates(device="auto") without a method is placed for one weighted sum; Aggregator.aggregate
    decides again for its own passes and info["device"] says so (rates where both stay on the CPU: no GPU
    here)."""
    rates.read, rates.gram = 20.0, 10.0  # Kuramoto: 2/20 <= 2/12 s per GB: the CPU
    cu = ChunkedUpdates(_U(), device="auto")
    assert cu.device.type == "cpu" and "one weighted sum [sum]" in cu.placement
    x = torch.zeros(D)
    new, info = algorithms.build("kuramoto").aggregate(x, cu, [1] * K)
    assert info["device"].startswith("cpu: host source, kuramoto [sum, sum] on ")
    assert f"CPU ~{GB * 2 / 20:.3g} s" in info["device"] and f"GPU ~{GB * 2 / 12:.3g} s" in info["device"]
    ref, _ = algorithms.build("kuramoto").aggregate(x, _U(), [1] * K)
    torch.testing.assert_close(new, ref, rtol=1e-6, atol=1e-7)
    placed = ChunkedUpdates(_U(), device="auto", method=algorithms.build("kuramoto"))
    assert placed.placement == info["device"]


def test_fedaware_passes_follow_its_elud_path_by_k(monkeypatch):
    """FedAWARE's ELUD screens with the participants' Gram up to ELUD_GRAM_MAX_K of them, above it with a
    finite_rows read (its sums ride in the momentum pass): the declared passes say so, and a round of more
    clients on a source reads U exactly as declared."""
    from fedkernels.algorithms.fedaware.options import ELUD_GRAM_MAX_K

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    big = ELUD_GRAM_MAX_K + 3
    agg = algorithms.build("fedaware", num_clients=big)
    assert round_passes(agg, ELUD_GRAM_MAX_K)[0][0] == "gram"
    assert round_passes(agg, None)[0][0] == "gram"
    passes, _ = round_passes(agg, big)
    assert passes[0] == "sum" and "gram" not in passes
    declared = sum(PASSES[cost._kind(p)][2] for p in passes)
    n = _u_reads(monkeypatch)
    U = torch.randn(big, 40, generator=torch.Generator().manual_seed(1)) * 0.1
    new, info = agg.aggregate(
        torch.zeros(40), ChunkedUpdates(U, chunk_cols=16, device="auto"), [1.0 + k for k in range(big)]
    )
    assert n[0] == declared and torch.isfinite(new).all(), (passes, n[0])


def test_a_users_passes_without_k_still_work(monkeypatch):
    class Mine:
        name = "mine"

        def passes(self):
            return ("gram", "sum")

    assert round_passes(Mine(), 7) == (("gram", "sum"), "mine")
