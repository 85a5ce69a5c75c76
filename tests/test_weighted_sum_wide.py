"""weighted_sum into a wider result: a bf16/fp16 U summed into fp32/fp64 (out / base) in one pass, the
same bits as converting U to the result's dtype first (the path sources.weighted_sum_block took
before), the screen's flags exact, every other dtype pair one clear error; and weighted_sum_block
using it (no finite_rows pass, no conversion scratch)."""

import pytest
import torch
from torch.testing import assert_close

from fedkernels import ops, reference as ref
from fedkernels.sources import chunked
from fedkernels.ops.weighted_sum import out_dtypes
from devices import cuda_only  # tests/devices.py

WIDE = [
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float64),
    (torch.float16, torch.float64),
]
# odd sizes: a single column, tails of the 8192-column CPU chunk and of the CUDA vector width, K >= 8 and not
SHAPES = [(1, 1), (3, 17), (8, 8192 + 9), (13, 2 * 8192 + 5), (16, 4099)]


def _eq(a, b):
    assert a.dtype == b.dtype
    assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _data(K, d, udt, odt, seed=0, pad=3, start=1):
    """U with a row stride > d (a column window of a wider matrix: used without a copy), coef, base."""
    g = torch.Generator().manual_seed(seed + K * 131 + d)
    U = torch.randn(K, d + pad, generator=g, dtype=torch.float64).to(udt)[:, start : start + d]
    coef = torch.rand(K, generator=g, dtype=torch.float64) - 0.3
    base = torch.randn(d, generator=g, dtype=torch.float64).to(odt)
    return U, coef, base


def _converted(U, coef, base=None, alpha=1.0, rows=None, odt=torch.float32):
    """The old path: U converted to the result's dtype, then the same-dtype op."""
    return ops.weighted_sum(U.to(odt), coef, base=base, alpha=alpha, rows=rows)


@pytest.mark.parametrize("K,d", SHAPES)
@pytest.mark.parametrize("udt,odt", WIDE)
def test_wide_result_is_the_bits_of_converting_u_first(K, d, udt, odt):
    U, coef, base = _data(K, d, udt, odt)
    assert U.stride(0) == d + 3
    want = _converted(U, coef, base, -0.7, odt=odt)
    got = ops.weighted_sum(U, coef, base=base, alpha=-0.7)  # functional: base's dtype
    _eq(got, want)
    out = torch.full((d,), 5.0, dtype=odt)
    assert ops.weighted_sum(U, coef, alpha=-0.7, out=out) is out  # out= without base
    _eq(out, _converted(U, coef, alpha=-0.7, odt=odt))
    b2 = base.clone()  # out aliasing base: in-place apply
    ops.weighted_sum(U, coef, base=b2, alpha=-0.7, out=b2)
    _eq(b2, want)
    rows = [K - 1, 0, K // 2, 0]
    c4 = torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=torch.float64)
    _eq(ops.weighted_sum(U, c4, base=base, alpha=0.3, rows=rows), _converted(U, c4, base, 0.3, rows, odt))
    s, ok = ops.weighted_sum_screened(U, c4, base=base, alpha=0.3, rows=rows, out=torch.empty(d, dtype=odt))
    _eq(s, _converted(U, c4, base, 0.3, rows, odt))
    assert ok.tolist() == [True] * 4
    assert_close(
        got.double(),
        ref.weighted_sum(U, coef, base, -0.7),
        rtol=1e-5 if odt == torch.float32 else 1e-12,
        atol=1e-5 * K if odt == torch.float32 else 1e-12,
    )


@pytest.mark.parametrize("udt,odt", WIDE)
def test_wide_non_contiguous_u_and_empty_selections(udt, odt):
    U, coef, base = _data(6, 2 * 1001, udt, odt)
    Us = U[:, ::2]  # column stride 2: copied once by the wrapper
    _eq(ops.weighted_sum(Us, coef, base=base[:1001]), _converted(Us, coef, base[:1001], odt=odt))
    _eq(ops.weighted_sum(U, [], base=base, rows=[]), base)
    out = torch.empty(0, dtype=odt)
    _eq(ops.weighted_sum_screened(U[:, :0], coef, out=out)[0], out)


