"""The cost of differential privacy in the aggregate (CPU): DP-FedAvg vs FedAvg, and Flower's DP wrapper.

    python -m bench.dp [--quick] [--K 10,100] [--d 11200000] [--out DIR]

ResNet-18 size (d = 11.2M fp32), K = 10 and 100 clients. Rows, each a full aggregate on the same U:

* ``fedavg``: ``algorithms.build("fedavg").aggregate`` (one screening weighted sum: K d reads);
* ``dp_central``: ``build("fedavg", dp={kind: central})``: the norms' kstats pass, then the weighted sum
  with the clip factors as coefficients and the Gaussian noise drawn in its output write (two reads of U);
  target <= 2.1x fedavg;
* ``dp_client``: ``kind: client`` (the clients clipped; the simulator clips each row as it writes it): one
  screening read of U, then the noise added to the result; target <= 1.15x fedavg;
* ``noise_only``: ``ops.add_gaussian_noise_`` on d values (the generator's share: Philox4x32-10 +
  Box-Muller in float64, ~20 ns per column pair on one core) and ``torch.randn`` of d fp32 for scale;
* ``flower_fedavg`` / ``flower_dp_central``: Flower's ``aggregate`` on per-client NDArray lists, and its
  ``DifferentialPrivacyServerSideFixedClipping`` arithmetic over it (``compute_clip_model_update`` per
  client, FedAvg's ``aggregate``, ``add_gaussian_noise_inplace`` with ``compute_stdv``), timed without
  the Parameters (de)serialisation;
* ``client_clip_row``: ``flat.clip_rows_`` of one row (the client-side clipping the simulator does while
  the row is written), against ``row.sub_(global)`` of the same row (the write's own last pass).

Prints ratios against fedavg and Flower; writes runs/bench/cpu-dp.json (``--out``).
"""

from __future__ import annotations

import argparse
import gc

import numpy as np
import torch

from bench.common import add_out_argument, compare, copy_bandwidth, print_table, timeit, write_json
from fedkernels import algorithms, ops
from fedkernels.flat import clip_rows_

try:
    from flwr.server.strategy.aggregate import aggregate as flwr_aggregate
    from flwr.supercore.differential_privacy import add_gaussian_noise_inplace, compute_clip_model_update, compute_stdv
except ImportError:  # flwr not installed: the Flower rows are left out
    flwr_aggregate = None

DP = dict(clip=1.0, noise_multiplier=1.0, population=1000, seed=1)


def _layers(U: torch.Tensor, cuts: int = 62):
    """Each row of U as a list of ~62 NumPy arrays (a ResNet-18 has 62 tensors): Flower's NDArrays."""
    d = U.size(1)
    edges = np.linspace(0, d, cuts + 1).astype(int)
    return [[u[a:b].numpy() for a, b in zip(edges[:-1], edges[1:])] for u in U]


