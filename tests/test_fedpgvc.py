"""FedPGVC and FedPVR: spec docs/specs/fedpgvc.md §9 vectors, layer mask, client rules, server, state."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedkernels.algorithms import BadUpdateError, ClientContext, build
from fedkernels.algorithms.fedpgvc import FedPGVC
from fedkernels.algorithms.fedpgvc.modes import code_shrink_, pgvc_direction_
from fedkernels.algorithms.parts import controlled_entries
from fedkernels.algorithms.control_variates import pvr_control_update
from fedkernels.algorithms.fedpvr import FedPVR
from fedkernels.flat import FlatSpec

D64 = torch.float64


def T(x):
    return torch.tensor(x, dtype=D64)


def bce(out, t):
    return F.binary_cross_entropy_with_logits(out.reshape(-1), t, reduction="none")


def PL(K):
    """What K FedPGVC client rules send (the server checks the client side ran)."""
    return [{"pgvc_skipped_steps": 0} for _ in range(K)]


def local_train(agg, model, batches, lr, loss_fn=None, client_id=0, payload=None, optimizer=None, extras=None):
    """Manual local loop following the hook order of base.ClientRule."""
    loss_fn = loss_fn or (lambda o, t: F.cross_entropy(o, t, reduction="none"))
    spec = FlatSpec.from_module(model)
    g0 = spec.flatten(model).clone()
    rule = agg.client_rule()
    pl = payload if payload is not None else agg.client_payload(client_id)
    ctx = ClientContext(
        client_id, agg.round, g0, spec, lr, sum(len(b[1]) for b in batches), pl, extras=dict(extras or {})
    )
    opt = optimizer or torch.optim.SGD(model.parameters(), lr=lr)
    if rule is not None:
        rule.begin(ctx, model)
    for x, y in batches:
        ctx.batch = (x, y)
        opt.zero_grad()
        loss = loss_fn(model(x), y).mean()
        if rule is not None:
            extra = rule.loss_term(ctx, model)
            if extra is not None:
                loss = loss + extra
        loss.backward()
        if rule is not None:
            rule.before_step(ctx, model)
        if rule is None or not rule.step(ctx, model, opt):
            opt.step()
        ctx.step += 1
        if rule is not None:
            rule.after_step(ctx, model)
    payload_out = rule.end(ctx, model) if rule is not None else {}
    return spec.flatten(model) - g0, payload_out, rule


def logistic(w=0.5, b=-0.25):
    m = nn.Linear(1, 1).double()
    with torch.no_grad():
        m.weight.fill_(w)
        m.bias.fill_(b)
    return m


# ---- §9 U1 / U1b -----------------------------------------------------------------------------
U1_X, U1_Y = T([[1.0], [-2.0]]), T([1.0, 0.0])


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("sgd", [0.544161188838, -0.239243831986]),
        ("hadamard", [0.491954513797, -0.251054401178]),
        ("paper_literal", [0.491954513797, -0.251054401178]),
        ("additive", [0.562379643582, -0.229441073451]),
    ],
)
def test_u1_logistic_one_step(mode, expected):
    agg = FedPGVC(n_ctrl=0 if mode == "sgd" else 1, mode="hadamard" if mode == "sgd" else mode, loss_fn=bce)
    m = logistic()
    _, _, rule = local_train(agg, m, [(U1_X, U1_Y)], 0.1, loss_fn=bce)
    got = torch.cat([m.weight.reshape(-1), m.bias]).detach()
    torch.testing.assert_close(got, T(expected), atol=1e-11, rtol=0)
    if mode == "hadamard":
        torch.testing.assert_close(
            torch.cat([r.reshape(-1) for r in rule.last_rho]), T([-0.182184547434, -0.098027585350]), atol=1e-11, rtol=0
        )


def test_u1_loss_ordering_documents_non_descent():
    def loss_after(mode, n_ctrl):
        m = logistic()
        local_train(FedPGVC(n_ctrl=n_ctrl, mode=mode, loss_fn=bce), m, [(U1_X, U1_Y)], 0.1, loss_fn=bce)
        return float(bce(m(U1_X), U1_Y).mean().detach())

    init = float(bce(logistic()(U1_X), U1_Y).mean().detach())
    assert abs(init - 0.413934250612) < 1e-11
    sgd, add, had = loss_after("hadamard", 0), loss_after("additive", 1), loss_after("hadamard", 1)
    assert abs(sgd - 0.393716963029) < 1e-11 and abs(add - 0.385057831072) < 1e-11
    assert abs(had - 0.417615555373) < 1e-11
    assert add < sgd < init < had


def test_u1b_single_sample_sign():
    m = logistic()
    local_train(FedPGVC(n_ctrl=1, loss_fn=bce), m, [(T([[1.0]]), T([1.0]))], 0.1, loss_fn=bce)
    torch.testing.assert_close(
        torch.cat([m.weight.reshape(-1), m.bias]).detach(), T([0.488959850874, -0.261040149126]), atol=1e-11, rtol=0
    )
    g = torch.Generator().manual_seed(0)
    for trial in range(20):  # property: with B = 1, hadamard never increases a controlled parameter
        net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
        before = [p.detach().clone() for p in net.parameters()]
        x = torch.randn(1, 4, generator=g, dtype=D64)
        y = torch.randint(0, 3, (1,), generator=g)
        local_train(FedPGVC(n_ctrl=2), net, [(x, y)], 0.3)
        for p, q in zip(net.parameters(), before):
            assert bool((p.detach() <= q + 1e-15).all())


# ---- §9 U2 -----------------------------------------------------------------------------------
U2_W = [[0.2, -0.1], [0.0, 0.3], [-0.4, 0.1]]
U2_b = [0.1, 0.0, -0.1]
U2_H, U2_Y = T([[1.0, 2.0], [-1.0, 0.5]]), torch.tensor([2, 0])


def u2_head():
    m = nn.Linear(2, 3).double()
    with torch.no_grad():
        m.weight.copy_(T(U2_W))
        m.bias.copy_(T(U2_b))
    return m


@pytest.mark.parametrize(
    "mode,W,b",
    [
        (
            "hadamard",
            [
                [1.005042938753e-4, -0.112641119199],
                [-0.006500985963, 0.035115036318],
                [-0.679603645708, -0.293949008301],
            ],
            [0.068744565007, -0.131668315054, -0.133997686699],
        ),
        (
            "additive",
            [[-0.443125945303, -0.267975220219], [-0.121480757119, -0.446371652845], [0.364606702422, 1.014346873064]],
            [0.351495391007, -0.524208868005, 0.172713476998],
        ),
    ],
)
def test_u2_softmax_head(mode, W, b):
    m = u2_head()
    _, _, rule = local_train(FedPGVC(n_ctrl=1, mode=mode), m, [(U2_H, U2_Y)], 0.5)
    torch.testing.assert_close(m.weight.detach(), T(W), atol=1e-11, rtol=0)
    torch.testing.assert_close(m.bias.detach(), T(b), atol=1e-11, rtol=0)
    rW, rb = rule.last_rho
    torch.testing.assert_close(
        rW,
        T([[0.760650368762, 0.222136425973], [0.163380666722, 0.911600938410], [-0.924031035484, -1.133737364383]]),
        atol=1e-11,
        rtol=0,
    )
    torch.testing.assert_close(rb, T([-0.278681080479, 0.631252350694, -0.352571270216]), atol=1e-11, rtol=0)
    assert abs(float(rW.mean())) < 1e-14 and abs(float(rb.mean())) < 1e-14


def test_u2_layer_scalar_mean_freezes_classifier():
    m = u2_head()
    local_train(FedPGVC(n_ctrl=1, mode="layer_scalar", stat="mean"), m, [(U2_H, U2_Y)], 0.5)
    torch.testing.assert_close(m.weight.detach(), T(U2_W), atol=1e-14, rtol=0)
    torch.testing.assert_close(m.bias.detach(), T(U2_b), atol=1e-14, rtol=0)


def test_layer_scalar_norm_and_layer_normalize():
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x, y = torch.randn(5, 3, dtype=D64), torch.randint(0, 3, (5,))
    for mode in ("layer_scalar", "layer_normalize"):
        a = FedPGVC(n_ctrl=1, mode=mode, stat="norm", tau=0.7)
        m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()
        m.load_state_dict(net.state_dict())
        # the expected step, computed independently
        ell = F.cross_entropy(m(x), y, reduction="none")
        ps = list(m[2].parameters())
        g = torch.autograd.grad(ell.mean(), ps, retain_graph=True)
        rho = torch.autograd.grad(0.5 * (ell**2).mean(), ps)
        s = [r.norm() for r in rho] if mode == "layer_scalar" else [0.7 / gi.norm() for gi in g]
        exp = [p.detach() - 0.1 * si * gi for p, si, gi in zip(ps, s, g)]
        g_first = torch.autograd.grad(F.cross_entropy(m(x), y), list(m[0].parameters()))
        exp_first = [p.detach() - 0.1 * gi for p, gi in zip(m[0].parameters(), g_first)]
        local_train(a, m, [(x, y)], 0.1)
        for p, e in zip(list(m[2].parameters()) + list(m[0].parameters()), exp + exp_first):
            torch.testing.assert_close(p.detach(), e, atol=1e-13, rtol=0)


# ---- §9 U3 -----------------------------------------------------------------------------------
def test_u3_two_layer_rho():
    net = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2)).double()
    with torch.no_grad():
        net[0].weight.copy_(T([[0.13, -0.13], [0.64, 0.1], [-0.54, 0.36]]))
        net[0].bias.copy_(T([1.3, 0.95, -0.7]))
        net[2].weight.copy_(T([[-1.27, -0.62, 0.04], [-2.33, -0.22, -1.25]]))
        net[2].bias.copy_(T([-0.73, -0.54]))
    X, Y = T([[0.5, -1.0], [1.5, 0.2], [-0.3, 0.8]]), torch.tensor([0, 1, 1])
    ell = F.cross_entropy(net(X), Y, reduction="none").detach()
    torch.testing.assert_close(ell, T([0.333509199965, 1.034352764007, 1.104001402944]), atol=1e-11, rtol=0)
    params = list(net.parameters())
    g = torch.autograd.grad(F.cross_entropy(net(X), Y), params)
    # explicit per-sample sum (the definition), independent of the rule
    rho_ex = [torch.zeros_like(p) for p in params]
    for b in range(3):
        lb = F.cross_entropy(net(X[b : b + 1]), Y[b : b + 1])
        gb = torch.autograd.grad(lb, params)
        for acc, gi in zip(rho_ex, gb):
            acc.add_(float(lb.detach()) * gi / 3)
    agg = FedPGVC(n_ctrl=2, mode="hadamard")
    _, _, rule = local_train(agg, net, [(X, Y)], 0.0)
    rW1, rb1, rW2, rb2 = rule.last_rho
    torch.testing.assert_close(
        rW1, T([[0.258408166716, 0.289133222794], [-0.097512515742, -0.109106876526], [0, 0]]), atol=1e-11, rtol=0
    )
    torch.testing.assert_close(rb1, T([0.462895937939, -0.174677712430, 0]), atol=1e-11, rtol=0)
    torch.testing.assert_close(
        rW2, T([[0.563934398142, 0.598156311339, 0], [-0.563934398142, -0.598156311339, 0]]), atol=1e-11, rtol=0
    )
    torch.testing.assert_close(rb2, T([0.436694281075, -0.436694281075]), atol=1e-11, rtol=0)
    for r, e in zip(rule.last_rho, rho_ex):
        torch.testing.assert_close(r, e, atol=1e-15, rtol=0)
    torch.testing.assert_close(
        g[0], T([[0.220649824713, 0.334702060747], [-0.083264084797, -0.126302664433], [0, 0]]), atol=1e-11, rtol=0
    )
    torch.testing.assert_close(
        g[2], T([[0.432088890430, 0.490777130531, 0], [-0.432088890430, -0.490777130531, 0]]), atol=1e-11, rtol=0
    )
    assert float(rW1[2].abs().max()) == 0.0 and float(rb1[2]) == 0.0


# ---- §9 U4: server aggregation ----------------------------------------------------------------
U4_w = T([1.0, -2.0])
U4_Y = T([[1.5, -1.0], [0.5, -3.5], [2.0, -2.0]])
U4_n = [10, 30, 60]


@pytest.mark.parametrize(
    "opts,expected",
    [
        ({}, [1.333333333333, -2.166666666667]),
        ({"server_lr": 0.5}, [1.166666666667, -2.083333333333]),
        ({"weighting": "samples"}, [1.5, -2.35]),
    ],
)
def test_u4_server(opts, expected):
    new, _ = build("fedpgvc", **opts).aggregate(U4_w, U4_Y - U4_w, U4_n, payloads=PL(3))
    torch.testing.assert_close(new, T(expected), atol=1e-11, rtol=0)


def test_u4_nan_client_and_order_independence():
    Y = U4_Y.clone()
    Y[1] = T([float("nan"), 0.0])
    with pytest.raises(BadUpdateError):
        FedPGVC().aggregate(U4_w, Y - U4_w, U4_n, payloads=PL(3))
    new, info = FedPGVC(on_bad_update="exclude").aggregate(U4_w, Y - U4_w, U4_n, client_ids=[0, 1, 2], payloads=PL(3))
    torch.testing.assert_close(new, T([1.75, -1.5]), atol=1e-12, rtol=0)
    assert info["excluded"][0]["client_id"] == 1
    a = FedPGVC().aggregate(U4_w, U4_Y - U4_w, U4_n, payloads=PL(3))[0]
    b = FedPGVC().aggregate(U4_w, (U4_Y - U4_w)[[2, 0, 1]], [60, 10, 30], client_ids=[2, 0, 1], payloads=PL(3))[0]
    torch.testing.assert_close(a, b, atol=1e-15, rtol=0)


def test_server_against_float64_recomputation():
    g = torch.Generator().manual_seed(3)
    for K, d in ((1, 5), (2, 17), (7, 301)):
        w = torch.randn(d, generator=g)
        U = torch.randn(K, d, generator=g)
        n = torch.randint(1, 50, (K,), generator=g).tolist()
        for weighting in ("uniform", "samples"):
            new, _ = FedPGVC(weighting=weighting, server_lr=0.7).aggregate(w, U, n, payloads=PL(len(n)))
            a = torch.full((K,), 1.0 / K, dtype=D64) if weighting == "uniform" else T(n) / sum(n)
            exp = w.double() + 0.7 * (a[:, None] * U.double()).sum(0)
            torch.testing.assert_close(new.double(), exp, atol=1e-5, rtol=1e-5)


def test_degenerate_rounds():
    w = T([1.0, 2.0, 3.0])
    new, _ = FedPGVC().aggregate(w, torch.zeros(2, 3, dtype=D64), [1, 1], payloads=PL(2))
    assert torch.equal(new, w)
    new, _ = FedPGVC().aggregate(w, T([[1.0, -1.0, 0.5]]), [4], payloads=PL(1))
    torch.testing.assert_close(new, T([2.0, 1.0, 3.5]))
    new, info = FedPGVC(on_bad_update="exclude").aggregate(w, T([[float("inf"), 0, 0]]), [4], payloads=PL(1))
    assert torch.equal(new, w) and info["skipped"]


# ---- §9 U5: one full round ---------------------------------------------------------------------
U5 = {
    "sgd": (
        [0.586335203438, -0.228504151531],
        [0.540580140620, -0.278104406467],
        [0.563457672029, -0.253304278999],
        [0.531728836015, -0.251652139499],
    ),
    "hadamard": (
        [0.483709990318, -0.252115732441],
        [0.500094249856, -0.254014396114],
        [0.491902120087, -0.253065064277],
        [0.495951060043, -0.251532532139],
    ),
    "additive": (
        [0.619769366454, -0.209896975775],
        [0.540293574168, -0.306612501576],
        [0.580031470311, -0.258254738675],
        [0.540015735156, -0.254127369338],
    ),
}


@pytest.mark.parametrize("mode", list(U5))
def test_u5_full_round(mode):
    y1e, y2e, s1, s05 = U5[mode]
    data = [(T([[1.0], [-2.0]]), T([1.0, 0.0])), (T([[0.5], [3.0]]), T([0.0, 1.0]))]
    for eta_g, expected in ((1.0, s1), (0.5, s05)):
        agg = FedPGVC(
            n_ctrl=0 if mode == "sgd" else 1, mode="hadamard" if mode == "sgd" else mode, loss_fn=bce, server_lr=eta_g
        )
        rows, pls = [], []
        for k, (x, y) in enumerate(data):
            m = logistic()
            U, pl, _ = local_train(agg, m, [(x, y), (x, y)], 0.1, loss_fn=bce, client_id=k)
            rows.append(U)
            pls.append(pl)
        w0 = T([0.5, -0.25])
        torch.testing.assert_close(w0 + rows[0], T(y1e), atol=1e-11, rtol=0)
        torch.testing.assert_close(w0 + rows[1], T(y2e), atol=1e-11, rtol=0)
        new, _ = agg.aggregate(w0, torch.stack(rows), [2, 2], client_ids=[0, 1], payloads=pls)
        torch.testing.assert_close(new, T(expected), atol=1e-11, rtol=0)


# ---- §9 U7 / U8: step arithmetic ----------------------------------------------------------------
def test_u7_step_modes():
    p, g, rho = T([1, 2, 3]), T([0.5, -1, 2]), T([0.1, 0.2, -0.3])
    corr = T([0.01, 0.02, 0.03]) - T([0.03, 0.02, 0.01])

    def step(mode, lam=1.0, c=None):
        u = pgvc_direction_([g.clone()], [rho], mode, lam)[0]
        return p - 0.1 * (u + (c if c is not None else 0))

    torch.testing.assert_close(step("code"), T([0.95, 2.1, 2.8]))  # code = plain step
    torch.testing.assert_close(step("hadamard"), T([0.995, 2.02, 3.06]))
    torch.testing.assert_close(step("additive", 0.5), T([0.945, 2.09, 2.815]))
    torch.testing.assert_close(step("code", c=corr), T([0.952, 2.1, 2.798]))
    torch.testing.assert_close(step("hadamard", c=corr), T([0.997, 2.02, 3.058]))
    # mixed range: element 0 in S_sgd, elements 1..2 in S_gvc
    u = g.clone()
    pgvc_direction_([u[1:3]], [rho[1:3]], "hadamard")
    torch.testing.assert_close(p - 0.1 * u, T([0.95, 2.02, 3.06]))


def test_u8_code_shrink():
    W = T([[1, -2], [0.5, 4]])
    code_shrink_([W], [3.0], 0.001)
    torch.testing.assert_close(W, T([[0.997, -1.994], [0.4985, 3.988]]), atol=1e-15, rtol=0)


def test_code_mode_runs_plain_steps_then_shrinks():
    torch.manual_seed(0)
    x, y = torch.randn(6, 3, dtype=D64), torch.randint(0, 2, (6,))
    ref = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    m = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    m.load_state_dict(ref.state_dict())
    local_train(FedPGVC(n_ctrl=0), ref, [(x, y)], 0.1)
    local_train(
        FedPGVC(n_ctrl=1, mode="code", code_eta=0.01, code_layers=["0", "2"]),
        m,
        [(x, y)],
        0.1,
        extras={"local_data": [(x, y)]},
    )
    torch.testing.assert_close(m[0].weight, ref[0].weight, atol=0, rtol=0)  # S_sgd: plain
    # S_gvc: every tensor of Keras layer j (here [Dense(relu), Dense], so "2" is j = 1) scaled by
    # 1 - eta * r_j, r_j = l_j * mean(G_j) with G_j the gradient of Keras tensor j (= 0.bias), at the final model
    # (each tensor of layer j by layer j's r_j, as the script does; not tensor t by its own r_t)
    ell = F.cross_entropy(ref(x), y, reduction="none")
    G = torch.autograd.grad(ell.sum(), list(ref.parameters()))
    r = float(ell[1].detach()) * float(G[1].mean())
    for t in (2, 3):
        torch.testing.assert_close(
            list(m.parameters())[t].detach(), (1 - 0.01 * r) * list(ref.parameters())[t].detach(), atol=1e-14, rtol=0
        )


class KerasMLP(nn.Module):
    """Keras [Flatten, Dense(relu), Dense(relu), Dense]: tensors [W1, b1, W2, b2, W3, b3]."""

    keras_layers = ("flatten", "fc1", "fc2", "fc3")

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(2, 3), nn.Linear(3, 2), nn.Linear(2, 3)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x.flatten(1))))))


HAND = {
    "fc1": ([[0.5, -0.3], [0.2, 0.8], [-0.6, 0.1]], [0.1, -0.2, 0.3]),
    "fc2": ([[0.4, -0.5, 0.3], [-0.2, 0.6, 0.7]], [0.05, -0.1]),
    "fc3": ([[0.3, -0.4], [0.5, 0.2], [-0.7, 0.6]], [0.0, 0.1, -0.1]),
}
HAND_X = [[1.0, 0.5], [-0.5, 1.5], [2.0, -1.0], [0.3, 0.3], [-1.2, -0.4]]
HAND_Y = [0, 2, 1, 1, 0]


def hand_script_shrink(eta):
    """The script's mapping written out in numpy float64 with a hand-written backward pass: r_j =
    l_j * mean(G_j), G_j = d(sum_s l_s)/d(Keras tensor j), j = Keras layer index (Flatten is 0)."""
    import numpy as np

    (W1, b1), (W2, b2), (W3, b3) = [(np.array(w), np.array(b)) for w, b in HAND.values()]
    ell, GW2, Gb2 = [], np.zeros_like(W2), np.zeros_like(b2)
    for x, y in zip(np.array(HAND_X), HAND_Y):
        a1 = W1 @ x + b1
        h1 = np.maximum(a1, 0)
        a2 = W2 @ h1 + b2
        h2 = np.maximum(a2, 0)
        z = W3 @ h2 + b3
        p = np.exp(z - z.max())
        p /= p.sum()
        ell.append(-np.log(p[y]))
        d3 = p.copy()
        d3[y] -= 1
        d2 = (W3.T @ d3) * (a2 > 0)
        GW2 += np.outer(d2, h1)
        Gb2 += d2
    # Keras tensors: 0 W1, 1 b1, 2 W2, 3 b2, 4 W3, 5 b3; fc2 is layer j = 2, fc3 is layer j = 3
    r2, r3 = ell[2] * GW2.mean(), ell[3] * Gb2.mean()
    return {
        "fc1": (W1, b1),
        "fc2": ((1 - eta * r2) * W2, (1 - eta * r2) * b2),
        "fc3": ((1 - eta * r3) * W3, (1 - eta * r3) * b3),
    }, (r2, r3)


def test_code_mode_hand_computation_of_the_script_mapping():
    m = KerasMLP().double()
    with torch.no_grad():
        for name, (w, b) in HAND.items():
            getattr(m, name).weight.copy_(T(w))
            getattr(m, name).bias.copy_(T(b))
    X, Y = T(HAND_X).reshape(5, 1, 1, 2), torch.tensor(HAND_Y)
    exp, (r2, r3) = hand_script_shrink(0.5)
    assert abs(r2) > 1e-3 and abs(r3) > 1e-3  # the classifier (fc3) is shrunk too, by r_3 of tensor b2
    # lr 0: the plain steps leave the model as it is; r from the whole local set, given in two chunks
    local_train(
        FedPGVC(n_ctrl=2, mode="code", code_eta=0.5),
        m,
        [(X[:2], Y[:2])],
        0.0,
        extras={"local_data": [(X[:3], Y[:3]), (X[3:], Y[3:])]},
    )
    for name, (w, b) in exp.items():
        torch.testing.assert_close(getattr(m, name).weight.detach(), T(w), atol=1e-14, rtol=0)
        torch.testing.assert_close(getattr(m, name).bias.detach(), T(b), atol=1e-14, rtol=0)


def test_code_mode_mapping_errors():
    x, y = torch.randn(9, 3, dtype=D64), torch.randint(0, 2, (9,))
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    with pytest.raises(ValueError, match="Keras layer list of Sequential"):
        local_train(FedPGVC(n_ctrl=1, mode="code"), net, [(x, y)], 0.1, extras={"local_data": [(x, y)]})
    with pytest.raises(ValueError, match=r"\['2'\] are missing"):
        local_train(
            FedPGVC(n_ctrl=1, mode="code", code_layers=["0", "relu"]),
            net,
            [(x, y)],
            0.1,
            extras={"local_data": [(x, y)]},
        )
    with pytest.raises(ValueError, match="local_data"):
        local_train(FedPGVC(n_ctrl=1, mode="code", code_layers=["0", "2"]), net, [(x, y)], 0.1)
    # Keras index 5 > the 3 tensors' last index 3: the script's rho_i[j] would raise IndexError
    with pytest.raises(ValueError, match="no tensor 5"):
        local_train(
            FedPGVC(n_ctrl=1, mode="code", code_layers=["0", "a", "b", "c", "d", "2"]),
            net,
            [(x, y)],
            0.1,
            extras={"local_data": [(x, y)]},
        )
    with pytest.raises(ValueError, match="has 1 local samples"):  # j = 1 needs a second sample
        local_train(
            FedPGVC(n_ctrl=1, mode="code", code_layers=["0", "2"]),
            net,
            [(x, y)],
            0.1,
            extras={"local_data": [(x[:1], y[:1])]},
        )


@pytest.mark.parametrize(
    "name,size,n_ctrl,js,sources",
    [
        ("lenet5", 28, 2, [6, 7], ["fc2.weight", "fc2.bias"]),  # the script's create_cnn_model
        ("lenet5", 28, 3, [5, 6, 7], ["fc1.bias", "fc2.weight", "fc2.bias"]),  # its mask [0,0,0,0,1,1,1,1]
        ("digit_cnn_pgvc", 8, 2, [6, 7], ["fc2.weight", "fc2.bias"]),
        ("lenet_keras", 28, 2, [6, 7], ["fc1.weight", "fc1.bias"]),  # build_lenet
        ("mlp_pgvc", 8, 2, [2, 3], ["fc2.weight", "fc2.bias"]),  # [Flatten, Dense x 3]
    ],
)
def test_code_mapping_of_the_papers_models(name, size, n_ctrl, js, sources):
    from fedkernels.algorithms.fedpgvc.modes import code_plan
    from fedkernels.sim.models import build_model

    model = build_model(name, 10, 1, size)
    spec = FlatSpec.from_module(model)
    plan = code_plan(model, spec, controlled_entries(spec, n_ctrl))
    assert plan.js.tolist() == js
    params = dict(model.named_parameters())
    assert [s is params[n] for s, n in zip(plan.sources, sources)] == [True] * len(sources)


def test_simulator_client_code_mode_uses_the_whole_local_set():
    """40 local samples at batch 8; r comes from all 40 (stored order), not the
    last minibatch."""
    from fedkernels.sim.trainer import ClientTrainer
    from fedkernels.sim.config import TrainConfig
    from fedkernels.sim.models import MLP

    torch.manual_seed(3)
    x, y = torch.randn(80, 1, 2, 2, dtype=D64), torch.randint(0, 3, (80,))
    parts = [torch.arange(0, 80, 2), torch.arange(1, 80, 2)]  # client 1: the odd samples
    model = MLP(4, 3, (5, 4)).double()
    spec = FlatSpec.from_module(model)
    tr = ClientTrainer(model, spec, x, y, parts, TrainConfig(epochs=1, batch_size=8, lr=0.1))
    w0 = spec.flatten(model).clone()
    tr.train(1, 0, w0, 0.1, 1, seed=5, rule=FedPGVC(n_ctrl=0).client_rule())
    plain = tr.work.clone()
    tr.train(1, 0, w0, 0.1, 1, seed=5, rule=FedPGVC(n_ctrl=2, mode="code", code_eta=0.5).client_rule())
    # expected, at the plain local model: Keras [Flatten, fc1, fc2, fc3]; fc2 (j=2) by r of fc2.weight,
    # fc3 (j=3) by r of fc2.bias; l_j of the client's j-th sample
    ref = MLP(4, 3, (5, 4)).double()
    spec.load_(ref, plain)
    idx = parts[1]
    ell = F.cross_entropy(ref(x[idx]), y[idx], reduction="none").detach()
    G = torch.autograd.grad(F.cross_entropy(ref(x[idx]), y[idx], reduction="sum"), [ref.fc2.weight, ref.fc2.bias])
    r = [float(ell[2]) * float(G[0].mean()), float(ell[3]) * float(G[1].mean())]
    got = dict(zip(spec.names, spec.views(tr.work).values()))
    for name, p in ref.named_parameters():
        f = {"fc2": 1 - 0.5 * r[0], "fc3": 1 - 0.5 * r[1]}.get(name.split(".")[0], 1.0)
        torch.testing.assert_close(got[name], f * p.detach(), atol=1e-14, rtol=0)
    # the last minibatch alone (8 samples) gives a different r_3
    last = idx[torch.randperm(40, generator=torch.Generator().manual_seed(5))][32:]
    ell8 = F.cross_entropy(ref(x[last]), y[last], reduction="none")
    g8 = torch.autograd.grad(ell8.sum(), [ref.fc2.bias])[0]
    assert abs(float(ell8[3].detach()) * float(g8.mean()) - r[1]) > 1e-3 * abs(r[1])


def test_lr_matched_control_scales_head_gradient_by_running_mean_loss():
    """Spec §8 Exp A matched control: head step (1 + lam * lbar_running) g, the rest plain SGD."""
    torch.manual_seed(1)
    batches = [(torch.randn(5, 3, dtype=D64), torch.randint(0, 2, (5,))) for _ in range(3)]
    ref = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    m = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    m.load_state_dict(ref.state_dict())
    U, out, _ = local_train(FedPGVC(n_ctrl=1, mode="lr_matched", lam=0.5), m, batches, 0.1)
    # manual: running mean of the minibatch mean losses, head gradient scaled by 1 + 0.5 * lbar
    hist = []
    for x, y in batches:
        ref.zero_grad()
        loss = F.cross_entropy(ref(x), y)
        hist.append(float(loss.detach()))
        loss.backward()
        scale = 1.0 + 0.5 * sum(hist) / len(hist)
        with torch.no_grad():
            for i, p in enumerate(ref.parameters()):
                p -= 0.1 * (scale if i >= 2 else 1.0) * p.grad
    for a, b in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, atol=1e-14, rtol=0)
    assert out["pgvc_mean_loss"] == pytest.approx(sum(hist) / len(hist), abs=1e-14)


# ---- layer mask ------------------------------------------------------------------------------
class CNN5(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 6, 5), nn.Conv2d(6, 16, 5)
        self.pool = nn.MaxPool2d(2)
        self.fc1, self.fc2, self.fc3 = nn.Linear(400, 120), nn.Linear(120, 84), nn.Linear(84, 100)


def test_mask_cnn5_and_norms():
    spec = FlatSpec.from_module(CNN5())
    assert spec.d == 69656
    e = controlled_entries(spec, 2)
    assert [x.name for x in e] == ["fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"]
    assert sum(x.numel for x in e) == 18664
    assert controlled_entries(spec, 0) == []
    assert len(controlled_entries(spec, "all")) == 10
    assert [x.module for x in controlled_entries(spec, None, ["fc3", "conv1"])] == ["conv1", "conv1", "fc3", "fc3"]
    with pytest.raises(ValueError, match="fc9"):
        controlled_entries(spec, 2, ["fc9"])
    with pytest.raises(ValueError, match="only 5"):
        controlled_entries(spec, 6)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    spec = FlatSpec.from_module(net, include_buffers=True)
    names = [x.name for x in controlled_entries(spec, 2)]
    assert names == ["2.weight", "2.bias", "3.weight", "3.bias", "4.weight", "4.bias"]  # LN between joins
    assert [x.name for x in controlled_entries(spec, 3)][:4] == ["0.weight", "0.bias", "1.weight", "1.bias"]


def test_n_ctrl_zero_is_fedavg_bitwise():
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 3))
    batches = [(torch.randn(4, 3), torch.randint(0, 3, (4,))) for _ in range(3)]
    ref = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 3))
    ref.load_state_dict(base.state_dict())
    Uref, _, _ = local_train(build("fedavg"), ref, batches, 0.1)
    for mode in ("hadamard", "additive", "layer_scalar", "layer_normalize", "code"):
        m = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 3))
        m.load_state_dict(base.state_dict())
        U, _, _ = local_train(FedPGVC(n_ctrl=0, mode=mode), m, batches, 0.1)
        assert torch.equal(U, Uref)
    w = torch.randn(20)
    Us = torch.randn(4, 20)
    a = FedPGVC(n_ctrl=0).aggregate(w, Us, [1, 2, 3, 4], payloads=PL(4))[0]
    b = build("fedavg", weighting="uniform").aggregate(w, Us, [1, 2, 3, 4])[0]
    assert torch.equal(a, b)


def test_nan_policy_skip_and_raise():
    m = logistic()
    before = torch.cat([m.weight.reshape(-1), m.bias]).detach().clone()
    bad = (T([[float("nan")]]), T([1.0]))
    U, pl, _ = local_train(FedPGVC(n_ctrl=1, loss_fn=bce), m, [bad], 0.1, loss_fn=bce)
    assert pl["pgvc_skipped_steps"] == 1 and torch.equal(U, torch.zeros(2, dtype=D64))
    assert torch.equal(torch.cat([m.weight.reshape(-1), m.bias]).detach(), before)
    with pytest.raises(FloatingPointError):
        local_train(FedPGVC(n_ctrl=1, loss_fn=bce, nan_policy="raise"), logistic(), [bad], 0.1, loss_fn=bce)


def test_bad_options():
    for kw in (
        {"mode": "x"},
        {"n_ctrl": -1},
        {"n_ctrl": "some"},
        {"stat": "max"},
        {"weighting": "w"},
        {"server_rule": "q"},
        {"nan_policy": "ignore"},
        {"loss_clip": 0.0},
    ):
        with pytest.raises(ValueError):
            FedPGVC(**kw)
    with pytest.raises(ValueError):
        FedPVR(n_ctrl=-2)


def test_loss_clip_only_inside_rho():
    m1, m2 = u2_head(), u2_head()
    _, _, r1 = local_train(FedPGVC(n_ctrl=1, loss_clip=1.5), m1, [(U2_H, U2_Y)], 0.5)
    ell = F.cross_entropy(m2(U2_H), U2_Y, reduction="none")
    rho = torch.autograd.grad((ell.detach().clamp(max=1.5) * ell).mean(), list(m2.parameters()))
    for a, b in zip(r1.last_rho, rho):
        torch.testing.assert_close(a, b, atol=1e-15, rtol=0)


# ---- FedPVR ----------------------------------------------------------------------------------
def test_u6_pvr_control_variates():
    x, c = T([1.0, 2.0]), T([0.1, -0.2])
    ci_new, dci = pvr_control_update(x, T([0.8, 2.3]), c, T([0.05, 0.0]), 4, 0.1)
    torch.testing.assert_close(ci_new, T([0.45, -0.55]))
    torch.testing.assert_close(dci, T([0.4, -0.55]))
    cj_new, dcj = pvr_control_update(x, T([1.1, 1.9]), c, T([0.0, 0.0]), 4, 0.1)
    torch.testing.assert_close(cj_new, T([-0.35, 0.45]))
    torch.testing.assert_close(dcj, T([-0.35, 0.45]))
    agg = FedPVR(n_ctrl="all", num_clients=4)
    agg.setup(None, 4, x)
    agg.c = c.clone()
    Y = torch.stack([T([0.8, 2.3]), T([1.1, 1.9])])
    new, _ = agg.aggregate(x, Y - x, [1, 1], client_ids=[1, 3], payloads=[{"delta_c": dci}, {"delta_c": dcj}])
    torch.testing.assert_close(new, T([0.95, 2.1]))
    torch.testing.assert_close(agg.c, T([0.1125, -0.225]))
    torch.testing.assert_close(agg.c_table[1], T([0.4, -0.55]))
    torch.testing.assert_close(agg.c_table[3], T([-0.35, 0.45]))
    assert float(agg.c_table[[0, 2]].abs().max()) == 0.0


def _pvr_net():
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def test_pvr_rule_corrected_step_and_delta_c():
    net = _pvr_net()
    spec = FlatSpec.from_module(net)
    agg = FedPVR(n_ctrl=2)
    agg.setup(spec, 3, spec.flatten(net))
    d_c = agg.d_c
    assert d_c == 4 * 4 + 4 + 4 * 2 + 2
    agg.c = torch.linspace(-0.1, 0.1, d_c, dtype=D64)
    agg.c_table[2] = torch.linspace(0.2, -0.05, d_c, dtype=D64)
    x, y = torch.randn(5, 3, dtype=D64), torch.randint(0, 2, (5,))
    ref = _pvr_net()
    g = torch.autograd.grad(F.cross_entropy(ref(x), y), list(ref.parameters()))
    corr = agg.c - agg.c_table[2]
    gflat = torch.cat([t.reshape(-1) for t in g])
    off = spec.d - d_c
    gflat[off:] += corr
    w0 = spec.flatten(ref)
    exp = w0 - 0.2 * gflat
    U, pl, _ = local_train(agg, net, [(x, y)], 0.2, client_id=2)
    torch.testing.assert_close(w0 + U, exp, atol=1e-14, rtol=0)
    torch.testing.assert_close(pl["delta_c"], -agg.c - U[off:] / 0.2, atol=1e-12, rtol=0)
    assert pl["num_steps"] == 1


def _scaffold_ref(w, U, dC, ids, c, ctab, N):
    K = U.shape[0]
    new = w + U.mean(0)
    c2 = c + (K / N) * dC.mean(0)
    ctab2 = ctab.clone()
    for k, i in enumerate(ids):
        ctab2[i] += dC[k]
    return new, c2, ctab2


def test_pvr_all_is_scaffold_partial_participation_and_state_roundtrip():
    g = torch.Generator().manual_seed(11)
    N, d = 6, 13
    w = torch.randn(d, generator=g, dtype=D64)
    rounds = []
    for r in range(4):
        K = 1 + r % 3
        ids = torch.randperm(N, generator=g)[:K].tolist()
        rounds.append((torch.randn(K, d, generator=g, dtype=D64), torch.randn(K, d, generator=g, dtype=D64), ids))
    agg = build("fedpvr", n_ctrl="all", num_clients=N)
    agg.setup(None, N, w)
    c, ctab, ww = torch.zeros(d, dtype=D64), torch.zeros(N, d, dtype=D64), w.clone()
    snap = None
    for r, (U, dC, ids) in enumerate(rounds):
        if r == 2:
            snap = agg.state_dict()
            w_at2 = ww.clone()
        ww_new, _ = agg.aggregate(ww, U, [1] * len(ids), ids, [{"delta_c": x} for x in dC])
        ref_w, c, ctab = _scaffold_ref(ww, U, dC, ids, c, ctab, N)
        torch.testing.assert_close(ww_new, ref_w, atol=1e-12, rtol=0)
        torch.testing.assert_close(agg.c, c, atol=1e-12, rtol=0)
        torch.testing.assert_close(agg.c_table, ctab, atol=1e-12, rtol=0)
        ww = ww_new
    agg2 = FedPVR(n_ctrl="all")
    agg2.load_state_dict(snap)
    ww2 = w_at2
    for U, dC, ids in rounds[2:]:
        ww2, _ = agg2.aggregate(ww2, U, [1] * len(ids), ids, [{"delta_c": x} for x in dC])
    assert torch.equal(ww2, ww) and torch.equal(agg2.c, agg.c) and torch.equal(agg2.c_table, agg.c_table)
    assert agg2.round == agg.round == 4


def test_pvr_bad_payload():
    w = torch.zeros(4, dtype=D64)
    agg = FedPVR(n_ctrl="all", num_clients=3)
    U = torch.ones(2, 4, dtype=D64)
    with pytest.raises(BadUpdateError, match="delta_c"):
        agg.aggregate(w, U, [1, 1], [0, 1], [{"delta_c": torch.zeros(4, dtype=D64)}, {}])
    with pytest.raises(BadUpdateError, match="length"):
        agg.aggregate(
            w, U, [1, 1], [0, 1], [{"delta_c": torch.zeros(4, dtype=D64)}, {"delta_c": torch.zeros(3, dtype=D64)}]
        )
    agg = FedPVR(n_ctrl="all", num_clients=3, on_bad_update="exclude")
    new, info = agg.aggregate(
        w,
        U,
        [1, 1],
        [0, 1],
        [{"delta_c": torch.ones(4, dtype=D64)}, {"delta_c": torch.full((4,), float("nan"), dtype=D64)}],
    )
    assert [e["client_id"] for e in info["excluded"]] == [1]
    torch.testing.assert_close(agg.c, torch.full((4,), 1 / 3, dtype=D64))
    assert float(agg.c_table[1].abs().max()) == 0.0
    with pytest.raises(ValueError, match="number of clients"):
        FedPVR(n_ctrl="all").aggregate(w, U, [1, 1])


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="workers=N forks")
def test_simulator_code_mode_workers_bit_identical_and_shrinks():
    """code mode through the simulator: workers=2 equals one process, and the shrink changed the
    global model (against plain FedAvg-style training, n_ctrl=0)."""
    from fedkernels.sim import presets
    from fedkernels.sim.config import apply_overrides
    from fedkernels.sim.simulation import Simulation

    def run(*extra):
        cfg = apply_overrides(
            presets.get("smoke"),
            [
                "threads=1",
                "verbose=false",
                "plots=false",
                "progress=false",
                "algorithm.name=fedpgvc",
                "algorithm.options.mode=code",
                "algorithm.options.code_eta=0.05",
                "bad_client_policy=raise",
                *extra,
            ],
        )
        s = Simulation(cfg, write_outputs=False)
        s.run()
        return s.global_flat.clone()

    one, two, plain = run(), run("workers=2"), run("algorithm.options.n_ctrl=0")
    assert torch.equal(one, two)
    assert not torch.equal(one, plain) and bool(torch.isfinite(one).all())


def test_simulator_code_mode_bad_layer_list_stops_at_setup():
    """A model whose Keras layer list is unknown (or wrong) stops the run once, at setup, even under
    the exclude policy (which would otherwise drop every client of every round with a warning)."""
    from fedkernels.sim import presets
    from fedkernels.sim.config import apply_overrides
    from fedkernels.sim.simulation import Simulation

    cfg = apply_overrides(
        presets.get("smoke"),
        [
            "threads=1",
            "verbose=false",
            "plots=false",
            "progress=false",
            "algorithm.name=fedpgvc",
            "algorithm.options.mode=code",
            "algorithm.options.code_layers=[nope]",
            "bad_client_policy=exclude",
        ],
    )
    s = Simulation(cfg, write_outputs=False)
    with pytest.raises(ValueError, match="code_layers"):
        s.setup()
