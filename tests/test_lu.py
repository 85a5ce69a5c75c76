"""lu_factor / lu_factor_ex / lu_solve: spec fedecado.md section 9 (U3, U10; U2, U5d, U9 in test_arrowhead_solve.py),
torch.linalg agreement, float64 reference, odd and non-contiguous shapes, opcheck, bad inputs."""
import numpy as np
import pytest
import torch

from fedkernels import ops, reference


def well_conditioned(B, n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(B, n, n, generator=g, dtype=torch.float64) + 2.0 * n ** 0.5 * torch.eye(n, dtype=torch.float64)
    return A.to(dtype)


# ---- spec vectors --------------------------------------------------------------------------------
def test_u10_generic_3x3():
    A = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 10.0]], dtype=torch.float64)
    LU, piv, info = ops.lu_factor_ex(A)
    assert piv.dtype == torch.int32 and piv.tolist() == [3, 3, 3] and int(info) == 0
    exp = torch.tensor([[7, 8, 10], [1 / 7, 6 / 7, 11 / 7], [4 / 7, 1 / 2, -1 / 2]], dtype=torch.float64)
    torch.testing.assert_close(LU, exp, rtol=0, atol=1e-14)
    assert float(torch.diagonal(LU).prod()) * (-1) ** int((piv != torch.arange(1, 4)).sum()) == pytest.approx(-3.0)
    x = ops.lu_solve(LU, piv, torch.tensor([[1.0], [2.0], [3.0]], dtype=torch.float64))
    torch.testing.assert_close(x[:, 0], torch.tensor([-1 / 3, 2 / 3, 0], dtype=torch.float64), rtol=0, atol=1e-14)


def test_u10_singular_no_nan_and_error():
    LU, piv, info = ops.lu_factor_ex(torch.ones(2, 2))
    assert LU.tolist() == [[1.0, 1.0], [1.0, 0.0]] and piv.tolist() == [1, 2] and int(info) == 2
    assert bool(torch.isfinite(LU).all())
    A = torch.stack([torch.eye(3), torch.tensor([[1.0, 2, 3], [2, 4, 6], [1, 0, 1]])])
    LU, piv, info = ops.lu_factor_ex(A)
    assert info.tolist()[0] == 0 and info.tolist()[1] > 0 and bool(torch.isfinite(LU).all())
    with pytest.raises(ValueError, match=r"singular \(matrix 1 of the batch\): pivot 3"):
        ops.lu_factor(A)
    with pytest.raises(ValueError, match="pivot 2 is zero"):
        ops.lu_factor(torch.ones(2, 2))
    with pytest.raises(ValueError, match="pivot 1 is zero"):
        ops.lu_factor(torch.zeros(4, 4))


def test_u3_dense_be_matrix():
    M = torch.tensor([[1, -1, -1], [1, 1.8, 0], [1, 0, 11 / 7]], dtype=torch.float64)
    LU, piv, info = ops.lu_factor_ex(M)
    assert piv.tolist() == [1, 2, 3]  # ties in column 0 keep the first index
    exp = torch.tensor([[1, -1, -1], [1, 2.8, 1], [1, 5 / 14, 31 / 14]], dtype=torch.float64)
    torch.testing.assert_close(LU, exp, rtol=0, atol=1e-14)
    assert float(torch.diagonal(LU).prod()) == pytest.approx(217 / 35)
    z = ops.lu_solve(LU, piv, torch.tensor([[0.0], [1.0], [1.5]], dtype=torch.float64))[:, 0]
    torch.testing.assert_close(z, torch.tensor([299, 75, 224], dtype=torch.float64) / 434, rtol=0, atol=1e-14)


