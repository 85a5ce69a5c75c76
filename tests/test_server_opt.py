"""server_opt_step_ (the fused FedAdam / FedYogi / FedAdagrad step) against the float64 reference, and the
methods fedadam / fedyogi / fedadagrad against the reference over rounds, against Flower's strategies,
with bad options, the bad-row policy, a chunked source and a resume from state_dict."""

import json
import math
import re

import numpy as np
import pytest
import torch

from fedkernels import algorithms, ops, reference as ref
from fuzz_oracle import server_opt_expected  # tests/fuzz_oracle.py: the recomputation and its bound
from fedkernels.algorithms.server_opt import ServerOptimizer
from fedkernels.sources import ChunkedUpdates, TensorSource
from devices import DEVICES, one_line  # tests/devices.py: the cuda case skips without a GPU and the CUDA build

import cli_process  # tests/cli_process.py: the command in a child forked from a pre-imported interpreter

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
RULES = ["adam", "yogi", "adagrad"]
OPTS = {
    "adam": dict(beta_1=0.9, beta_2=0.99, tau=1e-3),
    "yogi": dict(beta_1=0.9, beta_2=0.99, tau=1e-3),
    "adagrad": dict(beta_1=0.5, beta_2=0.0, tau=1e-3),
}


def _state_dtype(dt):
    return torch.float64 if dt == torch.float64 else torch.float32


