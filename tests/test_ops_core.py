"""gram, weighted_sum, finite_rows: native CPU ops against the float64 reference."""
import subprocess
import sys

import pytest
import torch
from torch.testing import assert_close

from fedkernels import ops, reference as ref

SHAPES = [(1, 1), (2, 3), (3, 17), (5, 1000), (7, 4099), (16, 2048 * 3 + 5), (33, 257), (10, 70001)]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _tol(dtype):
    return {torch.float64: (1e-12, 1e-12), torch.float32: (1e-5, 1e-5),
            torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}[dtype]


# ---- gram ------------------------------------------------------------------------------------
@pytest.mark.parametrize("K,d", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gram_matches_reference(K, d, dtype):
    U = torch.randn(K, d, dtype=torch.float64).to(dtype)
    G = ops.gram(U)
    assert G.dtype == torch.float64 and G.shape == (K, K)
    # products of fp32/fp16/bf16 values are exact in fp64: gram matches the fp64 reference on the
    # same (rounded) inputs to fp64 summation error, for every input dtype
    assert_close(G, ref.gram(U), rtol=1e-12, atol=1e-12 * d)
    assert torch.equal(G, G.T)


@pytest.mark.parametrize("K,d", [(6, 1001), (13, 5000)])
def test_gram_rows_subset(K, d):
    U = torch.randn(K, d, dtype=torch.float64)
    rows = [K - 1, 0, 3, 3]
    assert_close(ops.gram(U, rows=rows), ref.gram(U, rows), rtol=1e-12, atol=1e-10)
    assert_close(ops.gram(U, rows=torch.tensor(rows)), ref.gram(U, rows), rtol=1e-12, atol=1e-10)


def test_gram_noncontiguous_and_column_chunks():
    U = torch.randn(9, 3001, dtype=torch.float32)
    # transposed storage (column stride != 1) is copied once
    Ut = torch.randn(3001, 9).T
    assert_close(ops.gram(Ut), ref.gram(Ut), rtol=1e-12, atol=1e-9)
    # strided rows
    assert_close(ops.gram(U[::2]), ref.gram(U[::2]), rtol=1e-12, atol=1e-9)
    # column chunks are views (no copy) and their grams sum to the full gram
    G = sum(ops.gram(U[:, a:a + 1000]) for a in range(0, 3001, 1000))
    assert_close(G, ref.gram(U), rtol=1e-12, atol=1e-9)


def test_gram_large_values_fp64_accuracy():
    # fp32 inputs whose fp32 Gram would lose digits: we must match fp64 to ~1e-12 relative
    U = (torch.randn(4, 200_000, dtype=torch.float64) * 1e3 + 1e4).float()
    G = ops.gram(U)
    R = ref.gram(U)
    assert ((G - R).abs() / R.abs()).max() < 1e-12


def test_gram_deterministic_across_calls_and_threads():
    U = torch.randn(12, 300_001)
    g1, g2 = ops.gram(U), ops.gram(U)
    assert torch.equal(g1, g2)
    code = (
        "import torch, fedkernels.ops as o; torch.manual_seed(1); U = torch.randn(12, 300001); "
        "torch.set_num_threads({n}); G = o.gram(U); import sys; sys.stdout.write(G.numpy().tobytes().hex())"
    )
    outs = [subprocess.run([sys.executable, "-c", code.format(n=n)], capture_output=True, text=True, check=True).stdout
            for n in (1, 2)]
    assert outs[0] == outs[1] and len(outs[0]) == 12 * 12 * 16


def test_gram_empty_and_edge():
    assert ops.gram(torch.zeros(0, 5)).shape == (0, 0)
    assert torch.equal(ops.gram(torch.zeros(3, 0)), torch.zeros(3, 3, dtype=torch.float64))
    assert ops.gram(torch.ones(3, 4), rows=[]).shape == (0, 3)


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


# ---- finite_rows -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_finite_rows(dtype):
    U = torch.randn(6, 40_000).to(dtype)
    U[1, 39_999] = float("nan")
    U[4, 0] = float("inf")
    U[5, 20_000] = -float("inf")
    expect = torch.tensor([True, False, True, True, False, False])
    assert torch.equal(ops.finite_rows(U), expect)
    assert torch.equal(ops.finite_rows(U), ref.finite_rows(U))
    big = torch.full((2, 10), 3e38, dtype=torch.float32)  # huge but finite
    assert ops.finite_rows(big).all()


# ---- bad inputs --------------------------------------------------------------------------------
def test_bad_inputs_name_the_argument():
    U = torch.randn(4, 10)
    with pytest.raises(ValueError, match="U must be a 2-D"):
        ops.gram(torch.randn(10))
    with pytest.raises(TypeError, match="U must be a torch.Tensor"):
        ops.gram([[1.0, 2.0]])
    with pytest.raises(ValueError, match="floating dtype"):
        ops.gram(torch.ones(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="rows must lie in"):
        ops.gram(U, rows=[0, 4])
    with pytest.raises(ValueError, match="rows must hold integer"):
        ops.gram(U, rows=torch.tensor([0.5]))
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


# ---- opcheck -----------------------------------------------------------------------------------
def test_opcheck():
    U = torch.randn(5, 300)
    c = torch.rand(5, dtype=torch.float64)
    b = torch.randn(300)
    torch.library.opcheck(torch.ops.fedkernels.gram.default, (U, None))
    torch.library.opcheck(torch.ops.fedkernels.gram.default, (U, torch.tensor([1, 3])))
    torch.library.opcheck(torch.ops.fedkernels.weighted_sum.default, (U, c, b, 0.5, None))
    torch.library.opcheck(torch.ops.fedkernels.weighted_sum.default, (U, c[:2], None, 1.0, torch.tensor([4, 0])))
    torch.library.opcheck(torch.ops.fedkernels.weighted_sum_out.default, (U, c, b, 0.5, None, torch.empty(300)))
    torch.library.opcheck(torch.ops.fedkernels.finite_rows.default, (U,))


def test_weighted_sum_coefficients_beyond_float_range():
    # lam / ||m|| for a denormal m: coef 1e40 does not fit in fp32, the products do
    U = torch.full((2, 5), 1e-40)
    out = ops.weighted_sum(U, [1e40, 1e40])
    assert_close(out.double(), ref.weighted_sum(U, [1e40, 1e40]), rtol=1e-5, atol=1e-6)
    assert torch.isfinite(out).all()
