"""FedAvg and the shared Aggregator validation (bad updates, degenerate rounds, state)."""

import pytest
import torch
from torch.testing import assert_close

from fedkernels import algorithms
from fedkernels.algorithms import BadUpdateError


def test_fedavg_equals_hand_computed_weighted_mean():
    g = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    U = torch.tensor([[1.0, 0.0, -1.0], [3.0, 3.0, 3.0]], dtype=torch.float64)
    new, info = algorithms.build("fedavg").aggregate(g, U, num_examples=[1, 3], client_ids=[4, 9])
    # p = (1/4, 3/4): mean update = (0.25*1 + 0.75*3, 0.75*3, -0.25 + 2.25) = (2.5, 2.25, 2.0)
    assert_close(new, torch.tensor([3.5, 4.25, 5.0], dtype=torch.float64))
    assert info["weights"] == [0.25, 0.75] and info["num_clients"] == 2


@pytest.mark.parametrize("K,d", [(1, 7), (2, 100), (10, 10_001)])
def test_fedavg_matches_float64_recomputation(K, d):
    g = torch.randn(d)
    U = torch.randn(K, d)
    n = torch.randint(1, 100, (K,)).tolist()
    agg = algorithms.build("fedavg", server_lr=0.5)
    new, _ = agg.aggregate(g, U, n)
    p = torch.tensor(n, dtype=torch.float64) / sum(n)
    expect = g.double() + 0.5 * (p[:, None] * U.double()).sum(0)
    assert_close(new.double(), expect, rtol=1e-5, atol=1e-5)
    uni, _ = algorithms.build("fedavg", weighting="uniform").aggregate(g, U, n)
    assert_close(uni.double(), g.double() + U.double().mean(0), rtol=1e-5, atol=1e-5)


def test_all_zero_updates_keep_model():
    g = torch.randn(50)
    new, _ = algorithms.build("fedavg").aggregate(g, torch.zeros(3, 50), [1, 1, 1])
    assert torch.equal(new, g)


def test_nan_update_rejected_or_excluded():
    g = torch.zeros(5)
    U = torch.ones(3, 5)
    U[1, 2] = float("nan")
    with pytest.raises(BadUpdateError, match="client 11 .*NaN"):
        algorithms.build("fedavg").aggregate(g, U, [1, 1, 1], client_ids=[10, 11, 12])
    new, info = algorithms.build("fedavg", on_bad_update="exclude").aggregate(g, U, [1, 1, 1], client_ids=[10, 11, 12])
    assert torch.equal(new, torch.ones(5))
    assert info["excluded"] == [{"client_id": 11, "reason": "update contains NaN/Inf"}]
    # every client bad: the global model is returned unchanged
    new, info = algorithms.build("fedavg", on_bad_update="exclude").aggregate(
        g, torch.full((2, 5), float("inf")), [1, 1]
    )
    assert torch.equal(new, g) and info["skipped"]


def test_bad_shapes_and_samples():
    agg = algorithms.build("fedavg")
    g = torch.zeros(4)
    with pytest.raises(BadUpdateError, match="expected d=4"):
        agg.aggregate(g, torch.zeros(2, 5), [1, 1])
    with pytest.raises(BadUpdateError, match="updates\\[1\\] has 3 elements"):
        agg.aggregate(g, [torch.zeros(4), torch.zeros(3)], [1, 1])
    with pytest.raises(BadUpdateError, match="num_examples must be > 0"):
        agg.aggregate(g, torch.zeros(2, 4), [1, 0])
    with pytest.raises(ValueError, match="num_examples has 1 entries"):
        agg.aggregate(g, torch.zeros(2, 4), [1])
    with pytest.raises(ValueError, match="client_ids must be distinct"):
        agg.aggregate(g, torch.zeros(2, 4), [1, 1], client_ids=[3, 3])
    with pytest.raises(ValueError, match="dtype"):
        agg.aggregate(g, torch.zeros(2, 4, dtype=torch.float64), [1, 1])
    with pytest.raises(ValueError, match="global_flat contains NaN"):
        agg.aggregate(torch.full((4,), float("nan")), torch.zeros(2, 4), [1, 1])
    with pytest.raises(ValueError, match="weighting"):
        algorithms.build("fedavg", weighting="median")
    with pytest.raises(ValueError, match="unknown aggregator"):
        algorithms.build("nope")
    # a wrong-length update under the exclude policy is dropped, not fatal
    new, info = algorithms.build("fedavg", on_bad_update="exclude").aggregate(g, [torch.ones(4), torch.ones(3)], [1, 1])
    assert torch.equal(new, torch.ones(4)) and info["excluded"][0]["client_id"] == 1