def test_coefficients_beyond_float_accumulate_in_double_as_converting_does():
    U = torch.full((3, 1000), 1e-30).bfloat16()
    U[1, 7] = 2e-30
    coef = torch.tensor([4e38, 1e39, -2e38], dtype=torch.float64)
    want = _converted(U, coef, odt=torch.float32)
    assert torch.isfinite(want).all()
    _eq(ops.weighted_sum(U, coef, out=torch.empty(1000)), want)


@pytest.mark.parametrize("udt,odt", WIDE)
def test_wide_screen_flags_are_exact(udt, odt):
    """NaN/Inf in some rows (a tail column, a chunk edge, the first column): flags name exactly those
    rows; the finite columns carry the bits of the converted sum; finite rows whose fp32 sum overflows
    stay flagged finite."""
    K, d = 11, 3 * 8192 + 7
    U, coef, base = _data(K, d, udt, odt, seed=5)
    U[2, d - 1] = float("nan")
    U[5, 8192] = float("inf")
    U[9, 0] = float("-inf")
    out = torch.empty(d, dtype=odt)
    s, ok = ops.weighted_sum_screened(U, coef, base=base, alpha=0.5, out=out)
    assert s is out and ok.tolist() == [k not in (2, 5, 9) for k in range(K)]
    _eq(out, _converted(U, coef, base, 0.5, odt=odt))
    s, ok = ops.weighted_sum_screened(U, coef, base=base, alpha=0.5)  # the functional form: base's dtype
    assert s.dtype == odt and ok.tolist() == [k not in (2, 5, 9) for k in range(K)]
    _, ok = ops.weighted_sum_screened(U, [1.0, 1.0, 1.0], rows=[9, 0, 2], out=torch.empty(d, dtype=odt))
    assert ok.tolist() == [False, True, False]
    big = torch.full((2, 300), 6e4 if udt == torch.float16 else 3e38).to(udt)  # finite, the sum may overflow
    s, ok = ops.weighted_sum_screened(big, [1e35, 1e35], out=torch.empty(300, dtype=odt))
    assert ok.tolist() == [True, True]
    assert torch.isinf(s).all() == (odt == torch.float32)


def test_wide_result_autograd_and_fake_kernel():
    U = torch.randn(4, 37).bfloat16().requires_grad_()
    base = torch.randn(37, requires_grad=True)
    coef = torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=torch.float64)
    y = ops.weighted_sum(U, coef, base=base, alpha=0.5)
    assert y.dtype == torch.float32
    g = torch.randn(37)
    y.backward(g)
    assert U.grad.dtype == torch.bfloat16 and base.grad.dtype == torch.float32
    _eq(U.grad, ((0.5 * coef).float()[:, None] * g[None, :]).bfloat16())
    _eq(base.grad, g)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fU, fb = torch.empty(4, 37, dtype=torch.float16), torch.empty(37, dtype=torch.float64)
        fc = torch.empty(4, dtype=torch.float64)
        assert torch.ops.fedkernels.weighted_sum(fU, fc, fb, 1.0, None).dtype == torch.float64
        assert torch.ops.fedkernels.weighted_sum_screened(fU, fc, fb, 1.0, None)[0].dtype == torch.float64
    Ud = torch.randn(4, 300).half()
    torch.library.opcheck(torch.ops.fedkernels.weighted_sum.default, (Ud, coef, torch.randn(300), 0.5, None))
    torch.library.opcheck(
        torch.ops.fedkernels.weighted_sum_screened_out.default,
        (Ud, coef, None, 0.5, None, torch.empty(300, dtype=torch.float64)),
    )


