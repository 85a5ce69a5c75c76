"""The robust aggregators (algorithms/robust/) and the simulator's attacks (sim/attacks.py).

Bounds: a rule whose result is an fp64 computation rounded once to fp32 (median, trimmed mean,
Bulyan's closest-to-median mean: sums of at most K exactly converted values in fp64, then one
rounding) equals the fp64 reference to half an fp32 ulp plus the fp64 sum's error (K * 2^-53
relative), so ``rtol = 2^-23`` bounds it; a row picked by Krum is returned exactly (weight 1, the
others 0, base 0). RFA and centred clipping take distances from an fp64 expansion
||a||^2 - 2<a, b> + ||b||^2, whose error is ~2^-52 ||a||^2 (documented in their modules): on these
well-conditioned inputs (distances of the order of the norms) the weights agree with the direct
fp64 reference to 1e-10 relative, and the fp32 result to ``rtol = 2^-22`` plus that.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch

from fedkernels import algorithms, ops
from fedkernels.errors import BadUpdateError
from fedkernels.sources import ChunkedUpdates, TensorSource

import cli_process  # tests/cli_process.py: the command in a child forked from a pre-imported interpreter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EPS32 = 2.0**-23

RULES = [
    ("median", {}),
    ("trimmed_mean", {"beta": 0.2}),
    ("trimmed_mean", {"beta": 0.0}),
    ("krum", {"f": 2}),
    ("krum", {"f": 1, "m": 3}),
    ("bulyan", {"f": 1}),
    ("geometric_median", {"iterations": 4}),
    ("centered_clip", {"tau": 3.0, "iterations": 3}),
]


def _data(K=11, d=257, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    U = torch.randn(K, d, generator=g, dtype=torch.float64)
    n = torch.randint(1, 100, (K,), generator=g).to(torch.float64)
    return U.to(dtype), n


# ---- fp64 references (direct formulas) -------------------------------------------------------------
def ref_order(U, lo, hi):
    return np.sort(U, axis=0)[lo:hi].mean(0)


def ref_krum_scores(U, f, alive):
    idx = np.flatnonzero(alive)
    D = ((U[:, None, :] - U[None, :, :]) ** 2).sum(-1)
    nc = max(1, len(idx) - f - 2)
    s = np.full(len(U), np.inf)
    for i in idx:
        s[i] = np.sort(D[i, idx])[1 : nc + 1].sum()
    return s


def ref_krum(U, n, f, m):
    s = ref_krum_scores(U, f, np.ones(len(U), bool))
    rows = np.argsort(s, kind="stable")[:m]
    w = n[rows] / n[rows].sum()
    return (w[:, None] * U[rows]).sum(0), rows


def ref_bulyan(U, f):
    alive = np.ones(len(U), bool)
    picked = []
    for _ in range(len(U) - 2 * f):
        k = int(np.argmin(ref_krum_scores(U, f, alive)))
        picked.append(k)
        alive[k] = False
    S = U[picked]
    beta = len(picked) - 2 * f
    med = np.median(S, axis=0)
    order = np.argsort(np.abs(S - med), axis=0, kind="stable")[:beta]
    return np.take_along_axis(S, order, 0).mean(0), picked


def ref_weiszfeld(U, alpha, iterations, nu, ftol):
    p = alpha.copy()
    prev = None
    for _ in range(iterations):
        v = p @ U
        dist = np.sqrt(((U - v) ** 2).sum(1))
        obj = (alpha * dist).sum()
        if prev is not None and abs(prev - obj) <= ftol * obj:
            break
        b = alpha / np.maximum(dist, nu)
        p = b / b.sum()
        prev = obj
    return p @ U


def ref_cclip(U, v, tau, iterations):
    for _ in range(iterations):
        X = U - v
        nrm = np.sqrt((X**2).sum(1))
        s = np.minimum(1.0, tau / np.maximum(nrm, 1e-300))
        v = v + (s[:, None] * X).mean(0)
    return v


def reference(name, opts, U, n, state=None):
    U = U.double().numpy()
    n = n.numpy()
    K = len(U)
    if name == "median":
        return ref_order(U, (K - 1) // 2, K // 2 + 1)
    if name == "trimmed_mean":
        lo = int(opts["beta"] * K)
        return ref_order(U, lo, K - lo)
    if name == "krum":
        return ref_krum(U, n, opts["f"], opts.get("m", 1))[0]
    if name == "bulyan":
        return ref_bulyan(U, opts["f"])[0]
    if name == "geometric_median":
        return ref_weiszfeld(U, n / n.sum(), opts["iterations"], 1e-6, 1e-6)
    if name == "centered_clip":
        return ref_cclip(U, np.zeros(U.shape[1]) if state is None else state, opts["tau"], opts["iterations"])
    raise AssertionError(name)


def check_close(name, opts, got, ref, U):
    """Selection rules: one rounding of an fp64 value (rtol 2^-23). Rules ending in ``ops.weighted_sum``
    (Multi-Krum, RFA, centred clipping): fp32 accumulation of K terms with weights summing to 1, so
    |error| <= (K + 2) 2^-23 max_k |U_k| per column (plus the fp64 weights' 1e-10 relative)."""
    A = np.abs(U.double().numpy()).max(0)
    if name in ("geometric_median", "centered_clip") or opts.get("m", 1) > 1:
        bound = (U.size(0) + 2) * EPS32 * A + 1e-10 * A
    else:
        bound = EPS32 * np.abs(ref) + 1e-300
    assert (np.abs(got - ref) <= bound).all(), float(np.max(np.abs(got - ref) - bound))


# ---- each rule against its fp64 reference ---------------------------------------------------------------
@pytest.mark.parametrize("name,opts", RULES)
@pytest.mark.parametrize("K", [11, 12])
def test_rule_matches_fp64_reference(name, opts, K):
    U, n = _data(K=K, seed=K)
    x = torch.zeros(U.size(1))
    res = algorithms.build(name, **opts).aggregate(x, U, n)
    ref = reference(name, opts, U, n)
    got = res.params.double().numpy()
    if name == "krum" and opts.get("m", 1) == 1:
        assert np.array_equal(got, U.double().numpy()[res.info["selected"][0]])  # the row itself, exactly
    check_close(name, opts, got, ref, U)


def test_fp64_updates_give_fp64_results():
    U, n = _data(K=9, dtype=torch.float64)
    for name, opts in [("median", {}), ("trimmed_mean", {"beta": 0.3}), ("bulyan", {"f": 1})]:
        got = algorithms.build(name, **opts).aggregate(torch.zeros(U.size(1), dtype=torch.float64), U, n).params
        assert got.dtype == torch.float64
        # a mean of at most K fp64 values in another order: K rounding errors of the largest |value|
        bound = U.size(0) * np.finfo(np.float64).eps * float(U.abs().max())
        np.testing.assert_allclose(got.numpy(), reference(name, opts, U, n), rtol=0, atol=bound)


def test_server_lr_and_global_model():
    U, n = _data(K=7)
    x = torch.randn(U.size(1))
    a = algorithms.build("median", server_lr=0.5).aggregate(x, U, n).params
    exp = x.double().numpy() + 0.5 * reference("median", {}, U, n)
    np.testing.assert_allclose(a.double().numpy(), exp, rtol=2 * EPS32, atol=2 * EPS32 * np.abs(exp).max())


def test_even_median_is_mean_of_middle_values():
    U = torch.tensor([[1.0, 4.0], [3.0, -2.0], [2.0, 0.0], [10.0, 1.0]])
    got = algorithms.build("median").aggregate(torch.zeros(2), U, [1] * 4).params
    assert got.tolist() == [2.5, 0.5]


def test_centered_clip_continues_from_previous_aggregate_and_state_dict():
    U1, n = _data(K=9, seed=1)
    U2, _ = _data(K=9, seed=2)
    opts = {"tau": 2.0, "iterations": 2}
    a = algorithms.build("centered_clip", **opts)
    x = torch.zeros(U1.size(1))
    v1 = a.aggregate(x, U1, n).params
    st = a.state_dict()
    b = algorithms.build("centered_clip", **opts)
    b.load_state_dict(st)
    r_a = a.aggregate(x, U2, n).params
    r_b = b.aggregate(x, U2, n).params
    assert torch.equal(r_a, r_b) and st["round"] == 1 and torch.equal(st["center"], v1)
    ref = ref_cclip(U2.double().numpy(), v1.double().numpy(), 2.0, 2)
    check_close("centered_clip", opts, r_a.double().numpy(), ref, torch.cat([U2, v1.unsqueeze(0)]))


@pytest.mark.parametrize("name,opts", RULES)
def test_state_dict_round_trip(name, opts):
    U, n = _data(K=11)
    a = algorithms.build(name, **opts)
    a.aggregate(torch.zeros(U.size(1)), U, n)
    b = algorithms.build(name, **opts)
    b.load_state_dict(a.state_dict())
    assert b.round == 1
    x = torch.randn(U.size(1))
    assert torch.equal(a.aggregate(x, U, n).params, b.aggregate(x, U, n).params)


# ---- Flower's functions ------------------------------------------------------------------------------
def _flower():
    return pytest.importorskip("flwr.server.strategy.aggregate")


@pytest.mark.parametrize("seed", range(4))
def test_matches_flower_aggregate_functions(seed):
    fa = _flower()
    rng = np.random.default_rng(seed)
    K, f = 13, 2
    shapes = [(4, 3), (7,), (5, 2, 2)]
    layers = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(K)]
    n = rng.integers(1, 80, K)
    U = torch.from_numpy(np.stack([np.concatenate([a.ravel() for a in ls]) for ls in layers]))
    x = torch.zeros(U.size(1))
    flat = lambda arrs: np.concatenate([a.ravel() for a in arrs])  # noqa: E731
    res = lambda: [(ls, int(k)) for ls, k in zip(layers, n)]  # noqa: E731
    med = algorithms.build("median").aggregate(x, U, n.tolist()).params.numpy()
    assert np.array_equal(med, flat(fa.aggregate_median(res())))
    tm = algorithms.build("trimmed_mean", beta=0.2).aggregate(x, U, n.tolist()).params.numpy()
    ft = flat(fa.aggregate_trimmed_avg(res(), 0.2))
    np.testing.assert_allclose(tm, ft, rtol=2 * EPS32, atol=2 * EPS32 * np.abs(ft).max())  # numpy sums in fp32
    kr = algorithms.build("krum", f=f).aggregate(x, U, n.tolist())
    assert np.array_equal(kr.params.numpy(), flat(fa.aggregate_krum(res(), f, 0)))
    mk = algorithms.build("krum", f=f, m=4).aggregate(x, U, n.tolist()).params.numpy()
    fm = flat(fa.aggregate_krum(res(), f, 4))  # both sum 4 fp32 terms in fp32
    assert (np.abs(mk - fm) <= 12 * EPS32 * np.abs(U.numpy()).max(0)).all()
    bu = algorithms.build("bulyan", f=f).aggregate(x, U, n.tolist()).params.numpy()
    fb = flat(fa.aggregate_bulyan(res(), f, fa.aggregate_krum, to_keep=0))
    np.testing.assert_allclose(bu, fb, rtol=2 * EPS32, atol=2 * EPS32 * np.abs(fb).max())


