"""fedkernels.privacy: the accountant (dp-accounting's RDP/PLD) against published epsilons and against
dp-accounting used directly; the noise calibration; the refusals."""

import math
import sys

import pytest

dpa = pytest.importorskip("dp_accounting")

from fedkernels.privacy import (  # noqa: E402
    MissingExtra,
    PrivacyAccountant,
    calibrate_noise_multiplier,
    epsilon_after,
    require_dp_accounting,
)


# TensorFlow Privacy's MNIST DP-SGD tutorial (tutorials/README.md, "Select Parameters"): N = 60000, batch 256
# (Poisson sampling q = 256/60000), delta = 1e-5, steps = ceil(epochs * N / batch), epsilons published to two
# decimals, computed with RDP and the classic conversion eps = min_alpha rdp(alpha) + log(1/delta)/(alpha - 1)
# (compute_dp_sgd_privacy.py of that time; its orders are dp-accounting's default ones).
PUBLISHED = [(1.1, 60, 3.01), (1.3, 15, 1.19), (0.7, 45, 7.10)]


@pytest.mark.parametrize("z,epochs,eps", PUBLISHED)
def test_reproduces_tensorflow_privacy_published_epsilons(z, epochs, eps):
    steps = math.ceil(epochs * 60000 / 256)
    acc = PrivacyAccountant(z, 256, 60000, 1e-5, sampling="poisson")
    orders, rdp = acc.rdp_curve(steps)
    classic = min(r + math.log(1 / 1e-5) / (a - 1) for a, r in zip(orders, rdp))
    assert round(classic, 2) == eps
    # dp-accounting's own conversion (Balle et al. 2020) is tighter: what the runs report
    assert acc.epsilon_at(steps) < classic


@pytest.mark.parametrize(
    "sampling,rel,mk",
    [
        (
            "fixed_size",
            "REPLACE_ONE",
            lambda z: dpa.SampledWithoutReplacementDpEvent(3000, 100, dpa.GaussianDpEvent(z / 2)),
        ),
        ("poisson", "ADD_OR_REMOVE_ONE", lambda z: dpa.PoissonSampledDpEvent(100 / 3000, dpa.GaussianDpEvent(z))),
    ],
)
def test_rounds_compose_as_dp_accounting_does(sampling, rel, mk):
    acc = PrivacyAccountant(1.3, 100, 3000, 1e-5, sampling=sampling)
    for rounds in (1, 7, 50):
        direct = dpa.rdp.RdpAccountant(neighboring_relation=getattr(dpa.NeighboringRelation, rel))
        direct.compose(dpa.SelfComposedDpEvent(mk(1.3), rounds))
        assert acc.epsilon_at(rounds) == pytest.approx(direct.get_epsilon(1e-5), rel=1e-12)
    assert acc.epsilon == 0.0
    e1 = acc.step()
    assert e1 == acc.epsilon_at(1) and acc.step(2) == acc.epsilon_at(3) > e1


def test_pld_poisson_close_to_rdp_and_tighter():
    r = epsilon_after(100, 1.0, 100, 3000, 1e-5, "rdp", "poisson")
    p = epsilon_after(100, 1.0, 100, 3000, 1e-5, "pld", "poisson")
    assert 0.5 * r < p < r


def test_fixed_size_sampling_pays_the_replace_one_sensitivity():
    """Replacing one client's clipped update moves the sum by up to 2C: fixed-size sampling is accounted
    with half the multiplier (REPLACE_ONE), so it costs more than Poisson's add/remove at the same z."""
    assert epsilon_after(10, 2.0, 100, 3000, 1e-5) > epsilon_after(10, 2.0, 100, 3000, 1e-5, sampling="poisson")
    full = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
    full.compose(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(1.0), 5))  # every client, every round: q = 1
    assert epsilon_after(5, 2.0, 40, 40, 1e-5) == pytest.approx(full.get_epsilon(1e-5), rel=1e-12)


@pytest.mark.parametrize("sampling", ["fixed_size", "poisson"])
def test_calibration_is_the_smallest_multiplier_reaching_the_target(sampling):
    z = calibrate_noise_multiplier(4.0, 1e-5, 30, 50, 2000, sampling=sampling)
    assert epsilon_after(30, z, 50, 2000, 1e-5, sampling=sampling) <= 4.0
    assert epsilon_after(30, z * (1 - 2e-3), 50, 2000, 1e-5, sampling=sampling) > 4.0


def test_zero_noise_is_infinite_epsilon():
    assert epsilon_after(1, 0.0, 10, 100, 1e-5) == math.inf
    assert epsilon_after(0, 0.0, 10, 100, 1e-5) == 0.0


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(delta=1.0), "delta=1.0: expected a number in \\(0, 1\\)"),
        (dict(delta=0.0), "delta"),
        (dict(sample_size=0), "sample_size=0"),
        (dict(sample_size=200), "sample_size=200"),
        (dict(noise_multiplier=-1.0), "noise_multiplier=-1.0"),
        (dict(accountant="gdp"), "accountant='gdp'"),
        (dict(accountant="pld"), "does not support fixed-size sampling"),
    ],
)
def test_bad_arguments(kw, match):
    args = dict(noise_multiplier=1.0, sample_size=10, population=100, delta=1e-5) | kw
    with pytest.raises(ValueError, match=match):
        PrivacyAccountant(**args)


def test_unreachable_target_is_one_line():
    with pytest.raises(ValueError, match="cannot be reached in 1000 rounds") as e:
        calibrate_noise_multiplier(1e-4, 1e-5, 1000, 100, 100, z_max=10.0)
    assert "\n" not in str(e.value)


def test_missing_extra_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "dp_accounting", None)
    with pytest.raises(MissingExtra, match=r"pip install 'fedkernels\[privacy\]'"):
        require_dp_accounting()
