"""The DP wrapper (algorithms.dp): Flower's DP-FedAvg semantics (clipped sums compared with Flower's own
functions when flwr is installed, the noise by its std and by its exact bits), client-side and adaptive
clipping (Andrew et al.), the per-round epsilon, the per-method verdicts, state and resume, bad options."""

import math

import pytest
import torch

from fedkernels import algorithms, ops
from fedkernels.algorithms.dp import Noised, adaptive_noise, check_dp_options, verdicts

pytest.importorskip("dp_accounting")


def _round_inputs(K=10, d=4000, seed=0, scale=(0.01, 3.0)):
    g = torch.Generator().manual_seed(seed)
    U = torch.randn(K, d, generator=g)
    U *= torch.linspace(scale[0], scale[1], K).unsqueeze(1)  # some rows under the clip norm, some over
    n = torch.randint(1, 100, (K,), generator=g).double()
    return torch.randn(d, generator=g), U, n


def _dp(**kw):
    return dict(dict(kind="central", clip=1.0, noise_multiplier=1.3, population=500, seed=7), **kw)


def test_central_is_flowers_clipped_average_plus_noise_of_std_zC_over_m():
    gflat, U, n = _round_inputs()
    K, d = U.shape
    agg = algorithms.build("fedavg", dp=_dp())
    new, info = agg.aggregate(gflat, U, n, list(range(K)))
    norms = U.double().norm(dim=1)
    s = torch.clamp(1.0 / norms, max=1.0)
    clipped_mean = gflat.double() + (U.double() * s[:, None]).mean(0)
    sigma = 1.3 * 1.0 / K  # Flower's compute_stdv(z, C, m)
    # the noise is exactly sigma * N(seed, 2 * round, j), in the sum's write (float32: v + float(sigma n))
    want = ops.weighted_sum_noised(U, (s / K).tolist(), gflat, 1.0, sigma=sigma, seed=7, counter=0)
    assert torch.equal(new, want)
    z = (new.double() - clipped_mean) / sigma
    assert torch.allclose(z, ops.philox_normal(d, 7, 0), atol=1e-4 / sigma)
    assert info["dp_clipped"] == int((norms > 1).sum()) and 0 < info["dp_clipped"] < K
    assert info["weights"] == [1 / K] * K  # fair weights: num_examples ignored


def test_clipped_aggregate_matches_flower_functions():
    flwr_dp = pytest.importorskip("flwr.supercore.differential_privacy")
    from flwr.server.strategy.aggregate import aggregate

    gflat, U, n = _round_inputs(K=6, d=300)
    arrays = [[u[:100].double().numpy().copy(), u[100:].double().numpy().copy()] for u in U]
    for a in arrays:
        flwr_dp.clip_inputs_inplace(a, 1.0)
    g = [gflat[:100].double().numpy(), gflat[100:].double().numpy()]
    params = [[gi + ai for gi, ai in zip(g, a)] for a in arrays]
    flower = aggregate([(p, 1) for p in params])  # Flower's FedAvg, equal weights
    agg = algorithms.build("fedavg", dp=_dp(noise_multiplier=0.0))
    new, _ = agg.aggregate(gflat.double(), U.double(), n, list(range(6)))
    assert torch.allclose(new, torch.from_numpy(__import__("numpy").concatenate(flower)), rtol=0, atol=1e-12)
    assert flwr_dp.compute_stdv(1.3, 1.0, 6) == 1.3 / 6


def test_client_kind_trusts_the_rows_and_adds_the_same_noise():
    gflat, U, n = _round_inputs()
    K = U.shape[0]
    U = U * torch.clamp(1.0 / U.norm(dim=1, keepdim=True), max=1.0)  # clipped by the clients
    new, info = algorithms.build("fedavg", dp=_dp(kind="client")).aggregate(gflat, U, n, list(range(K)))
    central, _ = algorithms.build("fedavg", dp=_dp()).aggregate(gflat, U, n, list(range(K)))
    assert torch.allclose(new, central, atol=1e-6)
    assert info["dp_clipped"] == 0


