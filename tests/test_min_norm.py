"""min_norm: spec fedaware.md section 9 vectors, exact-QP optimality (scipy), KKT, reference
agreement, properties and bad inputs."""

import math
import re

import numpy as np
import pytest
import scipy.optimize
import spec_vectors  # tests/spec_vectors.py (its MIN_NORM_CASES are the spec's matrices, not this file's)
import torch

from fedkernels import ops, reference
from devices import DEV, DEVICES, cuda_only, gen, one_line, settle  # tests/devices.py: every case on cpu and cuda
import host_harness  # tests/host_harness.py: the CUDA kernels' per-thread logic on the host
from host_harness import hexf

METHODS = ["away", "pairwise", "fw", "code_compat"]


def gram_of(m):
    m = torch.tensor(m, dtype=torch.float64)
    return m @ m.T


def normalised_gram(m):
    m = torch.tensor(m, dtype=torch.float64)
    u = m / m.norm(dim=1, keepdim=True)
    return u @ u.T


def solve(G, **kw):
    kw.setdefault("tol", 1e-12)
    kw.setdefault("tol_abs", 1e-15)
    return ops.min_norm(G, **kw)


def exact_qp(G: np.ndarray):
    """Exact min-norm point via Lawson-Hanson: LDP -> NNLS on a factor of G, then an exact
    re-solve on the support (G_S z = 1, lam = z / sum z) when that is feasible and no worse."""
    K = G.shape[0]
    w, V = np.linalg.eigh(G)
    B = (V * np.sqrt(np.clip(w, 0, None))).T
    E = np.vstack([B, np.ones((1, K))])
    f = np.zeros(K + 1)
    f[-1] = 1.0
    u, _ = scipy.optimize.nnls(E, f, maxiter=100 * K)
    lam = u / u.sum()
    S = np.where(lam > 1e-12)[0]
    try:
        z = np.linalg.solve(G[np.ix_(S, S)], np.ones(len(S)))
        l2 = np.zeros(K)
        l2[S] = z / z.sum()
        if (l2 >= 0).all() and l2 @ G @ l2 <= lam @ G @ lam:
            lam = l2
    except np.linalg.LinAlgError:
        pass
    return lam, float(lam @ G @ lam)


def check_kkt(G, lam, tol=1e-9):
    G = 0.5 * (G + G.T)
    assert bool((lam >= 0).all())
    assert abs(float(lam.sum()) - 1.0) < 1e-12
    v = G @ lam
    q = float(lam @ v)
    scale = max(float(torch.diagonal(G).abs().max()), 1e-300)
    assert float(v.min()) >= q - tol * scale, (float(v.min()), q)
    supp = lam > 1e-9
    assert float((v[supp] - q).abs().max()) <= tol * scale


# ---- spec section 9 vectors --------------------------------------------------------------------
def test_a1_segment_closed_form():
    lam, it, gap = solve(torch.tensor([[4.0, 0.0], [0.0, 1.0]], dtype=torch.float64))
    torch.testing.assert_close(lam, torch.tensor([0.2, 0.8], dtype=torch.float64), rtol=0, atol=1e-15)
    assert float(lam @ torch.tensor([[4.0, 0], [0, 1.0]], dtype=torch.float64) @ lam) == pytest.approx(0.8, abs=1e-15)
    lam, _, _ = solve(torch.ones(2, 2, dtype=torch.float64))  # u = v: gamma = 0.5
    torch.testing.assert_close(lam, torch.tensor([0.5, 0.5], dtype=torch.float64))


@pytest.mark.parametrize("method", ["away", "pairwise", "fw"])
def test_a2_a3_two_and_orthogonal(method):
    lam, _, _ = solve(gram_of([[2, 0], [0, 1]]), method=method)
    torch.testing.assert_close(lam, torch.tensor([0.2, 0.8], dtype=torch.float64), rtol=0, atol=1e-12)
    lam, _, _ = solve(normalised_gram([[2, 0], [0, 1]]), method=method)
    torch.testing.assert_close(lam, torch.tensor([0.5, 0.5], dtype=torch.float64), rtol=0, atol=1e-12)
    G = gram_of([[1, 0, 0], [0, 2, 0], [0, 0, 3]])
    lam, _, _ = solve(G, method=method)
    torch.testing.assert_close(lam, torch.tensor([36 / 49, 9 / 49, 4 / 49], dtype=torch.float64), rtol=0, atol=1e-6)
    assert float(lam @ G @ lam) == pytest.approx(36 / 49, abs=1e-10)
    lam, _, _ = solve(normalised_gram([[1, 0, 0], [0, 2, 0], [0, 0, 3]]), method=method)
    torch.testing.assert_close(lam, torch.full((3,), 1 / 3, dtype=torch.float64), rtol=0, atol=1e-6)


