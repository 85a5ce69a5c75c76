"""fedecado_be_step (the fused FedECADO backward-Euler attempt): against the float64 reference (dense
solve of spec fedecado.md §2.6 + the §2.7 LTE), against the torch composition in
fedecado.be_step, spec §9 U2/U5d numbers, out buffers, NaN -> reject, opcheck, bad inputs, and the
wiring into central_round / the FedECADO aggregator."""

import math
import re

import pytest
import torch

from fedkernels import ops, reference
from fedkernels.algorithms import build
from fedkernels.algorithms.fedecado import solver as fe
from devices import DEV, DEVICES, cuda_only, gen, one_line, settle  # tests/devices.py: every case on cpu and cuda
import host_harness  # tests/host_harness.py: the CUDA kernels' per-thread logic on the host
from host_harness import hexf

D64 = torch.float64


def _inputs(K, d, seed, dtype=D64, S=True, hold=False):
    g = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g, dtype=D64)  # noqa: E731
    T = torch.rand(K, generator=g, dtype=D64) * 1.9 + 0.1
    tl = float(torch.rand(1, generator=g, dtype=D64)) * float(T.max())
    dt = (0.02 + 0.98 * float(torch.rand(1, generator=g, dtype=D64))) * (float(T.max()) - tl)
    L = 0.1 + 9.9 * float(torch.rand(1, generator=g, dtype=D64))
    w = torch.rand(K, generator=g, dtype=D64) * 2
    h = torch.rand(K, generator=g, dtype=D64) * 5
    thn, tho = fe.theta(T, tl + dt, "hold" if hold else "linear"), fe.theta(T, tl, "hold" if hold else "linear")
    ig = 1.0 / (1.0 / dt + w * h)
    t = lambda x: x.to(dtype)  # noqa: E731
    return dict(
        xc=t(rn(d)),
        Icur=t(rn(K, d)),
        xc0=t(rn(d)),
        U=t(rn(K, d)),
        Ik=t(rn(K, d)),
        S_off=t(rn(d)) if S else None,
        theta_new=thn,
        theta_old=tho,
        inv_g=ig,
        dt=dt,
        L=L,
    )


def _args(a):
    return (
        a["xc"],
        a["Icur"],
        a["xc0"],
        a["U"],
        a["Ik"],
        a["S_off"],
        a["theta_new"],
        a["theta_old"],
        a["inv_g"],
        a["dt"],
        a["L"],
    )


def _close_lte(x, y, rtol):
    for u, v in zip(x, y):
        assert abs(u - v) <= rtol * max(abs(v), 1e-300), (x, y)


