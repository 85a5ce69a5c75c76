"""FedAWARE: spec §9 vectors A2-A12 through the aggregator, property tests, state round trip,
bad input, degenerate rounds. The min-norm solve is fedkernels.ops.min_norm (the default)."""

import copy
import itertools
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fedkernels import ops
from fedkernels.algorithms import BadUpdateError, build
from fedkernels.algorithms.fedaware import aware_project
from fedkernels.algorithms.fedaware.options import elud

F64 = torch.float64
TIGHT = dict(tol=1e-12, tol_abs=1e-15)


def close(a, b, rtol=0.0, atol=1e-7):
    torch.testing.assert_close(torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64), rtol=rtol, atol=atol)


def mk(**opts):
    return build("fedaware", **{**TIGHT, **opts})


def one_shot(m, normalize, **opts):
    """N = len(m) clients, all in round 0, alpha = 1: the momenta are exactly m (startup_full)."""
    m = torch.as_tensor(m, dtype=F64)
    a = mk(num_clients=m.size(0), alpha=1.0, normalize=normalize, warmup="startup_full", elud=False, **opts)
    x = torch.zeros(m.size(1), dtype=F64)
    r = a.aggregate(x, m, [1] * m.size(0))
    return a, r, r.params - x


def kkt(a, r):
    lam = torch.tensor(r.info["lam"], dtype=F64)
    G, _ = a.gram_matrix(torch.arange(lam.numel()))
    v = G @ lam
    q = float(lam @ v)
    assert (lam >= 0).all() and abs(float(lam.sum()) - 1) < 1e-12
    assert (v >= q - 1e-9).all()
    assert ((v[lam > 1e-9] - q).abs() < 1e-7).all()
    return lam, q


# ---- §9 vectors --------------------------------------------------------------------------------
def test_a2_two_vectors():
    a, r, d = one_shot([[2, 0], [0, 1]], normalize=False)
    lam, q = kkt(a, r)
    close(lam, [0.2, 0.8], atol=1e-6)
    close(d, [0.4, 0.8])
    close(q, 0.8, atol=1e-10)
    a, r, d = one_shot([[2, 0], [0, 1]], normalize=True)
    lam, q = kkt(a, r)
    close(lam, [0.5, 0.5], atol=1e-6)
    close(d, [0.5, 0.5])
    close(q, 0.5, atol=1e-10)
    close(r.info["coef"], [0.25, 0.5], atol=1e-6)


def test_a3_orthogonal():
    m = [[1, 0, 0], [0, 2, 0], [0, 0, 3]]
    a, r, d = one_shot(m, normalize=False)
    lam, q = kkt(a, r)
    close(lam, [36 / 49, 9 / 49, 4 / 49], atol=1e-6)
    close(d, [0.7346938776, 0.3673469388, 0.2448979592])
    close(q, 36 / 49, atol=1e-10)
    a, r, d = one_shot(m, normalize=True)
    lam, q = kkt(a, r)
    close(lam, [1 / 3] * 3, atol=1e-6)
    close(q, 1 / 3, atol=1e-10)
    close(d, [1 / 3, 1 / 3, 1 / 3])


def test_a4_dominated_vertex():
    m = [[1, 0], [2, 1], [3, -1]]
    a, r, d = one_shot(m, normalize=False)
    close(a.Gm, [[1, 2, 3], [2, 5, 5], [3, 5, 10]], atol=0)
    lam, q = kkt(a, r)
    close(lam, [1, 0, 0], atol=1e-6)
    close(d, [1, 0])
    close(q, 1, atol=1e-10)
    assert r.info["support"] == [0]
    a, r, d = one_shot(m, normalize=True)
    lam, q = kkt(a, r)
    close(lam, [0, 0.5, 0.5], atol=1e-6)
    close(d, [0.9215552445, 0.0654929147])
    close(q, 0.8535533906, atol=1e-10)


def test_a4_code_compat():
    _, r, _ = one_shot([[1, 0], [2, 1], [3, -1]], normalize=False, code_compat=True)
    close(r.info["lam"], [0.999999, 1e-6, 0], atol=1e-6)
    assert r.info["lam"][1] > 0  # the code's 0.999 nudge leaves the vertex


