"""gc_project_ / gc_project / gc_project_flat_: native CPU gradient centralization against the float64
reference and the GC-Fed spec §9 vectors."""

import math
import re

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from fedkernels import ops, reference as ref
from fedkernels.flat import FlatSpec
from devices import DEV, DEVICES, FLOATS, one_line, randn, settle  # tests/devices.py: every case on cpu and cuda
import host_harness  # tests/host_harness.py: the CUDA kernels' per-thread logic on the host

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# the paper models' row lengths: 27 (3x3x3 first conv), 75 (5x5x3), 576 (64x3x3), 4608 (512x3x3),
# 25088 (VGG classifier.0), plus odd and tiny ones
SHAPES = [
    (64, 3, 3, 3),
    (32, 3, 5, 5),
    (64, 64, 3, 3),
    (40, 512, 3, 3),
    (3, 25088),
    (10, 512),
    (7, 13),
    (5, 1),
    (1, 4099),
    (33, 2, 1, 3),
    (100,),
    (7,),
    (1,),
    (),
]


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _rand(shape, dtype=torch.float32, seed=0, scale=1.0, shift=0.0):
    return (torch.randn(shape, generator=_gen(seed), dtype=torch.float64) * scale + shift).to(dtype)


def _tol(dtype, x):
    """Absolute tolerance relative to the largest |x| (GC-Fed §9 T9)."""
    m = float(x.detach().abs().max()) if x.numel() else 0.0
    rel = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 1e-3}[dtype]
    return rel * max(m, 1.0)


def _check(out, x, policy="skip", min_fanin=2, expected=None):
    e = ref.gc_project([x], policy, min_fanin)[0] if expected is None else expected
    assert out.shape == x.shape and out.dtype == x.dtype
    assert_close(out.to(torch.float64), e, rtol=0, atol=_tol(x.dtype, x))


