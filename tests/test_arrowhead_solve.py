"""arrowhead_solve: spec fedecado.md section 9 (U2, U5d, U9), the dense LU path and the float64
reference, general coefficients, non-contiguous inputs, opcheck, bad inputs."""

import re

import pytest
import torch

from devices import DEV, DEVICES, gen, one_line  # tests/devices.py: every case on cpu and cuda
from fedkernels import ops, reference
import host_harness  # tests/host_harness.py: the CUDA kernels' per-thread logic on the host
from host_harness import hexf


def test_u2_arrowhead_closed_form():
    # U2: dt = 1, L = 1, g = [5/4, 7/4] -> a = 1 + dt/(L g) = [9/5, 11/7]; r = [1, 3/2]; rhs0 = 0
    x, I = ops.arrowhead_solve(
        torch.tensor([9 / 5, 11 / 7], dtype=torch.float64),
        -1.0,
        1.0,
        1.0,
        torch.zeros(1, dtype=torch.float64),
        torch.tensor([[1.0], [1.5]], dtype=torch.float64),
    )
    assert float(x[0]) == pytest.approx(299 / 434, abs=1e-15)
    torch.testing.assert_close(I[:, 0], torch.tensor([75, 224], dtype=torch.float64) / 434, rtol=0, atol=1e-15)
    # U5d, ECADO limit inv_g = 0: a = 1, r = Gamma' = [1, 3/2]
    x, I = ops.arrowhead_solve(
        torch.ones(2),
        -1.0,
        1.0,
        1.0,
        torch.zeros(1, dtype=torch.float64),
        torch.tensor([[1.0], [1.5]], dtype=torch.float64),
    )
    assert float(x[0]) == pytest.approx(5 / 6, abs=1e-15)
    torch.testing.assert_close(I[:, 0], torch.tensor([1 / 6, 2 / 3], dtype=torch.float64), rtol=0, atol=1e-15)


@pytest.mark.parametrize("K", [1, 3, 10, 33])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_u9_arrowhead_vs_dense(K, dtype):
    g = torch.Generator().manual_seed(K)
    m = 7 if dtype == torch.float64 else 5001
    dt, L = 0.3 + torch.rand(1, generator=g).item(), 0.1 + 9.9 * torch.rand(1, generator=g).item()
    hbar = 5 * torch.rand(K, generator=g, dtype=torch.float64)
    w = torch.distributions.Dirichlet(torch.ones(K)).sample().double() * K
    ginv = 1.0 / (1.0 / dt + w * hbar)
    a = 1.0 + dt * ginv / L
    r0 = torch.randn(m, generator=g, dtype=torch.float64).to(dtype)
    R = torch.randn(K, m, generator=g, dtype=torch.float64).to(dtype)
    x, I = ops.arrowhead_solve(a, -dt, dt / L, 1.0, r0, R)
    xr, Ir = reference.arrowhead_solve(a, -dt, dt / L, 1.0, r0, R)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(x.double(), xr, rtol=tol, atol=tol)
    torch.testing.assert_close(I.double(), Ir, rtol=tol, atol=tol)
    # permuting the clients permutes I and leaves x unchanged
    p = torch.randperm(K, generator=g)
    xp, Ip = ops.arrowhead_solve(a[p], -dt, dt / L, 1.0, r0, R[p])
    torch.testing.assert_close(xp, x, rtol=tol, atol=tol)
    torch.testing.assert_close(Ip, I[p], rtol=tol, atol=tol)
    # the same system through the generic LU path
    M = torch.zeros(K + 1, K + 1, dtype=torch.float64)
    M[0, 0], M[0, 1:], M[1:, 0], M[1:, 1:] = 1.0, -dt, dt / L, torch.diag(a)
    LU, piv = ops.lu_factor(M)
    Z = ops.lu_solve(LU, piv, torch.cat([r0[None], R]).double())
    torch.testing.assert_close(Z[0], xr, rtol=1e-12, atol=1e-12)


