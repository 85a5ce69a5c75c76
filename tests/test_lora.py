"""LoRA-aware aggregation (fedkernels.lora): the adapter spec, naive / exact / fold against float64
maths, heterogeneous ranks, and bad input.

The maths tests run on a hand-built stand-in with peft's LoraLayer attributes (so they need no
peft); the integration tests build real peft models and skip without peft. Bounds: u = 2^-24 (fp32
unit roundoff). A product of factors each rounded to fp32, ``B' = B* + E_B``, ``A' = A* + E_A`` with
``|E| <= u |.|`` entrywise, is off ``B* A*`` by at most ``u (2 + u) ||B*||_F ||A*||_F``; with the
square root of the singular values split between the factors ``||B*||_F^2 = ||A*||_F^2 = sum of the
kept singular values``, so the bound is ``u (2 + u) ||M_r||_*`` (nuclear norm). The float64 QR / SVD
add a backward error of a few eps64 * ||M||, covered by a 1e-10 relative term, far below u.
"""

import math

import pytest
import torch
from torch import nn

from fedkernels.lora import LoraAggregator, LoraSpec

import cli_process  # tests/cli_process.py: the command in a child forked from a pre-imported interpreter

U32 = 2.0**-24
F64 = 1e-10


# ---- a stand-in with peft's LoraLayer attributes (lora_A / lora_B ModuleDicts, scaling, base_layer) ----
class StandIn(nn.Module):
    def __init__(self, base: nn.Module, r: int, alpha: float, adapter: str = "default"):
        super().__init__()
        self.base_layer = base
        self.lora_A, self.lora_B = nn.ModuleDict(), nn.ModuleDict()
        if isinstance(base, nn.Linear):
            self.lora_A[adapter] = nn.Linear(base.in_features, r, bias=False)
            self.lora_B[adapter] = nn.Linear(r, base.out_features, bias=False)
        else:
            self.lora_A[adapter] = nn.Conv2d(base.in_channels, r, base.kernel_size, bias=False)
            self.lora_B[adapter] = nn.Conv2d(r, base.out_channels, 1, bias=False)
        self.scaling = {adapter: alpha / r}
        self.r = {adapter: r}
        self.fan_in_fan_out = False
        base.weight.requires_grad_(False)

    def get_base_layer(self):
        return self.base_layer


class Net(nn.Module):
    def __init__(self, r=4, alpha=8.0, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.conv = StandIn(nn.Conv2d(2, 5, 3), r, alpha)
        self.fc1 = StandIn(nn.Linear(20, 14), r, alpha)
        self.fc2 = StandIn(nn.Linear(14, 6), r, alpha)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))


