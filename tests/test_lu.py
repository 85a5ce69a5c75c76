"""lu_factor / lu_factor_ex / lu_solve: spec fedecado.md section 9 (U3, U10; U2, U5d, U9 in test_arrowhead_solve.py),
torch.linalg agreement, float64 reference, odd and non-contiguous shapes, opcheck, bad inputs."""

import math
import re
import numpy as np
import pytest
import torch

from fedkernels import ops, reference
from devices import (
    DEV,
    DEVICES,
    cuda_only,
    gen,
    one_line,
    randn,
    settle,
)  # tests/devices.py: every case on cpu and cuda
import host_harness  # tests/host_harness.py: the CUDA kernels' per-thread logic on the host
from host_harness import hexf


def well_conditioned(B, n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(B, n, n, generator=g, dtype=torch.float64) + 2.0 * n**0.5 * torch.eye(n, dtype=torch.float64)
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
    torch.testing.assert_close(
        (LU[same] / scale[same]).double(), (LU_t[same] / scale[same]).double(), rtol=tol, atol=tol
    )
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
    torch.library.opcheck(
        torch.ops.fedkernels.lu_solve_out.default, (LU, piv, R[:, :100].contiguous(), torch.empty(11, 100))
    )


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
    assert importlib.import_module("fedkernels.ops.lu").LU_MAX_N == ops.LU_MAX_N == n == 64  # 64: the docs' value
    LU, piv = ops.lu_factor(torch.eye(n, dtype=torch.float64))
    assert torch.equal(LU, torch.eye(n, dtype=torch.float64))
    with pytest.raises(ValueError, match=rf"lu_factor: n must be in \[1, {n}\]"):
        ops.lu_factor(torch.eye(n + 1))
    with pytest.raises(ValueError, match=rf"lu_factor: n must be in \[1, {n}\]"):
        torch.ops.fedkernels.lu_factor(torch.eye(n + 1))


@pytest.mark.parametrize("dev", DEVICES)
def test_opcheck(dev):
    A = well_conditioned(3, 5, torch.float64, 2).to(dev)
    torch.library.opcheck(torch.ops.fedkernels.lu_factor.default, (A,))
    torch.library.opcheck(torch.ops.fedkernels.lu_factor.default, (A[0],))
    LU, piv, _ = torch.ops.fedkernels.lu_factor(A)
    R = torch.randn(3, 5, 7, dtype=torch.float64).to(dev)
    torch.library.opcheck(torch.ops.fedkernels.lu_solve.default, (LU, piv, R))
    torch.library.opcheck(torch.ops.fedkernels.lu_solve.default, (LU[0], piv[0], torch.randn(5, 9).to(dev)))
    if dev == DEV:  # the CPU case of lu_solve_out: test_deterministic_and_out
        torch.library.opcheck(torch.ops.fedkernels.lu_solve_out.default, (LU, piv, R, torch.empty_like(R)))


# ---- on every device (cpu, and cuda where there is one: tests/devices.py) --------------------
@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 2, 4, 11, 21, 32, 33, 64])
def test_lu_factor_solve(dev, n, dtype):
    B, m = 37, 300
    A = torch.randn(B, n, n, generator=gen(n), dtype=torch.float64).to(dtype)
    A[0] = 0.0  # singular: info = 1, no NaN from a division
    if n > 2:
        A[1, :, 1] = 0.0  # zero pivot in column 1 -> info = 2
    LU, piv, info = torch.ops.fedkernels.lu_factor(A.to(dev))
    LU_c, piv_c, info_c = torch.ops.fedkernels.lu_factor(A)  # CPU op: same LAPACK getf2 rules
    assert torch.equal(piv.cpu(), piv_c) and torch.equal(info.cpu(), info_c)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(LU.cpu(), LU_c, rtol=tol, atol=tol)
    LU_r, piv_r, info_r = torch.linalg.lu_factor_ex(A[2:].double())
    assert torch.equal(piv.cpu()[2:], piv_r.to(torch.int32))
    R = torch.randn(B - 2, n, m, generator=gen(n + 1), dtype=torch.float64).to(dtype)
    X = torch.ops.fedkernels.lu_solve(LU[2:], piv[2:], R.to(dev))
    assert X.dtype == dtype and X.shape == R.shape
    X_c = torch.ops.fedkernels.lu_solve(LU_c[2:], piv_c[2:], R)
    torch.testing.assert_close(X.cpu(), X_c, rtol=tol * 10, atol=tol * 10)
    X_r = torch.linalg.solve(A[2:].double(), R.double())
    torch.testing.assert_close(X.cpu().double(), X_r, rtol=tol * 100, atol=tol * 100)
    A1 = A[5].to(dev)  # unbatched
    LU1, piv1, info1 = torch.ops.fedkernels.lu_factor(A1)
    assert LU1.shape == (n, n) and piv1.shape == (n,) and info1.shape == ()
    torch.testing.assert_close(LU1.cpu(), LU_c[5], rtol=tol, atol=tol)


