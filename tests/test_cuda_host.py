"""Host tests of the CUDA kernels' per-thread logic, without a GPU.

The kernels in csrc/cuda/*.cu call ``__host__ __device__`` functions from csrc/cuda/*.cuh (index and
column maths, vector/scalar tails, the accumulation-type rule, the NaN-safe LU pivot order, the
permuted substitution of lu_solve, the arrowhead column solve, gram's plan / tile / DMMA-fragment
maths and reduction orders, the min-norm line search and Frank-Wolfe steps, finite_rows' scan,
fedecado_be_step's per-element update and its three storage paths). tests/cuda_host/harness.cpp
compiles those headers with g++ (FK_HD defined away), emulates the kernels' thread grids around
them, and these tests compare the result with the float64 reference (fedkernels.reference) and the
CPU ops on small shapes and edge cases (and, where the device order is plain adds and explicit
fmas, with a Python model of the documented order bit for bit). What only a GPU run can check (shuffles, shared-memory barriers,
vector loads, launch configurations) is listed in each header.
"""
from __future__ import annotations

import math
import os
import shutil
import subprocess

import pytest
import torch
from spec_vectors import MIN_NORM_CASES   # tests/spec_vectors.py

from fedkernels import reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_SRC = os.path.join(ROOT, "csrc", "cuda")
HARNESS = os.path.join(ROOT, "tests", "cuda_host", "harness.cpp")

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the host harness")


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    exe = str(tmp_path_factory.mktemp("cuda_host") / "harness")
    subprocess.run(["g++", "-std=c++17", "-O1", "-Wall", "-Werror", "-I", CUDA_SRC, HARNESS, "-o", exe],
                   check=True, capture_output=True, text=True)
    proc = subprocess.Popen([exe], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(*parts) -> list:
        line = " ".join(_fmt(p) for p in parts)
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
        ans = proc.stdout.readline().split()
        assert ans and ans[0] != "ERR", f"harness: {' '.join(ans)}"
        return ans

    yield ask
    proc.stdin.close()
    proc.wait(timeout=10)


def _fmt(x) -> str:
    if isinstance(x, (list, tuple)):
        return " ".join(_fmt(v) for v in x)
    if isinstance(x, torch.Tensor):
        return _fmt(x.reshape(-1).tolist())
    if isinstance(x, str):
        return x
    if isinstance(x, bool):
        return str(int(x))
    if isinstance(x, int):
        return str(x)
    x = float(x)
    return "nan" if math.isnan(x) else ("inf" if x == math.inf else ("-inf" if x == -math.inf else x.hex()))


def _f(s: str) -> float:
    return float(s) if s.lstrip("-") in ("nan", "inf") else float.fromhex(s)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ---- weighted_sum -----------------------------------------------------------------------------------
@pytest.mark.parametrize("alpha,c", [(1.0, 3.0e38), (1.0, 3.1e38), (1.0, float("nan")), (1e200, 1e-200),
                                     (-1.0, -3.0e38), (2.0, float("inf")), (1e-300, 1e300), (0.5, -7.0e38)])
def test_wsum_fits_float_is_the_cpu_rule(harness, alpha, c):
    # csrc/cpu/weighted_sum.cpp: fits_float = |alpha * c| <= 3e38 for every coefficient
    assert harness("fits", alpha, c) == [str(int(abs(alpha * c) <= 3.0e38))]


@pytest.mark.parametrize("x", [0.0, -0.0, 1.0, -3.0e38, 3.4028234663852886e38, 1e-45, 1e300, float("inf"),
                               float("-inf"), float("nan")])
def test_wsum_screen_finite_test(harness, x):
    # weighted_sum_screened's test on the accumulators and on a bad block's values: x * 0 == 0
    f32 = torch.tensor(x, dtype=torch.float64).float().item()
    assert harness("wfin", x) == [str(int(math.isfinite(f32))), str(int(math.isfinite(x)))]


@pytest.mark.parametrize("u,ld,K,out,base,want", [
    (0, 16, 5, 0, 0, 1), (0, 12, 5, 0, 0, 0), (0, 12, 1, 0, 0, 1), (4, 16, 5, 0, 0, 0),
    (0, 16, 5, 8, 0, 0), (0, 16, 5, 0, 32, 1), (0, 16, 5, 0, 40, 0), (256, 4096, 100, 512, 1024, 1)])
def test_wsum_vector_path_needs_every_row_aligned(harness, u, ld, K, out, base, want):
    assert harness("vecok", u, ld, K, out, base) == [str(want)]


# (dtype emulated, accumulation bytes, vector width V = 16 / element size)
WSUM_TYPES = [(torch.float32, 4, 4), (torch.float16, 4, 8), (torch.bfloat16, 4, 8), (torch.float64, 8, 2)]


def _wsum_case(harness, dtype, A, V, vec, K, d, rows, alpha, base, coef):
    U = torch.randn(K, d, generator=_gen(K * 7 + d), dtype=torch.float64).to(dtype)
    n = len(rows) if rows is not None else K
    b = torch.randn(d, generator=_gen(d), dtype=torch.float64).to(dtype) if base else None
    ans = harness("wsum", A, V, vec, K, d, n, alpha, -1, U.double(), coef, int(rows is not None),
                  list(rows) if rows is not None else [], int(base), b.double() if base else [])
    wide = ans[0] == "1"
    out = torch.tensor([_f(s) for s in ans[1:]], dtype=torch.float64).to(dtype)  # the kernel's final cast
    return U, b, wide, out


@pytest.mark.parametrize("dtype,A,V", WSUM_TYPES)
@pytest.mark.parametrize("vec", [True, False])
@pytest.mark.parametrize("K,d", [(1, 1), (3, 5), (1, 1023), (2, 1025), (3, 2 * 256 * 8 + 3), (300, 37)])
def test_wsum_grid_matches_reference(harness, dtype, A, V, vec, K, d):
    """Every column exactly once (the harness checks coverage), tails when d is not a multiple of V,
    K above the 256-row staging batch, rows in index order: matches the float64 reference."""
    coef = torch.randn(K, generator=_gen(K), dtype=torch.float64)
    U, b, wide, out = _wsum_case(harness, dtype, A, V, vec, K, d, None, 0.7, True, coef)
    assert wide == (A == 8)  # double accumulation only for fp64 data here
    ref = reference.weighted_sum(U, coef, base=b, alpha=0.7)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * max(1.0, K ** 0.5))


