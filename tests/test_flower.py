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
        out.append(
            (
                Proxy(str(1000 + k)),
                FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrs), int(rng.integers(5, 60)), m),
            )
        )
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
    glob[-1] = glob[-1].astype(np.float64)  # a float64 tensor keeps its dtype
    st = FedKernelsStrategy(algorithms.build("fedavgm", beta=0.5), min_fit_clients=1, min_available_clients=1)
    ref = algorithms.build("fedavgm", beta=0.5)
    x = torch.cat([torch.from_numpy(g.astype(np.float32)).reshape(-1) for g in glob])
    params = ndarrays_to_parameters(glob)
    for t in range(3):
        st.set_global(params)  # what configure_fit does
        res = _results(parameters_to_ndarrays(params), seed=10 + t)
        U = (
            torch.stack(
                [
                    torch.cat(
                        [
                            torch.from_numpy(a.astype(np.float32)).reshape(-1)
                            for a in parameters_to_ndarrays(r.parameters)
                        ]
                    )
                    for _, r in res
                ]
            )
            - x
        )
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
        out.append(y[off : off + a.size].reshape(a.shape).astype(a.dtype))
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
    st = FedKernelsStrategy(
        algorithms.build("scaffold"),
        num_clients=N,
        vector_payloads=("delta_c",),
        client_payloads=True,
        fraction_fit=1.0,
        min_fit_clients=N,
        min_available_clients=N,
    )
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
            results.append(
                (proxy, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(new_arrays + [dc]), 10, {"cid": cid}))
            )
            rows.append(torch.from_numpy(np.concatenate([a.reshape(-1) for a in new_arrays])) - xr)
            pls.append({"delta_c": torch.from_numpy(dc)})
            ids.append(cid)
        params, _ = st.aggregate_fit(r, results, [])
        xr, _ = ref.aggregate(xr, torch.stack(rows), [10] * N, ids, pls)
        got = np.concatenate([a.reshape(-1) for a in parameters_to_ndarrays(params)])
        np.testing.assert_allclose(got, xr.numpy(), rtol=1e-6, atol=1e-6)
    assert float(ref.c.abs().sum()) > 0  # the control variates were exercised


def test_client_payloads_off_sends_the_model_only_and_bad_payload_raises():
    from flwr.server.client_manager import SimpleClientManager
    from fedkernels.integrations.flower import unpack_fit_ins

    glob = _arrays(np.random.default_rng(6))
    cm = SimpleClientManager()
    cm.register(Proxy("7"))
    st = FedKernelsStrategy(algorithms.build("scaffold"), num_clients=1, min_fit_clients=1, min_available_clients=1)
    ((proxy, ins),) = st.configure_fit(1, ndarrays_to_parameters(glob), cm)
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


# ---- Flower's Message API (flwr.serverapp.strategy): FedKernelsMessageStrategy -------------------
def _message_api():
    return pytest.importorskip("flwr.serverapp.strategy")


@pytest.fixture(autouse=True)
def _serverapp_identity():
    """What Flower's ServerApp runtime sets before running a ServerApp (run_serverapp.py): the
    process's task identity, which Message() reads. Restored afterwards."""
    try:
        from flwr.common.constant import SUPERLINK_NODE_ID
        from flwr.supercore.task_identity import TaskIdentity
    except ImportError:  # older Flower: no task identity
        yield
        return
    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, SUPERLINK_NODE_ID
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


def _record(arrays):
    from flwr.app import Array, ArrayRecord

    return ArrayRecord({f"layer{i}": Array(np.ascontiguousarray(a)) for i, a in enumerate(arrays)})


def _flat(record):
    return np.concatenate([record[k].numpy().reshape(-1) for k in record.keys()])


def _train_ins(node_id):
    from flwr.app import Message, MessageType, RecordDict

    return Message(RecordDict(), dst_node_id=node_id, message_type=MessageType.TRAIN)


