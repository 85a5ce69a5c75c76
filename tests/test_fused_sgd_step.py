"""fused_sgd_step_ / corrected_sgd_step_ / gc_sgd_step_: the fused local steps against the float64
reference, torch.optim.SGD, and the GC-Fed spec §9 T5/T6 vectors."""

import re

import pytest
import torch
from torch.testing import assert_close

from fedkernels import ops, reference as ref
from devices import DEV, DEVICES, gen, one_line, randn, settle  # tests/devices.py: every case on cpu and cuda

SHAPES = [
    (64, 3, 3, 3),
    (32, 3, 5, 5),
    (16, 64, 3, 3),
    (6, 512, 3, 3),
    (2, 25088),
    (10, 512),
    (7, 13),
    (5, 1),
    (100,),
    (7,),
    (1,),
    (),
]


def _rand(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _set(dtype, seed):
    return [_rand(s, dtype, seed * 100 + i) for i, s in enumerate(SHAPES)]


def _tol(dtype):
    return {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]


def _clone(xs):
    return [None if x is None else x.clone() for x in xs]


# ---- spec §9 vectors ---------------------------------------------------------------------------------
def test_t5_code_order_step():
    w = torch.tensor([[1.0, 2, 3]], dtype=torch.float64)
    g = torch.tensor([[0.3, 0.6, 0.9]], dtype=torch.float64)
    g0 = g.clone()
    ops.gc_sgd_step_([w], [g], lr=0.1, weight_decay=0.1)
    assert_close(w, torch.tensor([[1.02, 1.98, 2.94]], dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.equal(g, g0)  # the gradient is read, not modified
    assert abs(float(w.mean()) - 1.98) < 1e-12


def test_t6_momentum_two_steps():
    w = torch.tensor([[1.0, 2, 3]], dtype=torch.float64)
    buf = torch.full_like(w, 123.0)  # ignored on the first step
    ops.gc_sgd_step_(
        [w], [torch.tensor([[0.3, 0.6, 0.9]], dtype=torch.float64)], [buf], lr=0.1, momentum=0.9, first_step=True
    )
    assert_close(buf, torch.tensor([[-0.3, 0, 0.3]], dtype=torch.float64), rtol=0, atol=1e-12)
    assert_close(w, torch.tensor([[1.03, 2.0, 2.97]], dtype=torch.float64), rtol=0, atol=1e-12)
    ops.gc_sgd_step_([w], [torch.tensor([[1.0, -1, 0]], dtype=torch.float64)], [buf], lr=0.1, momentum=0.9)
    assert_close(buf, torch.tensor([[0.73, -1, 0.27]], dtype=torch.float64), rtol=0, atol=1e-12)
    assert_close(w, torch.tensor([[0.957, 2.1, 2.943]], dtype=torch.float64), rtol=0, atol=1e-12)
    assert abs(float(w.mean()) - 2.0) < 1e-12


# ---- against the float64 reference --------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("momentum,first", [(0.0, False), (0.9, True), (0.9, False)])
@pytest.mark.parametrize("policy", ["skip", "center"])
def test_matches_reference(dtype, momentum, first, policy):
    n = len(SHAPES)
    P, G, B, C, Ci = (_set(dtype, s) for s in range(5))
    mask = [i % 3 != 1 for i in range(n)]
    c_add = [c if i % 2 == 0 else None for i, c in enumerate(C)]
    c_sub = [c if i % 4 != 3 else None for i, c in enumerate(Ci)]
    kw = dict(
        lr=0.05,
        momentum=momentum,
        weight_decay=1e-2,
        first_step=first,
        c_add=c_add,
        c_sub=c_sub,
        gc_mask=mask,
        vector_policy=policy,
    )
    P2, B2, G0 = _clone(P), _clone(B), _clone(G)
    ops.fused_sgd_step_(P, G, B, **kw)
    P64 = [p.double() for p in P2]
    B64 = [b.double() for b in B2]
    ref.fused_sgd_step_(
        P64,
        [g.double() for g in G],
        B64,
        **{
            **kw,
            "c_add": [None if c is None else c.double() for c in c_add],
            "c_sub": [None if c is None else c.double() for c in c_sub],
        },
    )
    tol = _tol(dtype)
    for i in range(n):
        assert torch.equal(G[i], G0[i])
        scale = max(1.0, float(P64[i].abs().max()) if P64[i].numel() else 1.0)
        assert_close(P[i].double(), P64[i], rtol=0, atol=tol * scale * 4)
        if momentum:
            bscale = max(1.0, float(B64[i].abs().max()) if B64[i].numel() else 1.0)
            assert_close(B[i].double(), B64[i], rtol=0, atol=tol * bscale * 4)
        else:
            assert torch.equal(B[i], B2[i])  # no momentum: buffers untouched


def test_gc_step_equals_gc_then_torch_sgd():
    """Spec §9 T9: the fused op equals gc_project_ followed by torch.optim.SGD.step (3 steps)."""
    shapes = [(32, 3, 5, 5), (32,), (64, 32, 5, 5), (512, 256), (10, 512), (10,)]
    P = [torch.nn.Parameter(_rand(s, seed=i)) for i, s in enumerate(shapes)]
    Q = [p.detach().clone() for p in P]
    bufs = [torch.zeros_like(q) for q in Q]
    opt = torch.optim.SGD(P, lr=0.01, momentum=0.9, weight_decay=1e-5)
    for step in range(3):
        grads = [_rand(s, seed=1000 * (step + 1) + i) for i, s in enumerate(shapes)]
        for p, g in zip(P, grads):
            p.grad = g.clone()
        ops.gc_project_([p.grad for p in P], "center")
        opt.step()
        ops.gc_sgd_step_(
            Q, grads, bufs, lr=0.01, momentum=0.9, weight_decay=1e-5, first_step=step == 0, vector_policy="center"
        )
        for p, q in zip(P, Q):
            assert_close(q, p.detach(), rtol=1e-6, atol=1e-6)
    for p, b in zip(P, bufs):
        assert_close(b, opt.state[p]["momentum_buffer"], rtol=1e-6, atol=1e-6)


def test_corrected_step_equals_torch_sgd_on_corrected_grad():
    shapes = [(16, 3, 3, 3), (16,), (10, 64), (10,)]
    P = [torch.nn.Parameter(_rand(s, seed=i)) for i, s in enumerate(shapes)]
    Q = [p.detach().clone() for p in P]
    bufs = [torch.zeros_like(q) for q in Q]
    c = [_rand(s, seed=50 + i) for i, s in enumerate(shapes)]
    ci = [_rand(s, seed=60 + i) for i, s in enumerate(shapes)]
    opt = torch.optim.SGD(P, lr=0.02, momentum=0.9, weight_decay=1e-4)
    subset = [2, 3]  # FedPVR: only the classifier is corrected
    for step in range(3):
        grads = [_rand(s, seed=500 * (step + 1) + i) for i, s in enumerate(shapes)]
        for i, (p, g) in enumerate(zip(P, grads)):
            p.grad = g - ci[i] + c[i] if i in subset else g.clone()
        opt.step()
        ops.corrected_sgd_step_(
            Q, grads, c, ci, bufs, lr=0.02, momentum=0.9, weight_decay=1e-4, first_step=step == 0, subset=subset
        )
        for p, q in zip(P, Q):
            assert_close(q, p.detach(), rtol=1e-6, atol=1e-6)


def test_corrected_step_forms_agree():
    """c, c_i read separately == precomputed c - c_i (fp64), full set and bool subset; no momentum."""
    P, G, C, Ci = (_set(torch.float64, s) for s in range(4))
    n = len(P)
    A, Bp = _clone(P), _clone(P)
    ops.corrected_sgd_step_(A, G, C, Ci, lr=0.1)
    ops.corrected_sgd_step_(Bp, G, [c - ci for c, ci in zip(C, Ci)], lr=0.1)
    for a, b, p, g, c, ci in zip(A, Bp, P, G, C, Ci):
        assert_close(a, b, rtol=0, atol=1e-12)
        assert_close(a, p - 0.1 * (g - ci + c), rtol=0, atol=1e-12)
    mask = [i % 2 == 0 for i in range(n)]
    D = _clone(P)
    ops.corrected_sgd_step_(D, G, [c if m else None for c, m in zip(C, mask)], Ci, lr=0.1, subset=mask)
    for d, p, g, c, ci, m in zip(D, P, G, C, Ci, mask):
        assert_close(d, p - 0.1 * ((g - ci + c) if m else g), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_noncontiguous_tensors(dtype):
    base = [_rand((24, 18), dtype, seed=i) for i in range(5)]
    P = [base[0].T, _rand((20, 9, 3), dtype, seed=7)[::2]]  # transposed, sliced
    G = [base[1].T, _rand((10, 9, 3), dtype, seed=8)]  # non-contiguous grad too
    B = [base[2].T, _rand((10, 9, 3), dtype, seed=9).permute(1, 0, 2).contiguous().permute(1, 0, 2)]
    C = [base[3].T, None]
    P2, B2 = [p.clone() for p in P], [b.clone() for b in B]
    parent = base[0].clone()
    kw = dict(lr=0.1, momentum=0.9, weight_decay=0.01, c_add=C, gc_mask=[True, True], vector_policy="skip")
    ops.fused_sgd_step_(P, G, B, **kw)
    P64, B64 = [p.double() for p in P2], [b.double() for b in B2]
    ref.fused_sgd_step_(P64, [g.double() for g in G], B64, **{**kw, "c_add": [C[0].double(), None]})
    for p, e in zip(P + B, P64 + B64):
        assert_close(p.double(), e, rtol=0, atol=_tol(dtype) * max(1.0, float(e.abs().max())) * 4)
    assert not torch.equal(base[0], parent)  # the transposed view wrote through to its base


def test_deterministic_across_threads():
    P, G, B = (_set(torch.float32, s) for s in range(3))
    outs = []
    n_threads = torch.get_num_threads()
    try:
        for th in (n_threads, 1, n_threads):
            torch.set_num_threads(th)
            p, b = _clone(P), _clone(B)
            ops.gc_sgd_step_(p, G, b, lr=0.01, momentum=0.9, weight_decay=1e-5)
            outs.append(p + b)
    finally:
        torch.set_num_threads(n_threads)
    for o in outs[1:]:
        for x, y in zip(outs[0], o):
            assert torch.equal(x, y)


def test_empty_and_mask_forms():
    assert ops.fused_sgd_step_([], [], lr=0.1) == []
    p, g = _rand((4, 5), seed=1), _rand((4, 5), seed=2)
    q = p.clone()
    ops.gc_sgd_step_([p], [g], lr=0.5, gc_mask=False)  # plain SGD
    assert_close(p, q - 0.5 * g, rtol=0, atol=1e-6)
    r = q.clone()
    ops.fused_sgd_step_([r], [g], lr=0.5, gc_mask=[True])
    assert_close(r, q - 0.5 * (g - g.mean(1, keepdim=True)), rtol=0, atol=1e-6)


def test_bad_inputs():
    p, g = torch.zeros(3, 4), torch.zeros(3, 4)
    with pytest.raises(ValueError, match="grads\\[0\\]"):
        ops.fused_sgd_step_([p], [torch.zeros(4, 3)], lr=0.1)
    with pytest.raises(ValueError, match="grads\\[0\\]"):
        ops.fused_sgd_step_([p], [g.double()], lr=0.1)
    with pytest.raises(ValueError, match="one entry per parameter"):
        ops.fused_sgd_step_([p], [g, g], lr=0.1)
    with pytest.raises(ValueError, match="momentum_bufs"):
        ops.fused_sgd_step_([p], [g], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="lr"):
        ops.fused_sgd_step_([p], [g], lr=float("nan"))
    with pytest.raises(ValueError, match="momentum"):
        ops.fused_sgd_step_([p], [g], [g.clone()], lr=0.1, momentum=-0.5)
    with pytest.raises(ValueError, match="params\\[0\\]"):
        ops.fused_sgd_step_([torch.zeros(3, dtype=torch.int64)], [torch.zeros(3, dtype=torch.int64)], lr=0.1)
    with pytest.raises(ValueError, match="c_add\\[0\\]"):
        ops.fused_sgd_step_([p], [g], lr=0.1, c_add=[torch.zeros(2)])
    with pytest.raises(ValueError, match="gc_mask"):
        ops.fused_sgd_step_([p], [g], lr=0.1, gc_mask=[True, False])
    with pytest.raises(ValueError, match="vector_policy"):
        ops.fused_sgd_step_([p], [g], lr=0.1, gc_mask=True, vector_policy="all")
    with pytest.raises(ValueError, match="min_fanin"):
        ops.gc_sgd_step_([p], [g], lr=0.1, min_fanin=0)
    with pytest.raises(ValueError, match="subset"):
        ops.corrected_sgd_step_([p], [g], [g], lr=0.1, subset=[3])
    with pytest.raises(ValueError, match="None for a parameter"):
        ops.corrected_sgd_step_([p], [g], [None], lr=0.1)
    with pytest.raises(ValueError, match="momentum_bufs"):  # the native op checks too
        torch.ops.fedkernels.fused_sgd_step_([p], [g], [], [], [], [], 0.1, 0.9, 0.0, False, "skip", 2)


@pytest.mark.parametrize("dev", DEVICES)
def test_opcheck(dev):
    def args():
        P = [t.to(dev) for t in (torch.randn(6, 3, 3, 3), torch.randn(5, dtype=torch.float64), torch.randn(4, 7))]
        G = [torch.randn_like(x) for x in P]
        B = [torch.randn_like(x) for x in P]
        C = [torch.randn_like(P[0]), None, torch.randn_like(P[2])]
        Ci = [None, torch.randn_like(P[1]), torch.randn_like(P[2])]
        return (P, G, B, C, Ci, [True, True, False], 0.1, 0.9, 1e-4, False, "center", 2)

    torch.library.opcheck(torch.ops.fedkernels.fused_sgd_step_.default, args())


# ---- on every device (cpu, and cuda where there is one: tests/devices.py) --------------------
@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("momentum,first", [(0.0, False), (0.9, True), (0.9, False)])
def test_fused_sgd_step_every_device_matches_cpu(dev, momentum, first):
    shapes = [(8, 3, 3, 3), (8,), (10, 72), (5,)]
    mk = lambda s: [torch.randn(*sh, generator=gen(s + i), dtype=torch.float64).float() for i, sh in enumerate(shapes)]  # noqa: E731
    p, g, buf, c, ci = mk(1), mk(10), mk(20), mk(30), mk(40)
    pd, gd, bd, cd, cid = ([t.to(dev, copy=True) for t in x] for x in (p, g, buf, c, ci))
    mask = [True, False, True, True]
    cadd = [c[0], None, c[2], None]
    args = (0.1, momentum, 1e-3, first, "center", 2)
    torch.ops.fedkernels.fused_sgd_step_(p, g, buf if momentum else [], cadd, ci, mask, *args)
    torch.ops.fedkernels.fused_sgd_step_(pd, gd, bd if momentum else [], [cd[0], None, cd[2], None], cid, mask, *args)
    for x, y in zip(pd + (bd if momentum else []), p + (buf if momentum else [])):
        torch.testing.assert_close(x.cpu(), y, rtol=1e-5, atol=1e-6)
    for x, y in zip(gd, g):
        assert torch.equal(x.cpu(), y)  # grads untouched


@pytest.mark.parametrize("dev", DEVICES)
def test_bad_args_fused_sgd_step(dev):
    shapes = [(6, 2, 3), (6,), (4, 9)]
    p = [randn(dev, *s, seed=60 + i) for i, s in enumerate(shapes)]
    g = [randn(dev, *s, seed=70 + i) for i, s in enumerate(shapes)]
    buf = [randn(dev, *s, seed=80 + i) for i, s in enumerate(shapes)]
    F = torch.ops.fedkernels
    one_line(
        ValueError,
        r"fused_sgd_step_: momentum must be >= 0, got -0.5",
        ops.fused_sgd_step_,
        p,
        g,
        buf,
        lr=0.1,
        momentum=-0.5,
    )
    one_line(
        ValueError,
        r"fused_sgd_step_: gc_mask must have one entry per parameter \(3\), got 2",
        ops.fused_sgd_step_,
        p,
        g,
        lr=0.1,
        gc_mask=[True, False],
    )
    one_line(
        ValueError, r"fused_sgd_step_: lr must be a finite number, got nan", ops.fused_sgd_step_, p, g, lr=float("nan")
    )
    one_line(
        ValueError,
        r"fused_sgd_step_: grads must have one entry per parameter \(3\), got 2",
        F.fused_sgd_step_,
        p,
        g[:2],
        [],
        [],
        [],
        [],
        0.1,
        0.0,
        0.0,
        False,
        "skip",
        2,
    )
    one_line(
        ValueError,
        r"fused_sgd_step_: grads\[2\] must match params\[2\] \(shape \(4, 9\), torch.float32, \w+(:0)?\), "
        r"got shape \(9, 4\), torch.float32",
        F.fused_sgd_step_,
        p,
        g[:2] + [g[2].T.contiguous()],
        [],
        [],
        [],
        [],
        0.1,
        0.0,
        0.0,
        False,
        "skip",
        2,
    )
    if dev == DEV:
        one_line(
            ValueError, r"fused_sgd_step_: grads\[1\].*cpu", ops.fused_sgd_step_, p, [g[0], g[1].cpu(), g[2]], lr=0.1
        )
    rp, rb = [t.cpu().clone() for t in p], [t.cpu().clone() for t in buf]
    ref.fused_sgd_step_(
        rp,
        [t.cpu() for t in g],
        rb,
        lr=0.1,
        momentum=0.9,
        weight_decay=1e-3,
        gc_mask=[True, False, True],
        vector_policy="center",
    )
    ops.fused_sgd_step_(
        p, g, buf, lr=0.1, momentum=0.9, weight_decay=1e-3, gc_mask=[True, False, True], vector_policy="center"
    )
    settle(dev)
    for x, y in zip(p + buf, rp + rb):
        torch.testing.assert_close(x.cpu().double(), y.double(), rtol=1e-5, atol=1e-6)


# ---- tensor properties: checked once, by the native op, for the wrapper and a direct call alike ----
def _native_step(p, g, bufs=(), c_add=(), c_sub=(), momentum=0.0):
    return lambda: torch.ops.fedkernels.fused_sgd_step_(
        list(p), list(g), list(bufs), list(c_add), list(c_sub), [], 0.1, momentum, 0.0, False, "skip", 2
    )


def _wrapped_step(p, g, bufs=None, c_add=None, c_sub=None, momentum=0.0):
    return lambda: ops.fused_sgd_step_(p, g, bufs, lr=0.1, momentum=momentum, c_add=c_add, c_sub=c_sub)


def _bad_step_cases(dev):
    """(name, wrapper/native keyword arguments, the whole message) with params of shapes (4, 9), (5,)."""
    p = [randn(dev, 4, 9, seed=1), randn(dev, 5, seed=2)]
    g = [randn(dev, 4, 9, seed=3), randn(dev, 5, seed=4)]
    d = "cuda:0" if dev == DEV else "cpu"
    like = f"must match params[1] (shape (5,), torch.float32, {d}), got shape"
    return [
        ("grads dtype", dict(p=p, g=[g[0], g[1].double()]), f"grads[1] {like} (5,), torch.float64, {d}"),
        ("grads shape", dict(p=p, g=[g[0], g[0][0]]), f"grads[1] {like} (9,), torch.float32, {d}"),
        ("grads int", dict(p=p, g=[g[0], g[1].long()]), f"grads[1] {like} (5,), torch.int64, {d}"),
        ("grads length", dict(p=p, g=g[:1]), "grads must have one entry per parameter (2), got 1"),
        ("grads with no params", dict(p=[], g=g[:1]), "grads must have one entry per parameter (0), got 1"),
        (
            "params int",
            dict(p=[p[0], p[1].int()], g=g),
            "params[1] must have a floating dtype (float16, bfloat16, float32, float64), got torch.int32",
        ),
        (
            "momentum_bufs length",
            dict(p=p, g=g, bufs=[g[0]], momentum=0.9),
            "momentum_bufs must have one entry per parameter (2), got 1",
        ),
        (
            "momentum_bufs dtype",
            dict(p=p, g=g, bufs=[g[0], g[1].half()], momentum=0.9),
            f"momentum_bufs[1] {like} (5,), torch.float16, {d}",
        ),
        ("c_add shape", dict(p=p, g=g, c_add=[None, g[0]]), f"c_add[1] {like} (4, 9), torch.float32, {d}"),
        ("c_sub length", dict(p=p, g=g, c_sub=[g[0]]), "c_sub must have one entry per parameter (2), got 1"),
    ]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", range(10))
def test_bad_tensor_args_same_from_wrapper_and_native(dev, case):
    name, kw, msg = _bad_step_cases(dev)[case]
    for fn in (_wrapped_step(**kw), _native_step(**{k: v for k, v in kw.items() if v is not None})):
        one_line(ValueError, "^" + re.escape("fused_sgd_step_: " + msg) + "$", fn)


def test_the_native_step_refuses_non_contiguous_tensors():
    """The wrapper copies them (and writes params and buffers back); a direct call must pass contiguous ones."""
    p, g = torch.randn(4, 6), torch.randn(6, 4).T
    one_line(
        ValueError,
        r"^fused_sgd_step_: grads\[0\] must be contiguous \(the fedkernels.ops wrapper copies it once\)$",
        _native_step([p], [g]),
    )
    want = p.clone()
    _native_step([want], [g.contiguous()])()
    ops.fused_sgd_step_([p], [g], lr=0.1)
    assert torch.equal(p, want)  # the same kernel on the same values
