"""GC-Fed: spec docs/specs/gcfed.md §9 vectors (T1-T8), layer splits, client rule, server, bad input."""

import pytest
import torch
from torch import nn

from fedkernels.algorithms import ClientContext, build
from fedkernels.algorithms import gcfed as G
from fedkernels.algorithms.gcfed import GCFed, apply_gc_
from fedkernels.ops import gc_project_
from fedkernels.algorithms.gcfed.options import gc_mean_variant_
from fedkernels.algorithms.parts import split_layers
from fedkernels.flat import FlatSpec

D64 = torch.float64


def T(x, dtype=D64):
    return torch.tensor(x, dtype=dtype)


def gc(x, **kw):
    y = x.clone()
    gc_project_([y], kw.get("vector_policy", "center"), kw.get("min_fanin", 2))
    return y


# ---- T1-T3: the projection -------------------------------------------------------------------
def test_t1_linear():
    Gm = T([[1, 2, 6], [-3, 0.5, 0.25]])
    out = gc(Gm)
    torch.testing.assert_close(out, T([[-2, -1, 3], [-2.25, 1.25, 1.0]]), atol=1e-12, rtol=0)
    P = torch.eye(3, dtype=D64) - torch.ones(3, 3, dtype=D64) / 3
    torch.testing.assert_close(out, Gm @ P)
    torch.testing.assert_close(out, (P @ Gm.T).T)
    assert float(out.sum(1).abs().max()) < 1e-12


C = T([0.5, -1, 2, 3.5, 0, 1.5, -2.5, 4, 1, 1, 1, 1, 2, 2, 2, 10]).reshape(2, 2, 2, 2)


def test_t2_conv_and_t2b_variants():
    torch.testing.assert_close(
        gc(C).reshape(2, 8), T([[-0.5, -2, 1, 2.5, -1, 0.5, -3.5, 3], [-1.5, -1.5, -1.5, -1.5, -0.5, -0.5, -0.5, 7.5]])
    )
    exp = {
        "cout_cin": [[-0.75, -2.25, 0.75, 2.25, -0.75, 0.75, -3.25, 3.25], [0, 0, 0, 0, -2, -2, -2, 6]],
        "cout_taps": [
            [0.25, -1.25, 2.25, -0.25, -0.25, 1.25, -2.25, 0.25],
            [-0.5, -0.5, -0.5, -4.5, 0.5, 0.5, 0.5, 4.5],
        ],
        "cout_cin_kw": [[-0.75, -2.25, 0.75, 2.25, 1.25, -1.25, -1.25, 1.25], [0, 0, 0, 0, 0, -4, 0, 4]],
        "cin_taps": [[-0.25, -1, 0.5, 1.25, -1, -0.25, -2.25, -3], [0.25, 1, -0.5, -1.25, 1, 0.25, 2.25, 3]],
    }
    for name, e in exp.items():
        y = C.clone()
        gc_mean_variant_(y, name)
        torch.testing.assert_close(y.reshape(2, 8), T(e), atol=1e-12, rtol=0)
        # through apply_gc_: the variant on the conv tensor, standard GC on the rest
        y, b = C.clone(), T([1, 2, 3, 6])
        apply_gc_([y, b], "center", 2, name)
        torch.testing.assert_close(y.reshape(2, 8), T(e), atol=1e-12, rtol=0)
        torch.testing.assert_close(b, T([-2, -1, 0, 3]))


