"""Flower adapter: any fedkernels aggregator as a Flower strategy (``pip install --no-build-isolation '.[flower]'``).

Flower's current Message API (``flwr.serverapp``): ``FedKernelsMessageStrategy`` (see its docstring)::

    strategy = FedKernelsMessageStrategy(algorithms.build("scaffold"), num_clients=100, client_payloads=True,
                                         fraction_train=0.1)        # Flower's message FedAvg options
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=50)

Flower's legacy API (``flwr.server.strategy``): ``FedKernelsStrategy``::

    import flwr
    from fedkernels import algorithms
    from fedkernels.integrations.flower import FedKernelsStrategy

    strategy = FedKernelsStrategy(algorithms.build("kuramoto", mode="S"),
                                  initial_parameters=flwr.common.ndarrays_to_parameters(init_arrays),
                                  num_clients=100, min_fit_clients=10, ...)   # FedAvg's options

The strategy is Flower's ``FedAvg`` (client sampling, configure/evaluate, options) with
``aggregate_fit`` replaced: once per round the clients' parameter lists are decoded straight
into the rows of a preallocated K x d float32 buffer (one copy per tensor, no intermediate
arrays), as updates ``local - global`` (the subtraction fused into the decoding copy), and handed
to ``aggregator.aggregate``; the new flat vector goes back to Flower as ``Parameters`` with the
original shapes and dtypes. Metrics: the aggregator's ``info`` made JSON-safe (numbers, strings
and booleans as they are; lists and dicts as JSON strings; None dropped).

What clients send besides their model:

* ``FitRes.metrics`` numbers become the aggregator's payload for that client (e.g. FedNova's
  ``local_steps``, Kuramoto mode C's ``phase``); ``metrics[cid_key]`` (default ``"cid"``), when
  present, is the client's id in ``[0, num_clients)`` (stateful methods index their tables by it);
  otherwise clients get dense ids in order of first appearance.
* ``vector_payloads=("delta_c",)``: that many extra tensors appended after the model tensors,
  each with d elements (e.g. SCAFFOLD's control-variate delta), become tensor payloads.

What the server sends besides the model (``client_payloads=True``): ``configure_fit`` asks the
aggregator for each sampled client's ``client_payload(cid)`` (SCAFFOLD's ``c`` and ``c_i``,
FedECADO's flow ``I`` and weight ``w``, FedPVR's control variates, ...). Tensors are appended after
the model tensors as float32 arrays, their names listed in ``config["fedkernels_payload"]`` (JSON);
numbers, strings and booleans go into the ``config``; the client's id goes in ``config[cid_key]``
so the client can echo it back in its metrics. On the client, ``unpack_fit_ins(arrays, config)``
splits the received arrays into the model and a ``{name: tensor}`` payload dict.

The global model the updates are measured against is the one ``configure_fit`` sent this round.
"""

from __future__ import annotations

import io
import json
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

try:
    from flwr.common import (
        FitIns,
        FitRes,
        Parameters,
        Scalar,
        ndarray_to_bytes,
        ndarrays_to_parameters,
        parameters_to_ndarrays,
    )
    from flwr.server.strategy import FedAvg
except ImportError as err:  # pragma: no cover - exercised only without flwr
    raise ImportError("fedkernels.integrations.flower needs Flower: pip install 'fedkernels[flower]'") from err

from ..algorithms.base import Aggregator

__all__ = [
    "FedKernelsStrategy",
    "FedKernelsMessageStrategy",
    "json_safe_metrics",
    "metric_record",
    "decode_into",
    "unpack_fit_ins",
    "unpack_payload",
]

PAYLOAD_KEY = "fedkernels_payload"


