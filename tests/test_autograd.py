"""Derivatives of the ops: gradcheck in float64 of weighted_sum (coef, U, base),
gram (U) and gc_project; opcheck with its autograd checks; torch.func.grad; and a clear error on
backward through every op without a derivative (never silent zeros / None)."""

import pytest
import torch
from torch.autograd import gradcheck

from fedkernels import ops

D64 = torch.float64


def _leaf(*shape, noncontig=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    if noncontig:  # every other column of a wider matrix: unit stride lost, copied by the wrapper
        x = torch.randn(*shape[:-1], 2 * shape[-1], generator=g, dtype=D64)[..., ::2]
    else:
        x = torch.randn(*shape, generator=g, dtype=D64)
    return x.detach().requires_grad_() if not noncontig else x.requires_grad_()


@pytest.mark.parametrize("K,d", [(1, 1), (3, 7), (5, 33), (8, 129)])
@pytest.mark.parametrize("noncontig", [False, True])
def test_weighted_sum_gradcheck(K, d, noncontig):
    U = _leaf(K, d, noncontig=noncontig, seed=K)
    c = _leaf(K, seed=K + 1)
    b = _leaf(d, seed=K + 2)
    assert gradcheck(lambda U, c, b: ops.weighted_sum(U, c, base=b, alpha=-0.7), (U, c, b))
    assert gradcheck(lambda U, c: ops.weighted_sum(U, c), (U, c))


def test_weighted_sum_gradcheck_with_rows_repeated():
    U, c = _leaf(6, 11), _leaf(4, seed=3)
    rows = [5, 0, 5, 2]
    assert gradcheck(lambda U, c: ops.weighted_sum(U, c, alpha=1.3, rows=rows), (U, c))


def test_weighted_sum_coef_gradient_matches_the_formula():
    # d/dcoef_i of sum(out^2) = 2 alpha <U_i, out>; torch.func.grad agrees with backward()
    U = torch.randn(4, 9, dtype=D64)
    c = torch.rand(4, dtype=D64, requires_grad=True)
    out = ops.weighted_sum(U, c, alpha=0.5)
    (out**2).sum().backward()
    want = 2 * 0.5 * (U @ out.detach())
    torch.testing.assert_close(c.grad, want, rtol=1e-13, atol=1e-13)
    fg = torch.func.grad(lambda c: (ops.weighted_sum(U, c, alpha=0.5) ** 2).sum())(c.detach())
    torch.testing.assert_close(fg, want, rtol=1e-13, atol=1e-13)
    assert fg.abs().sum() > 0


def test_weighted_sum_fp32_update_matrix_with_fp64_coef_gradient():
    U = torch.randn(3, 20, requires_grad=True)
    c = torch.rand(3, dtype=D64, requires_grad=True)
    ops.weighted_sum(U, c).sum().backward()
    assert U.grad.dtype == torch.float32 and c.grad.dtype == D64
    torch.testing.assert_close(c.grad, U.detach().double().sum(1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("K,d", [(1, 1), (3, 7), (6, 31)])
@pytest.mark.parametrize("noncontig", [False, True])
def test_gram_gradcheck(K, d, noncontig):
    U = _leaf(K, d, noncontig=noncontig, seed=10 + K)
    assert gradcheck(lambda U: ops.gram(U), (U,))
    if K > 1:
        assert gradcheck(lambda U: ops.gram(U, rows=[K - 1, 0, K - 1]), (U,))


def test_gc_project_gradcheck():
    W = _leaf(4, 3, 2, seed=1)  # conv-like: rows of 6
    L = _leaf(5, 7, seed=2)
    b = _leaf(5, seed=3)
    for policy in ("skip", "center"):
        assert gradcheck(lambda W, L, b: tuple(ops.gc_project([W, L, b], policy)), (W, L, b))
    assert gradcheck(lambda L: ops.gc_project([L], min_fanin=8)[0], (L,))  # rows too short: identity
    Lt = _leaf(7, 5, seed=4).T  # non-contiguous
    assert gradcheck(lambda Lt: ops.gc_project([Lt])[0], (Lt,))


def test_opcheck_with_autograd():
    U = _leaf(5, 13, seed=5)
    c = _leaf(5, seed=6)
    b = _leaf(13, seed=7)
    torch.library.opcheck(torch.ops.fedkernels.weighted_sum.default, (U, c, b, 0.5, None))
    torch.library.opcheck(
        torch.ops.fedkernels.weighted_sum.default, (U, c[:2].detach().requires_grad_(), None, 1.0, torch.tensor([4, 0]))
    )
    torch.library.opcheck(torch.ops.fedkernels.gram.default, (U, None))
    torch.library.opcheck(torch.ops.fedkernels.gram.default, (U, torch.tensor([1, 3])))
    torch.library.opcheck(torch.ops.fedkernels.gc_project.default, ([U, b], "center", 2))
    torch.library.opcheck(torch.ops.fedkernels.gc_project.default, ([U, b],))


def _spd(n):
    A = torch.randn(n, n, dtype=D64)
    return A @ A.T + n * torch.eye(n, dtype=D64)


@pytest.mark.parametrize("name", ["min_norm", "lu_factor", "lu_factor_ex", "lu_solve", "arrowhead_solve"])
def test_backward_through_an_op_without_derivative_raises(name):
    if name == "min_norm":
        G = _spd(4).requires_grad_()
        out = ops.min_norm(G)[0]
    elif name in ("lu_factor", "lu_factor_ex"):
        A = _spd(4).requires_grad_()
        out = getattr(ops, name)(A)[0]
        name = "lu_factor"
    elif name == "lu_solve":
        LU, piv = ops.lu_factor(_spd(4))
        R = torch.randn(4, 3, dtype=D64, requires_grad=True)
        out = ops.lu_solve(LU, piv, R)
    else:
        a = (torch.rand(3, dtype=D64) + 1).requires_grad_()  # only a coefficient requires grad
        out = ops.arrowhead_solve(a, -0.1, 0.1, 1.0, torch.randn(5, dtype=D64), torch.randn(3, 5, dtype=D64))[1]
    assert out.requires_grad
    with pytest.raises(RuntimeError, match=f"fedkernels.{name} has no derivative"):
        out.sum().backward()
    if name == "min_norm":
        with pytest.raises(RuntimeError, match="fedkernels.min_norm has no derivative"):
            torch.func.grad(lambda G: ops.min_norm(G)[0].sum())(_spd(3))


@pytest.mark.parametrize("name", ["min_norm", "lu_factor", "lu_solve", "arrowhead_solve", "fedecado_be_step"])
def test_raw_op_without_derivative_raises_with_its_reason(name):
    # each op module registers its own rule (ops._autograd.no_derivative_op): the raw torch.ops op
    # raises on backward, naming the op and why (a missing registration would not give the reason)
    reason = {
        "min_norm": "piecewise in G",
        "lu_factor": "torch.linalg.lu_factor",
        "lu_solve": "torch.linalg.lu_solve",
        "arrowhead_solve": "torch.linalg.solve",
        "fedecado_be_step": "integrator step",
    }[name]
    K, d = 3, 5
    if name == "min_norm":
        out = torch.ops.fedkernels.min_norm(_spd(4).requires_grad_())[0]
    elif name == "lu_factor":
        out = torch.ops.fedkernels.lu_factor(_spd(4).requires_grad_())[0]
    elif name == "lu_solve":
        LU, piv = ops.lu_factor(_spd(4))
        out = torch.ops.fedkernels.lu_solve(LU, piv, torch.randn(4, 3, dtype=D64, requires_grad=True))
    elif name == "arrowhead_solve":
        a, b, c = torch.rand(K, dtype=D64) + 1, torch.full((K,), -0.1, dtype=D64), torch.full((K,), 0.1, dtype=D64)
        R = torch.randn(K, d, dtype=D64, requires_grad=True)
        out = torch.ops.fedkernels.arrowhead_solve(a, b, c, 1.0, torch.randn(d, dtype=D64), R)[1]
    else:
        U = torch.randn(K, d, dtype=D64, requires_grad=True)
        z = torch.zeros(d, dtype=D64)
        th = torch.ones(K, dtype=D64)
        out = torch.ops.fedkernels.fedecado_be_step(
            z, torch.zeros(K, d, dtype=D64), z, U, torch.zeros(K, d, dtype=D64), None, th, th, th, 0.1, 1.0
        )[0]
    assert out.requires_grad
    with pytest.raises(RuntimeError, match=f"fedkernels.{name} has no derivative .*{reason}"):
        out.sum().backward()


def test_inplace_and_out_variants_refuse_grad():
    U = torch.randn(3, 5, requires_grad=True)
    with pytest.raises(RuntimeError, match="no derivative"):
        ops.weighted_sum(U, [1.0, 1.0, 1.0], out=torch.empty(5))
    W = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="gc_project_ has no derivative"):
        ops.gc_project_([W])
    with torch.no_grad():
        ops.gc_project_([W])  # fine without grad mode
    assert W.grad is None
    LU, piv = ops.lu_factor(_spd(3))
    with pytest.raises(RuntimeError, match="no derivative"):
        ops.lu_solve(LU, piv, torch.randn(3, 2, dtype=D64, requires_grad=True), out=torch.empty(3, 2, dtype=D64))


def test_finite_rows_is_not_differentiable():
    U = torch.randn(3, 5, requires_grad=True)
    assert not ops.finite_rows(U).requires_grad


def test_torch_func_grad_of_gram_and_gc_project():
    U = torch.randn(3, 6, dtype=D64)
    fg = torch.func.grad(lambda U: ops.gram(U).sum())(U)
    torch.testing.assert_close(fg, 2 * U.sum(0, keepdim=True).expand(3, 6), rtol=1e-13, atol=1e-13)
    W = torch.randn(4, 5, dtype=D64)
    w = torch.randn(4, 5, dtype=D64)
    fg = torch.func.grad(lambda W: (ops.gc_project([W])[0] * w).sum())(W)
    torch.testing.assert_close(fg, w - w.mean(1, keepdim=True), rtol=1e-13, atol=1e-13)