def test_t3_edge_cases():
    b = T([1, 2, 3, 6])
    torch.testing.assert_close(gc(b, vector_policy="center"), T([-2, -1, 0, 3]))
    torch.testing.assert_close(gc(b, vector_policy="skip"), b)
    lin1 = T([[2], [5]])
    torch.testing.assert_close(gc(lin1), lin1)
    torch.testing.assert_close(gc(lin1, min_fanin=1), T([[0], [0]]))
    torch.testing.assert_close(
        gc(torch.arange(1, 10, dtype=D64).reshape(1, 1, 3, 3)).reshape(-1), torch.arange(-4, 5, dtype=D64)
    )
    assert float(gc(T(7.0))) == 7.0
    assert bool(torch.isnan(gc(T([1, 2, 3, float("nan")]))).all())
    y = gc(T([1, float("inf"), 3]))
    assert y[0] == -float("inf") and torch.isnan(y[1]) and y[2] == -float("inf")
    h = gc(torch.tensor([1000, 1001, 1001, 1001], dtype=torch.float16))
    assert h.tolist() == [-0.75, 0.25, 0.25, 0.25]
    X = torch.randn(5, 7, dtype=D64)
    torch.testing.assert_close(gc(gc(X)), gc(X))
    for e in (torch.zeros(0, 8), torch.zeros(0)):
        assert gc(e).numel() == 0


def test_projection_random_noncontiguous_and_dtypes():
    g = torch.Generator().manual_seed(0)
    shapes = [(32, 3, 5, 5), (64, 3, 3, 3), (4, 1, 1, 1), (10, 512), (100,), (7,)]
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        ts = [torch.randn(s, generator=g).to(dtype) for s in shapes]
        ts.append(torch.randn(16, 8, 3, 3, generator=g).to(dtype).to(memory_format=torch.channels_last))
        ts.append(torch.randn(9, 6, generator=g).to(dtype).T)  # transposed view
        ref = []
        for t in ts:  # float64 recomputation from the §9 formula
            x = t.double()
            if x.dim() == 1:
                ref.append(x - x.mean())
            elif x[0].numel() < 2:
                ref.append(x)
            else:
                ref.append(x - x.mean(dim=tuple(range(1, x.dim())), keepdim=True))
        gc_project_(ts, "center", 2)
        tol = 1e-12 if dtype == torch.float64 else (1e-5 if dtype == torch.float32 else 2e-2)
        for t, r in zip(ts, ref):
            torch.testing.assert_close(t.double(), r, atol=tol * max(1.0, float(r.abs().max())), rtol=0)


def test_native_gc_matches_reference():
    from fedkernels import reference

    g = torch.Generator().manual_seed(1)
    ts = [torch.randn(6, 4, 3, 3, generator=g), torch.randn(5, generator=g), torch.randn(3, 1, generator=g)]
    a = [t.clone() for t in ts]
    gc_project_(a, "center", 2)  # the native op (the extension is required)
    b = [t.clone() for t in ts]
    reference.gc_project_(b, "center", 2)
    assert not torch.equal(a[0], ts[0])
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=0)


# ---- T4: Global GC on an aggregated update ------------------------------------------------------
def t4_setup():
    m = nn.Linear(4, 2).double()
    spec = FlatSpec.from_module(m)
    w = torch.cat([T([[0.5, -0.5, 1, 0], [0, 2, -1, 1]]).reshape(-1), T([0.25, -0.25])])
    dW = [
        [[1, 0, -1, 0], [0.5, 0.5, 0.5, 0.5]],
        [[0, 2, 0, 0], [-1, 0, 1, 2]],
        [[1, -1, 3, 1], [0, 0, 0.5, 0.5]],
        [[2, 0, 2, 0], [0.5, -0.5, 0, 1]],
    ]
    db = [[1, 0], [0.5, 0.5], [0.5, 0], [1, 0.5]]
    U = torch.stack([torch.cat([T(a).reshape(-1), T(b)]) for a, b in zip(dW, db)])
    return spec, w, U