def test_wsum_rows_duplicates_and_bad_rows_give_nan(harness):
    K, d = 6, 300
    coef = torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=torch.float64)
    U, _, _, out = _wsum_case(harness, torch.float32, 4, 4, True, K, d, [5, 1, 1, 3], -2.0, False, coef)
    torch.testing.assert_close(out.double(), reference.weighted_sum(U, coef, alpha=-2.0, rows=[5, 1, 1, 3]),
                               rtol=1e-5, atol=1e-5)
    for bad in ([5, 1, 6, 3], [5, -1, 1, 3]):
        _, _, _, out = _wsum_case(harness, torch.float32, 4, 4, True, K, d, bad, -2.0, False, coef)
        assert torch.isnan(out).all()  # never a plausible number, never a read outside U


@pytest.mark.parametrize("dtype,A,V", WSUM_TYPES[:3])
def test_wsum_coefficient_beyond_float_accumulates_in_double(harness, dtype, A, V):
    """alpha * coef = 1e39 does not fit in float: the CPU op accumulates in double (finite result);
    a float cast would give inf. The kernel follows the CPU rule."""
    K, d = 3, 70
    coef = torch.tensor([1e39, -1e39, 1e-3], dtype=torch.float64)
    U, _, wide, out = _wsum_case(harness, dtype, A, V, True, K, d, None, 1.0, False, coef)
    assert wide
    ref = reference.weighted_sum(U, coef)
    assert torch.isfinite(out.double()).sum() == torch.isfinite(ref.to(dtype).double()).sum()
    cpu = torch.ops.fedkernels.weighted_sum(U, coef, None, 1.0, None)
    torch.testing.assert_close(out, cpu, rtol=1e-2, atol=1e-2, equal_nan=True)


# ---- gram: plan, both paths' index maths, DMMA fragments, reduction order ------------------------------
def _gram_emulate(harness, U, rows=None, eb=4):
    K, d = U.shape
    sym = rows is None
    ans = harness("gram", eb, 0 if sym else len(rows), K, d, int(sym), [] if sym else list(rows), U.double())
    k = K if sym else len(rows)
    return int(ans[0]), torch.tensor([_f(x) for x in ans[1:]], dtype=torch.float64).view(k, K)


@pytest.mark.parametrize("eb,dtype", [(4, torch.float32), (8, torch.float64), (2, torch.float16)])
@pytest.mark.parametrize("K,d,parts,tw", [(1, 1, 1, 256), (3, 5, 1, 256), (7, 700, 3, 256), (100, 300, 3, 128),
                                          (1000, 70, 3, 32), (2, 256 * 1024 + 33, 513, 256)])