def test_other_dtype_pairs_are_one_clear_error():
    assert out_dtypes(torch.bfloat16) == (torch.bfloat16, torch.float32, torch.float64)
    assert out_dtypes(torch.float32) == (torch.float32,)
    Ub, c = torch.randn(4, 10).bfloat16(), [1.0] * 4
    wider = r" or a wider torch.float32 / torch.float64, got "
    with pytest.raises(
        ValueError,
        match=r"^weighted_sum: out must have dtype torch.bfloat16 \(the dtype of U\)" + wider + r"torch.float16$",
    ):
        ops.weighted_sum(Ub, c, out=torch.empty(10, dtype=torch.float16))
    with pytest.raises(
        ValueError,
        match=r"^weighted_sum_screened: base must have dtype torch.bfloat16 \(the dtype "
        r"of U\)" + wider + r"torch.float16$",
    ):
        ops.weighted_sum_screened(Ub, c, base=torch.zeros(10, dtype=torch.float16))
    with pytest.raises(
        ValueError,
        match=r"^weighted_sum: base must have dtype torch.float32 \(the dtype of out\), "
        r"got torch.float64$",
    ):
        ops.weighted_sum(Ub, c, base=torch.zeros(10, dtype=torch.float64), out=torch.empty(10))
    with pytest.raises(
        ValueError,
        match=r"^weighted_sum: out must have dtype torch.float32 \(the dtype of U\), "
        r"got torch.float64$",
    ):  # fp32 U is not widened
        ops.weighted_sum(torch.randn(4, 10), c, out=torch.empty(10, dtype=torch.float64))
    # the same words from the native ops (the C++ checks shared by the CPU kernel and the CUDA glue)
    cc = torch.ones(4, dtype=torch.float64)
    with pytest.raises(
        ValueError, match=r"^weighted_sum: out must have dtype torch.bfloat16 \(the dtype of U\)" + wider
    ):
        torch.ops.fedkernels.weighted_sum_out(Ub, cc, None, 1.0, None, torch.empty(10, dtype=torch.float16))
    with pytest.raises(
        ValueError,
        match=r"^weighted_sum_screened: out must have dtype torch.float32 \(the dtype of U\), got torch.float64$",
    ):
        torch.ops.fedkernels.weighted_sum_screened_out(
            torch.randn(4, 10), cc, None, 1.0, None, torch.empty(10, dtype=torch.float64)
        )
    with pytest.raises(
        ValueError, match=r"^weighted_sum: base must have dtype torch.bfloat16 \(the dtype of U\)" + wider
    ):
        torch.ops.fedkernels.weighted_sum(Ub, cc, torch.zeros(10, dtype=torch.float16), 1.0, None)
    with pytest.raises(
        ValueError, match=r"^weighted_sum: base must have dtype torch.float32 \(the dtype of out\), got torch.float64$"
    ):
        torch.ops.fedkernels.weighted_sum_out(Ub, cc, torch.zeros(10, dtype=torch.float64), 1.0, None, torch.empty(10))


# ---- sources.weighted_sum_block: one pass, the old path as the fallback ---------------------------------------
def _old_block(c, coef, base, alpha, odt, rows=None):
    """weighted_sum_block's conversion path (CONVERT_COLS columns at a time), forced by a non-contiguous dst."""
    full = torch.empty(2 * c.size(1), dtype=odt)
    dst = full[::2]
    ok = chunked.weighted_sum_block(c, coef, base, alpha, dst, rows=rows, screen=True)
    return dst.clone(), ok


@pytest.mark.parametrize("udt,odt", WIDE)
@pytest.mark.parametrize("with_rows", [False, True])
def test_block_sums_a_half_block_into_a_wide_dst_in_one_pass(monkeypatch, udt, odt, with_rows):
    K, d = 9, 2 * 8192 + 3
    U, coef, base = _data(K, d, udt, odt, seed=11)
    U[4, 100] = float("nan")
    rows = torch.tensor([8, 4, 0]) if with_rows else None
    cf = coef[:3] if with_rows else coef
    monkeypatch.setattr(chunked, "CONVERT_COLS", 4096)  # the fallback in several blocks
    want, want_ok = _old_block(U, cf, base, 0.5, odt, rows)
    calls = []
    for name in ("finite_rows", "weighted_sum", "weighted_sum_screened"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _r=real, _n=name, **kw: calls.append(_n) or _r(*a, **kw))
    full = torch.zeros(3 * d, dtype=odt)
    dst = full[d : 2 * d]
    ok = chunked.weighted_sum_block(U, cf, base, 0.5, dst, rows=rows, screen=True)
    # no rows: one screened pass; rows: the [K] flags from finite_rows, then one pass; never a converted copy
    assert calls == (["finite_rows", "weighted_sum"] if with_rows else ["weighted_sum_screened"])
    assert ok.tolist() == want_ok.tolist() == [k != 4 for k in range(K)]
    _eq(dst, want)
    assert not full[:d].any() and not full[2 * d :].any()
    calls.clear()
    dst = torch.empty(d, dtype=odt)
    assert chunked.weighted_sum_block(U, cf, None, 0.5, dst, rows=rows) is None and calls == ["weighted_sum"]
    _eq(dst, _converted(U, cf, None, 0.5, rows, odt))


