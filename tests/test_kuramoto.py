"""Kuramoto-FedAvg: spec §9 vectors K1-K11, property tests, state round trip, bad input, client rule."""

import math

import pytest
import torch
from torch import nn

from fedkernels import algorithms
from fedkernels.algorithms import BadUpdateError, ClientContext, build
from fedkernels.algorithms.kuramoto import code_weights, kuramoto_stats, kuramoto_weights
from fedkernels.flat import FlatSpec

F64 = torch.float64
R9 = dict(rtol=1e-9, atol=1e-12)


def t(x, dtype=F64):
    return torch.tensor(x, dtype=dtype)


def close(a, b, **tol):
    if tol:
        tol.setdefault("rtol", 0.0)
        tol.setdefault("atol", 0.0)
    torch.testing.assert_close(torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64), **(tol or R9))


def agg(U, w, p, **opts):
    a = build("kuramoto", **opts)
    return a.aggregate(w, U, p)


# ---- plain float64 re-computation of §2.3 / §2.6 (two passes, no Gram) ------------------------------
def ref_weights(U, p, mode="S", kappa=0.5, tau=0.05, clip_delta=True):
    U = U.to(F64)
    p = torch.as_tensor(p, dtype=F64)
    mean = (p[:, None] * U).sum(0)
    nb = float(mean @ mean)
    norms = U.norm(dim=1)
    valid = (norms**2 > 1e-30) & (nb > 1e-30)
    th = torch.zeros(len(p), dtype=F64)
    s = torch.zeros(len(p), dtype=F64)
    if valid.any():
        c = ((U[valid] @ mean) / (norms[valid] * math.sqrt(nb))).clamp(-1, 1)
        th[valid] = torch.arccos(c)
        delta = th[valid].mean() - th[valid]
        if mode == "S" and clip_delta:
            delta = delta.clamp(-math.pi / 2, math.pi / 2)
        s[valid] = torch.sin(delta)
    if mode == "S":
        num = p * (1 + min(max(kappa, 0), 1) * s)
        return num / num.sum()
    S = s.sum()
    if int(valid.sum()) < 3 or S == 0 or abs(S) <= tau * s.abs().sum():
        return p
    return s / S


# ---- §9 vectors ------------------------------------------------------------------------------
def test_k1_three_clients_uniform():
    U = t([[2, 0], [1, 1], [-1, 2]])
    p = t([1 / 3] * 3)
    w = t([0.5, -0.5])
    dot, nsq, nbar = kuramoto_stats(U, p)
    close(dot, [4 / 3, 5 / 3, 4 / 3])
    close(nsq, [4, 2, 5])
    close(nbar, 13 / 9)
    rho, info = kuramoto_weights(dot, nsq, nbar, p, "P", kappa=0.1, tau=0.0)
    close(info["theta"], [0.9827937232, 0.1973955598, 1.0516502125], rtol=1e-9, atol=1e-10)
    close(info["theta_bar"], 0.7439464985, rtol=1e-9, atol=1e-10)
    close(info["s"], [-0.2365827343, 0.5197437165, -0.3028710038], rtol=1e-9, atol=1e-10)
    close(info["S"], -0.0197100217, rtol=1e-8, atol=1e-11)
    close(info["ratio"], 0.01861, rtol=1e-3)
    close(rho, [12.0031696658, -26.3695152135, 15.3663455477])
    assert not info["degenerate"]
    close(agg(U, w, [1, 1, 1], mode="P", kappa0=0.1, tau=0.0).params, [-1.2729521430, -0.0636824118])
    r = agg(U, w, [1, 1, 1], mode="P", kappa0=0.1)
    assert r.info["degenerate"] and r.info["guard_fired"]
    close(r.params, [0.5666666667, -0.4])
    r = agg(U, torch.zeros(2, dtype=F64), [1, 1, 1], mode="S", kappa0=0.5)
    close(r.info["weights"], [0.2948715317, 0.4213413941, 0.2837870743])
    close(r.params, [0.7272973831, 0.9889155426])
    r = agg(U, w, [1, 1, 1], mode="S", kappa0=1.0)
    close(r.info["weights"], [0.2561553645, 0.5099314924, 0.2339131431])
    close(r.params, [1.2883290783, 0.4777577786])
    r = agg(U, w, [1, 1, 1], mode="S", kappa0=0.0)
    assert r.info["weights"] == p.tolist()
    close(r.params, w + (p[:, None] * U).sum(0))