def _inputs(d, dt, sdt, device="cpu", seed=0):
    """x, g (pseudo-gradient) of dtype dt and m, v (state, sdt); v kept away from g^2 (the sign that
    Yogi takes of v - g^2 is then the same in every precision)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(d, generator=gen, dtype=torch.float64).to(dt)
    g = (0.1 * torch.randn(d, generator=gen, dtype=torch.float64)).to(dt)
    m = (0.05 * torch.randn(d, generator=gen, dtype=torch.float64)).to(sdt)
    v = (0.01 * torch.rand(d, generator=gen, dtype=torch.float64)).to(sdt)
    g2 = g.to(torch.float64) ** 2
    near = (v.to(torch.float64) - g2).abs() <= 1e-3 * g2
    v = torch.where(near, (1.5 * g2).to(sdt), v)
    return [t.to(device) for t in (x, g, m, v)]


def _check(io, m, v, x, g, m0, v0, rule, lr, sdt, dt, **kw):
    """io, m, v against the float64 recomputation within the bound derived from the kernel's arithmetic
    (fuzz_oracle.server_opt_expected: the roundings of m', v', sqrt, + tau, the quotient, the add)."""
    want, wm, wv, tol, tol_m, tol_v, may = server_opt_expected(
        x.cpu(), g.cpu(), m0.cpu(), v0.cpu(), rule, lr, kw["beta_1"], kw["beta_2"], kw["tau"], sdt, dt
    )
    assert m.dtype == sdt and v.dtype == sdt and io.dtype == dt
    assert not bool(may.any())  # these inputs stay in range: every coordinate is checked
    assert torch.all((m.cpu().double() - wm).abs() <= tol_m)
    assert torch.all((v.cpu().double() - wv).abs() <= tol_v)
    assert torch.all((io.cpu().double() - want).abs() <= tol), (io, want)
    # the reference op (Flower's order of operations, float64) agrees with the recomputation
    r_new, r_m, r_v = ref.server_opt_step(g.cpu().to(sdt), m0.cpu(), v0.cpu(), x.cpu(), rule=rule, lr=lr, **kw)
    assert torch.allclose(r_new, want, rtol=1e-14, atol=1e-300) and torch.allclose(r_m, wm, rtol=1e-14, atol=0)


# ---- the op -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("d", [1, 7, 16385, 40_001])
def test_op_matches_reference(device, rule, dt, d):
    sdt = _state_dtype(dt)
    x, g, m, v = _inputs(d, dt, sdt, device, seed=d)
    m0, v0, io = m.clone(), v.clone(), g.clone()
    out = ops.server_opt_step_(io, m, v, x, rule=rule, lr=0.03, **OPTS[rule])
    assert out is io
    _check(io, m, v, x, g, m0, v0, rule, 0.03, sdt, dt, **OPTS[rule])


@pytest.mark.parametrize("device", DEVICES[1:])
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dt", DTYPES)
def test_op_cuda_gives_the_cpu_bits(device, rule, dt):
    """The CUDA kernel calls the CPU op's per-coordinate function with IEEE round-to-nearest fma, sqrt
    and division intrinsics: the same bits (only a GPU run checks this)."""
    sdt = _state_dtype(dt)
    x, g, m, v = _inputs(70_001, dt, sdt, seed=9)
    cpu = [g.clone(), m.clone(), v.clone()]
    dev = [t.to(device) for t in (g, m, v)]
    ops.server_opt_step_(*cpu, x, rule=rule, lr=0.02, from_model=rule == "yogi", **OPTS[rule])
    ops.server_opt_step_(*dev, x.to(device), rule=rule, lr=0.02, from_model=rule == "yogi", **OPTS[rule])
    assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu, dev))


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16])
def test_op_float64_state_under_a_narrow_model(rule, dt):
    x, g, m, v = _inputs(5003, dt, torch.float64, seed=2)
    m0, v0, io = m.clone(), v.clone(), g.clone()
    ops.server_opt_step_(io, m, v, x, rule=rule, lr=0.1, **OPTS[rule])
    _check(io, m, v, x, g, m0, v0, rule, 0.1, torch.float64, dt, **OPTS[rule])


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dt", [torch.float32, torch.float64])
def test_op_from_model_is_the_step_on_io_minus_x(rule, dt):
    """from_model: io holds a new model; the pseudo-gradient is io - x formed in the state's precision,
    so the op equals the plain step on that difference bit for bit."""
    sdt = _state_dtype(dt)
    x, g, m, v = _inputs(9001, dt, sdt, seed=4)
    new_in = x + g
    a_io, a_m, a_v = new_in.clone(), m.clone(), v.clone()
    ops.server_opt_step_(a_io, a_m, a_v, x, rule=rule, lr=0.05, from_model=True, **OPTS[rule])
    b_io, b_m, b_v = (new_in.to(sdt) - x.to(sdt)).to(dt), m.clone(), v.clone()
    ops.server_opt_step_(b_io, b_m, b_v, x, rule=rule, lr=0.05, **OPTS[rule])
    assert torch.equal(a_io, b_io) and torch.equal(a_m, b_m) and torch.equal(a_v, b_v)


def test_op_yogi_sign_zero_and_nan_propagation():
    x = torch.zeros(4)
    io = torch.tensor([0.5, 0.0, float("nan"), 1.0])
    m = torch.zeros(4)
    v = torch.tensor([0.25, 0.0, 1.0, float("inf")])  # v == g^2: sign 0, v unchanged; g = 0: nothing moves
    ops.server_opt_step_(io, m, v, x, rule="yogi", lr=1.0, beta_1=0.9, beta_2=0.99, tau=1e-3)
    assert v[0] == 0.25 and v[1] == 0.0 and math.isnan(v[2]) and math.isnan(io[2])
    assert io[1] == 0.0 and m[1] == 0.0
    assert io[0] == pytest.approx(0.05 / (0.5 + 1e-3), rel=1e-6)


def test_op_same_bits_with_1_and_2_threads_and_across_calls():
    x, g, m, v = _inputs(300_001, torch.float32, torch.float32, seed=7)
    n0 = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 2):
            torch.set_num_threads(n)
            io, mm, vv = g.clone(), m.clone(), v.clone()
            ops.server_opt_step_(io, mm, vv, x, rule="adam", lr=0.1, beta_1=0.9, beta_2=0.99, tau=1e-9)
            outs.append((io, mm, vv))
    finally:
        torch.set_num_threads(n0)
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other))


def test_op_non_contiguous_inputs_are_written_back():
    x, g, m, v = _inputs(2 * 1001, torch.float32, torch.float32, seed=5)
    sl = slice(None, None, 2)
    io_nc, m_nc, v_nc, x_nc = g.clone()[sl], m.clone()[sl], v.clone()[sl], x[sl]
    io_c, m_c, v_c = io_nc.contiguous(), m_nc.contiguous(), v_nc.contiguous()
    assert not io_nc.is_contiguous()
    ops.server_opt_step_(io_nc, m_nc, v_nc, x_nc, rule="yogi", lr=0.1, beta_1=0.9, beta_2=0.99, tau=1e-3)
    ops.server_opt_step_(io_c, m_c, v_c, x_nc.contiguous(), rule="yogi", lr=0.1, beta_1=0.9, beta_2=0.99, tau=1e-3)
    assert torch.equal(io_nc, io_c) and torch.equal(m_nc, m_c) and torch.equal(v_nc, v_c)


def test_op_empty_is_a_no_op():
    e = torch.zeros(0)
    ops.server_opt_step_(e, e.clone(), e.clone(), e.clone(), rule="adam", lr=1.0)


def _bad_call(**over):
    x, g, m, v = _inputs(8, torch.float32, torch.float32)
    a = dict(io=g, m=m, v=v, x=x, rule="adam", lr=0.1, beta_1=0.9, beta_2=0.99, tau=1e-3)
    a.update(over)
    ops.server_opt_step_(a.pop("io"), a.pop("m"), a.pop("v"), a.pop("x"), **a)


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(rule="sgd"), "rule must be one of"),
        (dict(lr=float("nan")), "lr must be a finite number"),
        (dict(tau=-1.0), "tau must be >= 0"),
        (dict(beta_1=1.5), r"beta_1 must lie in \[0, 1\]"),
        (dict(beta_2=-0.1), r"beta_2 must lie in \[0, 1\]"),
        (dict(io=torch.zeros(9)), "io must be a 1-D tensor of length d=8"),
        (dict(m=torch.zeros(8, dtype=torch.float16)), "m and v must both be float32 or both float64"),
        (dict(v=torch.zeros(8, dtype=torch.float64)), "m and v must both be float32 or both float64"),
        (dict(io=torch.zeros(8, dtype=torch.float64)), "io must have dtype torch.float32"),
        (
            dict(x=torch.zeros(8, dtype=torch.float64), io=torch.zeros(8, dtype=torch.float64)),
            "m and v must be float64 for a float64 model",
        ),
        (dict(x=torch.zeros(2, 4)), "x must be a 1-D"),
        (dict(x=torch.zeros(8, dtype=torch.int64)), "x must have a floating dtype"),
        (dict(from_model=1), "from_model must be a bool"),
    ],
)
def test_op_bad_arguments_name_them(over, match):
    with pytest.raises(ValueError, match=match):
        _bad_call(**over)


# ---- tensor properties: checked once, by the native op, for the wrapper and a direct call alike ----
_F32, _F64 = torch.float32, torch.float64
BAD_TENSOR_ARGS = [  # (tensors replaced in a float32 call with d = 8, the message after "server_opt_step_: ")
    (dict(io=torch.zeros(9)), "io must be a 1-D tensor of length d=8 (len(x)), got shape (9,)"),
    (dict(m=torch.zeros(2, 4)), "m must be a 1-D tensor of length d=8 (len(x)), got shape (2, 4)"),
    (dict(v=torch.zeros(())), "v must be a 1-D tensor of length d=8 (len(x)), got shape ()"),
    (dict(x=torch.zeros(2, 4)), "x must be a 1-D [d] tensor, got shape (2, 4)"),
    (
        dict(x=torch.zeros(8, dtype=torch.int64)),
        "x must have a floating dtype (float16, bfloat16, float32, float64), got torch.int64",
    ),
    (dict(io=torch.zeros(8, dtype=_F64)), "io must have dtype torch.float32 (the dtype of x), got torch.float64"),
    (dict(io=torch.zeros(8, dtype=torch.int32)), "io must have dtype torch.float32 (the dtype of x), got torch.int32"),
    (
        dict(m=torch.zeros(8, dtype=torch.float16)),
        "m and v must both be float32 or both float64, got torch.float16 and torch.float32",
    ),
    (
        dict(v=torch.zeros(8, dtype=_F64)),
        "m and v must both be float32 or both float64, got torch.float32 and torch.float64",
    ),
    (
        dict(x=torch.zeros(8, dtype=_F64), io=torch.zeros(8, dtype=_F64)),
        "m and v must be float64 for a float64 model, got torch.float32",
    ),
]


@pytest.mark.parametrize("case", range(len(BAD_TENSOR_ARGS)))
def test_bad_tensor_args_same_from_wrapper_and_native(case):
    over, msg = BAD_TENSOR_ARGS[case]
    x, g, m, v = _inputs(8, _F32, _F32)
    a = {**dict(io=g, m=m, v=v, x=x), **over}
    t = (a["io"], a["m"], a["v"], a["x"])
    for fn in (
        lambda: ops.server_opt_step_(*t, rule="adam", lr=0.1, beta_1=0.9, beta_2=0.99),
        lambda: torch.ops.fedkernels.server_opt_step_(*t, "adam", 0.1, 0.9, 0.99, 1e-9, False),
    ):
        one_line(ValueError, "^" + re.escape("server_opt_step_: " + msg) + "$", fn)


def test_the_native_step_refuses_non_contiguous_state():
    """The wrapper copies it in and back; a direct call must pass contiguous tensors."""
    x, g, m, v = _inputs(8, _F32, _F32)
    m2 = torch.zeros(16)[::2]
    m2.copy_(m)
    one_line(
        ValueError,
        r"^server_opt_step_: m must be contiguous \(the fedkernels.ops wrapper copies it once\)$",
        torch.ops.fedkernels.server_opt_step_,
        g.clone(),
        m2,
        v.clone(),
        x,
        "adam",
        0.1,
        0.9,
        0.99,
        1e-9,
        False,
    )
    io_a, io_b = g.clone(), g.clone()
    ops.server_opt_step_(io_a, m2, v.clone(), x, rule="adam", lr=0.1, beta_1=0.9, beta_2=0.99)
    m_b = m.clone()
    torch.ops.fedkernels.server_opt_step_(io_b, m_b, v.clone(), x, "adam", 0.1, 0.9, 0.99, 1e-9, False)
    assert torch.equal(io_a, io_b) and torch.equal(m2, m_b)  # the same kernel on the same values


def test_op_refuses_shared_memory_and_tensors_that_need_grad():
    x, g, m, v = _inputs(8, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="io and x share memory"):
        ops.server_opt_step_(x, m, v, x, rule="adam", lr=0.1)
    with pytest.raises(ValueError, match="m and v share memory"):
        ops.server_opt_step_(g, m, m, x, rule="adam", lr=0.1)
    with pytest.raises(ValueError, match="internally overlapping"):
        ops.server_opt_step_(g, torch.zeros(1).expand(8), v, x, rule="adam", lr=0.1)
    with pytest.raises(TypeError, match="m must be a torch.Tensor"):
        ops.server_opt_step_(g, [0.0] * 8, v, x, rule="adam", lr=0.1)
    with pytest.raises(RuntimeError, match="has no derivative"):
        ops.server_opt_step_(g, m, v, x.clone().requires_grad_(), rule="adam", lr=0.1)


@pytest.mark.parametrize("rule", RULES)
def test_op_opcheck(rule):
    x, g, m, v = _inputs(37, torch.float32, torch.float32, seed=1)
    torch.library.opcheck(
        torch.ops.fedkernels.server_opt_step_.default, (g, m, v, x, rule, 0.1, 0.9, 0.99, 1e-3, rule == "yogi")
    )


# ---- the methods ----------------------------------------------------------------------------------------
def _rounds(K=6, d=501, R=5, dt=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(d, generator=gen, dtype=torch.float64).to(dt)
    Us = [(0.1 * torch.randn(K, d, generator=gen, dtype=torch.float64) + 0.02 * r).to(dt) for r in range(R)]
    ns = [torch.randint(5, 60, (K,), generator=gen).tolist() for _ in range(R)]
    return x, Us, ns


def _ref_rounds(rule, x, Us, ns, eta, beta_1, beta_2, tau, correction, initial_v=0.0, uniform=False):
    """float64 recomputation: sample-weighted mean update, Flower's FedOpt arithmetic (reference op)."""
    x = x.to(torch.float64)
    m = torch.zeros_like(x)
    v = torch.full_like(x, initial_v)
    for r, (U, n) in enumerate(zip(Us, ns)):
        p = (
            torch.full((len(n),), 1.0 / len(n), dtype=torch.float64)
            if uniform
            else torch.tensor(n, dtype=torch.float64) / sum(n)
        )
        g = p @ U.to(torch.float64)
        e = {"flower": r + 2, "adam": r + 1}.get(correction)
        lr = eta if e is None else eta * math.sqrt(1 - beta_2**e) / (1 - beta_1**e)
        x, m, v = ref.server_opt_step(g, m, v, x, rule=rule, lr=lr, beta_1=beta_1, beta_2=beta_2, tau=tau)
    return x