def test_block_keeps_the_conversion_path_where_there_is_no_kernel(monkeypatch):
    """A device without the out= kernels: the conversion path, same bits (has_kernel is the only switch)."""
    U, coef, base = _data(5, 3000, torch.bfloat16, torch.float32, seed=3)
    want = _converted(U, coef, base, 0.25)
    monkeypatch.setattr(
        chunked, "has_kernel", lambda native, dev: native not in ("weighted_sum_out", "weighted_sum_screened_out")
    )
    seen = []
    real = ops.weighted_sum
    monkeypatch.setattr(ops, "weighted_sum", lambda U, *a, **kw: seen.append(U.dtype) or real(U, *a, **kw))
    dst = torch.empty(3000)
    ok = chunked.weighted_sum_block(U, coef, base, 0.25, dst, screen=True)
    assert ok.tolist() == [True] * 5 and seen == [torch.float32]  # summed from the converted scratch
    _eq(dst, want)


@cuda_only
@pytest.mark.parametrize("udt,odt", WIDE)
def test_cuda_wide_result_matches_converting_first(udt, odt):
    """The CUDA kernel: vector path (16-byte aligned rows) and scalar path (odd row stride), rows=, the
    screen; the bits of the CUDA op on U converted first."""
    for K, d, pad, start in ((9, 8 * 256 * 3 + 5, 3, 0), (5, 1001, 3, 1)):  # row stride 6152 = 8 * 769; odd
        U, coef, base = _data(K, d, udt, odt, seed=7, pad=pad, start=start)
        U[3, d - 2] = float("inf")
        U, base = U.cuda(), base.cuda()
        want = ops.weighted_sum(U.to(odt), coef, base=base, alpha=-0.5)
        out = torch.empty(d, dtype=odt, device="cuda")
        s, ok = ops.weighted_sum_screened(U, coef, base=base, alpha=-0.5, out=out)
        assert ok.tolist() == [k != 3 for k in range(K)]
        _eq(s, want)
        _eq(ops.weighted_sum(U, coef, base=base, alpha=-0.5), want)
        rows = [K - 1, 0, 0]
        _eq(
            ops.weighted_sum(U, coef[:3], alpha=2.0, rows=rows, out=torch.empty(d, dtype=odt, device="cuda")),
            ops.weighted_sum(U.to(odt), coef[:3], alpha=2.0, rows=rows),
        )
        assert_close(
            s.cpu(),
            ops.weighted_sum(U.cpu(), coef, base=base.cpu(), alpha=-0.5),
            equal_nan=True,
            rtol=1e-5 if odt == torch.float32 else 1e-12,
            atol=1e-5 if odt == torch.float32 else 1e-12,
        )


@pytest.mark.parametrize("udt,odt", WIDE)
def test_chunked_table_on_the_device_is_one_widened_pass(monkeypatch, udt, odt):
    """weighted_sum_chunked of a bf16/fp16 table into fp32/fp64 on its own device: one weighted_sum call
    (no converted chunks), the bits of the chunked conversion (forced here by a column-strided table)."""
    import sys

    wsmod = sys.modules["fedkernels.ops.weighted_sum"]  # the module (ops.weighted_sum is the function)
    U, coef, base = _data(7, 2 * 3001, udt, odt, seed=2)
    Us, b = U[:, ::2], base[:3001]  # column stride 2: the chunked conversion path
    Uc = Us.contiguous()
    rows = [6, 1, 1, 4]
    c4 = coef[:4]
    calls = []
    real = wsmod.weighted_sum
    monkeypatch.setattr(wsmod, "weighted_sum", lambda M, *a, **kw: calls.append(M.dtype) or real(M, *a, **kw))
    want = ops.weighted_sum_chunked(Us, c4, base=b, alpha=0.5, rows=rows, out_dtype=odt, chunk_cols=1000)
    assert calls == [odt] * 4  # 4 converted chunks
    calls.clear()
    got = ops.weighted_sum_chunked(Uc, c4, base=b, alpha=0.5, rows=rows, out_dtype=odt, chunk_cols=1000)
    assert calls == [udt]  # one pass over the table as it is
    _eq(got, want)
    _eq(got, _converted(Uc, c4, b, 0.5, rows, odt))
    calls.clear()
    _eq(ops.weighted_sum_chunked(Uc, coef, out_dtype=odt), _converted(Uc, coef, odt=odt))
    assert calls == [udt]
