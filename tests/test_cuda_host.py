"""What the CUDA sources share, checked without a GPU: every op's schema has one CUDA registration, the
kernels stay free of device asserts and torch headers; and select's per-thread logic on the host.

Each op's host-harness tests (its kernel's per-thread logic compiled with g++ and compared with the
float64 reference: tests/host_harness.py, tests/cuda_host/<op>.cpp) live in its tests/test_<op>.py.
"""

from __future__ import annotations

import os

import pytest
import torch

import host_harness  # tests/host_harness.py: the CUDA kernels' per-thread logic on the host
from devices import gen  # tests/devices.py
from fedkernels import reference
from host_harness import CUDA_SRC, ROOT, hexf


@pytest.fixture(scope="module")
def harness():
    yield from host_harness.session()


# ---- static rules of the CUDA sources (cheap, run everywhere) ----------------------------------------
def _read(path):
    with open(path) as f:
        return f.read()


def test_every_op_in_the_schema_has_a_cuda_registration():
    import re

    # every schema lives in its op's CPU file (TORCH_LIBRARY_FRAGMENT); device-independent ops
    # (CompositeExplicitAutograd: test hooks without a tensor on a device) need no CUDA kernel
    schema = re.compile(r'm\.def\("([a-z_0-9]+)\(')  # a schema string (pybind's m.def("build_info", ...) is not one)
    assert not schema.search(_read(os.path.join(ROOT, "csrc", "fedkernels.cpp"))), (
        "a schema belongs in csrc/cpu/<op>.cpp"
    )
    ops, cpu_dir = set(), os.path.join(ROOT, "csrc", "cpu")
    for name in sorted(os.listdir(cpu_dir)):
        src = _read(os.path.join(cpu_dir, name))
        if schema.search(src):
            assert "TORCH_LIBRARY_FRAGMENT(fedkernels, m)" in src and "TORCH_LIBRARY(" not in src, name
            ops |= set(schema.findall(src))
        for block in re.findall(r"TORCH_LIBRARY_IMPL\(fedkernels, CompositeExplicitAutograd, m\)\s*\{([^}]*)\}", src):
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
            assert "<cassert>" not in src and "assert(" not in src.replace("static_assert(", ""), (
                f"{name}: a device assert poisons the CUDA context; validate on the host"
            )
            assert "torch/" not in src and "ATen/" not in src, f"{name}: kernels stay free of torch headers"


# ---- gc_project work plan -----------------------------------------------------------------------------


# ---- select (order_mean / closest_mean: one thread per column, stable ranks) -------------------------
@pytest.mark.parametrize("K,d", [(1, 3), (2, 5), (3, 7), (4, 40), (7, 33), (10, 50), (33, 9)])
def test_select_columns_match_reference(harness, K, d):
    """sel::order_mean_col / closest_mean_col per emulated thread against the float64 reference: the
    median of odd k exactly, the other means to float64 summation order; ties (small integers) and a NaN
    and an Inf row (NaN columns as the reference; the row flags as finite_rows)."""
    from fedkernels.ops.select import median_bounds, trim_bounds

    g = gen(K * 7 + d)
    U = torch.randn(K, d, generator=g, dtype=torch.float64)
    U[:, : d // 2] = torch.randint(-2, 3, (K, d // 2), generator=g).double()  # columns full of ties
    if K >= 3:
        U[1, 0], U[2, d - 1] = float("nan"), float("inf")

    def ask(mode, lo, hi):
        ans = harness("select", mode, K, d, lo, hi, U)
        vals = torch.tensor([hexf(x) for x in ans[1 : 1 + d]], dtype=torch.float64)
        return vals, [bool(int(x)) for x in ans[1 + d :]]

    for lo, hi in {median_bounds(K), trim_bounds(K, 0.2), (0, K), (K - 1, K)}:
        got, ok = ask(0, lo, hi)
        want = reference.order_mean(U, lo, hi)
        assert ok == reference.finite_rows(U).tolist()
        assert torch.equal(got.isnan(), want.isnan())
        torch.testing.assert_close(got, want, rtol=4 * K * 2.0**-53, atol=4 * K * 2.0**-53 * 4, equal_nan=True)
        if hi - lo == 1:
            assert torch.equal(got.nan_to_num(), want.nan_to_num())
    for beta in sorted({1, max(1, K // 2), K}):
        got, _ = ask(1, beta, 0)
        want = reference.closest_mean(U, beta)
        assert torch.equal(got.isnan(), want.isnan())
        torch.testing.assert_close(got, want, rtol=4 * K * 2.0**-53, atol=4 * K * 2.0**-53 * 4, equal_nan=True)
