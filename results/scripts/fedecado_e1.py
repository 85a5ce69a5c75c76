"""FedECADO spec §8 E1: objective inconsistency and multi-rate on quadratics (CPU, about a minute).

N = 20 clients, d = 5, f_i = 0.5 a_i ||x - b_i||^2, a_i ~ U[0.5, 2], b_i ~ N(0, 9 I),
n_i ~ 1000 Dir(0.5) + 1, p_i = n_i / sum n. Every round each active client draws
eta_i ~ U[1e-3, 1e-2] and tau_i ~ U{10..100} and runs tau_i steps of full-gradient descent.
The optimum of sum_i p_i f_i is x* = sum p_i a_i b_i / sum p_i a_i. 100 rounds, participation
in {1.0, 0.5, 0.2}, L in {0.3, 1}, delta = 1e-2, seeds 0, 1, 2.

Methods (the library's aggregators, fed flat float64 vectors):
  fedavg            p-weighted average of the active clients' models (local GD on f_i)
  fednova           FedNova with a_i = tau_i (the simulator's default payload: steps only)
  fednova-lr        FedNova with a_i = eta_i tau_i (learning-rate-aware normalisation)
  fedecado-L*       FedECADO, inactive="frozen" (default), exact Hessian scalar hbar_i = a_i
  fedecado-exclude  inactive="exclude" (the spec's documented negative control)
  fedecado-sync     sync=True: every T_i taken as T_max (ECADO without multi-rate)
FedECADO clients run x <- x - eta (w_i a_i (x - b_i) + I_i), w_i = N p_i, and report T = eta tau.

Writes results/fedecado/e1-quadratics/summary.json (and prints a table):
  python results/scripts/fedecado_e1.py
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import numpy as np
import torch

from fedkernels.algorithms import build

N, D, ROUNDS = 20, 5, 100
OUT = os.path.join(os.path.dirname(__file__), "..", "fedecado", "e1-quadratics")


def problem(seed):
    rng = np.random.default_rng(seed)
    a = rng.uniform(0.5, 2.0, N)
    b = rng.normal(0.0, 3.0, (N, D))
    n = 1000 * rng.dirichlet(np.full(N, 0.5)) + 1
    p = n / n.sum()
    xstar = (p * a) @ b / (p * a).sum()
    return a, b, n, p, xstar


def gd(x, a, b, eta, tau, w=1.0, I=None):
    for _ in range(tau):
        g = w * a * (x - b)
        if I is not None:
            g = g + I
        x = x - eta * g
    return x


def run(method, seed, part, L=None, rounds=ROUNDS):
    a, b, n, p, xstar = problem(seed)
    rng = np.random.default_rng(1000 + seed)  # schedule stream: the same for every method
    b_t = torch.tensor(b)
    x = torch.zeros(D, dtype=torch.float64)
    k = max(1, int(round(part * N)))
    if method.startswith("fedecado"):
        opts = dict(L=L, delta=1e-2, data_sizes=list(n), hbar=list(a))
        if method == "fedecado-exclude":
            opts["inactive"] = "exclude"
        if method == "fedecado-sync":
            opts["sync"] = True
        agg = build("fedecado", **opts)
        agg.setup(None, N, x)
    elif method.startswith("fednova"):
        agg = build("fednova")
    else:
        agg = build("fedavg")
    err, steps = [], 0
    for r in range(rounds):
        eta = rng.uniform(1e-3, 1e-2, N)
        tau = rng.integers(10, 101, N)
        active = sorted(rng.choice(N, k, replace=False).tolist()) if k < N else list(range(N))
        rows, pls = [], []
        for i in active:
            if method.startswith("fedecado"):
                pl = agg.client_payload(i)
                I_i = pl["I"] if pl["I"] is not None else torch.zeros(D, dtype=torch.float64)
                xi = gd(x, a[i], b_t[i], eta[i], int(tau[i]), w=pl["w"], I=I_i)
                pls.append({"T": float(eta[i] * tau[i])})
            else:
                xi = gd(x, a[i], b_t[i], eta[i], int(tau[i]))
                if method == "fednova":
                    pls.append({"local_steps": int(tau[i])})
                elif method == "fednova-lr":
                    pls.append({"local_steps": int(tau[i]), "a_norm": float(eta[i] * tau[i])})
                else:
                    pls.append({})
            rows.append(xi - x)
        x, info = agg.aggregate(x, torch.stack(rows), [float(n[i]) for i in active], active, pls)
        steps += int(info.get("steps", 0))
        err.append(float(torch.linalg.vector_norm(x - torch.tensor(xstar))))
    return {
        "err": err,
        "final": err[-1],
        "at60": err[59] if len(err) >= 60 else None,
        "central_steps_per_round": steps / rounds,
        "finite": bool(all(math.isfinite(e) for e in err)),
    }


def main():
    os.makedirs(OUT, exist_ok=True)
    methods = [("fedavg", None), ("fednova", None), ("fednova-lr", None)]
    for L in (0.3, 1.0):
        methods += [("fedecado", L), ("fedecado-exclude", L), ("fedecado-sync", L)]
    t0 = time.time()
    res = {}
    for part in (1.0, 0.5, 0.2):
        for m, L in methods:
            label = m if L is None else f"{m}-L{L:g}"
            runs = [run(m, s, part, L) for s in (0, 1, 2)]
            fin = np.array([r["final"] for r in runs])
            a60 = np.array([r["at60"] for r in runs])
            res[f"p{part:g}/{label}"] = {
                "participation": part,
                "method": m,
                "L": L,
                "final_err_geomean": float(np.exp(np.mean(np.log(np.maximum(fin, 1e-300))))),
                "final_err": fin.tolist(),
                "err_at_60": a60.tolist(),
                "central_steps_per_round": float(np.mean([r["central_steps_per_round"] for r in runs])),
                "all_finite": all(r["finite"] for r in runs),
                "curves_every_10": [r["err"][9::10] for r in runs],
            }
            print(
                f"p={part:<4g} {label:24s} ||x-x*|| final {' '.join(f'{v:9.2e}' for v in fin)}   "
                f"@60 {' '.join(f'{v:9.2e}' for v in a60)}",
                flush=True,
            )
    res["_meta"] = {
        "N": N,
        "d": D,
        "rounds": ROUNDS,
        "seeds": [0, 1, 2],
        "delta": 1e-2,
        "wall_s": time.time() - t0,
        "torch": torch.__version__,
    }
    with open(os.path.join(OUT, "summary.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {os.path.relpath(os.path.join(OUT, 'summary.json'))} in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