@cuda_only
@pytest.mark.parametrize("n", [5, 32, 40])
def test_lu_factor_nan_does_not_hang_and_pivots_match_the_cpu_rule(n):  # the CPU op refuses NaN
    A = torch.randn(8, n, n, generator=gen(n), dtype=torch.float64)
    A[0, 2, 0] = float("nan")  # NaN below the diagonal: never the pivot
    A[1, 0, 0] = float("nan")  # NaN on the diagonal: keeps row 0
    A[2, :, 0] = float("nan")
    LU, piv, info = torch.ops.fedkernels.lu_factor(A.to(DEV))
    torch.cuda.synchronize()
    assert int(piv[1, 0]) == 1 and int(piv[2, 0]) == 1
    assert int(piv[0, 0]) - 1 == int(torch.where(torch.isnan(A[0, :, 0]), -1.0, A[0, :, 0].abs()).argmax())
    LUc, pivc, _ = torch.ops.fedkernels.lu_factor(A[3:])
    assert torch.equal(piv[3:].cpu(), pivc)


@pytest.mark.parametrize("dev", DEVICES)
def test_lu_solve_out_and_arrowhead_on_every_device(dev):
    A = torch.randn(4, 9, 9, generator=gen(31), dtype=torch.float64) + 9 * torch.eye(9, dtype=torch.float64)
    LU, piv, _ = torch.ops.fedkernels.lu_factor(A.to(dev))
    R = torch.randn(4, 9, 500, generator=gen(32), dtype=torch.float64).to(dev)
    X = torch.ops.fedkernels.lu_solve(LU, piv, R)
    out = torch.empty_like(R)
    torch.ops.fedkernels.lu_solve_out(LU, piv, R, out)
    assert torch.equal(out, X)
    torch.ops.fedkernels.lu_solve_out(LU, piv.cpu(), R, R)  # in place, host pivots
    assert torch.equal(R, X)
    a = torch.rand(6, generator=gen(33), dtype=torch.float64) + 0.5
    b, c = (
        -0.1 * torch.rand(6, generator=gen(34), dtype=torch.float64),
        torch.rand(6, generator=gen(35), dtype=torch.float64),
    )
    for dt in (torch.float32, torch.float64):
        r0, RR = randn(dev, 1001, dtype=dt, seed=36), randn(dev, 6, 1001, dtype=dt, seed=37)
        x, I = torch.ops.fedkernels.arrowhead_solve(a, b, c, 1.0, r0, RR)
        xr, Ir = reference.arrowhead_solve(a, b, c, 1.0, r0.cpu(), RR.cpu())
        tol = 1e-12 if dt == torch.float64 else 1e-5
        torch.testing.assert_close(x.cpu().double(), xr, rtol=tol, atol=tol)
        torch.testing.assert_close(I.cpu().double(), Ir, rtol=tol, atol=tol)


@pytest.mark.parametrize("dev", DEVICES)
def test_bad_args_lu(dev):
    A = (torch.randn(3, 6, 6, generator=gen(58), dtype=torch.float64) + 6 * torch.eye(6, dtype=torch.float64)).to(dev)
    R = torch.randn(3, 6, 40, generator=gen(59), dtype=torch.float64).to(dev)
    F = torch.ops.fedkernels
    one_line(
        ValueError,
        r"lu_factor: A must be a square \[n, n\] or batched \[B, n, n\] matrix, got shape \(3, 6, 5\)",
        ops.lu_factor,
        A[..., :5],
    )
    one_line(
        ValueError,
        r"lu_factor: n must be in \[1, 64\] \(small systems; use torch.linalg for larger\), got 70",
        F.lu_factor,
        torch.zeros(70, 70, dtype=torch.float64, device=dev),
    )
    bad = A.clone()
    bad[1, 2, 3] = float("nan")
    one_line(ValueError, r"lu_factor: A must be finite \(got NaN or Inf entries\)", ops.lu_factor, bad)
    one_line(ValueError, r"lu_factor: A must be float32 or float64, got torch.float16", ops.lu_factor, A.half())
    LU, piv = ops.lu_factor(A)
    one_line(
        ValueError, r"lu_solve: pivots must be int32 or int64, got torch.float32", ops.lu_solve, LU, piv.float(), R
    )
    one_line(
        ValueError,
        r"lu_solve: pivots must have shape \(3, 6\), got \(3, 5\)",
        F.lu_solve,
        LU,
        piv[:, :5].contiguous(),
        R,
    )
    one_line(ValueError, r"lu_solve: R must be .*got shape \(3, 5, 40\)", ops.lu_solve, LU, piv, R[:, :5])
    if dev == DEV:
        one_line(
            ValueError,
            r"lu_solve: LU, pivots and R must be on one device, got cuda.*cpu",
            ops.lu_solve,
            LU,
            piv,
            R.cpu(),
        )
    X = ops.lu_solve(LU, piv, R)
    settle(dev)
    torch.testing.assert_close(X.cpu(), torch.linalg.solve(A.cpu(), R.cpu()), rtol=1e-10, atol=1e-10)
    LU_r, piv_r = reference.lu_factor(A.cpu())
    torch.testing.assert_close(X.cpu(), reference.lu_solve(LU_r, piv_r, R.cpu()), rtol=1e-10, atol=1e-10)


