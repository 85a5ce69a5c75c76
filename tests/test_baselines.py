"""Baselines: FedAvgM, FedProx, SCAFFOLD, FedNova (server arithmetic against float64
re-computations, neutral-parameter reductions, state round trips, bad input, client rules on a
tiny nn.Linear with a manual local loop)."""

import copy
import math

import pytest
import torch
from torch import nn

from fedkernels.algorithms import BadUpdateError, ClientContext, available, build
from fedkernels.algorithms.parts import momentum_steps
from fedkernels.flat import FlatSpec

F64 = torch.float64


def close(a, b, rtol=1e-12, atol=1e-12):
    torch.testing.assert_close(torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64), rtol=rtol, atol=atol)


def rand_round(K, d, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    U = torch.randn(K, d, generator=g, dtype=F64).to(dtype)
    n = torch.randint(1, 40, (K,), generator=g).to(F64)
    return U, n


def local_train(rule, model, spec, global_flat, payload, steps=3, lr=0.1, momentum=0.0, cid=0, seed=0, ctx_spec=True):
    """The ClientRule loop of base.ClientRule's docstring; returns (update, payload, grads seen)."""
    spec.load_(model, global_flat)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 3, generator=g), torch.randn(16, 2, generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    ctx = ClientContext(
        client_id=cid,
        round=0,
        global_flat=global_flat,
        spec=spec if ctx_spec else None,
        lr=lr,
        num_examples=16,
        payload=payload,
    )
    if rule is not None:
        rule.begin(ctx, model)
    grads = []
    for s in range(steps):
        opt.zero_grad()
        xb, yb = x[4 * (s % 4) : 4 * (s % 4) + 4], y[4 * (s % 4) : 4 * (s % 4) + 4]
        loss = ((model(xb) - yb) ** 2).mean()
        extra = rule.loss_term(ctx, model) if rule is not None else None
        if extra is not None:
            loss = loss + extra
        loss.backward()
        raw = [p.grad.clone() for p in model.parameters()]
        if rule is not None:
            rule.before_step(ctx, model)
        grads.append((raw, [p.grad.clone() for p in model.parameters()], spec.flatten(model)))
        if rule is None or not rule.step(ctx, model, opt):
            opt.step()
        ctx.step += 1
        if rule is not None:
            rule.after_step(ctx, model)
    pl = rule.end(ctx, model) if rule is not None else {}
    return spec.flatten(model) - global_flat, pl, grads


@pytest.fixture
def linear():
    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    return m, FlatSpec.from_module(m)


def test_registry_names():
    for n in ("fedavgm", "fedprox", "scaffold", "fednova"):
        assert n in available()
        assert build(n).name == n


# ---- FedAvgM -------------------------------------------------------------------------------------
@pytest.mark.parametrize("nesterov", [False, True])
def test_fedavgm_against_float64(nesterov):
    d = 37
    a = build("fedavgm", beta=0.8, server_lr=0.5, nesterov=nesterov)
    w = torch.randn(d, dtype=F64)
    v = torch.zeros(d, dtype=F64)
    w_ref = w.clone()
    for r in range(4):
        U, n = rand_round(3 + r % 2, d, r, dtype=F64)
        ids = list(range(r, r + U.size(0)))
        res = a.aggregate(w, U, n, client_ids=ids)
        p = n / n.sum()
        mean = (p[:, None] * U).sum(0)
        v = 0.8 * v + mean
        w_ref = w_ref + 0.5 * ((0.8 * v + mean) if nesterov else v)
        w = res.params
        close(w, w_ref)
        close(a.momentum, v)


def test_fedavgm_beta_zero_is_fedavg_and_degenerate():
    for seed in range(3):
        U, n = rand_round(5, 101, seed)
        w = torch.randn(101)
        r = build("fedavgm", beta=0.0, server_lr=0.7).aggregate(w, U, n)
        close(r.params, build("fedavg", server_lr=0.7).aggregate(w, U, n).params, rtol=1e-6, atol=1e-6)
    w = torch.randn(5)
    close(build("fedavgm").aggregate(w, torch.zeros(3, 5), [1, 2, 3]).params, w, rtol=0, atol=0)
    one = torch.randn(1, 5)
    close(build("fedavgm").aggregate(w, one, [4]).params, w + one[0], rtol=1e-6, atol=1e-6)


def test_fedavgm_state_round_trip_and_bad_input():
    a = build("fedavgm", beta=0.9)
    w = torch.zeros(20)
    rounds = [rand_round(4, 20, s) for s in range(5)]
    for U, n in rounds[:2]:
        w = a.aggregate(w, U, n).params
    b = build("fedavgm", beta=0.9)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    wa = wb = w
    for U, n in rounds[2:]:
        wa, wb = a.aggregate(wa, U, n).params, b.aggregate(wb, U, n).params
        assert torch.equal(wa, wb)
    with pytest.raises(ValueError, match="beta"):
        build("fedavgm", beta=1.0)
    U, n = rounds[0]
    Ub = U.clone()
    Ub[1, 0] = float("inf")
    with pytest.raises(BadUpdateError):
        build("fedavgm").aggregate(torch.zeros(20), Ub, n)
    c = build("fedavgm", on_bad_update="exclude")
    r = c.aggregate(torch.zeros(20), Ub, n)
    assert torch.equal(r.params, build("fedavgm").aggregate(torch.zeros(20), U[[0, 2, 3]], n[[0, 2, 3]]).params)


# ---- FedProx -------------------------------------------------------------------------------------
def test_fedprox_server_is_fedavg():
    U, n = rand_round(6, 50, 1)
    w = torch.randn(50)
    pl = [{"prox_mu": 0.1}] * len(n)  # what FedProxRule.end sends
    assert torch.equal(
        build("fedprox", mu=0.1).aggregate(w, U, n, payloads=pl).params, build("fedavg").aggregate(w, U, n).params
    )
    with pytest.raises(ValueError, match="mu"):
        build("fedprox", mu=-1)
    with pytest.raises(ValueError, match="prox"):
        build("fedprox", prox="l1")


def test_fedprox_rule_gradient_and_loss_forms(linear):
    model, spec = linear
    g0 = spec.flatten(model).clone()
    mu = 0.5
    agg = build("fedprox", mu=mu)
    U_grad, _, grads = local_train(agg.client_rule(), model, spec, g0, {}, steps=4)
    for raw, new, flat in grads:
        expect = torch.cat([r.reshape(-1) for r in raw]) + mu * (flat - g0)
        close(torch.cat([q.reshape(-1) for q in new]), expect, rtol=1e-6, atol=1e-7)
    assert any((flat - g0).abs().max() > 0 for _, _, flat in grads[1:])  # the term was active
    U_loss, _, _ = local_train(build("fedprox", mu=mu, prox="loss").client_rule(), model, spec, g0, {}, steps=4)
    close(U_grad, U_loss, rtol=1e-5, atol=1e-6)
    U_plain, _, _ = local_train(None, model, spec, g0, {}, steps=4)
    assert not torch.allclose(U_grad, U_plain)
    U_mu0, _, _ = local_train(build("fedprox", mu=0.0).client_rule(), model, spec, g0, {}, steps=4)
    assert torch.equal(U_mu0, U_plain)
    U_nospec, _, _ = local_train(agg.client_rule(), model, spec, g0, {}, steps=4, ctx_spec=False)
    assert torch.equal(U_nospec, U_grad)


# ---- SCAFFOLD ------------------------------------------------------------------------------------
def test_scaffold_rule_correction_and_option_two(linear):
    model, spec = linear
    d = spec.d
    g0 = spec.flatten(model).clone()
    c, ci = torch.randn(d) * 0.1, torch.randn(d) * 0.1
    # the gradient-edit path (fused_step=False) exposes the corrected p.grad after before_step;
    # the fused native step gives the same training (tests/test_fused_rules.py)
    rule = build("scaffold", fused_step=False).client_rule()
    U, pl, grads = local_train(rule, model, spec, g0, {"c": c, "c_i": ci}, steps=5, lr=0.05)
    for raw, new, _ in grads:
        close(
            torch.cat([q.reshape(-1) for q in new]),
            torch.cat([r.reshape(-1) for r in raw]) - ci + c,
            rtol=1e-6,
            atol=1e-7,
        )
    y = g0 + U
    close(pl["delta_c"], -c + (g0 - y) / (5 * 0.05), rtol=1e-6, atol=1e-6)
    assert pl["local_steps"] == 5
    # with momentum_correction the divisor is the effective number of momentum steps
    rule = build("scaffold", momentum_correction=True).client_rule()
    U, pl, _ = local_train(rule, model, spec, g0, {"c": c, "c_i": ci}, steps=5, lr=0.05, momentum=0.9)
    close(pl["delta_c"], -c + (-U) / (momentum_steps(5, 0.9) * 0.05), rtol=1e-6, atol=1e-6)
    # no control variates yet (first round): plain SGD
    U0, pl0, _ = local_train(build("scaffold").client_rule(), model, spec, g0, {}, steps=3)
    Up, _, _ = local_train(None, model, spec, g0, {}, steps=3)
    assert torch.equal(U0, Up)
    close(pl0["delta_c"], -U0 / (3 * 0.1), rtol=1e-6, atol=1e-6)


def test_scaffold_first_round_is_fedavg_and_server_float64(linear):
    model, spec = linear
    N = 6
    a = build("scaffold", server_lr=0.8, weighting="samples")
    a.setup(spec, num_clients=N)
    w = spec.flatten(model).clone()
    ref_c = torch.zeros(spec.d, dtype=F64)
    ref_ci = torch.zeros(N, spec.d, dtype=F64)
    for r, ids in enumerate([[0, 2, 4], [1, 2, 5], [0, 3]]):
        rows, pls = [], []
        for cid in ids:
            U, pl, _ = local_train(
                a.client_rule(),
                model,
                spec,
                w,
                a.client_payload(cid),
                steps=2 + cid % 2,
                lr=0.05,
                cid=cid,
                seed=100 * r + cid,
            )
            rows.append(U)
            pls.append(pl)
        U = torch.stack(rows)
        n = torch.tensor([10.0 + cid for cid in ids])
        res = a.aggregate(w, U, n, client_ids=ids, payloads=pls)
        if r == 0:
            assert torch.equal(res.params, build("fedavg", server_lr=0.8).aggregate(w, U, n).params)
        p = n.to(F64) / n.sum()
        close(res.params, w.to(F64) + 0.8 * (p[:, None] * U.to(F64)).sum(0), rtol=1e-6, atol=1e-6)
        for cid, pl in zip(ids, pls):
            ref_ci[cid] += pl["delta_c"].to(F64)
        ref_c += sum(pl["delta_c"].to(F64) for pl in pls) / N
        close(a.c, ref_c, rtol=1e-5, atol=1e-6)
        close(a.c_table, ref_ci, rtol=1e-5, atol=1e-6)
        close(a.c, ref_ci.mean(0), rtol=1e-5, atol=1e-6)  # c stays the mean of the c_i
        w = res.params


def _scaffold_inputs(d, ids, seed):
    U, n = rand_round(len(ids), d, seed)
    g = torch.Generator().manual_seed(seed + 99)
    return U, n, [{"delta_c": torch.randn(d, generator=g)} for _ in ids]


def test_scaffold_dict_mode_state_round_trip_and_bad_input():
    d = 12
    seq = [([0, 3], 1), ([3, 5, 1], 2), ([2], 3), ([0, 5], 4), ([1, 2, 3], 5)]
    a = build("scaffold")  # N unknown: dict of rows, N = clients seen so far
    tbl = build("scaffold")
    tbl.setup(num_clients=6)
    w = wt = torch.zeros(d)
    for ids, s in seq[:3]:
        U, n, pl = _scaffold_inputs(d, ids, s)
        ra = a.aggregate(w, U, n, client_ids=ids, payloads=pl)
        w, wt = ra.params, tbl.aggregate(wt, U, n, client_ids=ids, payloads=pl).params
    assert sorted(a.c_rows) == [0, 1, 2, 3, 5] and ra.info["c_scale"] == 1 / 5
    assert torch.equal(w, wt)
    for cid in range(6):
        ci = a.client_payload(cid)["c_i"]
        close(tbl.client_payload(cid)["c_i"], torch.zeros(d) if ci is None else ci, rtol=0, atol=0)
    b = build("scaffold")
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    wb = w
    for ids, s in seq[3:]:
        U, n, pl = _scaffold_inputs(d, ids, s)
        w, wb = (
            a.aggregate(w, U, n, client_ids=ids, payloads=pl).params,
            b.aggregate(wb, U, n, client_ids=ids, payloads=pl).params,
        )
        assert torch.equal(w, wb) and torch.equal(a.c, b.c)
    # bad payloads
    U, n, pl = _scaffold_inputs(d, [0, 1, 2], 7)
    with pytest.raises(BadUpdateError, match="delta_c"):
        build("scaffold").aggregate(torch.zeros(d), U, n, payloads=[pl[0], {}, pl[2]])
    with pytest.raises(BadUpdateError, match="expected d"):
        build("scaffold").aggregate(torch.zeros(d), U, n, payloads=[pl[0], {"delta_c": torch.zeros(3)}, pl[2]])
    e = build("scaffold", on_bad_update="exclude")
    e.setup(num_clients=3)
    pl[1] = {"delta_c": torch.full((d,), float("nan"))}
    r = e.aggregate(torch.zeros(d), U, n, payloads=pl)
    assert r.info["excluded"][0]["client_id"] == 1
    assert torch.equal(e.c_table[1], torch.zeros(d))  # excluded client keeps its c_i
    close(e.c, (pl[0]["delta_c"] + pl[2]["delta_c"]) / 3, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="client_ids"):
        e.aggregate(torch.zeros(d), U, n, client_ids=[0, 1, 7], payloads=pl)


def test_scaffold_degenerate_rounds():
    d = 5
    a = build("scaffold")
    w = torch.randn(d)
    r = a.aggregate(w, torch.zeros(2, d), [1, 1], payloads=[{"delta_c": torch.zeros(d)}] * 2)
    assert torch.equal(r.params, w) and torch.equal(a.c, torch.zeros(d))
    one = torch.randn(1, d)
    r = a.aggregate(w, one, [3], payloads=[{"delta_c": torch.ones(d)}])
    close(r.params, w + one[0], rtol=1e-6, atol=1e-7)
    close(a.c, torch.ones(d) / 2)  # two clients seen so far


# ---- FedNova -------------------------------------------------------------------------------------
def test_momentum_steps_matches_simulated_sgd():
    for tau, rho in [(1, 0.0), (5, 0.0), (5, 0.9), (13, 0.5)]:
        w = torch.zeros(1, requires_grad=True)
        opt = torch.optim.SGD([w], lr=0.1, momentum=rho)
        for _ in range(tau):
            opt.zero_grad()
            w.sum().backward()  # constant gradient 1
            opt.step()
        close(-w.detach().double() / 0.1, [momentum_steps(tau, rho)], rtol=1e-5, atol=0)
    with pytest.raises(ValueError):
        momentum_steps(3, 1.0)


def test_fednova_against_float64_and_equal_tau():
    d = 29
    U, n = rand_round(4, d, 3, dtype=F64)
    w = torch.randn(d, dtype=F64)
    taus, rhos = [2, 5, 3, 9], [0.0, 0.9, 0.0, 0.5]
    pls = [{"local_steps": t, "momentum": r} for t, r in zip(taus, rhos)]
    res = build("fednova", server_lr=0.9).aggregate(w, U, n, payloads=pls)
    p = n / n.sum()
    a = torch.tensor([momentum_steps(t, r) for t, r in zip(taus, rhos)], dtype=F64)
    tau_eff = (p * a).sum()
    close(res.params, w + 0.9 * tau_eff * ((p / a)[:, None] * U).sum(0))
    close(res.info["tau_eff"], tau_eff)
    # a_norm overrides; local_momentum is the default rho
    pls2 = [{"a_norm": float(x)} for x in a]
    close(build("fednova", server_lr=0.9).aggregate(w, U, n, payloads=pls2).params, res.params)
    pls3 = [{"local_steps": t} for t in taus]
    r3 = build("fednova", local_momentum=0.5).aggregate(w, U, n, payloads=pls3)
    a3 = torch.tensor([momentum_steps(t, 0.5) for t in taus], dtype=F64)
    close(r3.params, w + (p * a3).sum() * ((p / a3)[:, None] * U).sum(0))
    # equal tau: FedAvg
    U32, n32 = rand_round(6, 300, 4)
    w32 = torch.randn(300)
    r = build("fednova").aggregate(w32, U32, n32, payloads=[{"local_steps": 7}] * 6)
    close(r.params, build("fedavg").aggregate(w32, U32, n32).params, rtol=1e-6, atol=1e-6)
    close(r.info["coef"], (n32 / n32.sum()).double())


def test_fednova_rule_and_bad_payloads(linear):
    model, spec = linear
    g0 = spec.flatten(model).clone()
    agg = build("fednova")
    U, pl, _ = local_train(agg.client_rule(), model, spec, g0, {}, steps=4, momentum=0.9)
    assert pl == {"local_steps": 4, "momentum": 0.9}
    Up, _, _ = local_train(None, model, spec, g0, {}, steps=4, momentum=0.9)
    assert torch.equal(U, Up)  # training unchanged
    U2 = torch.stack([U, 0.5 * U])
    with pytest.raises(BadUpdateError, match="local_steps"):
        agg.aggregate(g0, U2, [1, 1], payloads=[pl, {}])
    with pytest.raises(BadUpdateError, match="local_steps"):
        agg.aggregate(g0, U2, [1, 1], payloads=[pl, {"local_steps": 0}])
    with pytest.raises(BadUpdateError, match="momentum"):
        agg.aggregate(g0, U2, [1, 1], payloads=[pl, {"local_steps": 2, "momentum": 1.5}])
    r = build("fednova", on_bad_update="exclude").aggregate(g0, U2, [1, 1], payloads=[pl, {}])
    close(r.params, g0 + U, rtol=1e-6, atol=1e-7)  # K = 1 after exclusion: w + U
    # a_norm given by some clients: it replaces their local_steps (even a bad one); each row is
    # checked by what it sent, in any position of the round
    U3 = torch.stack([U, 0.5 * U, 0.25 * U])
    for bad, key in (
        ({"local_steps": math.inf}, "local_steps"),
        ({"local_steps": math.nan}, "local_steps"),
        ({"a_norm": math.nan}, "a_norm"),
        ({"a_norm": math.inf}, "a_norm"),
        ({"a_norm": 0.0}, "a_norm"),
    ):
        for pos in range(3):
            pls = [{"a_norm": 2.0, "local_steps": -1}, {"local_steps": 3}, {"a_norm": 4.0}]
            pls[pos] = bad
            with pytest.raises(BadUpdateError, match=rf"\(row {pos}\).*{key}"):
                build("fednova").aggregate(g0, U3, [1, 1, 1], payloads=pls)
    r = build("fednova").aggregate(
        g0, U3, [1, 1, 1], payloads=[{"a_norm": 2.0, "local_steps": -1}, {"local_steps": 3}, {"a_norm": 4.0}]
    )
    assert r.info["a_norm"] == [2.0, 3.0, 4.0]
    z = build("fednova").aggregate(
        g0, torch.zeros(2, spec.d), [1, 1], payloads=[{"local_steps": 1}, {"local_steps": 3}]
    )
    assert torch.equal(z.params, g0)
    st = agg.state_dict()
    b = build("fednova")
    b.load_state_dict(st)
    assert b.round == agg.round