def test_adaptive_clip_follows_the_paper_and_noise_budget_matches_flower():
    gflat, U, n = _round_inputs(K=20)
    norms = U.double().norm(dim=1)
    agg = algorithms.build("fedavg", dp=_dp(kind="adaptive", clip=0.5, noise_multiplier=0.0))
    agg.aggregate(gflat, U, n, list(range(20)))
    within = int((norms <= 0.5).sum())
    assert agg.clip == pytest.approx(0.5 * math.exp(-0.2 * (within / 20 - 0.5)), rel=1e-12)
    # too few updates within C: C grows; all within: C shrinks (the paper's direction)
    agg2 = algorithms.build("fedavg", dp=_dp(kind="adaptive", clip=1e-6, noise_multiplier=0.0))
    agg2.aggregate(gflat, U, n, list(range(20)))
    assert agg2.clip > 1e-6
    agg3 = algorithms.build("fedavg", dp=_dp(kind="adaptive", clip=1e6, noise_multiplier=0.0))
    agg3.aggregate(gflat, U, n, list(range(20)))
    assert agg3.clip < 1e6
    flwr_dp = pytest.importorskip("flwr.supercore.differential_privacy")
    assert adaptive_noise(1.3, 20 / 20) == pytest.approx(flwr_dp.compute_adaptive_noise_params(1.3, 20, None)[1])
    with pytest.raises(ValueError, match="clipped_count_stddev=0.5 is too small"):
        adaptive_noise(1.3, 0.5)


def test_epsilon_every_round_is_the_accountants():
    from fedkernels.privacy import PrivacyAccountant

    gflat, U, n = _round_inputs(K=10, d=100)
    agg = algorithms.build("fedavg", dp=_dp())
    acc = PrivacyAccountant(1.3, 10, 500, 1e-5)
    eps = []
    for r in range(3):
        gflat, info = agg.aggregate(gflat, U, n, list(range(10)))
        eps.append(info["epsilon"])
        assert info["epsilon"] == acc.epsilon_at(r + 1)
    assert eps[0] < eps[1] < eps[2]


def test_target_epsilon_calibrates_the_multiplier():
    o = check_dp_options(dict(clip=1.0, target_epsilon=4.0, rounds=20, num_sampled_clients=10, population=500))
    from fedkernels.privacy import epsilon_after

    assert epsilon_after(20, o["noise_multiplier"], 10, 500, 1e-5) <= 4.0


def test_resumed_round_draws_the_same_noise():
    gflat, U, n = _round_inputs(K=8, d=500)
    a = algorithms.build("fedavgm", dp=_dp(kind="adaptive", clip=0.7, clipped_count_stddev=2.0))
    g1, _ = a.aggregate(gflat, U, n, list(range(8)))
    st = a.state_dict()
    g2, i2 = a.aggregate(g1, U * 0.5, n, list(range(8)))
    b = algorithms.build("fedavgm", dp=_dp(kind="adaptive", clip=0.7, clipped_count_stddev=2.0))
    b.load_state_dict(st)
    h2, j2 = b.aggregate(g1, U * 0.5, n, list(range(8)))
    assert torch.equal(g2, h2) and i2["epsilon"] == j2["epsilon"] and a.clip == b.clip


@pytest.mark.parametrize("name", sorted(n for n, v in verdicts().items() if v == "private"))
def test_every_accepted_method_runs_under_dp(name):
    from fedkernels.flat import FlatSpec

    spec = FlatSpec.from_module(torch.nn.Sequential(torch.nn.Linear(16, 15), torch.nn.Linear(15, 1)))
    gflat, U, n = _round_inputs(K=6, d=spec.d)
    try:
        algorithms.build(name)
    except ValueError as e:
        pytest.skip(f"{name} needs options to build: {e}")
    agg = algorithms.build(name, dp=_dp())
    agg.setup(spec, 500, gflat)
    import fuzz_oracle  # the payloads each method's clients send

    payloads = fuzz_oracle._payloads(
        agg.inner.name, agg.inner, 6, spec.d, torch.float32, torch.Generator(), {}, list(range(6))
    )
    new, info = agg.aggregate(gflat, U, n, list(range(6)), payloads)
    assert torch.isfinite(new).all() and info["epsilon"] > 0


@pytest.mark.parametrize("name", sorted(n for n, v in verdicts().items() if v != "private"))
def test_refused_methods_say_why(name):
    with pytest.raises(ValueError, match=r"dp: method '[a-z_-]+' is refused: ") as e:
        algorithms.build(name, dp=_dp())
    assert "\n" not in str(e.value)


