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


# ---- server -> client payloads (client_payloads=True) ----------------------------------------------
def _quad_client(arrays, payload, b, lr=0.05, tau=4):
    """SCAFFOLD option-II client on f(y) = 0.5 ||y - b||^2 over the flat model (numpy, float64)."""
    x = np.concatenate([a.reshape(-1) for a in arrays]).astype(np.float64)
    c = payload["c"].double().numpy() if "c" in payload else np.zeros_like(x)
    ci = payload["c_i"].double().numpy() if "c_i" in payload else np.zeros_like(x)
    y = x.copy()
    for _ in range(tau):
        y -= lr * ((y - b) - ci + c)
    dc = -c + (x - y) / (tau * lr)
    out, off = [], 0
    for a in arrays:
        out.append(y[off:off + a.size].reshape(a.shape).astype(a.dtype))
        off += a.size
    return out, dc.astype(np.float32)


def test_client_payloads_scaffold_matches_direct_loop():
    from flwr.server.client_manager import SimpleClientManager
    from fedkernels.integrations.flower import unpack_fit_ins
    rng = np.random.default_rng(5)
    glob = _arrays(rng)
    d = sum(a.size for a in glob)
    N, rounds = 4, 3
    targets = [rng.standard_normal(d) for _ in range(N)]
    cm = SimpleClientManager()
    proxies = [Proxy(str(i)) for i in range(N)]
    for p in proxies:
        cm.register(p)
    st = FedKernelsStrategy(algorithms.build("scaffold"), num_clients=N, vector_payloads=("delta_c",),
                            client_payloads=True, fraction_fit=1.0, min_fit_clients=N, min_available_clients=N)
    ref = algorithms.build("scaffold")
    xr = torch.from_numpy(np.concatenate([a.reshape(-1) for a in glob]).astype(np.float32))
    ref.setup(None, N, xr)
    params = ndarrays_to_parameters(glob)
    for r in range(1, rounds + 1):
        pairs = st.configure_fit(r, params, cm)
        assert len(pairs) == N
        results, rows, pls, ids = [], [], [], []
        for proxy, ins in pairs:
            arrays, payload = unpack_fit_ins(parameters_to_ndarrays(ins.parameters), ins.config)
            cid = ins.config["cid"]
            assert len(arrays) == len(SHAPES) and json.loads(ins.config["fedkernels_payload"]) == ["c", "c_i"]
            torch.testing.assert_close(payload["c"], ref.client_payload(cid)["c"], rtol=0, atol=0)
            torch.testing.assert_close(payload["c_i"], ref.client_payload(cid)["c_i"], rtol=0, atol=0)
            new_arrays, dc = _quad_client(arrays, payload, targets[int(proxy.cid)])
            results.append((proxy, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(new_arrays + [dc]), 10,
                                          {"cid": cid})))
            rows.append(torch.from_numpy(np.concatenate([a.reshape(-1) for a in new_arrays])) - xr)
            pls.append({"delta_c": torch.from_numpy(dc)})
            ids.append(cid)
        params, _ = st.aggregate_fit(r, results, [])
        xr, _ = ref.aggregate(xr, torch.stack(rows), [10] * N, ids, pls)
        got = np.concatenate([a.reshape(-1) for a in parameters_to_ndarrays(params)])
        np.testing.assert_allclose(got, xr.numpy(), rtol=1e-6, atol=1e-6)
    assert float(ref.c.abs().sum()) > 0        # the control variates were exercised


def test_client_payloads_off_sends_the_model_only_and_bad_payload_raises():
    from flwr.server.client_manager import SimpleClientManager
    from fedkernels.integrations.flower import unpack_fit_ins
    glob = _arrays(np.random.default_rng(6))
    cm = SimpleClientManager()
    cm.register(Proxy("7"))
    st = FedKernelsStrategy(algorithms.build("scaffold"), num_clients=1, min_fit_clients=1, min_available_clients=1)
    (proxy, ins), = st.configure_fit(1, ndarrays_to_parameters(glob), cm)
    assert len(ins.parameters.tensors) == len(SHAPES) and "fedkernels_payload" not in ins.config
    arrays, payload = unpack_fit_ins(parameters_to_ndarrays(ins.parameters), ins.config)
    assert len(arrays) == len(SHAPES) and payload == {}

    class Odd(algorithms.base.Aggregator):
        name = "odd"

        def _aggregate(self, rin):
            raise AssertionError("not used")

        def client_payload(self, cid):
            return {"table": {"a": 1}}
    st = FedKernelsStrategy(Odd(), num_clients=1, client_payloads=True, min_fit_clients=1, min_available_clients=1)
    with pytest.raises(TypeError, match="table"):
        st.configure_fit(1, ndarrays_to_parameters(glob), cm)