def test_kstats_emulation_matches_reference(harness, eb, dtype, K, d, parts, tw):
    """kstats_parts / kstats_final emulated around ks::: every element of U read exactly once per phase
    (ERR otherwise), the plan's parts and tile width (fp32 at K = 1000: 32 columns; 1025 tiles: 2 per
    part: 513 parts), dot / nsq / nbar against the float64 reference."""
    U = torch.randn(K, d, generator=_gen(K * 3 + d), dtype=torch.float64).to(dtype)
    p = torch.rand(K, generator=_gen(d), dtype=torch.float64) + 0.1
    p /= p.sum()
    ans = harness("kstats", eb, K, d, U.double(), p)
    got = torch.tensor([_f(x) for x in ans[2:]], dtype=torch.float64)
    if eb == 4:
        assert (int(ans[0]), int(ans[1])) == (parts, tw)
    dot, nsq, nbar, _ = reference.kstats(U, p)
    torch.testing.assert_close(got, torch.cat([dot, nsq, nbar.reshape(1)]), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("eb,dtype", [(4, torch.float32), (8, torch.float64), (2, torch.bfloat16)])
@pytest.mark.parametrize("K,d", [(1, 1), (3, 5), (16, 600), (17, 513), (33, 129), (100, 200), (130, 70)])
def test_gram_emulation_matches_reference(harness, eb, dtype, K, d):
    """Path R (K <= 16) and path T (DMMA tiles, diagonal and off-diagonal blocks at K = 130 > 128):
    every staged slot, every 8x8 tile and every output element exactly once per part (ERR
    otherwise), the fragment layout through an mma built from the PTX layout, G exactly symmetric."""
    U = torch.randn(K, d, generator=_gen(K * 7 + d), dtype=torch.float64).to(dtype)
    _, G = _gram_emulate(harness, U, eb=eb)
    ref = reference.gram(U)
    torch.testing.assert_close(G, ref, rtol=1e-12, atol=1e-12 * d)
    assert torch.equal(G, G.T)
    if K <= 16:
        assert torch.equal(G, _gram_r_model(U))      # path R: the documented order, bit for bit


@pytest.mark.parametrize("k,K,d", [(5, 20, 300), (20, 3, 257), (3, 140, 65), (17, 17, 64)])
def test_gram_emulation_rows_duplicates_bad_rows(harness, k, K, d):
    U = torch.randn(K, d, generator=_gen(k + K + d), dtype=torch.float64).float()
    rows = [(i * 7) % K for i in range(k)]
    rows[-1] = rows[0]                                # a duplicate
    _, G = _gram_emulate(harness, U, rows=rows)
    torch.testing.assert_close(G, reference.gram(U, rows=rows), rtol=1e-12, atol=1e-12 * d)
    bad = list(rows)
    bad[1] = K                                        # out of range: a NaN row, the others intact
    _, G = _gram_emulate(harness, U, rows=bad)
    assert torch.isnan(G[1]).all()
    keep = [i for i in range(k) if i != 1]
    torch.testing.assert_close(G[keep], reference.gram(U, rows=[bad[i] for i in keep]), rtol=1e-12, atol=1e-12 * d)


def _fma(a: float, b: float, c: float) -> float:
    from fractions import Fraction
    if not all(math.isfinite(x) for x in (a, b, c)):
        return a * b + c
    return float(Fraction(a) * Fraction(b) + Fraction(c))    # exact, then one correct rounding


def _butterfly(x):
    x = list(x)
    for o in (16, 8, 4, 2, 1):
        x = [x[l] + x[l ^ o] for l in range(32)]
    return x[0]


def _gram_r_model(U):
    """Path R's documented order for one part (d <= part width): thread t sums fma over columns t,
    t + 256, ...; per warp the butterfly x_l + x_{l^o}; warps added in index order."""
    U64 = U.double().tolist()
    K, d = len(U64), len(U64[0])
    G = torch.zeros(K, K, dtype=torch.float64)
    for i in range(K):
        for j in range(i, K):
            part = []
            for t in range(256):
                acc = 0.0
                for c in range(t, d, 256):
                    acc = _fma(U64[i][c], U64[j][c], acc)
                part.append(acc)
            s = _butterfly(part[0:32])
            for w in range(1, 8):
                s = s + _butterfly(part[32 * w:32 * w + 32])
            G[i, j] = G[j, i] = s
    return G


def test_gram_final_reduction_is_the_documented_order(harness):
    """G[i][j] = part_0 + ... + part_7 (warp order), part_w = sum of parts w, w + 8, ... from 0.0."""
    g = _gen(11)
    for n in (1, 7, 8, 9, 100, 1024):
        vals = (torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-8, 9, (n,), generator=g)).tolist()
        got = _f(harness("gramred", n, vals)[1])
        parts = []
        for w in range(8):
            s = 0.0
            for p in range(w, n, 8):
                s += vals[p]
            parts.append(s)
        t = parts[0]
        for q in range(1, 8):
            t += parts[q]
        assert got == t, n
        if n == 1024:
            seq = 0.0
            for v in vals:
                seq += v
            assert seq != t   # the order matters for these values: the check above can fail


