"""Privacy accounting for the DP wrapper (``fedkernels.algorithms.dp``): epsilon of the released models
after each round, and the noise multiplier that reaches a target epsilon, from Google's maintained
``dp-accounting`` library (the optional extra ``pip install fedkernels[privacy]``), not written by hand.

The mechanism accounted is the one the wrapper runs: every round, a fixed number m of the N clients is
sampled (uniformly, without replacement: the simulator's sampling) and the clipped updates' sum gets
Gaussian noise. See :mod:`fedkernels.privacy.accountant` and docs/privacy.md.
"""

from .accountant import (
    ACCOUNTANTS,
    SAMPLINGS,
    MissingExtra,
    PrivacyAccountant,
    calibrate_noise_multiplier,
    epsilon_after,
    require_dp_accounting,
)

__all__ = [
    "PrivacyAccountant",
    "calibrate_noise_multiplier",
    "epsilon_after",
    "require_dp_accounting",
    "MissingExtra",
    "ACCOUNTANTS",
    "SAMPLINGS",
]