def test_a5_origin_in_hull():
    m = [[1, 0], [-1, 1], [-1, -1]]
    a, r, d = one_shot(m, normalize=False)
    assert r.info["zero_direction"] and r.info["fallback"] == "zero step"
    close(d, [0, 0], atol=0)
    close(r.info["lam"], [0.5, 0.25, 0.25], atol=1e-6)
    assert r.info["q"] < 1e-12
    a, r, d = one_shot(m, normalize=True)
    assert r.info["zero_direction"]
    s = 2 + math.sqrt(2)
    close(r.info["lam"], [math.sqrt(2) / s, 1 / s, 1 / s], atol=1e-6)
    _, r, d = one_shot(m, normalize=True, zero_fallback="na")  # FedAWARE-NA fallback: sum p_i m_i
    close(d, torch.tensor(m, dtype=F64).mean(0), atol=1e-12)
    assert r.info["fallback"] == "na"


def test_a6_duplicate_rows():
    m = [[1, 1], [1, 1], [1, -1]]
    a, r, d = one_shot(m, normalize=False)
    lam, q = kkt(a, r)
    close(d, [1, 0])
    close(q, 1, atol=1e-10)
    close(lam[0] + lam[1], 0.5, atol=1e-6)
    close(lam[2], 0.5, atol=1e-6)
    a, r, d = one_shot(m, normalize=True)
    lam, q = kkt(a, r)
    close(q, 0.5, atol=1e-10)
    close(d, [0.7071067812, 0])  # the unit-vector combination sum lam_i m_i / ||m_i||
    close(torch.tensor(r.info["coef"], dtype=F64) @ torch.tensor(m, dtype=F64)[r.info["support"]], d, atol=1e-12)


def test_a7_generic():
    m = torch.tensor([[1.0, 0.2, 0.0], [0.3, 1.0, 0.1], [-0.2, 0.4, 1.0], [0.5, 0.5, 0.5]], dtype=F64)
    close(m.norm(dim=1), [1.019803902719, 1.048808848170, 1.095445115010, 0.866025403784], atol=1e-12)
    a, r, d = one_shot(m, normalize=False)
    lam, q = kkt(a, r)
    close(lam, [0.510511996043, 0.039079891170, 0.450408112788, 0], atol=1e-6)
    close(d, [0.432154340836, 0.321345535493, 0.454316101905])
    close(q, 0.496423447934702, atol=1e-10)
    a, r, d = one_shot(m, normalize=True)
    lam, q = kkt(a, r)
    close(lam, [0.480867327294, 0.035552475857, 0.483580196849, 0], atol=1e-6)
    close(d, [0.393409334695, 0.304782318879, 0.444836099197])
    close(q, 0.445542321675432, atol=1e-10)
    close(
        torch.tensor(r.info["coef"], dtype=F64), lam[r.info["support"]] / m.norm(dim=1)[r.info["support"]], atol=1e-12
    )


A9 = {
    (True, "ema_from_zero"): (
        [0.5, 0.5, 0],
        [0.5, 0.5],
        [-0.5, -0.5],
        [0.5, 0, 0.5],
        [0.0654929147, 0.9215552445],
        [-0.5654929147, -1.4215552445],
        0.8535533906,
    ),
    (True, "first_update"): (
        [0.5, 0.5, 0],
        [0.5, 0.5],
        [-0.5, -0.5],
        None,
        [0.3535533906, 0.8535533906],
        [-0.8535533906, -1.3535533906],
        0.8535533906,
    ),
    (False, "ema_from_zero"): ([0.8, 0.2, 0], [0.4, 0.2], [-0.4, -0.2], [1, 0, 0], [0.25, 0.5], [-0.65, -0.7], 0.3125),
    (False, "first_update"): ([0.8, 0.2, 0], [0.8, 0.4], [-0.8, -0.4], [1, 0, 0], [0.5, 0.5], [-1.3, -0.9], 0.5),
}


@pytest.mark.parametrize("normalize,init", list(A9))
def test_a9_end_to_end_rounds(normalize, init):
    lam0, d0, x1, lam1, d1, x2, q1 = A9[(normalize, init)]
    a = mk(num_clients=3, alpha=0.5, normalize=normalize, init=init, warmup="startup_full")
    g0 = torch.tensor([[1, 0], [0, 2], [1, 1]], dtype=F64)  # pseudo-gradients; U = -g
    r = a.aggregate(torch.zeros(2, dtype=F64), -g0, [1, 1, 1], client_ids=[0, 1, 2])
    close(r.info["lam"], lam0, atol=1e-6)
    close(r.params, x1, atol=1e-9)
    close(-(r.params - 0), d0, atol=1e-9)
    g1 = torch.tensor([[0, 1], [-1, 1]], dtype=F64)
    r2 = a.aggregate(r.params, -g1, [1, 1], client_ids=[0, 2])
    if lam1 is not None:
        close(r2.info["lam"], lam1, atol=1e-6)
    close(r.params - r2.params, d1, atol=1e-9)
    close(r2.params, x2, atol=1e-9)
    close(r2.info["q"], q1, atol=1e-9)
    mom = [[0.25, 0.5], [0, 1], [-0.25, 0.75]] if init == "ema_from_zero" else [[0.5, 0.5], [0, 2], [0, 1]]
    close(-a.M, mom, atol=0)