def test_gram_plan(harness):
    def plan(k, K, d, sym, eb):
        r = [int(x) for x in harness("gramplan", k, K, d, int(sym), eb)]
        return dict(zip(["path_r", "tile", "kp", "Kp", "pairs", "part_cols", "nparts", "ws"], r))
    p = plan(100, 100, 11_220_132, True, 4)           # ResNet-18, K = 100: one diagonal block, 1024 parts
    assert p["path_r"] == 0 and p["tile"] == 128 and p["pairs"] == 1 and 1000 <= p["nparts"] <= 1024
    for k, K, d, sym in [(16, 16, 10**6, True), (17, 17, 5, True), (100, 100, 11_220_132, True), (1000, 1000, 10**6, True),
                         (5, 300, 12345, False), (300, 2, 999, False), (1, 1, 1, True), (129, 129, 4097, True)]:
        for eb in (2, 4, 8):
            p = plan(k, K, d, sym, eb)
            align = 256 if p["path_r"] else (32 if eb == 8 else 64)
            assert p["part_cols"] % align == 0
            assert (p["nparts"] - 1) * p["part_cols"] < d <= p["nparts"] * p["part_cols"]   # every column in one part
            assert p["ws"] == p["nparts"] * p["kp"] * p["Kp"] * 8 <= 256 << 20
            assert p["nparts"] <= 1024 and p["kp"] >= k and p["Kp"] >= K
            t = p["tile"]
            n_t = -(-K // t)
            assert p["pairs"] == (n_t * (n_t + 1) // 2 if sym else -(-k // t) * n_t)


# ---- finite_rows -----------------------------------------------------------------------------------
# (element size, V = 16 / size): fp32, fp16/bf16, fp64; values are given as float64 (exact)
FR_TYPES = [(4, 4), (2, 8), (8, 2)]


def _finite_case(harness, size, V, K, d, ld, u_off, bad_at, seed=0):
    U = torch.randn(K, ld, generator=_gen(seed + K * 31 + d), dtype=torch.float64)
    for (r, j, v) in bad_at:
        U[r, j] = v
    ans = harness("finite", V, size, u_off, K, d, ld, U)
    ok = torch.tensor([a == "1" for a in ans[1:]])
    return ans[0] == "1", ok, U[:, :d]


@pytest.mark.parametrize("size,V", FR_TYPES)
@pytest.mark.parametrize("K,d", [(1, 1), (3, 5), (2, 4096), (2, 8191), (4, 8192 + 7), (300, 3), (1, 3 * 8192 + 1)])
def test_finite_rows_grid_nan_inf_at_tails(harness, size, V, K, d):
    """Every column of every row exactly once on the vector path (aligned rows) and the scalar
    path (misaligned start), NaN/Inf at the first column, the last column (the tail chunk, not a
    multiple of the vector width) and a chunk boundary; a clean row stays true."""
    chunk = 256 * 4 * V
    nan, inf = float("nan"), float("inf")
    cols = sorted({0, d - 1, min(chunk, d - 1), min(chunk - 1, d - 1)})
    ld = -(-d // V) * V                                       # padded rows: 16-byte aligned
    for u_off, want_vec in ((0, True), (size, False)):      # aligned base / misaligned base
        for r in range(K):
            bad = [(r, cols[r % len(cols)], (nan, inf, -inf)[r % 3])] if r % 2 == 0 else []
            if K > 2 and r >= 2:
                bad = bad[:1] if r % 5 else []
            vec, ok, U = _finite_case(harness, size, V, K, d, ld, u_off, bad, seed=r)
            assert vec == want_vec
            assert torch.equal(ok, reference.finite_rows(U)), (u_off, r)
            if K > 8:
                break


@pytest.mark.parametrize("size,V", FR_TYPES)
def test_finite_rows_misaligned_rows_take_the_scalar_path(harness, size, V):
    K, d = 5, 3 * 256 * 4 * V + 3
    ld = d + 2                                             # row stride not a multiple of 16 bytes
    assert (ld * size) % 16
    bad = [(1, d - 1, float("nan")), (3, 256 * 4 * V, float("-inf")), (4, 0, float("inf"))]
    vec, ok, U = _finite_case(harness, size, V, K, d, ld, 0, bad)
    assert not vec
    assert ok.tolist() == [True, False, True, False, False]
    assert torch.equal(ok, reference.finite_rows(U))
    # one row: any stride is aligned enough for the vector path
    vec, ok, U = _finite_case(harness, size, V, 1, d, ld, 0, [(0, d - 1, float("nan"))])
    assert vec and ok.tolist() == [False]


# ---- fedecado_be_step: per-element update, the three paths ---------------------------------------------
def _be_case(K, d, dtype, seed, with_s=True):
    g = _gen(seed)
    rn = lambda *sh: torch.randn(*sh, generator=g, dtype=torch.float64).to(dtype)   # noqa: E731
    T = torch.rand(K, generator=g, dtype=torch.float64) * 1.9 + 0.1
    tl = 0.3 * float(T.max())
    dt = 0.5 * (float(T.max()) - tl)
    ig = 1.0 / (1.0 / dt + torch.rand(K, generator=g, dtype=torch.float64) * 5)
    ig[0] = 0.0                                                      # the ECADO limit for one client
    return [rn(d), rn(K, d), rn(d), rn(K, d), rn(K, d), rn(d) if with_s else None, (tl + dt) / T, tl / T, ig, dt, 1.7]


def _be_emulate(harness, args, path, nt):
    xc, Icur, xc0, U, Ik, S, thn, tho, ig, dt, L = args
    K, d = U.shape
    c = dt / L
    ia = 1.0 / (1.0 + c * ig)
    coef = torch.cat([thn, thn - tho, ig, ia])                        # what the glue uploads
    inv_den = 1.0 / (1.0 + dt * c * float(ia.sum()))
    A = 4 if U.dtype == torch.float32 else 8
    ans = harness("bestep", A, path, nt, K, d, int(S is not None), c, dt, inv_den, coef, xc.double(),
                  Icur.double(), xc0.double(), U.double(), Ik.double(), S.double() if S is not None else [])
    v = torch.tensor([_f(x) for x in ans[1:]], dtype=torch.float64)
    x, I, mc, me = v[:d], v[d:d + K * d].view(K, d), float(v[-2]), float(v[-1])
    return x.to(U.dtype), I.to(U.dtype), torch.tensor([0.5 * dt * mc, 0.5 * dt / L * me], dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("K,d", [(1, 1), (3, 7), (32, 65), (33, 300), (100, 129)])
@pytest.mark.parametrize("with_s", [True, False])
def test_be_step_paths_match_reference_and_cpu(harness, dtype, K, d, with_s):
    """Registers (K <= 32), shared-memory slots and the recomputing pass: every column once, each
    thread only its own slots, the same bits on all three paths, and the float64 reference / CPU op
    to the rounding of the arithmetic type."""
    args = _be_case(K, d, dtype, seed=K * 31 + d, with_s=with_s)
    nt = int(harness("besmem", K, 4 if dtype == torch.float32 else 8, 232448 - 1024)[0])
    assert nt >= 32
    outs = []
    for path, threads in ((0, 256), (1, nt), (1, 32), (2, 256)):
        if path == 0 and K > 32:
            continue
        outs.append(_be_emulate(harness, args, path, threads))
    for o in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(o, outs[0]))
    x, I, lte = outs[0]
    rx, rI, rl = reference.fedecado_be_step(*args)
    cx, cI, cl = torch.ops.fedkernels.fedecado_be_step(*args)
    tol = 1e-12 if dtype == torch.float64 else 3e-6 * max(1, K ** 0.5)
    torch.testing.assert_close(x.double(), rx, rtol=tol, atol=tol)
    torch.testing.assert_close(I.double(), rI, rtol=tol, atol=tol)
    torch.testing.assert_close(x.double(), cx.double(), rtol=tol, atol=tol)
    torch.testing.assert_close(I.double(), cI.double(), rtol=tol, atol=tol)
    torch.testing.assert_close(lte, rl, rtol=100 * tol, atol=100 * tol)
    torch.testing.assert_close(lte, cl, rtol=100 * tol, atol=100 * tol)


def test_be_step_nan_gives_infinite_lte(harness):
    args = _be_case(40, 50, torch.float32, seed=1)
    args[3] = args[3].clone()
    args[3][7, 11] = float("nan")
    _, _, lte = _be_emulate(harness, args, 1, 64)
    assert lte.tolist() == [math.inf, math.inf]
    _, _, cl = torch.ops.fedkernels.fedecado_be_step(*args)
    assert cl.tolist() == [math.inf, math.inf]


def test_be_step_smem_plan(harness):
    budget = 232448 - 1024
    # per thread 2K slots; the largest of 256..32 threads within 96 KB, else the device budget
    assert harness("besmem", 33, 4, budget) == ["256", str(2 * 33 * 4 * 256)]
    assert harness("besmem", 100, 4, budget) == ["64", str(2 * 100 * 4 * 64)]
    assert harness("besmem", 100, 8, budget) == ["32", str(2 * 100 * 8 * 32)]
    assert harness("besmem", 400, 8, budget)[0] == "32"             # 204800 bytes: beyond 96 KB, within the budget
    assert harness("besmem", 460, 8, budget) == ["0", "0"]          # recomputing pass
    assert harness("besmem", 900, 4, budget)[0] == "32" and harness("besmem", 910, 4, budget)[0] == "0"


# ---- LU pivot order ---------------------------------------------------------------------------------
def _scan_pivot(col, k):
    """csrc/cpu/lu.cpp getf2: p = k, best = |a_kk|; the first i > k with |a_ik| > best (NaN never)."""
    p, best = k, abs(col[k])
    for i in range(k + 1, len(col)):
        v = abs(col[i])
        if v > best:
            p, best = i, v
    return p


def _columns():
    g = _gen(5)
    nan, inf = float("nan"), float("inf")
    cols = []
    for n in (1, 2, 5, 31, 32, 33, 64):
        base = torch.randn(n, generator=g, dtype=torch.float64).tolist()
        cols.append(base)
        cols.append([abs(x) if i % 3 else -abs(x) for i, x in enumerate(base)])
        cols.append([1.0 if i % 2 else -1.0 for i in range(n)])                # ties: smallest index
        cols.append([0.0] * n)                                                  # zero pivot
        for pos in {0, n // 2, n - 1}:
            c = list(base)
            c[pos] = nan
            cols.append(c)                                                       # NaN on/below the diagonal
            c2 = list(base)
            c2[pos] = inf if pos % 2 else -inf
            cols.append(c2)
        cols.append([nan] * n)
        cols.append([inf, nan, -inf] * (n // 3) + [inf] * (n % 3))
    return cols


def test_lu_pivot_total_order_every_lane_agrees(harness):
    checked = 0
    for col in _columns():
        n = len(col)
        for k in sorted({0, n // 2, n - 1}):
            warp_p, block_p = (int(x) for x in harness("pivot", k, n, col))
            want = _scan_pivot(col, k)
            assert block_p == want, (col, k)
            if n <= 32:
                assert warp_p == want, (col, k)   # -2 would mean two lanes chose differently
            assert k <= block_p < n
            checked += 1
    assert checked > 100


def test_lu_pivot_scan_rule_is_the_cpu_op():
    """The Python scan above is the CPU op's rule (on finite columns, where the CPU op runs)."""
    for col in _columns():
        if not all(math.isfinite(x) for x in col) or len(col) < 2:
            continue
        n = len(col)
        A = torch.eye(n, dtype=torch.float64)
        A[:, 0] = torch.tensor(col, dtype=torch.float64)
        _, piv, _ = torch.ops.fedkernels.lu_factor(A)
        assert int(piv[0]) - 1 == _scan_pivot(col, 0)


# ---- lu_solve / arrowhead per-column logic -----------------------------------------------------------
@pytest.mark.parametrize("n", [1, 3, 17, 32, 33, 64])
def test_lu_solve_column_matches_reference(harness, n):
    m = 5
    A = torch.randn(n, n, generator=_gen(n), dtype=torch.float64) + n * torch.eye(n, dtype=torch.float64)
    A = A[torch.randperm(n, generator=_gen(n + 1))]  # pivoting needed
    LU, piv, info = torch.ops.fedkernels.lu_factor(A)
    assert int(info) == 0
    R = torch.randn(n, m, generator=_gen(n + 2), dtype=torch.float64)
    ans = harness("lusolve", n, m, LU, [int(p) for p in piv], R)
    assert ans[0] == "1"
    X = torch.tensor([_f(s) for s in ans[1:]], dtype=torch.float64).view(n, m)
    torch.testing.assert_close(X, reference.lu_solve(LU, piv, R), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(X, torch.linalg.solve(A, R), rtol=1e-9, atol=1e-9)
    if n > 1:
        bad = [int(p) for p in piv]
        bad[n - 1] = n + 1                      # out of range: NaN columns, no assert
        ans = harness("lusolve", n, m, LU, bad, R)
        assert ans[0] == "0" and all(math.isnan(_f(s)) for s in ans[1:])


@pytest.mark.parametrize("K,m", [(1, 1), (4, 7), (300, 3)])
def test_arrowhead_column_matches_reference(harness, K, m):
    g = _gen(K)
    a = torch.rand(K, generator=g, dtype=torch.float64) + 0.5
    b = -0.1 * torch.rand(K, generator=g, dtype=torch.float64)
    c = 0.2 * torch.rand(K, generator=g, dtype=torch.float64)
    alpha = 1.0
    r0 = torch.randn(m, generator=g, dtype=torch.float64)
    R = torch.randn(K, m, generator=g, dtype=torch.float64)
    coef = torch.cat([b / a, c, 1.0 / a])     # what csrc/cuda/lu_glue.cpp uploads
    inv_den = 1.0 / (alpha - float((b * c / a).sum()))
    ans = harness("arrow", K, m, inv_den, coef, r0, R)
    vals = torch.tensor([_f(s) for s in ans[1:]], dtype=torch.float64)
    x, I = vals[:m], vals[m:].view(K, m)
    xr, Ir = reference.arrowhead_solve(a, b, c, alpha, r0, R)
    torch.testing.assert_close(x, xr, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(I, Ir, rtol=1e-12, atol=1e-12)
    xc, Ic = torch.ops.fedkernels.arrowhead_solve(a, b, c, alpha, r0, R)   # the CPU op: same order
    torch.testing.assert_close(x, xc, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(I, Ic, rtol=1e-14, atol=1e-14)


# ---- min_norm: line search, step logic and the whole block, emulated ---------------------------------
@pytest.mark.parametrize("a,b,c", [(1.0, 0.5, 2.0), (1.0, 1.0, 1.0), (2.0, 3.0, 1.0), (1.0, -2.0, 5.0),
                                   (3.0, 0.0, 3.0), (1e-300, 0.0, 1e-300), (4.0, 4.5, 9.0), (1.0, 2.0, 3.0)])
def test_min_norm_segment_is_the_reference_line_search(harness, a, b, c):
    g, val = (_f(x) for x in harness("segment", a, b, c)[1:])
    g_r, val_r = reference._segment(a, b, c)
    assert g == g_r and val == val_r    # same formula and order; no fma on the host build


_MN_METHODS = {"fw": 0, "away": 1, "pairwise": 2}


def _mn_emulate(harness, G, method, init="best_pair", max_iter=30000, tol=1e-12, tol_abs=1e-15, lam0=None):
    ans = harness("minnorm", G.shape[0], _MN_METHODS[method], int(init == "min_diag"), max_iter, tol, tol_abs,
                  int(lam0 is not None), G, lam0 if lam0 is not None else [])
    return torch.tensor([_f(x) for x in ans[2:]], dtype=torch.float64), int(ans[0]), _f(ans[1])


def _mn_G(K, seed=None):
    U = torch.randn(K, max(2, K // 2), generator=_gen(K if seed is None else seed), dtype=torch.float64)
    return U, U @ U.T / U.shape[1] + torch.eye(K, dtype=torch.float64)


@pytest.mark.parametrize("K,method", [(K, m) for m in ("fw", "away", "pairwise") for K in (1, 2, 3, 10, 100, 300)
                                      if m != "fw" or K <= 10])
def test_min_norm_block_emulation_matches_cpu_op_and_reference(harness, K, method):
    """The kernel's control flow around mn::plan / mn::update / scan_thread / row_partial, with the
    block's reduction orders (K=300 > 256 threads: two entries per thread), converges to the CPU
    op's and the reference's minimiser (G strongly convex: lam unique)."""
    U, G = _mn_G(K)
    G = G + 1e-3 * torch.triu(torch.ones(K, K, dtype=torch.float64), 1)   # not symmetric: symmetrised
    lam, it, gap = _mn_emulate(harness, G, method)
    Gs = 0.5 * (G + G.T)
    assert it < 30000
    assert float(lam.min()) >= 0.0 and abs(float(lam.sum()) - 1.0) < 1e-12
    v = Gs @ lam
    q = float(lam @ v)
    assert abs(gap - (q - float(v.min()))) <= 1e-12 * max(1.0, q)   # the exact gap at the returned lam
    assert gap <= 1e-12 * q + 1e-15 * float(Gs.diagonal().max()) + 1e-13
    lam_c, it_c, _ = torch.ops.fedkernels.min_norm(G, 30000, 1e-12, 1e-15, method, "best_pair", False, None)
    q_c = float(lam_c @ (Gs @ lam_c))
    assert abs(q - q_c) <= 1e-11 * max(1.0, q_c)
    torch.testing.assert_close(U.T @ lam, U.T @ lam_c, rtol=0, atol=1e-6)
    assert abs(it - int(it_c)) <= max(2, int(it_c) // 20)    # same steps; sums in another order
    if K <= 10:
        lam_r, _, _ = reference.min_norm(G, max_iter=30000, tol=1e-12, method=method, polish=False)
        assert abs(q - float(lam_r @ (Gs @ lam_r))) <= 1e-11


@pytest.mark.parametrize("method", ["fw", "away", "pairwise"])
def test_min_norm_block_emulation_spec_vectors(harness, method):
    for m, q_exp in MIN_NORM_CASES:   # fedaware.md §9 A3, A4, A5, A7 (tests/spec_vectors.py)
        M = torch.tensor(m, dtype=torch.float64)
        G = M @ M.T
        lam, _, _ = _mn_emulate(harness, G, method, max_iter=10000, tol=1e-14)
        assert abs(float(lam @ G @ lam) - q_exp) <= 1e-10, (m, method)


def test_min_norm_block_emulation_inits(harness):
    U = torch.randn(30, 12, generator=_gen(3), dtype=torch.float64)
    G = U @ U.T
    lam0 = torch.rand(30, generator=_gen(4), dtype=torch.float64)
    for init, l0 in (("min_diag", None), ("best_pair", lam0), ("best_pair", torch.zeros(30, dtype=torch.float64))):
        lam, it, _ = _mn_emulate(harness, G, "away", init=init, max_iter=5000, lam0=l0)
        lam_c, it_c, _ = torch.ops.fedkernels.min_norm(G, 5000, 1e-12, 1e-15, "away", init, False,
                                                        l0 if l0 is not None and float(l0.sum()) > 0 else None)
        assert abs(float(lam @ G @ lam) - float(lam_c @ G @ lam_c)) <= 1e-9
    # zero iterations: the init itself (best pair on a 3-vertex hull; min_diag: the vertex of least norm)
    M = torch.tensor([[1.0, 0, 0], [0, 2.0, 0], [0, 0, 3.0]])
    for init, want in (("best_pair", [0.8, 0.2, 0.0]), ("min_diag", [1.0, 0.0, 0.0])):
        lam, it, _ = _mn_emulate(harness, M @ M.T, "away", init=init, max_iter=0)
        assert it == 0 and torch.allclose(lam, torch.tensor(want, dtype=torch.float64), atol=1e-15)
    # ties: two identical vertices, the smallest index wins everywhere
    G = torch.ones(4, 4, dtype=torch.float64) + torch.diag(torch.tensor([0.0, 0.0, 1.0, 1.0], dtype=torch.float64))
    lam, _, _ = _mn_emulate(harness, G, "away", init="min_diag", max_iter=100)
    assert lam.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_min_norm_g_placement(harness):
    budget = 232448 - 1024       # sm_90 opt-in limit minus the static scratch and margin (min_norm.cu)
    n_max = max(n for n in range(1, 400) if n * n * 8 + 24 * n <= budget)
    assert harness("gsmem", n_max, budget) == ["1", str(24 * n_max)]
    assert harness("gsmem", n_max + 1, budget)[0] == "0"
    assert harness("gsmem", 1000, budget)[0] == "0" and harness("gsmem", 1, 64)[0] == "1"
    assert n_max >= 160


# ---- the CUDA min_norm test cases are ones the solver converges on ------------------------------------
def test_cuda_min_norm_cases_converge_on_the_cpu_op():
    from test_cuda import MIN_NORM_CASES, _min_norm_G
    for K, method in MIN_NORM_CASES:
        if K > 100:
            continue  # K=1000 measured: 18993 (away) / 9899 (pairwise) iterations of 30000
        _, it, _ = torch.ops.fedkernels.min_norm(_min_norm_G(K), 30000, 1e-12, 1e-15, method, "best_pair", False, None)
        assert int(it) < 30000, (K, method)


# ---- static rules of the CUDA sources (cheap, run everywhere) ----------------------------------------
def _read(path):
    with open(path) as f:
        return f.read()


def test_every_op_in_the_schema_has_a_cuda_registration():
    import re
    schema = _read(os.path.join(ROOT, "csrc", "fedkernels.cpp"))
    ops = set(re.findall(r'm\.def\("([a-z_0-9]+)\(', schema))
    # schemas of newer ops live in their CPU file (TORCH_LIBRARY_FRAGMENT); device-independent ones
    # (CompositeExplicitAutograd: test hooks without a tensor on a device) need no CUDA kernel
    cpu_dir = os.path.join(ROOT, "csrc", "cpu")
    for name in sorted(os.listdir(cpu_dir)):
        src = _read(os.path.join(cpu_dir, name))
        if "TORCH_LIBRARY_FRAGMENT(fedkernels" in src:
            ops |= set(re.findall(r'm\.def\("([a-z_0-9]+)\(', src))
        for block in re.findall(r'TORCH_LIBRARY_IMPL\(fedkernels, CompositeExplicitAutograd, m\)\s*\{([^}]*)\}', src):
            ops -= set(re.findall(r'm\.impl\("([a-z_0-9]+)"', block))
    impls, files = set(), {}
    for name in sorted(os.listdir(CUDA_SRC)):
        if name.endswith("_glue.cpp"):
            src = _read(os.path.join(CUDA_SRC, name))
            assert "TORCH_LIBRARY_IMPL(fedkernels, CUDA, m)" in src, name
            for op in re.findall(r'm\.impl\("([a-z_0-9]+)"', src):
                assert op not in impls, f"{op} registered twice"
                impls.add(op)
                files[op] = name
    assert ops and ops == impls, (sorted(ops - impls), sorted(impls - ops))


def test_cuda_sources_have_no_device_assert_and_minimal_includes():
    for name in os.listdir(CUDA_SRC):
        src = _read(os.path.join(CUDA_SRC, name))
        assert "#include <ATen/cuda/CUDAContext.h>" not in src, f"{name}: pulls in cuBLAS/cuSPARSE headers"
        if name.endswith((".cu", ".cuh")):
            assert "<cassert>" not in src and "assert(" not in src.replace("static_assert(", ""), \
                f"{name}: a device assert poisons the CUDA context; validate on the host"
            assert "torch/" not in src and "ATen/" not in src, f"{name}: kernels stay free of torch headers"


# ---- gc_project work plan -----------------------------------------------------------------------------
def test_gc_plan_covers_every_row_once(harness):
    # rows, cols of a ResNet-like list plus edge cases: one row, exactly the path limits, empty tensors
    shapes = [(64, 147), (0, 5), (64, 576), (128, 1152), (1, 10), (512, 4608), (3, 1024), (2, 1025), (5, 8192),
              (4, 8193), (100, 512), (0, 0), (65, 3), (1, 100000)]
    ans = harness("gcplan", len(shapes), [r for r, _ in shapes], [c for _, c in shapes])
    items = int(ans[0])
    per = [tuple(int(x) for x in a.split(":")) for a in ans[1:]]
    want_items = 0
    for (rows, cols), (path, lo, hi) in zip(shapes, per):
        want_path = 0 if cols <= 1024 else (1 if cols <= 8192 else 2)
        assert path == want_path, (rows, cols)
        assert lo == hi == 1, (rows, cols)            # every row exactly once
        if rows and cols:
            want_items += -(-rows // 64) if path == 0 else rows
    assert items == want_items


# ---- select (order_mean / closest_mean: one thread per column, stable ranks) -------------------------
@pytest.mark.parametrize("K,d", [(1, 3), (2, 5), (3, 7), (4, 40), (7, 33), (10, 50), (33, 9)])
def test_select_columns_match_reference(harness, K, d):
    """sel::order_mean_col / closest_mean_col per emulated thread against the float64 reference: the
    median of odd k exactly, the other means to float64 summation order; ties (small integers) and a NaN
    and an Inf row (NaN columns as the reference; the row flags as finite_rows)."""
    from fedkernels.ops.select import median_bounds, trim_bounds
    g = _gen(K * 7 + d)
    U = torch.randn(K, d, generator=g, dtype=torch.float64)
    U[:, : d // 2] = torch.randint(-2, 3, (K, d // 2), generator=g).double()     # columns full of ties
    if K >= 3:
        U[1, 0], U[2, d - 1] = float("nan"), float("inf")

    def ask(mode, lo, hi):
        ans = harness("select", mode, K, d, lo, hi, U)
        vals = torch.tensor([_f(x) for x in ans[1:1 + d]], dtype=torch.float64)
        return vals, [bool(int(x)) for x in ans[1 + d:]]

    for lo, hi in {median_bounds(K), trim_bounds(K, 0.2), (0, K), (K - 1, K)}:
        got, ok = ask(0, lo, hi)
        want = reference.order_mean(U, lo, hi)
        assert ok == reference.finite_rows(U).tolist()
        assert torch.equal(got.isnan(), want.isnan())
        torch.testing.assert_close(got, want, rtol=4 * K * 2.0 ** -53, atol=4 * K * 2.0 ** -53 * 4, equal_nan=True)
        if hi - lo == 1:
            assert torch.equal(got.nan_to_num(), want.nan_to_num())
    for beta in sorted({1, max(1, K // 2), K}):
        got, _ = ask(1, beta, 0)
        want = reference.closest_mean(U, beta)
        assert torch.equal(got.isnan(), want.isnan())
        torch.testing.assert_close(got, want, rtol=4 * K * 2.0 ** -53, atol=4 * K * 2.0 ** -53 * 4, equal_nan=True)
