"""The selection ops (order_mean, closest_mean and their _screened forms) on every device: against the
float64 reference (the median's middle value exactly, the means within a bound from the arithmetic),
against NumPy / SciPy (np.median, scipy.stats.trim_mean) and Flower's aggregate functions, shapes,
strides, dtypes, rows subsets, NaN/Inf rows, thread counts, opcheck and bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from test_cuda import NEEDS_CUDA  # tests/test_cuda.py: the cuda cases skip without a GPU and the CUDA build

from fedkernels import ops, reference as ref
from fedkernels.ops.select import median_bounds, trim_bounds


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=NEEDS_CUDA)])
def dev(request) -> str:
    return request.param


DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# (K, d): K = 1, 2, odd and even, the network sizes (<= 256) and the per-column path (> 256); odd d
SHAPES = [
    (1, 1),
    (2, 3),
    (3, 17),
    (4, 33),
    (5, 1000),
    (10, 4099),
    (16, 70),
    (17, 131),
    (33, 257),
    (100, 301),
    (257, 40),
    (300, 37),
]


def _odd(K, d, dtype, seed=0, dev="cpu"):
    """U as a strided view (rows of a wider buffer, from column 1)."""
    big = torch.randn(K, d + 5, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return big.to(dtype).to(dev)[:, 1 : 1 + d]


def _out_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _bound(X64, n, want, out_dtype):
    """|got - want| <= rounding of the result to out_dtype + float64 summation of n values (any order)."""
    u = 2.0**-24 if out_dtype == torch.float32 else 2.0**-53
    A = X64.abs().amax(0) if X64.numel() else torch.zeros(0, dtype=torch.float64)
    return u * want.abs() + 2 * n * 2.0**-53 * A + 1e-300


def _check(got, want, X64, n, dtype):
    assert got.dtype == _out_dtype(dtype) and got.shape == want.shape
    g = got.cpu().double()
    assert torch.equal(g.isnan(), want.isnan())
    fin = ~want.isnan()
    assert torch.all((g[fin] - want[fin]).abs() <= _bound(X64, n, want, _out_dtype(dtype))[fin])


@pytest.mark.parametrize("K,d", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_order_mean_matches_reference(dev, K, d, dtype):
    U = _odd(K, d, dtype, seed=K + d, dev=dev)
    X64 = U.cpu().double()
    for lo, hi in {median_bounds(K), trim_bounds(K, 0.1), trim_bounds(K, 0.25), (0, 1), (K - 1, K), (0, K)}:
        got = ops.order_mean(U, lo, hi)
        want = ref.order_mean(U.cpu(), lo, hi)
        _check(got, want, X64, hi - lo, dtype)
    lo, hi = median_bounds(K)
    if K % 2:  # the median of odd k is its middle value, exactly
        assert torch.equal(
            ops.order_mean(U, lo, hi).cpu(), want_mid := ref.order_mean(U.cpu(), lo, hi).to(_out_dtype(dtype))
        )
        assert torch.equal(want_mid.double(), torch.sort(X64, 0).values[K // 2])


@pytest.mark.parametrize("K", [16, 17])
def test_every_position_of_every_0_1_column(K):
    """All 2^K columns of K zeros and ones, every sorted position and some wide windows, exactly: by the 0-1
    principle the comparator networks that run for them (the pruned network, or the 16-row register sort
    with its keep-min/keep-max merge and one inserted row at K = 17, whichever is cheaper for the window)
    select correctly on every input."""
    cols = torch.arange(1 << K)
    U = ((cols[None, :] >> torch.arange(K)[:, None]) & 1).float()
    want = torch.sort(U, 0).values
    for p in range(K):
        assert torch.equal(ops.order_mean(U, p, p + 1), want[p]), p
    for lo, hi in ((0, K), (3, K - 4), (7, 9), (K - 1, K), (1, K - 1), (2, 13)):
        assert torch.equal(ops.order_mean(U, lo, hi).double(), want[lo:hi].double().mean(0).float().double())


# windows with at most 15 positions below and above them (the window's ends from the 16 smallest and 16
# largest): K around multiples of 16 (the last rows inserted one by one or sorted as a padded block)
EXTREME_KS = [2, 15, 16, 17, 22, 23, 31, 32, 33, 38, 47, 100, 101, 263, 300]


def _extreme_windows(K):
    w = {(0, K), (min(15, K - 1), K), (0, max(1, K - 15)), (K // 2, K // 2 + 1)}
    w |= {trim_bounds(K, 0.1), trim_bounds(K, 0.05)}
    if K > 31:
        w.add((15, K - 15))
    return sorted((lo, hi) for lo, hi in w if 0 <= lo < hi <= K)


@pytest.mark.parametrize("K", EXTREME_KS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_window_ends_with_ties_are_exact(dev, K, dtype):
    """Small integers, so every window has ties at its ends and every sum is exact in float64: the op equals
    the reference bit for bit (each tie count must be right)."""
    g = torch.Generator().manual_seed(K)
    U = torch.randint(-3, 4, (K, 777), generator=g).to(dtype).to(dev)
    for lo, hi in _extreme_windows(K):
        want = ref.order_mean(U.cpu(), lo, hi).to(_out_dtype(dtype))
        assert torch.equal(ops.order_mean(U, lo, hi).cpu(), want), (lo, hi)


@pytest.mark.parametrize("K", [5, 17, 40, 100])
def test_window_ends_at_infinities(dev, K):
    """+-Inf are ordered values: a window that reaches one is +-Inf (NaN if it holds both), as the reference."""
    g = torch.Generator().manual_seed(K)
    U = torch.randn(K, 600, generator=g)
    inf = float("inf")
    for j in range(600):  # per column up to 3 + inf and up to 3 - inf
        n_pos, n_neg = j % 4, (j // 4) % 4
        rows = torch.randperm(K, generator=g)[: n_pos + n_neg]
        U[rows[:n_pos], j] = inf
        U[rows[n_pos:], j] = -inf
    U = U.to(dev)
    X64 = U.cpu().double()
    for lo, hi in _extreme_windows(K) + [(0, 1), (K - 1, K), (2, K - 2)]:
        if not 0 <= lo < hi <= K:
            continue
        got, want = ops.order_mean(U, lo, hi).cpu().double(), ref.order_mean(U.cpu(), lo, hi)
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf()), (lo, hi)
        inf_cols = want.isinf()
        assert torch.equal(got[inf_cols], want[inf_cols])
        fin = torch.isfinite(want)
        Xf = torch.where(torch.isfinite(X64), X64, torch.zeros_like(X64))
        assert torch.all((got[fin] - want[fin]).abs() <= _bound(Xf, hi - lo, want, torch.float32)[fin])


@pytest.mark.parametrize("K,d", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_closest_mean_matches_reference(dev, K, d, dtype):
    U = _odd(K, d, dtype, seed=3 * K + d, dev=dev)
    X64 = U.cpu().double()
    for beta in sorted({1, 2 if K >= 2 else 1, max(1, K - 2), (K + 1) // 2, K}):
        got = ops.closest_mean(U, beta)
        _check(got, ref.closest_mean(U.cpu(), beta), X64, beta, dtype)


def test_closest_mean_selects_like_brute_force():
    """The reference (and the op) take the beta values nearest the median, smaller values first on ties:
    checked on small integer columns full of ties against a per-column Python loop."""
    g = torch.Generator().manual_seed(5)
    for K in (1, 2, 3, 4, 5, 6, 9, 10):
        U = torch.randint(-3, 4, (K, 200), generator=g).float()
        for beta in range(1, K + 1):
            want = []
            for j in range(U.size(1)):
                x = sorted(U[:, j].tolist())
                m = (x[(K - 1) // 2] + x[K // 2]) / 2
                sel = sorted(x, key=lambda v: (abs(v - m), v))[:beta]
                want.append(sum(sel) / beta)
            want = torch.tensor(want, dtype=torch.float64)
            assert torch.equal(ref.closest_mean(U, beta), want)
            assert torch.equal(ops.closest_mean(U, beta), want.float()), (K, beta)


@pytest.mark.parametrize("K", [1, 2, 3, 4, 7, 10, 25, 100])
def test_vs_numpy_and_scipy(dev, K):
    scipy_stats = pytest.importorskip("scipy.stats")
    U = _odd(K, 999, torch.float32, seed=K, dev=dev)
    X = U.cpu().numpy().astype(np.float64)
    med = ops.order_mean(U, *median_bounds(K)).cpu().numpy()
    np.testing.assert_array_equal(med, np.median(X, axis=0).astype(np.float32))  # both round the fp64 median once
    for beta in (0.0, 0.1, 0.2, 0.3, 0.45):
        got = ops.order_mean(U, *trim_bounds(K, beta)).cpu().numpy().astype(np.float64)
        want = scipy_stats.trim_mean(X, beta, axis=0)
        np.testing.assert_allclose(got, want, rtol=2**-23, atol=1e-12)


@pytest.mark.parametrize("K,f", [(7, 1), (10, 1), (11, 2), (15, 3)])
def test_vs_flower(K, f):
    agg = pytest.importorskip("flwr.server.strategy.aggregate")
    U = _odd(K, 513, torch.float32, seed=K + f)
    layers = [U[:, :500].reshape(K, 20, 25), U[:, 500:]]  # two layers, as Flower's NDArrays
    results = [([layers[0][i].numpy().copy(), layers[1][i].numpy().copy()], 10) for i in range(K)]
    flat = lambda nds: np.concatenate([a.ravel() for a in nds])  # noqa: E731
    # coordinate-wise median and trimmed mean: the same values to float32 rounding
    np.testing.assert_allclose(
        ops.order_mean(U, *median_bounds(K)).numpy(), flat(agg.aggregate_median(results)), rtol=2**-23, atol=0
    )
    for beta in (0.1, 0.2, 0.3):
        np.testing.assert_allclose(
            ops.order_mean(U, *trim_bounds(K, beta)).numpy(),
            flat(agg.aggregate_trimmed_avg(results, beta)),
            rtol=2**-22,
            atol=1e-7,
        )
    # Bulyan: its Krum selections, then the beta closest to their median per coordinate
    theta, beta = K - 2 * f, K - 4 * f
    if K >= 4 * f + 3:
        want = flat(agg.aggregate_bulyan(list(results), f, agg.aggregate_krum, to_keep=0))
        D = torch.cdist(U.double(), U.double()) ** 2  # Bulyan's Krum picks, as Flower makes them
        left, picked = list(range(K)), []
        for _ in range(theta):
            n = len(left)
            Dl = D[left][:, left]
            scores = torch.sort(Dl, 1).values[:, 1 : max(1, n - f - 2) + 1].sum(1)
            picked.append(left.pop(int(torch.argmin(scores))))
        got = ops.closest_mean(U, beta, rows=picked).numpy()
        np.testing.assert_allclose(got, want, rtol=2**-21, atol=1e-7)
        # the median of the selected set, as Flower's reference point (not of all K rows)
        assert not np.allclose(got, ops.closest_mean(U, beta).numpy())


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_subset_equals_the_selected_matrix(dev, dtype):
    U = _odd(12, 777, dtype, seed=1, dev=dev)
    rows = [11, 0, 5, 5, 3, 8, 2]  # any order, repeats allowed
    sub = U[rows]
    for lo, hi in ((3, 4), (1, 6), (0, 7)):
        assert torch.equal(ops.order_mean(U, lo, hi, rows=rows), ops.order_mean(sub, lo, hi))
    for beta in (1, 3, 7):
        assert torch.equal(ops.closest_mean(U, beta, rows=torch.tensor(rows)), ops.closest_mean(sub, beta))
    out, ok = ops.order_mean_screened(U, 3, 4, rows=rows)
    assert ok.shape == (7,) and ok.all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K,d", [(1, 1), (5, 3), (12, 1031), (40, 700), (300, 20)])
def test_flags_are_exact_and_nan_columns(dev, K, d, dtype):
    U = _odd(K, d, dtype, seed=K, dev=dev).clone()
    bad = {}
    for k in range(1, K, 2):
        bad[k] = (k * 13) % d
        U[k, bad[k]] = (float("nan"), float("inf"), float("-inf"))[k % 3]
    U[0].fill_(torch.finfo(dtype).max)  # finite, the largest values
    want_ok = [k not in bad for k in range(K)]
    lo, hi = median_bounds(K)
    out, ok = ops.order_mean_screened(U, lo, hi)
    assert ok.tolist() == ref.finite_rows(U.cpu()).tolist() == want_ok
    _check(out, ref.order_mean(U.cpu(), lo, hi), U.cpu().double(), hi - lo, dtype)  # NaN columns as the reference
    cm, ok2 = ops.closest_mean_screened(U, max(1, K // 2))
    assert ok2.tolist() == want_ok
    nonfinite_cols = sorted(set(bad.values()))
    assert torch.isnan(cm.cpu()[nonfinite_cols]).all() if nonfinite_cols else True
    good = [k for k in range(K) if want_ok[k]]  # dropping the flagged rows: all finite
    assert torch.isfinite(ops.order_mean(U, *median_bounds(len(good)), rows=good).cpu()[1:]).all()


def test_nan_and_inf_rules():
    nan, inf = float("nan"), float("inf")
    U = torch.tensor([[1.0, nan, inf, inf, 1.0], [2.0, 1.0, 2.0, -inf, 2.0], [3.0, 2.0, 3.0, 5.0, inf]])
    assert ops.order_mean(U, 1, 2).tolist()[:1] == [2.0]
    med = ops.order_mean(U, 1, 2)
    assert math.isnan(med[1]) and med[2] == 3.0 and med[3] == 5.0 and med[4] == 2.0  # NaN propagates; Inf is ordered
    assert ops.order_mean(U, 0, 3)[2] == inf and math.isnan(ops.order_mean(U, 0, 3)[3])
    cm = ops.closest_mean(U, 2)
    assert cm[0] == 1.5 and all(math.isnan(v) for v in cm[1:].tolist())  # NaN/Inf columns: NaN


@pytest.mark.parametrize("K,d", [(10, 100_000), (100, 7000), (300, 500)])
def test_same_bits_with_1_and_2_threads(K, d):
    U = _odd(K, d, torch.float32, seed=3)
    n0 = torch.get_num_threads()
    out = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out.append(
                (
                    ops.order_mean_screened(U, *median_bounds(K)),
                    ops.order_mean(U, *trim_bounds(K, 0.2)),
                    ops.order_mean(U, *trim_bounds(K, 0.1)),
                    ops.closest_mean_screened(U, K // 2),
                )
            )
    finally:
        torch.set_num_threads(n0)
    for a, b in zip(out[0], out[1]):
        a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_zero_columns_and_one_row(dev):
    out, ok = ops.order_mean_screened(torch.zeros(3, 0, device=dev), 1, 2)
    assert out.shape == (0,) and ok.tolist() == [True] * 3
    U = _odd(1, 50, torch.float32, dev=dev)
    assert torch.equal(ops.order_mean(U, 0, 1), U[0]) and torch.equal(ops.closest_mean(U, 1), U[0])


def test_bad_inputs_are_one_line_value_errors():
    U = torch.randn(10, 20)
    cases = [
        (lambda: ops.order_mean(U, 3, 3), r"order_mean: hi must be in \(lo, k\] = \(3, 10\]"),
        (lambda: ops.order_mean(U, 4, 11), r"hi must be in \(lo, k\] = \(4, 10\].*got hi=11"),
        (lambda: ops.order_mean(U, -1, 2), r"lo must be in \[0, k\) = \[0, 10\).*got lo=-1"),
        (lambda: ops.order_mean(U, 0, 3, rows=[1, 2]), r"hi must be in \(lo, k\] = \(0, 2\]"),
        (lambda: ops.order_mean(U, 1.0, 3), r"order_mean: lo must be an int, got 1.0"),
        (lambda: ops.order_mean(U, True, 3), r"lo must be an int"),
        (lambda: ops.closest_mean(U, 11), r"closest_mean: beta must be in \[1, k\] = \[1, 10\].*got beta=11"),
        (lambda: ops.closest_mean(U, 0), r"beta must be in \[1, k\]"),
        (lambda: ops.closest_mean_screened(U, 2, rows=[0, 10]), r"closest_mean_screened: rows must lie in \[0, 10\)"),
        (lambda: ops.order_mean(torch.randn(10), 0, 1), r"order_mean: U must be a 2-D"),
        (lambda: ops.order_mean(torch.ones(3, 3, dtype=torch.int64), 0, 1), r"floating dtype"),
        (lambda: ops.order_mean(torch.randn(0, 4), 0, 1), r"lo must be in \[0, k\) = \[0, 0\)"),
    ]
    for call, msg in cases:
        with pytest.raises(ValueError, match=msg) as e:
            call()
        assert "\n" not in str(e.value)


# ---- U's and rows' shapes, dtypes and layout: checked once, by the native op, for the wrappers and a direct call
FLOATING = "must have a floating dtype (float16, bfloat16, float32, float64)"
BAD_TENSOR_ARGS = [  # (U on dev, rows (host), the whole message after "<op>: ")
    (lambda dev: torch.zeros(7, device=dev), None, "U must be a 2-D [K, d] tensor, got shape (7,)"),
    (lambda dev: torch.zeros(2, 3, 4, device=dev), None, "U must be a 2-D [K, d] tensor, got shape (2, 3, 4)"),
    (lambda dev: torch.zeros(9, device=dev), torch.tensor([0, 5]), "U must be a 2-D [K, d] tensor, got shape (9,)"),
    (lambda dev: torch.zeros(3, 4, dtype=torch.int64, device=dev), None, f"U {FLOATING}, got torch.int64"),
    (lambda dev: torch.zeros(3, 4, dtype=torch.bool, device=dev)[:, ::2], None, f"U {FLOATING}, got torch.bool"),
    (
        lambda dev: torch.zeros(3, 4, device=dev),
        torch.tensor([[0, 1, 2]]),
        "rows must be a 1-D sequence of row indices, got shape (1, 3)",
    ),
    (
        lambda dev: torch.zeros(3, 4, device=dev),
        torch.tensor([0.0, 2.0]),
        "rows must hold integer row indices, got dtype torch.float32",
    ),
    (
        lambda dev: torch.zeros(3, 4, device=dev),
        torch.tensor([True]),
        "rows must hold integer row indices, got dtype torch.bool",
    ),
]
SELECT_CALLS = [  # (the wrapper, the native op, their int arguments: valid for every U above)
    ("order_mean", "order_mean", (0, 1)),
    ("order_mean_screened", "order_mean", (0, 1)),
    ("closest_mean", "closest_mean", (1,)),
    ("closest_mean_screened", "closest_mean", (1,)),
]


@pytest.mark.parametrize("op,native,ints", SELECT_CALLS)
@pytest.mark.parametrize("case", range(len(BAD_TENSOR_ARGS)))
def test_bad_tensor_args_same_from_wrapper_and_native(dev, case, op, native, ints):
    make, rows, msg = BAD_TENSOR_ARGS[case]
    U = make(dev)
    wrapper, raw = getattr(ops, op), getattr(torch.ops.fedkernels, native)
    for name, call in ((op, lambda: wrapper(U, *ints, rows=rows)), (native, lambda: raw(U, *ints, rows))):
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value) == f"{name}: {msg}"  # one line, the same words (each under its own op's name)


def test_compiled_bad_U_raises_the_native_error():
    """Under torch.compile the fake kernel does not stop tracing on a 1-D U; the native op refuses it."""
    torch._dynamo.reset()
    f = torch.compile(lambda U: ops.order_mean(U, 0, 1), fullgraph=True)
    with pytest.raises(ValueError, match=r"^order_mean: U must be a 2-D \[K, d\] tensor, got shape \(5,\)$"):
        f(torch.zeros(5))


def test_screened_forms_ask_for_the_native_ops_kernel(monkeypatch):
    """order_mean_screened / closest_mean_screened call the native order_mean / closest_mean: the build
    must have a kernel for those (there is no fedkernels::order_mean_screened to ask about)."""
    import importlib

    select_mod = importlib.import_module("fedkernels.ops.select")
    asked = []
    real = select_mod._needs_kernel
    monkeypatch.setattr(select_mod, "_needs_kernel", lambda native, *a: asked.append(native) or real(native, *a))
    U = torch.randn(5, 3)
    ops.order_mean_screened(U, 1, 3)
    ops.closest_mean_screened(U, 2)
    assert asked == ["order_mean", "closest_mean"]


def test_a_shape_error_is_not_reported_as_a_range_error():
    """lo, hi, beta and rows are range-checked against k only when U and rows have the right shape."""
    with pytest.raises(ValueError, match=r"^order_mean: U must be a 2-D \[K, d\] tensor, got shape \(2, 5, 4\)$"):
        ops.order_mean(torch.zeros(2, 5, 4), 0, 3, rows=[4])  # k would be 2 (rows: 1), rows would be out of range
    with pytest.raises(ValueError, match=r"^closest_mean_screened: rows must be a 1-D sequence of row indices"):
        ops.closest_mean_screened(torch.zeros(4, 3), 3, rows=[[0, 1]])  # beta = 3 > the 2 entries


def test_the_native_ops_refuse_a_matrix_without_unit_column_stride():
    """The wrappers copy such a U once; a direct call must pass one the kernel reads."""
    U = torch.randn(5, 8, dtype=torch.float64)[:, ::2]
    assert torch.equal(ops.order_mean(U, 1, 4), ops.order_mean(U.contiguous(), 1, 4))
    for fn, ints in ((torch.ops.fedkernels.order_mean, (1, 4)), (torch.ops.fedkernels.closest_mean, (2,))):
        with pytest.raises(ValueError, match=r"U must have unit column stride, got strides \(8, 2\) \(the") as e:
            fn(U, *ints, None)
        assert "\n" not in str(e.value)


def test_no_derivative():
    U = torch.randn(5, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="fedkernels.order_mean has no derivative"):
        ops.order_mean(U, 2, 3).sum().backward()
    with pytest.raises(RuntimeError, match="fedkernels.closest_mean has no derivative"):
        ops.closest_mean(U, 2).sum().backward()


def test_opcheck():
    U = torch.randn(7, 300)
    rows = torch.tensor([0, 2, 3, 6])
    for args in ((U, 3, 4, None), (U, 1, 3, rows), (U.double(), 0, 7, None)):
        torch.library.opcheck(
            torch.ops.fedkernels.order_mean.default, args, test_utils=("test_schema", "test_faketensor")
        )
    for args in ((U, 3, None), (U.half(), 2, rows)):
        torch.library.opcheck(
            torch.ops.fedkernels.closest_mean.default, args, test_utils=("test_schema", "test_faketensor")
        )


def test_sharded_ands_the_flags():
    class TwoShards:
        def __init__(self, other):
            self.other = other

        def all_reduce_sum(self, t):
            return t

        def all_reduce_max(self, t):
            return t

        def all_reduce_and(self, m):
            return m & self.other

    U = _odd(6, 40, torch.float32)
    other = torch.tensor([True, True, False, True, True, True])
    with ops.reduce_across(TwoShards(other)):
        out, ok = ops.order_mean_screened(U, 2, 4)
    assert ok.tolist() == other.tolist() and torch.equal(out, ops.order_mean(U, 2, 4))