def test_a10_projection_and_extension():
    close(aware_project(torch.tensor([-1.0, 2.0]), torch.tensor([1.0, 1.0])), [0.5, 0.5], atol=1e-7)
    close(aware_project(torch.tensor([-1.0, 2.0]), torch.tensor([-1.0, -1.0])), [0.5, 0.5], atol=1e-7)
    close(aware_project(torch.tensor([-1.0, 2.0]), torch.zeros(2)), [0, 0], atol=0)
    # extension="fedavg": the FedAvg step projected onto the AWARE direction, against float64
    g = torch.Generator().manual_seed(5)
    U = torch.randn(4, 9, generator=g, dtype=F64)
    n = torch.tensor([3.0, 1.0, 4.0, 2.0], dtype=F64)
    for ext in ("fedavg", "fedavgm"):
        a = mk(num_clients=4, extension=ext, warmup="startup_full", ext_beta=0.5)
        r = a.aggregate(torch.zeros(9, dtype=F64), U, n)
        p = n / n.sum()
        Gt = (p[:, None] * U).sum(0)  # first round: momentum buffer = FedAvg step
        unit = U / U.norm(dim=1, keepdim=True)
        d = torch.tensor(r.info["lam"], dtype=F64) @ (0.5 * unit)
        close(r.params, aware_project(Gt, d), atol=1e-9)
        r2 = a.aggregate(r.params, 0.5 * U, n)
        if ext == "fedavgm":
            Gt2 = 0.5 * Gt + 0.5 * Gt
            close(a.ext_momentum, Gt2, atol=1e-12)
        else:
            Gt2 = 0.5 * Gt
        lam2 = torch.tensor(r2.info["lam"], dtype=F64)
        d2 = lam2 @ unit * 1.0  # momenta stay parallel to U, norms 0.5
        close(r2.params - r.params, aware_project(Gt2, d2), atol=1e-9)


def test_a11_elud():
    close(elud(torch.tensor([[1.0, 0], [0, 1]])), [2.0, 1.4142135624], atol=1e-9)
    g = torch.tensor([[1.0, 0], [0, 2], [1, 1]], dtype=F64)
    close(elud(g @ g.T), [1.6153846154, 1.2709778186], atol=1e-9)
    assert elud(torch.tensor([[1.0, -1], [-1, 1]])) == (None, None)
    a = mk(num_clients=3, warmup="startup_full")
    r = a.aggregate(torch.zeros(2, dtype=F64), -g, [1, 1, 1])
    close([r.info["elud"], r.info["elud_sqrt"]], [1.6153846154, 1.2709778186], atol=1e-9)


def test_a12_exploration_phases():
    a = mk(num_clients=4, alpha=0.5)
    x = torch.zeros(3, dtype=F64)
    gen = torch.Generator().manual_seed(0)
    U = {i: torch.randn(3, generator=gen, dtype=F64) for i in range(4)}
    n = {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0}
    ids = [0, 2]  # exploration: each client once (the authors' sampler order)
    r = a.aggregate(x, torch.stack([U[i] for i in ids]), [n[i] for i in ids], client_ids=ids)
    assert r.info["phase"] == "explore"
    close(r.params, (1 / 4) * U[0] + (3 / 4) * U[2], atol=1e-12)  # FedAvg with p_{0,2} / (p_0 + p_2)
    close(a.M[0], 0.5 * U[0], atol=0)
    close(a.M[2], 0.5 * U[2], atol=0)
    assert not a.M[1].any() and not a.M[3].any()
    ids = [1, 3]
    r = a.aggregate(r.params, torch.stack([U[i] for i in ids]), [n[i] for i in ids], client_ids=ids)
    assert r.info["phase"] == "aware" and r.info["num_active"] == 4