def _replies(glob, K=5, seed=1, metrics=None, payload=None):
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

    rng = np.random.default_rng(seed)
    out = []
    for k in range(K):
        arrs = [g + 0.1 * rng.standard_normal(g.shape).astype(g.dtype) for g in glob]
        m = {"num-examples": int(rng.integers(5, 60)), "train_loss": float(rng.random())}
        m.update(metrics(k) if metrics else {})
        content = {"arrays": _record(arrs), "metrics": MetricRecord(m)}
        if payload is not None:
            content["fedkernels_payload"] = payload(k)
        out.append(Message(RecordDict(content), reply_to=_train_ins(100 + k)))
    return out


def test_message_fedavg_matches_flower_message_fedavg():
    strat = _message_api()
    from fedkernels.integrations.flower import FedKernelsMessageStrategy

    glob = _arrays(np.random.default_rng(0))
    replies = _replies(glob, K=6)
    st = FedKernelsMessageStrategy(algorithms.build("fedavg"))
    st.set_global(_record(glob))
    got, metrics = st.aggregate_train(1, replies)
    want, want_metrics = strat.FedAvg().aggregate_train(1, replies)
    assert list(got.keys()) == list(want.keys())
    for k in got.keys():
        assert got[k].shape == want[k].shape and got[k].dtype == want[k].dtype
    np.testing.assert_allclose(_flat(got), _flat(want), rtol=2e-6, atol=2e-6)
    assert metrics["train_loss"] == pytest.approx(want_metrics["train_loss"])  # clients' metrics averaged too
    assert metrics["fedkernels_failures"] == 0 and "cid" not in metrics
    # node ids became dense client ids in order of appearance
    assert [st._ids[100 + k] for k in range(6)] == list(range(6))


def test_message_strategy_payloads_ids_and_errors():
    _message_api()
    from flwr.app import ArrayRecord, Error, Message
    from fedkernels.integrations.flower import FedKernelsMessageStrategy

    glob = _arrays(np.random.default_rng(2))
    d = sum(a.size for a in glob)
    seen = {}

    class Spy(algorithms.base.Aggregator):
        name = "spy"

        def _aggregate(self, rin):
            raise AssertionError("not used")

        def aggregate(self, x, U, n, ids, payloads=None):
            seen.update(U=U.clone(), n=list(n), ids=list(ids), payloads=payloads)
            return x + U.mean(0), {
                "norm": float(U.norm()),
                "flag": True,
                "weights": torch.ones(len(n)),
                "note": "strings are left out",
            }

    rng = np.random.default_rng(3)
    dcs = [rng.standard_normal(d).astype(np.float32) for _ in range(3)]
    replies = _replies(
        glob,
        K=3,
        metrics=lambda k: {"cid": 7 - k, "local_steps": 10 + k},
        payload=lambda k: ArrayRecord({"delta_c": __import__("flwr").app.Array(dcs[k])}),
    )
    replies.append(Message(Error(code=0, reason="client crashed"), reply_to=_train_ins(999)))
    st = FedKernelsMessageStrategy(Spy(), num_clients=8)
    st.set_global(_record(glob))
    new, metrics = st.aggregate_train(1, replies)
    assert seen["ids"] == [7, 6, 5] and len(seen["n"]) == 3
    assert [p["local_steps"] for p in seen["payloads"]] == [10, 11, 12]
    for p, dc in zip(seen["payloads"], dcs):
        np.testing.assert_array_equal(p["delta_c"].numpy(), dc)
        assert "cid" not in p and "num-examples" not in p
    g = np.concatenate([a.reshape(-1) for a in glob])
    np.testing.assert_allclose(seen["U"][0].numpy(), _flat(replies[0].content["arrays"]) - g, rtol=0, atol=1e-6)
    assert metrics["fedkernels_failures"] == 1 and metrics["flag"] == 1 and metrics["weights"] == [1.0] * 3
    assert "note" not in metrics and st.last_info["note"] == "strings are left out"