CASES = [
    ("fedadam", "adam", {}, dict(eta=0.1, beta_1=0.9, beta_2=0.99, tau=1e-9, correction="flower")),
    (
        "fedadam",
        "adam",
        dict(bias_correction="adam", eta=0.05, tau=1e-3),
        dict(eta=0.05, beta_1=0.9, beta_2=0.99, tau=1e-3, correction="adam"),
    ),
    (
        "fedadam",
        "adam",
        dict(bias_correction=False, beta_1=0.5, beta_2=0.9),
        dict(eta=0.1, beta_1=0.5, beta_2=0.9, tau=1e-9, correction="none"),
    ),
    ("fedyogi", "yogi", {}, dict(eta=1e-2, beta_1=0.9, beta_2=0.99, tau=1e-3, correction="none")),
    (
        "fedyogi",
        "yogi",
        dict(bias_correction=True, initial_v=1e-6),
        dict(eta=1e-2, beta_1=0.9, beta_2=0.99, tau=1e-3, correction="flower", initial_v=1e-6),
    ),
    ("fedadagrad", "adagrad", {}, dict(eta=0.1, beta_1=0.0, beta_2=0.0, tau=1e-9, correction="none")),
    (
        "fedadagrad",
        "adagrad",
        dict(beta_1=0.9, tau=1e-3, weighting="uniform"),
        dict(eta=0.1, beta_1=0.9, beta_2=0.0, tau=1e-3, correction="none", uniform=True),
    ),
]