# ---- properties --------------------------------------------------------------------------------
def _active_set_q(G):
    """Exhaustive exact min-norm value over the simplex (enumerate supports, solve G_S z = 1)."""
    K = G.size(0)
    best = math.inf
    for r in range(1, K + 1):
        for S in itertools.combinations(range(K), r):
            Gs = G[list(S)][:, list(S)]
            try:
                z = torch.linalg.solve(Gs, torch.ones(r, dtype=F64))
            except RuntimeError:
                continue
            if float(z.sum()) <= 0 or (z < -1e-12).any():
                continue
            lam = torch.zeros(K, dtype=F64)
            lam[list(S)] = z / z.sum()
            v = G @ lam
            q = float(lam @ v)
            if (v >= q - 1e-9).all():
                best = min(best, q)
    return best


@pytest.mark.parametrize("seed", range(4))
def test_exact_optimum_against_active_set(seed):
    g = torch.Generator().manual_seed(seed)
    N = 3 + seed
    m = torch.randn(N, 4, generator=g, dtype=F64) + 0.3
    for normalize in (False, True):
        a, r, d = one_shot(m, normalize=normalize)
        G, _ = a.gram_matrix(torch.arange(N))
        assert abs(r.info["q"] - _active_set_q(G)) <= 1e-9
        close(d @ d, r.info["q"], atol=1e-9)  # ||step||^2 = q in both modes


def test_permutation_and_scaling():
    g = torch.Generator().manual_seed(3)
    m = torch.randn(5, 8, generator=g, dtype=F64) + 0.5
    perm = [3, 0, 4, 1, 2]
    for normalize in (True, False):
        _, r, d = one_shot(m, normalize)
        _, rp, dp = one_shot(m[perm], normalize)
        close(dp, d, atol=1e-7)
        close(torch.tensor(rp.info["lam"]), torch.tensor(r.info["lam"])[perm], atol=1e-6)
    _, r, d = one_shot(m, True)
    ms = m.clone()
    ms[2] *= 7.0
    _, rs, ds = one_shot(ms, True)
    close(ds, d, atol=1e-7)  # normalised: per-row scaling is invisible
    _, r, d = one_shot(m, False)
    _, rs, ds = one_shot(3.0 * m, False)
    close(rs.info["lam"], r.info["lam"], atol=1e-6)
    close(ds, 3.0 * d, atol=1e-7)


def test_incremental_gram_partial_participation_against_float64():
    N, d, k = 7, 23, 3
    a = mk(num_clients=N, alpha=0.3, normalize=True, warmup="mask")
    g = torch.Generator().manual_seed(11)
    x = torch.zeros(d, dtype=torch.float32)
    M_ref = torch.zeros(N, d, dtype=F64)
    for rnd in range(20):
        ids = torch.randperm(N, generator=g)[:k].tolist()
        U = torch.randn(k, d, generator=g).to(torch.float32)
        r = a.aggregate(x, U, torch.randint(1, 9, (k,), generator=g).tolist(), client_ids=ids)
        for j, cid in enumerate(ids):
            M_ref[cid] = 0.7 * M_ref[cid] + 0.3 * U[j].double()
        close(a.M, M_ref, rtol=1e-6, atol=1e-6)
        Mf = a.M.double()
        torch.testing.assert_close(a.Gm, Mf @ Mf.T, rtol=1e-12, atol=1e-12)
        # the step: min-norm over the seen (mask) rows, float64 re-computation of d from lam
        seen = sorted(set(torch.nonzero(a.seen).reshape(-1).tolist()))
        assert r.info["num_active"] == len(seen)
        lam = torch.tensor(r.info["lam"], dtype=F64)
        nrm = M_ref.norm(dim=1).clamp_min(1e-300)
        step = ((lam / nrm)[:, None] * M_ref).sum(0)
        close(r.params.double() - x.double(), step, rtol=1e-5, atol=1e-6)
        assert all(lam[i] == 0 for i in range(N) if i not in seen)
        x = r.params


def test_gram_cache_rows_and_columns_in_any_client_order(monkeypatch):
    """Gm[idx, :] = Gr, then Gm[:, idx] = Gr^T (Gr = gram(M, rows=idx)), bit for bit, when every client
    takes part (ids sorted or shuffled: one transposing copy) and when some do (row and column copies).
    The Gram is made slightly asymmetric (<m_i, m_j> != <m_j, m_i> in the last bits is allowed), so that
    a write of Gr where Gr^T belongs shows."""
    from fedkernels.algorithms import fedaware

    gram = ops.gram

    def skewed(U, rows=None):
        G = gram(U, rows=rows)
        return G + 1e-9 * torch.arange(G.numel(), dtype=F64).reshape(G.shape) / G.numel()

    monkeypatch.setattr(fedaware.ops, "gram", skewed)
    N, d = 6, 9
    a = mk(num_clients=N, alpha=0.4, warmup="startup_full", elud=False)
    g = torch.Generator().manual_seed(5)
    x = torch.zeros(d, dtype=F64)
    for ids in ([0, 1, 2, 3, 4, 5], [4, 0, 5, 2, 1, 3], [5, 1, 3], [2, 0], [3, 5, 0, 1, 4, 2]):
        before = a.Gm.clone() if a.Gm is not None else torch.zeros(N, N, dtype=F64)
        U = torch.randn(len(ids), d, generator=g, dtype=F64) + 0.1
        a.aggregate(x, U, [1.0] * len(ids), client_ids=ids)
        idx = torch.tensor(ids)
        Gr = skewed(a.M, rows=idx)
        want = before.clone()
        want[idx, :] = Gr
        want[:, idx] = Gr.T
        assert torch.equal(a.Gm, want), ids
        torch.testing.assert_close(a.Gm, a.M @ a.M.T, rtol=0, atol=2e-9)