def clients(spec, K, ranks=None, seed=1):
    """K random adapter vectors, client k zero beyond ranks[k] in every layer."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(K, spec.d, generator=g)
    if ranks is not None:
        for k, rk in enumerate(ranks):
            X[k] = spec.truncate(X[k], rk)
    return X


def products(spec, X, p):
    """Per layer, float64 ``M = sum_k p_k B_k A_k`` and the fp64 product of the fp64 factor averages."""
    out = {}
    X64 = X.double()
    avg = (p[:, None] * X64).sum(0)
    for l in spec.layers:
        M = sum(p[k] * (lambda BA: BA[0] @ BA[1])(l.factors(X64[k])) for k in range(X.size(0)))
        Bb, Ab = l.factors(avg)
        out[l.name] = (M, Bb @ Ab)
    return out


def stored_product(l, vec):
    B, A = l.factors(vec)
    return B.double() @ A.double()


def nuclear(M):
    return float(torch.linalg.svdvals(M).sum())


P = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
P = P / P.sum()


def test_spec_holds_only_the_adapters_and_round_trips():
    m = Net()
    spec = LoraSpec.from_model(m)
    adapters = [p for n, p in m.named_parameters() if ".lora_" in n]
    assert spec.d == sum(p.numel() for p in adapters)
    assert [l.name for l in spec.layers] == ["conv", "fc1", "fc2"]
    assert all(".lora_" in e.name for e in spec.flat)
    conv = spec["conv"]
    assert (conv.rank, conv.fan_in, conv.fan_out, conv.weight_shape, conv.scaling) == (4, 18, 5, (5, 2, 3, 3), 2.0)
    v = spec.flatten(m)
    m2 = Net(seed=5)
    base_before = m2.fc1.base_layer.weight.clone()
    spec.load_(m2, v)
    assert torch.equal(spec.flatten(m2), v)
    assert torch.equal(m2.fc1.base_layer.weight, base_before)  # the frozen base is not touched
    # the conv delta is the convolution of the factors (what peft's get_delta_weight computes)
    B, A = m.conv.lora_B["default"].weight, m.conv.lora_A["default"].weight
    ref = torch.nn.functional.conv2d(A.transpose(0, 1), B).transpose(0, 1) * 2.0
    torch.testing.assert_close(
        conv.delta(v), ref, rtol=0, atol=64 * U32 * float((B.abs().sum() * A.abs().max()).detach())
    )


def test_naive_is_the_average_of_the_factors():
    spec = LoraSpec.from_model(Net())
    X = clients(spec, 4)
    res = LoraAggregator(spec, "naive").aggregate(X, num_examples=[1, 2, 3, 4])
    ref = (P[:, None] * X.double()).sum(0)
    # fp32 accumulation of K terms (and the coefficients rounded to fp32): (K + 2) u sum_k p_k |x_k|
    bound = (4 + 2) * U32 * (P[:, None] * X.double().abs()).sum(0)
    assert bool(((res.adapter.double() - ref).abs() <= bound).all())
    assert res.residuals == {}
    # the reported error is the distance of the averaged factors' product to the true average of products
    prods = products(spec, X, P)
    for l in spec.layers:
        M, naive = prods[l.name]
        want = l.scaling * float(torch.linalg.matrix_norm(naive - M))
        assert res.info["layers"][l.name]["error_naive"] == pytest.approx(want, rel=1e-9)
        assert res.info["layers"][l.name]["error"] == res.info["layers"][l.name]["error_naive"]
    assert res.info["naive_relative_error"] > 0.1
    assert res.info["relative_to"] == "product"
    # given the round's global adapters: errors relative to the true average update s (M - B_g A_g)
    g = clients(spec, 1, seed=7)[0]
    for mode in ("naive", "exact", "fold"):
        r0 = LoraAggregator(spec, mode).aggregate(X, num_examples=[1, 2, 3, 4])
        rg = LoraAggregator(spec, mode).aggregate(X, num_examples=[1, 2, 3, 4], global_adapter=g)
        assert rg.info["relative_to"] == "update"
        upd = 0.0
        for l in spec.layers:
            M, _ = prods[l.name]
            Bg, Ag = l.factors(g.double())
            want = l.scaling * float(torch.linalg.matrix_norm(M - Bg @ Ag))
            assert rg.info["layers"][l.name]["true_norm"] == pytest.approx(want, rel=1e-9)
            upd += want**2
        assert rg.info["true_norm"] == pytest.approx(math.sqrt(upd), rel=1e-9)
        # the aggregate does not depend on the reporting basis: naive's and fold's factors are the same
        # weighted-sum pass; exact's products are both the rank-r truncation of M to the bound of
        # test_exact_* (each within u (2 + u) ||M_r||_* + F64 ||M|| of it)
        if mode != "exact":
            assert torch.equal(rg.adapter, r0.adapter)
            continue
        for l in spec.layers:
            M, _ = prods[l.name]
            S = torch.linalg.svdvals(M)
            tol = 2 * (U32 * (2 + U32) * float(S[: l.rank].sum()) + F64 * float(S[0]))
            assert float(torch.linalg.matrix_norm(stored_product(l, rg.adapter) - stored_product(l, r0.adapter))) <= tol


def test_exact_with_enough_rank_reproduces_the_average_of_products():
    # server rank 8 >= 2 + 2 + 2 + 2: the products' sum has rank <= 8, so its SVD keeps all of it
    spec = LoraSpec.from_model(Net(r=8, alpha=16.0))
    X = clients(spec, 4, ranks=[2, 2, 2, 2])
    res = LoraAggregator(spec, "exact").aggregate(X, num_examples=[1, 2, 3, 4], client_ranks=[2, 2, 2, 2])
    prods = products(spec, X, P)
    for l in spec.layers:
        M, naive = prods[l.name]
        err = float(torch.linalg.matrix_norm(stored_product(l, res.adapter) - M))
        bound = U32 * (2 + U32) * nuclear(M) + F64 * float(torch.linalg.matrix_norm(M))
        assert err <= bound, (l.name, err, bound)
        row = res.info["layers"][l.name]
        assert row["error"] <= l.scaling * bound
        assert row["discarded"] <= F64 * row["true_norm"]
        assert row["error_naive"] > 100 * row["error"]
    assert res.info["relative_error"] < 1e-6 < res.info["naive_relative_error"]


def test_truncated_exact_is_the_best_rank_r_approximation():
    spec = LoraSpec.from_model(Net(r=3, alpha=3.0))
    X = clients(spec, 4)  # sum of 4 rank-3 products: rank up to 12 > 3
    res = LoraAggregator(spec, "exact").aggregate(X, num_examples=[1, 2, 3, 4])
    prods = products(spec, X, P)
    for l in spec.layers:
        M, _ = prods[l.name]
        Uf, S, Vh = torch.linalg.svd(M, full_matrices=False)
        r = l.rank
        Mr = (Uf[:, :r] * S[:r]) @ Vh[:r]
        opt = float(S[r:].square().sum().sqrt())  # Eckart-Young: no rank-r matrix is closer to M
        got = stored_product(l, res.adapter)
        assert torch.linalg.matrix_rank(got) <= r
        slack = U32 * (2 + U32) * nuclear(Mr) + F64 * float(S[0])
        # the SVD's rank-r truncation (unique: the gap sigma_r - sigma_r+1 is far above the slack)
        assert float(S[r - 1] - S[r]) > 1e3 * slack
        assert float(torch.linalg.matrix_norm(got - Mr)) <= slack
        assert opt - F64 * float(S[0]) <= float(torch.linalg.matrix_norm(got - M)) <= opt + slack
        # the convention: B = U_r S_r^(1/2), A = S_r^(1/2) V_r^T, so B^T B = A A^T = S_r (diagonal)
        B, A = (t.double() for t in l.factors(res.adapter))
        Sr = torch.diag(S[:r])
        assert float(torch.linalg.matrix_norm(B.t() @ B - Sr)) <= 4 * U32 * float(S[:r].sum())
        assert float(torch.linalg.matrix_norm(A @ A.t() - Sr)) <= 4 * U32 * float(S[:r].sum())
        row = res.info["layers"][l.name]
        assert row["discarded"] == pytest.approx(l.scaling * opt, rel=1e-9)
        assert abs(row["error"] - l.scaling * opt) <= l.scaling * slack


def test_fold_keeps_base_plus_product_equal_to_base_plus_true_average():
    m = Net()
    spec = LoraSpec.from_model(m)
    X = clients(spec, 4)
    res = LoraAggregator(spec, "fold").aggregate(X, num_examples=[1, 2, 3, 4])
    naive = LoraAggregator(spec, "naive").aggregate(X, num_examples=[1, 2, 3, 4])
    assert torch.equal(res.adapter, naive.adapter)  # fold keeps the averaged factors
    prods = products(spec, X, P)
    W0 = {l.name: getattr(m, l.name).base_layer.weight.detach().double().clone() for l in spec.layers}
    spec.fold_(m, res.residuals)
    spec.load_(m, res.adapter)
    X64 = X.double()
    for l in spec.layers:
        M, _ = prods[l.name]
        s = l.scaling
        W = getattr(m, l.name).base_layer.weight.detach().double()
        eff = W + l.to_weight(s * stored_product(l, res.adapter))
        want = W0[l.name] + l.to_weight(s * M)
        # the fold's sum rounded to fp32, the residual rounded to fp32, and the fp32 factor averages
        # (K + 2) u off their fp64 values entrywise, which moves their product by at most
        # (K + 2) u (||sum p|B|||_F ||A_avg||_F + ||B_avg||_F ||sum p|A|||_F) (1 + (K + 2) u)
        Bab = sum(P[k] * l.factors(X64[k])[0].abs() for k in range(4))
        Aab = sum(P[k] * l.factors(X64[k])[1].abs() for k in range(4))
        Bb, Ab = l.factors((P[:, None] * X64).sum(0))
        res64 = res.residuals[l.name].double()
        g = 6 * U32
        bound = U32 * (
            float(torch.linalg.vector_norm(W0[l.name])) + 2 * float(torch.linalg.vector_norm(res64))
        ) + s * g * (1 + g) * (
            float(torch.linalg.matrix_norm(Bab)) * float(torch.linalg.matrix_norm(Ab))
            + float(torch.linalg.matrix_norm(Bb)) * float(torch.linalg.matrix_norm(Aab))
        )
        err = float(torch.linalg.vector_norm(eff - want))
        assert err <= bound, (l.name, err, bound)
        assert res.info["layers"][l.name]["error"] <= bound
        assert float(torch.linalg.vector_norm(res64)) > 100 * bound  # the residual is not negligible


def test_heterogeneous_ranks_exact_redistributes_best_rank_rk():
    spec = LoraSpec.from_model(Net(r=8, alpha=16.0))
    ranks = [2, 4, 1, 1]
    X = clients(spec, 4, ranks=ranks)
    res = LoraAggregator(spec, "exact").aggregate(X, num_examples=[1, 2, 3, 4], client_ranks=ranks)
    prods = products(spec, X, P)
    for rk in (1, 2, 4):
        share = spec.truncate(res.adapter, rk)
        for l in spec.layers:
            M, _ = prods[l.name]
            S = torch.linalg.svdvals(M)
            opt = float(S[rk:].square().sum().sqrt())
            err = float(torch.linalg.matrix_norm(stored_product(l, share) - M))
            assert opt - F64 * float(S[0]) <= err <= opt + U32 * (2 + U32) * float(S[:rk].sum()) + F64 * float(S[0])
    naive = LoraAggregator(spec, "naive").aggregate(X, num_examples=[1, 2, 3, 4], client_ranks=ranks)
    assert naive.info["relative_error"] > 0.1 > 1e-6 > res.info["relative_error"]


def test_same_input_same_bits():
    spec = LoraSpec.from_model(Net())
    X = clients(spec, 4)
    for mode in ("exact", "fold"):
        a = LoraAggregator(spec, mode).aggregate(X, [1, 2, 3, 4])
        b = LoraAggregator(spec, mode).aggregate(X.clone(), [1, 2, 3, 4])
        assert torch.equal(a.adapter, b.adapter)
        assert all(torch.equal(a.residuals[k], b.residuals[k]) for k in a.residuals)


def _one_line(excinfo, *words):
    msg = str(excinfo.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)


def test_bad_input():
    spec = LoraSpec.from_model(Net())
    agg = LoraAggregator(spec, "exact")
    with pytest.raises(ValueError) as e:
        LoraSpec.from_model(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)))
    _one_line(e, "no LoRA layers")
    with pytest.raises(ValueError) as e:
        agg.aggregate(torch.zeros(0, spec.d))
    _one_line(e, "K=0")
    with pytest.raises(ValueError) as e:
        agg.aggregate(torch.zeros(3, spec.d + 1))
    _one_line(e, "adapters", f"d={spec.d}")
    with pytest.raises(ValueError) as e:
        LoraAggregator(spec, "mean")
    _one_line(e, "mode", "'mean'", "naive")
    with pytest.raises(ValueError) as e:
        agg.aggregate(clients(spec, 2), num_examples=[1, 2, 3])
    _one_line(e, "num_examples", "K=2")
    # a client with a higher rank than the server's
    with pytest.raises(ValueError) as e:
        spec.flatten(Net(r=8))
    _one_line(e, "rank 8", "4 in the server's spec")
    with pytest.raises(ValueError) as e:
        agg.aggregate(clients(spec, 2), client_ranks=[2, 5])
    _one_line(e, "client_ranks[1]", "[1, 4]", "5")
    # a client declared rank 2 whose factors go beyond it
    with pytest.raises(ValueError) as e:
        agg.aggregate(clients(spec, 2), client_ranks=[4, 2])
    _one_line(e, "client 1", "client_ranks=2", "'conv'")
    X = clients(spec, 2)
    X[1, 3] = float("nan")
    with pytest.raises(ValueError) as e:
        agg.aggregate(X)
    _one_line(e, "rows [1]", "NaN")


@pytest.mark.parametrize("mode", ["exact", "fold"])
def test_lora_round_is_the_round_runners_screen_and_policy(mode):
    """LoraRound: the round runner's validation, NaN/Inf screen and on_bad_update policy around the
    aggregator's step on the adapters ``global + row``: with exclude, the result is the aggregator's on the
    other clients' adapters bit for bit (ranks and residuals included); with raise, one line naming the client."""
    from fedkernels.errors import BadUpdateError
    from fedkernels.lora import LoraRound

    spec = LoraSpec.from_model(Net())
    agg = LoraAggregator(spec, mode=mode)
    G = clients(spec, 1, seed=7)[0]
    ranks_of = [4, 2, 3, 1, 4]  # client id -> rank
    ids = [3, 0, 4, 1]
    X = torch.stack([spec.truncate(x, ranks_of[c]) for x, c in zip(clients(spec, 4, seed=2), ids)])
    U = X - G
    U[2, 5] = float("nan")  # client 4
    n = [3.0, 1.0, 2.0, 5.0]
    res = LoraRound(agg, ranks_of, on_bad_update="exclude").aggregate(G, U, n, ids)
    keep = [0, 1, 3]
    want = agg.aggregate(U[keep] + G, num_examples=[n[k] for k in keep], client_ranks=[1, 4, 2], global_adapter=G)
    assert torch.equal(res.params, want.adapter)
    assert res.info["excluded"] == [{"client_id": 4, "reason": "update contains NaN/Inf"}]
    assert res.info["client_ranks"] == [1, 4, 2] and res.info["num_clients"] == 3
    assert res.info["error_to_true_average"] == want.info["error_to_true_average"]
    assert res.info["residuals"].keys() == want.residuals.keys()
    assert all(torch.equal(res.info["residuals"][k], v) for k, v in want.residuals.items())
    with pytest.raises(BadUpdateError) as e:
        LoraRound(agg, ranks_of).aggregate(G, U, n, ids)
    _one_line(e, "lora.aggregate: client 4 (row 2)", "NaN/Inf", "on_bad_update='exclude'")
    with pytest.raises(ValueError) as e:
        LoraRound(agg).aggregate(G, U[:, :-1], n, ids)
    _one_line(e, "lora.aggregate", f"expected d={spec.d}")