# ---- agreement with torch.linalg and the reference ---------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 5, 11, 33, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_factor_matches_torch(n, dtype):
    B = 200 if n <= 11 else 20
    g = torch.Generator().manual_seed(n)
    A = torch.randn(B, n, n, generator=g, dtype=torch.float64).to(dtype)
    LU, piv, info = ops.lu_factor_ex(A)
    LU_t, piv_t, info_t = torch.linalg.lu_factor_ex(A)
    assert LU.dtype == dtype and piv.dtype == torch.int32 and info.tolist() == info_t.tolist()
    same = (piv == piv_t).all(dim=1)
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    scale = A.abs().amax(dim=(1, 2), keepdim=True)
    torch.testing.assert_close((LU[same] / scale[same]).double(), (LU_t[same] / scale[same]).double(),
                               rtol=tol, atol=tol)
    # where a near-tie flipped a pivot (fp32), the factorisation must still be valid
    if dtype == torch.float32:
        assert int(same.sum()) >= B - 2
    P, L, U = torch.lu_unpack(LU.double(), piv)
    res = (P @ L @ U - A.double()).norm(dim=(1, 2)) / A.double().norm(dim=(1, 2))
    assert float(res.max()) < (1e-5 if dtype == torch.float32 else 1e-13)
    # unbatched path agrees with the batch
    LU0, piv0, _ = ops.lu_factor_ex(A[0])
    assert torch.equal(LU0, LU[0]) and torch.equal(piv0, piv[0])