def unpack_fit_ins(
    arrays: Sequence[np.ndarray], config: Dict[str, Any]
) -> Tuple[List[np.ndarray], Dict[str, torch.Tensor]]:
    """Client side of ``client_payloads=True``: (model arrays, {name: float32 tensor}) from the
    arrays and config a client's ``fit`` received. Without payloads: (arrays, {})."""
    names = json.loads(config.get(PAYLOAD_KEY, "[]")) if config is not None else []
    if not isinstance(names, list) or len(names) > len(arrays):
        raise ValueError(f"unpack_fit_ins: config[{PAYLOAD_KEY!r}] names {names!r} do not fit {len(arrays)} arrays")
    nm = len(arrays) - len(names)
    return list(arrays[:nm]), {n: torch.from_numpy(np.asarray(a)) for n, a in zip(names, arrays[nm:])}


def json_safe_metrics(info: Dict[str, Any], prefix: str = "") -> Dict[str, Scalar]:
    """Flower metrics (bool/int/float/str values) from an aggregator's ``info``."""
    out: Dict[str, Scalar] = {}
    for k, v in info.items():
        key = f"{prefix}{k}"
        if v is None:
            continue
        if isinstance(v, (bool, int, float, str)):
            out[key] = v
        elif isinstance(v, torch.Tensor) and v.numel() == 1:
            out[key] = v.item()
        elif isinstance(v, (np.generic,)):
            out[key] = v.item()
        else:
            if isinstance(v, torch.Tensor):
                v = v.tolist()
            out[key] = json.dumps(v, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o))
    return out


def _npy_header(b: bytes) -> Tuple[Tuple[int, ...], bool, np.dtype, int]:
    f = io.BytesIO(b[:4096] if len(b) > 4096 else b)
    major, _ = np.lib.format.read_magic(f)
    if major == 1:
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
    else:
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
    return tuple(shape), bool(fortran), dtype, f.tell()


def decode_into(
    tensors: Sequence[bytes], out: np.ndarray, shapes: Sequence[Tuple[int, ...]], minus: Optional[np.ndarray] = None
) -> None:
    """Decodes Flower's serialized arrays (``np.save`` bytes) straight into the flat ``out`` row;
    with ``minus`` (a flat array like ``out``) writes ``decoded - minus`` in the same pass."""
    if len(tensors) < len(shapes):
        raise ValueError(f"flower: got {len(tensors)} tensors, expected {len(shapes)}")
    off = 0
    for i, (b, shape) in enumerate(zip(tensors, shapes)):
        shp, fortran, dtype, hdr = _npy_header(b)
        n = int(np.prod(shp, dtype=np.int64))
        if tuple(shp) != tuple(shape):
            raise ValueError(f"flower: tensor {i} has shape {tuple(shp)}, expected {tuple(shape)}")
        src = np.frombuffer(b, dtype=dtype, count=n, offset=hdr)
        if fortran and len(shp) > 1:
            src = src.reshape(shp[::-1]).T.reshape(-1)
        if minus is None:
            np.copyto(out[off : off + n], src, casting="same_kind")
        else:
            np.subtract(src, minus[off : off + n], out=out[off : off + n], casting="same_kind")
        off += n
    if off != out.size:
        raise ValueError(f"flower: decoded {off} values, expected d={out.size}")


