"""CPU benchmark of FedAWARE's min-norm solver and FedECADO's small linear solves.

* min_norm, K in {10, 100, 300, 1000}: ours (away-step FW + face polish, native) against the MGDA-style
  solver of the FedAWARE code (Gram entries pulled to the host one by one with .item(), best-pair
  init and Frank-Wolfe in a Python/NumPy loop, 1000 iterations, ||dlam||_1 < 1e-5 stop), our
  native code_compat port of that solver, and the float64 PyTorch reference. Quality: relative
  suboptimality (q - q_best) / q_best of each solver's lam.
* lu_solve, n = 11 (K = 10 clients + centre), m columns in {1e5, 1e6, 1e7} fp32: ours (lu_factor +
  lu_solve) against torch.linalg.lu_factor + lu_solve. Floor: 2*n*m*4 bytes (read R, write X) /
  measured copy bandwidth.
* batched small systems (B matrices of n x n, m right-hand sides each): factor + solve.
* arrowhead_solve (closed form of the same BE system): (K+1)*m*4*2 bytes.
Both solvers return fresh tensors; at m = 1e7 (hundreds of MB) their first-touch page faults cost
more than the arithmetic, so each row also gives ``pct_fresh_copy``: the time of copying the same
bytes into a fresh tensor, as a % of ours (100 = as fast as a fresh copy). ``ours_out_ms`` (lu_solve
into a reused ``out=``) is the cost inside a FedECADO round loop, which reuses its buffers.
Run: python -m bench.cpu_linalg [--quick]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from fedkernels import ops, reference

from .common import add_out_argument, copy_bandwidth, print_table, timeit, write_json


# ---- the MGDA-style solver as in FedAWARE's min_norm_solvers.py (host loop) ---------------------
def _from2(v1v1, v1v2, v2v2):
    if v1v2 >= v1v1:
        return 0.999, v1v1
    if v1v2 >= v2v2:
        return 0.001, v2v2
    gamma = -1.0 * ((v1v2 - v2v2) / (v1v1 + v2v2 - 2 * v1v2))
    return gamma, v2v2 + gamma * (v1v2 - v2v2)


def mgda_min_norm(M: torch.Tensor, max_iter: int = 1000):
    """Gram matrix M (K x K torch tensor) -> lam, as find_min_norm_element_FW with
    _min_norm_2d_accelerated: every entry pulled with .item(), then a NumPy Frank-Wolfe loop."""
    n = M.size(0)
    dps = {}
    dmin, sol = 1e8, None
    for i in range(n):
        if (i, i) not in dps:
            dps[(i, i)] = M[i, i].item()
        for j in range(i + 1, n):
            if (j, j) not in dps:
                dps[(j, j)] = M[j, j].item()
            if (i, j) not in dps:
                dps[(i, j)] = dps[(j, i)] = M[i, j].item()
            c, d = _from2(dps[(i, i)], dps[(i, j)], dps[(j, j)])
            if d < dmin:
                dmin, sol = d, [(i, j), c, d]
    sol_vec = np.zeros(n)
    sol_vec[sol[0][0]] = sol[1]
    sol_vec[sol[0][1]] = 1 - sol[1]
    if n < 3:
        return sol_vec
    grad_mat = np.zeros((n, n))
    for i in range(n):
        for j in range(n):
            grad_mat[i, j] = dps[(i, j)]
    for _ in range(max_iter):
        t_iter = np.argmin(np.dot(grad_mat, sol_vec))
        v1v1 = np.dot(sol_vec, np.dot(grad_mat, sol_vec))
        v1v2 = np.dot(sol_vec, grad_mat[:, t_iter])
        v2v2 = grad_mat[t_iter, t_iter]
        nc, nd = _from2(v1v1, v1v2, v2v2)
        new_sol_vec = nc * sol_vec
        new_sol_vec[t_iter] += 1 - nc
        if np.sum(np.abs(new_sol_vec - sol_vec)) < 1e-5:
            return sol_vec
        sol_vec = new_sol_vec
    return sol_vec


def bench_min_norm(K: int, d: int, repeats: int):
    g = torch.Generator().manual_seed(K)
    U = torch.randn(K, d, generator=g) + 0.3
    G = ops.gram(U)  # fp64, as FedAWARE computes it
    Gn = G / torch.sqrt(torch.outer(torch.diagonal(G), torch.diagonal(G)))  # normalised mode
    rows = []
    for mode, M in (("normalised", Gn), ("raw", G)):
        lam_ours, it, gap = ops.min_norm(M)
        sols = {"ours": lam_ours}
        t = {"ours": timeit(lambda: ops.min_norm(M), repeats=repeats, warmup=1)}
        t["ours_code_compat"] = timeit(lambda: ops.min_norm(M, method="code_compat"), repeats=repeats, warmup=1)
        sols["ours_code_compat"] = ops.min_norm(M, method="code_compat")[0]
        r_rep = max(1, repeats // 3)
        t["reference"] = timeit(lambda: reference.min_norm(M), repeats=r_rep, warmup=0)
        sols["reference"] = reference.min_norm(M)[0]
        t["mgda"] = timeit(lambda: mgda_min_norm(M.float()), repeats=r_rep, warmup=0)
        sols["mgda"] = torch.from_numpy(mgda_min_norm(M.float()))
        q = {k: float(v @ M @ v) for k, v in sols.items()}
        qb = min(q.values())
        rows.append(
            {
                "op": "min_norm",
                "mode": mode,
                "K": K,
                "d": d,
                "iters": it,
                "gap": gap,
                "ours_ms": t["ours"] * 1e3,
                "code_compat_ms": t["ours_code_compat"] * 1e3,
                "reference_ms": t["reference"] * 1e3,
                "mgda_ms": t["mgda"] * 1e3,
                "speedup_vs_mgda": t["mgda"] / t["ours"],
                "speedup_vs_reference": t["reference"] / t["ours"],
                "subopt_ours": (q["ours"] - qb) / qb,
                "subopt_mgda": (q["mgda"] - qb) / qb,
                "subopt_code_compat": (q["ours_code_compat"] - qb) / qb,
            }
        )
    return rows


def bench_lu_solve(n: int, m: int, repeats: int):
    g = torch.Generator().manual_seed(m)
    A = torch.randn(n, n, generator=g) + 2 * n**0.5 * torch.eye(n)
    R = torch.randn(n, m, generator=g)
    X = torch.empty_like(R)

    def ours():
        LU, piv = ops.lu_factor(A)
        return ops.lu_solve(LU, piv, R)

    def torch_lu():
        LU, piv = torch.linalg.lu_factor(A)
        return torch.linalg.lu_solve(LU, piv, R)

    Y = torch.empty_like(R)

    def ours_out():  # reused output buffer (no page faults), as in a FedECADO round loop
        LU, piv = ops.lu_factor(A)
        return ops.lu_solve(LU, piv, R, out=Y)

    t_o = timeit(ours, repeats=repeats, warmup=1)
    t_oo = timeit(ours_out, repeats=repeats, warmup=1)
    t_t = timeit(torch_lu, repeats=repeats, warmup=1)
    t_c = timeit(lambda: X.copy_(R), repeats=repeats, warmup=1)  # same bytes, same sizes
    t_f = timeit(lambda: R.clone(), repeats=repeats, warmup=1)  # same bytes into a fresh allocation
    nbytes = 2 * n * m * 4
    bw = copy_bandwidth()
    err = float((ours().double() - torch.linalg.solve(A.double(), R.double())).abs().max())
    return {
        "op": "lu_solve",
        "n": n,
        "m": m,
        "B": 1,
        "ours_ms": t_o * 1e3,
        "ours_out_ms": t_oo * 1e3,
        "torch_ms": t_t * 1e3,
        "speedup_vs_torch": t_t / t_o,
        "GBps": nbytes / t_o / 1e9,
        "pct_copy_bw": 100 * nbytes / t_o / bw,
        "GBps_out": nbytes / t_oo / 1e9,
        "pct_copy_bw_out": 100 * nbytes / t_oo / bw,
        "pct_same_size_copy_out": 100 * t_c / t_oo,
        "pct_fresh_copy": 100 * t_f / t_o,
        "max_abs_err": err,
    }


def bench_batched(B: int, n: int, m: int, repeats: int):
    g = torch.Generator().manual_seed(B + n)
    A = torch.randn(B, n, n, generator=g) + 2 * n**0.5 * torch.eye(n)
    R = torch.randn(B, n, m, generator=g)

    def ours():
        LU, piv = ops.lu_factor(A)
        return ops.lu_solve(LU, piv, R)

    def torch_lu():
        LU, piv = torch.linalg.lu_factor(A)
        return torch.linalg.lu_solve(LU, piv, R)

    t_o = timeit(ours, repeats=repeats, warmup=1)
    t_t = timeit(torch_lu, repeats=repeats, warmup=1)
    t_f = timeit(lambda: ops.lu_factor(A), repeats=repeats, warmup=1)
    t_tf = timeit(lambda: torch.linalg.lu_factor(A), repeats=repeats, warmup=1)
    nbytes = (B * n * n * 4) * 2 + 2 * B * n * m * 4
    return {
        "op": "batched lu_factor+lu_solve",
        "n": n,
        "m": m,
        "B": B,
        "ours_ms": t_o * 1e3,
        "torch_ms": t_t * 1e3,
        "speedup_vs_torch": t_t / t_o,
        "factor_ours_ms": t_f * 1e3,
        "factor_torch_ms": t_tf * 1e3,
        "GBps": nbytes / t_o / 1e9,
        "pct_copy_bw": 100 * nbytes / t_o / copy_bandwidth(),
    }


def bench_arrowhead(K: int, m: int, repeats: int):
    g = torch.Generator().manual_seed(K + m)
    dt, L = 0.5, 1.0
    a = 1.0 + dt / L / (1.0 / dt + torch.rand(K, generator=g, dtype=torch.float64))
    r0 = torch.randn(m, generator=g)
    R = torch.randn(K, m, generator=g)
    t_o = timeit(lambda: ops.arrowhead_solve(a, -dt, dt / L, 1.0, r0, R), repeats=repeats, warmup=1)
    M = torch.zeros(K + 1, K + 1)
    M[0, 0], M[0, 1:], M[1:, 0], M[1:, 1:] = 1.0, -dt, dt / L, torch.diag(a.float())
    Rf = torch.cat([r0[None], R])
    t_t = timeit(lambda: torch.linalg.lu_solve(*torch.linalg.lu_factor(M), Rf), repeats=repeats, warmup=1)
    # the outputs x [m] and I [K, m] are fresh allocations: first-touch page faults dominate at large m.
    # Reference: the same bytes copied into fresh tensors (R.clone(), r0.clone()).
    t_f = timeit(lambda: (R.clone(), r0.clone()), repeats=repeats, warmup=1)
    nbytes = 2 * (K + 1) * m * 4
    return {
        "op": "arrowhead_solve",
        "n": K + 1,
        "m": m,
        "B": 1,
        "ours_ms": t_o * 1e3,
        "torch_ms": t_t * 1e3,
        "speedup_vs_torch": t_t / t_o,
        "GBps": nbytes / t_o / 1e9,
        "pct_copy_bw": 100 * nbytes / t_o / copy_bandwidth(),
        "fresh_copy_ms": t_f * 1e3,
        "pct_fresh_copy": 100 * t_f / t_o,
    }


def run(quick: bool = False):
    rep = 3 if quick else 7
    rows = []
    for K in (10, 100, 300, 1000):
        rows += bench_min_norm(K, 2000, rep)
    for m in [100_000, 1_000_000] + ([] if quick else [10_000_000]):
        rows.append(bench_lu_solve(11, m, rep))
    for B, n, m in [(10_000, 11, 1), (10_000, 4, 16), (1_000, 33, 64)] + ([] if quick else [(100, 11, 100_000)]):
        rows.append(bench_batched(B, n, m, rep))
    for m in [1_000_000] + ([] if quick else [10_000_000]):
        rows.append(bench_arrowhead(10, m, rep))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    add_out_argument(ap)
    a = ap.parse_args(argv)
    rows = run(a.quick)
    print(f"copy bandwidth: {copy_bandwidth() / 1e9:.1f} GB/s (read + write)")
    mn = [r for r in rows if r["op"] == "min_norm"]
    print_table(
        mn,
        [
            "mode",
            "K",
            "iters",
            "ours_ms",
            "code_compat_ms",
            "reference_ms",
            "mgda_ms",
            "speedup_vs_mgda",
            "subopt_ours",
            "subopt_code_compat",
            "subopt_mgda",
        ],
    )
    print()
    print_table(
        [r for r in rows if r["op"] != "min_norm"],
        [
            "op",
            "B",
            "n",
            "m",
            "ours_ms",
            "ours_out_ms",
            "torch_ms",
            "speedup_vs_torch",
            "GBps",
            "pct_copy_bw",
            "pct_copy_bw_out",
            "pct_same_size_copy_out",
            "pct_fresh_copy",
        ],
    )
    path = write_json("cpu-linalg.json", rows, out=a.out)
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