@pytest.mark.parametrize("n", [2, 3, 7])
def test_factor_matches_reference(n):
    A = torch.randn(5, n, n, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    A[1, :, 0] = A[1, 0, 0]  # ties in column 0
    A[2] = 0.0
    A[2, 0, 1] = 1.0  # singular with a zero column
    LU, piv, info = ops.lu_factor_ex(A)
    LUr, pivr, infor = reference.lu_factor_ex(A)
    assert torch.equal(piv, pivr) and torch.equal(info, infor)
    torch.testing.assert_close(LU, LUr, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("n,m", [(1, 1), (3, 5), (11, 1), (11, 1000), (11, 100_003), (33, 2049), (64, 129)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_solve_matches_torch(n, m, dtype):
    A = well_conditioned(1, n, dtype, n + m)[0]
    R = torch.randn(n, m, generator=torch.Generator().manual_seed(m), dtype=torch.float64).to(dtype)
    LU, piv = ops.lu_factor(A)
    X = ops.lu_solve(LU, piv, R)
    assert X.dtype == dtype and X.shape == R.shape
    Xt = torch.linalg.solve(A.double(), R.double())
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(X.double(), Xt, rtol=tol, atol=tol)
    # torch.linalg.lu_factor's output (column-major LU) is accepted too
    LU_t, piv_t = torch.linalg.lu_factor(A)
    torch.testing.assert_close(ops.lu_solve(LU_t, piv_t, R).double(), Xt, rtol=tol, atol=tol)
    if m <= 1000:
        torch.testing.assert_close(X.double(), reference.lu_solve(LU, piv, R), rtol=tol, atol=tol)


@pytest.mark.parametrize("B,n,m", [(1, 4, 3), (1000, 11, 1), (300, 2, 17), (7, 33, 513), (3, 11, 10_001)])
def test_batched_solve(B, n, m):
    A = well_conditioned(B, n, torch.float32, B + n)
    R = torch.randn(B, n, m, generator=torch.Generator().manual_seed(m), dtype=torch.float32)
    LU, piv = ops.lu_factor(A)
    X = ops.lu_solve(LU, piv, R)
    Xt = torch.linalg.solve(A.double(), R.double())
    torch.testing.assert_close(X.double(), Xt, rtol=1e-5, atol=1e-5)
    LU_t, piv_t = torch.linalg.lu_factor(A)
    torch.testing.assert_close(X, torch.linalg.lu_solve(LU_t, piv_t, R), rtol=1e-4, atol=1e-4)


def test_noncontiguous_inputs():
    A = well_conditioned(4, 9, torch.float64, 1)
    At = A.transpose(1, 2)  # non-contiguous A
    LU, piv = ops.lu_factor(At)
    LU2, piv2 = ops.lu_factor(At.contiguous())
    assert torch.equal(LU, LU2) and torch.equal(piv, piv2)
    big = torch.randn(4, 9, 2 * 257, dtype=torch.float64)
    R = big[:, :, ::2]  # no unit column stride
    torch.testing.assert_close(ops.lu_solve(LU, piv, R), torch.linalg.solve(At, R), rtol=1e-12, atol=1e-12)
    R2 = big[:, :, :257]  # unit column stride, row stride 514 (used without a copy)
    torch.testing.assert_close(ops.lu_solve(LU, piv, R2), torch.linalg.solve(At, R2), rtol=1e-12, atol=1e-12)
    assert ops.lu_solve(LU, piv, torch.empty(4, 9, 0, dtype=torch.float64)).shape == (4, 9, 0)


def test_deterministic_and_out():
    A = well_conditioned(1, 11, torch.float32, 5)[0]
    R = torch.randn(11, 300_001)
    LU, piv = ops.lu_factor(A)
    X = ops.lu_solve(LU, piv, R)
    assert torch.equal(X, ops.lu_solve(LU, piv, R))
    out = torch.full_like(R, float("nan"))
    assert ops.lu_solve(LU, piv, R, out=out) is out and torch.equal(out, X)
    with pytest.raises(ValueError, match="out must be"):
        ops.lu_solve(LU, piv, R, out=torch.empty(11, 5))
    torch.library.opcheck(torch.ops.fedkernels.lu_solve_out.default, (LU, piv, R[:, :100].contiguous(),
                                                                      torch.empty(11, 100)))


def test_bad_inputs():
    with pytest.raises(ValueError, match="square"):
        ops.lu_factor(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="square"):
        ops.lu_factor(torch.zeros(2, 2, 2, 2))
    with pytest.raises(ValueError, match=r"n must be in \[1, 64\]"):
        ops.lu_factor(torch.eye(65))
    with pytest.raises(ValueError, match="float32 or float64"):
        ops.lu_factor(torch.eye(3, dtype=torch.float16))
    for bad in (float("nan"), float("inf")):
        A = torch.eye(3)
        A[2, 1] = bad
        with pytest.raises(ValueError, match="finite"):
            ops.lu_factor(A)
    with pytest.raises(RuntimeError, match="finite"):  # the native op checks as well
        torch.ops.fedkernels.lu_factor(torch.tensor([[1.0, float("nan")], [0.0, 1.0]]))
    LU, piv = ops.lu_factor(torch.eye(3))
    with pytest.raises(ValueError, match=r"R must be \[3, m\]"):
        ops.lu_solve(LU, piv, torch.zeros(4, 2))
    with pytest.raises(ValueError, match="pivots must have shape"):
        ops.lu_solve(LU, piv[:2], torch.zeros(3, 2))
    with pytest.raises(ValueError, match="pivots must be int32"):
        ops.lu_solve(LU, piv.float(), torch.zeros(3, 2))
    with pytest.raises(RuntimeError, match="out of range"):
        ops.lu_solve(LU, torch.tensor([3, 1, 3], dtype=torch.int32), torch.zeros(3, 2))
    with pytest.raises(RuntimeError, match="singular factor"):
        ops.lu_solve(torch.zeros(3, 3), piv, torch.zeros(3, 2))


def test_one_size_limit_for_python_and_native():
    """The LU size limit is defined once (csrc/lu_limits.h): the wrapper reads it from build_info(), and the
    wrapper and the native op's last-line check refuse the same n."""
    import importlib
    from fedkernels import build_info
    n = build_info()["lu_max_n"]
    assert importlib.import_module("fedkernels.ops.lu").LU_MAX_N == ops.LU_MAX_N == n == 64   # 64: the docs' value
    LU, piv = ops.lu_factor(torch.eye(n, dtype=torch.float64))
    assert torch.equal(LU, torch.eye(n, dtype=torch.float64))
    with pytest.raises(ValueError, match=rf"lu_factor: n must be in \[1, {n}\]"):
        ops.lu_factor(torch.eye(n + 1))
    with pytest.raises(RuntimeError, match=rf"lu_factor: n must be in \[1, {n}\]"):
        torch.ops.fedkernels.lu_factor(torch.eye(n + 1))


def test_opcheck():
    A = well_conditioned(3, 5, torch.float64, 2)
    torch.library.opcheck(torch.ops.fedkernels.lu_factor.default, (A,))
    torch.library.opcheck(torch.ops.fedkernels.lu_factor.default, (A[0],))
    LU, piv, _ = torch.ops.fedkernels.lu_factor(A)
    torch.library.opcheck(torch.ops.fedkernels.lu_solve.default, (LU, piv, torch.randn(3, 5, 7, dtype=torch.float64)))
    torch.library.opcheck(torch.ops.fedkernels.lu_solve.default, (LU[0], piv[0], torch.randn(5, 9)))