class FedKernelsStrategy(FedAvg):
    """Flower FedAvg with ``aggregate_fit`` done by a fedkernels aggregator (see module docstring).

    Extra options: ``num_clients`` (N, for stateful aggregators), ``cid_key`` (metrics key of the
    client id, default "cid"), ``vector_payloads`` (names of extra d-sized tensors after the model),
    ``client_payloads`` (send each client its ``aggregator.client_payload``; default False: the
    clients get the model only), ``metrics_prefix`` (default ""), ``spec`` (a FlatSpec passed to
    ``aggregator.setup``). All other keyword arguments go to ``flwr.server.strategy.FedAvg``.
    """

    def __init__(
        self,
        aggregator: Aggregator,
        *,
        num_clients: Optional[int] = None,
        cid_key: str = "cid",
        vector_payloads: Sequence[str] = (),
        client_payloads: bool = False,
        metrics_prefix: str = "",
        spec: Any = None,
        **fedavg_kw: Any,
    ) -> None:
        super().__init__(**fedavg_kw)
        if not isinstance(aggregator, Aggregator):
            raise TypeError(
                f"FedKernelsStrategy: aggregator must be a fedkernels Aggregator, got {type(aggregator).__name__}"
            )
        self.aggregator = aggregator
        self.num_clients = num_clients
        self.cid_key = cid_key
        self.vector_payloads = tuple(vector_payloads)
        self.client_payloads = bool(client_payloads)
        self.metrics_prefix = metrics_prefix
        self.spec = spec
        self._shapes: Optional[List[Tuple[int, ...]]] = None
        self._dtypes: Optional[List[np.dtype]] = None
        self._global: Optional[torch.Tensor] = None
        self._buf: Optional[torch.Tensor] = None
        self._ids: Dict[str, int] = {}
        self._ready = False

    def __repr__(self) -> str:
        return f"FedKernelsStrategy({self.aggregator!r})"

    # ---- the global model -------------------------------------------------------------------------
    def set_global(self, parameters: Parameters) -> None:
        """Records the global model (layout and values) the next results are measured against."""
        shapes, dtypes = [], []
        for b in parameters.tensors:
            shp, _, dt, _ = _npy_header(b)
            shapes.append(shp)
            dtypes.append(dt)
        d = int(sum(int(np.prod(s, dtype=np.int64)) for s in shapes))
        if self._global is None or self._global.numel() != d:
            self._global = torch.empty(d, dtype=torch.float32)
        self._shapes, self._dtypes = shapes, dtypes
        decode_into(parameters.tensors, self._global.numpy(), shapes)

    def initialize_parameters(self, client_manager: Any) -> Optional[Parameters]:
        params = super().initialize_parameters(client_manager)
        if params is not None:
            self.set_global(params)
        return params

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: Any) -> List[Tuple[Any, FitIns]]:
        self.set_global(parameters)
        pairs = super().configure_fit(server_round, parameters, client_manager)
        if not self.client_payloads:
            return pairs
        self._setup()
        return [(proxy, self._with_payload(proxy, ins)) for proxy, ins in pairs]

    def _with_payload(self, proxy, ins: FitIns) -> FitIns:
        cid = self._proxy_id(proxy)
        config: Dict[str, Scalar] = dict(ins.config)
        config[self.cid_key or "cid"] = cid
        names, extra = [], []
        for key, val in self.aggregator.client_payload(cid).items():
            if val is None:
                continue
            if isinstance(val, torch.Tensor):
                names.append(key)
                extra.append(ndarray_to_bytes(val.detach().to("cpu", torch.float32).contiguous().reshape(-1).numpy()))
            elif isinstance(val, (bool, int, float, str, np.generic)):
                config[key] = val.item() if isinstance(val, np.generic) else val
            else:
                raise TypeError(
                    f"flower: client_payload[{key!r}] of type {type(val).__name__} cannot be sent "
                    f"(tensors, numbers, strings and booleans can)"
                )
        config[PAYLOAD_KEY] = json.dumps(names)
        return FitIns(
            Parameters(tensors=list(ins.parameters.tensors) + extra, tensor_type=ins.parameters.tensor_type), config
        )

    def _setup(self) -> None:
        if not self._ready:
            n_cl = self.num_clients if self.num_clients is not None else self.aggregator.num_clients
            self.aggregator.setup(self.spec if self.spec is not None else self.aggregator.spec, n_cl, self._global)
            self._ready = True

    def _to_parameters(self, flat: torch.Tensor) -> Parameters:
        arrs, off = [], 0
        v = flat.detach().cpu().numpy()
        for shp, dt in zip(self._shapes, self._dtypes):
            n = int(np.prod(shp, dtype=np.int64))
            arrs.append(v[off : off + n].reshape(shp).astype(dt, copy=False))
            off += n
        return ndarrays_to_parameters(arrs)

    # ---- aggregation --------------------------------------------------------------------------------
    def _proxy_id(self, proxy) -> int:
        """Dense ids in order of first appearance of each proxy's ``cid`` (configure or results)."""
        key = str(getattr(proxy, "cid", id(proxy)))
        if key not in self._ids:
            self._ids[key] = len(self._ids)
        return self._ids[key]

    def _client_id(self, proxy, res: FitRes) -> int:
        if self.cid_key and self.cid_key in res.metrics:
            return int(res.metrics[self.cid_key])
        return self._proxy_id(proxy)

    def aggregate_fit(
        self, server_round: int, results: List[Tuple[Any, FitRes]], failures: List[Any]
    ) -> Tuple[Optional[Parameters], Dict[str, Scalar]]:
        if not results:
            return None, {}
        if not self.accept_failures and failures:
            return None, {}
        if self._global is None:
            self.set_global(results[0][1].parameters)  # no configure_fit seen: measure against client 0
        K, d = len(results), self._global.numel()
        nmodel = len(self._shapes)
        if self._buf is None or self._buf.size(0) < K or self._buf.size(1) != d:
            self._buf = torch.empty(K, d, dtype=torch.float32)
        U = self._buf[:K]
        Unp, gnp = U.numpy(), self._global.numpy()
        ids, n, pls = [], [], []
        for k, (proxy, res) in enumerate(results):
            tens = res.parameters.tensors
            if len(tens) != nmodel + len(self.vector_payloads):
                raise ValueError(
                    f"flower: client result {k} has {len(tens)} tensors, expected {nmodel} model "
                    f"tensors + {len(self.vector_payloads)} vector payloads"
                )
            decode_into(tens[:nmodel], Unp[k], self._shapes, minus=gnp)  # row = local - global
            pl: Dict[str, Any] = {}
            for key, val in res.metrics.items():
                if key != self.cid_key and isinstance(val, (int, float)) and not isinstance(val, bool):
                    pl[key] = val
            for j, name in enumerate(self.vector_payloads):
                vec = torch.empty(d, dtype=torch.float32)
                b = tens[nmodel + j]
                shp, _, dt, hdr = _npy_header(b)
                np.copyto(vec.numpy(), np.frombuffer(b, dtype=dt, count=d, offset=hdr), casting="same_kind")
                pl[name] = vec
            ids.append(self._client_id(proxy, res))
            n.append(float(res.num_examples))
            pls.append(pl)
        self._setup()
        new, info = self.aggregator.aggregate(self._global, U, n, ids, pls)
        self._global.copy_(new)
        metrics = json_safe_metrics(info, self.metrics_prefix)
        if self.fit_metrics_aggregation_fn:
            metrics.update(self.fit_metrics_aggregation_fn([(r.num_examples, r.metrics) for _, r in results]))
        return self._to_parameters(new), metrics