# ---- with real peft models ----------------------------------------------------------------------------
def _peft_net(r, alpha, seed=0, targets=("fc1", "fc2", "conv")):
    peft = pytest.importorskip("peft")

    class Base(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 3, 3)
            self.fc1 = nn.Linear(12, 10)
            self.fc2 = nn.Linear(10, 4)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    torch.manual_seed(seed)
    m = peft.get_peft_model(Base(), peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets)))
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape))
    return m


def _lora_modules(m):
    return {n: mod for n, mod in m.named_modules() if hasattr(mod, "get_delta_weight") and hasattr(mod, "lora_A")}


def _peft_delta(mod):
    """peft's own delta (an fp32 product of the rank-r factors, times s) in fp64, and a bound on the
    Frobenius norm of its rounding: gamma_r s || |B| |A| ||_F for the product and u |delta| for the
    scaling, gamma_r = r u / (1 - r u)."""
    with torch.no_grad():
        want = mod.get_delta_weight("default").double()
        A = mod.lora_A["default"].weight.double().flatten(1)
        B = mod.lora_B["default"].weight.double().flatten(1)
        r, s = A.shape[0], mod.scaling["default"]
    g = r * U32 / (1 - r * U32)
    return want, g * s * float(torch.linalg.matrix_norm(B.abs() @ A.abs())) + U32 * float(
        torch.linalg.vector_norm(want)
    )


