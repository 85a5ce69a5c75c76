"""torch.compile(fullgraph=True) of the op wrappers and torch.vmap batching rules.

Compiled wrappers must trace without graph breaks and give the eager results; value checks are
skipped under tracing (documented in fedkernels/ops/_checks.py) while the eager wrappers keep their
clear ValueErrors. vmap of weighted_sum and gram uses the registered rules (no fallback warning)
and equals a Python loop bit for bit.
"""

import warnings

import pytest
import torch

from fedkernels import ops

D64 = torch.float64


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compile(fn, backend="eager"):
    return torch.compile(fn, fullgraph=True, backend=backend)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_weighted_sum_and_gram_compile_fullgraph(backend):
    U = torch.randn(5, 301)
    c = torch.rand(5, dtype=D64)
    b = torch.randn(301)

    def agg(U, c, b):
        G = ops.gram(U)
        return ops.weighted_sum(U, c, base=b, alpha=0.5), ops.weighted_sum(U, c[:2], rows=[4, 1]), G, ops.finite_rows(U)

    got = _compile(agg, backend)(U, c, b)
    want = agg(U, c, b)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_min_norm_compile_fullgraph():
    A = torch.randn(6, 40, dtype=D64)
    G = A @ A.T
    lam, it, gap = _compile(lambda G: ops.min_norm(G, tol=1e-13))(G)
    lam_e, it_e, gap_e = ops.min_norm(G, tol=1e-13)
    assert torch.equal(lam, lam_e)
    assert int(it) == it_e and float(gap) == gap_e  # 0-d tensors under compile, Python numbers in eager


def test_lu_factor_ex_and_arrowhead_compile_fullgraph():
    A = torch.randn(3, 5, 5, dtype=D64) + 5 * torch.eye(5, dtype=D64)
    got = _compile(ops.lu_factor_ex)(A)
    want = ops.lu_factor_ex(A)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    a = torch.rand(4, dtype=D64) + 1
    r0, R = torch.randn(9, dtype=D64), torch.randn(4, 9, dtype=D64)
    f = _compile(lambda a, r0, R: ops.arrowhead_solve(a, -0.2, 0.3, 1.0, r0, R))
    got, want = f(a, r0, R), ops.arrowhead_solve(a, -0.2, 0.3, 1.0, r0, R)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_gc_project_inplace_compile_fullgraph():
    W = torch.randn(8, 3, 3)
    b = torch.randn(8)

    def step(W, b):
        ops.gc_project_([W, b], "center")
        return W, b

    Wc, bc = W.clone(), b.clone()
    _compile(step)(Wc, bc)
    We, be = ops.gc_project_([W.clone(), b.clone()], "center")
    assert torch.equal(Wc, We) and torch.equal(bc, be)


def test_eager_checks_still_raise():
    U = torch.randn(4, 10)
    with pytest.raises(ValueError, match="coef must be finite"):
        ops.weighted_sum(U, [1.0, float("nan"), 0.0, 0.0])
    with pytest.raises(ValueError, match="rows must lie in"):
        ops.gram(U, rows=[9])
    with pytest.raises(ValueError, match="has internally overlapping memory"):
        ops.gc_project_([torch.randn(1, 4).expand(3, 4)])
    with pytest.raises(ValueError, match="G must be finite"):
        ops.min_norm(torch.full((2, 2), float("nan"), dtype=D64))


def test_compiled_bad_index_still_cannot_read_out_of_bounds():
    # value checks are skipped while tracing; the CPU kernel's own range check still refuses
    U = torch.randn(4, 10)
    f = _compile(lambda U, r: ops.weighted_sum(U, torch.ones(1, dtype=D64), rows=r))
    with pytest.raises(Exception, match="rows|row|range"):
        f(U, torch.tensor([7]))


# ---- vmap -------------------------------------------------------------------------------------------
def test_vmap_weighted_sum_matches_a_loop_without_fallback_warning():
    U = torch.randn(4, 3, 57)
    c = torch.rand(4, 3, dtype=D64)
    b = torch.randn(4, 57)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the per-sample fallback warns; a registered rule does not
        got = torch.vmap(lambda U, c, b: ops.weighted_sum(U, c, base=b, alpha=-1.5))(U, c, b)
        only_c = torch.vmap(lambda c: ops.weighted_sum(U[0], c))(c)
        only_U = torch.vmap(lambda U: ops.weighted_sum(U, c[0], rows=[2, 0, 2]), in_dims=0)(U)
    assert torch.equal(got, torch.stack([ops.weighted_sum(U[i], c[i], base=b[i], alpha=-1.5) for i in range(4)]))
    assert torch.equal(only_c, torch.stack([ops.weighted_sum(U[0], c[i]) for i in range(4)]))
    assert torch.equal(only_U, torch.stack([ops.weighted_sum(U[i], c[0], rows=[2, 0, 2]) for i in range(4)]))


def test_vmap_gram_matches_a_loop():
    U = torch.randn(3, 5, 41)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = torch.vmap(ops.gram)(U)
        got_rows = torch.vmap(lambda U: ops.gram(U, rows=[4, 1]))(U)
        got_dim1 = torch.vmap(ops.gram, in_dims=1)(U)
    assert torch.equal(got, torch.stack([ops.gram(U[i]) for i in range(3)]))
    assert torch.equal(got_rows, torch.stack([ops.gram(U[i], rows=[4, 1]) for i in range(3)]))
    assert torch.equal(got_dim1, torch.stack([ops.gram(U[:, j]) for j in range(5)]))


def test_vmap_of_grad_per_example_coef_gradients():
    U = torch.randn(4, 3, 20, dtype=D64)
    c = torch.rand(4, 3, dtype=D64)
    f = torch.func.grad(lambda c, U: ops.weighted_sum(U, c).pow(2).sum())
    got = torch.vmap(f)(c, U)
    want = torch.stack([2 * U[i] @ ops.weighted_sum(U[i], c[i]) for i in range(4)])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
