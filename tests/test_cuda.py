"""CUDA kernels against the float64 reference, the CPU ops and opcheck.

Every test whose data and unpacking do not depend on the device runs on ``dev`` = cpu and cuda:
the cpu case runs everywhere (so a bug in a test's data or unpacking shows on a CPU machine, not
first on a GPU), the cuda case is marked ``cuda`` and skipped (cleanly, at collection time)
without a CUDA device or without the CUDA build of fedkernels (``fedkernels.build_info()['cuda']``).
Tests of CUDA-only behaviour (host vectors, device asserts, graph capture) are cuda only. Run on a
GPU machine with ``python -m pytest -m cuda tests/test_cuda.py``.
"""
from __future__ import annotations

import re

import pytest
import spec_vectors   # tests/spec_vectors.py (its MIN_NORM_CASES are the spec's matrices, not this file's cases)
import torch

import fedkernels
from fedkernels import ops, reference


def _cuda_build() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        return bool(fedkernels.build_info().get("cuda", False))
    except Exception:  # pragma: no cover - broken install
        return False


NEEDS_CUDA = [pytest.mark.cuda,
              pytest.mark.skipif(not _cuda_build(), reason="needs a CUDA device and the CUDA build of fedkernels")]
DEV = "cuda"


def cuda_only(test):
    for mark in NEEDS_CUDA:
        test = mark(test)
    return test


@pytest.fixture(params=["cpu", pytest.param(DEV, marks=NEEDS_CUDA)])
def dev(request) -> str:
    return request.param

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def _randn(dev: str, *shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed), dtype=torch.float64).to(dtype).to(dev)


# ---- kstats (Kuramoto's statistics in one pass) ------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("K,d", [(1, 1), (3, 7), (10, 4099), (100, 300), (1000, 76), (2, 262177)])
def test_kstats_matches_reference_and_cpu(dev, K, d, dtype):
    base = _randn(dev, K, d + 3, dtype=dtype, seed=K + d)
    U = base[:, 1:1 + d]                                   # row stride d + 3, unaligned start
    p = torch.rand(K, generator=_gen(d), dtype=torch.float64) + 0.1
    p /= p.sum()
    got = ops.kstats(U, p)
    assert all(t.device.type == dev for t in got)
    want = reference.kstats(U.cpu(), p)
    A = U.cpu().double().abs()
    m = p @ A
    for g, w, S in zip(got[:3], want[:3], (A @ m, (A * A).sum(1), m @ m)):
        assert g.dtype == torch.float64 and torch.all((g.cpu() - w).abs() <= 1e-12 * S + 1e-300)
    assert got[3].cpu().tolist() == [True] * K
    again = ops.kstats(U, p)
    assert all(torch.equal(a, b) for a, b in zip(got, again))     # bitwise: fixed order, no atomics


def test_kstats_flags_exact(dev):
    for dtype in FLOATS:
        U = _randn(dev, 6, 999, dtype=dtype, seed=2)
        U[1, 5], U[3, 998] = float("nan"), float("-inf")
        U[0] = torch.finfo(dtype).max                       # finite (fp64: its squared norm overflows)
        ok = ops.kstats(U, torch.full((6,), 1 / 6, dtype=torch.float64))[3]
        assert ok.cpu().tolist() == [True, False, True, False, True, True], dtype


def test_kstats_empty(dev):
    dot, nsq, nbar, ok = ops.kstats(torch.empty(3, 0, device=dev), torch.full((3,), 1 / 3, dtype=torch.float64))
    assert float(dot.abs().sum() + nsq.sum() + nbar) == 0.0 and ok.all() and dot.device.type == dev


# ---- gram -----------------------------------------------------------------------------------------
# K <= 16: path R; K > 16: fp64 tensor cores (one diagonal block up to K = 128, off-diagonal blocks above)
GRAM_SHAPES = [(1, 1), (2, 3), (3, 7), (10, 4099), (16, 1000), (17, 513), (33, 2000), (70, 1031), (130, 777)]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("K,d", GRAM_SHAPES)
def test_gram_matches_reference(dev, K, d, dtype):
    U = _randn(dev, K, d, dtype=dtype, seed=K * 1000 + d)
    G = ops.gram(U)
    assert G.dtype == torch.float64 and G.device.type == dev and G.shape == (K, K)
    ref = reference.gram(U)  # exact float64 products: only the summation order differs
    torch.testing.assert_close(G, ref, rtol=1e-11, atol=1e-11 * d)
    assert torch.equal(G, G.T)


@pytest.mark.parametrize("K,d", [(5, 100), (12, 3333), (40, 777)])
def test_gram_rows_and_noncontiguous(dev, K, d):
    base = _randn(dev, K, d + 9, seed=3)
    U = base[:, 4:4 + d]  # row stride d + 9, unaligned start
    rows = torch.tensor([K - 1, 0, 2, 2], device=dev)
    G = ops.gram(U, rows=rows)
    torch.testing.assert_close(G, reference.gram(U, rows=rows), rtol=1e-11, atol=1e-11 * d)
    torch.testing.assert_close(ops.gram(U), reference.gram(U), rtol=1e-11, atol=1e-11 * d)


@pytest.mark.parametrize("K,d", [(10, 100_003), (64, 20_000)])
def test_gram_deterministic_and_matches_cpu(dev, K, d):
    U = _randn(dev, K, d, seed=11)
    G1, G2 = ops.gram(U), ops.gram(U)
    assert torch.equal(G1, G2)  # bitwise: fixed-order reduction, no atomics
    torch.testing.assert_close(G1.cpu(), ops.gram(U.cpu()), rtol=1e-11, atol=1e-11 * d)


def test_gram_empty(dev):
    U = torch.empty(3, 0, device=dev)
    assert torch.equal(ops.gram(U), torch.zeros(3, 3, dtype=torch.float64, device=dev))