def test_message_strategy_rejects_bad_replies_and_arguments():
    _message_api()
    from flwr.app import Message, MetricRecord, RecordDict
    from fedkernels.integrations.flower import FedKernelsMessageStrategy

    glob = _arrays(np.random.default_rng(4))
    st = FedKernelsMessageStrategy(algorithms.build("fedavg"))
    with pytest.raises(RuntimeError, match="configure_train"):
        st.aggregate_train(1, _replies(glob, K=2))
    st.set_global(_record(glob))
    no_n = Message(
        RecordDict({"arrays": _record(glob), "metrics": MetricRecord({"loss": 1.0})}), reply_to=_train_ins(5)
    )
    with pytest.raises(ValueError, match="num-examples"):
        st.aggregate_train(1, [no_n])
    wrong = Message(
        RecordDict({"arrays": _record(glob[:2]), "metrics": MetricRecord({"num-examples": 3})}), reply_to=_train_ins(5)
    )
    with pytest.raises(ValueError, match="expected the global model"):
        st.aggregate_train(1, [wrong])
    with pytest.raises(TypeError, match="Aggregator"):
        FedKernelsMessageStrategy(object())
    with pytest.raises(ValueError, match="num_clients"):
        FedKernelsMessageStrategy(algorithms.build("fedavg"), num_clients=0)


class LocalGrid:
    """A Flower ``Grid`` that delivers each message to a Flower ``ClientApp`` in this process (what a
    SuperLink + SuperNodes do over the network), one Context per node kept across rounds."""

    def __new__(cls, *a, **k):
        from flwr.serverapp import Grid

        class _Grid(Grid):
            def __init__(self, app, node_ids):
                from flwr.app import Context, RecordDict

                self.app, self.nodes, self.sent = app, list(node_ids), []
                self.ctx = {
                    n: Context(run_id=1, node_id=n, node_config={}, state=RecordDict(), run_config={})
                    for n in self.nodes
                }

            def set_run(self, run):
                self._run = run

            @property
            def run(self):
                return self._run

            def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
                from flwr.app import Message

                return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

            def get_node_ids(self):
                return list(self.nodes)

            def push_messages(self, messages):
                raise RuntimeError("not used: send_and_receive delivers directly")

            def pull_messages(self, message_ids):
                raise RuntimeError("not used")

            def send_and_receive(self, messages, *, timeout=None):
                import uuid

                replies = []
                for m in messages:
                    m.metadata.__dict__["_message_id"] = str(uuid.uuid4())
                    self.sent.append(m)
                    replies.append(self.app(m, self.ctx[m.metadata.dst_node_id]))
                return replies

        return _Grid(*a, **k)