@pytest.mark.parametrize("name,rule,opts,refopts", CASES)
def test_method_matches_float64_reference_over_5_rounds(name, rule, opts, refopts):
    """A float64 model: the weighted mean (fp64-accumulated, fixed order) and the fused step against the
    recomputation; 1e-12 of the model's scale covers the rounding of five rounds (each a few ulps of
    the step, about eta)."""
    x, Us, ns = _rounds()
    agg = algorithms.build(name, **opts)
    g = x
    for r, (U, n) in enumerate(zip(Us, ns)):
        g, info = agg.aggregate(g, U, n)
        assert info["t"] == r + 1 and info["num_clients"] == 6
    want = _ref_rounds(rule, x, Us, ns, **refopts)
    assert g.dtype == torch.float64
    assert torch.allclose(g, want, rtol=0, atol=1e-12)
    assert agg.t == 5 and agg.m.dtype == torch.float64 and agg.v.shape == (501,)


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16])
def test_method_narrow_model_keeps_float32_state(dt):
    """A narrow model: float32 state, and every round is the weighted mean in the model's dtype (the same
    weighted_sum op, bit for bit) followed by the step within its derived bound from the state before it."""
    x, Us, ns = _rounds(dt=dt, R=3)
    agg = algorithms.build("fedadam", tau=1e-3)
    g = x
    for r, (U, n) in enumerate(zip(Us, ns)):
        m0 = agg.m.clone() if agg.m is not None else torch.zeros(x.numel())
        v0 = agg.v.clone() if agg.v is not None else torch.zeros(x.numel())
        p = torch.tensor(n, dtype=torch.float64) / sum(n)
        delta = ops.weighted_sum(U, p)
        new, info = agg.aggregate(g, U, n)
        assert new.dtype == dt and agg.m.dtype == torch.float32 and agg.v.dtype == torch.float32
        want, wm, wv, tol, tol_m, tol_v, may = server_opt_expected(
            g, delta, m0, v0, "adam", info["eta_t"], 0.9, 0.99, 1e-3, torch.float32, dt
        )
        assert not bool(may.any())
        assert torch.all((new.double() - want).abs() <= tol)
        assert torch.all((agg.m.double() - wm).abs() <= tol_m) and torch.all((agg.v.double() - wv).abs() <= tol_v)
        g = new