@pytest.mark.parametrize(
    "name,opts,W,b",
    [
        ("global_gc", {}, [[0.875, -0.875, 1.375, -0.375], [-0.375, 1.625, -0.875, 1.625]], [0.5, -0.5]),
        (
            "global_gc",
            {"vector_policy": "skip"},
            [[0.875, -0.875, 1.375, -0.375], [-0.375, 1.625, -0.875, 1.625]],
            [1.0, 0.0],
        ),
        (
            "global_gc",
            {"server_lr": 0.5},
            [[0.6875, -0.6875, 1.1875, -0.1875], [-0.1875, 1.8125, -0.9375, 1.3125]],
            None,
        ),
        ("fedavg", {"weighting": "uniform"}, [[1.5, -0.25, 2, 0.25], [0, 2, -0.5, 2]], [1.0, 0.0]),
        (
            "gcfed",
            {"local_layers": "none", "global_scope": "none"},
            [[1.5, -0.25, 2, 0.25], [0, 2, -0.5, 2]],
            [1.0, 0.0],
        ),
    ],
)
def test_t4_global_gc(name, opts, W, b):
    spec, w, U = t4_setup()
    agg = build(name, **opts)
    agg.setup(spec, 4, w)
    new, _ = agg.aggregate(w, U, [1, 2, 3, 4])
    torch.testing.assert_close(new[:8].reshape(2, 4), T(W), atol=1e-12, rtol=0)
    if b is not None:
        torch.testing.assert_close(new[8:], T(b), atol=1e-12, rtol=0)
    if name == "global_gc":
        torch.testing.assert_close(new[:8].reshape(2, 4).mean(1), T([0.25, 0.5]))  # row means kept
        cent = U.clone()  # linearity: mean of centred updates == centred mean
        for k in range(4):
            gc_project_([cent[k, :8].view(2, 4), cent[k, 8:]], opts.get("vector_policy", "center"), 2)
        torch.testing.assert_close(new, w + opts.get("server_lr", 1.0) * cent.mean(0), atol=1e-12, rtol=0)


def test_neutral_is_fedavg_bitwise_and_random_vs_float64():
    g = torch.Generator().manual_seed(4)
    net = nn.Sequential(nn.Conv2d(2, 4, 3), nn.Flatten(), nn.Linear(4, 3))
    spec = FlatSpec.from_module(net)
    for K in (1, 2, 5):
        w = torch.randn(spec.d, generator=g)
        U = torch.randn(K, spec.d, generator=g)
        n = torch.randint(1, 9, (K,), generator=g).tolist()
        agg = build("gcfed", local_layers="none", global_scope="none")
        agg.setup(spec, 10, w)
        assert torch.equal(agg.aggregate(w, U, n)[0], build("fedavg", weighting="uniform").aggregate(w, U, n)[0])
        for scope in ("all", "complement"):
            agg = build("gcfed", global_scope=scope, weighting="samples", server_lr=0.8)
            agg.setup(spec, 10, w)
            new, _ = agg.aggregate(w, U, n, payloads=[{"local_gc": 2}] * K)  # as LocalGCRule.end sends
            p = T(n) / sum(n)
            delta = (p[:, None] * U.double()).sum(0)
            ents = [e for e in spec.entries if scope == "all" or e.module == "2"]
            for e in ents:
                v = delta[e.slice].view(e.shape)
                v.sub_(v.mean() if v.dim() == 1 else v.reshape(v.shape[0], -1).mean(1).view(-1, *[1] * (v.dim() - 1)))
            torch.testing.assert_close(new.double(), w.double() + 0.8 * delta, atol=1e-5, rtol=1e-5)
    zero = build("global_gc")
    zero.setup(spec, 3, w)
    assert torch.equal(zero.aggregate(w, torch.zeros(2, spec.d), [1, 1])[0], w)


# ---- T5 / T6: local step ordering and momentum -------------------------------------------------
def one_param_rule(agg, w0):
    m = nn.Linear(3, 1, bias=False).double()
    with torch.no_grad():
        m.weight.copy_(T(w0))
    spec = FlatSpec.from_module(m)
    agg.setup(spec, 1, spec.flatten(m))
    rule = agg.client_rule()
    ctx = ClientContext(0, 0, spec.flatten(m), spec, 0.1, 1, {})
    rule.begin(ctx, m)
    return m, rule, ctx