# ---- against the float64 reference (dense solve) --------------------------------------------------
@pytest.mark.parametrize(
    "K,d", [(1, 1), (2, 7), (3, 1), (5, 1031), (10, 333), (33, 257), (70, 65), (200, 76), (300, 390)]
)  # (column chunks of the CPU kernel: 1 x 80, 208 + 182)
@pytest.mark.parametrize("S", [True, False])
def test_matches_reference_f64(K, d, S):
    a = _inputs(K, d, seed=K * 100 + d, S=S)
    xn, In, lte = ops.fedecado_be_step(*_args(a))
    rx, rI, rl = reference.fedecado_be_step(*_args(a))
    assert xn.dtype == D64 and In.shape == (K, d) and lte.dtype == D64 and lte.shape == (2,)
    torch.testing.assert_close(xn, rx, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(In, rI, rtol=1e-12, atol=1e-12)
    _close_lte(lte.tolist(), rl.tolist(), 1e-9)


@pytest.mark.parametrize("K,d", [(4, 1000), (10, 4097)])
def test_matches_reference_f32(K, d):
    a = _inputs(K, d, seed=7 + K, dtype=torch.float32)
    xn, In, lte = ops.fedecado_be_step(*_args(a))
    assert xn.dtype == torch.float32 and In.dtype == torch.float32
    rx, rI, rl = reference.fedecado_be_step(*_args(a))
    torch.testing.assert_close(xn.double(), rx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(In.double(), rI, rtol=1e-5, atol=1e-5)
    _close_lte(lte.tolist(), rl.tolist(), 1e-4)


def test_hold_theta_and_ecado_limit():
    a = _inputs(6, 301, seed=3, hold=True)
    a["inv_g"] = torch.zeros(6, dtype=D64)  # ECADO limit: 1/g = 0, a_i = 1
    xn, In, lte = ops.fedecado_be_step(*_args(a))
    rx, rI, rl = reference.fedecado_be_step(*_args(a))
    torch.testing.assert_close(xn, rx, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(In, rI, rtol=1e-12, atol=1e-12)
    _close_lte(lte.tolist(), rl.tolist(), 1e-9)


def test_noncontiguous_inputs():
    K, d = 5, 211
    a = _inputs(K, d, seed=11)
    big = torch.randn(K, 2 * d + 3, dtype=D64)
    big[:, 3 : d + 3] = a["U"]
    Ibig = torch.randn(2 * K, d, dtype=D64)
    Ibig[::2] = a["Icur"]
    b = dict(a)
    b["U"] = big[:, 3 : d + 3]  # row stride 2d + 3 (column chunk of a buffer)
    b["Icur"] = Ibig[::2]  # every other row
    b["Ik"] = a["Ik"].t().contiguous().t()  # column-major: copied once by the wrapper
    b["xc"] = torch.stack([a["xc"], a["xc"]], 1)[:, 0]  # stride 2
    b["theta_new"] = torch.stack([a["theta_new"], a["theta_new"]], 1)[:, 1]
    assert not b["U"].is_contiguous() and not b["Icur"].is_contiguous() and not b["xc"].is_contiguous()
    x1, I1, l1 = ops.fedecado_be_step(*_args(a))
    x2, I2, l2 = ops.fedecado_be_step(*_args(b))
    assert torch.equal(x1, x2) and torch.equal(I1, I2) and torch.equal(l1, l2)


@pytest.mark.parametrize("dtype", [D64, torch.float32])
@pytest.mark.parametrize("K", [3, 100])
def test_bits_do_not_depend_on_the_column_position(K, dtype):
    """A column's x', I' and its share of the LTE maxima are the same bits wherever it falls: in the whole
    vectors of a chunk or in the CPU kernel's last span (the last 64 bytes of columns of a chunk whose width
    is not a multiple of 64 bytes, recomputed over columns the vectors before it already hold), and for a
    chunk narrower than one vector. Each [K, d] problem is compared with one of width dw (a multiple of 16:
    whole vectors only) that holds its columns first and repeats them after (same maxima)."""
    for d in list(range(1, 20)) + list(range(60, 85)):
        a = _inputs(K, d, seed=K * 1000 + d, dtype=dtype, S=d % 2 == 0)
        dw = (d + 15) // 16 * 16 + 16
        idx = torch.arange(dw) % d
        w = {
            k: (
                v[..., idx]
                if isinstance(v, torch.Tensor) and v.shape[-1] == d and k not in ("theta_new", "theta_old", "inv_g")
                else v
            )
            for k, v in a.items()
        }
        xn, In, lte = ops.fedecado_be_step(*_args(a))
        xw, Iw, ltew = ops.fedecado_be_step(*_args(w))
        assert torch.equal(xn, xw[:d]) and torch.equal(In, Iw[:, :d]), (K, d)
        assert torch.equal(lte, ltew), (K, d, lte, ltew)


# ---- against the torch composition (fedecado.be_step) and spec numbers ---------------------------
@pytest.mark.parametrize("dtype", [D64, torch.float32])
@pytest.mark.parametrize("K,d", [(1, 9), (5, 777), (12, 2049)])
def test_matches_torch_be_step(K, d, dtype):
    a = _inputs(K, d, seed=K + d, dtype=dtype)
    args = (
        a["xc"],
        a["Icur"],
        a["xc0"],
        a["U"],
        a["Ik"],
        a["theta_new"],
        a["theta_old"],
        a["inv_g"],
        a["dt"],
        a["L"],
        a["S_off"],
    )
    xt, It, lct, lit = fe.be_step(*args, solver="closed_form")
    xf, If, lcf, lif = fe.be_step(*args, solver="fused")
    tol = 1e-12 if dtype == D64 else 2e-5
    torch.testing.assert_close(xf, xt, rtol=tol, atol=tol)
    torch.testing.assert_close(If, It, rtol=tol, atol=tol)
    assert abs(lcf - lct) <= tol * 10 * max(1.0, lct) and abs(lif - lit) <= tol * 10 * max(1.0, lit)


def test_spec_u2_and_u5d():
    z, I0, U = torch.tensor([0.0], dtype=D64), torch.zeros(2, 1, dtype=D64), torch.tensor([[1.0], [3.0]], dtype=D64)
    thn, tho = fe.theta([1.0, 2.0], 1.0), fe.theta([1.0, 2.0], 0.0)
    ig = 1.0 / (1.0 + torch.tensor([0.25, 0.75], dtype=D64))  # g = 1/dt + w hbar, dt = hbar = 1
    xn, In, lte = ops.fedecado_be_step(z, I0, z, U, I0, None, thn, tho, ig, 1.0, 1.0)
    assert float(xn) == pytest.approx(299 / 434, abs=1e-14)
    torch.testing.assert_close(In[:, 0], torch.tensor([75 / 434, 224 / 434], dtype=D64), atol=1e-14, rtol=0)
    _close_lte(lte.tolist(), [299 / 868, 224 / 868], 1e-13)
    xn, In, lte = ops.fedecado_be_step(z, I0, z, U, I0, None, thn, tho, torch.zeros(2, dtype=D64), 1.0, 1.0)
    assert float(xn) == pytest.approx(5 / 6, abs=1e-14)  # U5d: ECADO limit
    torch.testing.assert_close(In[:, 0], torch.tensor([1 / 6, 2 / 3], dtype=D64), atol=1e-14, rtol=0)
    _close_lte(lte.tolist(), [5 / 12, 1 / 3], 1e-13)


# ---- out buffers, NaN, determinism ----------------------------------------------------------------
def test_out_buffers_and_determinism():
    a = _inputs(7, 5000, seed=5, dtype=torch.float32)
    x1, I1, l1 = ops.fedecado_be_step(*_args(a))
    xo, Io, lo = torch.full((5000,), 7.0), torch.full((7, 5000), 7.0), torch.zeros(2, dtype=D64)
    r = ops.fedecado_be_step(*_args(a), out=(xo, Io), lte_out=lo)
    assert r[0] is xo and r[1] is Io and r[2] is lo
    assert torch.equal(xo, x1) and torch.equal(Io, I1) and torch.equal(lo, l1)
    for _ in range(2):
        x2, I2, l2 = ops.fedecado_be_step(*_args(a))
        assert torch.equal(x2, x1) and torch.equal(I2, I1) and torch.equal(l2, l1)


def test_nan_forces_rejection():
    a = _inputs(4, 300, seed=9)
    a["U"][2, 123] = math.nan
    _, _, lte = ops.fedecado_be_step(*_args(a))
    assert math.isinf(lte[1]) and lte[1] > 0  # e_2 is NaN at column 123
    a = _inputs(4, 300, seed=9)
    a["xc"][17] = math.nan  # x' NaN -> every I' NaN -> dsum NaN
    _, _, lte = ops.fedecado_be_step(*_args(a))
    assert math.isinf(lte[0]) and math.isinf(lte[1])
    _, _, rl = reference.fedecado_be_step(*_args(a))
    assert math.isinf(rl[0]) and math.isinf(rl[1])


def test_empty_d():
    a = _inputs(3, 0, seed=1)
    xn, In, lte = ops.fedecado_be_step(*_args(a))
    assert xn.shape == (0,) and In.shape == (3, 0) and lte.tolist() == [0.0, 0.0]


# ---- opcheck and bad inputs -----------------------------------------------------------------------
@pytest.mark.parametrize("dev", DEVICES)
def test_opcheck(dev):
    def on(a):  # the [d] and [K, d] tensors on dev; theta_new, theta_old, inv_g stay host coefficients
        return {
            k: v.contiguous().to(dev)
            if isinstance(v, torch.Tensor) and k not in ("theta_new", "theta_old", "inv_g")
            else v.contiguous()
            if isinstance(v, torch.Tensor)
            else v
            for k, v in a.items()
        }

    args = _args(on(_inputs(3, 70, seed=2)))
    torch.library.opcheck(torch.ops.fedkernels.fedecado_be_step.default, args)
    a32 = _inputs(3, 70, seed=2, dtype=torch.float32, S=False)
    torch.library.opcheck(torch.ops.fedkernels.fedecado_be_step.default, _args(on(a32)))
    outs = (
        torch.empty(70, dtype=D64, device=dev),
        torch.empty(3, 70, dtype=D64, device=dev),
        torch.empty(2, dtype=D64, device=dev),
    )
    torch.library.opcheck(torch.ops.fedkernels.fedecado_be_step_out.default, args + outs)


def test_bad_inputs():
    a = _inputs(3, 20, seed=4)
    f = lambda **kw: ops.fedecado_be_step(*_args({**a, **kw}))  # noqa: E731
    with pytest.raises(ValueError, match="Icur must have shape"):
        f(Icur=torch.zeros(2, 20, dtype=D64))
    with pytest.raises(ValueError, match="Ik must have U's dtype"):
        f(Ik=a["Ik"].float())
    with pytest.raises(ValueError, match="xc must be a 1-D tensor of length 20"):
        f(xc=torch.zeros(21, dtype=D64))
    with pytest.raises(ValueError, match="S_off must have dtype"):
        f(S_off=a["S_off"].float())
    with pytest.raises(ValueError, match="U must be float32 or float64"):
        f(U=a["U"].half(), Icur=a["Icur"].half(), Ik=a["Ik"].half())
    with pytest.raises(ValueError, match="U must be a 2-D"):
        f(U=a["U"][0])
    with pytest.raises(ValueError, match="theta_new must be a 1-D sequence of length K = 3"):
        f(theta_new=torch.zeros(4, dtype=D64))
    with pytest.raises(ValueError, match="theta_old must be finite"):
        f(theta_old=torch.tensor([0.0, math.nan, 1.0], dtype=D64))
    with pytest.raises(ValueError, match="inv_g must be >= 0"):
        f(inv_g=torch.tensor([0.1, -0.1, 0.2], dtype=D64))
    with pytest.raises(ValueError, match="dt must be a finite number > 0"):
        f(dt=0.0)
    with pytest.raises(ValueError, match="L must be a finite number > 0"):
        f(L=math.inf)
    with pytest.raises(TypeError, match="U must be a torch.Tensor"):
        f(U=[[1.0] * 20] * 3)
    with pytest.raises(ValueError, match="I_out must be a contiguous"):
        ops.fedecado_be_step(*_args(a), out=(torch.empty(20, dtype=D64), torch.empty(3, 21, dtype=D64)))
    with pytest.raises(ValueError, match="xc_out must not share storage"):
        ops.fedecado_be_step(*_args(a), out=(a["xc"], torch.empty(3, 20, dtype=D64)))
    with pytest.raises(ValueError, match="I_out must not share storage"):
        ops.fedecado_be_step(*_args(a), out=(torch.empty(20, dtype=D64), a["Icur"]))
    with pytest.raises(ValueError, match="lte_out must be"):
        ops.fedecado_be_step(*_args(a), lte_out=torch.empty(2))
    # the raw op checks too (C++ errors)
    with pytest.raises(RuntimeError, match="inv_g"):
        torch.ops.fedkernels.fedecado_be_step(*_args({**a, "inv_g": torch.tensor([0.1, -1.0, 0.2], dtype=D64)}))
    with pytest.raises(RuntimeError, match="dt must be finite"):
        torch.ops.fedkernels.fedecado_be_step(*_args({**a, "dt": -1.0}))
    with pytest.raises(ValueError, match="solver='fused' needs"):
        fe.be_step(
            a["xc"],
            a["Icur"],
            a["xc0"],
            a["U"],
            a["Ik"],
            a["theta_new"],
            a["theta_old"],
            a["inv_g"],
            a["dt"],
            a["L"],
            a["S_off"],
            lte_norm="rms",
            solver="fused",
        )


# ---- wiring: central_round and the aggregator -----------------------------------------------------
def _round_inputs(K, d, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    xc0 = torch.randn(d, generator=g, dtype=D64).to(dtype)
    I = (0.3 * torch.randn(K, d, generator=g, dtype=D64)).to(dtype)
    U = (0.5 * torch.randn(K, d, generator=g, dtype=D64)).to(dtype)
    T = (torch.rand(K, generator=g, dtype=D64) * 0.5 + 0.1).tolist()
    w = (torch.rand(K, generator=g, dtype=D64) + 0.5).tolist()
    S = (0.1 * torch.randn(d, generator=g, dtype=D64)).to(dtype)
    return xc0, I, U, T, w, S


@pytest.mark.parametrize("dtype", [D64, torch.float32])
def test_central_round_fused_vs_composition(dtype, monkeypatch):
    xc0, I, U, T, w, S = _round_inputs(4, 501, seed=1, dtype=dtype)
    kw = dict(L=0.5, delta=0.02, dt_init=max(T), S_off=S)
    ref = fe.central_round(xc0, I, U, T, w, [1.0] * 4, solver="closed_form", **kw)
    calls = []
    real = ops.BEStepWindow.step
    monkeypatch.setattr(ops.BEStepWindow, "step", lambda self, *a, **k: calls.append(real(self, *a, **k)) or calls[-1])
    res = fe.central_round(xc0, I, U, T, w, [1.0] * 4, solver="auto", **kw)
    assert len(calls) == res["steps"] + res["rejects"] and res["rejects"] > 0 and res["steps"] > 2
    ids = {(id(o[0]), id(o[1])) for o in calls}
    assert len(ids) == 2  # two reused buffer pairs
    assert (res["steps"], res["rejects"], res["dt"], res["truncated"]) == (
        ref["steps"],
        ref["rejects"],
        ref["dt"],
        ref["truncated"],
    )
    tol = 1e-12 if dtype == D64 else 1e-5
    torch.testing.assert_close(res["xc"], ref["xc"], rtol=tol, atol=tol)
    torch.testing.assert_close(res["I"], ref["I"], rtol=tol, atol=tol)
    assert torch.equal(I, _round_inputs(4, 501, seed=1, dtype=dtype)[1])  # inputs untouched


def test_central_round_forced_step_fused():
    xc0, I, U, T, w, S = _round_inputs(3, 64, seed=2, dtype=D64)
    kw = dict(L=0.5, delta=1e-9, dt_init=max(T), S_off=S, max_steps=3)
    ref = fe.central_round(xc0, I, U, T, w, [1.0] * 3, solver="closed_form", **kw)
    res = fe.central_round(xc0, I, U, T, w, [1.0] * 3, **kw)
    assert res["truncated"] and (res["steps"], res["rejects"]) == (ref["steps"], ref["rejects"])
    torch.testing.assert_close(res["xc"], ref["xc"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(res["I"], ref["I"], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [D64, torch.float32])
def test_aggregator_unchanged(dtype):
    N, K, d = 6, 3, 301
    res = {}
    for solver in ("closed_form", "auto"):
        agg = build("fedecado", num_clients=N, hessian="identity", delta=0.05, L=0.5)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(d, generator=g, dtype=D64).to(dtype)
        agg.solver = solver
        infos = []
        for rnd in range(3):
            ids = [(rnd + j) % N for j in range(K)]
            U = (0.3 * torch.randn(K, d, generator=g, dtype=D64)).to(dtype)
            pl = [{"T": 0.1 + 0.05 * j} for j in range(K)]
            out = agg.aggregate(x, U, [10] * K, ids, pl)
            x = out.params
            infos.append((out.info["steps"], out.info["rejects"]))
        res[solver] = (x, agg.I.clone(), infos)
    tol = 1e-12 if dtype == D64 else 1e-5
    assert res["auto"][2] == res["closed_form"][2]
    torch.testing.assert_close(res["auto"][0], res["closed_form"][0], rtol=tol, atol=tol)
    torch.testing.assert_close(res["auto"][1], res["closed_form"][1], rtol=tol, atol=tol)


# ---- regression: fuzz case op:fedecado_be_step seed 1410940040 (column 50 of 64) --------------------------
# Huge client updates of opposite signs: x' is 1e4 below its two terms (~4e295). The op and the dense
# reference both round correctly relative to the terms, yet differ by 1e-13 of |x'|: the oracle's bound is
# relative to the magnitude of the summed terms, not to |x'| + 1 (fuzz_oracle.be_step_bounds).
FUZZ_CASE = {
    "target": "op:fedecado_be_step",
    "seed": 1410940040,
    "K": 2,
    "d": 64,
    "dtype": "fp64",
    "kind": "huge",
    "layout": "contig",
    "use_out": False,
}


def _cancelling_args():
    t = lambda *v: torch.tensor(v, dtype=D64)  # noqa: E731
    return (
        t(1.5999165775357946),
        t(0.01716414046526393, 0.011973304835373358).reshape(2, 1),
        t(-0.4670004855852071),
        t(-9.704637310295126e298, 8.613341695991379e298).reshape(2, 1),
        t(-0.010244733396060236, -0.016639666458889132).reshape(2, 1),
        t(0.0013878916732588831),
        [0.5186634636307912, 0.582027459227225],
        [0.2593317318153956, 0.2910137296136125],
        [0.46839750679329606, 0.3201046438960701],
        0.05,
        3.0,
    )


def _exact_x(args):
    """x' of the header's formula in exact rational arithmetic (inputs taken as the exact doubles)."""
    from fractions import Fraction as F

    xc, Icur, xc0, U, Ik, S, thn, tho, ig, dt, L = args
    c = F(dt) / F(L)
    a = [1 + c * F(g) for g in ig]
    r = [
        F(Icur[i, 0].item()) + c * (F(xc0[0].item()) + F(thn[i]) * F(U[i, 0].item()) + F(ig[i]) * F(Ik[i, 0].item()))
        for i in range(len(a))
    ]
    den = 1 + F(dt) * c * sum(1 / ai for ai in a)
    return float((F(xc[0].item()) + F(dt) * F(S[0].item()) + F(dt) * sum(ri / ai for ri, ai in zip(r, a))) / den)


def test_huge_cancelling_updates_within_error_bound():
    import fuzz_oracle as fuzz  # tests/fuzz_oracle.py: the campaign's checker

    args = _cancelling_args()
    got, ref = ops.fedecado_be_step(*args), reference.fedecado_be_step(*args)
    tol_x, _, _ = fuzz.be_step_bounds(args, D64)
    ex = _exact_x(args)
    assert abs(got[0].item() - ex) <= tol_x.item() and abs(ref[0].item() - ex) <= tol_x.item()
    old_bound = 64 * (2 + 2) * torch.finfo(D64).eps * (abs(ref[0].item()) + 1.0)  # relative to |x'|: rejected
    assert abs(got[0].item() - ref[0].item()) > old_bound
    fuzz.check_fedecado_be_step(args, got, ref, D64)
    assert fuzz.execute(FUZZ_CASE) == ("ok", "")
    # the bound is not vacuous: x' off by 1e-12 of its terms (4e-9 of |x'|), or one lte off by 1e-9, is caught
    bad_x = (got[0] + 1e-12 * 4.2e295, got[1], got[2])
    bad_l = (got[0], got[1], got[2] * torch.tensor([1.0, 1.0 + 1e-9], dtype=D64))
    for bad in (bad_x, bad_l):
        with pytest.raises(fuzz.Fail):
            fuzz.check_fedecado_be_step(args, bad, ref, D64)


# ---- host syncs: one device-to-host copy per attempt ----------------------------------------------
@pytest.mark.parametrize("norm", ["inf", "rms"])
def test_torch_attempt_brings_both_lte_norms_in_one_host_copy(monkeypatch, norm):
    """be_step's torch composition (a device without the fused kernel, lte_norm='rms', solver=
    'closed_form' / 'lu'): LTE_c and LTE_I come to the host together, one read of device values per
    attempt (a device-to-host sync on a GPU), with the values of reading them one by one. (The
    attempt's device values have U's dtype, float32 here; the per-client vectors are float64 host
    tensors on every device: their reads are not counted.)"""
    a = _inputs(6, 301, seed=3, dtype=torch.float32)
    args = (
        a["xc"],
        a["Icur"],
        a["xc0"],
        a["U"],
        a["Ik"],
        a["theta_new"],
        a["theta_old"],
        a["inv_g"],
        a["dt"],
        a["L"],
        a["S_off"],
    )
    reads = []
    for name in ("__float__", "item", "tolist", "cpu", "__bool__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor,
            name,
            lambda self, *x, _r=real, _n=name, **k: (
                (self.dtype == torch.float32 and reads.append(_n)) or _r(self, *x, **k)
            ),
        )
    xn, In, lc, li = fe.be_step(*args, lte_norm=norm, solver="closed_form")
    assert reads == ["tolist"], reads
    monkeypatch.undo()
    D = In - a["Icur"]
    want_c = 0.5 * a["dt"] * float(fe._norm(D.sum(0), norm))
    e = (
        a["U"] * (a["theta_new"] - a["theta_old"]).float().unsqueeze(1)
        - D * a["inv_g"].float().unsqueeze(1)
        - (xn - a["xc"]).unsqueeze(0)
    )
    assert lc == want_c
    assert abs(li - 0.5 * a["dt"] / a["L"] * float(fe._norm(e, norm).max())) <= 1e-6 * max(li, 1e-30)


def test_central_round_checks_the_window_once(monkeypatch):
    """The fused attempts of a round go through one ops.BEStepWindow (U, Ik, xc0, S_off checked once),
    each attempt a step of it: no per-attempt fedecado_be_step call (whose checks repeat for every attempt)."""
    xc0, I, U, T, w, S = _round_inputs(4, 301, seed=5, dtype=D64)
    windows, singles = [], []
    real_init = ops.BEStepWindow.__init__
    monkeypatch.setattr(
        ops.BEStepWindow, "__init__", lambda self, *a, **k: windows.append(1) or real_init(self, *a, **k)
    )
    monkeypatch.setattr(ops, "fedecado_be_step", lambda *a, **k: singles.append(1))
    res = fe.central_round(xc0, I, U, T, w, [1.0] * 4, L=0.5, delta=0.02, dt_init=max(T), S_off=S)
    assert windows == [1] and not singles and res["steps"] + res["rejects"] > 3


@cuda_only
def test_central_round_on_gpu_is_fused_with_one_sync_per_attempt():
    import warnings

    if not fedkernels_cuda():
        pytest.skip("fedkernels built without CUDA")
    xc0, I, U, T, w, S = _round_inputs(5, 4099, seed=6, dtype=D64)
    kw = dict(L=0.5, delta=0.02, dt_init=max(T))
    ref = fe.central_round(xc0, I, U, T, w, [1.0] * 5, S_off=S, **kw)
    c = lambda t: t.cuda()  # noqa: E731
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            res = fe.central_round(c(xc0), c(I), c(U), T, w, [1.0] * 5, S_off=c(S), **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(m.message) for m in rec if "synchroniz" in str(m.message).lower()]
    assert res["finite"] is True and len(syncs) <= res["steps"] + res["rejects"], syncs
    assert (res["steps"], res["rejects"]) == (ref["steps"], ref["rejects"])
    torch.testing.assert_close(res["xc"].cpu(), ref["xc"], rtol=1e-9, atol=1e-9)  # (GPU vs CPU rounding, ~16 steps)


def fedkernels_cuda():
    import fedkernels

    return bool(fedkernels.build_info().get("cuda"))


# ---- on every device (cpu, and cuda where there is one: tests/devices.py) --------------------
@pytest.mark.parametrize("dev", DEVICES)
def _be_inputs(dev, K, d, dtype, seed):
    g = gen(seed)
    rn = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    T = torch.rand(K, generator=g, dtype=torch.float64) * 1.9 + 0.1
    tl = 0.3 * float(T.max())
    dt = 0.5 * (float(T.max()) - tl)
    ig = 1.0 / (1.0 / dt + torch.rand(K, generator=g, dtype=torch.float64) * 5)
    on = lambda x: x.to(dtype).to(dev)  # noqa: E731
    return [
        on(rn(d)),
        on(rn(K, d)),
        on(rn(d)),
        on(rn(K, d)),
        on(rn(K, d)),
        on(rn(d)),
        (tl + dt) / T,
        tl / T,
        ig,
        dt,
        1.7,
    ]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
# K <= 32: registers; above: per-thread shared-memory slots; K = 500 in fp64: the recomputing pass

@pytest.mark.parametrize("K,d", [(1, 1), (3, 1000), (5, 4099), (16, 777), (32, 2049), (33, 513), (70, 300), (500, 65)])
def test_be_step_matches_reference_and_cpu(dev, K, d, dtype):
    args = _be_inputs(dev, K, d, dtype, seed=K * 31 + d)
    xn, In, lte = ops.fedecado_be_step(*args)
    assert xn.device.type == In.device.type == lte.device.type == dev and lte.dtype == torch.float64
    cpu = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    rx, rI, rl = reference.fedecado_be_step(*cpu)
    cx, cI, cl = ops.fedecado_be_step(*cpu)
    tol = 1e-11 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(xn.cpu().double(), rx, rtol=tol, atol=tol)
    torch.testing.assert_close(In.cpu().double(), rI, rtol=tol, atol=tol)
    torch.testing.assert_close(xn.cpu(), cx, rtol=tol, atol=tol)
    torch.testing.assert_close(lte.cpu(), rl, rtol=tol * 100, atol=tol * 100)
    torch.testing.assert_close(lte.cpu(), cl, rtol=tol * 100, atol=tol * 100)


@pytest.mark.parametrize("dev", DEVICES)
def test_be_step_noncontiguous_out_nan_deterministic(dev):
    K, d = 6, 3001
    args = _be_inputs(dev, K, d, torch.float32, seed=5)
    big = torch.zeros(K, d + 5, device=dev)
    big[:, 5:] = args[3]
    a2 = list(args)
    a2[3] = big[:, 5:]  # row-strided column chunk
    x1, I1, l1 = ops.fedecado_be_step(*args)
    xo, Io, lo = (
        torch.empty(d, device=dev),
        torch.empty(K, d, device=dev),
        torch.empty(2, dtype=torch.float64, device=dev),
    )
    ops.fedecado_be_step(*a2, out=(xo, Io), lte_out=lo)
    assert torch.equal(xo, x1) and torch.equal(Io, I1) and torch.equal(lo, l1)
    for _ in range(3):  # atomicMax of a max: bitwise repeatable
        x2, I2, l2 = ops.fedecado_be_step(*args)
        assert torch.equal(x2, x1) and torch.equal(I2, I1) and torch.equal(l2, l1)
    a3 = list(args)
    a3[3] = args[3].clone()
    a3[3][2, 1234] = float("nan")
    _, _, l3 = ops.fedecado_be_step(*a3)
    assert torch.isinf(l3[1]) and float(l3[1]) > 0


@pytest.mark.parametrize("dev", DEVICES)
def test_bad_args_fedecado_be_step(dev):
    args = _be_inputs(dev, 4, 333, torch.float64, seed=57)
    F = torch.ops.fedkernels

    def with_(i, v):
        a = list(args)
        a[i] = v
        return a

    one_line(
        ValueError,
        r"fedecado_be_step: Icur must have shape \[K, d\] = \[4, 333\] .*got \(3, 333\)",
        ops.fedecado_be_step,
        *with_(1, args[1][:3]),
    )
    one_line(
        ValueError,
        r"fedecado_be_step: Icur must have shape \[K, d\] = \[4, 333\] \(the shape of U\), got \(3, 333\)",
        F.fedecado_be_step,
        *with_(1, args[1][:3]),
    )
    one_line(
        ValueError,
        r"fedecado_be_step: dt must be a finite number > 0, got nan",
        ops.fedecado_be_step,
        *with_(9, float("nan")),
    )
    one_line(RuntimeError, r"fedecado_be_step: dt must be finite and > 0, got -1", F.fedecado_be_step, *with_(9, -1.0))
    one_line(
        ValueError,
        r"fedecado_be_step: xc must have dtype torch.float64 .*got torch.float32",
        ops.fedecado_be_step,
        *with_(0, args[0].float()),
    )
    if dev == DEV:
        one_line(
            ValueError,
            r"fedecado_be_step: Ik must have U's dtype torch.float64 and device cuda.*on cpu",
            ops.fedecado_be_step,
            *with_(4, args[4].cpu()),
        )
    xn, In, lte = ops.fedecado_be_step(*args)
    settle(dev)
    rx, rI, rl = reference.fedecado_be_step(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args])
    torch.testing.assert_close(xn.cpu(), rx, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(In.cpu(), rI, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(lte.cpu(), rl, rtol=1e-9, atol=1e-9)


# ---- the CUDA kernel's per-thread logic on the host (tests/host_harness.py, tests/cuda_host/fedecado_be_step.cpp) ---
@pytest.fixture(scope="module")
def harness():
    yield from host_harness.session()


def _be_case(K, d, dtype, seed, with_s=True):
    g = gen(seed)
    rn = lambda *sh: torch.randn(*sh, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    T = torch.rand(K, generator=g, dtype=torch.float64) * 1.9 + 0.1
    tl = 0.3 * float(T.max())
    dt = 0.5 * (float(T.max()) - tl)
    ig = 1.0 / (1.0 / dt + torch.rand(K, generator=g, dtype=torch.float64) * 5)
    ig[0] = 0.0  # the ECADO limit for one client
    return [rn(d), rn(K, d), rn(d), rn(K, d), rn(K, d), rn(d) if with_s else None, (tl + dt) / T, tl / T, ig, dt, 1.7]


def _be_emulate(harness, args, path, nt):
    xc, Icur, xc0, U, Ik, S, thn, tho, ig, dt, L = args
    K, d = U.shape
    c = dt / L
    ia = 1.0 / (1.0 + c * ig)
    coef = torch.cat([thn, thn - tho, ig, ia])  # what the glue uploads
    inv_den = 1.0 / (1.0 + dt * c * float(ia.sum()))
    A = 4 if U.dtype == torch.float32 else 8
    ans = harness(
        "bestep",
        A,
        path,
        nt,
        K,
        d,
        int(S is not None),
        c,
        dt,
        inv_den,
        coef,
        xc.double(),
        Icur.double(),
        xc0.double(),
        U.double(),
        Ik.double(),
        S.double() if S is not None else [],
    )
    v = torch.tensor([hexf(x) for x in ans[1:]], dtype=torch.float64)
    x, I, mc, me = v[:d], v[d : d + K * d].view(K, d), float(v[-2]), float(v[-1])
    return x.to(U.dtype), I.to(U.dtype), torch.tensor([0.5 * dt * mc, 0.5 * dt / L * me], dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("K,d", [(1, 1), (3, 7), (32, 65), (33, 300), (100, 129)])
@pytest.mark.parametrize("with_s", [True, False])
def test_be_step_paths_match_reference_and_cpu(harness, dtype, K, d, with_s):
    """Registers (K <= 32), shared-memory slots and the recomputing pass: every column once, each
    thread only its own slots, the same bits on all three paths, and the float64 reference / CPU op
    to the rounding of the arithmetic type."""
    args = _be_case(K, d, dtype, seed=K * 31 + d, with_s=with_s)
    nt = int(harness("besmem", K, 4 if dtype == torch.float32 else 8, 232448 - 1024)[0])
    assert nt >= 32
    outs = []
    for path, threads in ((0, 256), (1, nt), (1, 32), (2, 256)):
        if path == 0 and K > 32:
            continue
        outs.append(_be_emulate(harness, args, path, threads))
    for o in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(o, outs[0]))
    x, I, lte = outs[0]
    rx, rI, rl = reference.fedecado_be_step(*args)
    cx, cI, cl = torch.ops.fedkernels.fedecado_be_step(*args)
    tol = 1e-12 if dtype == torch.float64 else 3e-6 * max(1, K**0.5)
    torch.testing.assert_close(x.double(), rx, rtol=tol, atol=tol)
    torch.testing.assert_close(I.double(), rI, rtol=tol, atol=tol)
    torch.testing.assert_close(x.double(), cx.double(), rtol=tol, atol=tol)
    torch.testing.assert_close(I.double(), cI.double(), rtol=tol, atol=tol)
    torch.testing.assert_close(lte, rl, rtol=100 * tol, atol=100 * tol)
    torch.testing.assert_close(lte, cl, rtol=100 * tol, atol=100 * tol)


def test_be_step_nan_gives_infinite_lte(harness):
    args = _be_case(40, 50, torch.float32, seed=1)
    args[3] = args[3].clone()
    args[3][7, 11] = float("nan")
    _, _, lte = _be_emulate(harness, args, 1, 64)
    assert lte.tolist() == [math.inf, math.inf]
    _, _, cl = torch.ops.fedkernels.fedecado_be_step(*args)
    assert cl.tolist() == [math.inf, math.inf]


def test_be_step_smem_plan(harness):
    budget = 232448 - 1024
    # per thread 2K slots; the largest of 256..32 threads within 96 KB, else the device budget
    assert harness("besmem", 33, 4, budget) == ["256", str(2 * 33 * 4 * 256)]
    assert harness("besmem", 100, 4, budget) == ["64", str(2 * 100 * 4 * 64)]
    assert harness("besmem", 100, 8, budget) == ["32", str(2 * 100 * 8 * 32)]
    assert harness("besmem", 400, 8, budget)[0] == "32"  # 204800 bytes: beyond 96 KB, within the budget
    assert harness("besmem", 460, 8, budget) == ["0", "0"]  # recomputing pass
    assert harness("besmem", 900, 4, budget)[0] == "32" and harness("besmem", 910, 4, budget)[0] == "0"


# ---- tensor properties: checked once, by the native op, for the wrapper and a direct call alike ----
def _bad_be_cases(dev):
    """(argument index or output name, the bad value, the message after "fedecado_be_step: ") with K = 3, d = 5, fp64."""
    on = lambda t: t.to(dev)  # noqa: E731
    d64 = torch.float64
    dv = "cuda:0" if dev == DEV else "cpu"
    floats = "(float16, bfloat16, float32, float64)"
    return [
        (3, on(torch.zeros(5, dtype=d64)), "U must be a 2-D [K, d] tensor, got shape (5,)"),
        (3, on(torch.zeros(3, 5, dtype=torch.int64)), f"U must have a floating dtype {floats}, got torch.int64"),
        (3, on(torch.zeros(3, 5, dtype=torch.float16)), "U must be float32 or float64, got torch.float16"),
        (1, on(torch.zeros(2, 5, dtype=d64)), "Icur must have shape [K, d] = [3, 5] (the shape of U), got (2, 5)"),
        (4, on(torch.zeros(5, dtype=d64)), "Ik must be a 2-D [K, d] tensor, got shape (5,)"),
        (4, on(torch.zeros(3, 5, dtype=torch.bool)), f"Ik must have a floating dtype {floats}, got torch.bool"),
        (4, on(torch.zeros(3, 5)), f"Ik must have U's dtype torch.float64 and device {dv}, got torch.float32 on {dv}"),
        (0, on(torch.zeros(4, dtype=d64)), "xc must be a 1-D tensor of length 5, got shape (4,)"),
        (2, on(torch.zeros(5)), "xc0 must have dtype torch.float64 (the dtype of U), got torch.float32"),
        (5, on(torch.zeros(1, 5, dtype=d64)), "S_off must be a 1-D tensor of length 5, got shape (1, 5)"),
        (
            6,
            torch.ones(2, dtype=d64),
            "theta_new must be a 1-D sequence of length K = 3 (one per client), got shape (2,)",
        ),
        (8, torch.zeros(3, dtype=torch.int64), "inv_g must be a float tensor, got torch.int64"),
        (
            "xc_out",
            on(torch.zeros(4, dtype=d64)),
            f"xc_out must be a contiguous torch.float64 tensor of shape [5] on {dv}, got (4,) torch.float64 on {dv}",
        ),
        (
            "I_out",
            on(torch.zeros(3, 5)),
            f"I_out must be a contiguous torch.float64 tensor of shape [3, 5] on {dv}, got (3, 5) torch.float32 on {dv}",
        ),
        (
            "I_out",
            on(torch.zeros(5, 3, dtype=d64)).T,
            f"I_out must be a contiguous torch.float64 tensor of shape [3, 5] on {dv}, got (3, 5) torch.float64 on {dv}",
        ),
        ("lte", on(torch.zeros(2)), f"lte_out must be a contiguous float64 tensor of shape [2] on {dv}"),
        ("lte", on(torch.zeros(3, dtype=d64)), f"lte_out must be a contiguous float64 tensor of shape [2] on {dv}"),
    ]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", range(17))
def test_bad_tensor_args_same_from_wrapper_and_native(dev, case):
    where, bad, msg = _bad_be_cases(dev)[case]
    args = _be_inputs(dev, 3, 5, torch.float64, seed=58)
    outs = {
        "xc_out": torch.empty(5, dtype=torch.float64, device=dev),
        "I_out": torch.empty(3, 5, dtype=torch.float64, device=dev),
        "lte": torch.empty(2, dtype=torch.float64, device=dev),
    }
    if isinstance(where, int):
        args[where] = bad
    else:
        outs[where] = bad
    calls = [
        lambda: ops.fedecado_be_step(*args, out=(outs["xc_out"], outs["I_out"]), lte_out=outs["lte"]),
        lambda: torch.ops.fedkernels.fedecado_be_step_out(*args, outs["xc_out"], outs["I_out"], outs["lte"]),
    ]
    if isinstance(where, int):  # the functional op and the wrapper's own outputs
        calls += [lambda: ops.fedecado_be_step(*args), lambda: torch.ops.fedkernels.fedecado_be_step(*args)]
    for fn in calls:
        one_line(ValueError, "^" + re.escape("fedecado_be_step: " + msg) + "$", fn)