def test_k2_nonuniform_p():
    U = t([[1, 0, 0], [0, 1, 0], [1, 1, 1]])
    n = [5, 3, 2]
    p = t([0.5, 0.3, 0.2])
    dot, nsq, nbar = kuramoto_stats(U, p)
    close(dot / (nsq.sqrt() * math.sqrt(nbar)), [0.7925939239, 0.5661385171, 0.9152086306], rtol=1e-9, atol=1e-10)
    rho, info = kuramoto_weights(dot, nsq, nbar, p, "P", guard=False)
    close(info["theta"], [0.6557449353, 0.9689825516, 0.4147709909], rtol=1e-9, atol=1e-10)
    close(info["theta_bar"], 0.6798328259, rtol=1e-9, atol=1e-10)
    close(info["s"], [0.0240855613, -0.2851373517, 0.2619689441], rtol=1e-8, atol=1e-10)
    close(info["S"], 9.1715e-4, rtol=1e-4)
    close(rho, [26.2612018817, -310.8937115007, 285.632509619], rtol=1e-8, atol=1e-8)
    r = agg(U, torch.zeros(3, dtype=F64), n, mode="P")
    assert r.info["degenerate"]
    close(r.info["weights"], p)
    r = agg(U, torch.zeros(3, dtype=F64), n, mode="S", kappa0=0.5)
    close(r.info["weights"], [0.5114180361, 0.2599727120, 0.2286092519])
    rp = agg(U, torch.zeros(3, dtype=F64), n, mode="S", kappa0=0.5, theta_bar="p")  # flag: p-weighted mean phase
    close(rp.info["theta_bar"], float(p @ t(info["theta"])))
    close(rp.info["s"], torch.sin(rp.info["theta_bar"] - t(info["theta"])))
    close(r.params, [0.7400272880, 0.4885819639, 0.2286092519])


def test_k3_two_clients_degenerate():
    U = t([[1, 0], [0, 3]])
    w = torch.zeros(2, dtype=F64)
    r = agg(U, w, [1, 1], mode="P")
    close(r.info["s"], [-0.4472135955, 0.4472135955], rtol=1e-9, atol=1e-10)
    assert abs(r.info["S"]) < 1e-15
    assert r.info["degenerate"]
    close(r.params, [0.5 * 0.5, 0.5 * 1.5])  # kappa0 = 0.5 times the FedAvg step [0.5, 1.5]
    r = agg(U, w, [1, 1], mode="S", kappa0=1.0)
    close(r.info["weights"], [0.2763932023, 0.7236067977])
    close(r.info["weights"], [0.5 * (1 - 0.4472135955), 0.5 * (1 + 0.4472135955)])


def test_k4_identical_updates():
    U = t([[1, 2], [1, 2], [1, 2]])
    w = torch.zeros(2, dtype=F64)
    r = agg(U, w, [1, 1, 1], mode="P", kappa0=1.0)
    assert r.info["degenerate"]
    assert r.info["theta"] == [0.0, 0.0, 0.0] and r.info["s"] == [0.0, 0.0, 0.0]
    r = agg(U, w, [1, 1, 1], mode="P", kappa0=1.0, tau=0.0)  # S = 0 is degenerate for any tau
    assert r.info["degenerate"]
    r = agg(U, w, [1, 1, 1], mode="S", kappa0=1.0)
    close(r.info["weights"], [1 / 3] * 3)
    close(r.params, [1, 2])


def test_k5_zero_norm_client():
    U = t([[1, 0], [0, 0], [0, 1]])
    w = torch.zeros(2, dtype=F64)
    r = agg(U, w, [1, 1, 1], mode="S", kappa0=1.0)
    assert r.info["valid"] == [True, False, True]
    close([r.info["theta"][0], r.info["theta"][2]], [0.7853981634] * 2, rtol=1e-9, atol=1e-10)
    close(r.info["theta_bar"], math.pi / 4)
    close(r.info["s"], [0, 0, 0], atol=1e-15, rtol=0)
    close(r.info["weights"], [1 / 3] * 3)
    close(r.params, [1 / 3, 1 / 3])
    assert agg(U, w, [1, 1, 1], mode="P").info["degenerate"]


def test_k6_cancelling_updates():
    U = t([[1, 0], [-1, 0]])
    w = t([0.25, 0.5])
    for mode in "PS":
        r = agg(U, w, [1, 1], mode=mode)
        assert r.info["valid"] == [False, False] and r.info["mean_zero"]
        assert r.info["weights"] == [0.5, 0.5]
        assert torch.isfinite(r.params).all()
        close(r.params, w)


