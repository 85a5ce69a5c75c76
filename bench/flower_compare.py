"""Flower's FedAvg.aggregate_fit vs FedKernelsStrategy(FedAvg) on the same FitRes objects.

    python -m bench.flower_compare [--quick]

Both sides start from Flower ``Parameters`` (np.save bytes per tensor) and return ``Parameters``.
Reported: end-to-end aggregate_fit time, and the aggregation arithmetic alone (Flower's
``aggregate`` on decoded NDArrays vs ``aggregator.aggregate`` on the K x d buffer), the ratio of
the two, and the achieved bandwidth of fedkernels' arithmetic (bytes of U read / time).
Writes cpu-flower.json (``--out``; bench/common.py).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from bench.common import add_out_argument, copy_bandwidth, print_table, timeit, write_json

try:
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server.client_proxy import ClientProxy
    from flwr.server.strategy import FedAvg
    from flwr.server.strategy.aggregate import aggregate as flwr_aggregate
except ImportError:
    print("flwr is not installed: pip install 'fedkernels[flower]'")
    sys.exit(0)

from fedkernels import algorithms
from fedkernels.integrations.flower import FedKernelsStrategy


class _Proxy(ClientProxy):
    def get_properties(self, *a):
        raise RuntimeError

    def get_parameters(self, *a):
        raise RuntimeError

    def fit(self, *a):
        raise RuntimeError

    def evaluate(self, *a):
        raise RuntimeError

    def reconnect(self, *a):
        raise RuntimeError


def layer_shapes(d_target: int):
    """A CNN-like list of tensors (conv blocks + biases/norms + a classifier) summing to ~d_target."""
    shapes, d, c = [], 0, 16
    while d < d_target * 0.9:
        w = (c * 2, c, 3, 3)
        for s in (w, (c * 2,), (c * 2,), (c * 2,)):
            shapes.append(s)
            d += int(np.prod(s))
        c = min(c * 2, 512)
    shapes += [(10, 512), (10,)]
    return shapes


def make_results(shapes, K, seed=0):
    rng = np.random.default_rng(seed)
    glob = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    res = []
    for k in range(K):
        arrs = [g + 0.01 * rng.standard_normal(g.shape, dtype=np.float32) for g in glob]
        res.append(
            (_Proxy(str(k)), FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrs), int(rng.integers(10, 100)), {}))
        )
    return glob, res


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    configs = [(1_000_000, 10), (11_000_000, 10)] if not args.quick else [(500_000, 8)]
    rows = []
    for d_target, K in configs:
        shapes = layer_shapes(d_target)
        d = int(sum(np.prod(s) for s in shapes))
        glob, res = make_results(shapes, K)
        gp = ndarrays_to_parameters(glob)
        flower = FedAvg()  # inplace=True: Flower's default
        ours = FedKernelsStrategy(algorithms.build("fedavg"))
        ours.set_global(gp)
        rep = 3 if d > 5e6 else 5
        t_fl = timeit(lambda: flower.aggregate_fit(1, res, []), repeats=rep)
        t_fk = timeit(lambda: (ours.set_global(gp), ours.aggregate_fit(1, res, [])), repeats=rep)
        # arithmetic only: Flower's aggregate on decoded arrays vs the aggregator on the buffer
        decoded = [(parameters_to_ndarrays(r.parameters), r.num_examples) for _, r in res]
        t_fl_math = timeit(lambda: flwr_aggregate(decoded), repeats=rep)
        U = ours._buf[:K].clone()
        x = ours._global.clone()
        n = [r.num_examples for _, r in res]
        agg = algorithms.build("fedavg")
        t_fk_math = timeit(lambda: agg.aggregate(x, U, n), repeats=rep)
        # same result
        a = np.concatenate([v.reshape(-1) for v in parameters_to_ndarrays(flower.aggregate_fit(1, res, [])[0])])
        ours.set_global(gp)
        b = np.concatenate([v.reshape(-1) for v in parameters_to_ndarrays(ours.aggregate_fit(1, res, [])[0])])
        err = float(np.max(np.abs(a - b)) / max(1e-30, float(np.max(np.abs(a)))))
        bytes_u = K * d * 4
        rows.append(
            {
                "d": d,
                "K": K,
                "tensors": len(shapes),
                "flower_aggregate_fit_s": t_fl,
                "fedkernels_aggregate_fit_s": t_fk,
                "speedup_end_to_end": t_fl / t_fk,
                "flower_math_s": t_fl_math,
                "fedkernels_math_s": t_fk_math,
                "speedup_math": t_fl_math / t_fk_math,
                "fedkernels_math_GBps": bytes_u / t_fk_math / 1e9,
                "fedkernels_math_vs_copy_bw": bytes_u / t_fk_math / copy_bandwidth(),
                "max_rel_diff": err,
            }
        )
    print_table(
        rows,
        [
            "d",
            "K",
            "flower_aggregate_fit_s",
            "fedkernels_aggregate_fit_s",
            "speedup_end_to_end",
            "flower_math_s",
            "fedkernels_math_s",
            "speedup_math",
            "fedkernels_math_GBps",
            "max_rel_diff",
        ],
    )
    path = write_json(
        "cpu-flower.json",
        rows,
        {
            "flwr": __import__("flwr").__version__,
            "note": "aggregate_fit end to end (Parameters in, Parameters out) "
            "and arithmetic only; Flower FedAvg inplace=True",
        },
        out=args.out,
    )
    print("wrote", path)


if __name__ == "__main__":
    main()