def bench_K(K: int, d: int, repeats: int, flower: bool):
    g = torch.Generator().manual_seed(K)
    U = torch.randn(K, d, generator=g) * 1e-3
    gflat = torch.randn(d, generator=g)
    n = torch.ones(K, dtype=torch.float64)
    ids = list(range(K))
    aggs = {
        "fedavg": algorithms.build("fedavg"),
        "dp_central": algorithms.build("fedavg", dp=dict(DP, kind="central")),
        "dp_client": algorithms.build("fedavg", dp=dict(DP, kind="client")),
    }
    x = torch.empty(d)
    fns = {k: (lambda a=a, U=U: a.aggregate(gflat, U, n, ids)) for k, a in aggs.items()}
    fns["noise_only"] = lambda: ops.add_gaussian_noise_(x, 0.1, 1, 2)
    fns["torch_randn"] = lambda: torch.randn(d, out=x)
    t = compare(fns, repeats=repeats, min_time=0.0)
    rows = []
    base = t["fedavg"]["median_s"]
    for k, v in t.items():
        rows.append(
            {
                "K": K,
                "d": d,
                "what": k,
                "median_ms": 1e3 * v["median_s"],
                "min_ms": 1e3 * v["min_s"],
                "x_fedavg": v["median_s"] / base,
                "GBps_U": K * d * 4 / v["median_s"] / 1e9,
            }
        )
    row = U[0].clone()
    clips = iter(1e-3 * 0.999 ** np.arange(10_000))  # a smaller C each call: every call scales the row
    rows.append(
        {
            "K": K,
            "d": d,
            "what": "client_clip_row",
            "median_ms": 1e3 * timeit(lambda: clip_rows_(row.unsqueeze(0), float(next(clips))), repeats=repeats),
            "min_ms": None,
        }
    )
    rows.append(
        {
            "K": K,
            "d": d,
            "what": "row_sub_global (write_delta's last pass)",
            "median_ms": 1e3 * timeit(lambda: row.sub_(gflat), repeats=repeats),
            "min_ms": None,
        }
    )
    if flower and flwr_aggregate is not None:
        layers = _layers(U)
        glayers = [a.copy() for a in _layers(gflat.unsqueeze(0))[0]]
        params = [[gl + ul for gl, ul in zip(glayers, u)] for u in layers]  # the clients' models
        del layers
        gc.collect()

        def flower_fedavg():
            return flwr_aggregate([(p, 1) for p in params])

        def flower_dp():
            clipped = []
            for p in params:
                q = [a.copy() for a in p]  # Flower clips the FitRes' arrays in place
                compute_clip_model_update(q, glayers, DP["clip"])
                clipped.append((q, 1))
            agg = flwr_aggregate(clipped)
            add_gaussian_noise_inplace(agg, compute_stdv(DP["noise_multiplier"], DP["clip"], K))
            return agg

        reps = max(1, repeats // 3)
        tf = {
            "flower_fedavg": timeit(flower_fedavg, repeats=reps, warmup=0),
            "flower_dp_central": timeit(flower_dp, repeats=reps, warmup=0),
        }
        for k, v in tf.items():
            rows.append(
                {
                    "K": K,
                    "d": d,
                    "what": k,
                    "median_ms": 1e3 * v,
                    "min_ms": None,
                    "x_fedavg": v / base,
                    "GBps_U": K * d * 4 / v / 1e9,
                }
            )
        del params
    for r in rows:
        if r["what"] in ("dp_central", "dp_client", "flower_dp_central"):
            r["x_flower_dp"] = None
    fl = {r["what"]: r["median_ms"] for r in rows}
    if "flower_dp_central" in fl:
        for r in rows:
            if r["what"] in ("dp_central", "dp_client"):
                r["flower_dp_over_this"] = fl["flower_dp_central"] / r["median_ms"]
    del U
    gc.collect()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="d = 1M, K = 10, 3 repeats")
    ap.add_argument("--K", default="10,100")
    ap.add_argument("--d", type=int, default=11_200_000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--no-flower", action="store_true")
    add_out_argument(ap)
    a = ap.parse_args(argv)
    Ks = [10] if a.quick else [int(k) for k in a.K.split(",")]
    d = 1_000_000 if a.quick else a.d
    reps = 3 if a.quick else a.repeats
    rows = []
    for K in Ks:
        rows += bench_K(K, d, reps, not a.no_flower)
    print_table(rows, ["K", "d", "what", "median_ms", "min_ms", "x_fedavg", "GBps_U", "flower_dp_over_this"])
    print(
        f"copy bandwidth {copy_bandwidth() / 1e9:.1f} GB/s; targets: dp_central <= 2.1x fedavg, "
        "dp_client <= 1.15x fedavg"
    )
    path = write_json("cpu-dp.json", rows, {"threads": torch.get_num_threads(), "d": d, "Ks": Ks}, out=a.out)
    print("wrote", path)


if __name__ == "__main__":
    main()
