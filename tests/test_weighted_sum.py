"""weighted_sum: the native op against the float64 reference (shapes, rows, out=, layouts, bad inputs)."""
import pytest
import torch
from torch.testing import assert_close

from fedkernels import ops, reference as ref

SHAPES = [(1, 1), (2, 3), (3, 17), (5, 1000), (7, 4099), (16, 2048 * 3 + 5), (33, 257), (10, 70001)]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _tol(dtype):
    return {torch.float64: (1e-12, 1e-12), torch.float32: (1e-5, 1e-5),
            torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}[dtype]


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
    U = big[:, ::2]                      # column stride 2 -> copied once
    Uc = big[:, 1000:5001]               # column chunk view -> no copy
    Ut = torch.randn(4001, 8, dtype=torch.float64).T
    base = torch.randn(2 * 4001, dtype=torch.float64)[::2]   # non-contiguous base
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


def test_weighted_sum_opcheck():
    U = torch.randn(5, 300)
    c = torch.rand(5, dtype=torch.float64)
    b = torch.randn(300)
    torch.library.opcheck(torch.ops.fedkernels.weighted_sum.default, (U, c, b, 0.5, None))
    torch.library.opcheck(torch.ops.fedkernels.weighted_sum.default, (U, c[:2], None, 1.0, torch.tensor([4, 0])))
    torch.library.opcheck(torch.ops.fedkernels.weighted_sum_out.default, (U, c, b, 0.5, None, torch.empty(300)))


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
    _needs_kernel("weighted_sum", torch.device("cpu"), "weighted_sum")      # CPU: always there
    for native in ("weighted_sum", "gram", "arrowhead_solve", "fused_sgd_step_"):
        if torch._C._dispatch_has_kernel_for_dispatch_key(f"fedkernels::{native}", "CUDA"):
            _needs_kernel(native, torch.device("cuda"), native)
        else:
            with pytest.raises(ValueError, match=f"no cuda kernel for fedkernels::{native}"):
                _needs_kernel(native, torch.device("cuda"), native)


