"""CPU benchmark: the adaptive server optimisers (FedAdam / FedYogi / FedAdagrad).

    python -m bench.server_opt [--quick] [--d N] [--Ks 10,100] [--flower]

Step rows (d = 11,220,132 = ResNet-18 by default, fp32 model and fp32 state): ``ops.server_opt_step_``
(one fused pass: reads the pseudo-gradient, x, m, v and writes the new model, m, v: 7 d-vectors, 28
bytes per coordinate) against the torch composition of the same maths (``m.mul_().add_()``,
``v.mul_().addcmul_()`` or Yogi's sign term, ``sqrt().add_()``, ``addcdiv``: about 15-19 d-vectors
moved) and against the floor, 28 d bytes at the bandwidth of a d-element copy timed in the same rounds.

Aggregate rows (K = 10 and 100 clients): ``fedadam`` / ``fedyogi`` / ``fedadagrad``'s whole
``aggregate`` (the screened weighted_sum pass over U, then the fused step) against ``fedavg``'s
(the screened weighted_sum pass with the base added), the target being <= 1.3x. ``--flower`` adds
Flower's ``FedAdam.aggregate_fit`` at the smallest K (NumPy, the clients' models as ndarrays).

Timings are interleaved (one sample of each function per round, bench/common.compare): load from other
processes hits all alike; median and min are recorded. Writes cpu-server-opt.json (``--out``).
"""

from __future__ import annotations

import argparse
from typing import Dict, List

import torch

from fedkernels import algorithms, ops

from .common import add_out_argument, compare, print_table, write_json

D_RESNET18 = 11_220_132
OPTS = {
    "adam": dict(beta_1=0.9, beta_2=0.99, tau=1e-9),
    "yogi": dict(beta_1=0.9, beta_2=0.99, tau=1e-3),
    "adagrad": dict(beta_1=0.0, beta_2=0.0, tau=1e-9),
}


def torch_step(rule: str, io, m, v, x, lr, beta_1, beta_2, tau):
    """The same maths as ops.server_opt_step_ in torch ops (what a user writes; Flower's order)."""
    m.mul_(beta_1).add_(io, alpha=1 - beta_1)
    if rule == "adam":
        v.mul_(beta_2).addcmul_(io, io, value=1 - beta_2)
    elif rule == "yogi":
        g2 = io * io
        v.sub_(g2.mul_(torch.sign(v - g2)), alpha=1 - beta_2)
    else:
        v.addcmul_(io, io)
    torch.addcdiv(x, m, v.sqrt().add_(tau), value=lr, out=io)


def step_rows(d: int, repeats: int) -> List[Dict[str, object]]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(d, generator=gen)
    g = 0.01 * torch.randn(d, generator=gen)
    rows = []
    for rule, o in OPTS.items():
        bufs = {k: (g.clone(), torch.zeros(d), torch.full((d,), 1e-4)) for k in ("op", "torch")}

        def op(b=bufs["op"], rule=rule, o=o):
            b[0].copy_(g)  # (the copy is timed in both: the pseudo-gradient's write)
            ops.server_opt_step_(b[0], b[1], b[2], x, rule=rule, lr=0.01, **o)

        def comp(b=bufs["torch"], rule=rule, o=o):
            b[0].copy_(g)
            torch_step(rule, b[0], b[1], b[2], x, 0.01, **o)

        def refill(b=bufs["op"]):
            b[0].copy_(g)  # the copy alone, subtracted below

        t = compare({"op": op, "torch": comp, "copy": refill}, repeats=repeats, min_time=0.0)
        top = t["op"]["median_s"] - t["copy"]["median_s"]
        ttorch = t["torch"]["median_s"] - t["copy"]["median_s"]
        # the floor: 28 bytes a coordinate at the bandwidth of the interleaved copy (8 bytes a coordinate),
        # measured in the same rounds as the op (a busy machine's bandwidth moves between probes)
        floor_s = 3.5 * t["copy"]["median_s"]
        rows.append(
            {
                "row": f"step {rule}",
                "d": d,
                "op_ms": 1e3 * top,
                "torch_ms": 1e3 * ttorch,
                "floor_ms": 1e3 * floor_s,
                "op/floor": top / floor_s,
                "torch/op": ttorch / top,
                "op_min_ms": 1e3 * (t["op"]["min_s"] - t["copy"]["min_s"]),
            }
        )
    return rows


def aggregate_rows(d: int, Ks: List[int], repeats: int, flower: bool) -> List[Dict[str, object]]:
    rows = []
    x = torch.randn(d, generator=torch.Generator().manual_seed(1))
    base = 0.01 * torch.randn(d, generator=torch.Generator().manual_seed(2))
    for K in Ks:
        U = base * torch.linspace(0.5, 1.5, K).unsqueeze(1)  # [K, d] fp32 (values do not matter)
        n = list(range(10, 10 + K))
        aggs = {name: algorithms.build(name) for name in ("fedavg", "fedadam", "fedyogi", "fedadagrad")}
        fns = {name: (lambda a=a, U=U, n=n: a.aggregate(x, U, n)) for name, a in aggs.items()}
        t = compare(fns, repeats=repeats, min_time=0.0)
        ref = t["fedavg"]["median_s"]
        for name in aggs:
            rows.append(
                {
                    "row": f"aggregate {name}",
                    "K": K,
                    "d": d,
                    "ms": 1e3 * t[name]["median_s"],
                    "min_ms": 1e3 * t[name]["min_s"],
                    "x fedavg": t[name]["median_s"] / ref,
                }
            )
        if flower and K == min(Ks):
            rows.append(flower_row(x, U, n, t["fedadam"]["median_s"]))
        del U
    return rows


def flower_row(x, U, n, ours_s) -> Dict[str, object]:
    """Flower's FedAdam.aggregate_fit on the same round (the clients' full models as one ndarray each)."""
    import time

    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
    from flwr.server.strategy import FedAdam

    xs = x.numpy()
    res = [
        (None, FitRes(Status(Code.OK, ""), ndarrays_to_parameters([xs + U[k].numpy()]), n[k], {}))
        for k in range(U.size(0))
    ]
    ts = []
    for r in range(3):
        st = FedAdam(initial_parameters=ndarrays_to_parameters([xs]))
        t0 = time.perf_counter()
        st.aggregate_fit(1, res, [])
        ts.append(time.perf_counter() - t0)
    t = sorted(ts)[1]
    return {
        "row": "aggregate flower FedAdam",
        "K": U.size(0),
        "d": x.numel(),
        "ms": 1e3 * t,
        "x fedkernels fedadam": t / ours_s,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="d = 1e6, K = 10, 5 repeats")
    ap.add_argument("--d", type=int, default=D_RESNET18)
    ap.add_argument("--Ks", default="10,100")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--flower", action="store_true", help="also time Flower's FedAdam.aggregate_fit (needs flwr)")
    add_out_argument(ap)
    a = ap.parse_args(argv)
    d, Ks, reps = (1_000_000, [10], 5) if a.quick else (a.d, [int(k) for k in a.Ks.split(",")], a.repeats)
    rows = step_rows(d, reps)
    print_table(rows, ["row", "d", "op_ms", "torch_ms", "floor_ms", "op/floor", "torch/op"])
    arows = aggregate_rows(d, Ks, reps, a.flower)
    print_table(arows, ["row", "K", "d", "ms", "min_ms", "x fedavg", "x fedkernels fedadam"])
    path = write_json("cpu-server-opt.json", rows + arows, {"threads": torch.get_num_threads()}, out=a.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