def manual_step(m, rule, ctx, opt, g):
    opt.zero_grad()
    m.weight.grad = T(g).clone()  # the gradient a backward pass would leave
    rule.before_step(ctx, m)
    if not rule.step(ctx, m, opt):
        opt.step()
    ctx.step += 1
    rule.after_step(ctx, m)


def test_t5_orders():
    m, rule, ctx = one_param_rule(build("local_gc"), [[1, 2, 3]])
    manual_step(m, rule, ctx, torch.optim.SGD(m.parameters(), lr=0.1, weight_decay=0.1), [[0.3, 0.6, 0.9]])
    torch.testing.assert_close(m.weight.detach(), T([[1.02, 1.98, 2.94]]), atol=1e-12, rtol=0)
    m, rule, ctx = one_param_rule(build("local_gc", local_order="post_wd", weight_decay=0.1), [[1, 2, 3]])
    manual_step(m, rule, ctx, torch.optim.SGD(m.parameters(), lr=0.1), [[0.3, 0.6, 0.9]])
    torch.testing.assert_close(m.weight.detach(), T([[1.04, 2.00, 2.96]]), atol=1e-12, rtol=0)


def test_t6_momentum():
    m, rule, ctx = one_param_rule(build("local_gc"), [[1, 2, 3]])
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    manual_step(m, rule, ctx, opt, [[0.3, 0.6, 0.9]])
    torch.testing.assert_close(m.weight.detach(), T([[1.03, 2.0, 2.97]]), atol=1e-12, rtol=0)
    manual_step(m, rule, ctx, opt, [[1, -1, 0]])
    torch.testing.assert_close(m.weight.detach(), T([[0.957, 2.1, 2.943]]), atol=1e-12, rtol=0)
    assert abs(float(m.weight.detach().mean()) - 2.0) < 1e-12
    # post_momentum (the rule steps itself): p -= lr * GC(buf), buf un-centred
    m, rule, ctx = one_param_rule(build("local_gc", local_order="post_momentum", momentum=0.9), [[1, 2, 3]])
    manual_step(m, rule, ctx, torch.optim.SGD(m.parameters(), lr=0.1), [[0.3, 0.6, 0.9]])
    manual_step(m, rule, ctx, torch.optim.SGD(m.parameters(), lr=0.1), [[1, -1, 0]])
    buf2 = 0.9 * T([0.3, 0.6, 0.9]) + T([1, -1, 0])
    exp = T([1.03, 2.0, 2.97]) - 0.1 * (buf2 - buf2.mean())
    torch.testing.assert_close(m.weight.detach().reshape(-1), exp, atol=1e-12, rtol=0)


# ---- T7: one full round end to end -------------------------------------------------------------
T7 = {
    "fedavg": (
        [[0.96935, 0.440818164062, 0.037004492188], [0.0464, -0.417820117188, 0.921739648438]],
        [[0.86974296875, 0.0942328125], [0.561208203125, 0.87691171875]],
    ),
    "local_gc": (
        [[1.049262847222, 0.475294878472, -0.024557725694], [0.068771875, -0.422140364583, 0.853368489583]],
        [[0.91562109375, 0.08437890625], [0.638808376736, 0.861191623264]],
    ),
    "global_gc": (
        [[0.986959114583, 0.458427278646, 0.054613606771], [0.029626822917, -0.434593294271, 0.904966471354]],
        [[0.887755078125, 0.112244921875], [0.592148242188, 0.907851757812]],
    ),
    "gcfed": (
        [[1.030304253472, 0.470555230035, -0.000859483507], [0.056258072917, -0.425268815104, 0.869010742188]],
        [[0.906969661458, 0.093030338542], [0.625831228299, 0.874168771701]],
    ),
}


def t7_net():
    net = nn.Sequential(nn.Linear(3, 2, bias=False), nn.Linear(2, 2, bias=False)).double()
    with torch.no_grad():
        net[0].weight.copy_(T([[1, 0.5, 0], [0, -0.5, 1]]))
        net[1].weight.copy_(T([[1, 0], [0.5, 1]]))
    return net