def test_k7_single_client_every_mode():
    U = t([[3, 4]])
    w = t([1, -1])
    close(agg(U, w, [7], mode="S").params, [4, 3])
    r = agg(U, w, [7], mode="P", kappa0=0.3)
    assert r.info["degenerate"]
    close(r.params, w + 0.3 * U[0])
    close(build("kuramoto", mode="C").aggregate(w, U, [7], payloads=[{"phase": 1.0}]).params, [4, 3])
    close(agg(U, w, [7], mode="S", server_lr=0.5).params, w + 0.5 * U[0])


def test_k8_overflow_and_small_angles():
    U = (1e20 * t([[1, 0], [2, 0], [1, 1e-3]])).to(torch.float32)
    assert not torch.isfinite((U * U).sum(1)).all()  # a naive fp32 norm overflows
    r = agg(U, torch.zeros(2), [1, 1, 1], mode="S", kappa0=1.0)
    close(r.info["theta"], [0.00025, 0.00025, 0.00075], atol=1e-6, rtol=0)
    close(r.info["weights"], [0.3333888889, 0.3333888889, 0.3332222223], rtol=1e-5, atol=0)
    r1 = agg(t([[1, 0], [2, 0], [1, 1e-3]]), torch.zeros(2, dtype=F64), [1, 1, 1], mode="S", kappa0=1.0)
    close(r.info["weights"], r1.info["weights"], rtol=1e-5, atol=0)  # scale invariance
    assert torch.isfinite(r.params).all()


def test_k9_code_mode():
    W = t([[1, 0], [0, 1], [2, 2]])
    w = torch.zeros(2, dtype=F64)
    phase = [1.0, 1.5, 3.0]
    a = build("kuramoto", mode="C", kappa0=0.2, clip=10.0)
    r = a.aggregate(w, W - w, [1, 1, 1], payloads=[{"phase": f} for f in phase])
    close(r.info["weights"], [0.3439987107, 0.3926871146, 0.2633141747])
    close(r.params, [0.8706270602, 0.9193154640])
    assert not r.info["clipped"]
    cp = torch.cos(t(phase)[:, None] - t(phase)[None, :]).sum(1) - 1
    close(cp, [0.4614357253, 0.9483197636, -0.3454096349])
    b, aa = code_weights(t(phase), t([1 / 3] * 3), 0.2)
    close(aa.sum(), 1.0)
    # the elementwise clamp: a tiny clip bounds the sync term coordinate by coordinate
    r = build("kuramoto", mode="C", kappa0=0.2, clip=1e-3).aggregate(
        w, W, [1, 1, 1], payloads=[{"phase": f} for f in phase]
    )
    sync = (b[:, None] * W).sum(0).clamp(-1e-3, 1e-3)
    close(r.params, W.mean(0) + 0.2 * sync)
    assert r.info["clipped"]


@pytest.mark.parametrize("K", [1, 2, 3, 301])
def test_code_weights_match_the_pairwise_sum(K):
    """c'_k = sum_{j != k} cos(phi_k - phi_j), summed pair by pair (K x K), equals code_weights' O(K)
    form (cos/sin sums) to rounding, for spread-out phases and non-uniform p."""
    g = torch.Generator().manual_seed(K)
    phase = torch.rand(K, generator=g, dtype=F64) * 40 - 7
    p = torch.rand(K, generator=g, dtype=F64) + 0.1
    p /= p.sum()
    cp = torch.cos(phase[:, None] - phase[None, :]).sum(1) - 1.0
    b_ref = (cp - p * cp.sum()) / max(1, K - 1)
    b, a = code_weights(phase, p, 0.3)
    close(b, b_ref, rtol=0, atol=1e-13)
    close(a, p + 0.3 * b_ref, rtol=0, atol=1e-13)
    close(a.sum(), 1.0, rtol=0, atol=1e-13)


def test_k10_kappa_schedule():
    a = build("kuramoto", kappa0=0.5, beta=0.9)
    close([a.kappa(s) for s in range(4)], [0.5, 0.45, 0.405, 0.3645])
    U = torch.randn(4, 5, dtype=F64)
    seen = [a.aggregate(torch.zeros(5, dtype=F64), U, [1] * 4).info["kappa"] for _ in range(4)]
    close(seen, [0.5, 0.45, 0.405, 0.3645])


