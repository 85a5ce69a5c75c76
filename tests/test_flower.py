"""Flower adapter: FedKernelsStrategy against Flower's own FedAvg, with Flower's objects."""
import json

import numpy as np
import pytest
import torch

flwr = pytest.importorskip("flwr")
from flwr.common import Code, FitRes, Parameters, Status, ndarrays_to_parameters, parameters_to_ndarrays  # noqa: E402
from flwr.server.client_proxy import ClientProxy  # noqa: E402
from flwr.server.strategy import FedAvg  # noqa: E402

from fedkernels import algorithms  # noqa: E402
from fedkernels.integrations.flower import FedKernelsStrategy, decode_into, json_safe_metrics  # noqa: E402

SHAPES = [(6, 3, 3, 3), (6,), (10, 54), (10,), (1,)]


class Proxy(ClientProxy):
    def get_properties(self, ins, timeout, group_id):
        raise RuntimeError("not used")

    def get_parameters(self, ins, timeout, group_id):
        raise RuntimeError("not used")

    def fit(self, ins, timeout, group_id):
        raise RuntimeError("not used")

    def evaluate(self, ins, timeout, group_id):
        raise RuntimeError("not used")

    def reconnect(self, ins, timeout, group_id):
        raise RuntimeError("not used")


def _arrays(rng, scale=1.0, dtype=np.float32):
    return [(rng.standard_normal(s) * scale).astype(dtype) for s in SHAPES]


def _results(glob, K=5, seed=1, metrics=None, extra=None):
    rng = np.random.default_rng(seed)
    out = []
    for k in range(K):
        arrs = [g + 0.1 * rng.standard_normal(g.shape).astype(g.dtype) for g in glob]
        if extra is not None:
            arrs = arrs + extra(k)
        m = metrics(k) if metrics else {}
        out.append((Proxy(str(1000 + k)),
                    FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrs), int(rng.integers(5, 60)), m)))
    return out


def _configure(strategy, params):
    strategy.set_global(params)


def test_fedavg_matches_flower_fedavg():
    rng = np.random.default_rng(0)
    glob = _arrays(rng)
    gp = ndarrays_to_parameters(glob)
    res = _results(glob)
    ref, _ = FedAvg(inplace=False).aggregate_fit(1, res, [])
    ref_inpl, _ = FedAvg().aggregate_fit(1, _results(glob), [])
    st = FedKernelsStrategy(algorithms.build("fedavg"))
    _configure(st, gp)
    got, metrics = st.aggregate_fit(1, res, [])
    a, b, c = parameters_to_ndarrays(ref), parameters_to_ndarrays(got), parameters_to_ndarrays(ref_inpl)
    assert [x.shape for x in b] == [tuple(s) for s in SHAPES] and all(x.dtype == np.float32 for x in b)
    for x, y, z in zip(a, b, c):
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(y, z, rtol=1e-5, atol=1e-6)
    w = json.loads(metrics["weights"])
    n = np.array([r.num_examples for _, r in res], dtype=np.float64)
    np.testing.assert_allclose(w, n / n.sum(), rtol=1e-15)
    assert metrics["num_clients"] == 5


def test_rounds_follow_configure_fit_and_keep_dtypes():
    rng = np.random.default_rng(3)
    glob = _arrays(rng)
    glob[-1] = glob[-1].astype(np.float64)             # a float64 tensor keeps its dtype
    st = FedKernelsStrategy(algorithms.build("fedavgm", beta=0.5), min_fit_clients=1, min_available_clients=1)
    ref = algorithms.build("fedavgm", beta=0.5)
    x = torch.cat([torch.from_numpy(g.astype(np.float32)).reshape(-1) for g in glob])
    params = ndarrays_to_parameters(glob)
    for t in range(3):
        st.set_global(params)                          # what configure_fit does
        res = _results(parameters_to_ndarrays(params), seed=10 + t)
        U = torch.stack([torch.cat([torch.from_numpy(a.astype(np.float32)).reshape(-1)
                                    for a in parameters_to_ndarrays(r.parameters)]) for _, r in res]) - x
        x, _ = ref.aggregate(x, U, [r.num_examples for _, r in res])
        params, _ = st.aggregate_fit(t + 1, res, [])
        arrs = parameters_to_ndarrays(params)
        assert arrs[-1].dtype == np.float64
        flat = np.concatenate([a.astype(np.float32).reshape(-1) for a in arrs])
        np.testing.assert_allclose(flat, x.numpy(), rtol=1e-6, atol=1e-6)