ROUND_PAYLOADS = []  # what the client rules of the last local_train calls sent


def local_train(agg, net, batches, lr, cid=0):
    spec = FlatSpec.from_module(net)
    g0 = spec.flatten(net).clone()
    rule = agg.client_rule()
    ctx = ClientContext(cid, agg.round, g0, spec, lr, 1, agg.client_payload(cid))
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    if rule:
        rule.begin(ctx, net)
    for x, y in batches:
        ctx.batch = (x, y)
        opt.zero_grad()
        loss = 0.5 * ((net(x) - y) ** 2).sum()
        loss.backward()
        if rule:
            rule.before_step(ctx, net)
        if not rule or not rule.step(ctx, net, opt):
            opt.step()
        ctx.step += 1
        if rule:
            rule.after_step(ctx, net)
    out = rule.end(ctx, net) if rule else {}
    ROUND_PAYLOADS.append(out)
    return spec.flatten(net) - g0


@pytest.mark.parametrize("name", list(T7))
@pytest.mark.parametrize("scope", ["all", "complement"])
def test_t7_full_round(name, scope):
    data = [(T([[1, 2, -1]]), T([[1, 0]])), (T([[0, 1, 3]]), T([[0, 2]]))]
    opts = {"global_layers": ["1"], "global_scope": scope} if name == "gcfed" else {}
    if name == "fedavg":
        opts = {"weighting": "uniform"}
    agg = build(name, **opts)
    spec = FlatSpec.from_module(t7_net())
    w0 = spec.flatten(t7_net())
    agg.setup(spec, 2, w0)
    ROUND_PAYLOADS.clear()
    rows = [local_train(agg, t7_net(), [(x, y), (x, y)], 0.1, k) for k, (x, y) in enumerate(data)]
    if name == "local_gc":
        torch.testing.assert_close(
            rows[0][:6].view(2, 3),
            T([[-0.019744444444, -0.078977777778, 0.098722222222], [0.032355555556, 0.129422222222, -0.161777777778]]),
            atol=1e-11,
            rtol=0,
        )
    new, _ = agg.aggregate(w0, torch.stack(rows), [1, 1], [0, 1], payloads=ROUND_PAYLOADS)
    W1, W2 = T7[name]
    torch.testing.assert_close(new[:6].view(2, 3), T(W1), atol=1e-9, rtol=0)
    torch.testing.assert_close(new[6:].view(2, 2), T(W2), atol=1e-9, rtol=0)


