"""CUDA kernels against the float64 reference, the CPU ops and opcheck.

Marked ``cuda``; skipped (cleanly, at collection time) without a CUDA device or without the CUDA
build of fedkernels (``fedkernels.build_info()['cuda']``). Run on a GPU machine with
``python -m pytest -m cuda tests/test_cuda.py``.
"""
from __future__ import annotations

import pytest
import torch
from spec_vectors import MIN_NORM_CASES   # tests/spec_vectors.py

import fedkernels
from fedkernels import ops, reference


def _cuda_build() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        return bool(fedkernels.build_info().get("cuda", False))
    except Exception:  # pragma: no cover - broken install
        return False


pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not _cuda_build(), reason="needs a CUDA device and the CUDA build of fedkernels"),
]

DEV = "cuda"
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def _randn(*shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed), dtype=torch.float64).to(dtype).to(DEV)


# ---- gram -----------------------------------------------------------------------------------------
# K <= 16: path R; K > 16: fp64 tensor cores (one diagonal block up to K = 128, off-diagonal blocks above)
GRAM_SHAPES = [(1, 1), (2, 3), (3, 7), (10, 4099), (16, 1000), (17, 513), (33, 2000), (70, 1031), (130, 777)]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("K,d", GRAM_SHAPES)
def test_gram_matches_reference(K, d, dtype):
    U = _randn(K, d, dtype=dtype, seed=K * 1000 + d)
    G = ops.gram(U)
    assert G.dtype == torch.float64 and G.device.type == "cuda" and G.shape == (K, K)
    ref = reference.gram(U)  # exact float64 products: only the summation order differs
    torch.testing.assert_close(G, ref, rtol=1e-11, atol=1e-11 * d)
    assert torch.equal(G, G.T)


@pytest.mark.parametrize("K,d", [(5, 100), (12, 3333), (40, 777)])
def test_gram_rows_and_noncontiguous(K, d):
    base = _randn(K, d + 9, seed=3)
    U = base[:, 4:4 + d]  # row stride d + 9, unaligned start
    rows = torch.tensor([K - 1, 0, 2, 2], device=DEV)
    G = ops.gram(U, rows=rows)
    torch.testing.assert_close(G, reference.gram(U, rows=rows), rtol=1e-11, atol=1e-11 * d)
    torch.testing.assert_close(ops.gram(U), reference.gram(U), rtol=1e-11, atol=1e-11 * d)


@pytest.mark.parametrize("K,d", [(10, 100_003), (64, 20_000)])
def test_gram_deterministic_and_matches_cpu(K, d):
    U = _randn(K, d, seed=11)
    G1, G2 = ops.gram(U), ops.gram(U)
    assert torch.equal(G1, G2)  # bitwise: fixed-order reduction, no atomics
    torch.testing.assert_close(G1.cpu(), ops.gram(U.cpu()), rtol=1e-11, atol=1e-11 * d)


def test_gram_empty():
    U = torch.empty(3, 0, device=DEV)
    assert torch.equal(ops.gram(U), torch.zeros(3, 3, dtype=torch.float64, device=DEV))


# ---- weighted_sum ---------------------------------------------------------------------------------
def _wsum_tol(dtype):
    return {torch.float64: (1e-12, 1e-12), torch.float32: (1e-5, 1e-5), torch.float16: (1e-2, 1e-2),
            torch.bfloat16: (2e-2, 2e-2)}[dtype]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("K,d", [(1, 1), (3, 5), (10, 4099), (7, 1024), (300, 257)])
