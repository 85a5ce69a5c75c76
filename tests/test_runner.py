"""The round runner (fedkernels.algorithms.runner): the protocol around a method's update, with its state
in the call (nothing left on the method), the bad-row policy and the re-run without the bad rows."""

import pytest
import torch

from fedkernels import algorithms
from fedkernels.algorithms.base import AggResult, Aggregator, BadUpdateError
from fedkernels.algorithms.runner import Payloads, run_round
from fedkernels.sources import ChunkedUpdates, TensorSource

F64 = torch.float64


class Counting(Aggregator):
    """FedAvg's sum, counting its updates and the rows each saw (screen_in_pass: its sum screens)."""

    name = "counting"
    screen_in_pass = True

    def __init__(self, **kw):
        super().__init__(**kw)
        self.seen = []

    def _aggregate(self, rin):
        self.seen.append(list(rin.client_ids))
        return AggResult(rin.weighted_sum(rin.sample_weights(), base=rin.global_flat), {})


def _data(K=5, d=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(d, generator=g), torch.randn(K, d, generator=g), [1.0 + k for k in range(K)]


def test_run_round_is_aggregate():
    x, U, n = _data()
    for name, opts in [("fedavg", {}), ("kuramoto", {}), ("fedaware", {"num_clients": 5}), ("fedavgm", {})]:
        a, b = algorithms.build(name, **opts), algorithms.build(name, **opts)
        for _ in range(2):
            ra, rb = a.aggregate(x, U, n), run_round(b, x, U, n)
            assert torch.equal(ra.params, rb.params) and ra.info == rb.info, name
        assert a.round == b.round == 2


def test_the_rows_first_pass_screens_and_a_bad_row_reruns_the_update_without_it():
    x, U, n = _data()
    U[3, 4] = float("nan")
    agg = Counting(on_bad_update="exclude")
    res = agg.aggregate(x, U, n, client_ids=[10, 11, 12, 13, 14])
    assert agg.seen == [[10, 11, 12, 13, 14], [10, 11, 12, 14]]  # the update again, without row 3
    assert res.info["excluded"] == [{"client_id": 13, "reason": "update contains NaN/Inf"}]
    keep = [0, 1, 2, 4]
    ref = Counting().aggregate(x, U[keep], [n[k] for k in keep]).params
    assert torch.equal(res.params, ref) and agg.round == 1
    raising = Counting()
    with pytest.raises(BadUpdateError, match=r"counting.aggregate: client 3 \(row 3\): update contains NaN/Inf"):
        raising.aggregate(x, U, n)
    assert raising.round == 0


def test_no_protocol_state_is_left_on_the_method():
    """The runner keeps one call's state in the call: the method's attributes after a round (with an
    exclusion and a re-run, on a tensor and on a source) are its own state only."""
    x, U, n = _data()
    U[1, 0] = float("inf")
    for upd in (U, ChunkedUpdates(TensorSource(U), chunk_cols=4)):
        agg = algorithms.build("scaffold", on_bad_update="exclude", num_clients=5)
        before = set(vars(agg))
        pl = [{"delta_c": torch.full((11,), 0.1 * k)} for k in range(5)]
        agg.aggregate(x, upd, n, payloads=pl)
        assert set(vars(agg)) - before <= {"c", "d_c", "c_table", "table_version", "c_rows"}, set(vars(agg)) - before
    for attr in ("_payload_stacks", "_pending_global", "_pending_payload", "_defer_global"):
        assert not hasattr(Aggregator, attr)


def test_payload_stacks_follow_their_rows_when_rows_are_dropped():
    """SCAFFOLD's delta_c are stacked once by the screen; a row dropped for its update drops its delta_c:
    the round equals SCAFFOLD on the kept clients."""
    d = 7
    x, U, n = _data(d=d)
    U[2, 1] = float("nan")
    pl = [{"delta_c": torch.full((d,), 0.5 + k)} for k in range(5)]
    a = algorithms.build("scaffold", on_bad_update="exclude", num_clients=5)
    ra = a.aggregate(x, U, n, list(range(5)), pl)
    keep = [0, 1, 3, 4]
    b = algorithms.build("scaffold", num_clients=5)
    rb = b.aggregate(x, U[keep], [n[k] for k in keep], keep, [pl[k] for k in keep])
    assert torch.equal(ra.params, rb.params) and torch.equal(a.c, b.c)
    assert torch.equal(a.c_table, b.c_table)


def test_payloads_keep_the_callers_dicts():
    x, U, n = _data(K=2)
    pl = [{"a": 1}, {"b": 2}]
    rin = algorithms.build("fedavg").validate(x, U, n, payloads=pl)
    assert isinstance(rin.payloads, Payloads) and rin.payloads[0] is pl[0] and rin.payloads[1] is pl[1]


@pytest.mark.parametrize(
    "name,opts",
    [
        ("fedavg", {}),
        ("kuramoto", {}),
        ("kuramoto", {"mode": "P"}),
        ("geometric_median", {}),
        ("fedadam", {}),
    ],
)
def test_the_result_pass_writes_into_out_with_the_same_bits(monkeypatch, name, opts):
    """A dense round's result pass (a weighted sum on the global model) writes straight into the
    caller's ``out``, not into a new vector copied there afterwards (FedAdam's result is not such a
    pass: copied in): bitwise the model without ``out``. With a bad row and ``exclude``, the first
    pass has written into ``out`` before the re-run: the re-run's model replaces it."""
    from fedkernels import ops

    x, U, n = _data(K=6, d=1001)
    plain = algorithms.build(name, server_lr=0.7, **opts).aggregate(x, U, n).params
    outs = []
    for op in ("weighted_sum", "weighted_sum_screened"):
        f = getattr(ops, op)

        def spy(*a, _f=f, **kw):
            outs.append(kw.get("out"))
            return _f(*a, **kw)

        monkeypatch.setattr(ops, op, spy)
    out = torch.full_like(x, float("nan"))
    into = algorithms.build(name, server_lr=0.7, **opts).aggregate(x, U, n, out=out)
    assert into.params is out and torch.equal(out, plain)
    assert any(o is out for o in outs) == (name != "fedadam"), outs
    bad = U.clone()
    bad[2, 500] = float("inf")
    keep = [0, 1, 3, 4, 5]
    ref = algorithms.build(name, server_lr=0.7, **opts).aggregate(x, U[keep], [n[k] for k in keep]).params
    out = torch.full_like(x, float("nan"))
    res = algorithms.build(name, server_lr=0.7, on_bad_update="exclude", **opts).aggregate(x, bad, n, out=out)
    assert res.params is out and torch.equal(out, ref) and [e["client_id"] for e in res.info["excluded"]] == [2]


def test_a_differentiable_result_pass_is_an_ordinary_op_call():
    """With a gradient through the updates (rows screened before the method's pass, so its sum is the
    differentiable op) the result pass stays the op's autograd form, never ``out=``: the same model,
    and the gradient reaches U."""

    class Plain(Counting):
        name = "plain"
        screen_in_pass = False

    x, U, n = _data(K=4, d=37)
    ref = Plain().aggregate(x, U, n).params
    U = U.clone().requires_grad_(True)
    got = Plain().aggregate(x, U, n).params
    assert torch.equal(got.detach(), ref)
    got.sum().backward()
    p = torch.tensor(n, dtype=F64) / sum(n)
    torch.testing.assert_close(U.grad, p.to(U.dtype).unsqueeze(1).expand_as(U), rtol=0, atol=0)