# ---- T8: layer splits ----------------------------------------------------------------------------
CNN = ["conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
MLP = [f"fc{i}.{p}" for i in (1, 2, 3) for p in ("weight", "bias")]
VGG = [f"features.{i}.{p}" for i in (0, 3, 6, 8, 11, 13, 16, 18) for p in ("weight", "bias")] + [
    f"classifier.{i}.{p}" for i in (0, 3, 6) for p in ("weight", "bias")
]


def resnet18_gn_names():
    names = ["conv1.weight", "bn1.weight", "bn1.bias"]
    for layer in range(1, 5):
        for blk in range(2):
            pre = f"layer{layer}.{blk}."
            names += [
                pre + s for s in ("conv1.weight", "bn1.weight", "bn1.bias", "conv2.weight", "bn2.weight", "bn2.bias")
            ]
            if layer > 1 and blk == 0:
                names += [pre + s for s in ("downsample.0.weight", "downsample.1.weight", "downsample.1.bias")]
    return names + ["fc.weight", "fc.bias"]


def glob_only(names, mask):
    return [n for n, m in zip(names, mask) if not m]


def test_t8_splits():
    assert sum(split_layers(CNN, "all_except", ["fc2."])) == 6
    assert split_layers(CNN, "first_fraction", lam=0.5) == [True] * 4 + [False] * 4
    assert glob_only(CNN, split_layers(CNN, "first_fraction", lam=0.9)) == ["fc2.bias"]
    assert sum(split_layers(CNN, "first_fraction", lam=0.85)) == 6
    with pytest.raises(ValueError, match="matches no parameter"):
        split_layers(CNN, "all_except", ["fc"])  # prefix, not substring: "fc" is no module
    assert glob_only(CNN, split_layers(CNN, "all_except", ["fc1"])) == ["fc1.weight", "fc1.bias"]
    assert glob_only(MLP, split_layers(MLP, "all_except", ["fc3"])) == ["fc3.weight", "fc3.bias"]
    assert glob_only(MLP, split_layers(MLP, "first_fraction", lam=0.9)) == ["fc3.bias"]
    assert len(VGG) == 22
    assert sum(split_layers(VGG, "all_except", ["classifier.0", "classifier.3", "classifier.6"])) == 16
    assert glob_only(VGG, split_layers(VGG, "first_fraction", lam=0.9)) == [
        "classifier.3.bias",
        "classifier.6.weight",
        "classifier.6.bias",
    ]
    R = resnet18_gn_names()
    assert len(R) == 62
    assert sum(split_layers(R, "all_except", ["fc"])) == 60
    assert glob_only(R, split_layers(R, "first_fraction", lam=0.9)) == [
        "layer4.1.bn1.weight",
        "layer4.1.bn1.bias",
        "layer4.1.conv2.weight",
        "layer4.1.bn2.weight",
        "layer4.1.bn2.bias",
        "fc.weight",
        "fc.bias",
    ]
    assert sum(split_layers(R, "first_fraction", lam=0.85)) == 52
    assert glob_only(R, split_layers(R, "first_fraction", lam=0.95)) == [
        "layer4.1.bn2.weight",
        "layer4.1.bn2.bias",
        "fc.weight",
        "fc.bias",
    ]
    assert split_layers(CNN, "first_fraction", lam=0.0) == [False] * 8
    assert split_layers(CNN, "first_fraction", lam=1.0) == [True] * 8


class DigitCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 4, 5, padding=2), nn.Conv2d(4, 8, 5, padding=2)
        self.fc1, self.fc2 = nn.Linear(32, 16), nn.Linear(16, 10)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def test_default_split_and_local_rule_on_cnn():
    torch.manual_seed(0)
    net = DigitCNN()
    spec = FlatSpec.from_module(net)
    agg = build("gcfed")  # default: classifier = last module (fc2)
    assert glob_only(spec.names, agg.local_mask(spec)) == ["fc2.weight", "fc2.bias"]
    assert [e.name for e in agg.global_entries(spec)] == spec.names
    assert [e.name for e in build("gcfed", global_scope="complement").global_entries(spec)] == [
        "fc2.weight",
        "fc2.bias",
    ]
    # Local GC with wd = 0 keeps every local row mean fixed; fc2 (global-only) moves freely
    w0 = spec.flatten(net).clone()
    rule = agg.client_rule()
    ctx = ClientContext(0, 0, w0, spec, 0.05, 8, {})
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    rule.begin(ctx, net)
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    for _ in range(3):
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        rule.before_step(ctx, net)
        if not rule.step(ctx, net, opt):  # the documented hook order (the rule may fuse the step)
            opt.step()
        ctx.step += 1
    w1 = spec.flatten(net)
    for e in spec.entries:
        a, b = w0[e.slice].view(e.shape), w1[e.slice].view(e.shape)
        ra = a.mean() if a.dim() == 1 else a.reshape(a.shape[0], -1).mean(1)
        rb = b.mean() if b.dim() == 1 else b.reshape(b.shape[0], -1).mean(1)
        if e.name == "fc2.weight":  # (the CE bias gradient sums to 0 over classes by itself)
            assert float((ra - rb).abs().max()) > 1e-4
        else:
            torch.testing.assert_close(rb, ra, atol=1e-6, rtol=0)