def test_message_strategy_start_scaffold_with_client_app_matches_direct_loop():
    _message_api()
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict  # noqa: F401
    from flwr.clientapp import ClientApp
    from fedkernels.integrations.flower import FedKernelsMessageStrategy, unpack_payload

    rng = np.random.default_rng(5)
    glob = _arrays(rng)
    d = sum(a.size for a in glob)
    nodes = [11, 22, 33, 44]
    targets = {n: rng.standard_normal(d) for n in nodes}
    app = ClientApp()

    @app.train()
    def train(msg, context):
        arrays = [msg.content["arrays"][k].numpy() for k in msg.content["arrays"].keys()]
        payload = unpack_payload(msg.content)
        assert msg.content["config"]["cid"] == payload_cid(msg) and set(payload) == {"c", "c_i"}
        new, dc = _quad_client(arrays, payload, targets[context.node_id])
        return Message(
            RecordDict(
                {
                    "arrays": _record(new),
                    "metrics": MetricRecord({"num-examples": 10, "loss": float(np.abs(dc).mean())}),
                    "fedkernels_payload": ArrayRecord({"delta_c": __import__("flwr").app.Array(dc)}),
                }
            ),
            reply_to=msg,
        )

    @app.evaluate()
    def evaluate(msg, context):
        x = _flat(msg.content["arrays"]).astype(np.float64)
        loss = 0.5 * float(((x - targets[context.node_id]) ** 2).sum())
        return Message(RecordDict({"metrics": MetricRecord({"num-examples": 1, "loss": loss})}), reply_to=msg)

    def payload_cid(msg):
        return st._ids[msg.metadata.dst_node_id]

    grid = LocalGrid(app, nodes)
    st = FedKernelsMessageStrategy(
        algorithms.build("scaffold"),
        num_clients=len(nodes),
        client_payloads=True,
        min_available_nodes=len(nodes),
        min_train_nodes=len(nodes),
        min_evaluate_nodes=len(nodes),
    )
    result = st.start(grid=grid, initial_arrays=_record(glob), num_rounds=3)
    assert sorted(st._ids) == nodes and sorted(st._ids.values()) == [0, 1, 2, 3]
    assert sum(m.metadata.message_type == "train" for m in grid.sent) == 3 * len(nodes)
    assert set(result.evaluate_metrics_clientapp) == {1, 2, 3}
    # the same three rounds straight through the library
    ref = algorithms.build("scaffold")
    xr = torch.from_numpy(np.concatenate([a.reshape(-1) for a in glob]).astype(np.float32))
    ref.setup(None, len(nodes), xr)
    order = sorted(nodes, key=lambda n: st._ids[n])
    for _ in range(3):
        arrays = [a.copy() for a in glob]
        off = 0
        for a in arrays:
            a[...] = xr.numpy()[off : off + a.size].reshape(a.shape)
            off += a.size
        rows, pls, ids = [], [], []
        for n in order:
            cid = st._ids[n]
            new, dc = _quad_client(arrays, ref.client_payload(cid), targets[n])
            rows.append(torch.from_numpy(np.concatenate([a.reshape(-1) for a in new])) - xr)
            pls.append({"delta_c": torch.from_numpy(dc)})
            ids.append(cid)
        xr, _ = ref.aggregate(xr, torch.stack(rows), [10] * len(nodes), ids, pls)
    np.testing.assert_allclose(_flat(result.arrays), xr.numpy(), rtol=1e-5, atol=1e-5)
    assert float(ref.c.abs().sum()) > 0
    # the losses went down over the rounds (the run trained)
    losses = [result.evaluate_metrics_clientapp[r]["loss"] for r in (1, 2, 3)]
    assert losses[2] < losses[0]


def test_message_strategy_under_flower_simulation_runtime():
    """SCAFFOLD with client payloads under Flower's own simulation runtime (run_simulation, Ray
    backend: supernodes in Ray workers) gives the library's direct loop. Needs `flwr[simulation]`."""
    _message_api()
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("ray") is None:
        pytest.skip("Flower's simulation runtime needs Ray: pip install 'flwr[simulation]'")
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([root, here, os.environ.get("PYTHONPATH", "")])
    )
    seed, nodes, rounds = 5, 3, 2
    r = subprocess.run(
        [sys.executable, os.path.join(here, "flower_sim_app.py"), str(seed), str(nodes), str(rounds)],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=600,
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stdout[-2000:] + r.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    assert out["rounds"] == list(range(1, rounds + 1))
    rng = np.random.default_rng(seed)
    glob = _arrays(rng)
    d = sum(a.size for a in glob)
    targets = [rng.standard_normal(d) for _ in range(nodes)]
    ref = algorithms.build("scaffold")
    xr = torch.from_numpy(np.concatenate([a.reshape(-1) for a in glob]).astype(np.float32))
    ref.setup(None, nodes, xr)
    for _ in range(rounds):
        arrays, off = [a.copy() for a in glob], 0
        for a in arrays:
            a[...] = xr.numpy()[off : off + a.size].reshape(a.shape)
            off += a.size
        rows, pls = [], []
        for cid in range(nodes):
            new, dc = _quad_client(arrays, ref.client_payload(cid), targets[cid])
            rows.append(torch.from_numpy(np.concatenate([a.reshape(-1) for a in new])) - xr)
            pls.append({"delta_c": torch.from_numpy(dc)})
        xr, _ = ref.aggregate(xr, torch.stack(rows), [10] * nodes, list(range(nodes)), pls)
    np.testing.assert_allclose(np.asarray(out["final"], dtype=np.float32), xr.numpy(), rtol=1e-5, atol=1e-5)
    assert float(ref.c.abs().sum()) > 0