# ---- spec §9 vectors -------------------------------------------------------------------------------
def test_t1_linear():
    G = torch.tensor([[1, 2, 6], [-3, 0.5, 0.25]], dtype=torch.float64)
    ops.gc_project_([G])
    exp = torch.tensor([[-2, -1, 3], [-2.25, 1.25, 1.0]], dtype=torch.float64)
    assert_close(G, exp, rtol=0, atol=1e-12)
    # projection form G @ (I - 11^T/3)
    G0 = torch.tensor([[1, 2, 6], [-3, 0.5, 0.25]], dtype=torch.float64)
    assert_close(G, G0 @ (torch.eye(3, dtype=torch.float64) - 1 / 3), rtol=0, atol=1e-12)
    assert_close(G.sum(1), torch.zeros(2, dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_t2_conv(dtype):
    C = torch.tensor([0.5, -1, 2, 3.5, 0, 1.5, -2.5, 4, 1, 1, 1, 1, 2, 2, 2, 10], dtype=dtype).reshape(2, 2, 2, 2)
    out = ops.gc_project([C])[0]
    exp = torch.tensor(
        [[-0.5, -2, 1, 2.5, -1, 0.5, -3.5, 3], [-1.5, -1.5, -1.5, -1.5, -0.5, -0.5, -0.5, 7.5]], dtype=dtype
    )
    assert_close(out.reshape(2, 8), exp, rtol=0, atol=1e-6)


def test_t3_edge_cases():
    b = torch.tensor([1.0, 2, 3, 6])
    assert_close(ops.gc_project([b], "center")[0], torch.tensor([-2.0, -1, 0, 3]), rtol=0, atol=0)
    assert_close(ops.gc_project([b], "skip")[0], b, rtol=0, atol=0)
    lin = torch.tensor([[2.0], [5.0]])  # fan-in 1: identity with min_fanin=2, zero with min_fanin=1
    assert_close(ops.gc_project([lin])[0], lin, rtol=0, atol=0)
    assert_close(ops.gc_project([lin], min_fanin=1)[0], torch.zeros(2, 1), rtol=0, atol=0)
    dw = torch.arange(1.0, 10.0).reshape(1, 1, 3, 3)  # depthwise 1..9 -> -4..4
    assert_close(ops.gc_project([dw])[0], torch.arange(-4.0, 5.0).reshape(1, 1, 3, 3), rtol=0, atol=0)
    s = torch.tensor(7.0)  # scalars always skipped
    ops.gc_project_([s], "center", min_fanin=1)
    assert s.item() == 7.0
    one = torch.tensor([3.0])  # length-1 vector under "center": identity with min_fanin 2
    ops.gc_project_([one], "center")
    assert one.item() == 3.0


def test_t3_nan_inf_propagate():
    x = torch.tensor([[1.0, 2, 3, float("nan")], [1.0, 2, 3, 4]])
    ops.gc_project_([x])
    assert torch.isnan(x[0]).all()
    assert_close(x[1], torch.tensor([-1.5, -0.5, 0.5, 1.5]), rtol=0, atol=0)
    y = torch.tensor([1.0, float("inf"), 3])
    ops.gc_project_([y], "center")
    assert y[0] == -math.inf and math.isnan(y[1]) and y[2] == -math.inf


def test_t3_fp16_accumulates_in_fp32():
    x = torch.tensor([1000, 1001, 1001, 1001], dtype=torch.float16)
    out = ops.gc_project([x], "center")[0]
    assert torch.equal(out, torch.tensor([-0.75, 0.25, 0.25, 0.25], dtype=torch.float16))
    y = torch.tensor([[1000, 1001, 1001, 1001]], dtype=torch.bfloat16)  # bf16 spacing 4 at 1000
    exp = (y.double() - y.double().mean()).to(torch.bfloat16)
    assert torch.equal(ops.gc_project([y])[0], exp)


def test_t4_global_gc_flat():
    """Global GC on the averaged update of a Linear 2x4 + bias(2), through FlatSpec views."""
    model = nn.Linear(4, 2)
    spec = FlatSpec.from_module(model)
    w = torch.tensor([[0.5, -0.5, 1, 0], [0, 2, -1, 1]], dtype=torch.float64)
    b = torch.tensor([0.25, -0.25], dtype=torch.float64)
    dW = torch.tensor(
        [
            [[1, 0, -1, 0], [0.5, 0.5, 0.5, 0.5]],
            [[0, 2, 0, 0], [-1, 0, 1, 2]],
            [[1, -1, 3, 1], [0, 0, 0.5, 0.5]],
            [[2, 0, 2, 0], [0.5, -0.5, 0, 1]],
        ],
        dtype=torch.float64,
    )
    db = torch.tensor([[1, 0], [0.5, 0.5], [0.5, 0], [1, 0.5]], dtype=torch.float64)
    U = torch.cat([dW.reshape(4, 8), db], dim=1)  # [K, d] in the spec's order (weight, bias)
    assert spec.d == 10
    for policy, b_new in (("center", [0.5, -0.5]), ("skip", [1.0, 0.0])):
        for eta, w_new in (
            (1.0, [[0.875, -0.875, 1.375, -0.375], [-0.375, 1.625, -0.875, 1.625]]),
            (0.5, [[0.6875, -0.6875, 1.1875, -0.1875], [-0.1875, 1.8125, -0.9375, 1.3125]]),
        ):
            delta = U.mean(0)
            ptr = delta.data_ptr()
            out = ops.gc_project_flat_(delta, spec, policy)
            assert out is delta and delta.data_ptr() == ptr
            new = torch.cat([w.reshape(-1), b]) + eta * delta
            assert_close(new[:8].reshape(2, 4), torch.tensor(w_new, dtype=torch.float64), rtol=0, atol=1e-12)
            if eta == 1.0:
                assert_close(new[8:], torch.tensor(b_new, dtype=torch.float64), rtol=0, atol=1e-12)
            assert_close(new[:8].reshape(2, 4).mean(1), w.mean(1), rtol=0, atol=1e-12)
    # linearity: mean_k GC(U_k) == GC(mean_k U_k); the [K, d] form centres every row in one call
    Uk = U.clone()
    ops.gc_project_flat_(Uk, spec, "center")
    g = U.mean(0)
    ops.gc_project_flat_(g, spec, "center")
    assert_close(Uk.mean(0), g, rtol=0, atol=1e-12)


def test_t9_mixed_list_all_dtypes():
    shapes = [(32, 3, 5, 5), (64, 32, 5, 5), (512, 4096), (10, 512), (64, 3, 3, 3), (4, 1, 1, 1), (0, 8), (100,), (7,)]
    for dtype in DTYPES:
        ts = [_rand(s, dtype, seed=i) for i, s in enumerate(shapes)]
        ts.append(_rand((64, 32, 3, 3), dtype, seed=50).to(memory_format=torch.channels_last))
        ts.append(_rand((40, 30), dtype, seed=51).T)
        src = [t.clone() for t in ts]
        outs = ops.gc_project(ts, "center")
        for t, s in zip(ts, src):  # out-of-place leaves the inputs alone
            assert torch.equal(t, s)
        ops.gc_project_(ts, "center")
        for o, t, s in zip(outs, ts, src):
            _check(o, s, "center")
            assert torch.equal(o, t)  # in-place and out-of-place agree bitwise
        # idempotent and zero row sums (within rounding)
        again = ops.gc_project(ts, "center")
        for a, t in zip(again, ts):
            assert_close(a.double(), t.double(), rtol=0, atol=_tol(dtype, t) * 2)
            if t.dim() >= 2 and t.numel() and t[0].numel() >= 2:
                sums = t.double().reshape(t.size(0), -1).sum(1)
                assert sums.abs().max() <= _tol(dtype, t) * t[0].numel()


# ---- random shapes, dtypes, layouts ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("policy", ["skip", "center"])
def test_matches_reference_random(dtype, policy):
    ts = [_rand(s, dtype, seed=i, scale=3.0, shift=0.5 * i) for i, s in enumerate(SHAPES)]
    src = [t.clone() for t in ts]
    outs = ops.gc_project(ts, policy)
    ops.gc_project_(ts, policy)
    for o, t, s in zip(outs, ts, src):
        _check(o, s, policy)
        assert torch.equal(o, t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_noncontiguous_layouts(dtype):
    base = _rand((12, 10, 6, 5), dtype, seed=3)
    views = {
        "channels_last": _rand((16, 8, 3, 3), dtype, seed=4).to(memory_format=torch.channels_last),
        "transposed": _rand((30, 20), dtype, seed=5).T,
        "row_slice": _rand((20, 9), dtype, seed=6)[::3],
        "col_slice": _rand((8, 40), dtype, seed=7)[:, 5:31],
        "permuted": base.permute(1, 0, 2, 3),
        "vector_stride": _rand((50,), dtype, seed=8)[::2],
    }
    for name, v in views.items():
        for policy in ("skip", "center"):
            x = v.clone() if name == "channels_last" else v  # keep the view's strides
            keep = x.clone()
            out = ops.gc_project([x], policy)[0]
            assert torch.equal(x, keep), name
            _check(out, keep, policy)
    # in place through views: the parent tensor sees the result and nothing outside the view changes
    parent = _rand((20, 9), dtype, seed=9)
    orig = parent.clone()
    ops.gc_project_([parent[::3], parent[1::3, 2:7]])
    exp = orig.clone().double()
    exp[::3] = ref.gc_project([orig[::3]])[0]
    exp[1::3, 2:7] = ref.gc_project([orig[1::3, 2:7]])[0]
    assert_close(parent.double(), exp, rtol=0, atol=_tol(dtype, orig))
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[::3] = False
    untouched[1::3] = False
    assert torch.equal(parent[untouched], orig[untouched])
    # channels-last in place keeps its layout
    cl = _rand((16, 8, 3, 3), dtype, seed=10).to(memory_format=torch.channels_last)
    keep = cl.clone()
    ops.gc_project_([cl])
    assert cl.is_contiguous(memory_format=torch.channels_last)
    _check(cl, keep)


def test_expanded_input_out_of_place():
    x = torch.randn(1, 7).expand(5, 7)
    out = ops.gc_project([x])[0]
    _check(out, x.contiguous())


def test_flat_views_share_storage():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.GroupNorm(2, 8), nn.Flatten(), nn.Linear(8 * 4 * 4, 5))
    spec = FlatSpec.from_module(model)
    vec = _rand((spec.d,), seed=11)
    orig = vec.clone()
    views = list(spec.views(vec).values())
    ops.gc_project_(views, "center")
    exp = torch.cat([r.reshape(-1) for r in ref.gc_project(list(spec.views(orig).values()), "center")])
    assert_close(vec.double(), exp, rtol=0, atol=1e-6)
    # gc_project_flat_ with a selection: only conv/linear weights
    v2 = orig.clone()
    ops.gc_project_flat_(v2, spec, "center", select=lambda e: e.kind in ("conv", "linear"))
    for e in spec.entries:
        got, o = v2[e.slice].view(e.shape), orig[e.slice].view(e.shape)
        if e.kind in ("conv", "linear"):
            _check(got, o, "center")
        else:
            assert torch.equal(got, o)
    # [K, d]: every client row centred independently
    U = _rand((3, spec.d), seed=12)
    U0 = U.clone()
    ops.gc_project_flat_(U, spec, "skip")
    for k in range(3):
        r = U0[k].clone()
        ops.gc_project_flat_(r, spec, "skip")
        assert torch.equal(U[k], r)


def test_deterministic_across_runs_and_threads():
    ts = [_rand(s, seed=i) for i, s in enumerate([(130, 512, 3, 3), (64, 25088), (512, 4096), (64, 3, 3, 3)])]
    a = ops.gc_project(ts)
    b = ops.gc_project(ts)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        c = ops.gc_project(ts)
    finally:
        torch.set_num_threads(n)
    for x, y, z in zip(a, b, c):
        assert torch.equal(x, y) and torch.equal(x, z)


def test_large_offset_rows_accuracy():
    # rows with a large common offset: fp32 accumulation still recovers the small deviations
    x = _rand((4, 4608), torch.float32, seed=13, scale=1.0, shift=1000.0)
    out = ops.gc_project([x])[0]
    e = ref.gc_project([x])[0]
    assert (out.double() - e).abs().max() < 1e-3


# ---- regression: fuzz case op:gc_project seed 2045883929 ------------------------------------------------
# A finite fp64 row near the fp64 maximum with a finite exact mean: a plain torch mean overflows in a
# partial sum (+Inf and -Inf in two vector lanes: NaN), the op (16 lanes here) does not.
FUZZ_ROW = [
    -1.0610966488320719e308,
    1.3849307721008802e308,
    -1.0085393767552198e308,
    -6.514626792454308e307,
    5.341044000256762e307,
    1.356132276862947e308,
    -9.778413698198433e307,
    5.81750342852853e307,
]
FUZZ_CASE = {
    "target": "op:gc_project",
    "seed": 2045883929,
    "tensors": [{"shape": [8, 1, 8, 1], "dtype": "fp64", "values": "huge", "layout": "transposed"}],
    "vector_policy": "skip",
    "min_fanin": 3,
    "bad_list": None,
}


def _exact_gc(row):
    """x - mean(x) with the mean in exact rational arithmetic, each output rounded once."""
    from fractions import Fraction

    m = sum(Fraction(v) for v in row) / len(row)
    return [float(Fraction(v) - m) for v in row]


@pytest.mark.parametrize("row", [FUZZ_ROW, [1e308, 1e308, -1e308, -1e308], [-1.7e308, -1.7e308, 1.7e308, 1.7e308, 1.0]])
def test_reference_mean_of_finite_huge_rows_is_finite(row):
    exp = torch.tensor(_exact_gc(row), dtype=torch.float64)
    tol = 4 * len(row) * torch.finfo(torch.float64).eps * max(abs(v) for v in row)
    x = torch.tensor([row], dtype=torch.float64)
    for r in (ref.gc_project([x])[0][0], ref.gc_project([x[0]], "center")[0]):
        assert torch.isfinite(r).all(), r
        assert_close(r, exp, rtol=0, atol=tol)


def test_fuzz_case_huge_fp64_rows():
    import fuzz_oracle  # tests/fuzz_oracle.py: the campaign's checker

    assert fuzz_oracle.execute(FUZZ_CASE) == ("ok", "")
    # the op itself is right: no partial sum of 8 elements in 16 lanes overflows
    x = torch.tensor([FUZZ_ROW], dtype=torch.float64)
    exp = torch.tensor([_exact_gc(FUZZ_ROW)], dtype=torch.float64)
    assert_close(ops.gc_project([x])[0], exp, rtol=0, atol=4 * 8 * torch.finfo(torch.float64).eps * x.abs().max())


# ---- bad input -----------------------------------------------------------------------------------------
def test_bad_inputs():
    ops.gc_project_([])  # empty list: no-op
    assert ops.gc_project([]) == []
    with pytest.raises(ValueError, match="tensors\\[1\\].*floating"):
        ops.gc_project_([torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.int64)])
    with pytest.raises(ValueError, match="min_fanin"):
        ops.gc_project_([torch.zeros(2, 3)], min_fanin=0)
    with pytest.raises(ValueError, match="min_fanin"):
        ops.gc_project([torch.zeros(2, 3)], min_fanin=2.5)
    with pytest.raises(ValueError, match="vector_policy"):
        ops.gc_project_([torch.zeros(2, 3)], vector_policy="mean")
    with pytest.raises(TypeError, match="list or tuple"):
        ops.gc_project_(torch.zeros(2, 3))
    with pytest.raises(TypeError, match="tensors\\[0\\]"):
        ops.gc_project_([[1.0, 2.0]])
    with pytest.raises(ValueError, match="vec"):
        ops.gc_project_flat_(torch.zeros(4), FlatSpec.from_module(nn.Linear(4, 2)))
    # the native op itself also refuses bad arguments
    with pytest.raises(RuntimeError, match="min_fanin"):
        torch.ops.fedkernels.gc_project_([torch.zeros(2, 3)], "skip", 0)
    with pytest.raises(ValueError, match=r"float16, bfloat16, float32, float64\), got torch.int32"):
        torch.ops.fedkernels.gc_project([torch.zeros(2, 3, dtype=torch.int32)], "skip", 2)


# ---- opcheck -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("policy", ["skip", "center"])
def test_opcheck(dev, policy):
    def make():
        return [
            t.to(dev)
            for t in (
                torch.randn(6, 3, 3, 3),
                torch.randn(5, 7, dtype=torch.float64),
                torch.randn(9),
                torch.randn(4, 6).T,
                torch.randn(3, 8, dtype=torch.bfloat16),
            )
        ]

    torch.library.opcheck(torch.ops.fedkernels.gc_project_.default, (make(), policy, 2))
    torch.library.opcheck(torch.ops.fedkernels.gc_project.default, (make(), policy, 2))


# ---- on every device (cpu, and cuda where there is one: tests/devices.py) --------------------
GC_SHAPES = [(8, 3, 3, 3), (64, 64, 3, 3), (16, 2048), (4, 3000), (6, 25088), (10,), (5, 1), (), (0, 4)]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("policy", ["skip", "center"])
def test_gc_project_matches_reference(dev, dtype, policy):
    ts = [
        randn(dev, *s, dtype=dtype, seed=i) if len(s) else torch.tensor(1.5, dtype=dtype, device=dev)
        for i, s in enumerate(GC_SHAPES)
    ]
    ts.append(randn(dev, 32, 40, dtype=dtype, seed=99).T)  # non-contiguous: goes through a copy
    want = ref.gc_project([t.cpu() for t in ts], vector_policy=policy)
    out = ops.gc_project(ts, vector_policy=policy)
    work = [t.clone() for t in ts]
    ops.gc_project_(work, vector_policy=policy)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    for o, w, r in zip(out, work, want):
        torch.testing.assert_close(o.cpu().double(), r.double(), rtol=tol, atol=tol)
        torch.testing.assert_close(w.cpu().double(), r.double(), rtol=tol, atol=tol)
    cpu = ops.gc_project([t.cpu() for t in ts], vector_policy=policy)
    for o, c in zip(out, cpu):
        torch.testing.assert_close(o.cpu().double(), c.double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dev", DEVICES)
def test_gc_project_deterministic(dev):
    t = randn(dev, 256, 4608, seed=1)
    a, b = ops.gc_project([t])[0], ops.gc_project([t])[0]
    assert torch.equal(a, b)


@pytest.mark.parametrize("dev", DEVICES)
def test_bad_args_gc_project(dev):
    ts = [randn(dev, 8, 3, 3, 3, seed=55), randn(dev, 8, seed=56)]
    F = torch.ops.fedkernels
    one_line(ValueError, r"gc_project_: min_fanin must be an int >= 1, got 0", ops.gc_project_, ts, min_fanin=0)
    one_line(RuntimeError, r"gc_project_: min_fanin must be an int >= 1, got -7", F.gc_project_, ts, "skip", -7)
    one_line(
        ValueError,
        r"gc_project_: tensors\[1\] must have a floating dtype .*got torch.int64",
        ops.gc_project_,
        [ts[0], torch.zeros(4, 3, dtype=torch.long, device=dev)],
    )
    one_line(
        ValueError,
        r"gc_project_: vector_policy must be 'skip' or 'center', got 'mean'",
        ops.gc_project_,
        ts,
        vector_policy="mean",
    )
    if dev == DEV:
        one_line(
            ValueError,
            r"gc_project_: all tensors must be on one device; tensors\[0\] is on cuda",
            ops.gc_project_,
            [ts[0], torch.zeros(4, 3)],
        )
    want = ref.gc_project([t.cpu() for t in ts], vector_policy="center")
    ops.gc_project_(ts, vector_policy="center")
    settle(dev)
    for t, r in zip(ts, want):
        torch.testing.assert_close(t.cpu().double(), r.double(), rtol=1e-5, atol=1e-5)


# ---- the CUDA kernel's per-thread logic on the host (tests/host_harness.py, tests/cuda_host/gc_project.cpp) --------
@pytest.fixture(scope="module")
def harness():
    yield from host_harness.session()


def test_gc_plan_covers_every_row_once(harness):
    # rows, cols of a ResNet-like list plus edge cases: one row, exactly the path limits, empty tensors
    shapes = [
        (64, 147),
        (0, 5),
        (64, 576),
        (128, 1152),
        (1, 10),
        (512, 4608),
        (3, 1024),
        (2, 1025),
        (5, 8192),
        (4, 8193),
        (100, 512),
        (0, 0),
        (65, 3),
        (1, 100000),
    ]
    ans = harness("gcplan", len(shapes), [r for r, _ in shapes], [c for _, c in shapes])
    items = int(ans[0])
    per = [tuple(int(x) for x in a.split(":")) for a in ans[1:]]
    want_items = 0
    for (rows, cols), (path, lo, hi) in zip(shapes, per):
        want_path = 0 if cols <= 1024 else (1 if cols <= 8192 else 2)
        assert path == want_path, (rows, cols)
        assert lo == hi == 1, (rows, cols)  # every row exactly once
        if rows and cols:
            want_items += -(-rows // 64) if path == 0 else rows
    assert items == want_items


# ---- tensor properties: checked once, by the native op, for the wrapper and a direct call alike ----
def _bad_gc_cases(dev):
    """(tensors, the message after "<op>: ")."""
    x = randn(dev, 4, 3, seed=5)
    floats = "must have a floating dtype (float16, bfloat16, float32, float64), got"
    cases = [
        ([x, torch.zeros(4, 3, dtype=torch.long, device=dev)], f"tensors[1] {floats} torch.int64"),
        ([torch.zeros(3, dtype=torch.int32, device=dev)], f"tensors[0] {floats} torch.int32"),
        ([x, torch.zeros(2, 2, dtype=torch.bool, device=dev), x], f"tensors[1] {floats} torch.bool"),
        ([x, torch.zeros(2, dtype=torch.complex64, device=dev)], f"tensors[1] {floats} torch.complex64"),
        ([x, x.T, torch.zeros(4, 3, dtype=torch.uint8, device=dev)[:, ::2]], f"tensors[2] {floats} torch.uint8"),
    ]
    if dev == DEV:
        cases.append(
            ([x, torch.zeros(4, 3)], "all tensors must be on one device; tensors[0] is on cuda:0, tensors[1] on cpu")
        )
    return cases


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", range(6))
@pytest.mark.parametrize("op", ["gc_project_", "gc_project"])
def test_bad_tensor_args_same_from_wrapper_and_native(dev, case, op):
    cases = _bad_gc_cases(dev)
    if case >= len(cases):
        pytest.skip("a device mismatch needs a second device")
    tensors, msg = cases[case]
    native = getattr(torch.ops.fedkernels, op)
    for fn in (lambda: getattr(ops, op)(tensors), lambda: native(tensors, "skip", 2)):
        one_line(ValueError, "^" + re.escape(f"{op}: {msg}") + "$", fn)
