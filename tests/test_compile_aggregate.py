"""torch.compile(fullgraph=True) of one FedAvg and one Kuramoto (mode S) aggregation: the traced
round equals the eager one, the eager call still raises one clear error on bad values, and shape
errors are raised while tracing."""

import pytest
import torch

from fedkernels.algorithms import BadUpdateError, build


def _round(K=5, d=257, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(d, generator=g), torch.randn(K, d, generator=g), torch.arange(1.0, K + 1)


@pytest.mark.parametrize(
    "name,opts",
    [
        ("fedavg", {}),
        ("fedavg", {"weighting": "uniform", "server_lr": 0.5}),
        ("kuramoto", {"mode": "S", "kappa0": 0.5}),
    ],
)
def test_fullgraph_compile_equals_eager(name, opts):
    torch._dynamo.reset()
    eager, comp = build(name, **opts), build(name, **opts)
    fn = torch.compile(lambda w, U, n: comp.aggregate(w, U, n), fullgraph=True)
    for seed in range(2):
        w, U, n = _round(seed=seed)
        r_e = eager.aggregate(w, U, n)
        r_c = fn(w, U, n)
        torch.testing.assert_close(r_c.params, r_e.params, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(
            torch.as_tensor(r_c.info["weights"]),
            torch.tensor(r_e.info["weights"], dtype=torch.float64),
            rtol=1e-12,
            atol=1e-12,
        )
    assert comp.round == eager.round == 2
    # eager mode keeps the value checks
    w, U, n = _round()
    U[1, 3] = float("nan")
    with pytest.raises(BadUpdateError, match="NaN/Inf"):
        eager.aggregate(w, U, n)
    # shape checks hold while tracing
    with pytest.raises(Exception, match="columns"):
        fn(w, U[:, :-1].contiguous(), n)


def test_kuramoto_mode_p_refuses_tracing():
    agg = build("kuramoto", mode="P")
    fn = torch.compile(lambda w, U, n: agg.aggregate(w, U, n), fullgraph=True)
    w, U, n = _round()
    with pytest.raises(Exception, match="mode P under torch.compile"):
        fn(w, U, n)