def test_noised_input_refuses_unnoised_reads():
    gflat, U, n = _round_inputs(K=3, d=10)
    rin = algorithms.build("fedavg").validate(gflat, U, n, [0, 1, 2])
    nz = Noised(rin, torch.ones(3), 1.0, 0, 0, "m")
    for read in (lambda: nz.gram(), lambda: nz.kstats(torch.ones(3) / 3), lambda: list(nz.blocks()), lambda: nz.U):
        with pytest.raises(ValueError, match="dp: m reads the updates through"):
            read()
    nz.weighted_sum(torch.ones(3) / 3)
    with pytest.raises(ValueError, match="a second weighted sum"):
        nz.weighted_sum(torch.ones(3) / 3)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(clip=0.0), r"dp.clip=0.0: expected a number > 0"),
        (dict(clip=-1.0), r"dp.clip=-1.0"),
        (dict(noise_multiplier=-0.5), r"dp.noise_multiplier=-0.5: expected a number >= 0"),
        (dict(delta=1.0), r"dp.delta=1.0: expected a number in \(0, 1\)"),
        (dict(delta=0), r"dp.delta=0"),
        (dict(kind="local"), r"dp.kind='local'"),
        (dict(target_epsilon=1.0), r"exactly one of noise_multiplier and target_epsilon"),
        (dict(noise_multiplier=None, target_epsilon=1.0), r"target_epsilon needs rounds, num_sampled_clients"),
        (
            dict(noise_multiplier=None, target_epsilon=1e-4, rounds=1000, num_sampled_clients=100, population=100),
            r"cannot be reached",
        ),
        (dict(clip_norm_lr=0.0), r"dp.clip_norm_lr=0.0"),
        (dict(bogus=1), r"unknown option 'bogus'"),
    ],
)
def test_bad_options_one_line(kw, match):
    with pytest.raises(ValueError, match=match) as e:
        algorithms.build("fedavg", dp={k: v for k, v in _dp(**kw).items()})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["central", "client"])
def test_bad_row_is_excluded_and_the_round_redone_without_it(kind):
    gflat, U, n = _round_inputs(K=6, d=300)
    U[2, 7] = float("nan")
    agg = algorithms.build("fedavg", on_bad_update="exclude", dp=_dp(kind=kind))
    new, info = agg.aggregate(gflat, U, n, list(range(6)))
    assert torch.isfinite(new).all()
    assert [e["client_id"] for e in info["excluded"]] == [2] and info["weights"] == [0.2] * 5
    keep = [0, 1, 3, 4, 5]
    ref, _ = algorithms.build("fedavg", dp=_dp(kind=kind)).aggregate(gflat, U[keep], n[keep], keep)
    assert torch.equal(new, ref)


def test_norms_measured_at_write_time_give_the_same_round():
    """The simulator hands the rows' norms (taken as each row was written) to the wrapper: the round
    skips its norms pass and gives the same bits as measuring them itself."""
    from fedkernels.flat import row_norms

    gflat, U, n = _round_inputs(K=7, d=5000)
    a = algorithms.build("fedavg", dp=_dp())
    b = algorithms.build("fedavg", dp=_dp())
    norms = row_norms(U)
    b.known_norms = {c: float(x) for c, x in zip(range(7), norms)}
    ra, ia = a.aggregate(gflat, U, n, list(range(7)))
    rb, ib = b.aggregate(gflat, U, n, list(range(7)))
    assert torch.equal(ra, rb) and ia["dp_clipped"] == ib["dp_clipped"] and b.known_norms is None
    assert torch.allclose(norms, U.double().norm(dim=1), rtol=1e-13)


def test_a_model_with_batchnorm_buffers_is_refused():
    # buffers are averaged without clipping or noise (algorithms/buffers.py): DP refuses them at setup
    from torch import nn
    from fedkernels import FlatSpec

    spec = FlatSpec.from_module(nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)))
    agg = algorithms.build("fedavg", dp={"kind": "central", "clip": 1.0, "noise_multiplier": 1.0})
    with pytest.raises(ValueError, match="dp: the model has buffers .*running_mean"):
        agg.setup(spec, num_clients=10)
    ok = FlatSpec.from_module(nn.Sequential(nn.Linear(4, 3), nn.GroupNorm(1, 3)))
    algorithms.build("fedavg", dp={"kind": "central", "clip": 1.0, "noise_multiplier": 1.0}).setup(ok, num_clients=10)


def test_verdicts_constant_reads_the_declarations():
    """``dp.VERDICTS`` (the public name) is ``verdicts()``: each registered method's own ``dp_verdict``."""
    from fedkernels.algorithms import dp

    assert dp.VERDICTS == dp.verdicts()
    assert dp.VERDICTS["fedavg"] == "private" and dp.VERDICTS["fedadam"] == "private"
    assert all(dp.VERDICTS[m] != "private" for m in ("scaffold", "fedaware", "kuramoto", "krum", "median"))