def test_k11_anti_aligned_and_clipping():
    U = t([[1, 0], [1, 0], [-1, 0]])
    w = torch.zeros(2, dtype=F64)
    tol7 = dict(rtol=1e-7, atol=1e-9)
    r = agg(U, w, [1, 1, 1], mode="P", kappa0=1.0)
    close(r.info["theta"], [0, 0, math.pi], **tol7)
    close(r.info["theta_bar"], math.pi / 3, **tol7)
    close(r.info["s"], [0.8660254038, 0.8660254038, -0.8660254038], **tol7)
    close(r.info["S"], 0.8660254038, **tol7)
    close(r.info["ratio"], 1 / 3, **tol7)
    assert not r.info["degenerate"]
    close(r.info["weights"], [1, 1, -1], **tol7)
    close(r.params, [3, 0], **tol7)
    r = agg(U, w, [1, 1, 1], mode="S", kappa0=1.0, clip_delta=False)
    close(r.info["weights"], [0.4826728252, 0.4826728252, 0.0346543497], **tol7)
    h = math.sqrt(3) / 2
    close(r.info["weights"], [(1 + h) / (3 + h)] * 2 + [(1 - h) / (3 + h)], **tol7)
    close(r.params, [0.9306913006, 0], **tol7)
    r = agg(U, w, [1, 1, 1], mode="S", kappa0=1.0, clip_delta=True)
    close(r.info["s"][2], -1.0)
    close(r.info["weights"], [0.5, 0.5, 0])
    close(r.params, [1, 0])


