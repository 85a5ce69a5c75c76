"""weighted_sum: the native op against the float64 reference (shapes, rows, out=, layouts, bad inputs)."""

import math
import re

import pytest
import torch
from torch.testing import assert_close

from fedkernels import ops, reference as ref
from devices import (
    DEV,
    DEVICES,
    FLOATS,
    cuda_only,
    gen,
    one_line,
    randn,
    settle,
)  # tests/devices.py: every case on cpu and cuda
import host_harness  # tests/host_harness.py: the CUDA kernels' per-thread logic on the host
from host_harness import hexf

SHAPES = [(1, 1), (2, 3), (3, 17), (5, 1000), (7, 4099), (16, 2048 * 3 + 5), (33, 257), (10, 70001)]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _tol(dtype):
    return {
        torch.float64: (1e-12, 1e-12),
        torch.float32: (1e-5, 1e-5),
        torch.bfloat16: (2e-2, 2e-2),
        torch.float16: (2e-3, 2e-3),
    }[dtype]


# ---- weighted_sum --------------------------------------------------------------------------------
@pytest.mark.parametrize("K,d", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_weighted_sum_matches_reference(K, d, dtype):
    U = torch.randn(K, d, dtype=torch.float64).to(dtype)
    coef = torch.rand(K, dtype=torch.float64)
    base = torch.randn(d, dtype=torch.float64).to(dtype)
    rtol, atol = _tol(dtype)
    out = ops.weighted_sum(U, coef, base=base, alpha=-0.7)
    assert out.dtype == dtype and out.shape == (d,)
    assert_close(out.double(), ref.weighted_sum(U, coef, base, -0.7), rtol=rtol, atol=atol * K)
    assert_close(ops.weighted_sum(U, coef).double(), ref.weighted_sum(U, coef), rtol=rtol, atol=atol * K)


def test_weighted_sum_rows_out_and_inplace():
    U = torch.randn(10, 5003, dtype=torch.float64)
    rows = [9, 2, 2, 5]
    coef = [0.5, -1.0, 0.25, 2.0]
    base = torch.randn(5003, dtype=torch.float64)
    expect = ref.weighted_sum(U, coef, base, 0.3, rows)
    assert_close(ops.weighted_sum(U, coef, base, 0.3, rows=rows), expect, rtol=1e-13, atol=1e-13)
    out = torch.empty(5003, dtype=torch.float64)
    r = ops.weighted_sum(U, torch.tensor(coef), base, 0.3, rows=torch.tensor(rows), out=out)
    assert r is out
    assert_close(out, expect, rtol=1e-13, atol=1e-13)
    # out aliasing base: in-place apply
    b2 = base.clone()
    ops.weighted_sum(U, coef, b2, 0.3, rows=rows, out=b2)
    assert_close(b2, expect, rtol=1e-13, atol=1e-13)


def test_weighted_sum_noncontiguous():
    big = torch.randn(8, 2 * 4001, dtype=torch.float64)
    U = big[:, ::2]  # column stride 2 -> copied once
    Uc = big[:, 1000:5001]  # column chunk view -> no copy
    Ut = torch.randn(4001, 8, dtype=torch.float64).T
    base = torch.randn(2 * 4001, dtype=torch.float64)[::2]  # non-contiguous base
    c = torch.rand(8, dtype=torch.float64)
    for M in (U, Uc, Ut):
        assert_close(ops.weighted_sum(M, c, base), ref.weighted_sum(M, c, base), rtol=1e-13, atol=1e-13)


def test_weighted_sum_deterministic_and_nan_propagates():
    U = torch.randn(20, 100_003)
    c = torch.rand(20, dtype=torch.float64)
    assert torch.equal(ops.weighted_sum(U, c), ops.weighted_sum(U, c))
    U[3, 17] = float("nan")
    out = ops.weighted_sum(U, c)
    assert torch.isnan(out[17]) and torch.isfinite(out[:17]).all() and torch.isfinite(out[18:]).all()
    # a NaN row that is not selected does not touch the result
    assert torch.isfinite(ops.weighted_sum(U, [1.0, 1.0], rows=[0, 1])).all()


def test_weighted_sum_empty_rows_gives_base():
    U = torch.randn(3, 11)
    b = torch.randn(11)
    assert torch.equal(ops.weighted_sum(U, [], base=b, rows=[]), b)
    assert torch.equal(ops.weighted_sum(torch.zeros(0, 11), [], base=b), b)


def test_weighted_sum_bad_inputs_name_the_argument():
    U = torch.randn(4, 10)
    with pytest.raises(ValueError, match="coef must be a 1-D tensor of length 4"):
        ops.weighted_sum(U, [1.0, 2.0])
    with pytest.raises(ValueError, match="coef must be finite"):
        ops.weighted_sum(U, [1.0, float("nan"), 0.0, 0.0])
    with pytest.raises(ValueError, match="base must be a 1-D tensor of length 10"):
        ops.weighted_sum(U, [1.0] * 4, base=torch.zeros(9))
    with pytest.raises(ValueError, match="base must have dtype"):
        ops.weighted_sum(U, [1.0] * 4, base=torch.zeros(10, dtype=torch.float64))
    with pytest.raises(ValueError, match="out must be"):
        ops.weighted_sum(U, [1.0] * 4, out=torch.zeros(11))
    with pytest.raises(ValueError, match="alpha must be a finite"):
        ops.weighted_sum(U, [1.0] * 4, alpha=float("inf"))
    with pytest.raises(ValueError, match="U is on"):
        ops.weighted_sum(U, [1.0] * 4, base=torch.zeros(10, device="meta"))


# ---- one list of samples drives correctness, gradients and opcheck on every device (pytorch/extension-cpp) ----
def sample_inputs(dev, *, requires_grad=False):
    """Arguments of torch.ops.fedkernels.weighted_sum (U, coef, base, alpha, rows): one element; float32 with a
    base; a float64 column chunk of a wider buffer (row stride d + 3, unaligned) with a row subset that repeats
    a row (rows on the device). coef is float64 on the device (host coefficients: the cuda-only cases)."""

    def t(*shape, dtype, seed):
        return randn(dev, *shape, dtype=dtype, seed=seed).requires_grad_(requires_grad)

    def U(K, d, dtype, seed):
        return randn(dev, K, d + 3, dtype=dtype, seed=seed)[:, 1 : 1 + d].requires_grad_(requires_grad)

    return [
        [U(1, 1, torch.float64, 1), t(1, dtype=torch.float64, seed=2), None, 1.0, None],
        [
            U(5, 300, torch.float32, 3),
            t(5, dtype=torch.float64, seed=4),
            t(300, dtype=torch.float32, seed=5),
            0.5,
            None,
        ],
        [
            U(6, 257, torch.float64, 6),
            t(4, dtype=torch.float64, seed=7),
            None,
            -1.3,
            torch.tensor([5, 0, 0, 2], device=dev),
        ],
    ]


def _sample_tol(U):
    """float32: the sum is accumulated in float and rounded to float (2^-24 relative per step)."""
    return (1e-12, 1e-12) if U.dtype == torch.float64 else (1e-5, 1e-5)


@pytest.mark.parametrize("dev", DEVICES)
def test_weighted_sum_samples_match_reference(dev):
    for U, coef, base, alpha, rows in sample_inputs(dev):
        got = torch.ops.fedkernels.weighted_sum(U, coef, base, alpha, rows)
        assert got.dtype == U.dtype and got.device == U.device
        rtol, atol = _sample_tol(U)
        assert_close(got.double(), ref.weighted_sum(U, coef, base, alpha, rows), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dev", DEVICES)
def test_weighted_sum_samples_gradients_match_reference(dev):
    for U, coef, base, alpha, rows in sample_inputs(dev, requires_grad=True):
        w = randn(dev, U.shape[1], dtype=torch.float64, seed=8)
        inputs = [x for x in (U, coef, base) if x is not None]
        got = torch.autograd.grad(
            (ops.weighted_sum(U, coef, base=base, alpha=alpha, rows=rows).double() * w).sum(), inputs
        )
        want = torch.autograd.grad((ref.weighted_sum(U, coef, base, alpha, rows) * w).sum(), inputs)
        rtol, atol = _sample_tol(U)
        for g, r, x in zip(got, want, inputs):
            assert g.dtype == x.dtype and g.device == x.device
            assert_close(g, r, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dev", DEVICES)
def test_weighted_sum_opcheck(dev):  # with requires_grad (the autograd checks): tests/test_autograd.py
    for args in sample_inputs(dev):
        torch.library.opcheck(torch.ops.fedkernels.weighted_sum.default, tuple(args))
    U, coef, base, alpha, rows = sample_inputs(dev)[1]
    torch.library.opcheck(
        torch.ops.fedkernels.weighted_sum_out.default, (U, coef, base, alpha, rows, torch.empty(U.shape[1], device=dev))
    )


def test_weighted_sum_coefficients_beyond_float_range():
    # lam / ||m|| for a denormal m: coef 1e40 does not fit in fp32, the products do
    U = torch.full((2, 5), 1e-40)
    out = ops.weighted_sum(U, [1e40, 1e40])
    assert_close(out.double(), ref.weighted_sum(U, [1e40, 1e40]), rtol=1e-5, atol=1e-6)
    assert torch.isfinite(out).all()


def test_rows_and_coef_are_checked_and_passed_on_the_host(monkeypatch):
    """The native op gets host (CPU) int64 rows and host coefficients, whatever their type."""
    from fedkernels.ops import _checks

    r = _checks._rows(torch.tensor([2, 0], dtype=torch.int32), 3, "weighted_sum")
    assert r.device.type == "cpu" and r.dtype == torch.int64 and r.is_contiguous()
    c = _checks._coef([0.5, 1.5], 2, "weighted_sum")
    assert c.device.type == "cpu" and c.dtype == torch.float64
    seen = {}
    real = torch.ops.fedkernels.weighted_sum

    class Spy:
        def __call__(self, U, coef, base, alpha, rows):
            seen.update(coef=coef.device, rows=rows.device)
            return real(U, coef, base, alpha, rows)

    monkeypatch.setattr(torch.ops.fedkernels, "weighted_sum", Spy())
    U = torch.randn(3, 8)
    out = ops.weighted_sum(U, torch.tensor([1.0, 2.0]), rows=torch.tensor([2, 0]))
    assert seen == {"coef": torch.device("cpu"), "rows": torch.device("cpu")}
    assert_close(out.double(), ref.weighted_sum(U, [1.0, 2.0], rows=[2, 0]), rtol=1e-6, atol=1e-6)


def test_bad_rows_rejected_on_the_host_for_every_index_type():
    U = torch.randn(4, 10)
    for rows in ([0, 4], [-1], torch.tensor([5]), torch.tensor([0, 7], dtype=torch.int32)):
        with pytest.raises(ValueError, match=r"rows must lie in \[0, 4\)"):
            ops.weighted_sum(U, [1.0] * len(rows), rows=rows)
        with pytest.raises(ValueError, match=r"rows must lie in \[0, 4\)"):
            ops.gram(U, rows=rows)
    with pytest.raises(ValueError, match="rows must hold integer"):
        ops.weighted_sum(U, [1.0], rows=[True])


def test_a_device_without_a_kernel_gives_one_clear_error():
    from fedkernels.ops._checks import _needs_kernel

    _needs_kernel("weighted_sum", torch.device("cpu"), "weighted_sum")  # CPU: always there
    for native in ("weighted_sum", "gram", "arrowhead_solve", "fused_sgd_step_"):
        if torch._C._dispatch_has_kernel_for_dispatch_key(f"fedkernels::{native}", "CUDA"):
            _needs_kernel(native, torch.device("cuda"), native)
        else:
            with pytest.raises(ValueError, match=f"no cuda kernel for fedkernels::{native}"):
                _needs_kernel(native, torch.device("cuda"), native)


# ---- weighted_sum_screened: the sum and the rows' finite flags from one pass ---------------------
@pytest.mark.parametrize("K,d", [(1, 1), (3, 7), (9, 8193), (17, 20000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_weighted_sum_screened_matches_reference(K, d, dtype):
    from fedkernels import reference

    g = torch.Generator().manual_seed(K * 31 + d)
    big = torch.randn(K, d + 5, generator=g).to(dtype)
    U = big[:, 2 : 2 + d]  # unit column stride, row stride d + 5
    bad = {k for k in range(K) if k % 3 == 1}
    for k in bad:  # NaN / +Inf / -Inf at odd places
        U[k, (k * 7919) % d] = (float("nan"), float("inf"), float("-inf"))[k % 3]
    coef = torch.rand(K, generator=g, dtype=torch.float64)
    base = torch.randn(d, generator=g).to(dtype)
    out, ok = ops.weighted_sum_screened(U, coef, base=base, alpha=0.5)
    ref_out, ref_ok = reference.weighted_sum_screened(U, coef, base=base, alpha=0.5)
    assert ok.dtype == torch.bool and ok.tolist() == ref_ok.tolist() == [k not in bad for k in range(K)]
    plain = ops.weighted_sum(U, coef, base=base, alpha=0.5)
    assert torch.equal(out.isnan(), plain.isnan())
    torch.testing.assert_close(out, plain, equal_nan=True, rtol=0, atol=0)  # the same bits as weighted_sum
    fin = torch.isfinite(ref_out)
    torch.testing.assert_close(
        out[fin].double(), ref_out[fin].double(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5
    )


def test_weighted_sum_screened_rows_and_overflow():
    """Flags follow ``rows``; finite rows whose fp32 sum overflows are still finite (exact flags)."""
    U = torch.full((4, 300), 3e38)
    U[2, 5] = float("nan")
    out, ok = ops.weighted_sum_screened(U, [1.0, 1.0, 1.0], rows=[3, 2, 0])
    assert ok.tolist() == [True, False, True]
    assert not torch.isfinite(out).all()
    _, ok = ops.weighted_sum_screened(U, [1.0, 1.0], rows=[0, 1])
    assert ok.tolist() == [True, True]  # overflowed sum, finite rows
    _, ok = ops.weighted_sum_screened(U[:, :0], [1.0] * 4)  # d = 0: every row is finite
    assert ok.tolist() == [True] * 4


def test_weighted_sum_screened_bad_args():
    U = torch.randn(3, 5)
    with pytest.raises(ValueError, match="coef"):
        ops.weighted_sum_screened(U, [1.0, 2.0])
    with pytest.raises(ValueError, match="rows"):
        ops.weighted_sum_screened(U, [1.0], rows=[3])


@pytest.mark.parametrize(
    "K,d,dtype", [(1, 1, torch.float32), (3, 7, torch.float64), (9, 8193, torch.float32), (5, 4099, torch.bfloat16)]
)
def test_weighted_sum_screened_out_writes_the_same_bits_into_out(K, d, dtype):
    """``out=``: the sum written into the caller's tensor (returned as it is), the flags as without out;
    U with a row stride > d, rows selected, out aliasing base (in-place apply)."""
    g = torch.Generator().manual_seed(K + d)
    U = torch.randn(K, d + 3, generator=g).to(dtype)[:, 1 : 1 + d]
    if K > 1:
        U[1, d // 2] = float("inf")
    coef = torch.rand(K, generator=g, dtype=torch.float64)
    base = torch.randn(d, generator=g).to(dtype)
    want, want_ok = ops.weighted_sum_screened(U, coef, base=base, alpha=-0.3)
    out = torch.full((d,), 7.0, dtype=dtype)
    got, ok = ops.weighted_sum_screened(U, coef, base=base, alpha=-0.3, out=out)
    assert got is out and ok.tolist() == want_ok.tolist() == [k != 1 for k in range(K)]
    torch.testing.assert_close(out, want, equal_nan=True, rtol=0, atol=0)
    rows = [K - 1, 0, K - 1]
    b2 = base.clone()
    got, ok = ops.weighted_sum_screened(U, [0.5, -1.0, 2.0], base=b2, alpha=0.7, rows=rows, out=b2)
    assert got is b2 and ok.tolist() == [K - 1 != 1, True, K - 1 != 1]
    torch.testing.assert_close(
        b2, ops.weighted_sum(U, [0.5, -1.0, 2.0], base=base, alpha=0.7, rows=rows), equal_nan=True, rtol=0, atol=0
    )
    fin = torch.isfinite(b2)
    torch.testing.assert_close(
        b2[fin].double(),
        ref.weighted_sum(U, [0.5, -1.0, 2.0], base, 0.7, rows)[fin],
        rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
        atol=1e-5,
    )


def test_weighted_sum_screened_out_bad_out_names_the_argument():
    U = torch.randn(4, 10)
    c = [1.0] * 4
    with pytest.raises(
        ValueError, match=r"weighted_sum_screened: out must be a 1-D tensor of length 10, got shape \(11,\)"
    ):
        ops.weighted_sum_screened(U, c, out=torch.zeros(11))
    with pytest.raises(
        ValueError,
        match=r"weighted_sum_screened: out must have dtype torch.float32 \(the dtype of U\), "
        r"got torch.float64",
    ):
        ops.weighted_sum_screened(U, c, out=torch.zeros(10, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"weighted_sum_screened: out is on meta but U is on cpu"):
        ops.weighted_sum_screened(U, c, out=torch.zeros(10, device="meta"))
    with pytest.raises(ValueError, match=r"weighted_sum_screened: out must be contiguous"):
        ops.weighted_sum_screened(U, c, out=torch.zeros(20)[::2])
    with pytest.raises(TypeError, match=r"weighted_sum_screened: out must be a torch.Tensor"):
        ops.weighted_sum_screened(U, c, out=[0.0] * 10)


@pytest.mark.parametrize("dev", DEVICES)
def test_weighted_sum_screened_out_opcheck(dev):
    U = torch.randn(5, 300)
    U[3, 7] = float("nan")
    U = U.to(dev)
    c = torch.rand(5, dtype=torch.float64).to(dev)
    b = torch.randn(300).to(dev)
    torch.library.opcheck(
        torch.ops.fedkernels.weighted_sum_screened_out.default, (U, c, b, 0.5, None, torch.empty(300, device=dev))
    )
    torch.library.opcheck(
        torch.ops.fedkernels.weighted_sum_screened_out.default,
        (U, c[:2], None, 1.0, torch.tensor([4, 3], device=dev), torch.empty(300, device=dev)),
    )


def test_a_screened_source_block_is_summed_straight_into_its_output_slice(monkeypatch):
    """sources.weighted_sum_block's screened path hands its destination slice to the op as ``out``
    (no block-sized temporary and copy), with the bits and flags of the plain op."""
    from fedkernels import sources

    seen = []
    real = ops.weighted_sum_screened

    def spy(*a, **kw):
        seen.append(kw.get("out"))
        return real(*a, **kw)

    monkeypatch.setattr(ops, "weighted_sum_screened", spy)
    U = torch.randn(6, 1000)
    U[4, 999] = float("nan")
    coef = torch.rand(6, dtype=torch.float64)
    base = torch.randn(1000)
    full = torch.zeros(3000)
    dst = full[1000:2000]
    ok = sources.weighted_sum_block(U, coef, base, 0.5, dst, screen=True)
    assert len(seen) == 1 and seen[0] is dst
    assert ok.tolist() == [True] * 4 + [False, True]
    torch.testing.assert_close(dst, ops.weighted_sum(U, coef, base=base, alpha=0.5), equal_nan=True, rtol=0, atol=0)
    assert not full[:1000].any() and not full[2000:].any()


def test_alpha_scales_the_coefficients_like_the_oracle():
    # alpha is folded into the coefficients (kernel header): alpha = 0 gives base even where the plain
    # fp64 sum overflows; the float64 oracle does the same (it gave 0 * inf = NaN before; a fuzz case found it)
    U = torch.full((3, 5), 1e308, dtype=torch.float64)
    c = torch.ones(3, dtype=torch.float64)
    base = torch.arange(5.0, dtype=torch.float64)
    for f in (ops.weighted_sum, ref.weighted_sum):
        assert torch.equal(f(U, c, base=base, alpha=0.0), base)
        assert torch.isinf(f(U, c, base=base, alpha=1.0)).all()


# ---- on every device (cpu, and cuda where there is one: tests/devices.py) --------------------
def _wsum_tol(dtype):
    return {
        torch.float64: (1e-12, 1e-12),
        torch.float32: (1e-5, 1e-5),
        torch.float16: (1e-2, 1e-2),
        torch.bfloat16: (2e-2, 2e-2),
    }[dtype]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("K,d", [(1, 1), (3, 5), (10, 4099), (7, 1024), (300, 257)])
def test_weighted_sum_matches_reference_on_every_device(dev, K, d, dtype):
    U = randn(dev, K, d, dtype=dtype, seed=K + d)
    coef = torch.randn(K, generator=gen(1), dtype=torch.float64).to(dev)
    base = randn(dev, d, dtype=dtype, seed=5)
    out = ops.weighted_sum(U, coef, base=base, alpha=0.7)
    want = ref.weighted_sum(U, coef, base=base, alpha=0.7)
    rtol, atol = _wsum_tol(dtype)
    torch.testing.assert_close(out.double(), want, rtol=rtol, atol=atol * max(1.0, float(K) ** 0.5))
    torch.testing.assert_close(
        out.cpu().double(),
        ops.weighted_sum(U.cpu(), coef.cpu(), base=base.cpu(), alpha=0.7).double(),
        rtol=rtol,
        atol=atol * max(1.0, float(K) ** 0.5),
    )


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_weighted_sum_rows_inplace_unaligned(dev, dtype):
    K, d = 9, 5001
    big = randn(dev, K, d + 3, dtype=dtype, seed=2)
    U = big[:, 1 : 1 + d]  # unaligned rows: scalar path
    rows = torch.tensor([8, 1, 1, 4], device=dev)
    coef = torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=torch.float64, device=dev)
    w = randn(dev, d, dtype=dtype, seed=4)
    want = ref.weighted_sum(U, coef, base=w, alpha=-2.0, rows=rows)
    got = ops.weighted_sum(U, coef, base=w, alpha=-2.0, rows=rows, out=w)  # in place
    assert got.data_ptr() == w.data_ptr()
    rtol, atol = _wsum_tol(dtype)
    torch.testing.assert_close(w.double(), want, rtol=rtol, atol=atol * 4)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("K,d,off", [(1, 1, 0), (5, 4099, 0), (9, 5001, 1), (300, 257, 0)])
def test_weighted_sum_screened_flags_and_bits(dev, K, d, off, dtype):
    """The flags equal the reference's on aligned (vector) and unaligned (scalar) rows, with NaN,
    +-Inf and an fp32-overflowing finite row; the sum is weighted_sum's, bit for bit."""
    big = randn(dev, K, d + 2, dtype=dtype, seed=K + d)
    U = big[:, off : off + d]
    bad = [k for k in range(K) if k % 4 == 1]
    for k in bad:
        U[k, (k * 7919) % d] = (float("nan"), float("inf"), float("-inf"))[k % 3]
    if K > 2 and dtype != torch.float64:
        U[K - 1].fill_(torch.finfo(dtype).max)  # finite, its sum overflows: still finite
    rows = torch.arange(K - 1, -1, -1, device=dev)
    coef = torch.rand(K, generator=gen(3), dtype=torch.float64).to(dev)
    base = randn(dev, d, dtype=dtype, seed=6)
    out, ok = ops.weighted_sum_screened(U, coef, base=base, alpha=0.5, rows=rows)
    _, want = ref.weighted_sum_screened(U, coef, base=base, alpha=0.5, rows=rows)
    assert ok.device == U.device and ok.cpu().tolist() == want.cpu().tolist()
    plain = ops.weighted_sum(U, coef, base=base, alpha=0.5, rows=rows)
    assert torch.equal(out.isnan(), plain.isnan()) and torch.equal(out.nan_to_num(), plain.nan_to_num())
    into = base.clone()  # out= (here base itself: in place), same bits and flags
    got, ok = ops.weighted_sum_screened(U, coef, base=into, alpha=0.5, rows=rows, out=into)
    assert got is into and ok.cpu().tolist() == want.cpu().tolist()
    assert torch.equal(into.isnan(), plain.isnan()) and torch.equal(into.nan_to_num(), plain.nan_to_num())


@pytest.mark.parametrize("dev", DEVICES)
def test_weighted_sum_nan_propagates(dev):
    U = randn(dev, 4, 300, seed=9)
    U[2, 17] = float("nan")
    out = ops.weighted_sum(U, torch.ones(4, dtype=torch.float64, device=dev))
    assert torch.isnan(out[17]) and torch.isfinite(out[:17]).all() and torch.isfinite(out[18:]).all()


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("on_device", [False, True])
def test_weighted_sum_coef_beyond_float_matches_cpu(dev, dtype, on_device):
    U = randn(dev, 3, 2051, dtype=dtype, seed=24)
    coef = torch.tensor([1e39, -1e39, 1e-3], dtype=torch.float64)
    got = torch.ops.fedkernels.weighted_sum(U, coef.to(dev) if on_device else coef, None, 1.0, None)
    want = torch.ops.fedkernels.weighted_sum(U.cpu(), coef, None, 1.0, None)
    assert torch.isfinite(got.double()).sum() == torch.isfinite(want.double()).sum()
    torch.testing.assert_close(got.cpu(), want, rtol=2e-2, atol=2e-2, equal_nan=True)


@cuda_only
def test_host_coef_and_rows_match_device_ones():
    K, d = 12, 3001
    U = randn(DEV, K, d, seed=21)
    coef = torch.randn(5, generator=gen(22), dtype=torch.float64)
    rows = torch.tensor([11, 0, 3, 3, 7])
    a = torch.ops.fedkernels.weighted_sum(U, coef, None, 0.5, rows)  # host coef and rows
    b = torch.ops.fedkernels.weighted_sum(U, coef.to(DEV), None, 0.5, rows.to(DEV))
    assert torch.equal(a, b)
    assert torch.equal(torch.ops.fedkernels.gram(U, rows), torch.ops.fedkernels.gram(U, rows.to(DEV)))
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.fedkernels.gram(U, torch.tensor([0, K]))  # host rows: checked


@cuda_only
def test_device_rows_out_of_range_give_nan_not_a_device_assert():
    U = randn(DEV, 6, 700, seed=23)
    bad = torch.tensor([0, 6, 2], device=DEV)
    out = torch.ops.fedkernels.weighted_sum(U, torch.ones(3, dtype=torch.float64, device=DEV), None, 1.0, bad)
    G = torch.ops.fedkernels.gram(U, bad)
    torch.cuda.synchronize()  # the context survives
    assert torch.isnan(out).all() and torch.isnan(G[1]).all() and torch.isfinite(G[0]).all()
    assert torch.isfinite(ops.gram(U)).all()


@pytest.mark.parametrize("dev", DEVICES)
def test_bad_args_weighted_sum(dev):
    U, coef, base = randn(dev, 4, 301, seed=51), torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=torch.float64), None
    F = torch.ops.fedkernels
    one_line(
        ValueError,
        r"weighted_sum: coef must be a 1-D tensor of length 4 .*got shape \(3,\)",
        ops.weighted_sum,
        U,
        coef[:3],
    )
    one_line(
        ValueError,
        r"weighted_sum: coef must be a 1-D tensor of length 4 .*got shape \(3,\)",
        F.weighted_sum,
        U,
        coef[:3],
        None,
        1.0,
        None,
    )
    one_line(
        ValueError,
        r"weighted_sum: rows must lie in \[0, 4\), got min 0 max 4",
        ops.weighted_sum,
        U,
        coef[:2],
        rows=[0, 4],
    )
    # host rows are range-checked by the native op (csrc/cpu: "rows entry 4", the CUDA glue: "rows[1] = 4")
    one_line(
        RuntimeError,
        r"weighted_sum: rows( entry|\[1\] =) 4 out of range \[0, 4\)",
        F.weighted_sum,
        U,
        coef[:2],
        None,
        1.0,
        torch.tensor([0, 4]),
    )
    one_line(
        ValueError,
        r"weighted_sum: base must have dtype torch.float32 .*got torch.float64",
        ops.weighted_sum,
        U,
        coef,
        base=torch.zeros(301, dtype=torch.float64, device=dev),
    )
    one_line(
        ValueError,
        r"weighted_sum: U must have a floating dtype .*got torch.int64",
        ops.weighted_sum,
        torch.zeros(4, 301, dtype=torch.long, device=dev),
        coef,
    )
    if dev == DEV:
        one_line(
            ValueError,
            r"weighted_sum: base is on cpu but U is on cuda",
            ops.weighted_sum,
            U,
            coef,
            base=torch.zeros(301),
        )
        one_line(
            ValueError,
            r"weighted_sum: base is on cpu but U is on cuda",
            F.weighted_sum,
            U,
            coef,
            torch.zeros(301),
            1.0,
            None,
        )
    base = randn(dev, 301, seed=52)
    out = ops.weighted_sum(U, coef, base=base, alpha=0.5, rows=[3, 0, 0, 2])
    settle(dev)
    torch.testing.assert_close(
        out.double(), ref.weighted_sum(U, coef, base=base, alpha=0.5, rows=[3, 0, 0, 2]), rtol=1e-5, atol=1e-5
    )


# ---- bad tensors: one ValueError, the same words from the wrapper and from the native op ------------------------
def _wsum_bad(dev):
    """{case: (arguments of a weighted sum with one bad tensor, the message after "<op>: ")}."""
    U, c = randn(dev, 4, 10, seed=61), [0.5, -1.0, 2.0, 0.25]
    Ub = U.bfloat16()

    def z(*shape, dtype=torch.float32):
        return torch.zeros(*shape, dtype=dtype, device=dev)

    floating = "must have a floating dtype (float16, bfloat16, float32, float64), got"
    wider = " or a wider torch.float32 / torch.float64"
    return {
        "U 3-D": (dict(U=U[..., None], coef=c), "U must be a 2-D [K, d] tensor, got shape (4, 10, 1)"),
        "U 1-D": (dict(U=U[0], coef=c), "U must be a 2-D [K, d] tensor, got shape (10,)"),
        "U int": (dict(U=z(4, 10, dtype=torch.int64), coef=c), f"U {floating} torch.int64"),
        "coef length": (
            dict(U=U, coef=c[:3]),
            "coef must be a 1-D tensor of length 4 (one per selected row), got shape (3,)",
        ),
        "rows 2-D": (
            dict(U=U, coef=c, rows=[[0, 1], [2, 3]]),
            "rows must be a 1-D sequence of row indices, got shape (2, 2)",
        ),
        "rows float": (
            dict(U=U, coef=c[:2], rows=torch.tensor([0.0, 1.0])),
            "rows must hold integer row indices, got dtype torch.float32",
        ),
        "base length": (dict(U=U, coef=c, base=z(9)), "base must be a 1-D tensor of length 10, got shape (9,)"),
        "base 2-D": (dict(U=U, coef=c, base=z(1, 10)), "base must be a 1-D tensor of length 10, got shape (1, 10)"),
        "base dtype": (
            dict(U=U, coef=c, base=z(10, dtype=torch.float64)),
            "base must have dtype torch.float32 (the dtype of U), got torch.float64",
        ),
        "base int": (
            dict(U=U, coef=c, base=z(10, dtype=torch.int64)),
            "base must have dtype torch.float32 (the dtype of U), got torch.int64",
        ),
        "base narrower": (
            dict(U=Ub, coef=c, base=z(10, dtype=torch.float16)),
            f"base must have dtype torch.bfloat16 (the dtype of U){wider}, got torch.float16",
        ),
        "out length": (dict(U=U, coef=c, out=z(11)), "out must be a 1-D tensor of length 10, got shape (11,)"),
        "out dtype": (
            dict(U=U, coef=c, out=z(10, dtype=torch.float64)),
            "out must have dtype torch.float32 (the dtype of U), got torch.float64",
        ),
        "out narrower": (
            dict(U=Ub, coef=c, out=z(10, dtype=torch.float16)),
            f"out must have dtype torch.bfloat16 (the dtype of U){wider}, got torch.float16",
        ),
        "out strided": (dict(U=U, coef=c, out=z(20)[::2]), "out must be contiguous"),
        "base not out's": (
            dict(U=Ub, coef=c, base=z(10, dtype=torch.float64), out=z(10)),
            "base must have dtype torch.float32 (the dtype of out), got torch.float64",
        ),
        "base elsewhere": (dict(U=U, coef=c, base=torch.zeros(10)), "base is on cpu but U is on cuda:0"),
        "out elsewhere": (dict(U=U, coef=c, out=torch.zeros(10)), "out is on cpu but U is on cuda:0"),
    }


WSUM_BAD = list(_wsum_bad("cpu"))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("op", ["weighted_sum", "weighted_sum_screened"])
@pytest.mark.parametrize("case", WSUM_BAD)
def test_bad_tensor_args_same_from_wrapper_and_native(dev, op, case):
    if case.endswith("elsewhere") and dev == "cpu":
        pytest.skip("a second device needs a GPU")
    kw, msg = _wsum_bad(dev)[case]
    want = "^" + re.escape(f"{op}: {msg}") + "$"
    one_line(ValueError, want, getattr(ops, op), **kw)
    U, coef, base, rows, out = (kw.get(k) for k in ("U", "coef", "base", "rows", "out"))
    coef = torch.tensor(coef, dtype=torch.float64)  # the host vectors the wrapper passes
    rows = None if rows is None else torch.as_tensor(rows)
    F = torch.ops.fedkernels
    if out is None:
        one_line(ValueError, want, getattr(F, op), U, coef, base, 1.0, rows)
    else:
        one_line(ValueError, want, getattr(F, op + "_out"), U, coef, base, 1.0, rows, out)


@pytest.mark.parametrize("case", ["U 1-D", "U int", "base length", "out strided"])
def test_bad_tensor_args_under_compile_raise_when_the_graph_runs(case):
    """The fake kernels trace any shape; the native op's check raises its ValueError when the graph runs."""
    kw, msg = _wsum_bad("cpu")[case]
    torch._dynamo.reset()
    f = torch.compile(lambda kw: ops.weighted_sum(**kw), backend="eager")
    one_line(ValueError, "^" + re.escape(f"weighted_sum: {msg}") + "$", f, kw)


# ---- the CUDA kernel's per-thread logic on the host (tests/host_harness.py, tests/cuda_host/weighted_sum.cpp) ------
@pytest.fixture(scope="module")
def harness():
    yield from host_harness.session()


@pytest.mark.parametrize(
    "alpha,c",
    [
        (1.0, 3.0e38),
        (1.0, 3.1e38),
        (1.0, float("nan")),
        (1e200, 1e-200),
        (-1.0, -3.0e38),
        (2.0, float("inf")),
        (1e-300, 1e300),
        (0.5, -7.0e38),
    ],
)
def test_wsum_fits_float_is_the_cpu_rule(harness, alpha, c):
    # csrc/cpu/weighted_sum.cpp: fits_float = |alpha * c| <= 3e38 for every coefficient
    assert harness("fits", alpha, c) == [str(int(abs(alpha * c) <= 3.0e38))]


@pytest.mark.parametrize(
    "x", [0.0, -0.0, 1.0, -3.0e38, 3.4028234663852886e38, 1e-45, 1e300, float("inf"), float("-inf"), float("nan")]
)
def test_wsum_screen_finite_test(harness, x):
    # weighted_sum_screened's test on the accumulators and on a bad block's values: x * 0 == 0
    f32 = torch.tensor(x, dtype=torch.float64).float().item()
    assert harness("wfin", x) == [str(int(math.isfinite(f32))), str(int(math.isfinite(x)))]


@pytest.mark.parametrize(
    "u,ld,K,out,base,want",
    [
        (0, 16, 5, 0, 0, 1),
        (0, 12, 5, 0, 0, 0),
        (0, 12, 1, 0, 0, 1),
        (4, 16, 5, 0, 0, 0),
        (0, 16, 5, 8, 0, 0),
        (0, 16, 5, 0, 32, 1),
        (0, 16, 5, 0, 40, 0),
        (256, 4096, 100, 512, 1024, 1),
    ],
)
def test_wsum_vector_path_needs_every_row_aligned(harness, u, ld, K, out, base, want):
    assert harness("vecok", u, ld, K, out, base) == [str(want)]


# (dtype emulated, accumulation bytes, vector width V = 16 / element size)
WSUM_TYPES = [(torch.float32, 4, 4), (torch.float16, 4, 8), (torch.bfloat16, 4, 8), (torch.float64, 8, 2)]


def _wsum_case(harness, dtype, A, V, vec, K, d, rows, alpha, base, coef):
    U = torch.randn(K, d, generator=gen(K * 7 + d), dtype=torch.float64).to(dtype)
    n = len(rows) if rows is not None else K
    b = torch.randn(d, generator=gen(d), dtype=torch.float64).to(dtype) if base else None
    ans = harness(
        "wsum",
        A,
        V,
        vec,
        K,
        d,
        n,
        alpha,
        -1,
        U.double(),
        coef,
        int(rows is not None),
        list(rows) if rows is not None else [],
        int(base),
        b.double() if base else [],
    )
    wide = ans[0] == "1"
    out = torch.tensor([hexf(s) for s in ans[1:]], dtype=torch.float64).to(dtype)  # the kernel's final cast
    return U, b, wide, out


@pytest.mark.parametrize("dtype,A,V", WSUM_TYPES)
@pytest.mark.parametrize("vec", [True, False])
@pytest.mark.parametrize("K,d", [(1, 1), (3, 5), (1, 1023), (2, 1025), (3, 2 * 256 * 8 + 3), (300, 37)])
def test_wsum_grid_matches_reference(harness, dtype, A, V, vec, K, d):
    """Every column exactly once (the harness checks coverage), tails when d is not a multiple of V,
    K above the 256-row staging batch, rows in index order: matches the float64 reference."""
    coef = torch.randn(K, generator=gen(K), dtype=torch.float64)
    U, b, wide, out = _wsum_case(harness, dtype, A, V, vec, K, d, None, 0.7, True, coef)
    assert wide == (A == 8)  # double accumulation only for fp64 data here
    want = ref.weighted_sum(U, coef, base=b, alpha=0.7)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol * max(1.0, K**0.5))


def test_wsum_rows_duplicates_and_bad_rows_give_nan(harness):
    K, d = 6, 300
    coef = torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=torch.float64)
    U, _, _, out = _wsum_case(harness, torch.float32, 4, 4, True, K, d, [5, 1, 1, 3], -2.0, False, coef)
    torch.testing.assert_close(
        out.double(), ref.weighted_sum(U, coef, alpha=-2.0, rows=[5, 1, 1, 3]), rtol=1e-5, atol=1e-5
    )
    for bad in ([5, 1, 6, 3], [5, -1, 1, 3]):
        _, _, _, out = _wsum_case(harness, torch.float32, 4, 4, True, K, d, bad, -2.0, False, coef)
        assert torch.isnan(out).all()  # never a plausible number, never a read outside U


@pytest.mark.parametrize("dtype,A,V", WSUM_TYPES[:3])
def test_wsum_coefficient_beyond_float_accumulates_in_double(harness, dtype, A, V):
    """alpha * coef = 1e39 does not fit in float: the CPU op accumulates in double (finite result);
    a float cast would give inf. The kernel follows the CPU rule."""
    K, d = 3, 70
    coef = torch.tensor([1e39, -1e39, 1e-3], dtype=torch.float64)
    U, _, wide, out = _wsum_case(harness, dtype, A, V, True, K, d, None, 1.0, False, coef)
    assert wide
    want = ref.weighted_sum(U, coef)
    assert torch.isfinite(out.double()).sum() == torch.isfinite(want.to(dtype).double()).sum()
    cpu = torch.ops.fedkernels.weighted_sum(U, coef, None, 1.0, None)
    torch.testing.assert_close(out, cpu, rtol=1e-2, atol=1e-2, equal_nan=True)