# ==== Flower's Message API (flwr.serverapp.strategy, ``strategy.start(grid=..., ...)``) ===========
try:
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.serverapp.strategy import FedAvg as _MessageFedAvg
except ImportError:  # pragma: no cover - Flower older than the Message API (1.21)
    _MessageFedAvg = None

PAYLOAD_CONFIG_KEY = "fedkernels_payload_config"
_MessageBase: Any = _MessageFedAvg if _MessageFedAvg is not None else object


def unpack_payload(content: "RecordDict") -> Dict[str, Any]:
    """Client side of ``FedKernelsMessageStrategy(client_payloads=True)``: the payload in a train
    message's content, ``{name: float32 tensor}`` from its ``"fedkernels_payload"`` ArrayRecord and
    ``{name: value}`` from its ``"fedkernels_payload_config"`` ConfigRecord ({} when none was sent).
    A client sends tensors back the same way: an ArrayRecord under ``"fedkernels_payload"``."""
    out: Dict[str, Any] = {}
    if PAYLOAD_KEY in content.array_records:
        for name, arr in content.array_records[PAYLOAD_KEY].items():
            out[name] = torch.from_numpy(np.asarray(arr.numpy(), dtype=np.float32).reshape(-1))
    if PAYLOAD_CONFIG_KEY in content.config_records:
        out.update(dict(content.config_records[PAYLOAD_CONFIG_KEY]))
    return out