def test_peft_heterogeneous_clients_flatten_aggregate_and_load():
    server = _peft_net(8, 16)
    spec = LoraSpec.from_model(server)
    assert [l.name.rsplit(".", 1)[-1] for l in spec.layers] == ["conv", "fc1", "fc2"]
    # client scalings 4, 2, 1 against the server's 2: the padded B carries the ratio (a power of 2: exact)
    cl = [_peft_net(2, 8, seed=1), _peft_net(2, 4, seed=2), _peft_net(4, 4, seed=3)]
    X = torch.stack([spec.flatten(c) for c in cl])
    ranks = [spec.model_rank(c) for c in cl]
    assert ranks == [2, 2, 4]
    for c, x in zip(cl, X):
        mods = _lora_modules(c)
        for l in spec.layers:
            want, tol = _peft_delta(mods[l.name])
            assert float(torch.linalg.vector_norm(l.delta(x.double()) - want)) <= tol
    n = [3.0, 1.0, 4.0]
    p = torch.tensor(n, dtype=torch.float64) / 8
    res = LoraAggregator(spec, "exact").aggregate(X, n, client_ranks=ranks)
    assert res.info["relative_error"] < 1e-6 < res.info["naive_relative_error"]
    for l in spec.layers:
        # the true average of the clients' deltas (fp64 from their factors) and from peft's fp32 deltas
        avg = sum(p[k] * l.delta(X[k].double()) for k in range(3))
        mat = avg.reshape(l.fan_out, l.fan_in)
        peft_avg = [_peft_delta(_lora_modules(c)[l.name]) for c in cl]
        tol_avg = sum(float(p[k]) * t for k, (_, t) in enumerate(peft_avg))
        got = l.delta(res.adapter.double())
        S = torch.linalg.svdvals(mat)
        bound = U32 * (2 + U32) * float(S.sum()) + F64 * float(S[0])
        assert float(torch.linalg.vector_norm(got - avg)) <= bound
        assert (
            float(torch.linalg.vector_norm(got - sum(p[k] * w for k, (w, _) in enumerate(peft_avg)))) <= bound + tol_avg
        )
    # redistributed to a rank-2 client: its delta is the best rank-2 approximation of the average
    avgs = {l.name: sum(p[k] * l.delta(X[k].double()) for k in range(3)) for l in spec.layers}
    spec.load_(cl[0], res.adapter)
    mods = _lora_modules(cl[0])
    for l in spec.layers:
        mat = avgs[l.name].reshape(l.fan_out, l.fan_in)
        S = torch.linalg.svdvals(mat)
        opt = float(S[2:].square().sum().sqrt())
        d0, tol = _peft_delta(mods[l.name])
        err = float(torch.linalg.matrix_norm(d0.reshape(l.fan_out, l.fan_in) - mat))
        assert abs(err - opt) <= tol + U32 * (2 + U32) * float(S[:2].sum()) + F64 * float(S[0])