def test_server_lr_scales_the_step():
    x, Us, ns = _rounds(R=2)
    a, b = algorithms.build("fedyogi", eta=0.02), algorithms.build("fedyogi", eta=0.01, server_lr=2.0)
    ga, gb = x, x
    for U, n in zip(Us, ns):
        ga, _ = a.aggregate(ga, U, n)
        gb, _ = b.aggregate(gb, U, n)
    assert torch.equal(ga, gb)


def test_resume_from_state_dict_is_bitwise():
    x, Us, ns = _rounds(dt=torch.float32, R=5)
    full = algorithms.build("fedadam", tau=1e-3)
    g = x
    for U, n in zip(Us, ns):
        g, _ = full.aggregate(g, U, n)
    first = algorithms.build("fedadam", tau=1e-3)
    h = x
    for U, n in zip(Us[:3], ns[:3]):
        h, _ = first.aggregate(h, U, n)
    st = first.state_dict()
    assert set(st) >= {"m", "v", "t", "round"} and st["t"] == 3 and st["m"].dtype == torch.float32
    resumed = algorithms.build("fedadam", tau=1e-3)
    resumed.load_state_dict(st)
    st["m"].fill_(1.0)  # the loaded state is a copy
    for U, n in zip(Us[3:], ns[3:]):
        h, _ = resumed.aggregate(h, U, n)
    assert torch.equal(g, h)
    assert torch.equal(full.m, resumed.m) and torch.equal(full.v, resumed.v) and resumed.t == 5


def test_bad_row_excluded_before_the_state_moves():
    x, Us, ns = _rounds(R=1, dt=torch.float32)
    U = Us[0].clone()
    U[2, 7] = float("nan")
    keep = [0, 1, 3, 4, 5]
    a = algorithms.build("fedyogi", on_bad_update="exclude")
    b = algorithms.build("fedyogi")
    ga, info = a.aggregate(x, U, ns[0])
    gb, _ = b.aggregate(x, U[keep], [ns[0][k] for k in keep], client_ids=keep)
    assert torch.equal(ga, gb) and torch.equal(a.m, b.m) and torch.equal(a.v, b.v)
    assert [e["client_id"] for e in info["excluded"]] == [2]
    c = algorithms.build("fedyogi")
    with pytest.raises(algorithms.BadUpdateError, match="row 2"):
        c.aggregate(x, U, ns[0])
    assert c.m is None and c.t == 0  # nothing moved