# ---- weighted_sum_screened: the sum and the rows' NaN/Inf flags from one pass ---------------------
@pytest.mark.parametrize("K,d", [(1, 1), (3, 7), (9, 8193), (17, 20000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_weighted_sum_screened_matches_reference(K, d, dtype):
    from fedkernels import reference
    g = torch.Generator().manual_seed(K * 31 + d)
    big = torch.randn(K, d + 5, generator=g).to(dtype)
    U = big[:, 2:2 + d]                                     # unit column stride, row stride d + 5
    bad = {k for k in range(K) if k % 3 == 1}
    for k in bad:                                           # NaN / +Inf / -Inf at odd places
        U[k, (k * 7919) % d] = (float("nan"), float("inf"), float("-inf"))[k % 3]
    coef = torch.rand(K, generator=g, dtype=torch.float64)
    base = torch.randn(d, generator=g).to(dtype)
    out, ok = ops.weighted_sum_screened(U, coef, base=base, alpha=0.5)
    ref_out, ref_ok = reference.weighted_sum_screened(U, coef, base=base, alpha=0.5)
    assert ok.dtype == torch.bool and ok.tolist() == ref_ok.tolist() == [k not in bad for k in range(K)]
    plain = ops.weighted_sum(U, coef, base=base, alpha=0.5)
    assert torch.equal(out.isnan(), plain.isnan())
    torch.testing.assert_close(out, plain, equal_nan=True, rtol=0, atol=0)   # the same bits as weighted_sum
    fin = torch.isfinite(ref_out)
    torch.testing.assert_close(out[fin].double(), ref_out[fin].double(),
                               rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)


def test_weighted_sum_screened_rows_and_overflow():
    """Flags follow ``rows``; finite rows whose fp32 sum overflows are still finite (exact flags)."""
    U = torch.full((4, 300), 3e38)
    U[2, 5] = float("nan")
    out, ok = ops.weighted_sum_screened(U, [1.0, 1.0, 1.0], rows=[3, 2, 0])
    assert ok.tolist() == [True, False, True]
    assert not torch.isfinite(out).all()
    _, ok = ops.weighted_sum_screened(U, [1.0, 1.0], rows=[0, 1])
    assert ok.tolist() == [True, True]                     # overflowed sum, finite rows
    _, ok = ops.weighted_sum_screened(U[:, :0], [1.0] * 4)  # d = 0: every row is finite
    assert ok.tolist() == [True] * 4


def test_weighted_sum_screened_bad_args():
    U = torch.randn(3, 5)
    with pytest.raises(ValueError, match="coef"):
        ops.weighted_sum_screened(U, [1.0, 2.0])
    with pytest.raises(ValueError, match="rows"):
        ops.weighted_sum_screened(U, [1.0], rows=[3])


@pytest.mark.parametrize("K,d,dtype", [(1, 1, torch.float32), (3, 7, torch.float64), (9, 8193, torch.float32),
                                       (5, 4099, torch.bfloat16)])
def test_weighted_sum_screened_out_writes_the_same_bits_into_out(K, d, dtype):
    """``out=``: the sum written into the caller's tensor (returned as it is), the flags as without out;
    U with a row stride > d, rows selected, out aliasing base (in-place apply)."""
    g = torch.Generator().manual_seed(K + d)
    U = torch.randn(K, d + 3, generator=g).to(dtype)[:, 1:1 + d]
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
    torch.testing.assert_close(b2, ops.weighted_sum(U, [0.5, -1.0, 2.0], base=base, alpha=0.7, rows=rows),
                               equal_nan=True, rtol=0, atol=0)
    fin = torch.isfinite(b2)
    torch.testing.assert_close(b2[fin].double(), ref.weighted_sum(U, [0.5, -1.0, 2.0], base, 0.7, rows)[fin],
                               rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)


def test_weighted_sum_screened_out_bad_out_names_the_argument():
    U = torch.randn(4, 10)
    c = [1.0] * 4
    with pytest.raises(ValueError, match=r"weighted_sum_screened: out must be a 1-D tensor of length 10, got shape \(11,\)"):
        ops.weighted_sum_screened(U, c, out=torch.zeros(11))
    with pytest.raises(ValueError, match=r"weighted_sum_screened: out must have dtype torch.float32 \(the dtype of U\), "
                                         r"got torch.float64"):
        ops.weighted_sum_screened(U, c, out=torch.zeros(10, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"weighted_sum_screened: out is on meta but U is on cpu"):
        ops.weighted_sum_screened(U, c, out=torch.zeros(10, device="meta"))
    with pytest.raises(ValueError, match=r"weighted_sum_screened: out must be contiguous"):
        ops.weighted_sum_screened(U, c, out=torch.zeros(20)[::2])
    with pytest.raises(TypeError, match=r"weighted_sum_screened: out must be a torch.Tensor"):
        ops.weighted_sum_screened(U, c, out=[0.0] * 10)


def test_weighted_sum_screened_out_opcheck():
    U = torch.randn(5, 300)
    U[3, 7] = float("nan")
    c = torch.rand(5, dtype=torch.float64)
    b = torch.randn(300)
    torch.library.opcheck(torch.ops.fedkernels.weighted_sum_screened_out.default, (U, c, b, 0.5, None, torch.empty(300)))
    torch.library.opcheck(torch.ops.fedkernels.weighted_sum_screened_out.default,
                          (U, c[:2], None, 1.0, torch.tensor([4, 3]), torch.empty(300)))


def test_a_screened_source_block_is_summed_straight_into_its_output_slice(monkeypatch):
    """sources.weighted_sum_block's screened path hands its destination slice to the op as ``out``
    (no block-sized temporary and copy), with the bits and flags of the plain op."""
    from fedkernels import sources
    seen = []
    real = ops.weighted_sum_screened

    def spy(*a, **kw):
        seen.append(kw.get("out"))
        return real(*a, **kw)
    monkeypatch.setattr(sources.ops, "weighted_sum_screened", spy)
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