# ---- properties --------------------------------------------------------------------------------
def _rand(K, d, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(d, generator=g, dtype=F64)
    U = 0.7 * common + torch.randn(K, d, generator=g, dtype=F64)
    n = torch.randint(5, 50, (K,), generator=g).to(F64)
    return U.to(dtype), n


@pytest.mark.parametrize("K,d", [(3, 7), (10, 1000), (33, 257)])
@pytest.mark.parametrize("mode", ["S", "P"])
def test_against_float64_recomputation(K, d, mode):
    U, n = _rand(K, d, K * 1000 + d)
    w = torch.randn(d)
    p = n / n.sum()
    r = agg(U, w, n, mode=mode, kappa0=0.7, guard=True)
    a_ref = ref_weights(U, p, mode, kappa=0.7)
    close(r.info["weights"], a_ref, rtol=1e-5, atol=1e-9)
    alpha = 0.7 if mode == "P" else 1.0
    expect = w.to(F64) + alpha * (a_ref[:, None] * U.to(F64)).sum(0)
    close(r.params, expect, rtol=1e-5, atol=1e-5)
    dot, nsq, nbar = kuramoto_stats(U, p)  # one kstats pass vs two passes, fp64
    U64 = U.to(F64)
    mean = (p[:, None] * U64).sum(0)
    close(dot, U64 @ mean, rtol=1e-12, atol=1e-12)
    close(nsq, (U64 * U64).sum(1), rtol=1e-12, atol=0)
    close(nbar, mean @ mean, rtol=1e-12, atol=0)


def test_permutation_and_scaling():
    U, n = _rand(6, 50, 3, dtype=F64)
    w = torch.randn(50, dtype=F64)
    r = agg(U, w, n, kappa0=1.0)
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    rp = agg(U[perm], w, n[perm], kappa0=1.0)
    close(rp.info["weights"], t(r.info["weights"])[perm], rtol=1e-12, atol=1e-15)
    close(rp.params, r.params, rtol=1e-12, atol=1e-12)
    rs = agg(U * 5.0, torch.zeros(50, dtype=F64), n, kappa0=1.0)
    close(rs.info["weights"], r.info["weights"], rtol=1e-10, atol=1e-14)
    close(rs.params, 5.0 * (r.params - w), rtol=1e-10, atol=1e-10)


def test_kappa_zero_is_fedavg_bit_for_bit():
    U, n = _rand(10, 1001, 7)
    w = torch.randn(1001)
    r = agg(U, w, n, mode="S", kappa0=0.0)
    f = build("fedavg").aggregate(w, U, n)
    assert torch.equal(r.params, f.params)
    r = agg(U, w, n, mode="S", kappa0=0.0, server_lr=0.3)
    assert torch.equal(r.params, build("fedavg", server_lr=0.3).aggregate(w, U, n).params)


def test_determinism_and_no_mutation():
    U, n = _rand(10, 4099, 11)
    w = torch.randn(4099)
    U0, w0 = U.clone(), w.clone()
    outs = [agg(U, w, n, mode=m).params for m in "SPS"]
    assert torch.equal(outs[0], outs[2])
    assert torch.equal(U, U0) and torch.equal(w, w0)


def test_nan_client_raise_and_exclude():
    U, n = _rand(5, 40, 5)
    w = torch.randn(40)
    Ub = U.clone()
    Ub[2, 7] = float("nan")
    with pytest.raises(BadUpdateError, match="client 12"):
        build("kuramoto").aggregate(w, Ub, n, client_ids=[10, 11, 12, 13, 14])
    r = build("kuramoto", on_bad_update="exclude").aggregate(w, Ub, n, client_ids=[10, 11, 12, 13, 14])
    keep = [0, 1, 3, 4]
    r0 = build("kuramoto").aggregate(w, U[keep], n[keep], client_ids=[10, 11, 13, 14])
    assert torch.equal(r.params, r0.params)
    assert r.info["excluded"][0]["client_id"] == 12


def test_state_dict_round_trip_mid_run():
    a = build("kuramoto", mode="S", kappa0=0.8, beta=0.7)
    w = torch.zeros(20)
    rounds = [_rand(4, 20, s)[0] for s in range(5)]
    for U in rounds[:2]:
        w = a.aggregate(w, U, [1, 2, 3, 4]).params
    st = a.state_dict()
    b = build("kuramoto", mode="S", kappa0=0.8, beta=0.7)
    b.load_state_dict(st)
    wa = wb = w
    for U in rounds[2:]:
        ra, rb = a.aggregate(wa, U, [1, 2, 3, 4]), b.aggregate(wb, U, [1, 2, 3, 4])
        wa, wb = ra.params, rb.params
        assert torch.equal(wa, wb) and ra.info["kappa"] == rb.info["kappa"]


def test_bad_options_and_payloads():
    with pytest.raises(ValueError, match="mode"):
        build("kuramoto", mode="X")
    with pytest.raises(ValueError, match="beta"):
        build("kuramoto", beta=0.0)
    with pytest.raises(ValueError, match="kappa0"):
        build("kuramoto", kappa0=-1)
    with pytest.raises(ValueError, match="theta_bar"):
        build("kuramoto", theta_bar="median")
    U = torch.randn(3, 4)
    with pytest.raises(BadUpdateError, match="phase"):
        build("kuramoto", mode="C").aggregate(torch.zeros(4), U, [1, 1, 1])
    r = build("kuramoto", mode="C", on_bad_update="exclude").aggregate(
        torch.zeros(4), U, [1, 1, 1], payloads=[{"phase": 1.0}, {}, {"phase": float("inf")}]
    )
    assert [e["client_id"] for e in r.info["excluded"]] == [1, 2]
    with pytest.raises(ValueError, match="num_examples"):
        build("kuramoto").aggregate(torch.zeros(4), U, [1, 1])
    assert "kuramoto_fedavg" in algorithms.available()
    assert build("kuramoto").mode == "S" and build("kuramoto").kappa0 == 0.5
    assert build("kuramoto", mode="C").kappa0 == 0.2 and build("kuramoto", mode="c").mode == "C"


def test_phase_rule_on_tiny_linear():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    spec = FlatSpec.from_module(model)
    a = build("kuramoto", mode="C")
    rule = a.client_rule()
    assert build("kuramoto").client_rule() is None
    g0 = spec.flatten(model)
    ctx = ClientContext(
        client_id=0, round=0, global_flat=g0, spec=spec, lr=0.1, num_examples=8, payload=a.client_payload(0)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 3), torch.randn(8, 2)
    rule.begin(ctx, model)
    norms = []
    for _ in range(3):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        norms.append(float(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double().norm()))
        rule.before_step(ctx, model)
        if not rule.step(ctx, model, opt):
            opt.step()
        ctx.step += 1
        rule.after_step(ctx, model)
    pl = rule.end(ctx, model)
    close(pl["phase"], sum(norms) / 3, rtol=1e-6, atol=0)  # per-tensor norms in fp32


def test_kuramoto_stats_from_kstats_or_a_given_gram():
    """kuramoto_stats keeps its signature: from U (one kstats pass) or from a caller's Gram matrix G, the
    same statistics to 1e-12 (spec §9 item 4); neither U nor G is one clear error."""
    from fedkernels import ops

    U, n = _rand(9, 300, 4, dtype=F64)
    p = n / n.sum()
    a = kuramoto_stats(U, p)
    b = kuramoto_stats(None, p, G=ops.gram(U))
    for x, y in zip(a, b):
        assert x.device.type == "cpu" and x.dtype == F64
        close(x, y, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="kuramoto_stats: pass U"):
        kuramoto_stats(None, p)
