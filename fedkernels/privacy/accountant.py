"""Client-level (epsilon, delta) of DP-FedAvg-style rounds, from ``dp-accounting`` (RDP or PLD).

One round = one subsampled Gaussian mechanism on the clients' clipped updates, with noise multiplier z
(the noise's std over the L2 sensitivity of one client's contribution under add/remove, C):

* ``sampling="fixed_size"`` (the simulator's: m of N clients uniformly without replacement, the same m
  every round): ``SampledWithoutReplacementDpEvent(N, m, GaussianDpEvent(z / 2))`` under the
  REPLACE_ONE neighbouring relation (datasets of N clients that differ in one client's data: N is
  public). Replacing one clipped update moves the sum by up to 2C, so the Gaussian's multiplier over
  that sensitivity is z / 2 (Wang, Balle, Kasiviswanathan 2019, Theorem 27, as dp-accounting's RDP
  accountant implements it). Only the RDP accountant supports this event.
* ``sampling="poisson"`` (each client joins each round independently with probability q = m / N):
  ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` under ADD_OR_REMOVE_ONE (Abadi et al. 2016; McMahan et
  al. 2018), RDP or PLD. The cross-check test reproduces TensorFlow Privacy's published DP-SGD
  epsilons with it.

Rounds compose (``SelfComposedDpEvent``); epsilon is reported at the run's delta.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional

ACCOUNTANTS = ("rdp", "pld")
SAMPLINGS = ("fixed_size", "poisson")
_EXTRA = "differential privacy needs the optional extra: pip install 'fedkernels[privacy]' (Google's dp-accounting)"


class MissingExtra(ImportError):
    """dp-accounting is not installed (the ``privacy`` extra)."""


def require_dp_accounting() -> Any:
    """The ``dp_accounting`` module, or :class:`MissingExtra` with one line naming the extra."""
    try:
        import dp_accounting
    except ImportError as e:  # pragma: no cover - the test environment has it
        raise MissingExtra(_EXTRA) from e
    return dp_accounting


def _check(
    noise_multiplier: float, sample_size: int, population: int, delta: float, accountant: str, sampling: str
) -> None:
    if not (isinstance(noise_multiplier, (int, float)) and math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise ValueError(f"privacy: noise_multiplier={noise_multiplier!r}: expected a finite number >= 0")
    if not (isinstance(population, int) and population >= 1):
        raise ValueError(f"privacy: population={population!r}: expected an integer >= 1 (the number of clients N)")
    if not (isinstance(sample_size, int) and 1 <= sample_size <= population):
        raise ValueError(
            f"privacy: sample_size={sample_size!r}: expected an integer in [1, {population}] (clients per round)"
        )
    if not (isinstance(delta, float) and 0 < delta < 1):
        raise ValueError(f"privacy: delta={delta!r}: expected a number in (0, 1)")
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"privacy: accountant={accountant!r}: expected one of {', '.join(ACCOUNTANTS)}")
    if sampling not in SAMPLINGS:
        raise ValueError(f"privacy: sampling={sampling!r}: expected one of {', '.join(SAMPLINGS)}")
    if accountant == "pld" and sampling == "fixed_size":
        raise ValueError(
            "privacy: accountant='pld' does not support fixed-size sampling without replacement "
            "(dp-accounting's PLD accountant has no such event); use accountant='rdp'"
        )


class PrivacyAccountant:
    """Epsilon after each round of a mechanism with noise multiplier ``noise_multiplier`` (z), ``sample_size``
    (m) clients per round out of ``population`` (N), at ``delta``. ``step(rounds=1)`` records rounds;
    ``epsilon`` is the epsilon so far (0 before any round; inf for z = 0 after one)."""

    def __init__(
        self,
        noise_multiplier: float,
        sample_size: int,
        population: int,
        delta: float,
        accountant: str = "rdp",
        sampling: str = "fixed_size",
    ) -> None:
        _check(noise_multiplier, sample_size, population, delta, accountant, sampling)
        self.noise_multiplier, self.sample_size, self.population = float(noise_multiplier), sample_size, population
        self.delta, self.accountant, self.sampling = delta, accountant, sampling
        self.rounds = 0
        self._rdp1: Optional[Any] = None  # RDP curve of one round (rounds compose by adding RDP)

    def event(self, rounds: int = 1) -> Any:
        """The dp-accounting event of ``rounds`` rounds."""
        dpa = require_dp_accounting()
        z, m, N = self.noise_multiplier, self.sample_size, self.population
        if self.sampling == "fixed_size":
            one = dpa.SampledWithoutReplacementDpEvent(N, m, dpa.GaussianDpEvent(z / 2))  # sensitivity 2C
        else:
            one = dpa.PoissonSampledDpEvent(m / N, dpa.GaussianDpEvent(z))
        return dpa.SelfComposedDpEvent(one, rounds)

    def _accountant(self) -> Any:
        dpa = require_dp_accounting()
        if self.accountant == "rdp":
            rel = (
                dpa.NeighboringRelation.REPLACE_ONE
                if self.sampling == "fixed_size"
                else dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
            )
            return dpa.rdp.RdpAccountant(neighboring_relation=rel)
        return dpa.pld.PLDAccountant()

    def epsilon_at(self, rounds: int) -> float:
        """Epsilon after ``rounds`` rounds. RDP: the accountant's curve of one round, computed once, times
        ``rounds`` (RDP composes additively: what the accountant does for a ``SelfComposedDpEvent``), turned
        into epsilon by dp-accounting's ``compute_epsilon``; PLD: the composed event's accountant."""
        if rounds <= 0:
            return 0.0
        if self.noise_multiplier == 0:
            return math.inf
        if self.accountant == "rdp":
            from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

            if self._rdp1 is None:
                acc = self._accountant()
                acc.compose(self.event(1))
                self._rdp1 = (list(acc._orders), acc._rdp)
            orders, rdp1 = self._rdp1
            return float(rdp_lib.compute_epsilon(orders, rounds * rdp1, self.delta)[0])
        acc = self._accountant()
        acc.compose(self.event(rounds))
        return float(acc.get_epsilon(self.delta))

    def rdp_curve(self, rounds: int) -> "tuple[list, Any]":
        """(orders, RDP at each order) after ``rounds`` rounds (RDP accountant only): what epsilon is made of."""
        if self.accountant != "rdp":
            raise ValueError("privacy: rdp_curve needs accountant='rdp'")
        self.epsilon_at(1)
        assert self._rdp1 is not None
        return self._rdp1[0], rounds * self._rdp1[1]

    def step(self, rounds: int = 1) -> float:
        self.rounds += rounds
        return self.epsilon

    @property
    def epsilon(self) -> float:
        return self.epsilon_at(self.rounds)

    def state_dict(self) -> dict:
        return {"rounds": self.rounds}

    def load_state_dict(self, st: dict) -> None:
        self.rounds = int(st["rounds"])


def epsilon_after(
    rounds: int,
    noise_multiplier: float,
    sample_size: int,
    population: int,
    delta: float,
    accountant: str = "rdp",
    sampling: str = "fixed_size",
) -> float:
    """Epsilon after ``rounds`` rounds (see :class:`PrivacyAccountant`)."""
    return PrivacyAccountant(noise_multiplier, sample_size, population, delta, accountant, sampling).epsilon_at(rounds)


@functools.lru_cache(maxsize=64)  # the run's checks and its set-up ask the same question
def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    rounds: int,
    sample_size: int,
    population: int,
    accountant: str = "rdp",
    sampling: str = "fixed_size",
    tol: float = 1e-3,
    z_max: float = 1e3,
) -> float:
    """The smallest noise multiplier z (to a relative ``tol``, rounded up) whose epsilon after ``rounds``
    rounds is at most ``target_epsilon``: bisection on z over the accountant (epsilon falls as z grows).
    ValueError (one line) when even ``z_max`` does not reach the target."""
    if not (isinstance(target_epsilon, (int, float)) and math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"privacy: target_epsilon={target_epsilon!r}: expected a finite number > 0")
    if not (isinstance(rounds, int) and rounds >= 1):
        raise ValueError(f"privacy: rounds={rounds!r}: expected an integer >= 1")
    _check(1.0, sample_size, population, delta, accountant, sampling)

    def eps(z: float) -> float:
        return epsilon_after(rounds, z, sample_size, population, delta, accountant, sampling)

    if eps(z_max) > target_epsilon:
        raise ValueError(
            f"privacy: target_epsilon={target_epsilon} cannot be reached in {rounds} rounds of "
            f"{sample_size} "
            f"of {population} clients at delta={delta} (epsilon {eps(z_max):.3g} even at noise "
            f"multiplier {z_max:g})"
        )
    lo, hi = 0.0, 1.0
    while eps(hi) > target_epsilon:
        lo, hi = hi, hi * 2
    while hi - lo > tol * hi:
        mid = 0.5 * (lo + hi)
        if eps(mid) > target_epsilon:
            lo = mid
        else:
            hi = mid
    return hi