def test_state_dict_roundtrip():
    a = algorithms.build("fedavg")
    a.aggregate(torch.zeros(3), torch.ones(2, 3), [1, 1])
    b = algorithms.build("fedavg")
    b.load_state_dict(a.state_dict())
    assert b.round == 1


def test_fedavg_reads_updates_once_when_clean(monkeypatch):
    """Stateless FedAvg never scans the K x d rows separately: its weighted_sum pass screens them
    (ops.weighted_sum_screened), also when a row is bad (then the round is computed without it)."""
    from fedkernels import ops

    shapes = []
    real = ops.finite_rows
    monkeypatch.setattr(ops, "finite_rows", lambda U: (shapes.append(tuple(U.shape)), real(U))[1])
    g, U = torch.zeros(6), torch.ones(3, 6)
    algorithms.build("fedavg").aggregate(g, U, [1, 1, 1])
    assert (3, 6) not in shapes
    U[2, 1] = float("nan")
    shapes.clear()
    new, info = algorithms.build("fedavg", on_bad_update="exclude").aggregate(g, U, [1, 1, 1])
    assert (3, 6) not in shapes and torch.equal(new, torch.ones(6)) and info["excluded"][0]["client_id"] == 2
    with pytest.raises(BadUpdateError, match=r"client 2 \(row 2\): update contains NaN/Inf"):
        algorithms.build("fedavg").aggregate(g, U, [1, 1, 1])
    # stateful FedAvgM screens in the same pass, before its momentum changes
    shapes.clear()
    m = algorithms.build("fedavgm", beta=0.5)
    m.aggregate(g, torch.ones(3, 6), [1, 1, 1])
    assert (3, 6) not in shapes
    v = m.momentum.clone()
    with pytest.raises(BadUpdateError, match=r"row 2"):
        m.aggregate(g, U, [1, 1, 1])
    assert torch.equal(m.momentum, v) and m.round == 1
    m2 = algorithms.build("fedavgm", beta=0.5, on_bad_update="exclude")
    m2.aggregate(g, torch.ones(3, 6), [1, 1, 1])
    new, info = m2.aggregate(g, U, [1, 1, 1])  # = a round of rows 0 and 1 only
    assert torch.equal(new, g + 0.5 * v + torch.ones(6)) and info["excluded"][0]["client_id"] == 2
    assert (3, 6) not in shapes


def test_updates_checked_against_global_flat_with_the_op_wording():
    """Aggregator.validate words a dtype / device / dtype-kind mismatch as the op wrappers do
    (ops._checks), naming updates and global_flat, before anything runs."""
    agg = algorithms.build("fedavgm")
    g = torch.zeros(4)
    with pytest.raises(
        ValueError,
        match=r"^fedavgm\.aggregate: updates must have dtype torch\.float32 \(the dtype "
        r"of global_flat\), got torch\.float64$",
    ):
        agg.aggregate(g, torch.zeros(2, 4, dtype=torch.float64), [1, 1])
    with pytest.raises(
        ValueError, match=r"^fedavgm\.aggregate: updates must have a floating dtype .*got torch\.int64$"
    ):
        agg.aggregate(g.long(), torch.zeros(2, 4, dtype=torch.long), [1, 1])
    assert agg.momentum is None and agg.round == 0  # nothing ran