def test_bad_options_and_state():
    for kw in (
        {"local_layers": "some"},
        {"global_scope": "x"},
        {"vector_policy": "zero"},
        {"mu": "q"},
        {"local_layers": "first_fraction", "lam": 1.5},
        {"min_fanin": 0},
        {"local_order": "late"},
    ):
        with pytest.raises(ValueError):
            GCFed(**kw)
    with pytest.raises(ValueError):
        build("local_gc_only")  # lam required
    w = torch.zeros(10)
    with pytest.raises(ValueError, match="FlatSpec"):
        build("global_gc").aggregate(w, torch.ones(2, 10), [1, 1])
    spec, w, U = t4_setup()
    a = build("global_gc")
    a.setup(spec, 4, w)
    a.aggregate(w, U, [1, 1, 1, 1])
    b = build("global_gc")
    b.setup(spec, 4, w)
    b.load_state_dict(a.state_dict())
    assert b.round == 1 and torch.equal(a.aggregate(w, U, [1] * 4)[0], b.aggregate(w, U, [1] * 4)[0])
    U[2, 0] = float("nan")
    c = build("global_gc", on_bad_update="exclude")
    c.setup(spec, 4, w)
    new, info = c.aggregate(w, U, [1] * 4, [0, 1, 2, 3])
    assert info["excluded"][0]["client_id"] == 2 and bool(torch.isfinite(new).all())
    assert build("local_gc_only", lam=0.5).client_rule() is not None
    assert build("global_gc").client_rule() is None


def _post_wd_net():
    net = nn.Sequential(nn.Linear(3, 2, bias=False), nn.Linear(2, 1, bias=False)).double()
    with torch.no_grad():
        net[0].weight.copy_(T([[1, 0.5, 0], [0, -0.5, 1]]))
        net[1].weight.copy_(T([[1, 2]]))
    return net


def _post_wd_step(agg, opt_wd):
    net = _post_wd_net()
    spec = FlatSpec.from_module(net)
    agg.setup(spec, 1, spec.flatten(net))
    rule = agg.client_rule()
    ctx = ClientContext(0, 0, spec.flatten(net), spec, 0.1, 1, {})
    rule.begin(ctx, net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, weight_decay=opt_wd)
    for p in net.parameters():
        p.grad = torch.zeros_like(p)  # zero gradients: only weight decay moves the weights
    rule.before_step(ctx, net)
    if not rule.step(ctx, net, opt):
        opt.step()
    assert opt.param_groups[0]["weight_decay"] == opt_wd  # the optimizer's setting is restored
    return net


def test_post_wd_decays_every_tensor_then_centres_the_local_ones():
    """Spec §2.2 [GC2020]: d = g + wd p on every tensor, GC on the local ones (here layer 0), then SGD."""
    W0 = T([[1, 0.5, 0], [0, -0.5, 1]])
    d0 = 0.1 * W0
    exp0 = W0 - 0.1 * (d0 - d0.mean(dim=1, keepdim=True))
    for agg_wd, opt_wd in ((0.1, 0.0), (0.0, 0.1)):  # wd from the rule, or from the optimizer (the simulator)
        net = _post_wd_step(build("gcfed", global_layers=["1"], local_order="post_wd", weight_decay=agg_wd), opt_wd)
        torch.testing.assert_close(net[1].weight.detach(), T([[0.99, 1.98]]), atol=1e-15, rtol=0)
        torch.testing.assert_close(net[0].weight.detach(), exp0, atol=1e-15, rtol=0)
    with pytest.raises(ValueError, match="weight decay twice"):
        _post_wd_step(build("gcfed", global_layers=["1"], local_order="post_wd", weight_decay=0.1), 0.1)
    # pre_wd (official code): GC on the raw gradient (zero here), the optimizer's wd un-centred
    net = _post_wd_step(build("gcfed", global_layers=["1"]), 0.1)
    torch.testing.assert_close(net[0].weight.detach(), 0.99 * W0, atol=1e-15, rtol=0)