def test_chunked_source_gives_the_same_bits():
    x, Us, ns = _rounds(R=2, dt=torch.float32, d=1003)
    a, b = algorithms.build("fedadam"), algorithms.build("fedadam")
    ga, gb = x, x
    for U, n in zip(Us, ns):
        ga, _ = a.aggregate(ga, U, n)
        gb, _ = b.aggregate(gb, ChunkedUpdates(TensorSource(U), chunk_cols=100), n)
    assert torch.equal(ga, gb)
    assert a.passes() == ("sum",)


def test_options_and_defaults_are_flowers():
    o = {n: {k: v.default for k, v in algorithms.options(n).items()} for n in ("fedadam", "fedyogi", "fedadagrad")}
    assert {k: o["fedadam"][k] for k in ("eta", "eta_l", "beta_1", "beta_2", "tau", "bias_correction")} == dict(
        eta=0.1, eta_l=0.1, beta_1=0.9, beta_2=0.99, tau=1e-9, bias_correction=True
    )
    assert {k: o["fedyogi"][k] for k in ("eta", "eta_l", "beta_1", "beta_2", "tau", "bias_correction")} == dict(
        eta=1e-2, eta_l=0.0316, beta_1=0.9, beta_2=0.99, tau=1e-3, bias_correction=False
    )
    assert {k: o["fedadagrad"][k] for k in ("eta", "eta_l", "tau", "beta_1")} == dict(
        eta=0.1, eta_l=0.1, tau=1e-9, beta_1=0.0
    )
    assert "beta_2" not in o["fedadagrad"] and "bias_correction" not in o["fedadagrad"]
    assert o["fedadam"]["weighting"] == "samples"


@pytest.mark.parametrize(
    "name,opts,match",
    [
        ("fedadam", dict(eta=0.0), "fedadam: eta must be > 0, got 0.0"),
        ("fedadam", dict(eta=-1), "fedadam: eta must be > 0"),
        ("fedadam", dict(eta_l=0), "fedadam: eta_l must be > 0"),
        ("fedadam", dict(beta_1=1.0), r"fedadam: beta_1 must lie in \[0, 1\), got 1.0"),
        ("fedyogi", dict(beta_2=-0.5), r"fedyogi: beta_2 must lie in \[0, 1\)"),
        ("fedyogi", dict(tau=0.0), "fedyogi: tau must be > 0"),
        ("fedadam", dict(tau=float("inf")), "fedadam: tau must be a finite number"),
        ("fedadam", dict(bias_correction="kingma"), "fedadam: bias_correction must be True, False or one of"),
        ("fedadagrad", dict(initial_v=-1.0), "fedadagrad: initial_v must be >= 0"),
        ("fedadagrad", dict(beta_2=0.9), "beta_2"),
        ("fedadam", dict(weighting="median"), "weighting must be one of"),
        ("fedadam", dict(server_lr_schedule="x.json"), "server_lr_schedule='x.json' is not supported"),
        ("fedyogi", dict(eta="fast"), "eta"),
    ],
)
def test_bad_options_are_one_line_value_errors(name, opts, match):
    with pytest.raises(ValueError, match=match) as e:
        algorithms.build(name, **opts)
    assert "\n" not in str(e.value)


def test_state_of_another_model_is_refused():
    x, Us, ns = _rounds(R=1, d=50)
    a = algorithms.build("fedadam")
    a.aggregate(x, Us[0], ns[0])
    b = algorithms.build("fedadam")
    b.load_state_dict(a.state_dict())
    x2, Us2, ns2 = _rounds(R=1, d=51)
    with pytest.raises(ValueError, match=r"fedadam: optimiser state m has shape \(50,\), expected \[51\]"):
        b.aggregate(x2, Us2[0], ns2[0])


def test_the_part_composes_after_another_aggregate():
    """ServerOptimizer after FedAvg's new model (from_model): the pseudo-gradient is new - x, so the
    result is fedadam's up to the rounding of x + delta - x (float64 here: far below 1e-12)."""
    x, Us, ns = _rounds(R=3)
    inner, opt = algorithms.build("fedavg"), ServerOptimizer("adam", 0.1, 0.9, 0.99, 1e-9, True)
    adam = algorithms.build("fedadam")
    g, h = x, x
    for r, (U, n) in enumerate(zip(Us, ns)):
        new, _ = inner.aggregate(g, U, n)
        g = opt.step_(g, new, r, from_model=True)
        h, _ = adam.aggregate(h, U, n)
    assert torch.allclose(g, h, rtol=0, atol=1e-12)