@pytest.mark.parametrize(
    "name,opts,flower", [("krum", {"f": 1}, "Krum"), ("median", {}, "FedMedian"), ("bulyan", {"f": 1}, "Bulyan")]
)
def test_flower_adapter_runs_robust_rules(name, opts, flower):
    pytest.importorskip("flwr")
    import flwr.server.strategy as S
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays

    from fedkernels.integrations.flower import FedKernelsStrategy
    from test_flower import Proxy

    rng = np.random.default_rng(3)
    glob = [rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal(5).astype(np.float32)]
    results = [
        (
            Proxy(str(k)),
            FitRes(
                Status(Code.OK, ""),
                ndarrays_to_parameters([g + rng.standard_normal(g.shape).astype(np.float32) for g in glob]),
                int(rng.integers(5, 50)),
                {},
            ),
        )
        for k in range(7)
    ]
    st = FedKernelsStrategy(algorithms.build(name, **opts))
    st.set_global(ndarrays_to_parameters(glob))
    got, _ = st.aggregate_fit(1, results, [])
    kw = {} if name == "median" else {"num_malicious_clients": 1, **({"to_keep": 0} if name == "bulyan" else {})}
    ref, _ = getattr(S, flower)(**kw).aggregate_fit(1, results, [])
    for a, b in zip(parameters_to_ndarrays(got), parameters_to_ndarrays(ref)):
        np.testing.assert_allclose(a, b, rtol=4 * EPS32, atol=1e-6)