def test_gram_cache_layout_does_not_change_a_bit():
    """After a round of every client the cached Gram is a transposed view (no copy); a contiguous copy of
    it (e.g. a checkpoint written that way) must give the same next rounds: lambda, q and the step."""
    N, d = 40, 12
    g = torch.Generator().manual_seed(3)
    x = torch.zeros(d, dtype=torch.float32)
    a = mk(num_clients=N, warmup="startup_full", elud=False)
    a.aggregate(x, torch.randn(N, d, generator=g) + 0.3, [1.0] * N)
    assert not a.Gm.is_contiguous()
    b = mk(num_clients=N, warmup="startup_full", elud=False)
    st = a.state_dict()
    st["Gm"] = st["Gm"].contiguous()
    b.load_state_dict(st)
    assert b.Gm.is_contiguous() and torch.equal(a.Gm, b.Gm)
    for k in (7, 5, N):  # some clients (a view and a copy side by side), then every one
        ids = torch.randperm(N, generator=g)[:k].tolist()
        U = torch.randn(k, d, generator=g) + 0.3
        ra, rb = a.aggregate(x, U, [2.0] * k, ids), b.aggregate(x, U, [2.0] * k, ids)
        assert torch.equal(ra.params, rb.params)
        assert ra.info["lam"] == rb.info["lam"] and ra.info["q"] == rb.info["q"]


def test_state_dict_round_trip_mid_run():
    N, d = 6, 10
    g = torch.Generator().manual_seed(2)
    rounds = [(torch.randperm(N, generator=g)[:3].tolist(), torch.randn(3, d, generator=g)) for _ in range(8)]
    for opts in ({}, {"extension": "fedavgm", "warm_start": True}, {"variant": "na"}):
        a = mk(num_clients=N, **opts)
        x = torch.zeros(d)
        for ids, U in rounds[:4]:
            x = a.aggregate(x, U, [1, 2, 3], client_ids=ids).params
        b = mk(num_clients=N, **opts)
        b.load_state_dict(copy.deepcopy(a.state_dict()))
        xa = xb = x
        for ids, U in rounds[4:]:
            ra, rb = a.aggregate(xa, U, [1, 2, 3], client_ids=ids), b.aggregate(xb, U, [1, 2, 3], client_ids=ids)
            xa, xb = ra.params, rb.params
            assert torch.equal(xa, xb) and ra.info.get("lam") == rb.info.get("lam")
        assert torch.equal(a.M, b.M) and torch.equal(a.Gm, b.Gm)


def test_nan_client_raise_and_exclude_leaves_momentum():
    a = mk(num_clients=4, warmup="startup_full")
    x = torch.zeros(5)
    U = torch.randn(4, 5)
    a.aggregate(x, U, [1, 1, 1, 1])
    M0 = a.M.clone()
    Ub = torch.randn(2, 5)
    Ub[1, 3] = float("nan")
    with pytest.raises(BadUpdateError, match="client 3"):
        a.aggregate(x, Ub, [1, 1], client_ids=[1, 3])
    assert torch.equal(a.M, M0)
    e = mk(num_clients=4, warmup="startup_full", on_bad_update="exclude")
    e.aggregate(x, U, [1, 1, 1, 1])
    r = e.aggregate(x, Ub, [1, 1], client_ids=[1, 3])
    assert torch.equal(e.M[3], M0[3]) and not torch.equal(e.M[1], M0[1])
    assert r.info["excluded"][0]["client_id"] == 3
    assert torch.isfinite(r.params).all()