# ---- the optimiser around any method (the wrapper seam: server_opt=) ------------------------------------------
@pytest.mark.parametrize("rule,method", [("adam", "fedadam"), ("yogi", "fedyogi"), ("adagrad", "fedadagrad")])
def test_server_opt_around_fedavg_is_the_method(rule, method):
    """fedavg + server_opt=rule: the pseudo-gradient is new - x with new = x + delta (float64: the
    difference is delta to ~1e-16 of |x|), so the models stay within 1e-12 of the method's over 5 rounds."""
    x, Us, ns = _rounds()
    a, b = algorithms.build("fedavg", server_opt=rule), algorithms.build(method)
    ga, gb = x, x
    for U, n in zip(Us, ns):
        ga, info = a.aggregate(ga, U, n)
        gb, _ = b.aggregate(gb, U, n)
        assert info["server_opt"]["rule"] == rule
    assert torch.allclose(ga, gb, rtol=0, atol=1e-12)
    assert a.t == 5 and torch.allclose(a.v, b.v, rtol=1e-9, atol=0)


def test_server_opt_mapping_overrides_the_defaults_and_resumes_bitwise():
    x, Us, ns = _rounds(dt=torch.float32, R=4)
    opts = dict(mode="S", server_opt={"rule": "yogi", "eta": 0.02, "tau": 1e-4, "bias_correction": "adam"})
    full = algorithms.build("kuramoto", **opts)
    g = x
    for U, n in zip(Us, ns):
        g, info = full.aggregate(g, U, n)
    assert full.opt.eta == 0.02 and full.opt.tau == 1e-4 and full.opt.bias_correction == "adam"
    first = algorithms.build("kuramoto", **opts)
    h = x
    for U, n in zip(Us[:2], ns[:2]):
        h, _ = first.aggregate(h, U, n)
    st = first.state_dict()
    assert st["t"] == 2 and "inner" in st and st["m"].shape == (501,)
    again = algorithms.build("kuramoto", **opts)
    again.load_state_dict(st)
    for U, n in zip(Us[2:], ns[2:]):
        h, _ = again.aggregate(h, U, n)
    assert torch.equal(g, h) and again.round == 4


def test_server_opt_after_norm_bound_clips_first():
    """norm_bound (inner) then server_opt: fedadam on the explicitly clipped rows (float64: the scaled
    rows differ by fp64 rounding, which the step carries through at the 1e-12 level)."""
    x, Us, ns = _rounds(R=3)
    M = 0.5
    a = algorithms.build("fedavg", norm_bound=M, server_opt="adam")
    b = algorithms.build("fedadam")
    ga, gb = x, x
    for U, n in zip(Us, ns):
        norms = U.norm(dim=1, keepdim=True)
        Uc = U * torch.where(norms > M, M / norms, torch.ones_like(norms))
        ga, info = a.aggregate(ga, U, n)
        gb, _ = b.aggregate(gb, Uc, n)
        assert info["norm_clipped"] > 0
    assert torch.allclose(ga, gb, rtol=0, atol=1e-12)


def test_server_opt_leaves_the_methods_own_result_alone_and_screens_first():
    x, Us, ns = _rounds(R=1, dt=torch.float32)
    U = Us[0].clone()
    U[1, 3] = float("nan")
    agg = algorithms.build("fedavgm", server_opt="adagrad")
    with pytest.raises(algorithms.BadUpdateError, match="row 1"):
        agg.aggregate(x, U, ns[0])
    assert agg.t == 0 and agg.m is None  # the policy acted before the step
    keep = algorithms.build("fedavgm", server_opt="adagrad", on_bad_update="exclude")
    new, info = keep.aggregate(x, U, ns[0])
    assert [e["client_id"] for e in info["excluded"]] == [1] and keep.t == 1
    assert not torch.equal(keep.momentum, new)  # the inner method's state is not the result


@pytest.mark.parametrize(
    "spec,match",
    [
        ("sgd", "server_opt rule 'sgd': expected one of"),
        ({"eta": 0.1}, "server_opt rule None: expected one of"),
        ({"rule": "adam", "momentum": 0.9}, "server_opt option 'momentum' is not one of"),
        ({"rule": "adagrad", "beta_2": 0.9}, "server_opt option 'beta_2' is not one of"),
        ({"rule": "adam", "eta": -1.0}, r"fedavg \(server_opt\): eta must be > 0"),
        (3, "option server_opt=3: expected a string or a mapping"),
    ],
)
def test_server_opt_bad_values_are_one_line(spec, match):
    with pytest.raises(ValueError, match=match) as e:
        algorithms.build("fedavg", server_opt=spec)
    assert "\n" not in str(e.value)