def test_arrowhead_general_coefficients_and_noncontiguous():
    g = torch.Generator().manual_seed(11)
    K, m = 6, 301
    a = 2 + torch.rand(K, generator=g, dtype=torch.float64)
    b, c = torch.randn(K, generator=g, dtype=torch.float64), torch.randn(K, generator=g, dtype=torch.float64)
    big = torch.randn(K, 2 * m, generator=g, dtype=torch.float64)
    R = big[:, ::2]
    r0 = torch.randn(2 * m, generator=g, dtype=torch.float64)[::2]
    x, I = ops.arrowhead_solve(a, b, c, 3.0, r0, R)
    xr, Ir = reference.arrowhead_solve(a, b, c, 3.0, r0, R)
    torch.testing.assert_close(x, xr, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(I, Ir, rtol=1e-12, atol=1e-12)


def test_arrowhead_bad_inputs():
    with pytest.raises(ValueError, match="a must be nonzero"):
        ops.arrowhead_solve(torch.zeros(2), 1.0, 1.0, 1.0, torch.zeros(3), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="singular"):
        ops.arrowhead_solve(torch.ones(2), 0.5, 1.0, 1.0, torch.zeros(3), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="r0"):
        ops.arrowhead_solve(torch.ones(2), 1.0, 1.0, 1.0, torch.zeros(4), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="length-2"):
        ops.arrowhead_solve(torch.ones(3), 1.0, 1.0, 1.0, torch.zeros(3), torch.zeros(2, 3))
    for alpha in (float("nan"), float("inf"), True, "1", None):
        with pytest.raises(ValueError, match=r"^arrowhead_solve: alpha must be a finite number, got "):
            ops.arrowhead_solve(torch.ones(2), 1.0, 1.0, alpha, torch.zeros(3), torch.zeros(2, 3))


@pytest.mark.parametrize("dev", DEVICES)
def test_arrowhead_opcheck(dev):
    a = torch.tensor([1.5, 2.0, 3.0], dtype=torch.float64)  # a, b, c: host coefficients on every device
    torch.library.opcheck(
        torch.ops.fedkernels.arrowhead_solve.default,
        (a, -a, a, 1.0, torch.randn(11).to(dev), torch.randn(3, 11).to(dev)),
    )


# ---- the CUDA kernel's per-thread logic on the host (tests/host_harness.py, tests/cuda_host/lu.cpp) ----------------
@pytest.fixture(scope="module")
def harness():
    yield from host_harness.session()


@pytest.mark.parametrize("K,m", [(1, 1), (4, 7), (300, 3)])
def test_arrowhead_column_matches_reference(harness, K, m):
    g = gen(K)
    a = torch.rand(K, generator=g, dtype=torch.float64) + 0.5
    b = -0.1 * torch.rand(K, generator=g, dtype=torch.float64)
    c = 0.2 * torch.rand(K, generator=g, dtype=torch.float64)
    alpha = 1.0
    r0 = torch.randn(m, generator=g, dtype=torch.float64)
    R = torch.randn(K, m, generator=g, dtype=torch.float64)
    coef = torch.cat([b / a, c, 1.0 / a])  # what csrc/cuda/lu_glue.cpp uploads
    inv_den = 1.0 / (alpha - float((b * c / a).sum()))
    ans = harness("arrow", K, m, inv_den, coef, r0, R)
    vals = torch.tensor([hexf(s) for s in ans[1:]], dtype=torch.float64)
    x, I = vals[:m], vals[m:].view(K, m)
    xr, Ir = reference.arrowhead_solve(a, b, c, alpha, r0, R)
    torch.testing.assert_close(x, xr, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(I, Ir, rtol=1e-12, atol=1e-12)
    xc, Ic = torch.ops.fedkernels.arrowhead_solve(a, b, c, alpha, r0, R)  # the CPU op: same order
    torch.testing.assert_close(x, xc, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(I, Ic, rtol=1e-14, atol=1e-14)


# ---- tensor properties: checked once, by the native op, for the wrapper and a direct call alike ----
def _bad_arrowhead_cases(dev):
    """(a, b, c, r0, R, the message after "arrowhead_solve: ") around K = 3, m = 5, fp64."""
    f64 = dict(dtype=torch.float64)
    a, b, c = torch.full((3,), 2.0, **f64), torch.full((3,), -0.1, **f64), torch.full((3,), 0.5, **f64)
    r0, R = torch.ones(5, device=dev, **f64), torch.ones(3, 5, device=dev, **f64)
    dv = "cuda:0" if dev == DEV else "cpu"
    cases = [
        (a, b, c, r0, R[0], "R must be a 2-D [K, m] tensor, got shape (5,)"),
        (a, b, c, r0, R[None], "R must be a 2-D [K, m] tensor, got shape (1, 3, 5)"),
        (a, b, c, r0, R.long(), "R must be float32 or float64, got torch.int64"),
        (a, b, c, r0, R.half(), "R must be float32 or float64, got torch.float16"),
        (a[:2], b, c, r0, R, "a must be a scalar or a length-3 vector, got shape (2,)"),
        (a, b[None], c, r0, R, "b must be a scalar or a length-3 vector, got shape (1, 3)"),
        (a, b, torch.ones(4, **f64), r0, R, "c must be a scalar or a length-3 vector, got shape (4,)"),
        (a, b, c, r0[:4], R, "r0 must be a 1-D tensor of length 5, got shape (4,)"),
        (a, b, c, r0.float(), R, "r0 must have dtype torch.float64 (the dtype of U), got torch.float32"),
    ]
    if dev == DEV:
        cases.append((a, b, c, r0.cpu(), R, f"r0 is on cpu but U is on {dv}"))
    return cases


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", range(10))
def test_bad_tensor_args_same_from_wrapper_and_native(dev, case):
    cases = _bad_arrowhead_cases(dev)
    if case >= len(cases):
        pytest.skip("a device mismatch needs a second device")
    a, b, c, r0, R, msg = cases[case]
    for fn in (ops.arrowhead_solve, torch.ops.fedkernels.arrowhead_solve):
        one_line(ValueError, "^" + re.escape("arrowhead_solve: " + msg) + "$", fn, a, b, c, 1.0, r0, R)


def test_the_native_solve_takes_scalar_coefficients_as_the_wrapper_does():
    R, r0 = (
        torch.randn(3, 7, generator=gen(70), dtype=torch.float64),
        torch.randn(7, generator=gen(71), dtype=torch.float64),
    )
    x, I = ops.arrowhead_solve(2.0, -0.1, 0.5, 1.0, r0, R)
    s = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    xn, In = torch.ops.fedkernels.arrowhead_solve(s(2.0), s(-0.1), s(0.5), 1.0, r0, R)
    assert torch.equal(x, xn) and torch.equal(I, In)