def test_degenerate_rounds():
    # N = 1: lam = (1), d = m~_1
    a = mk(num_clients=1, normalize=True)
    u = torch.tensor([[3.0, 4.0]])
    r = a.aggregate(torch.zeros(2), u, [5])
    assert r.info["phase"] == "aware" and r.info["lam"] == [1.0]
    close(r.params, [0.6, 0.8], atol=1e-7)  # alpha = 0.5: m = u/2, unit step
    # all-zero updates: zero momenta -> origin in the hull, zero step, no NaN
    a = mk(num_clients=3, warmup="startup_full")
    r = a.aggregate(torch.ones(4), torch.zeros(3, 4), [1, 1, 1])
    assert r.info["zero_direction"] and torch.equal(r.params, torch.ones(4))
    # K = 1 while exploring: FedAvg step w + U
    a = mk(num_clients=3)
    r = a.aggregate(torch.ones(4), torch.full((1, 4), 2.0), [7], client_ids=[1])
    assert r.info["phase"] == "explore"
    close(r.params, [3.0] * 4, atol=0)
    # startup_full with an unseen (zero) row: the zero vector is in the hull
    a = mk(num_clients=3, warmup="startup_full")
    r = a.aggregate(torch.zeros(2), torch.randn(2, 2), [1, 1], client_ids=[0, 1])
    assert r.info["zero_direction"]
    # mask warm-up ignores unseen rows from round 0
    a = mk(num_clients=3, warmup="mask", normalize=True)
    r = a.aggregate(torch.zeros(2), torch.tensor([[2.0, 0.0], [0.0, 1.0]]), [1, 1], client_ids=[0, 2])
    assert not r.info["zero_direction"] and r.info["num_active"] == 2
    close(r.params, [0.5, 0.5], atol=1e-7)


def test_na_variant_and_determinism():
    a = mk(num_clients=3, variant="na", warmup="startup_full", alpha=1.0)
    U = torch.tensor([[1.0, 0], [0, 2], [1, 1]])
    r = a.aggregate(torch.zeros(2), U, [1, 2, 1])
    close(r.params, 0.25 * U[0] + 0.5 * U[1] + 0.25 * U[2], atol=1e-7)
    g = torch.Generator().manual_seed(9)
    U = torch.randn(5, 301, generator=g)
    outs = []
    for _ in range(2):
        a = mk(num_clients=5, warmup="startup_full")
        outs.append(a.aggregate(torch.zeros(301), U, [1, 2, 3, 4, 5]).params)
    assert torch.equal(outs[0], outs[1])


def test_default_solver_and_injection():
    calls = []

    def spy(G, max_iter, tol, **kw):
        calls.append((G.clone(), max_iter, tol, kw))
        return ops.min_norm(G, max_iter, tol, **kw)

    a = build("fedaware", num_clients=3, warmup="startup_full", warm_start=True, solver=spy, max_iter=77, tol=1e-9)
    U = torch.randn(3, 4, dtype=F64)
    r1 = a.aggregate(torch.zeros(4, dtype=F64), U, [1, 1, 1])
    a.aggregate(torch.zeros(4, dtype=F64), U[:2], [1, 1], client_ids=[0, 2])
    assert len(calls) == 2 and calls[0][1] == 77 and calls[0][2] == 1e-9
    assert calls[0][3]["method"] == "away" and calls[0][3]["lam0"] is None
    close(calls[1][3]["lam0"], r1.info["lam"], atol=0)  # warm start from the previous lam
    assert build("fedaware", code_compat=True).method == "code_compat"


def test_default_is_ops_min_norm():
    a = build("fedaware", num_clients=3, warmup="startup_full", normalize=False, tol=1e-12, tol_abs=1e-15)
    assert a.solver.__name__ == "_default_solver"
    r = a.aggregate(torch.zeros(3, dtype=F64), torch.tensor([[1.0, 0, 0], [0, 2, 0], [0, 0, 3]], dtype=F64), [1, 1, 1])
    close(r.info["lam"], [36 / 49, 9 / 49, 4 / 49], atol=1e-6)


def test_bad_options_and_inputs():
    for kw, msg in (
        ({"alpha": 0}, "alpha"),
        ({"warmup": "x"}, "warmup"),
        ({"init": "x"}, "init"),
        ({"extension": "yogi"}, "extension"),
        ({"max_iter": -1}, "max_iter"),
        ({"num_clients": 0}, "num_clients"),
        ({"solver": 3}, "solver"),
        ({"variant": "y"}, "variant"),
    ):
        with pytest.raises(ValueError, match=msg):
            build("fedaware", **kw)
    with pytest.raises(ValueError, match="num_clients"):
        build("fedaware").aggregate(torch.zeros(2), torch.ones(1, 2), [1])
    a = mk()
    a.setup(num_clients=4)
    with pytest.raises(ValueError, match="client_ids"):
        a.aggregate(torch.zeros(2), torch.ones(1, 2), [1], client_ids=[4])
    a.aggregate(torch.zeros(2), torch.ones(1, 2), [1], client_ids=[3])
    with pytest.raises(ValueError, match="d="):
        a.aggregate(torch.zeros(3), torch.ones(1, 3), [1], client_ids=[3])
    with pytest.raises(ValueError, match="N=4"):
        a.setup(num_clients=5)