# ---- weighted_sum ---------------------------------------------------------------------------------
def _wsum_tol(dtype):
    return {torch.float64: (1e-12, 1e-12), torch.float32: (1e-5, 1e-5), torch.float16: (1e-2, 1e-2),
            torch.bfloat16: (2e-2, 2e-2)}[dtype]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("K,d", [(1, 1), (3, 5), (10, 4099), (7, 1024), (300, 257)])
def test_weighted_sum_matches_reference(dev, K, d, dtype):
    U = _randn(dev, K, d, dtype=dtype, seed=K + d)
    coef = torch.randn(K, generator=_gen(1), dtype=torch.float64).to(dev)
    base = _randn(dev, d, dtype=dtype, seed=5)
    out = ops.weighted_sum(U, coef, base=base, alpha=0.7)
    ref = reference.weighted_sum(U, coef, base=base, alpha=0.7)
    rtol, atol = _wsum_tol(dtype)
    torch.testing.assert_close(out.double(), ref, rtol=rtol, atol=atol * max(1.0, float(K) ** 0.5))
    torch.testing.assert_close(out.cpu().double(), ops.weighted_sum(U.cpu(), coef.cpu(), base=base.cpu(), alpha=0.7).double(),
                               rtol=rtol, atol=atol * max(1.0, float(K) ** 0.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_weighted_sum_rows_inplace_unaligned(dev, dtype):
    K, d = 9, 5001
    big = _randn(dev, K, d + 3, dtype=dtype, seed=2)
    U = big[:, 1:1 + d]  # unaligned rows: scalar path
    rows = torch.tensor([8, 1, 1, 4], device=dev)
    coef = torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=torch.float64, device=dev)
    w = _randn(dev, d, dtype=dtype, seed=4)
    ref = reference.weighted_sum(U, coef, base=w, alpha=-2.0, rows=rows)
    got = ops.weighted_sum(U, coef, base=w, alpha=-2.0, rows=rows, out=w)  # in place
    assert got.data_ptr() == w.data_ptr()
    rtol, atol = _wsum_tol(dtype)
    torch.testing.assert_close(w.double(), ref, rtol=rtol, atol=atol * 4)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("K,d,off", [(1, 1, 0), (5, 4099, 0), (9, 5001, 1), (300, 257, 0)])
def test_weighted_sum_screened_flags_and_bits(dev, K, d, off, dtype):
    """The flags equal the reference's on aligned (vector) and unaligned (scalar) rows, with NaN,
    +-Inf and an fp32-overflowing finite row; the sum is weighted_sum's, bit for bit."""
    big = _randn(dev, K, d + 2, dtype=dtype, seed=K + d)
    U = big[:, off:off + d]
    bad = [k for k in range(K) if k % 4 == 1]
    for k in bad:
        U[k, (k * 7919) % d] = (float("nan"), float("inf"), float("-inf"))[k % 3]
    if K > 2 and dtype != torch.float64:
        U[K - 1].fill_(torch.finfo(dtype).max)              # finite, its sum overflows: still finite
    rows = torch.arange(K - 1, -1, -1, device=dev)
    coef = torch.rand(K, generator=_gen(3), dtype=torch.float64).to(dev)
    base = _randn(dev, d, dtype=dtype, seed=6)
    out, ok = ops.weighted_sum_screened(U, coef, base=base, alpha=0.5, rows=rows)
    _, want = reference.weighted_sum_screened(U, coef, base=base, alpha=0.5, rows=rows)
    assert ok.device == U.device and ok.cpu().tolist() == want.cpu().tolist()
    plain = ops.weighted_sum(U, coef, base=base, alpha=0.5, rows=rows)
    assert torch.equal(out.isnan(), plain.isnan()) and torch.equal(out.nan_to_num(), plain.nan_to_num())
    into = base.clone()                                  # out= (here base itself: in place), same bits and flags
    got, ok = ops.weighted_sum_screened(U, coef, base=into, alpha=0.5, rows=rows, out=into)
    assert got is into and ok.cpu().tolist() == want.cpu().tolist()
    assert torch.equal(into.isnan(), plain.isnan()) and torch.equal(into.nan_to_num(), plain.nan_to_num())


def test_weighted_sum_nan_propagates(dev):
    U = _randn(dev, 4, 300, seed=9)
    U[2, 17] = float("nan")
    out = ops.weighted_sum(U, torch.ones(4, dtype=torch.float64, device=dev))
    assert torch.isnan(out[17]) and torch.isfinite(out[:17]).all() and torch.isfinite(out[18:]).all()


# ---- finite_rows ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("K,d", [(1, 1), (5, 7), (6, 70_001)])
def test_finite_rows(dev, K, d, dtype):
    U = _randn(dev, K, d, dtype=dtype, seed=d)
    if K > 1:
        U[0, d - 1] = float("nan")
        U[K - 1, d // 2] = float("inf")
    ok = ops.finite_rows(U)
    assert ok.dtype == torch.bool
    assert torch.equal(ok.cpu(), reference.finite_rows(U.cpu()))
    view = U[:, 1:] if d > 1 else U
    assert torch.equal(ops.finite_rows(view).cpu(), reference.finite_rows(view.cpu()))


# ---- min_norm -------------------------------------------------------------------------------------
def _kkt(G, lam, tol=1e-9):
    G = 0.5 * (G + G.T)
    v = G @ lam
    q = float(lam @ v)
    assert float(lam.min()) >= 0.0
    assert abs(float(lam.sum()) - 1.0) < 1e-12
    assert float(v.min()) >= q - tol * max(1.0, float(G.diagonal().abs().max()))
    return q


# G = U U^T / p + I is strongly convex, so lam is unique and away/pairwise Frank-Wolfe converge
# linearly (the CPU op reaches tol 1e-12 in 1910 / 992 iterations at K=100, 18993 / 9899 at K=1000).
# Plain FW converges sublinearly when the optimum has many active vertices: it is tested where it
# converges (K <= 10: 8735 iterations at K=10); a rank-deficient G at K=100/1000 converges for no method.
MIN_NORM_CASES = [(K, m) for m in ("fw", "away", "pairwise") for K in (1, 2, 3, 10, 100, 1000)
                  if m != "fw" or K <= 10]


def _min_norm_G(K: int) -> torch.Tensor:
    U = torch.randn(K, max(2, K // 2), generator=_gen(K), dtype=torch.float64)
    return U @ U.T / U.shape[1] + torch.eye(K, dtype=torch.float64)


@pytest.mark.parametrize("K,method", MIN_NORM_CASES)
def test_min_norm_matches_reference(dev, K, method):
    if dev == "cpu" and K > 100:
        pytest.skip("K=1000 on the CPU: ~15 s of float64 reference solver (the cuda case runs it)")
    max_iter = 30000
    U = torch.randn(K, max(2, K // 2), generator=_gen(K), dtype=torch.float64)
    G = _min_norm_G(K).to(dev)
    lam, it, gap = torch.ops.fedkernels.min_norm(G, max_iter, 1e-12, 1e-15, method, "best_pair", False, None)
    assert lam.device.type == dev and it.dtype == torch.long and gap.dtype == torch.float64
    assert int(it) < max_iter  # converged
    lam_c = lam.cpu()
    q = _kkt(G.cpu(), lam_c, tol=1e-7)
    lam_r, _, _ = reference.min_norm(G.cpu(), max_iter=max_iter, tol=1e-12, method=method, polish=False)
    q_r = float(lam_r @ (G.cpu() @ lam_r))
    assert abs(q - q_r) <= 1e-9 * max(1.0, float(G.diagonal().max()))
    d_gpu, d_ref = U.T @ lam_c, U.T @ lam_r  # lam is unique (G strongly convex): so is U^T lam
    torch.testing.assert_close(d_gpu, d_ref, rtol=0, atol=1e-6)
    lam2, it2, gap2 = torch.ops.fedkernels.min_norm(G, max_iter, 1e-12, 1e-15, method, "best_pair", False, None)
    assert torch.equal(lam, lam2) and torch.equal(it, it2) and torch.equal(gap, gap2)


@pytest.mark.parametrize("method", ["fw", "away", "pairwise"])
def test_min_norm_spec_vectors(dev, method):
    for m, q_exp in spec_vectors.MIN_NORM_CASES:   # fedaware.md §9 A3, A4, A5, A7
        M = torch.tensor(m, dtype=torch.float64)
        G = (M @ M.T).to(dev)
        lam, _, _ = torch.ops.fedkernels.min_norm(G, 10000, 1e-14, 1e-15, method, "best_pair", False, None)
        q = _kkt(G.cpu(), lam.cpu())
        assert abs(q - q_exp) <= 1e-10


def test_min_norm_warm_start_and_min_diag(dev):
    U = torch.randn(30, 12, generator=_gen(3), dtype=torch.float64)
    G = (U @ U.T).to(dev)
    lam0 = torch.rand(30, generator=_gen(4), dtype=torch.float64).to(dev)
    for init, l0 in (("min_diag", None), ("best_pair", lam0)):
        lam, _, _ = torch.ops.fedkernels.min_norm(G, 5000, 1e-12, 1e-15, "away", init, False, l0)
        _kkt(G.cpu(), lam.cpu(), tol=1e-7)


@cuda_only
def test_min_norm_rejects_host_only_modes():
    G = torch.eye(3, dtype=torch.float64, device=DEV)
    with pytest.raises(RuntimeError, match="polish"):
        torch.ops.fedkernels.min_norm(G, 100, 1e-12, 1e-15, "away", "best_pair", True, None)
    with pytest.raises(RuntimeError, match="code_compat"):
        torch.ops.fedkernels.min_norm(G, 100, 1e-12, 1e-15, "code_compat", "best_pair", False, None)


# ---- gc_project_ ----------------------------------------------------------------------------------
GC_SHAPES = [(8, 3, 3, 3), (64, 64, 3, 3), (16, 2048), (4, 3000), (6, 25088), (10,), (5, 1), (), (0, 4)]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("policy", ["skip", "center"])
def test_gc_project_matches_reference(dev, dtype, policy):
    ts = [_randn(dev, *s, dtype=dtype, seed=i) if len(s) else torch.tensor(1.5, dtype=dtype, device=dev)
          for i, s in enumerate(GC_SHAPES)]
    ts.append(_randn(dev, 32, 40, dtype=dtype, seed=99).T)  # non-contiguous: goes through a copy
    ref = reference.gc_project([t.cpu() for t in ts], vector_policy=policy)
    out = ops.gc_project(ts, vector_policy=policy)
    work = [t.clone() for t in ts]
    ops.gc_project_(work, vector_policy=policy)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    for o, w, r in zip(out, work, ref):
        torch.testing.assert_close(o.cpu().double(), r.double(), rtol=tol, atol=tol)
        torch.testing.assert_close(w.cpu().double(), r.double(), rtol=tol, atol=tol)
    cpu = ops.gc_project([t.cpu() for t in ts], vector_policy=policy)
    for o, c in zip(out, cpu):
        torch.testing.assert_close(o.cpu().double(), c.double(), rtol=tol, atol=tol)


def test_gc_project_deterministic(dev):
    t = _randn(dev, 256, 4608, seed=1)
    a, b = ops.gc_project([t])[0], ops.gc_project([t])[0]
    assert torch.equal(a, b)


# ---- LU -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 2, 4, 11, 21, 32, 33, 64])
def test_lu_factor_solve(dev, n, dtype):
    B, m = 37, 300
    A = torch.randn(B, n, n, generator=_gen(n), dtype=torch.float64).to(dtype)
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
    R = torch.randn(B - 2, n, m, generator=_gen(n + 1), dtype=torch.float64).to(dtype)
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


# ---- opcheck --------------------------------------------------------------------------------------
@cuda_only
def test_opcheck_cuda():  # the CPU ops' opchecks: tests/test_<op>.py
    U = _randn(DEV, 6, 300, seed=1)
    rows = torch.tensor([1, 3], device=DEV)
    coef = torch.randn(6, generator=_gen(2), dtype=torch.float64).to(DEV)
    base = _randn(DEV, 300, seed=3)
    torch.library.opcheck(torch.ops.fedkernels.gram.default, (U, None))
    torch.library.opcheck(torch.ops.fedkernels.gram.default, (U, rows))
    torch.library.opcheck(torch.ops.fedkernels.weighted_sum.default, (U, coef, base, 0.5, None))
    torch.library.opcheck(torch.ops.fedkernels.weighted_sum.default, (U, coef[:2], None, 1.0, rows))
    torch.library.opcheck(torch.ops.fedkernels.weighted_sum_out.default, (U, coef, base, 1.0, None, base.clone()))
    torch.library.opcheck(torch.ops.fedkernels.weighted_sum_screened_out.default,
                          (U, coef, base, 1.0, None, torch.empty_like(base)))
    torch.library.opcheck(torch.ops.fedkernels.finite_rows.default, (U,))
    G = (U.double() @ U.double().T).contiguous()
    torch.library.opcheck(torch.ops.fedkernels.min_norm.default,
                          (G, 1000, 1e-12, 1e-15, "away", "best_pair", False, None))
    torch.library.opcheck(torch.ops.fedkernels.gc_project_.default, ([_randn(DEV, 8, 27, seed=5), _randn(DEV, 4, 2000, seed=6)],
                                                                      "center", 2))
    torch.library.opcheck(torch.ops.fedkernels.gc_project.default, ([_randn(DEV, 8, 27, seed=5), _randn(DEV, 7, seed=6)],
                                                                     "center", 2))
    A = _randn(DEV, 3, 5, 5, dtype=torch.float64, seed=7)
    torch.library.opcheck(torch.ops.fedkernels.lu_factor.default, (A,))
    LU, piv, _ = torch.ops.fedkernels.lu_factor(A)
    torch.library.opcheck(torch.ops.fedkernels.lu_solve.default, (LU, piv, _randn(DEV, 3, 5, 40, dtype=torch.float64, seed=8)))


# ---- fedecado_be_step (fused FedECADO backward-Euler attempt) -------------------------------------
def _be_inputs(dev, K, d, dtype, seed):
    g = _gen(seed)
    rn = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)   # noqa: E731
    T = torch.rand(K, generator=g, dtype=torch.float64) * 1.9 + 0.1
    tl = 0.3 * float(T.max())
    dt = 0.5 * (float(T.max()) - tl)
    ig = 1.0 / (1.0 / dt + torch.rand(K, generator=g, dtype=torch.float64) * 5)
    on = lambda x: x.to(dtype).to(dev)   # noqa: E731
    return [on(rn(d)), on(rn(K, d)), on(rn(d)), on(rn(K, d)), on(rn(K, d)), on(rn(d)),
            (tl + dt) / T, tl / T, ig, dt, 1.7]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
# K <= 32: registers; above: per-thread shared-memory slots; K = 500 in fp64: the recomputing pass
@pytest.mark.parametrize("K,d", [(1, 1), (3, 1000), (5, 4099), (16, 777), (32, 2049), (33, 513), (70, 300), (500, 65)])
def test_be_step_matches_reference_and_cpu(dev, K, d, dtype):
    args = _be_inputs(dev, K, d, dtype, seed=K * 31 + d)
    xn, In, lte = ops.fedecado_be_step(*args)
    assert xn.device.type == In.device.type == lte.device.type == dev and lte.dtype == torch.float64
    cpu = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    rx, rI, rl = reference.fedecado_be_step(*cpu)
    cx, cI, cl = ops.fedecado_be_step(*cpu)
    tol = 1e-11 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(xn.cpu().double(), rx, rtol=tol, atol=tol)
    torch.testing.assert_close(In.cpu().double(), rI, rtol=tol, atol=tol)
    torch.testing.assert_close(xn.cpu(), cx, rtol=tol, atol=tol)
    torch.testing.assert_close(lte.cpu(), rl, rtol=tol * 100, atol=tol * 100)
    torch.testing.assert_close(lte.cpu(), cl, rtol=tol * 100, atol=tol * 100)


def test_be_step_noncontiguous_out_nan_deterministic(dev):
    K, d = 6, 3001
    args = _be_inputs(dev, K, d, torch.float32, seed=5)
    big = torch.zeros(K, d + 5, device=dev)
    big[:, 5:] = args[3]
    a2 = list(args)
    a2[3] = big[:, 5:]                                  # row-strided column chunk
    x1, I1, l1 = ops.fedecado_be_step(*args)
    xo, Io, lo = torch.empty(d, device=dev), torch.empty(K, d, device=dev), torch.empty(2, dtype=torch.float64, device=dev)
    ops.fedecado_be_step(*a2, out=(xo, Io), lte_out=lo)
    assert torch.equal(xo, x1) and torch.equal(Io, I1) and torch.equal(lo, l1)
    for _ in range(3):                                  # atomicMax of a max: bitwise repeatable
        x2, I2, l2 = ops.fedecado_be_step(*args)
        assert torch.equal(x2, x1) and torch.equal(I2, I1) and torch.equal(l2, l1)
    a3 = list(args)
    a3[3] = args[3].clone()
    a3[3][2, 1234] = float("nan")
    _, _, l3 = ops.fedecado_be_step(*a3)
    assert torch.isinf(l3[1]) and float(l3[1]) > 0


@cuda_only
def test_be_step_opcheck_cuda():  # the CPU ops' opchecks: tests/test_<op>.py
    args = _be_inputs(DEV, 3, 70, torch.float64, seed=2)
    torch.library.opcheck(torch.ops.fedkernels.fedecado_be_step.default, tuple(args))
    outs = (torch.empty(70, dtype=torch.float64, device=DEV), torch.empty(3, 70, dtype=torch.float64, device=DEV),
            torch.empty(2, dtype=torch.float64, device=DEV))
    torch.library.opcheck(torch.ops.fedkernels.fedecado_be_step_out.default, tuple(args) + outs)


# ---- every op on CUDA, host vectors, no device asserts, NaN-safe pivots, capture -------------------
@cuda_only
def test_host_coef_and_rows_match_device_ones():
    K, d = 12, 3001
    U = _randn(DEV, K, d, seed=21)
    coef = torch.randn(5, generator=_gen(22), dtype=torch.float64)
    rows = torch.tensor([11, 0, 3, 3, 7])
    a = torch.ops.fedkernels.weighted_sum(U, coef, None, 0.5, rows)               # host coef and rows
    b = torch.ops.fedkernels.weighted_sum(U, coef.to(DEV), None, 0.5, rows.to(DEV))
    assert torch.equal(a, b)
    assert torch.equal(torch.ops.fedkernels.gram(U, rows), torch.ops.fedkernels.gram(U, rows.to(DEV)))
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.fedkernels.gram(U, torch.tensor([0, K]))                           # host rows: checked


@cuda_only
def test_device_rows_out_of_range_give_nan_not_a_device_assert():
    U = _randn(DEV, 6, 700, seed=23)
    bad = torch.tensor([0, 6, 2], device=DEV)
    out = torch.ops.fedkernels.weighted_sum(U, torch.ones(3, dtype=torch.float64, device=DEV), None, 1.0, bad)
    G = torch.ops.fedkernels.gram(U, bad)
    torch.cuda.synchronize()                                                          # the context survives
    assert torch.isnan(out).all() and torch.isnan(G[1]).all() and torch.isfinite(G[0]).all()
    assert torch.isfinite(ops.gram(U)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("on_device", [False, True])
def test_weighted_sum_coef_beyond_float_matches_cpu(dev, dtype, on_device):
    U = _randn(dev, 3, 2051, dtype=dtype, seed=24)
    coef = torch.tensor([1e39, -1e39, 1e-3], dtype=torch.float64)
    got = torch.ops.fedkernels.weighted_sum(U, coef.to(dev) if on_device else coef, None, 1.0, None)
    want = torch.ops.fedkernels.weighted_sum(U.cpu(), coef, None, 1.0, None)
    assert torch.isfinite(got.double()).sum() == torch.isfinite(want.double()).sum()
    torch.testing.assert_close(got.cpu(), want, rtol=2e-2, atol=2e-2, equal_nan=True)


@cuda_only
@pytest.mark.parametrize("n", [5, 32, 40])
def test_lu_factor_nan_does_not_hang_and_pivots_match_the_cpu_rule(n):  # the CPU op refuses NaN
    A = torch.randn(8, n, n, generator=_gen(n), dtype=torch.float64)
    A[0, 2, 0] = float("nan")          # NaN below the diagonal: never the pivot
    A[1, 0, 0] = float("nan")          # NaN on the diagonal: keeps row 0
    A[2, :, 0] = float("nan")
    LU, piv, info = torch.ops.fedkernels.lu_factor(A.to(DEV))
    torch.cuda.synchronize()
    assert int(piv[1, 0]) == 1 and int(piv[2, 0]) == 1
    assert int(piv[0, 0]) - 1 == int(torch.where(torch.isnan(A[0, :, 0]), -1.0, A[0, :, 0].abs()).argmax())
    LUc, pivc, _ = torch.ops.fedkernels.lu_factor(A[3:])
    assert torch.equal(piv[3:].cpu(), pivc)


def test_lu_solve_out_and_arrowhead_on_cuda(dev):
    A = torch.randn(4, 9, 9, generator=_gen(31), dtype=torch.float64) + 9 * torch.eye(9, dtype=torch.float64)
    LU, piv, _ = torch.ops.fedkernels.lu_factor(A.to(dev))
    R = torch.randn(4, 9, 500, generator=_gen(32), dtype=torch.float64).to(dev)
    X = torch.ops.fedkernels.lu_solve(LU, piv, R)
    out = torch.empty_like(R)
    torch.ops.fedkernels.lu_solve_out(LU, piv, R, out)
    assert torch.equal(out, X)
    torch.ops.fedkernels.lu_solve_out(LU, piv.cpu(), R, R)                               # in place, host pivots
    assert torch.equal(R, X)
    a = torch.rand(6, generator=_gen(33), dtype=torch.float64) + 0.5
    b, c = -0.1 * torch.rand(6, generator=_gen(34), dtype=torch.float64), torch.rand(6, generator=_gen(35),
                                                                                      dtype=torch.float64)
    for dt in (torch.float32, torch.float64):
        r0, RR = _randn(dev, 1001, dtype=dt, seed=36), _randn(dev, 6, 1001, dtype=dt, seed=37)
        x, I = torch.ops.fedkernels.arrowhead_solve(a, b, c, 1.0, r0, RR)
        xr, Ir = reference.arrowhead_solve(a, b, c, 1.0, r0.cpu(), RR.cpu())
        tol = 1e-12 if dt == torch.float64 else 1e-5
        torch.testing.assert_close(x.cpu().double(), xr, rtol=tol, atol=tol)
        torch.testing.assert_close(I.cpu().double(), Ir, rtol=tol, atol=tol)


@pytest.mark.parametrize("momentum,first", [(0.0, False), (0.9, True), (0.9, False)])
def test_fused_sgd_step_cuda_matches_cpu(dev, momentum, first):
    shapes = [(8, 3, 3, 3), (8,), (10, 72), (5,)]
    mk = lambda s: [torch.randn(*sh, generator=_gen(s + i), dtype=torch.float64).float() for i, sh in enumerate(shapes)]  # noqa: E731
    p, g, buf, c, ci = mk(1), mk(10), mk(20), mk(30), mk(40)
    pd, gd, bd, cd, cid = ([t.to(dev, copy=True) for t in x] for x in (p, g, buf, c, ci))
    mask = [True, False, True, True]
    cadd = [c[0], None, c[2], None]
    args = (0.1, momentum, 1e-3, first, "center", 2)
    torch.ops.fedkernels.fused_sgd_step_(p, g, buf if momentum else [], cadd, ci, mask, *args)
    torch.ops.fedkernels.fused_sgd_step_(pd, gd, bd if momentum else [], [cd[0], None, cd[2], None], cid, mask, *args)
    for x, y in zip(pd + (bd if momentum else []), p + (buf if momentum else [])):
        torch.testing.assert_close(x.cpu(), y, rtol=1e-5, atol=1e-6)
    for x, y in zip(gd, g):
        assert torch.equal(x.cpu(), y)                                                # grads untouched


@cuda_only
def test_host_coef_ops_capture_in_a_cuda_graph():
    U = _randn(DEV, 10, 4099, seed=41)
    coef = torch.rand(10, generator=_gen(42), dtype=torch.float64)
    out = torch.empty(4099, device=DEV)
    want = torch.ops.fedkernels.weighted_sum(U, coef, None, 1.0, None)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.ops.fedkernels.weighted_sum_out(U, coef, None, 1.0, None, out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        torch.ops.fedkernels.weighted_sum_out(U, coef, None, 1.0, None, out)
        ops.gc_project_([U[:4].view(4, 4099)], "skip")
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@cuda_only
def test_opcheck_new_cuda_ops():  # the CPU ops' opchecks: tests/test_<op>.py
    A = _randn(DEV, 3, 5, 5, dtype=torch.float64, seed=7)
    LU, piv, _ = torch.ops.fedkernels.lu_factor(A)
    R = _randn(DEV, 3, 5, 40, dtype=torch.float64, seed=8)
    torch.library.opcheck(torch.ops.fedkernels.lu_solve_out.default, (LU, piv, R, torch.empty_like(R)))
    a = torch.rand(4, dtype=torch.float64) + 1
    torch.library.opcheck(torch.ops.fedkernels.arrowhead_solve.default,
                          (a, -a / 10, a / 5, 1.0, _randn(DEV, 30, dtype=torch.float64, seed=9),
                           _randn(DEV, 4, 30, dtype=torch.float64, seed=10)))


# ---- a bad argument raises one clear line, and the next valid call is right ------------------------
# Each op gets bad arguments (shape, dtype, device mix, rows out of range, NaN where it screens) through
# its Python wrapper (ValueError) and, where the wrapper would catch it first, through the native op
# itself (RuntimeError from csrc/<op>_checks.h: the message formats numbers and devices in C++, which crashed
# the process in a build with a private static libstdc++); then a valid call is checked against the
# float64 reference: the process and, on a GPU, the CUDA context stay usable.
def _one_line(exc, match, fn, *args, **kwargs):
    with pytest.raises(exc) as e:
        fn(*args, **kwargs)
    msg = str(e.value)
    assert msg and "\n" not in msg.strip(), f"not one line: {msg!r}"
    assert re.search(match, msg), f"{msg!r} does not match {match!r}"


def _settle(dev: str) -> None:
    if dev == DEV:
        torch.cuda.synchronize()  # an asynchronous CUDA error would surface here


def test_bad_args_weighted_sum(dev):
    U, coef, base = _randn(dev, 4, 301, seed=51), torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=torch.float64), None
    F = torch.ops.fedkernels
    _one_line(ValueError, r"weighted_sum: coef must be a 1-D tensor of length 4 .*got shape \(3,\)",
              ops.weighted_sum, U, coef[:3])
    _one_line(RuntimeError, r"weighted_sum: coef must be 1-D of length 4 .*got shape \[3\]", F.weighted_sum,
              U, coef[:3], None, 1.0, None)
    _one_line(ValueError, r"weighted_sum: rows must lie in \[0, 4\), got min 0 max 4", ops.weighted_sum,
              U, coef[:2], rows=[0, 4])
    # host rows are range-checked by the native op (csrc/cpu: "rows entry 4", the CUDA glue: "rows[1] = 4")
    _one_line(RuntimeError, r"weighted_sum: rows( entry|\[1\] =) 4 out of range \[0, 4\)", F.weighted_sum,
              U, coef[:2], None, 1.0, torch.tensor([0, 4]))
    _one_line(ValueError, r"weighted_sum: base must have dtype torch.float32 .*got torch.float64",
              ops.weighted_sum, U, coef, base=torch.zeros(301, dtype=torch.float64, device=dev))
    _one_line(ValueError, r"weighted_sum: U must have a floating dtype .*got torch.int64", ops.weighted_sum,
              torch.zeros(4, 301, dtype=torch.long, device=dev), coef)
    if dev == DEV:
        _one_line(ValueError, r"weighted_sum: base is on cpu but U is on cuda", ops.weighted_sum, U, coef,
                  base=torch.zeros(301))
        _one_line(RuntimeError, r"weighted_sum: .*base.* must be on cuda.*got cpu", F.weighted_sum,
                  U, coef, torch.zeros(301), 1.0, None)
    base = _randn(dev, 301, seed=52)
    out = ops.weighted_sum(U, coef, base=base, alpha=0.5, rows=[3, 0, 0, 2])
    _settle(dev)
    torch.testing.assert_close(out.double(), reference.weighted_sum(U, coef, base=base, alpha=0.5, rows=[3, 0, 0, 2]),
                               rtol=1e-5, atol=1e-5)


def test_bad_args_gram(dev):
    U, F = _randn(dev, 5, 257, seed=53), torch.ops.fedkernels
    _one_line(ValueError, r"gram: U must be a 2-D \[K, d\] tensor, got shape \(5, 257, 1\)", ops.gram, U[..., None])
    _one_line(RuntimeError, r"gram: U must be 2-D \[K, d\], got 3-D", F.gram, U[..., None], None)
    _one_line(ValueError, r"gram: rows must lie in \[0, 5\), got min -1 max 2", ops.gram, U, rows=[2, -1])
    _one_line(RuntimeError, r"gram: rows( entry|\[1\] =) 5 out of range \[0, 5\)", F.gram, U, torch.tensor([1, 5]))
    _one_line(ValueError, r"gram: rows must hold integer row indices, got dtype torch.float32", ops.gram, U,
              rows=torch.tensor([1.0]))
    G = ops.gram(U, rows=[4, 1])
    _settle(dev)
    torch.testing.assert_close(G, reference.gram(U, rows=[4, 1]), rtol=1e-11, atol=1e-11 * 257)


def test_bad_args_finite_rows(dev):
    U = _randn(dev, 6, 1001, seed=54)
    _one_line(ValueError, r"finite_rows: U must be a 2-D \[K, d\] tensor, got shape \(1001,\)", ops.finite_rows, U[0])
    _one_line(RuntimeError, r"finite_rows: U must be 2-D \[K, d\], got 1-D", torch.ops.fedkernels.finite_rows, U[0])
    _one_line(ValueError, r"finite_rows: U must have a floating dtype .*got torch.int32", ops.finite_rows,
              torch.zeros(6, 3, dtype=torch.int32, device=dev))
    U[4, 999] = float("nan")
    ok = ops.finite_rows(U)
    _settle(dev)
    assert ok.device.type == dev and torch.equal(ok.cpu(), reference.finite_rows(U.cpu()))
    assert ok.tolist() == [True, True, True, True, False, True]


def test_bad_args_min_norm(dev):
    G = _min_norm_G(7).to(dev)
    F = torch.ops.fedkernels
    _one_line(ValueError, r"min_norm: G must be a square \[K, K\] Gram matrix, got shape \(7, 6\)", ops.min_norm,
              G[:, :6])
    _one_line(RuntimeError, r"min_norm: G must be a square \[K, K\] matrix, got shape \[7, 6\]", F.min_norm,
              G[:, :6].contiguous(), 100, 1e-12, 1e-15, "away", "best_pair", False, None)
    _one_line(RuntimeError, r"min_norm: max_iter must be >= 0, got -5", F.min_norm,
              G, -5, 1e-12, 1e-15, "away", "best_pair", False, None)
    bad = G.clone()
    bad[2, 3] = float("nan")
    _one_line(ValueError, r"min_norm: G must be finite, got nan at \[2, 3\]", ops.min_norm, bad)
    _one_line(ValueError, r"min_norm: method must be one of .*got 'newton'", ops.min_norm, G, method="newton")
    _one_line(ValueError, r"min_norm: lam0 must be a 1-D tensor of length 7, got shape \(6,\)", ops.min_norm, G,
              lam0=torch.ones(6, dtype=torch.float64, device=dev))
    lam, _, _ = F.min_norm(G, 5000, 1e-12, 1e-15, "away", "best_pair", False, None)
    _settle(dev)
    lam_r, _, _ = reference.min_norm(G.cpu(), max_iter=5000, tol=1e-12, method="away", polish=False)
    Gc = G.cpu()
    assert lam.device.type == dev
    assert abs(float(lam.cpu() @ Gc @ lam.cpu()) - float(lam_r @ Gc @ lam_r)) <= 1e-9


def test_bad_args_gc_project(dev):
    ts = [_randn(dev, 8, 3, 3, 3, seed=55), _randn(dev, 8, seed=56)]
    F = torch.ops.fedkernels
    _one_line(ValueError, r"gc_project_: min_fanin must be an int >= 1, got 0", ops.gc_project_, ts, min_fanin=0)
    _one_line(RuntimeError, r"gc_project: min_fanin must be >= 1, got -7", F.gc_project_, ts, "skip", -7)
    _one_line(ValueError, r"gc_project_: tensors\[1\] must have a floating dtype .*got torch.int64", ops.gc_project_,
              [ts[0], torch.zeros(4, 3, dtype=torch.long, device=dev)])
    _one_line(ValueError, r"gc_project_: vector_policy must be 'skip' or 'center', got 'mean'", ops.gc_project_, ts,
              vector_policy="mean")
    if dev == DEV:
        _one_line(ValueError, r"gc_project_: all tensors must be on one device; tensors\[0\] is on cuda",
                  ops.gc_project_, [ts[0], torch.zeros(4, 3)])
    want = reference.gc_project([t.cpu() for t in ts], vector_policy="center")
    ops.gc_project_(ts, vector_policy="center")
    _settle(dev)
    for t, r in zip(ts, want):
        torch.testing.assert_close(t.cpu().double(), r.double(), rtol=1e-5, atol=1e-5)


def test_bad_args_fused_sgd_step(dev):
    shapes = [(6, 2, 3), (6,), (4, 9)]
    p = [_randn(dev, *s, seed=60 + i) for i, s in enumerate(shapes)]
    g = [_randn(dev, *s, seed=70 + i) for i, s in enumerate(shapes)]
    buf = [_randn(dev, *s, seed=80 + i) for i, s in enumerate(shapes)]
    F = torch.ops.fedkernels
    _one_line(ValueError, r"fused_sgd_step_: momentum must be >= 0, got -0.5", ops.fused_sgd_step_, p, g, buf,
              lr=0.1, momentum=-0.5)
    _one_line(ValueError, r"fused_sgd_step_: gc_mask must have one entry per parameter \(3\), got 2",
              ops.fused_sgd_step_, p, g, lr=0.1, gc_mask=[True, False])
    _one_line(ValueError, r"fused_sgd_step_: lr must be a finite number, got nan", ops.fused_sgd_step_, p, g,
              lr=float("nan"))
    _one_line(RuntimeError, r"fused_sgd_step_: grads has 2 tensors, expected 3", F.fused_sgd_step_,
              p, g[:2], [], [], [], [], 0.1, 0.0, 0.0, False, "skip", 2)
    _one_line(RuntimeError, r"fused_sgd_step_: grads\[2\] has shape \[9, 4\], expected the shape of params\[2\] "
              r"\[4, 9\]", F.fused_sgd_step_, p, g[:2] + [g[2].T.contiguous()], [], [], [], [], 0.1, 0.0, 0.0,
              False, "skip", 2)
    if dev == DEV:
        _one_line(ValueError, r"fused_sgd_step_: grads\[1\].*cpu", ops.fused_sgd_step_, p,
                  [g[0], g[1].cpu(), g[2]], lr=0.1)
    rp, rb = [t.cpu().clone() for t in p], [t.cpu().clone() for t in buf]
    reference.fused_sgd_step_(rp, [t.cpu() for t in g], rb, lr=0.1, momentum=0.9, weight_decay=1e-3,
                              gc_mask=[True, False, True], vector_policy="center")
    ops.fused_sgd_step_(p, g, buf, lr=0.1, momentum=0.9, weight_decay=1e-3, gc_mask=[True, False, True],
                        vector_policy="center")
    _settle(dev)
    for x, y in zip(p + buf, rp + rb):
        torch.testing.assert_close(x.cpu().double(), y.double(), rtol=1e-5, atol=1e-6)


def test_bad_args_fedecado_be_step(dev):
    args = _be_inputs(dev, 4, 333, torch.float64, seed=57)
    F = torch.ops.fedkernels

    def with_(i, v):
        a = list(args)
        a[i] = v
        return a
    _one_line(ValueError, r"fedecado_be_step: Icur must have shape \[K, d\] = \[4, 333\] .*got \(3, 333\)",
              ops.fedecado_be_step, *with_(1, args[1][:3]))
    _one_line(RuntimeError, r"fedecado_be_step: Icur must be \[K, d\] = \[4, 333\], got \[3, 333\]",
              F.fedecado_be_step, *with_(1, args[1][:3]))
    _one_line(ValueError, r"fedecado_be_step: dt must be a finite number > 0, got nan", ops.fedecado_be_step,
              *with_(9, float("nan")))
    _one_line(RuntimeError, r"fedecado_be_step: dt must be finite and > 0, got -1", F.fedecado_be_step,
              *with_(9, -1.0))
    _one_line(ValueError, r"fedecado_be_step: xc must have dtype torch.float64 .*got torch.float32",
              ops.fedecado_be_step, *with_(0, args[0].float()))
    if dev == DEV:
        _one_line(ValueError, r"fedecado_be_step: Ik must have U's dtype torch.float64 and device cuda.*on cpu",
                  ops.fedecado_be_step, *with_(4, args[4].cpu()))
    xn, In, lte = ops.fedecado_be_step(*args)
    _settle(dev)
    rx, rI, rl = reference.fedecado_be_step(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args])
    torch.testing.assert_close(xn.cpu(), rx, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(In.cpu(), rI, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(lte.cpu(), rl, rtol=1e-9, atol=1e-9)


def test_bad_args_lu(dev):
    A = (torch.randn(3, 6, 6, generator=_gen(58), dtype=torch.float64) + 6 * torch.eye(6, dtype=torch.float64)).to(dev)
    R = torch.randn(3, 6, 40, generator=_gen(59), dtype=torch.float64).to(dev)
    F = torch.ops.fedkernels
    _one_line(ValueError, r"lu_factor: A must be a square \[n, n\] or batched \[B, n, n\] matrix, got shape \(3, 6, 5\)",
              ops.lu_factor, A[..., :5])
    _one_line(RuntimeError, r"lu_factor: n must be in \[1, 64\] \(small systems\), got 70", F.lu_factor,
              torch.zeros(70, 70, dtype=torch.float64, device=dev))
    bad = A.clone()
    bad[1, 2, 3] = float("nan")
    _one_line(ValueError, r"lu_factor: A must be finite \(got NaN or Inf entries\)", ops.lu_factor, bad)
    _one_line(ValueError, r"lu_factor: A must be float32 or float64, got torch.float16", ops.lu_factor, A.half())
    LU, piv = ops.lu_factor(A)
    _one_line(ValueError, r"lu_solve: pivots must be int32 or int64, got torch.float32", ops.lu_solve, LU,
              piv.float(), R)
    _one_line(RuntimeError, r"lu_solve: pivots must be \[n\] \(or \[B, n\]\), got \[3, 5\]", F.lu_solve, LU,
              piv[:, :5].contiguous(), R)
    _one_line(ValueError, r"lu_solve: R must be .*got shape \(3, 5, 40\)", ops.lu_solve, LU, piv, R[:, :5])
    if dev == DEV:
        _one_line(ValueError, r"lu_solve: LU, pivots and R must be on one device, got cuda.*cpu", ops.lu_solve,
                  LU, piv, R.cpu())
    X = ops.lu_solve(LU, piv, R)
    _settle(dev)
    torch.testing.assert_close(X.cpu(), torch.linalg.solve(A.cpu(), R.cpu()), rtol=1e-10, atol=1e-10)
    LU_r, piv_r = reference.lu_factor(A.cpu())
    torch.testing.assert_close(X.cpu(), reference.lu_solve(LU_r, piv_r, R.cpu()), rtol=1e-10, atol=1e-10)