def test_a4_dominated_vertex():
    m = [[1, 0], [2, 1], [3, -1]]
    G = gram_of(m)
    torch.testing.assert_close(G, torch.tensor([[1, 2, 3], [2, 5, 5], [3, 5, 10.0]], dtype=torch.float64))
    lam, _, gap = solve(G)
    torch.testing.assert_close(lam, torch.tensor([1.0, 0, 0], dtype=torch.float64), rtol=0, atol=1e-12)
    lam, _, _ = solve(normalised_gram(m))
    torch.testing.assert_close(lam, torch.tensor([0, 0.5, 0.5], dtype=torch.float64), rtol=0, atol=1e-6)
    Gn = normalised_gram(m)
    assert float(lam @ Gn @ lam) == pytest.approx(0.8535533906, abs=1e-10)
    mt = torch.tensor(m, dtype=torch.float64)
    d = lam @ (mt / mt.norm(dim=1, keepdim=True))
    torch.testing.assert_close(d, torch.tensor([0.9215552445, 0.0654929147], dtype=torch.float64), rtol=0, atol=1e-9)
    # the authors' solver: 0.999 corner nudges, returns the previous iterate
    lam, it, _ = ops.min_norm(G, method="code_compat")
    torch.testing.assert_close(lam, torch.tensor([0.999999, 1e-6, 0], dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("method", ["away", "pairwise"])
def test_a5_origin_in_hull(method):
    m = [[1, 0], [-1, 1], [-1, -1]]
    lam, _, _ = solve(gram_of(m), method=method)
    torch.testing.assert_close(lam, torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64), rtol=0, atol=1e-6)
    assert float(lam @ gram_of(m) @ lam) <= 1e-12
    lam, _, _ = solve(normalised_gram(m), method=method)
    r2 = math.sqrt(2.0)
    exp = torch.tensor([r2, 1, 1], dtype=torch.float64) / (2 + r2)
    torch.testing.assert_close(lam, exp, rtol=0, atol=1e-6)


def test_a5_code_compat_stops_early():
    lam, it, _ = ops.min_norm(gram_of([[1, 0], [-1, 1], [-1, -1]]), method="code_compat")
    q = float(lam @ gram_of([[1, 0], [-1, 1], [-1, -1]]) @ lam)
    assert it < 1000 and 0.0 < q < 1e-8  # stops on ||dlam||_1 < 1e-5 well before the optimum q = 0


@pytest.mark.parametrize("method", METHODS)
def test_a6_duplicates(method):
    m = [[1, 1], [1, 1], [1, -1]]
    G = gram_of(m)
    lam, _, _ = solve(G, method=method)
    d = lam @ torch.tensor(m, dtype=torch.float64)
    tol = 1e-2 if method == "code_compat" else 1e-7
    torch.testing.assert_close(d, torch.tensor([1.0, 0], dtype=torch.float64), rtol=0, atol=tol)
    if method != "code_compat":
        torch.testing.assert_close(lam, torch.tensor([0.5, 0, 0.5], dtype=torch.float64), rtol=0, atol=1e-12)
        Gn = normalised_gram(m)
        lam, _, _ = solve(Gn, method=method)
        assert float(lam @ Gn @ lam) == pytest.approx(0.5, abs=1e-10)


A7 = [[1.0, 0.2, 0.0], [0.3, 1.0, 0.1], [-0.2, 0.4, 1.0], [0.5, 0.5, 0.5]]


@pytest.mark.parametrize("method", ["away", "pairwise"])
@pytest.mark.parametrize("init", ["best_pair", "min_diag"])
def test_a7_generic(method, init):
    m = torch.tensor(A7, dtype=torch.float64)
    G = gram_of(A7)
    lam, _, gap = solve(G, method=method, init=init)
    torch.testing.assert_close(
        lam, torch.tensor([0.510511996043, 0.039079891170, 0.450408112788, 0], dtype=torch.float64), rtol=0, atol=1e-6
    )
    torch.testing.assert_close(
        lam @ m, torch.tensor([0.432154340836, 0.321345535493, 0.454316101905], dtype=torch.float64), rtol=0, atol=1e-7
    )
    assert float(lam @ G @ lam) == pytest.approx(0.496423447934702, abs=1e-10)
    assert 0 <= gap <= 1e-12 * 0.5 + 1e-14
    Gn = normalised_gram(A7)
    lam, _, _ = solve(Gn, method=method, init=init)
    torch.testing.assert_close(
        lam, torch.tensor([0.480867327294, 0.035552475857, 0.483580196849, 0], dtype=torch.float64), rtol=0, atol=1e-6
    )
    torch.testing.assert_close(
        lam @ (m / m.norm(dim=1, keepdim=True)),
        torch.tensor([0.393409334695, 0.304782318879, 0.444836099197], dtype=torch.float64),
        rtol=0,
        atol=1e-7,
    )
    assert float(lam @ Gn @ lam) == pytest.approx(0.445542321675432, abs=1e-10)


def test_a7_code_compat_close():
    G = gram_of(A7)
    lam, it, _ = ops.min_norm(G, method="code_compat")
    assert it < 1000
    torch.testing.assert_close(
        lam, torch.tensor([0.510511996043, 0.039079891170, 0.450408112788, 0], dtype=torch.float64), rtol=0, atol=1e-4
    )


def test_a8_one_fw_step():
    G = torch.diag(torch.tensor([1.0, 4.0, 9.0], dtype=torch.float64))
    lam, it, _ = ops.min_norm(G, max_iter=1, method="fw", lam0=torch.full((3,), 1 / 3, dtype=torch.float64))
    assert it == 1
    torch.testing.assert_close(lam, torch.tensor([13, 2, 2], dtype=torch.float64) / 17, rtol=0, atol=1e-15)
    assert float(lam @ G @ lam) == pytest.approx(13 / 17, abs=1e-15)
    lam_r, it_r, _ = reference.min_norm(G, max_iter=1, method="fw", lam0=torch.full((3,), 1 / 3))
    torch.testing.assert_close(lam, lam_r, rtol=0, atol=1e-15)


# ---- optimality against an exact QP solve ------------------------------------------------------
CASES = [
    (3, 5, 0.0),
    (7, 3, 0.0),
    (10, 50, 0.3),
    (33, 20, 0.5),
    (100, 1000, 0.3),
    (100, 50, 0.3),
    (300, 1000, 0.3),
    (300, 100, 0.3),
    (150, 400, 0.0),
]


@pytest.mark.parametrize("K,d,shift", CASES)
@pytest.mark.parametrize("method", ["away", "pairwise"])
def test_exact_optimum_and_kkt(K, d, shift, method):
    g = torch.Generator().manual_seed(1000 * K + d)
    U = torch.randn(K, d, generator=g, dtype=torch.float64) + shift
    G = U @ U.T
    lam, it, gap = solve(G, method=method)
    lam_e, q_e = exact_qp(G.numpy())
    q = float(lam @ G @ lam)
    scale = float(torch.diagonal(G).max())
    assert q - q_e <= 1e-9 * max(q_e, 1e-3 * scale), (q, q_e)
    check_kkt(G, lam)
    assert it <= 1000 and gap <= 1e-9 * scale


@pytest.mark.parametrize("method", ["away", "pairwise"])
def test_plain_frank_wolfe_is_worse(method):
    """Plain FW stalls well above the optimum at K=100 (the reason for away/pairwise steps)."""
    g = torch.Generator().manual_seed(5)
    U = torch.randn(100, 1000, generator=g, dtype=torch.float64) + 0.3
    G = U @ U.T
    q_fw = float((lambda l: l @ G @ l)(solve(G, method="fw")[0]))
    q_as = float((lambda l: l @ G @ l)(solve(G, method=method)[0]))
    assert (q_fw - q_as) / q_as > 1e-6


@pytest.mark.parametrize("method", ["away", "pairwise"])
def test_no_polish_still_converges_small(method):
    G = gram_of(A7)
    lam, _, _ = solve(G, method=method, polish=False)
    assert float(lam @ G @ lam) == pytest.approx(0.496423447934702, abs=1e-10)


# ---- agreement with the float64 reference ------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("K,d", [(1, 3), (2, 4), (5, 3), (17, 40), (64, 30)])
def test_matches_reference(method, K, d):
    g = torch.Generator().manual_seed(K * 31 + d)
    U = torch.randn(K, d, generator=g, dtype=torch.float64) + 0.2
    G = U @ U.T
    lam, it, gap = ops.min_norm(G, method=method)
    lam_r, it_r, gap_r = reference.min_norm(G, method=method)
    qd = float(lam @ G @ lam - lam_r @ G @ lam_r)
    assert abs(qd) <= 1e-10 * float(torch.diagonal(G).max())
    if method in ("fw", "code_compat") or d >= K:  # unique lam (independent vectors) or identical path
        torch.testing.assert_close(lam, lam_r, rtol=0, atol=1e-7)


# ---- properties --------------------------------------------------------------------------------
def test_permutation_permutes_lambda():
    g = torch.Generator().manual_seed(3)
    U = torch.randn(20, 60, generator=g, dtype=torch.float64) + 0.4
    G = U @ U.T
    perm = torch.randperm(20, generator=g)
    lam, _, _ = solve(G)
    lam_p, _, _ = solve(G[perm][:, perm])
    torch.testing.assert_close(lam_p, lam[perm], rtol=0, atol=1e-9)


def test_scale_invariance_and_determinism():
    g = torch.Generator().manual_seed(4)
    U = torch.randn(40, 30, generator=g, dtype=torch.float64)
    G = U @ U.T
    a = solve(G)
    b = solve(G)
    assert torch.equal(a[0], b[0]) and a[1] == b[1] and a[2] == b[2]
    c = solve(G * 1e6)
    torch.testing.assert_close(c[0], a[0], rtol=0, atol=1e-9)
    d_a, d_c = a[0] @ U, c[0] @ U  # the min-norm point itself is unchanged by scaling G
    torch.testing.assert_close(d_c, d_a, rtol=0, atol=1e-9)


def test_degenerate_inputs():
    lam, it, gap = ops.min_norm(torch.tensor([[2.5]]))
    assert lam.tolist() == [1.0] and it == 0 and gap == 0.0
    lam, it, gap = ops.min_norm(torch.zeros(5, 5))
    assert float(lam.sum()) == pytest.approx(1.0) and bool((lam >= 0).all()) and gap == 0.0
    # duplicated vectors: q unique, lam on the lowest index of each duplicate group
    v = torch.tensor([[1.0, 2.0, 0.5], [0.3, -1.0, 2.0]], dtype=torch.float64)
    U = torch.cat([v[0:1], v[0:1], v[1:2], v[1:2], v[0:1]])
    G = U @ U.T
    lam, _, _ = solve(G)
    lam2, _, _ = solve(v @ v.T)
    assert float(lam @ G @ lam) == pytest.approx(float(lam2 @ (v @ v.T) @ lam2), abs=1e-12)
    # asymmetric input is symmetrised
    A = torch.tensor([[1.0, 0.0], [2.0, 4.0]], dtype=torch.float64)
    torch.testing.assert_close(solve(A)[0], solve(0.5 * (A + A.T))[0], rtol=0, atol=0)


@pytest.mark.parametrize("K", [31, 32, 33, 97])
def test_symmetrised_tile_by_tile(K):
    """The native op symmetrises G in 32 x 32 tiles: an asymmetric G (sizes around and across a tile's
    edge) gives the bits of the same solve on 0.5 * (G + G^T) formed row by row, with polish and without."""
    g = torch.Generator().manual_seed(K)
    U = torch.randn(K, max(2, K // 3), generator=g, dtype=torch.float64) + 0.2
    G = U @ U.T + 1e-3 * torch.rand(K, K, generator=g, dtype=torch.float64)
    for polish in (True, False):
        a = ops.min_norm(G, polish=polish)
        b = ops.min_norm(0.5 * (G + G.T), polish=polish)
        assert torch.equal(a[0], b[0]) and a[1:] == b[1:], (K, polish)


@pytest.mark.parametrize("K", [1, 2, 31, 33, 97])
@pytest.mark.parametrize("method", METHODS)
def test_scale_solves_on_the_scaled_symmetrised_gram(K, method):
    """scale=s solves on s_i s_j (G + G^T) / 2, made in the solver's one symmetrising pass: the bits of
    the same solve on that matrix formed by the caller ((G + G^T) * 0.5 * outer(s, s)), with the best_pair
    init and with min_diag, on an asymmetric G across the 32 x 32 tiles; and FedAWARE's normalisation
    (s = 1 / sqrt(diag G)) matches the solve on the unit vectors' Gram and the float64 reference."""
    g = torch.Generator().manual_seed(100 + K)
    U = (torch.randn(K, max(2, K // 3), generator=g, dtype=torch.float64) + 0.2) * torch.rand(
        K, 1, generator=g, dtype=torch.float64
    ).mul(5).add(0.1)
    G = U @ U.T + 1e-3 * torch.rand(K, K, generator=g, dtype=torch.float64)
    s = torch.rand(K, generator=g, dtype=torch.float64) + 0.5
    for init in ("best_pair", "min_diag"):
        a = ops.min_norm(G, method=method, init=init, scale=s)
        b = ops.min_norm((G + G.T) * 0.5 * torch.outer(s, s), method=method, init=init)
        assert torch.equal(a[0], b[0]) and a[1:] == b[1:], (K, method, init)
    Gu = U @ U.T
    n = torch.diagonal(Gu).sqrt()
    lam, _, gap = solve(Gu, method=method, scale=n.reciprocal())
    u = U / n[:, None]
    lam_u, _, _ = solve(u @ u.T, method=method)
    lam_r, _, _ = reference.min_norm(Gu, method=method, scale=n.reciprocal())
    Gn = u @ u.T
    for other in (lam_u, lam_r):
        assert abs(float(lam @ Gn @ lam - other @ Gn @ other)) <= 1e-10
    assert gap >= 0


def test_scale_bad_inputs():
    G = torch.eye(3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"scale must be a 1-D tensor of length 3, got shape \(2,\)"):
        ops.min_norm(G, scale=torch.ones(2))
    for bad, shown in ((0.0, "0"), (-1.0, "-1"), (float("nan"), "nan"), (float("inf"), "inf")):
        s = torch.ones(3, dtype=torch.float64)
        s[1] = bad
        with pytest.raises(ValueError, match=rf"scale must be finite and > 0, got {shown} at \[1\]"):
            ops.min_norm(G, scale=s)
    G[0, 2] = G[2, 0] = 1e300
    with pytest.raises(ValueError, match=r"s_i s_j \(G \+ G\^T\) / 2 overflows at \[0, 2\]"):
        ops.min_norm(G, scale=torch.tensor([1e10, 1.0, 1e10], dtype=torch.float64))


def test_best_pair_ties_go_to_the_first_pair_in_row_major_order():
    """The best_pair init is found tile by tile (in the symmetrising pass), but a tie still goes to the
    first pair in row-major order: (5, 40) (a later tile) before (6, 10) (visited first), as the plain
    double loop over i < j finds it."""
    G = 2.0 * torch.eye(70, dtype=torch.float64)
    for i, j in ((6, 10), (5, 40)):
        G[i, j] = G[j, i] = -1.9  # both segments: gamma 0.5, value 0.05, the least
    lam, it, _ = ops.min_norm(G, max_iter=0)
    assert it == 0 and torch.nonzero(lam).reshape(-1).tolist() == [5, 40] and lam[5] == lam[40] == 0.5


def test_symmetrised_overflow_is_refused():
    G = torch.eye(3, dtype=torch.float64)
    G[0, 2] = G[2, 0] = 1.5e308  # finite, but G + G^T is not
    with pytest.raises(ValueError, match=r"overflows at \[0, 2\]"):
        ops.min_norm(G)


def test_dtypes_and_noncontiguous():
    g = torch.Generator().manual_seed(6)
    U = torch.randn(12, 40, generator=g, dtype=torch.float64)
    G = U @ U.T
    lam, _, _ = solve(G)
    lam32, _, _ = ops.min_norm(G.float(), tol=1e-12)
    torch.testing.assert_close(lam32, lam, rtol=0, atol=1e-4)
    big = torch.zeros(24, 24, dtype=torch.float64)
    big[::2, ::2] = G
    Gv = big[::2, ::2]
    assert not Gv.is_contiguous()
    torch.testing.assert_close(solve(Gv)[0], lam, rtol=0, atol=0)
    torch.testing.assert_close(solve(G.T)[0], lam, rtol=0, atol=0)


def test_bad_inputs():
    with pytest.raises(ValueError, match="square"):
        ops.min_norm(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="square"):
        ops.min_norm(torch.zeros(3))
    with pytest.raises(ValueError, match="at least 1"):
        ops.min_norm(torch.zeros(0, 0))
    for bad in (float("nan"), float("inf")):
        G = torch.eye(3)
        G[1, 2] = bad
        with pytest.raises(ValueError, match="finite"):
            ops.min_norm(G)
    with pytest.raises(ValueError, match="floating"):
        ops.min_norm(torch.eye(3, dtype=torch.long))
    with pytest.raises(ValueError, match="method"):
        ops.min_norm(torch.eye(3), method="newton")
    with pytest.raises(ValueError, match="init"):
        ops.min_norm(torch.eye(3), init="random")
    with pytest.raises(ValueError, match="max_iter"):
        ops.min_norm(torch.eye(3), max_iter=-1)
    with pytest.raises(ValueError, match="tol"):
        ops.min_norm(torch.eye(3), tol=float("nan"))
    with pytest.raises(ValueError, match="lam0"):
        ops.min_norm(torch.eye(3), lam0=torch.tensor([1.0, -1.0, 1.0]))
    with pytest.raises(ValueError, match="lam0"):
        ops.min_norm(torch.eye(3), lam0=torch.ones(2))
    with pytest.raises(TypeError):
        ops.min_norm([[1.0]])
    # the native op checks too (the wrapper leaves finiteness to it: one read of G), naming the entry
    with pytest.raises(ValueError, match=r"finite, got nan at \[0, 1\]"):
        torch.ops.fedkernels.min_norm(torch.tensor([[1.0, float("nan")], [0.0, 1.0]], dtype=torch.float64))
    G = torch.eye(40, dtype=torch.float64)
    G[33, 2] = float("-inf")  # beyond the first 32 x 32 tile, below the diagonal
    with pytest.raises(ValueError, match=r"finite, got -inf at \[33, 2\]"):
        ops.min_norm(G)


@pytest.mark.parametrize("dev", DEVICES)
def test_opcheck(dev):
    g = torch.Generator().manual_seed(7)
    U = torch.randn(9, 5, generator=g, dtype=torch.float64)
    G = U @ U.T
    if dev == DEV:  # the device solver has no polish (face solves) and no code_compat: the schema's defaults
        G = G.to(dev)
        torch.library.opcheck(
            torch.ops.fedkernels.min_norm.default, (G, 1000, 1e-12, 1e-15, "away", "best_pair", False, None)
        )
        return
    torch.library.opcheck(torch.ops.fedkernels.min_norm.default, (G,))
    torch.library.opcheck(
        torch.ops.fedkernels.min_norm.default,
        (G, 50, 1e-9, 1e-15, "pairwise", "min_diag", True, torch.ones(9, dtype=torch.float64)),
    )
    torch.library.opcheck(
        torch.ops.fedkernels.min_norm.default,
        (G, 50, 1e-9, 1e-15, "away", "best_pair", True, None, torch.rand(9, dtype=torch.float64) + 0.5),
    )


# ---- on every device (cpu, and cuda where there is one: tests/devices.py) --------------------
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
MIN_NORM_CASES = [(K, m) for m in ("fw", "away", "pairwise") for K in (1, 2, 3, 10, 100, 1000) if m != "fw" or K <= 10]


def _min_norm_G(K: int) -> torch.Tensor:
    U = torch.randn(K, max(2, K // 2), generator=gen(K), dtype=torch.float64)
    return U @ U.T / U.shape[1] + torch.eye(K, dtype=torch.float64)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("K,method", MIN_NORM_CASES)
def test_min_norm_matches_reference(dev, K, method):
    if dev == "cpu" and K > 100:
        pytest.skip("K=1000 on the CPU: ~15 s of float64 reference solver (the cuda case runs it)")
    max_iter = 30000
    U = torch.randn(K, max(2, K // 2), generator=gen(K), dtype=torch.float64)
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


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("method", ["fw", "away", "pairwise"])
def test_min_norm_spec_vectors(dev, method):
    for m, q_exp in spec_vectors.MIN_NORM_CASES:  # fedaware.md §9 A3, A4, A5, A7
        M = torch.tensor(m, dtype=torch.float64)
        G = (M @ M.T).to(dev)
        lam, _, _ = torch.ops.fedkernels.min_norm(G, 10000, 1e-14, 1e-15, method, "best_pair", False, None)
        q = _kkt(G.cpu(), lam.cpu())
        assert abs(q - q_exp) <= 1e-10


@pytest.mark.parametrize("dev", DEVICES)
def test_min_norm_warm_start_and_min_diag(dev):
    U = torch.randn(30, 12, generator=gen(3), dtype=torch.float64)
    G = (U @ U.T).to(dev)
    lam0 = torch.rand(30, generator=gen(4), dtype=torch.float64).to(dev)
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


@pytest.mark.parametrize("dev", DEVICES)
def test_bad_args_min_norm(dev):
    G = _min_norm_G(7).to(dev)
    F = torch.ops.fedkernels
    one_line(
        ValueError, r"min_norm: G must be a square \[K, K\] Gram matrix, got shape \(7, 6\)", ops.min_norm, G[:, :6]
    )
    one_line(
        ValueError,
        r"min_norm: G must be a square \[K, K\] Gram matrix, got shape \(7, 6\)",
        F.min_norm,
        G[:, :6].contiguous(),
        100,
        1e-12,
        1e-15,
        "away",
        "best_pair",
        False,
        None,
    )
    one_line(
        RuntimeError,
        r"min_norm: max_iter must be >= 0, got -5",
        F.min_norm,
        G,
        -5,
        1e-12,
        1e-15,
        "away",
        "best_pair",
        False,
        None,
    )
    bad = G.clone()
    bad[2, 3] = float("nan")
    one_line(ValueError, r"min_norm: G must be finite, got nan at \[2, 3\]", ops.min_norm, bad)
    one_line(ValueError, r"min_norm: method must be one of .*got 'newton'", ops.min_norm, G, method="newton")
    one_line(
        ValueError,
        r"min_norm: lam0 must be a 1-D tensor of length 7, got shape \(6,\)",
        ops.min_norm,
        G,
        lam0=torch.ones(6, dtype=torch.float64, device=dev),
    )
    lam, _, _ = F.min_norm(G, 5000, 1e-12, 1e-15, "away", "best_pair", False, None)
    settle(dev)
    lam_r, _, _ = reference.min_norm(G.cpu(), max_iter=5000, tol=1e-12, method="away", polish=False)
    Gc = G.cpu()
    assert lam.device.type == dev
    assert abs(float(lam.cpu() @ Gc @ lam.cpu()) - float(lam_r @ Gc @ lam_r)) <= 1e-9


# ---- G's, lam0's and scale's shapes and G's dtype: checked once, by the native op, for the wrapper and a direct call
EYE3 = torch.eye(3, dtype=torch.float64)
BAD_TENSOR_ARGS = [  # (G on dev, lam0, scale (host), the whole message)
    (
        lambda dev: torch.ones(7, device=dev),
        None,
        None,
        "min_norm: G must be a square [K, K] Gram matrix, got shape (7,)",
    ),
    (
        lambda dev: torch.ones(7, 6, device=dev),
        None,
        None,
        "min_norm: G must be a square [K, K] Gram matrix, got shape (7, 6)",
    ),
    (
        lambda dev: torch.ones(2, 3, 3, device=dev),
        None,
        None,
        "min_norm: G must be a square [K, K] Gram matrix, got shape (2, 3, 3)",
    ),
    (
        lambda dev: torch.eye(3, dtype=torch.int64, device=dev),
        None,
        None,
        "min_norm: G must have a floating dtype (float16, bfloat16, float32, float64), got torch.int64",
    ),
    (
        lambda dev: torch.ones(0, 0, device=dev),
        torch.ones(0, dtype=torch.float64),  # (its sum is not positive: the error is G's)
        None,
        "min_norm: G must be at least 1 x 1 (K >= 1 vectors), got shape (0, 0)",
    ),
    (
        lambda dev: EYE3.to(dev),
        torch.ones(2, dtype=torch.float64),
        None,
        "min_norm: lam0 must be a 1-D tensor of length 3, got shape (2,)",
    ),
    (  # lam0's shape is wrong: its shape is the error, not its negative entries
        lambda dev: EYE3.to(dev),
        -torch.ones(3, 1, dtype=torch.float64),
        None,
        "min_norm: lam0 must be a 1-D tensor of length 3, got shape (3, 1)",
    ),
    (
        lambda dev: EYE3.to(dev),
        None,
        torch.ones(4, dtype=torch.float64),
        "min_norm: scale must be a 1-D tensor of length 3, got shape (4,)",
    ),
]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", range(len(BAD_TENSOR_ARGS)))
def test_bad_tensor_args_same_from_wrapper_and_native(dev, case):
    make, lam0, scale, msg = BAD_TENSOR_ARGS[case]
    G, exact = make(dev), "^" + re.escape(msg) + "$"
    one_line(ValueError, exact, ops.min_norm, G, polish=False, lam0=lam0, scale=scale)
    one_line(
        ValueError, exact, torch.ops.fedkernels.min_norm, G, 100, 1e-12, 1e-15, "away", "best_pair", False, lam0, scale
    )


def test_compiled_bad_G_raises_the_native_error():
    """Under torch.compile the fake kernel does not stop tracing on a 0-d G; the native op refuses it."""
    torch._dynamo.reset()
    f = torch.compile(lambda G: ops.min_norm(G), fullgraph=True)
    one_line(ValueError, r"^min_norm: G must be a square \[K, K\] Gram matrix, got shape \(\)$", f, torch.zeros(()))


def test_the_wrapper_reads_any_float_dtype_as_float64():
    """G's dtype is kept up to the native op, which reads it as float64 (exactly): the same result."""
    G = _min_norm_G(6)
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        Gd = G.to(dt)
        lam, it, gap = ops.min_norm(Gd)
        lam64, it64, gap64 = ops.min_norm(Gd.to(torch.float64))
        assert torch.equal(lam, lam64) and it == it64 and gap == gap64


# ---- the device cases above are ones the solver converges on ------------------------------------------
def test_cuda_min_norm_cases_converge_on_the_cpu_op():
    for K, method in MIN_NORM_CASES:
        if K > 100:
            continue  # K=1000 measured: 18993 (away) / 9899 (pairwise) iterations of 30000
        _, it, _ = torch.ops.fedkernels.min_norm(_min_norm_G(K), 30000, 1e-12, 1e-15, method, "best_pair", False, None)
        assert int(it) < 30000, (K, method)


# ---- the CUDA kernel's per-thread logic on the host (tests/host_harness.py, tests/cuda_host/min_norm.cpp) ----------
@pytest.fixture(scope="module")
def harness():
    yield from host_harness.session()


@pytest.mark.parametrize(
    "a,b,c",
    [
        (1.0, 0.5, 2.0),
        (1.0, 1.0, 1.0),
        (2.0, 3.0, 1.0),
        (1.0, -2.0, 5.0),
        (3.0, 0.0, 3.0),
        (1e-300, 0.0, 1e-300),
        (4.0, 4.5, 9.0),
        (1.0, 2.0, 3.0),
    ],
)
def test_min_norm_segment_is_the_reference_line_search(harness, a, b, c):
    g, val = (hexf(x) for x in harness("segment", a, b, c)[1:])
    g_r, val_r = reference._segment(a, b, c)
    assert g == g_r and val == val_r  # same formula and order; no fma on the host build


_MN_METHODS = {"fw": 0, "away": 1, "pairwise": 2}


def _mn_emulate(harness, G, method, init="best_pair", max_iter=30000, tol=1e-12, tol_abs=1e-15, lam0=None):
    ans = harness(
        "minnorm",
        G.shape[0],
        _MN_METHODS[method],
        int(init == "min_diag"),
        max_iter,
        tol,
        tol_abs,
        int(lam0 is not None),
        G,
        lam0 if lam0 is not None else [],
    )
    return torch.tensor([hexf(x) for x in ans[2:]], dtype=torch.float64), int(ans[0]), hexf(ans[1])


def _mn_G(K, seed=None):
    U = torch.randn(K, max(2, K // 2), generator=gen(K if seed is None else seed), dtype=torch.float64)
    return U, U @ U.T / U.shape[1] + torch.eye(K, dtype=torch.float64)


@pytest.mark.parametrize(
    "K,method", [(K, m) for m in ("fw", "away", "pairwise") for K in (1, 2, 3, 10, 100, 300) if m != "fw" or K <= 10]
)
def test_min_norm_block_emulation_matches_cpu_op_and_reference(harness, K, method):
    """The kernel's control flow around mn::plan / mn::update / scan_thread / row_partial, with the
    block's reduction orders (K=300 > 256 threads: two entries per thread), converges to the CPU
    op's and the reference's minimiser (G strongly convex: lam unique)."""
    U, G = _mn_G(K)
    G = G + 1e-3 * torch.triu(torch.ones(K, K, dtype=torch.float64), 1)  # not symmetric: symmetrised
    lam, it, gap = _mn_emulate(harness, G, method)
    Gs = 0.5 * (G + G.T)
    assert it < 30000
    assert float(lam.min()) >= 0.0 and abs(float(lam.sum()) - 1.0) < 1e-12
    v = Gs @ lam
    q = float(lam @ v)
    assert abs(gap - (q - float(v.min()))) <= 1e-12 * max(1.0, q)  # the exact gap at the returned lam
    assert gap <= 1e-12 * q + 1e-15 * float(Gs.diagonal().max()) + 1e-13
    lam_c, it_c, _ = torch.ops.fedkernels.min_norm(G, 30000, 1e-12, 1e-15, method, "best_pair", False, None)
    q_c = float(lam_c @ (Gs @ lam_c))
    assert abs(q - q_c) <= 1e-11 * max(1.0, q_c)
    torch.testing.assert_close(U.T @ lam, U.T @ lam_c, rtol=0, atol=1e-6)
    assert abs(it - int(it_c)) <= max(2, int(it_c) // 20)  # same steps; sums in another order
    if K <= 10:
        lam_r, _, _ = reference.min_norm(G, max_iter=30000, tol=1e-12, method=method, polish=False)
        assert abs(q - float(lam_r @ (Gs @ lam_r))) <= 1e-11


@pytest.mark.parametrize("method", ["fw", "away", "pairwise"])
def test_min_norm_block_emulation_spec_vectors(harness, method):
    for m, q_exp in spec_vectors.MIN_NORM_CASES:  # fedaware.md §9 A3, A4, A5, A7 (tests/spec_vectors.py)
        M = torch.tensor(m, dtype=torch.float64)
        G = M @ M.T
        lam, _, _ = _mn_emulate(harness, G, method, max_iter=10000, tol=1e-14)
        assert abs(float(lam @ G @ lam) - q_exp) <= 1e-10, (m, method)


def test_min_norm_block_emulation_inits(harness):
    U = torch.randn(30, 12, generator=gen(3), dtype=torch.float64)
    G = U @ U.T
    lam0 = torch.rand(30, generator=gen(4), dtype=torch.float64)
    for init, l0 in (("min_diag", None), ("best_pair", lam0), ("best_pair", torch.zeros(30, dtype=torch.float64))):
        lam, it, _ = _mn_emulate(harness, G, "away", init=init, max_iter=5000, lam0=l0)
        lam_c, it_c, _ = torch.ops.fedkernels.min_norm(
            G, 5000, 1e-12, 1e-15, "away", init, False, l0 if l0 is not None and float(l0.sum()) > 0 else None
        )
        assert abs(float(lam @ G @ lam) - float(lam_c @ G @ lam_c)) <= 1e-9
    # zero iterations: the init itself (best pair on a 3-vertex hull; min_diag: the vertex of least norm)
    M = torch.tensor([[1.0, 0, 0], [0, 2.0, 0], [0, 0, 3.0]])
    for init, want in (("best_pair", [0.8, 0.2, 0.0]), ("min_diag", [1.0, 0.0, 0.0])):
        lam, it, _ = _mn_emulate(harness, M @ M.T, "away", init=init, max_iter=0)
        assert it == 0 and torch.allclose(lam, torch.tensor(want, dtype=torch.float64), atol=1e-15)
    # ties: two identical vertices, the smallest index wins everywhere
    G = torch.ones(4, 4, dtype=torch.float64) + torch.diag(torch.tensor([0.0, 0.0, 1.0, 1.0], dtype=torch.float64))
    lam, _, _ = _mn_emulate(harness, G, "away", init="min_diag", max_iter=100)
    assert lam.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_min_norm_g_placement(harness):
    budget = 232448 - 1024  # sm_90 opt-in limit minus the static scratch and margin (min_norm.cu)
    n_max = max(n for n in range(1, 400) if n * n * 8 + 24 * n <= budget)
    assert harness("gsmem", n_max, budget) == ["1", str(24 * n_max)]
    assert harness("gsmem", n_max + 1, budget)[0] == "0"
    assert harness("gsmem", 1000, budget)[0] == "0" and harness("gsmem", 1, 64)[0] == "1"
    assert n_max >= 160