# ---- ELUD above ELUD_GRAM_MAX_K participants: O(kd) sums in the momentum pass -------------------------------
class _Ops(TorchDispatchMode):
    """Records the fedkernels ops whose first argument is U (by data pointer) and the aten ops on M."""

    def __init__(self, U, M=None):
        super().__init__()
        self.ptr, self.mptr, self.on_U, self.on_M = U.data_ptr(), None if M is None else M.data_ptr(), [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        a0 = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if a0 is not None and str(func.namespace) == "fedkernels" and a0.data_ptr() == self.ptr:
            self.on_U.append(str(func.overloadpacket))
        if (
            a0 is not None
            and self.mptr is not None
            and str(func.namespace) == "aten"
            and a0.untyped_storage().data_ptr() == self.mptr
        ):
            self.on_M.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_elud_above_gram_max_k_from_sums_matches_float64(monkeypatch, dtype):
    """k > ELUD_GRAM_MAX_K: ELUD from sum_i ||g_i||^2 and ||sum_i g_i||^2 (fp64, ops.kstats in the momentum
    pass's blocks), no Gram of U: fp64-accurate against the float64 formula on a round of
    high diversity (rows nearly cancel), and equal to the Gram path's value to rounding."""
    from fedkernels.algorithms import fedaware
    from fedkernels.algorithms.fedaware import options

    K, d = options.ELUD_GRAM_MAX_K + 9, 301
    g = torch.Generator().manual_seed(5)
    U = (torch.randn(K, d, generator=g) + 0.02).to(dtype)
    U64 = U.double()
    want = float(U64.pow(2).sum(1).mean() / U64.mean(0).pow(2).sum())
    assert want > 20
    x = torch.zeros(d, dtype=dtype)
    a = mk(num_clients=K, warmup="startup_full")
    with _Ops(U) as o:
        r = a.aggregate(x, U, [1] * K)
    # the screen, then the sums from ops.kstats (p = 1) on the momentum pass's block: no Gram of U
    assert "fedkernels.gram" not in o.on_U and o.on_U == ["fedkernels.finite_rows", "fedkernels.kstats"], o.on_U
    assert abs(r.info["elud"] / want - 1) < 1e-13 and abs(r.info["elud_sqrt"] ** 2 / want - 1) < 1e-13
    monkeypatch.setattr(fedaware, "ELUD_GRAM_MAX_K", K)  # the Gram path on the same round
    b = mk(num_clients=K, warmup="startup_full")
    with _Ops(U) as o:
        rb = b.aggregate(x, U, [1] * K)
    assert o.on_U == ["fedkernels.gram"], o.on_U  # (its screened form: one read of U)
    assert abs(rb.info["elud"] / r.info["elud"] - 1) < 1e-11
    assert torch.equal(r.params, rb.params) and torch.equal(a.M, b.M)


def test_elud_sums_path_screens_before_any_state_change():
    """k > ELUD_GRAM_MAX_K with a NaN row: raise leaves the momenta as they were; exclude drops the row and
    the logged ELUD is that of the other rows; a chunked source gives the tensor's ELUD."""
    from fedkernels.algorithms.fedaware.options import ELUD_GRAM_MAX_K
    from fedkernels.sources import ChunkedUpdates, TensorSource

    K, d = ELUD_GRAM_MAX_K + 4, 50
    g = torch.Generator().manual_seed(6)
    U = torch.randn(K, d, generator=g)
    x = torch.zeros(d)
    a = mk(num_clients=K, warmup="startup_full")
    a.aggregate(x, U, [1] * K)
    M0 = a.M.clone()
    Ub = U.clone()
    Ub[7, 3] = float("nan")
    with pytest.raises(BadUpdateError, match="client 7"):
        a.aggregate(x, Ub, [1] * K)
    assert torch.equal(a.M, M0)
    e = mk(num_clients=K, warmup="startup_full", on_bad_update="exclude")
    r = e.aggregate(x, Ub, [1] * K)
    keep = [i for i in range(K) if i != 7]
    U64 = U[keep].double()
    want = float(U64.pow(2).sum(1).mean() / U64.mean(0).pow(2).sum())
    assert r.info["excluded"][0]["client_id"] == 7 and abs(r.info["elud"] / want - 1) < 1e-12
    s = mk(num_clients=K, warmup="startup_full")
    rs = s.aggregate(x, ChunkedUpdates(TensorSource(U), chunk_cols=9), [1] * K)
    t = mk(num_clients=K, warmup="startup_full")
    rt = t.aggregate(x, U, [1] * K)
    assert abs(rs.info["elud"] / rt.info["elud"] - 1) < 1e-12 and torch.equal(s.M, t.M)


# ---- the momentum update in place on a run of rows ------------------------------------------------------
@pytest.mark.parametrize("mdtype", [None, torch.bfloat16])
@pytest.mark.parametrize("source", [False, True])
def test_momentum_update_in_place_on_a_run_of_rows_gives_the_gather_bits(mdtype, source):
    """Rounds whose ids are a run lo..hi-1 in order (every client: 0..N-1) update M[lo:hi] in place, without
    the gather / scatter (no index_copy_ on M): the momenta, the cached Gram and the model are
    those of the same rounds with the rows in another order (the gather path), bit for bit, on a tensor and
    on a chunked source, fp32 and bf16 tables."""
    from fedkernels.sources import ChunkedUpdates, TensorSource

    N, d = 12, 301
    g = torch.Generator().manual_seed(8)
    x = torch.randn(d, generator=g)
    rounds = [list(range(N)), [3, 4, 5, 6, 7], [11], list(range(N))]
    runs = mk(num_clients=N, warmup="startup_full", alpha=0.3, momentum_dtype=mdtype)
    perm = mk(num_clients=N, warmup="startup_full", alpha=0.3, momentum_dtype=mdtype)
    for ids in rounds:
        U = torch.randn(len(ids), d, generator=g) * 1e-2
        p = list(range(len(ids)))[::-1]
        p = p[1:] + p[:1] if len(p) > 2 else p
        wrap = (lambda V: ChunkedUpdates(TensorSource(V), chunk_cols=50)) if source else (lambda V: V)
        with _Ops(U, runs.M) as o:
            ra = runs.aggregate(x, wrap(U), [1.0] * len(ids), ids)
        if runs.M is not None and o.mptr is not None:
            assert "aten.index_copy_" not in o.on_M and "aten.mul_" in o.on_M, o.on_M
        rb = perm.aggregate(x, wrap(U[p]), [1.0] * len(ids), [ids[i] for i in p])
        assert torch.equal(runs.M, perm.M) and torch.equal(runs.Gm, perm.Gm)
        assert torch.equal(ra.params, rb.params)
        x = ra.params
    assert runs.M.dtype == (mdtype or torch.float32) and bool(runs.M.any())
    Ue = torch.randn(N, d, generator=g)
    with _Ops(Ue, runs.M) as o:  # the counter sees the in-place path's ops
        runs.aggregate(x, Ue, [1.0] * N)
    assert "aten.mul_" in o.on_M and "aten.add_" in o.on_M and "aten.index_copy_" not in o.on_M


def test_momentum_update_interrupted_between_its_two_in_place_steps_is_named():
    """A failure after M[lo:hi] *= (1 - alpha) and before += alpha U (the in-place path's two steps): the
    torn table's message says those columns hold (1 - alpha) times the old momenta, and the aggregator
    refuses to go on."""
    N, d = 6, 40
    a = mk(num_clients=N, warmup="startup_full")
    x = torch.zeros(d)
    a.aggregate(x, torch.randn(N, d), [1.0] * N)
    mptr = a.M.untyped_storage().data_ptr()

    class Fail(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.add_.Tensor and args[0].untyped_storage().data_ptr() == mptr:
                raise RuntimeError("simulated failure")
            return func(*args, **(kwargs or {}))

    with (
        Fail(),
        pytest.raises(
            RuntimeError,
            match=r"failed in columns 0\.\.39 of d=40 \(RuntimeError: simulated "
            r"failure\): .* clients \[0, 1, 2, 3, 4, 5\] hold the new momenta "
            r"before column 0, the old ones after column 39, \(1 - alpha\) "
            r"times the old ones in between",
        ),
    ):
        a.aggregate(x, torch.randn(N, d), [1.0] * N)
    with pytest.raises(RuntimeError, match="refuses further rounds"):
        a.aggregate(x, torch.randn(N, d), [1.0] * N)
