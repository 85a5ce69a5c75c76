"""dot / sqnorm / all_ / any_ / amax_d / mean_d and the explicit sharded mode (ops.reduce_across)."""

import torch

from fedkernels import ops


class DoublingReducer:
    """Stands in for two ranks holding identical slices: every partial result counts twice."""

    def __init__(self):
        self.calls = []

    def all_reduce_sum(self, t):
        self.calls.append("sum")
        return t * 2

    def all_reduce_max(self, t):
        self.calls.append("max")
        return t

    def all_reduce_and(self, mask):
        self.calls.append("and")
        return mask


def test_local_reductions_without_a_reducer():
    a, b = torch.randn(101), torch.randn(101)
    assert ops.active_reducer() is None
    assert abs(ops.dot(a, b) - float(a.double() @ b.double())) < 1e-12
    assert abs(ops.sqnorm(a) - float(a.double() @ a.double())) < 1e-12
    assert ops.all_(torch.ones(5, dtype=torch.bool)) and not ops.any_(torch.zeros(5, dtype=torch.bool))
    x = torch.randn(3, 7)
    assert torch.equal(ops.amax_d(x), x.amax(dim=-1))
    assert torch.equal(ops.amax_d(torch.zeros(3, 0)), torch.full((3,), float("-inf")))
    assert torch.equal(ops.mean_d(x), x.mean(dim=-1))


def test_reduce_across_routes_every_d_reduction_and_restores():
    U = torch.randn(3, 50, dtype=torch.float64)
    r = DoublingReducer()
    with ops.reduce_across(r) as got:
        assert got is r and ops.active_reducer() is r
        torch.testing.assert_close(ops.gram(U), 2 * (U @ U.T), rtol=1e-13, atol=1e-13)
        assert abs(ops.sqnorm(U[0]) - 2 * float(U[0] @ U[0])) < 1e-9
        assert ops.finite_rows(U).all()
        ops.amax_d(U)
        with ops.reduce_across(None):  # nested: local again
            assert ops.active_reducer() is None
            assert abs(ops.sqnorm(U[0]) - float(U[0] @ U[0])) < 1e-9
        assert ops.active_reducer() is r
    assert ops.active_reducer() is None
    assert r.calls == ["sum", "sum", "and", "max"]


def test_reduce_across_restores_after_an_error():
    r = DoublingReducer()
    try:
        with ops.reduce_across(r):
            raise KeyError("boom")
    except KeyError:
        pass
    assert ops.active_reducer() is None