def test_payloads_ids_and_vector_payloads():
    rng = np.random.default_rng(5)
    glob = _arrays(rng)
    d = sum(int(np.prod(s)) for s in SHAPES)
    # FedNova: local_steps from metrics
    st = FedKernelsStrategy(algorithms.build("fednova"))
    st.set_global(ndarrays_to_parameters(glob))
    res = _results(glob, metrics=lambda k: {"local_steps": k + 1, "cid": 4 - k})
    _, m = st.aggregate_fit(1, res, [])
    assert json.loads(m["a_norm"]) == [1.0, 2.0, 3.0, 4.0, 5.0]
    # SCAFFOLD: delta_c as an extra tensor; client ids from metrics index the c_i table
    agg = algorithms.build("scaffold")
    st = FedKernelsStrategy(agg, num_clients=8, vector_payloads=("delta_c",))
    st.set_global(ndarrays_to_parameters(glob))
    dcs = [np.full(d, 0.01 * (k + 1), dtype=np.float32) for k in range(3)]
    res = _results(glob, K=3, metrics=lambda k: {"cid": 2 * k}, extra=lambda k: [dcs[k]])
    st.aggregate_fit(1, res, [])
    for k in range(3):
        np.testing.assert_allclose(agg.c_table[2 * k].numpy(), dcs[k])
    np.testing.assert_allclose(agg.c.numpy(), sum(dcs) / 8, rtol=1e-6)
    # a result with the wrong number of tensors is an error naming the counts
    bad = _results(glob, K=1)
    with pytest.raises(ValueError, match="vector payloads"):
        st.aggregate_fit(2, bad, [])


def test_gram_method_and_metrics_are_json_safe():
    rng = np.random.default_rng(7)
    glob = _arrays(rng)
    st = FedKernelsStrategy(algorithms.build("kuramoto", mode="S"))
    st.set_global(ndarrays_to_parameters(glob))
    params, m = st.aggregate_fit(1, _results(glob, K=4), [])
    for k, v in m.items():
        assert isinstance(v, (bool, int, float, str)), (k, v)
    assert len(json.loads(m["weights"])) == 4 and m["mode"] == "S"
    safe = json_safe_metrics({"a": None, "b": torch.tensor([1.5]), "c": {"x": [1, 2]}, "d": np.float64(2.0)})
    assert safe == {"b": 1.5, "c": '{"x": [1, 2]}', "d": 2.0}


def test_failures_empty_and_decode_errors():
    rng = np.random.default_rng(9)
    glob = _arrays(rng)
    st = FedKernelsStrategy(algorithms.build("fedavg"), accept_failures=False)
    st.set_global(ndarrays_to_parameters(glob))
    assert st.aggregate_fit(1, [], []) == (None, {})
    assert st.aggregate_fit(1, _results(glob, K=2), [RuntimeError("x")]) == (None, {})
    out = np.empty(10, dtype=np.float32)
    with pytest.raises(ValueError, match="shape"):
        decode_into(ndarrays_to_parameters([np.zeros((2, 5), np.float32)]).tensors, out, [(5, 2)])
    with pytest.raises(TypeError, match="Aggregator"):
        FedKernelsStrategy(object())
    fortran = np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3))
    decode_into(ndarrays_to_parameters([fortran]).tensors, out[:6], [(2, 3)])
    np.testing.assert_array_equal(out[:6], np.arange(6, dtype=np.float32))
