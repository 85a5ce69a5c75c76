"""sim.stats: sample std, Student-t CIs and paired tests, against hand values and scipy.stats."""

import math

import pytest

from fedkernels.sim import stats

scipy_stats = pytest.importorskip("scipy.stats")


@pytest.mark.parametrize("df", [1, 2, 3, 4, 5, 9, 29, 100, 2.5])
@pytest.mark.parametrize("q", [0.5, 0.6, 0.9, 0.95, 0.975, 0.995, 0.025, 0.0005])
def test_t_ppf_matches_scipy(q, df):
    assert stats.t_ppf(q, df) == pytest.approx(scipy_stats.t.ppf(q, df), rel=1e-9, abs=1e-12)


def test_t_ppf_textbook_values():
    # the 97.5% points of a printed t table
    for df, t in [(1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (9, 2.262), (30, 2.042)]:
        assert stats.t_ppf(0.975, df) == pytest.approx(t, abs=5e-4)


@pytest.mark.parametrize("df", [1, 2, 4, 17])
@pytest.mark.parametrize("t", [-5.0, -1.0, 0.0, 0.3, 2.0, 40.0])
def test_t_sf_and_cdf_match_scipy(t, df):
    assert stats.t_sf(t, df) == pytest.approx(scipy_stats.t.sf(t, df), rel=1e-10, abs=1e-15)
    assert stats.t_cdf(t, df) == pytest.approx(scipy_stats.t.cdf(t, df), rel=1e-10, abs=1e-15)


def test_betainc_matches_scipy():
    special = pytest.importorskip("scipy.special")
    for a, b, x in [(0.5, 0.5, 0.3), (2.0, 3.0, 0.9), (10.0, 0.5, 0.99), (1.0, 1.0, 0.25)]:
        assert stats.betainc(a, b, x) == pytest.approx(special.betainc(a, b, x), rel=1e-11)


def test_describe_by_hand():
    d = stats.describe([0.81, 0.83, 0.82])
    assert d["n"] == 3 and d["mean"] == pytest.approx(0.82)
    assert d["std"] == pytest.approx(0.01)  # sum of squares 2e-4 / (3 - 1)
    assert d["sem"] == pytest.approx(0.01 / math.sqrt(3))
    half = 4.302652729911275 * 0.01 / math.sqrt(3)  # t_{0.975, 2}
    assert d["ci_low"] == pytest.approx(0.82 - half) and d["ci_high"] == pytest.approx(0.82 + half)
    # against scipy's interval
    lo, hi = scipy_stats.t.interval(0.95, 2, loc=0.82, scale=scipy_stats.sem([0.81, 0.83, 0.82]))
    assert (d["ci_low"], d["ci_high"]) == (pytest.approx(lo), pytest.approx(hi))


def test_describe_drops_missing_and_handles_small_n():
    d = stats.describe([0.5, None, float("nan"), "x", True])
    assert d["n"] == 1 and d["mean"] == 0.5 and d["std"] is None and d["ci_low"] is None
    assert stats.describe([])["mean"] is None
    with pytest.raises(ValueError, match="conf"):
        stats.describe([1, 2], conf=95)


def test_paired_matches_scipy_ttest_rel():
    x = [0.842, 0.851, 0.838, 0.860, 0.845]
    y = [0.830, 0.849, 0.829, 0.851, 0.846]
    r = stats.paired(x, y)
    ref = scipy_stats.ttest_rel(x, y)
    assert r["t"] == pytest.approx(ref.statistic, rel=1e-10)
    assert r["p"] == pytest.approx(ref.pvalue, rel=1e-9)
    diffs = [a - b for a, b in zip(x, y)]
    assert r["mean_diff"] == pytest.approx(sum(diffs) / 5)
    d = stats.describe(diffs)
    assert (r["ci_low"], r["ci_high"]) == (pytest.approx(d["ci_low"]), pytest.approx(d["ci_high"]))
    assert r["significant"] == (ref.pvalue < 0.05) and r["df"] == 4
    # the CI excludes 0 exactly when p < 0.05
    assert (r["ci_low"] > 0 or r["ci_high"] < 0) == r["significant"]


def test_paired_small_example_by_hand():
    # diffs 0.02, 0.04, 0.03: mean 0.03, std 0.01, t = 0.03 / (0.01 / sqrt 3) = 5.196, df 2
    r = stats.paired({0: 0.85, 1: 0.87, 2: 0.86}, {0: 0.83, 1: 0.83, 2: 0.83})
    assert r["mean_diff"] == pytest.approx(0.03) and r["std_diff"] == pytest.approx(0.01)
    assert r["t"] == pytest.approx(3 * math.sqrt(3))
    assert r["p"] == pytest.approx(2 * scipy_stats.t.sf(3 * math.sqrt(3), 2))  # 0.0351
    assert r["significant"] is True


def test_paired_aligns_by_seed_and_drops_missing():
    r = stats.paired({0: 0.9, 1: 0.8, 2: None, 5: 0.7}, {1: 0.75, 0: 0.85, 2: 0.8, 3: 0.1})
    assert r["keys"] == [0, 1] and r["diffs"] == pytest.approx([0.05, 0.05])
    assert r["t"] == math.inf and r["p"] == 0.0 and r["significant"] is True
    same = stats.paired([0.5, 0.6], [0.5, 0.6])
    assert same["t"] == 0.0 and same["p"] == 1.0 and same["significant"] is False
    one = stats.paired([0.5], [0.4])
    assert one["n"] == 1 and one["p"] is None and one["significant"] is None
    with pytest.raises(ValueError, match="same length"):
        stats.paired([1, 2], [1])


def test_fmt():
    d = stats.describe([0.81, 0.83, 0.82])
    assert stats.fmt_mean_ci(d, 100) == "82.00 ± 1.00"
    assert stats.fmt_mean_ci(d, 100, show="ci") == "82.00 [79.52, 84.48]"
    assert stats.fmt_mean_ci(stats.describe([0.5]), 100) == "50.00"
    assert stats.fmt_mean_ci(stats.describe([]), 100) == "n/a"
