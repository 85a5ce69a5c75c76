"""Statistics over seeds: sample std, Student-t confidence intervals, paired differences.

    describe([0.81, 0.83, 0.82])        # n, mean, std (n-1), sem, 95% CI from the t distribution
    paired([0.84, 0.85], [0.81, 0.83])  # method - baseline per seed: mean, std, 95% CI, t, p

Runs of different methods with the same seed share the partition and the client-sampling stream,
so method-minus-baseline differences per seed are paired observations and the paired t-test is the
right test (it removes the seed-to-seed variation both methods share). With n seeds the t
distribution has n - 1 degrees of freedom: at 3 seeds the 95% half-width is 4.30 standard errors,
at 2 seeds 12.71; a difference that is "significant" there is large.

The Student-t distribution is computed here (regularised incomplete beta function by Lentz's
continued fraction, quantiles by bisection on it), so that scipy is not a run-time dependency; the
tests compare it with ``scipy.stats``.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Optional, Sequence, Union

Number = Union[int, float]


# ---- the t distribution ------------------------------------------------------------------------------
def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        de = d * c
        h *= de
        if abs(de - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta function I_x(a, b) for a, b > 0 and 0 <= x <= 1."""
    if not (a > 0 and b > 0):
        raise ValueError(f"betainc: a and b must be > 0, got a={a}, b={b}")
    if not (0.0 <= x <= 1.0):
        raise ValueError(f"betainc: x must lie in [0, 1], got {x}")
    if x == 0.0 or x == 1.0:
        return x
    lbt = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(lbt) * _betacf(a, b, x) / a
    return 1.0 - math.exp(lbt) * _betacf(b, a, 1.0 - x) / b


def t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with ``df`` degrees of freedom."""
    if not df > 0:
        raise ValueError(f"t_sf: df must be > 0, got {df}")
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    tail = 0.5 * betainc(0.5 * df, 0.5, df / (df + t * t))
    return tail if t >= 0 else 1.0 - tail


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    return 1.0 - t_sf(t, df)


def t_ppf(q: float, df: float) -> float:
    """The ``q`` quantile of Student's t with ``df`` degrees of freedom (0 < q < 1), e.g.
    ``t_ppf(0.975, 2) = 4.3027``."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"t_ppf: q must lie in (0, 1), got {q}")
    if not df > 0:
        raise ValueError(f"t_ppf: df must be > 0, got {df}")
    if q == 0.5:
        return 0.0
    if q < 0.5:
        return -t_ppf(1.0 - q, df)
    target = 1.0 - q  # upper tail, found by bisection on t_sf (decreasing)
    lo, hi = 0.0, 1.0
    while t_sf(hi, df) > target:
        hi *= 2.0
        if hi > 1e300:
            return math.inf
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_sf(mid, df) > target:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


# ---- summaries ---------------------------------------------------------------------------------------
def finite(values: Sequence[Any]) -> list:
    """The finite real numbers of ``values`` (None, NaN, text and bools dropped)."""
    return [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]


def describe(values: Sequence[Any], conf: float = 0.95) -> Dict[str, Any]:
    """``{n, mean, std, sem, ci_low, ci_high, ci_half, conf}`` of the finite ``values``: ``std`` is
    the sample standard deviation (divisor n - 1), the CI is mean +- t_{(1+conf)/2, n-1} * std/sqrt(n).
    With one value std and the CI are None; with none everything but n is None."""
    if not 0.0 < conf < 1.0:
        raise ValueError(f"describe: conf must lie in (0, 1), got {conf}")
    v = finite(values)
    n = len(v)
    out: Dict[str, Any] = {
        "n": n,
        "mean": None,
        "std": None,
        "sem": None,
        "ci_low": None,
        "ci_high": None,
        "ci_half": None,
        "conf": conf,
    }
    if n == 0:
        return out
    mean = math.fsum(v) / n
    out["mean"] = mean
    if n < 2:
        return out
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in v) / (n - 1))
    sem = std / math.sqrt(n)
    half = t_ppf(0.5 + conf / 2.0, n - 1) * sem
    out.update(std=std, sem=sem, ci_half=half, ci_low=mean - half, ci_high=mean + half)
    return out


def _align(x, y):
    """Pairs of finite values: by key for mappings (e.g. seed -> value), by position for sequences."""
    if isinstance(x, Mapping) and isinstance(y, Mapping):
        keys = [k for k in x if k in y]
        pairs = [(x[k], y[k]) for k in keys]
    else:
        x, y = list(x), list(y)
        if len(x) != len(y):
            raise ValueError(f"paired: the two samples must have the same length, got {len(x)} and {len(y)}")
        keys = list(range(len(x)))
        pairs = list(zip(x, y))
    good = [(k, float(a), float(b)) for k, (a, b) in zip(keys, pairs) if len(finite([a, b])) == 2]
    return good


def paired(
    x: Union[Sequence[Any], Mapping[Any, Any]],
    baseline: Union[Sequence[Any], Mapping[Any, Any]],
    conf: float = 0.95,
    alpha: Optional[float] = None,
) -> Dict[str, Any]:
    """Paired comparison of ``x`` with ``baseline`` (same seeds): the per-seed differences
    ``x - baseline``, their mean, sample std, ``conf`` CI, the paired t statistic, the two-sided p
    value and ``significant`` (p < alpha, alpha = 1 - conf by default; the CI then excludes 0).

    Samples are aligned by key when both are mappings (seed -> value), else by position; pairs with
    a missing or non-finite value are dropped (``n`` says how many remain). With identical
    differences (std 0) t is +-inf and p 0 when their mean is not 0, and t = 0, p = 1 when it is."""
    alpha = 1.0 - conf if alpha is None else alpha
    pairs = _align(x, baseline)
    diffs = [a - b for _, a, b in pairs]
    d = describe(diffs, conf)
    out: Dict[str, Any] = {
        "n": d["n"],
        "keys": [k for k, _, _ in pairs],
        "diffs": diffs,
        "mean_diff": d["mean"],
        "std_diff": d["std"],
        "ci_low": d["ci_low"],
        "ci_high": d["ci_high"],
        "ci_half": d["ci_half"],
        "conf": conf,
        "t": None,
        "df": None,
        "p": None,
        "significant": None,
    }
    if d["n"] < 2:
        return out
    df = d["n"] - 1
    if d["std"] == 0.0:
        t = 0.0 if d["mean"] == 0.0 else math.copysign(math.inf, d["mean"])
    else:
        t = d["mean"] / d["sem"]
    p = 1.0 if t == 0.0 else min(1.0, 2.0 * t_sf(abs(t), df))
    out.update(t=t, df=df, p=p, significant=bool(p < alpha))
    return out


def fmt_mean_ci(d: Mapping[str, Any], scale: float = 1.0, digits: int = 2, show: str = "std") -> str:
    """``'82.03 ± 0.41'`` (``show='std'``: sample std) or ``'82.03 [81.01, 83.05]'`` (``'ci'``) from a
    :func:`describe` result; ``'n/a'`` without a mean, the bare mean with one value."""
    if d.get("mean") is None:
        return "n/a"
    m = scale * d["mean"]
    if show == "ci":
        if d.get("ci_low") is None:
            return f"{m:.{digits}f}"
        return f"{m:.{digits}f} [{scale * d['ci_low']:.{digits}f}, {scale * d['ci_high']:.{digits}f}]"
    if d.get("std") is None:
        return f"{m:.{digits}f}"
    return f"{m:.{digits}f} ± {scale * d['std']:.{digits}f}"