# ---- the CUDA kernel's per-thread logic on the host (tests/host_harness.py, tests/cuda_host/lu.cpp) ----------------
@pytest.fixture(scope="module")
def harness():
    yield from host_harness.session()


def _scan_pivot(col, k):
    """csrc/cpu/lu.cpp getf2: p = k, best = |a_kk|; the first i > k with |a_ik| > best (NaN never)."""
    p, best = k, abs(col[k])
    for i in range(k + 1, len(col)):
        v = abs(col[i])
        if v > best:
            p, best = i, v
    return p


def _columns():
    g = gen(5)
    nan, inf = float("nan"), float("inf")
    cols = []
    for n in (1, 2, 5, 31, 32, 33, 64):
        base = torch.randn(n, generator=g, dtype=torch.float64).tolist()
        cols.append(base)
        cols.append([abs(x) if i % 3 else -abs(x) for i, x in enumerate(base)])
        cols.append([1.0 if i % 2 else -1.0 for i in range(n)])  # ties: smallest index
        cols.append([0.0] * n)  # zero pivot
        for pos in {0, n // 2, n - 1}:
            c = list(base)
            c[pos] = nan
            cols.append(c)  # NaN on/below the diagonal
            c2 = list(base)
            c2[pos] = inf if pos % 2 else -inf
            cols.append(c2)
        cols.append([nan] * n)
        cols.append([inf, nan, -inf] * (n // 3) + [inf] * (n % 3))
    return cols


def test_lu_pivot_total_order_every_lane_agrees(harness):
    checked = 0
    for col in _columns():
        n = len(col)
        for k in sorted({0, n // 2, n - 1}):
            warp_p, block_p = (int(x) for x in harness("pivot", k, n, col))
            want = _scan_pivot(col, k)
            assert block_p == want, (col, k)
            if n <= 32:
                assert warp_p == want, (col, k)  # -2 would mean two lanes chose differently
            assert k <= block_p < n
            checked += 1
    assert checked > 100


def test_lu_pivot_scan_rule_is_the_cpu_op():
    """The Python scan above is the CPU op's rule (on finite columns, where the CPU op runs)."""
    for col in _columns():
        if not all(math.isfinite(x) for x in col) or len(col) < 2:
            continue
        n = len(col)
        A = torch.eye(n, dtype=torch.float64)
        A[:, 0] = torch.tensor(col, dtype=torch.float64)
        _, piv, _ = torch.ops.fedkernels.lu_factor(A)
        assert int(piv[0]) - 1 == _scan_pivot(col, 0)


@pytest.mark.parametrize("n", [1, 3, 17, 32, 33, 64])
def test_lu_solve_column_matches_reference(harness, n):
    m = 5
    A = torch.randn(n, n, generator=gen(n), dtype=torch.float64) + n * torch.eye(n, dtype=torch.float64)
    A = A[torch.randperm(n, generator=gen(n + 1))]  # pivoting needed
    LU, piv, info = torch.ops.fedkernels.lu_factor(A)
    assert int(info) == 0
    R = torch.randn(n, m, generator=gen(n + 2), dtype=torch.float64)
    ans = harness("lusolve", n, m, LU, [int(p) for p in piv], R)
    assert ans[0] == "1"
    X = torch.tensor([hexf(s) for s in ans[1:]], dtype=torch.float64).view(n, m)
    torch.testing.assert_close(X, reference.lu_solve(LU, piv, R), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(X, torch.linalg.solve(A, R), rtol=1e-9, atol=1e-9)
    if n > 1:
        bad = [int(p) for p in piv]
        bad[n - 1] = n + 1  # out of range: NaN columns, no assert
        ans = harness("lusolve", n, m, LU, bad, R)
        assert ans[0] == "0" and all(math.isnan(hexf(s)) for s in ans[1:])


# ---- tensor properties: checked once, by the native op, for the wrappers and a direct call alike ----
def _bad_factor_cases(dev):
    """(A, the message after "lu_factor: ")."""
    z = lambda *s, dt=torch.float64: torch.zeros(*s, dtype=dt, device=dev)  # noqa: E731
    square = "A must be a square [n, n] or batched [B, n, n] matrix, got shape"
    n_range = "n must be in [1, 64] (small systems; use torch.linalg for larger), got"
    return [
        (z(3), f"{square} (3,)"),
        (z(3, 4), f"{square} (3, 4)"),
        (z(2, 2, 3, 3), f"{square} (2, 2, 3, 3)"),
        (z(3, 3, dt=torch.int64), "A must be float32 or float64, got torch.int64"),
        (z(2, 3, 3, dt=torch.float16), "A must be float32 or float64, got torch.float16"),
        (z(70, 70), f"{n_range} 70"),
        (z(2, 0, 0), f"{n_range} 0"),
    ]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", range(7))
def test_bad_tensor_args_same_from_wrapper_and_native(dev, case):
    A, msg = _bad_factor_cases(dev)[case]
    for fn in (ops.lu_factor, torch.ops.fedkernels.lu_factor):
        one_line(ValueError, "^" + re.escape("lu_factor: " + msg) + "$", fn, A)
    one_line(ValueError, "^" + re.escape("lu_factor_ex: " + msg) + "$", ops.lu_factor_ex, A)  # (its own name)


def _bad_solve_cases(dev):
    """(LU, pivots, R, out, the message after "lu_solve: ") around a batch of 3 systems of n = 6, fp64."""
    A = (torch.randn(3, 6, 6, generator=gen(60), dtype=torch.float64) + 6 * torch.eye(6, dtype=torch.float64)).to(dev)
    LU, piv = ops.lu_factor(A)
    R = torch.randn(3, 6, 40, generator=gen(61), dtype=torch.float64).to(dev)
    out = torch.empty_like(R)
    dv = "cuda:0" if dev == DEV else "cpu"
    want_out = f"out must be a contiguous torch.float64 tensor of shape (3, 6, 40) on {dv}"
    return [
        (LU[0, 0], piv, R, out, "LU must be [n, n] or [B, n, n], got shape (6,)"),
        (LU[..., :5], piv, R, out, "LU must be [n, n] or [B, n, n], got shape (3, 6, 5)"),
        (LU.long(), piv, R, out, "LU must have a floating dtype, got torch.int64"),
        (LU, piv.float(), R, out, "pivots must be int32 or int64, got torch.float32"),
        (LU, piv.short(), R, out, "pivots must be int32 or int64, got torch.int16"),
        (LU, piv[:, :5], R, out, "pivots must have shape (3, 6), got (3, 5)"),
        (LU, piv[0], R, out, "pivots must have shape (3, 6), got (6,)"),
        (LU, piv, R[:, :5], out, "R must be [3, 6, m], got shape (3, 5, 40)"),
        (LU, piv, R[0], out, "R must be [3, 6, m], got shape (6, 40)"),
        (LU[0], piv[0], R, out, "R must be [6, m], got shape (3, 6, 40)"),
        (LU, piv, R.float(), out, want_out.replace("float64", "float32")),  # (R is fine: out is not R's dtype)
        (LU, piv, R.to(torch.int32), out, "R must be float32 or float64, got torch.int32"),
        (LU, piv, R, out.float(), want_out),
        (LU, piv, R, out[:, :5], want_out),
        (LU, piv, R, torch.empty(3, 40, 6, dtype=torch.float64, device=dev).transpose(1, 2), want_out),
    ]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", range(15))
def test_bad_tensor_args_same_from_wrapper_and_native_solve(dev, case):
    LU, piv, R, out, msg = _bad_solve_cases(dev)[case]
    if not msg.startswith("out "):
        for fn in (lambda: ops.lu_solve(LU, piv, R), lambda: torch.ops.fedkernels.lu_solve(LU, piv, R)):
            one_line(ValueError, "^" + re.escape("lu_solve: " + msg) + "$", fn)
    with torch.no_grad():
        for fn in (
            lambda: ops.lu_solve(LU, piv, R, out=out),
            lambda: torch.ops.fedkernels.lu_solve_out(LU, piv, R, out),
        ):
            one_line(ValueError, "^" + re.escape("lu_solve: " + msg) + "$", fn)