def test_cli_reaches_server_opt(tmp_path):
    import json
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1")
    base = [
        sys.executable,
        "-m",
        "fedkernels",
        "run",
        "--preset",
        "smoke",
        "rounds=2",
        "plots=false",
        "threads=1",
        "--no-progress",
        "--quiet",
    ]
    p = cli_process.run(
        base + ["algorithm.options.server_opt=yogi"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-2000:]
    run_dir = json.loads(p.stdout.strip().splitlines()[-1])["run_dir"]
    with open(tmp_path / run_dir / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["agg"]["server_opt"]["t"] for r in rows] == [1, 2]
    p = cli_process.run(
        base + ["algorithm.name=fedadam", "algorithm.options.beta_1=1.5"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "algorithm.options.beta_1=1.5" in lines[0], p.stderr


# ---- against Flower's strategies --------------------------------------------------------------------------
SHAPES = [(6, 3, 3, 3), (6,), (10, 54), (10,), (1,)]
FLOWER = [
    ("fedadam", "FedAdam", {}),
    ("fedadam", "FedAdam", dict(eta=0.03, beta_1=0.8, beta_2=0.95, tau=1e-4)),
    ("fedyogi", "FedYogi", {}),
    ("fedyogi", "FedYogi", dict(eta=0.05, beta_1=0.5, beta_2=0.9, tau=1e-6)),
    ("fedadagrad", "FedAdagrad", {}),
    ("fedadagrad", "FedAdagrad", dict(eta=0.2, tau=1e-5)),
]


@pytest.mark.parametrize("name,cls,opts", FLOWER)
def test_models_match_flower_over_5_rounds(name, cls, opts):
    """Flower's aggregate_fit on FitRes of float64 ndarrays (the clients' full models, as Flower's own
    tests build them) against the method on the same updates: the models agree to 1e-6 every round."""
    pytest.importorskip("flwr")
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server import strategy
    from test_flower import Proxy  # tests/test_flower.py: a ClientProxy that is never called

    rng = np.random.default_rng(11)
    glob = [rng.standard_normal(s) for s in SHAPES]
    fl = getattr(strategy, cls)(initial_parameters=ndarrays_to_parameters(glob), **opts)
    agg = algorithms.build(name, **opts)
    x = torch.cat([torch.from_numpy(a).reshape(-1) for a in glob])
    for rnd in range(1, 6):
        res, U, n = [], [], []
        cur = [
            y.reshape(s) for y, s in zip(np.split(x.numpy(), np.cumsum([int(np.prod(s)) for s in SHAPES])[:-1]), SHAPES)
        ]
        for k in range(4 + rnd):
            w = [a + 0.05 * rng.standard_normal(a.shape) + 0.01 * rnd for a in cur]
            nk = int(rng.integers(5, 60))
            res.append((Proxy(str(k)), FitRes(Status(Code.OK, ""), ndarrays_to_parameters(w), nk, {})))
            U.append(torch.cat([torch.from_numpy(a).reshape(-1) for a in w]) - x)
            n.append(nk)
        params, _ = fl.aggregate_fit(rnd, res, [])
        want = np.concatenate([a.reshape(-1) for a in parameters_to_ndarrays(params)])
        x, _ = agg.aggregate(x, torch.stack(U), n)
        np.testing.assert_allclose(x.numpy(), want, rtol=0, atol=1e-6)
    if name == "fedadam":  # and the option matters: without Flower's correction the models differ
        other = algorithms.build(name, bias_correction=False, **opts)
        assert other.opt.step_size(1, 0) != agg.opt.step_size(1, 0)


def test_flower_adapter_runs_fedadam_and_server_opt():
    """fedkernels' Flower strategy with fedadam (and a wrapped method) under Flower's aggregate_fit: the
    optimiser's step count and step size reach Flower's metrics; the models move."""
    pytest.importorskip("flwr")
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
    from test_flower import Proxy
    from fedkernels.integrations.flower import FedKernelsStrategy

    rng = np.random.default_rng(3)
    glob = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    for agg in (algorithms.build("fedadam", tau=1e-3), algorithms.build("fedavg", server_opt="yogi")):
        st = FedKernelsStrategy(agg, min_fit_clients=1, min_available_clients=1)
        params = ndarrays_to_parameters(glob)
        for r in (1, 2):
            st.set_global(params)
            cur = parameters_to_ndarrays(params)
            res = [
                (
                    Proxy(str(k)),
                    FitRes(
                        Status(Code.OK, ""),
                        ndarrays_to_parameters(
                            [a + 0.05 * rng.standard_normal(a.shape).astype(np.float32) for a in cur]
                        ),
                        10 + k,
                        {},
                    ),
                )
                for k in range(4)
            ]
            params, metrics = st.aggregate_fit(r, res, [])
            t = metrics["t"] if "t" in metrics else json.loads(metrics["server_opt"])["t"]
            assert t == r
        new = np.concatenate([a.reshape(-1) for a in parameters_to_ndarrays(params)])
        assert not np.allclose(new, np.concatenate([a.reshape(-1) for a in glob]))