# ---- bad input ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,opts,K,msg",
    [
        ("krum", {"f": 2}, 6, "krum: f=2 needs K >= 2f + 3 = 7 clients per round, got K=6"),
        ("bulyan", {"f": 1}, 6, "bulyan: f=1 needs K >= 4f + 3 = 7 clients per round, got K=6"),
        ("krum", {"m": 5}, 4, "krum: m=5 needs K >= m clients per round, got K=4"),
    ],
)
def test_too_few_clients_is_one_line_before_reading(name, opts, K, msg):
    U, n = _data(K=K)
    U[0, 0] = float("nan")  # not read: the bound is checked first
    with pytest.raises(ValueError) as e:
        algorithms.build(name, **opts).aggregate(torch.zeros(U.size(1)), U, n)
    assert str(e.value) == msg and not isinstance(e.value, BadUpdateError)


@pytest.mark.parametrize(
    "name,opts,word",
    [
        ("trimmed_mean", {"beta": 0.5}, "beta must lie in [0, 0.5), got 0.5"),
        ("trimmed_mean", {"beta": -0.1}, "beta must lie in [0, 0.5)"),
        ("krum", {"f": -1}, "f must be an integer >= 0, got -1"),
        ("krum", {"m": 0}, "m must be an integer >= 1, got 0"),
        ("krum", {"weighting": "x"}, "weighting must be one of"),
        ("bulyan", {"f": -2}, "f must be an integer >= 0"),
        ("geometric_median", {"iterations": 0}, "iterations must be an integer >= 1"),
        ("geometric_median", {"nu": 0.0}, "nu must be a finite number > 0"),
        ("geometric_median", {"ftol": -1.0}, "ftol must be a finite number >= 0"),
        ("centered_clip", {"tau": 0.0}, "tau must be a finite number > 0"),
        ("centered_clip", {"iterations": 0}, "iterations must be an integer >= 1"),
        ("krum", {"f": "two"}, "f"),
    ],
)
def test_bad_options_are_one_line(name, opts, word):
    with pytest.raises(ValueError) as e:
        algorithms.build(name, **opts)
    assert word in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name,opts", RULES)
