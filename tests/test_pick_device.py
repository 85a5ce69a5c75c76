"""device="auto" (fedkernels.sources.pick_device): the CPU or the GPU by the method's cost.

No GPU here: the probes and torch.cuda.is_available are replaced by fixed rates, so the decision logic is
checked (sum-only vs Gram methods, a per-client table on the device or on the host, data already on the
device, no CUDA); the runs themselves stay on the CPU. The real GPU path: GPU speed not measured."""
import pytest
import torch

from fedkernels import algorithms, sources
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
    monkeypatch.setattr(sources, "cpu_read_gbps", lambda: r.read)
    monkeypatch.setattr(sources, "cpu_gram_gbps", lambda k: r.gram_k.append(k) or r.gram)
    monkeypatch.setattr(sources, "h2d_gbps", lambda: r.h2d)
    monkeypatch.setattr(sources, "staging_gbps", lambda: r.stage)
    return r


def _no_probe(*a):
    raise AssertionError("probed")


# ---- the decision -----------------------------------------------------------------------------------------
def test_no_cuda_is_the_cpu_without_probing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("cpu_read_gbps", "cpu_gram_gbps", "h2d_gbps", "staging_gbps"):
        monkeypatch.setattr(sources, name, _no_probe)
    for method in (None, algorithms.build("kuramoto"), algorithms.build("fedaware")):
        assert pick_device(method, _U()) == (torch.device("cpu"), "cpu: no CUDA device")
    cu = ChunkedUpdates(_U(), device="auto", method=algorithms.build("kuramoto"))
    assert cu.device == torch.device("cpu") and cu.placement == "cpu: no CUDA device"
    assert ChunkedUpdates(_U(), device="cpu").placement is None


@pytest.mark.parametrize("read, h2d, stage, want", [
    (105.0, 51.9, 80.0, "cpu"),        # the GPU machine of the first run: the CPU op beats the link
    (10.0, 51.9, 80.0, "cuda:0"),      # a few cores: the link wins
    (52.0, 52.0, 90.0, "cpu"),         # a tie stays on the host
    (40.0, 51.9, 30.0, "cpu")])        # the host copy into pinned memory is the slower stage of the link
def test_one_sum_compares_the_read_rate_with_the_staged_link(rates, read, h2d, stage, want):
    rates.read, rates.h2d, rates.stage = read, h2d, stage
    dev, why = pick_device()
    link = min(h2d, stage)
    assert str(dev) == want and why.startswith(want + ": host source, one weighted sum [sum] on 1 GB: ")
    assert f"CPU ~{1 / read:.3g} s (reads {read:.1f} GB/s)" in why
    assert f"GPU ~{1 / link:.3g} s (1 read of U at the staged host-to-device {link:.1f} GB/s)" in why
    assert ("<=" in why) == (want == "cpu") and rates.gram_k == []      # no Gram: not probed
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
    assert (f"CPU ~{GB * (1 / 3 + 1 / 20):.3g} s (reads 20.0 GB/s, Gram at K={K} 3.0 GB/s) > "
            f"GPU ~{GB * 2 / 12:.3g} s (2 reads of U at the staged host-to-device 12.0 GB/s)") in why
    assert set(rates.gram_k) == {K}
    # Kuramoto, modes S and C: two column-local reads, no Gram: the CPU
    for mode in ("S", "C"):
        dev, why = pick_device(algorithms.build("kuramoto", mode=mode), U)
        assert dev == torch.device("cpu") and why.startswith("cpu: host source, kuramoto [sum, sum] on "), why
    # the same, K from a source and from a ChunkedUpdates
    rates.gram_k.clear()
    assert pick_device(_GramThenSum(), ChunkedUpdates(TensorSource(U[:3])))[0].type == "cuda"
    assert rates.gram_k and set(rates.gram_k) == {3}


def test_aggregate_picks_again_for_its_method(rates):
    """ChunkedUpdates(device="auto") without a method is placed for one weighted sum; Aggregator.aggregate
    decides again for its own passes and info["device"] says so (rates where both stay on the CPU: no GPU
    here)."""
    rates.read, rates.gram = 20.0, 10.0              # Kuramoto: 2/20 <= 2/12 s per GB: the CPU
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