def test_weighted_sum_matches_reference(K, d, dtype):
    U = _randn(K, d, dtype=dtype, seed=K + d)
    coef = torch.randn(K, generator=_gen(1), dtype=torch.float64).to(DEV)
    base = _randn(d, dtype=dtype, seed=5)
    out = ops.weighted_sum(U, coef, base=base, alpha=0.7)
    ref = reference.weighted_sum(U, coef, base=base, alpha=0.7)
    rtol, atol = _wsum_tol(dtype)
    torch.testing.assert_close(out.double(), ref, rtol=rtol, atol=atol * max(1.0, float(K) ** 0.5))
    torch.testing.assert_close(out.cpu().double(), ops.weighted_sum(U.cpu(), coef.cpu(), base=base.cpu(), alpha=0.7).double(),
                               rtol=rtol, atol=atol * max(1.0, float(K) ** 0.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_weighted_sum_rows_inplace_unaligned(dtype):
    K, d = 9, 5001
    big = _randn(K, d + 3, dtype=dtype, seed=2)
    U = big[:, 1:1 + d]  # unaligned rows: scalar path
    rows = torch.tensor([8, 1, 1, 4], device=DEV)
    coef = torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=torch.float64, device=DEV)
    w = _randn(d, dtype=dtype, seed=4)
    ref = reference.weighted_sum(U, coef, base=w, alpha=-2.0, rows=rows)
    got = ops.weighted_sum(U, coef, base=w, alpha=-2.0, rows=rows, out=w)  # in place
    assert got.data_ptr() == w.data_ptr()
    rtol, atol = _wsum_tol(dtype)
    torch.testing.assert_close(w.double(), ref, rtol=rtol, atol=atol * 4)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("K,d,off", [(1, 1, 0), (5, 4099, 0), (9, 5001, 1), (300, 257, 0)])
def test_weighted_sum_screened_flags_and_bits(K, d, off, dtype):
    """The flags equal the reference's on aligned (vector) and unaligned (scalar) rows, with NaN,
    +-Inf and an fp32-overflowing finite row; the sum is weighted_sum's, bit for bit."""
    big = _randn(K, d + 2, dtype=dtype, seed=K + d)
    U = big[:, off:off + d]
    bad = [k for k in range(K) if k % 4 == 1]
    for k in bad:
        U[k, (k * 7919) % d] = (float("nan"), float("inf"), float("-inf"))[k % 3]
    if K > 2 and dtype != torch.float64:
        U[K - 1].fill_(torch.finfo(dtype).max)              # finite, its sum overflows: still finite
    rows = torch.arange(K - 1, -1, -1)
    coef = torch.rand(K, generator=_gen(3), dtype=torch.float64)
    base = _randn(d, dtype=dtype, seed=6)
    out, ok = ops.weighted_sum_screened(U, coef, base=base, alpha=0.5, rows=rows)
    _, want = reference.weighted_sum_screened(U, coef, base=base, alpha=0.5, rows=rows)
    assert ok.device == U.device and ok.cpu().tolist() == want.cpu().tolist()
    plain = ops.weighted_sum(U, coef, base=base, alpha=0.5, rows=rows)
    assert torch.equal(out.isnan(), plain.isnan()) and torch.equal(out.nan_to_num(), plain.nan_to_num())


def test_weighted_sum_nan_propagates():
    U = _randn(4, 300, seed=9)
    U[2, 17] = float("nan")
    out = ops.weighted_sum(U, torch.ones(4, dtype=torch.float64, device=DEV))
    assert torch.isnan(out[17]) and torch.isfinite(out[:17]).all() and torch.isfinite(out[18:]).all()


# ---- finite_rows ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("K,d", [(1, 1), (5, 7), (6, 70_001)])
def test_finite_rows(K, d, dtype):
    U = _randn(K, d, dtype=dtype, seed=d)
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
def test_min_norm_matches_reference(K, method):
    max_iter = 30000
    U = torch.randn(K, max(2, K // 2), generator=_gen(K), dtype=torch.float64)
    G = _min_norm_G(K).to(DEV)
    lam, it, gap = torch.ops.fedkernels.min_norm(G, max_iter, 1e-12, 1e-15, method, "best_pair", False, None)
    assert lam.device.type == "cuda" and it.dtype == torch.long and gap.dtype == torch.float64
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
def test_min_norm_spec_vectors(method):
    for m, q_exp in MIN_NORM_CASES:   # fedaware.md §9 A3, A4, A5, A7 (tests/spec_vectors.py)
        M = torch.tensor(m, dtype=torch.float64)
        G = (M @ M.T).to(DEV)
        lam, _, _ = torch.ops.fedkernels.min_norm(G, 10000, 1e-14, 1e-15, method, "best_pair", False, None)
        q = _kkt(G.cpu(), lam.cpu())
        assert abs(q - q_exp) <= 1e-10


def test_min_norm_warm_start_and_min_diag():
    U = torch.randn(30, 12, generator=_gen(3), dtype=torch.float64)
    G = (U @ U.T).to(DEV)
    lam0 = torch.rand(30, generator=_gen(4), dtype=torch.float64).to(DEV)
    for init, l0 in (("min_diag", None), ("best_pair", lam0)):
        lam, _, _ = torch.ops.fedkernels.min_norm(G, 5000, 1e-12, 1e-15, "away", init, False, l0)
        _kkt(G.cpu(), lam.cpu(), tol=1e-7)


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
def test_gc_project_matches_reference(dtype, policy):
    ts = [_randn(*s, dtype=dtype, seed=i) if len(s) else torch.tensor(1.5, dtype=dtype, device=DEV)
          for i, s in enumerate(GC_SHAPES)]
    ts.append(_randn(32, 40, dtype=dtype, seed=99).T)  # non-contiguous: goes through a copy
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


def test_gc_project_deterministic():
    t = _randn(256, 4608, seed=1)
    a, b = ops.gc_project([t])[0], ops.gc_project([t])[0]
    assert torch.equal(a, b)


# ---- LU -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 2, 4, 11, 21, 32, 33, 64])
def test_lu_factor_solve(n, dtype):
    B, m = 37, 300
    A = torch.randn(B, n, n, generator=_gen(n), dtype=torch.float64).to(dtype)
    A[0] = 0.0  # singular: info = 1, no NaN from a division
    if n > 2:
        A[1, :, 1] = 0.0  # zero pivot in column 1 -> info = 2
    LU, piv, info = torch.ops.fedkernels.lu_factor(A.to(DEV))
    LU_c, piv_c, info_c = torch.ops.fedkernels.lu_factor(A)  # CPU op: same LAPACK getf2 rules
    assert torch.equal(piv.cpu(), piv_c) and torch.equal(info.cpu(), info_c)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(LU.cpu(), LU_c, rtol=tol, atol=tol)
    LU_r, piv_r, info_r = torch.linalg.lu_factor_ex(A[2:].double())
    assert torch.equal(piv.cpu()[2:], piv_r.to(torch.int32))
    R = torch.randn(B - 2, n, m, generator=_gen(n + 1), dtype=torch.float64).to(dtype)
    X = torch.ops.fedkernels.lu_solve(LU[2:], piv[2:], R.to(DEV))
    assert X.dtype == dtype and X.shape == R.shape
    X_c = torch.ops.fedkernels.lu_solve(LU_c[2:], piv_c[2:], R)
    torch.testing.assert_close(X.cpu(), X_c, rtol=tol * 10, atol=tol * 10)
    X_r = torch.linalg.solve(A[2:].double(), R.double())
    torch.testing.assert_close(X.cpu().double(), X_r, rtol=tol * 100, atol=tol * 100)
    A1 = A[5].to(DEV)  # unbatched
    LU1, piv1, info1 = torch.ops.fedkernels.lu_factor(A1)
    assert LU1.shape == (n, n) and piv1.shape == (n,) and info1.shape == ()
    torch.testing.assert_close(LU1.cpu(), LU_c[5], rtol=tol, atol=tol)


# ---- opcheck --------------------------------------------------------------------------------------
def test_opcheck_cuda():
    U = _randn(6, 300, seed=1)
    rows = torch.tensor([1, 3], device=DEV)
    coef = torch.randn(6, generator=_gen(2), dtype=torch.float64).to(DEV)
    base = _randn(300, seed=3)
    torch.library.opcheck(torch.ops.fedkernels.gram.default, (U, None))
    torch.library.opcheck(torch.ops.fedkernels.gram.default, (U, rows))
    torch.library.opcheck(torch.ops.fedkernels.weighted_sum.default, (U, coef, base, 0.5, None))
    torch.library.opcheck(torch.ops.fedkernels.weighted_sum.default, (U, coef[:2], None, 1.0, rows))
    torch.library.opcheck(torch.ops.fedkernels.weighted_sum_out.default, (U, coef, base, 1.0, None, base.clone()))
    torch.library.opcheck(torch.ops.fedkernels.finite_rows.default, (U,))
    G = (U.double() @ U.double().T).contiguous()
    torch.library.opcheck(torch.ops.fedkernels.min_norm.default,
                          (G, 1000, 1e-12, 1e-15, "away", "best_pair", False, None))
    torch.library.opcheck(torch.ops.fedkernels.gc_project_.default, ([_randn(8, 27, seed=5), _randn(4, 2000, seed=6)],
                                                                      "center", 2))
    torch.library.opcheck(torch.ops.fedkernels.gc_project.default, ([_randn(8, 27, seed=5), _randn(7, seed=6)],
                                                                     "center", 2))
    A = _randn(3, 5, 5, dtype=torch.float64, seed=7)
    torch.library.opcheck(torch.ops.fedkernels.lu_factor.default, (A,))
    LU, piv, _ = torch.ops.fedkernels.lu_factor(A)
    torch.library.opcheck(torch.ops.fedkernels.lu_solve.default, (LU, piv, _randn(3, 5, 40, dtype=torch.float64, seed=8)))


# ---- fedecado_be_step (fused FedECADO backward-Euler attempt) -------------------------------------
def _be_inputs(K, d, dtype, seed):
    g = _gen(seed)
    rn = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)   # noqa: E731
    T = torch.rand(K, generator=g, dtype=torch.float64) * 1.9 + 0.1
    tl = 0.3 * float(T.max())
    dt = 0.5 * (float(T.max()) - tl)
    ig = 1.0 / (1.0 / dt + torch.rand(K, generator=g, dtype=torch.float64) * 5)
    dev = lambda x: x.to(dtype).to(DEV)   # noqa: E731
    return [dev(rn(d)), dev(rn(K, d)), dev(rn(d)), dev(rn(K, d)), dev(rn(K, d)), dev(rn(d)),
            (tl + dt) / T, tl / T, ig, dt, 1.7]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
# K <= 32: registers; above: per-thread shared-memory slots; K = 500 in fp64: the recomputing pass
@pytest.mark.parametrize("K,d", [(1, 1), (3, 1000), (5, 4099), (16, 777), (32, 2049), (33, 513), (70, 300), (500, 65)])
def test_be_step_matches_reference_and_cpu(K, d, dtype):
    args = _be_inputs(K, d, dtype, seed=K * 31 + d)
    xn, In, lte = ops.fedecado_be_step(*args)
    assert xn.is_cuda and In.is_cuda and lte.is_cuda and lte.dtype == torch.float64
    cpu = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    rx, rI, rl = reference.fedecado_be_step(*cpu)
    cx, cI, cl = ops.fedecado_be_step(*cpu)
    tol = 1e-11 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(xn.cpu().double(), rx, rtol=tol, atol=tol)
    torch.testing.assert_close(In.cpu().double(), rI, rtol=tol, atol=tol)
    torch.testing.assert_close(xn.cpu(), cx, rtol=tol, atol=tol)
    torch.testing.assert_close(lte.cpu(), rl, rtol=tol * 100, atol=tol * 100)
    torch.testing.assert_close(lte.cpu(), cl, rtol=tol * 100, atol=tol * 100)


def test_be_step_noncontiguous_out_nan_deterministic():
    K, d = 6, 3001
    args = _be_inputs(K, d, torch.float32, seed=5)
    big = torch.zeros(K, d + 5, device=DEV)
    big[:, 5:] = args[3]
    a2 = list(args)
    a2[3] = big[:, 5:]                                  # row-strided column chunk
    x1, I1, l1 = ops.fedecado_be_step(*args)
    xo, Io, lo = torch.empty(d, device=DEV), torch.empty(K, d, device=DEV), torch.empty(2, dtype=torch.float64, device=DEV)
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


def test_be_step_opcheck_cuda():
    args = _be_inputs(3, 70, torch.float64, seed=2)
    torch.library.opcheck(torch.ops.fedkernels.fedecado_be_step.default, tuple(args))
    outs = (torch.empty(70, dtype=torch.float64, device=DEV), torch.empty(3, 70, dtype=torch.float64, device=DEV),
            torch.empty(2, dtype=torch.float64, device=DEV))
    torch.library.opcheck(torch.ops.fedkernels.fedecado_be_step_out.default, tuple(args) + outs)


# ---- issue 18: every op on CUDA, host vectors, no device asserts, NaN-safe pivots, capture ----------
def test_host_coef_and_rows_match_device_ones():
    K, d = 12, 3001
    U = _randn(K, d, seed=21)
    coef = torch.randn(5, generator=_gen(22), dtype=torch.float64)
    rows = torch.tensor([11, 0, 3, 3, 7])
    a = torch.ops.fedkernels.weighted_sum(U, coef, None, 0.5, rows)               # host coef and rows
    b = torch.ops.fedkernels.weighted_sum(U, coef.to(DEV), None, 0.5, rows.to(DEV))
    assert torch.equal(a, b)
    assert torch.equal(torch.ops.fedkernels.gram(U, rows), torch.ops.fedkernels.gram(U, rows.to(DEV)))
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.fedkernels.gram(U, torch.tensor([0, K]))                           # host rows: checked


def test_device_rows_out_of_range_give_nan_not_a_device_assert():
    U = _randn(6, 700, seed=23)
    bad = torch.tensor([0, 6, 2], device=DEV)
    out = torch.ops.fedkernels.weighted_sum(U, torch.ones(3, dtype=torch.float64, device=DEV), None, 1.0, bad)
    G = torch.ops.fedkernels.gram(U, bad)
    torch.cuda.synchronize()                                                          # the context survives
    assert torch.isnan(out).all() and torch.isnan(G[1]).all() and torch.isfinite(G[0]).all()
    assert torch.isfinite(ops.gram(U)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("on_device", [False, True])
def test_weighted_sum_coef_beyond_float_matches_cpu(dtype, on_device):
    U = _randn(3, 2051, dtype=dtype, seed=24)
    coef = torch.tensor([1e39, -1e39, 1e-3], dtype=torch.float64)
    got = torch.ops.fedkernels.weighted_sum(U, coef.to(DEV) if on_device else coef, None, 1.0, None)
    want = torch.ops.fedkernels.weighted_sum(U.cpu(), coef, None, 1.0, None)
    assert torch.isfinite(got.double()).sum() == torch.isfinite(want.double()).sum()
    torch.testing.assert_close(got.cpu(), want, rtol=2e-2, atol=2e-2, equal_nan=True)


@pytest.mark.parametrize("n", [5, 32, 40])
def test_lu_factor_nan_does_not_hang_and_pivots_match_the_cpu_rule(n):
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


def test_lu_solve_out_and_arrowhead_on_cuda():
    A = torch.randn(4, 9, 9, generator=_gen(31), dtype=torch.float64) + 9 * torch.eye(9, dtype=torch.float64)
    LU, piv, _ = torch.ops.fedkernels.lu_factor(A.to(DEV))
    R = torch.randn(4, 9, 500, generator=_gen(32), dtype=torch.float64).to(DEV)
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
        r0, RR = _randn(1001, dtype=dt, seed=36), _randn(6, 1001, dtype=dt, seed=37)
        x, I = torch.ops.fedkernels.arrowhead_solve(a, b, c, 1.0, r0, RR)
        xr, Ir = reference.arrowhead_solve(a, b, c, 1.0, r0.cpu(), RR.cpu())
        tol = 1e-12 if dt == torch.float64 else 1e-5
        torch.testing.assert_close(x.cpu().double(), xr, rtol=tol, atol=tol)
        torch.testing.assert_close(I.cpu().double(), Ir, rtol=tol, atol=tol)


@pytest.mark.parametrize("momentum,first", [(0.0, False), (0.9, True), (0.9, False)])
def test_fused_sgd_step_cuda_matches_cpu(momentum, first):
    shapes = [(8, 3, 3, 3), (8,), (10, 72), (5,)]
    mk = lambda s: [torch.randn(*sh, generator=_gen(s + i), dtype=torch.float64).float() for i, sh in enumerate(shapes)]  # noqa: E731
    p, g, buf, c, ci = mk(1), mk(10), mk(20), mk(30), mk(40)
    pd, gd, bd, cd, cid = ([t.to(DEV) for t in x] for x in (p, g, buf, c, ci))
    mask = [True, False, True, True]
    cadd = [c[0], None, c[2], None]
    args = (0.1, momentum, 1e-3, first, "center", 2)
    torch.ops.fedkernels.fused_sgd_step_(p, g, buf if momentum else [], cadd, ci, mask, *args)
    torch.ops.fedkernels.fused_sgd_step_(pd, gd, bd if momentum else [], [cd[0], None, cd[2], None], cid, mask, *args)
    for x, y in zip(pd + (bd if momentum else []), p + (buf if momentum else [])):
        torch.testing.assert_close(x.cpu(), y, rtol=1e-5, atol=1e-6)
    for x, y in zip(gd, g):
        assert torch.equal(x.cpu(), y)                                                # grads untouched


def test_host_coef_ops_capture_in_a_cuda_graph():
    U = _randn(10, 4099, seed=41)
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


def test_opcheck_new_cuda_ops():
    A = _randn(3, 5, 5, dtype=torch.float64, seed=7)
    LU, piv, _ = torch.ops.fedkernels.lu_factor(A)
    R = _randn(3, 5, 40, dtype=torch.float64, seed=8)
    torch.library.opcheck(torch.ops.fedkernels.lu_solve_out.default, (LU, piv, R, torch.empty_like(R)))
    a = torch.rand(4, dtype=torch.float64) + 1
    torch.library.opcheck(torch.ops.fedkernels.arrowhead_solve.default,
                          (a, -a / 10, a / 5, 1.0, _randn(30, dtype=torch.float64, seed=9),
                           _randn(4, 30, dtype=torch.float64, seed=10)))