def test_peft_bad_models():
    server = _peft_net(4, 8)
    spec = LoraSpec.from_model(server)
    with pytest.raises(ValueError) as e:
        spec.flatten(_peft_net(8, 16))
    _one_line(e, "rank 8", "4 in the server's spec")
    with pytest.raises(ValueError) as e:
        spec.flatten(_peft_net(4, 8, targets=("fc1", "fc2")))
    _one_line(e, "differ", "conv")
    peft = pytest.importorskip("peft")
    ia3 = peft.get_peft_model(
        nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)),
        peft.IA3Config(target_modules=["0", "2"], feedforward_modules=["2"]),
    )
    with pytest.raises(ValueError) as e:
        LoraSpec.from_model(ia3)
    _one_line(e, "no LoRA layers")
    dora = peft.get_peft_model(
        nn.Sequential(nn.Linear(3, 4)), peft.LoraConfig(r=2, target_modules=["0"], use_dora=True)
    )
    with pytest.raises(ValueError) as e:
        LoraSpec.from_model(dora)
    _one_line(e, "DoRA")


# ---- the offline example, run as a user would ----------------------------------------------------------
@pytest.mark.slow
def test_example_lora_digits_runs_two_rounds():
    import json
    import os
    import sys

    pytest.importorskip("peft")
    pytest.importorskip("sklearn")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    cmd = [
        sys.executable,
        os.path.join(root, "examples", "lora_digits.py"),
        "--rounds",
        "2",
        "--clients",
        "3",
        "--local-steps",
        "5",
    ]
    p = cli_process.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    final = json.loads(next(l for l in p.stdout.splitlines() if l.startswith("final "))[len("final ") :])
    assert set(final) == {"naive", "exact", "fold"}
    # fold is exact at any rank; exact is the best rank-r approximation, so never farther than naive's
    # factors (a rank-r matrix too) from the same round's true average
    assert final["fold"]["relative_error"] < 1e-6
    assert final["exact"]["relative_error"] <= final["exact"]["naive_relative_error"] * (1 + 1e-6)
    assert final["naive"]["relative_error"] == final["naive"]["naive_relative_error"] > 0
    assert all(0 <= r[k] <= 1 for r in final.values() for k in ("acc_new", "acc_all"))
    bad = cli_process.run(cmd[:2] + ["--rank", "0"], capture_output=True, text=True, env=env, timeout=600)
    assert bad.returncode == 2 and "--rank must be >= 1" in bad.stderr