def test_nan_row_follows_the_policy(name, opts):
    U, n = _data(K=12)
    bad = U.clone()
    bad[4, 7] = float("nan")
    x = torch.zeros(U.size(1))
    ids = list(range(12))
    with pytest.raises(BadUpdateError, match=r"client 4 \(row 4\)"):
        algorithms.build(name, **opts).aggregate(x, bad, n, ids)
    res = algorithms.build(name, on_bad_update="exclude", **opts).aggregate(x, bad, n, ids)
    keep = [k for k in ids if k != 4]
    clean = algorithms.build(name, **opts).aggregate(x, U[keep], n[keep], keep)
    assert torch.equal(res.params, clean.params)
    assert [e["client_id"] for e in res.info["excluded"]] == [4] and res.info["num_clients"] == 11


@pytest.mark.parametrize("name,opts", RULES)
def test_chunked_source_equals_in_memory(name, opts):
    U, n = _data(K=11, d=1001)
    x = torch.randn(U.size(1))
    mem = algorithms.build(name, **opts).aggregate(x, U, n)
    src = algorithms.build(name, **opts).aggregate(x, ChunkedUpdates(TensorSource(U), chunk_cols=128), n)
    if name in ("median", "trimmed_mean", "bulyan") or (name == "krum" and opts.get("m", 1) == 1):
        assert torch.equal(mem.params, src.params)  # column-local (the picks agree: checked below)
    else:  # weights from fp64 sums over chunks in another order: a few fp64 ulps apart
        torch.testing.assert_close(src.params, mem.params, rtol=1e-6, atol=1e-7)
    assert mem.info.get("selected") == src.info.get("selected")


def test_chunked_source_nan_row_is_named():
    U, n = _data(K=9, d=300)
    U[3, 250] = float("inf")
    with pytest.raises(BadUpdateError, match="row 3"):
        algorithms.build("median").aggregate(torch.zeros(300), ChunkedUpdates(TensorSource(U), chunk_cols=64), n)


def test_selection_ops_match_numpy():
    U, _ = _data(K=10, d=333)
    rows = [0, 2, 3, 5, 8, 9, 1]
    S = U.double().numpy()[rows]
    np.testing.assert_array_equal(ops.order_mean(U, 3, 4, rows=rows).numpy(), np.median(S, 0).astype(np.float32))
    beta = 3
    med = np.median(S, 0)
    idx = np.argsort(np.abs(np.sort(S, 0) - med), axis=0, kind="stable")[:beta]
    ref = np.take_along_axis(np.sort(S, 0), idx, 0).mean(0)
    np.testing.assert_allclose(ops.closest_mean(U, beta, rows=rows).numpy(), ref, rtol=EPS32)
    out, ok = ops.order_mean_screened(U, 0, 10)
    assert ok.all() and out.dtype == torch.float32
    with pytest.raises(ValueError, match="hi must be in"):
        ops.order_mean(U, 5, 5)
    with pytest.raises(ValueError, match="beta must be in"):
        ops.closest_mean(U, 0)