def metric_record(info: Dict[str, Any], prefix: str = "") -> "MetricRecord":
    """A Flower ``MetricRecord`` of an aggregator's ``info``: numbers as they are (booleans as 0/1),
    one-element tensors as numbers, lists/tensors of numbers as float lists. Entries a MetricRecord
    cannot hold (strings, dicts, None) are left out; the full ``info`` is the strategy's ``last_info``."""
    rec = MetricRecord()
    for k, v in info.items():
        if isinstance(v, torch.Tensor):
            v = v.item() if v.numel() == 1 else v.detach().double().reshape(-1).tolist()
        elif isinstance(v, np.generic):
            v = v.item()
        elif isinstance(v, np.ndarray):
            v = v.astype(np.float64).reshape(-1).tolist()
        if isinstance(v, bool):
            v = int(v)
        if isinstance(v, (int, float)):
            rec[f"{prefix}{k}"] = v
        elif (
            isinstance(v, (list, tuple))
            and v
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)
        ):
            rec[f"{prefix}{k}"] = [float(x) for x in v]
    return rec


class FedKernelsMessageStrategy(_MessageBase):
    """Any fedkernels aggregator as a strategy of Flower's Message API (``flwr.serverapp.strategy``).

    It is Flower's message-based ``FedAvg`` (node sampling, evaluation, ``start(grid, initial_arrays,
    num_rounds, ...)``, all its options) with ``aggregate_train`` done by ``aggregator``: each reply's
    model ArrayRecord is decoded straight into a row of a preallocated K x d float32 buffer as
    ``local - global`` (the global model is the one ``configure_train`` sent this round) and handed to
    ``aggregator.aggregate``; the new model goes back as an ArrayRecord with the original keys, shapes
    and dtypes, with the aggregator's ``info`` (numbers) and the clients' averaged train metrics.

    Replies: exactly one MetricRecord holding ``weighted_by_key`` (default ``"num-examples"``: the
    client's sample count); its other numbers become the aggregator's payload for that client (e.g.
    FedNova's ``local_steps``), and tensors in an optional ArrayRecord ``"fedkernels_payload"``
    (e.g. SCAFFOLD's ``delta_c``) too. The client id is ``metrics[cid_key]`` when present (default
    ``"cid"``), otherwise the sender's node id mapped to dense ids ``0, 1, ...`` in order of first
    appearance (stateful aggregators index their tables by it, in ``[0, num_clients)``).

    ``client_payloads=True``: each sampled node also receives its ``aggregator.client_payload(cid)``
    (SCAFFOLD's ``c``/``c_i``, FedECADO's flow, FedPVR's variates): tensors in an ArrayRecord
    ``"fedkernels_payload"``, numbers/strings/booleans in a ConfigRecord
    ``"fedkernels_payload_config"``, and ``config[cid_key]`` = its id; clients read them with
    ``unpack_payload(msg.content)``. Replies with an error are left out of the round (Flower's
    FedAvg does the same) and counted in the metric ``fedkernels_failures``.
    """

    def __init__(
        self,
        aggregator: Aggregator,
        *,
        num_clients: Optional[int] = None,
        cid_key: str = "cid",
        client_payloads: bool = False,
        metrics_prefix: str = "",
        spec: Any = None,
        **fedavg_kw: Any,
    ) -> None:
        if _MessageFedAvg is None:
            raise ImportError(
                "FedKernelsMessageStrategy needs Flower's Message API (flwr>=1.21): "
                "pip install --no-build-isolation '.[flower]'"
            )
        if not isinstance(aggregator, Aggregator):
            raise TypeError(
                f"FedKernelsMessageStrategy: aggregator must be a fedkernels Aggregator, got "
                f"{type(aggregator).__name__}"
            )
        if num_clients is not None and (
            isinstance(num_clients, bool) or not isinstance(num_clients, int) or num_clients < 1
        ):
            raise ValueError(f"FedKernelsMessageStrategy: num_clients must be a positive int, got {num_clients!r}")
        super().__init__(**fedavg_kw)
        self.aggregator = aggregator
        self.num_clients = num_clients
        self.cid_key = cid_key
        self.client_payloads = bool(client_payloads)
        self.metrics_prefix = metrics_prefix
        self.spec = spec
        self.last_info: Dict[str, Any] = {}
        self._keys: List[str] = []
        self._shapes: List[Tuple[int, ...]] = []
        self._dtypes: List[np.dtype] = []
        self._global: Optional[torch.Tensor] = None
        self._buf: Optional[torch.Tensor] = None
        self._ids: Dict[int, int] = {}
        self._ready = False

    def __repr__(self) -> str:
        return f"FedKernelsMessageStrategy({self.aggregator!r})"

    def summary(self) -> None:
        super().summary()
        from flwr.supercore import log
        from logging import INFO

        log(INFO, "\t└──> fedkernels aggregator: %r (client payloads: %s)", self.aggregator, self.client_payloads)

    # ---- the global model -------------------------------------------------------------------------
    def set_global(self, arrays: "ArrayRecord") -> None:
        """Records the global model (keys, shapes, dtypes, values) the next replies are measured against."""
        keys = list(arrays.keys())
        if not keys:
            raise ValueError("FedKernelsMessageStrategy: the global ArrayRecord is empty")
        for k in keys:
            if arrays[k].stype != "numpy.ndarray":
                raise ValueError(
                    f"FedKernelsMessageStrategy: array {k!r} has stype {arrays[k].stype!r}, expected 'numpy.ndarray'"
                )
        shapes = [tuple(int(s) for s in arrays[k].shape) for k in keys]
        d = int(sum(int(np.prod(s, dtype=np.int64)) for s in shapes))
        if self._global is None or self._global.numel() != d:
            self._global = torch.empty(d, dtype=torch.float32)
        self._keys, self._shapes = keys, shapes
        self._dtypes = [np.dtype(arrays[k].dtype) for k in keys]
        decode_into([arrays[k].data for k in keys], self._global.numpy(), shapes)

    def _to_arrays(self, flat: torch.Tensor) -> "ArrayRecord":
        v = flat.detach().cpu().numpy()
        out, off = {}, 0
        for key, shp, dt in zip(self._keys, self._shapes, self._dtypes):
            n = int(np.prod(shp, dtype=np.int64))
            out[key] = Array(np.ascontiguousarray(v[off : off + n].reshape(shp).astype(dt, copy=False)))
            off += n
        return ArrayRecord(out)

    def _setup(self) -> None:
        if not self._ready:
            n_cl = self.num_clients if self.num_clients is not None else self.aggregator.num_clients
            self.aggregator.setup(self.spec if self.spec is not None else self.aggregator.spec, n_cl, self._global)
            self._ready = True

    def _node_cid(self, node_id: int) -> int:
        if node_id not in self._ids:
            self._ids[node_id] = len(self._ids)
        return self._ids[node_id]

    # ---- training round -----------------------------------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: "ArrayRecord", config: "ConfigRecord", grid: Any
    ) -> List["Message"]:
        self.set_global(arrays)
        msgs = list(super().configure_train(server_round, arrays, config, grid))
        for m in msgs:
            self._node_cid(m.metadata.dst_node_id)
        if not self.client_payloads:
            return msgs
        self._setup()
        return [self._with_payload(m) for m in msgs]

    def _with_payload(self, msg: "Message") -> "Message":
        cid = self._node_cid(msg.metadata.dst_node_id)
        cfg = ConfigRecord(dict(msg.content.config_records[self.configrecord_key]))
        cfg[self.cid_key or "cid"] = cid
        tensors: Dict[str, Any] = {}
        scalars = ConfigRecord()
        for key, val in self.aggregator.client_payload(cid).items():
            if val is None:
                continue
            if isinstance(val, torch.Tensor):
                tensors[key] = Array(val.detach().to("cpu", torch.float32).contiguous().reshape(-1).numpy())
            elif isinstance(val, (bool, int, float, str, np.generic)):
                scalars[key] = val.item() if isinstance(val, np.generic) else val
            else:
                raise TypeError(
                    f"flower: client_payload[{key!r}] of type {type(val).__name__} cannot be sent "
                    f"(tensors, numbers, strings and booleans can)"
                )
        content = RecordDict(
            {
                self.arrayrecord_key: msg.content.array_records[self.arrayrecord_key],
                self.configrecord_key: cfg,
                PAYLOAD_KEY: ArrayRecord(tensors),
                PAYLOAD_CONFIG_KEY: scalars,
            }
        )
        return Message(
            content=content,
            dst_node_id=msg.metadata.dst_node_id,
            message_type=msg.metadata.message_type,
            group_id=msg.metadata.group_id or None,
        )

    def _reply_parts(self, k: int, msg: "Message") -> Tuple["ArrayRecord", "MetricRecord", Optional["ArrayRecord"]]:
        c = msg.content
        models = [name for name in c.array_records if name != PAYLOAD_KEY]
        if len(models) != 1 or len(c.metric_records) != 1:
            raise ValueError(
                f"flower: reply {k} (node {msg.metadata.src_node_id}) holds ArrayRecords {models} and "
                f"{len(c.metric_records)} MetricRecords; expected one model ArrayRecord (plus an "
                f"optional {PAYLOAD_KEY!r}) and one MetricRecord"
            )
        arrays = c.array_records[models[0]]
        metrics = next(iter(c.metric_records.values()))
        if list(arrays.keys()) != self._keys:
            raise ValueError(
                f"flower: reply {k} has arrays {list(arrays.keys())}, expected the global model's {self._keys}"
            )
        w = metrics.get(self.weighted_by_key)
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not w >= 0:
            raise ValueError(
                f"flower: reply {k} metrics[{self.weighted_by_key!r}] = {w!r}; expected the client's "
                "number of examples (a number >= 0)"
            )
        return arrays, metrics, c.array_records.get(PAYLOAD_KEY)

    def aggregate_train(
        self, server_round: int, replies: Any
    ) -> Tuple[Optional["ArrayRecord"], Optional["MetricRecord"]]:
        replies = list(replies)
        valid = [m for m in replies if not m.has_error()]
        failures = len(replies) - len(valid)
        if not valid:
            return None, (MetricRecord({"fedkernels_failures": failures}) if failures else None)
        if self._global is None:
            raise RuntimeError(
                "FedKernelsMessageStrategy.aggregate_train: no global model; configure_train "
                "(or set_global) must run first in the round"
            )
        parts = [self._reply_parts(k, m) for k, m in enumerate(valid)]
        K, d = len(valid), self._global.numel()
        if self._buf is None or self._buf.size(0) < K or self._buf.size(1) != d:
            self._buf = torch.empty(K, d, dtype=torch.float32)
        U = self._buf[:K]
        Unp, gnp = U.numpy(), self._global.numpy()
        ids, n, pls = [], [], []
        for k, (msg, (arrays, metrics, extra)) in enumerate(zip(valid, parts)):
            decode_into([arrays[key].data for key in self._keys], Unp[k], self._shapes, minus=gnp)
            pl: Dict[str, Any] = {}
            for key, val in metrics.items():
                if key in (self.cid_key, self.weighted_by_key):
                    continue
                pl[key] = torch.tensor(val, dtype=torch.float64) if isinstance(val, list) else val
            if extra is not None:
                for name, arr in extra.items():
                    pl[name] = torch.from_numpy(np.asarray(arr.numpy(), dtype=np.float32).reshape(-1))
            if self.cid_key and self.cid_key in metrics:
                ids.append(int(metrics[self.cid_key]))
            else:
                ids.append(self._node_cid(msg.metadata.src_node_id))
            n.append(float(metrics[self.weighted_by_key]))
            pls.append(pl)
        self._setup()
        new, info = self.aggregator.aggregate(self._global, U, n, ids, pls)
        self._global.copy_(new)
        self.last_info = dict(info)
        out = metric_record(info, self.metrics_prefix)
        client_avg = self.train_metrics_aggr_fn([m.content for m in valid], self.weighted_by_key)
        for key, val in client_avg.items():
            if key != self.cid_key and key not in out:
                out[key] = val
        out["fedkernels_failures"] = failures
        return self._to_arrays(new), out
