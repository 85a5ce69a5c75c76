"""Flower adapter: any fedkernels aggregator as a Flower ``Strategy`` (``pip install fedkernels[flower]``).

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
    from flwr.common import (FitIns, FitRes, Parameters, Scalar, ndarray_to_bytes, ndarrays_to_parameters,
                             parameters_to_ndarrays)
    from flwr.server.strategy import FedAvg
except ImportError as err:  # pragma: no cover - exercised only without flwr
    raise ImportError("fedkernels.integrations.flower needs Flower: pip install 'fedkernels[flower]'") from err

from ..algorithms.base import Aggregator

__all__ = ["FedKernelsStrategy", "json_safe_metrics", "decode_into", "unpack_fit_ins"]

PAYLOAD_KEY = "fedkernels_payload"


def unpack_fit_ins(arrays: Sequence[np.ndarray], config: Dict[str, Any]
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


def decode_into(tensors: Sequence[bytes], out: np.ndarray, shapes: Sequence[Tuple[int, ...]],
                minus: Optional[np.ndarray] = None) -> None:
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
            np.copyto(out[off:off + n], src, casting="same_kind")
        else:
            np.subtract(src, minus[off:off + n], out=out[off:off + n], casting="same_kind")
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

    def __init__(self, aggregator: Aggregator, *, num_clients: Optional[int] = None, cid_key: str = "cid",
                 vector_payloads: Sequence[str] = (), client_payloads: bool = False, metrics_prefix: str = "",
                 spec=None, **fedavg_kw):
        super().__init__(**fedavg_kw)
        if not isinstance(aggregator, Aggregator):
            raise TypeError(f"FedKernelsStrategy: aggregator must be a fedkernels Aggregator, got {type(aggregator).__name__}")
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

    def initialize_parameters(self, client_manager):
        params = super().initialize_parameters(client_manager)
        if params is not None:
            self.set_global(params)
        return params

    def configure_fit(self, server_round, parameters, client_manager):
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
                raise TypeError(f"flower: client_payload[{key!r}] of type {type(val).__name__} cannot be sent "
                                f"(tensors, numbers, strings and booleans can)")
        config[PAYLOAD_KEY] = json.dumps(names)
        return FitIns(Parameters(tensors=list(ins.parameters.tensors) + extra,
                                 tensor_type=ins.parameters.tensor_type), config)

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
            arrs.append(v[off:off + n].reshape(shp).astype(dt, copy=False))
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

    def aggregate_fit(self, server_round: int, results, failures):
        if not results:
            return None, {}
        if not self.accept_failures and failures:
            return None, {}
        if self._global is None:
            self.set_global(results[0][1].parameters)   # no configure_fit seen: measure against client 0
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
                raise ValueError(f"flower: client result {k} has {len(tens)} tensors, expected {nmodel} model "
                                 f"tensors + {len(self.vector_payloads)} vector payloads")
            decode_into(tens[:nmodel], Unp[k], self._shapes, minus=gnp)   # row = local - global
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