def test_krum_info_names_selected_clients():
    U, n = _data(K=9)
    U[[2, 6]] += 50.0  # two far-away rows are never picked
    res = algorithms.build("krum", f=2, m=3).aggregate(torch.zeros(U.size(1)), U, n, list(range(100, 109)))
    assert len(res.info["selected"]) == 3 and not {102, 106} & set(res.info["selected"])
    b = algorithms.build("bulyan", f=1).aggregate(torch.zeros(U.size(1)), U[:7], n[:7], list(range(7)))
    assert len(b.info["selected"]) == 5 and b.info["beta"] == 3


# ---- attacks ---------------------------------------------------------------------------------------
def _cfg(**attack):
    from fedkernels.sim.config import RunConfig

    return RunConfig.from_dict({"num_clients": 10, "seed": 3, "attack": attack})


def test_attack_corrupt_formulas():
    from fedkernels.sim.attacks import Attack, alie_z
    from statistics import NormalDist

    U, _ = _data(K=10, d=50)
    ids = list(range(10))
    att = Attack(_cfg(kind="alie", clients=[1, 4]))
    V = U.clone()
    assert att.corrupt(0, V, ids) == [1, 4]
    H = U.double()[[k for k in ids if k not in (1, 4)]]
    n, f = 10, 2
    z = NormalDist().inv_cdf((n - (n // 2 + 1 - f)) / n)
    assert abs(alie_z(10, 2) - z) < 1e-12
    exp = (H.mean(0) - z * H.std(0, correction=0)).float()
    assert torch.equal(V[1], exp) and torch.equal(V[4], exp)
    assert torch.equal(V[[0, 2, 3, 5, 6, 7, 8, 9]], U[[0, 2, 3, 5, 6, 7, 8, 9]])
    V = U.clone()
    Attack(_cfg(kind="ipm", clients=[0], epsilon=2.0)).corrupt(0, V, ids)
    assert torch.equal(V[0], (-2.0 * U.double()[1:].mean(0)).float())
    V = U.clone()
    Attack(_cfg(kind="sign_flip", clients=[9])).corrupt(0, V, ids)
    assert torch.equal(V[9], -U[9])
    V = U.clone()
    Attack(_cfg(kind="scale", clients=[9])).corrupt(0, V, ids)
    assert torch.equal(V[9], U[9] * 10.0)  # default: the round's K
    V = U.clone()
    assert Attack(_cfg(kind="gaussian", clients=[9], std=0.5)).corrupt(0, V, [0, 1]) is None
    assert torch.equal(V, U)  # no attacker sampled: nothing changes


def test_attackers_fixed_by_seed_and_label_flip():
    from fedkernels.sim.attacks import Attack

    a, b = Attack(_cfg(kind="sign_flip", fraction=0.3)), Attack(_cfg(kind="sign_flip", fraction=0.3))
    assert a.attackers == b.attackers and len(a.attackers) == 3
    lf = Attack(_cfg(kind="label_flip", clients=[1]))
    y = torch.tensor([0, 1, 2, 3, 4, 5])
    parts = [torch.tensor([0, 1]), torch.tensor([2, 3]), torch.tensor([4, 5])]
    assert lf.poison_labels(y, parts, 10).tolist() == [0, 1, 7, 6, 4, 5] and y.tolist() == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    "attack,msg",
    [
        ({"kind": "boom", "fraction": 0.2}, "attack.kind must be one of"),
        ({"kind": "alie"}, "needs exactly one of attack.fraction or attack.clients"),
        ({"kind": "alie", "fraction": 1.0}, "attack.fraction must be in (0, 1), got 1.0"),
        ({"kind": "alie", "clients": [3, 12]}, "attack.clients must be distinct client ids in [0, num_clients=10)"),
        ({"fraction": 0.2}, "attack.fraction=0.2 needs attack.kind"),
        ({"kind": "ipm", "fraction": 0.2, "std": 1.0}, "attack.std=1.0 is an option of attack.kind=gaussian"),
        ({"kind": "ipm", "fraction": 0.2, "epsilon": -1.0}, "attack.epsilon must be > 0, got -1.0"),
        ({"kind": "scale", "fraction": 0.2, "factor": 0.0}, "attack.factor must be > 0, got 0.0"),
        ({"kind": "alie", "fraction": 0.01}, "attack.fraction=0.01 of num_clients=10 is no attacker"),
    ],
)
def test_bad_attack_config(attack, msg):
    with pytest.raises(ValueError) as e:
        _cfg(**attack).validate()
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_no_attack_keeps_config_hash():
    from fedkernels.sim.config import RunConfig

    cfg = RunConfig()
    d = cfg.to_dict()
    for off in ("attack", "compress", "dp", "lora"):  # the optional sections, all off: none is in the hash
        d.pop(off)
    import hashlib
    from fedkernels.sim.config import PRESENTATION_KEYS

    h = hashlib.sha256(
        json.dumps({k: v for k, v in d.items() if k not in PRESENTATION_KEYS}, sort_keys=True, default=str).encode()
    ).hexdigest()[:8]
    assert cfg.config_hash() == h
    assert _cfg(kind="alie", fraction=0.2).config_hash() != _cfg().config_hash()


def _cli(*args, cwd):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return cli_process.run(
        [sys.executable, "-m", "fedkernels.sim.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_cli_krum_under_alie_records_attackers(tmp_path):
    p = _cli(
        "run",
        "--preset",
        "smoke",
        "num_clients=8",
        "algorithm.name=krum",
        "algorithm.options.f=1",
        "attack.kind=alie",
        "attack.fraction=0.25",
        "rounds=1",
        f"out_dir={tmp_path}",
        "plots=false",
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    (run,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    prov = json.loads((run / "provenance.json").read_text())
    assert prov["attack"]["kind"] == "alie" and len(prov["attack"]["attackers"]) == 2
    m = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert m[0]["attack"]["attackers"] == prov["attack"]["attackers"]  # all 8 clients take part
    assert m[0]["attack"]["selected"] == int(m[0]["agg"]["selected"][0] in prov["attack"]["attackers"])


@pytest.mark.parametrize(
    "arg,msg", [("attack.kind=alie", "needs exactly one of attack.fraction"), ("attack.epsilon=5", "needs attack.kind")]
)
def test_cli_bad_attack_exits_2_with_one_line(tmp_path, arg, msg):
    p = _cli("run", "--preset", "smoke", arg, f"out_dir={tmp_path}", cwd=tmp_path)
    assert p.returncode == 2 and msg in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not list(tmp_path.iterdir())


# ---- the attack hook under every executor ------------------------------------------------------
def _tiny_run(tmp_path, **kw):
    from fedkernels.sim import Simulation
    from fedkernels.sim.config import RunConfig, apply_overrides

    cfg = RunConfig.from_dict(
        {
            "rounds": 2,
            "num_clients": 6,
            "clients_per_round": 6,
            "seed": 1,
            "eval_every": 2,
            "out_dir": str(tmp_path),
            "plots": False,
            "verbose": False,
            "progress": False,
            "client_loss": "none",
            "data": {"name": "digits", "train_subset": 300, "test_subset": 100},
            "model": {"name": "mlp", "options": {"hidden": [8]}},
            "train": {"steps": 2, "batch_size": 16, "lr": 0.05},
            "algorithm": {"name": "krum", "options": {"f": 1}},
        }
    )
    s = Simulation(apply_overrides(cfg, [f"{k}={v}" for k, v in kw.items()]), write_outputs=False)
    s.run()
    return s


@pytest.mark.parametrize("kind", ["label_flip", "alie"])
def test_attacks_same_under_workers_and_sequential(tmp_path, kind):
    """The corruption acts on the exchanged round buffer (and label_flip on the labels before the
    executor starts), so the worker pool gives the sequential run's model bit for bit."""
    a = _tiny_run(tmp_path / "a", **{"attack.kind": kind, "attack.clients": "[0, 3]"})
    b = _tiny_run(tmp_path / "b", workers=2, **{"attack.kind": kind, "attack.clients": "[0, 3]"})
    c = _tiny_run(tmp_path / "c")
    assert torch.equal(a.global_flat, b.global_flat) and not torch.equal(a.global_flat, c.global_flat)
    assert [m["attack"] for m in a.metrics] == [m["attack"] for m in b.metrics]
    assert a.metrics[0]["attack"]["attackers"] == [0, 3]


def test_attack_under_batched_executor(tmp_path):
    s = _tiny_run(tmp_path, clients_at_once=3, **{"attack.kind": "sign_flip", "attack.fraction": 0.34})
    assert s.batched is not None and len(s.metrics[-1]["attack"]["attackers"]) == 2
    assert s.metrics[-1]["attack"]["selected"] in (0, 1)


@pytest.mark.parametrize("name,opts", RULES)
def test_norm_bound_wrapper_clips_before_the_rule(name, opts):
    """``norm_bound=M`` around a robust rule: the rule sees each update clipped to norm M."""
    U, n = _data(K=11)
    U[[1, 5]] *= 20.0
    M = 10.0
    clipped = U.double() * torch.clamp(M / U.double().norm(dim=1, keepdim=True), max=1.0)
    x = torch.zeros(U.size(1))
    got = algorithms.build(name, norm_bound=M, **opts).aggregate(x, U, n)
    ref = algorithms.build(name, **opts).aggregate(x, clipped.float(), n)
    assert got.info["norm_clipped"] == int((U.double().norm(dim=1) > M).sum())
    torch.testing.assert_close(got.params, ref.params, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "name,opts",
    [
        ("krum", {"f": 1}),
        ("krum", {"f": 1, "m": 3}),
        ("bulyan", {"f": 1}),
        ("median", {}),
        ("centered_clip", {"tau": 3.0, "iterations": 2}),
    ],
)
def test_result_vector_on_huge_pages_and_into_out_is_the_same_model(monkeypatch, name, opts):
    """The new model written into a huge-page mapping (RoundInput.result_vector -> _memory.new_vector; the size threshold lowered
    so a small d takes that path) and into the caller's ``out`` is bitwise the model of a plain
    allocation; the mapped tensor owns its memory and shares like any."""
    from fedkernels import _memory

    U, n = _data(K=11, d=1001)
    x = torch.randn(U.size(1))
    monkeypatch.setattr(_memory, "HUGE_PAGE_MIN_BYTES", 1 << 62)
    plain = algorithms.build(name, server_lr=0.7, **opts).aggregate(x, U, n).params
    monkeypatch.setattr(_memory, "HUGE_PAGE_MIN_BYTES", 0)
    mapped = algorithms.build(name, server_lr=0.7, **opts).aggregate(x, U, n).params
    out = torch.full_like(x, float("nan"))
    into = algorithms.build(name, server_lr=0.7, **opts).aggregate(x, U, n, out=out)
    assert into.params is out
    for got in (mapped, out):
        assert got.dtype == x.dtype and got.shape == x.shape and torch.equal(got, plain)
    if _memory._HUGE_PAGES:
        assert mapped.untyped_storage().nbytes() == x.numel() * 4
    mapped.add_(1.0)  # writable, and its own memory
    assert torch.equal(mapped, plain + 1.0) and not torch.equal(plain, mapped)
    assert torch.equal(mapped.clone().share_memory_(), mapped)


def test_bench_robust_runs_and_names_its_baselines(tmp_path):
    """bench/robust.py end to end on a tiny d: every case of the full run (Flower's functions when flwr is
    installed) and of the Krum breakdown is in its JSON, with the CPU time beside the wall time."""
    from bench import robust

    out = tmp_path / "r.json"
    assert robust.main(["--d", "3000", "--ks", "10", "--repeats", "1", "--out", str(out)]) == 0
    cases = {r["case"]: r for r in json.loads(out.read_text())["results"] if "case" in r}
    for c in ("floor:weighted_sum", "op:gram", "method:krum", "method:multi-krum", "method:bulyan"):
        assert c in cases and cases[c]["cpu_ms"] > 0
    if robust._flower() is not None:
        assert {"flower:aggregate_krum", "flower:aggregate_multi_krum", "flower:aggregate_bulyan"} <= set(cases)
        assert "cpu_flower_over_method" in cases["method:multi-krum"]
    assert cases["load"]["loadavg_start"]
    parts = tmp_path / "p.json"
    assert robust.main(["--krum-parts", "--d", "3000", "--ks", "10", "--repeats", "1", "--out", str(parts)]) == 0
    got = {r["case"] for r in json.loads(parts.read_text())["results"]}
    assert {"part:gram_screened", "part:screen_global", "part:final_sum_m1", "method:krum"} <= got
