"""finite_rows: the native op against the float64 reference."""

import re

import pytest
import torch

from fedkernels import ops, reference as ref
from devices import DEVICES, FLOATS, gen, one_line, randn, settle  # tests/devices.py: every case on cpu and cuda
import host_harness  # tests/host_harness.py: the CUDA kernels' per-thread logic on the host

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


# ---- finite_rows -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_finite_rows(dtype):
    U = torch.randn(6, 40_000).to(dtype)
    U[1, 39_999] = float("nan")
    U[4, 0] = float("inf")
    U[5, 20_000] = -float("inf")
    expect = torch.tensor([True, False, True, True, False, False])
    assert torch.equal(ops.finite_rows(U), expect)
    assert torch.equal(ops.finite_rows(U), ref.finite_rows(U))
    big = torch.full((2, 10), 3e38, dtype=torch.float32)  # huge but finite
    assert ops.finite_rows(big).all()


# ---- one list of samples drives correctness and opcheck on every device (pytorch/extension-cpp) -------------
def sample_inputs(dev):
    """Arguments of torch.ops.fedkernels.finite_rows (U,): one element; float32 rows with a NaN at the end
    of one and an Inf at the start of another; a float16 column chunk of a wider buffer (unaligned rows)."""
    U = randn(dev, 5, 300, seed=1)
    U[1, 299], U[3, 0] = float("nan"), float("inf")
    return [
        [randn(dev, 1, 1, dtype=torch.float64, seed=2)],
        [U],
        [randn(dev, 4, 1003, dtype=torch.float16, seed=3)[:, 1:1000]],
    ]


@pytest.mark.parametrize("dev", DEVICES)
def test_finite_rows_samples_match_reference(dev):
    for (U,) in sample_inputs(dev):
        ok = torch.ops.fedkernels.finite_rows(U)
        assert ok.dtype == torch.bool and ok.device == U.device
        assert torch.equal(ok, ref.finite_rows(U))


@pytest.mark.parametrize("dev", DEVICES)
def test_finite_rows_opcheck(dev):
    for args in sample_inputs(dev):
        torch.library.opcheck(torch.ops.fedkernels.finite_rows.default, tuple(args))


# ---- on every device (cpu, and cuda where there is one: tests/devices.py) --------------------
@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("K,d", [(1, 1), (5, 7), (6, 70_001)])
def test_finite_rows_on_every_device(dev, K, d, dtype):
    U = randn(dev, K, d, dtype=dtype, seed=d)
    if K > 1:
        U[0, d - 1] = float("nan")
        U[K - 1, d // 2] = float("inf")
    ok = ops.finite_rows(U)
    assert ok.dtype == torch.bool
    assert torch.equal(ok.cpu(), ref.finite_rows(U.cpu()))
    view = U[:, 1:] if d > 1 else U
    assert torch.equal(ops.finite_rows(view).cpu(), ref.finite_rows(view.cpu()))


@pytest.mark.parametrize("dev", DEVICES)
def test_bad_args_finite_rows(dev):
    U = randn(dev, 6, 1001, seed=54)
    one_line(ValueError, r"finite_rows: U must be a 2-D \[K, d\] tensor, got shape \(1001,\)", ops.finite_rows, U[0])
    one_line(
        ValueError,
        r"finite_rows: U must be a 2-D \[K, d\] tensor, got shape \(1001,\)",
        torch.ops.fedkernels.finite_rows,
        U[0],
    )
    one_line(
        ValueError,
        r"finite_rows: U must have a floating dtype .*got torch.int32",
        ops.finite_rows,
        torch.zeros(6, 3, dtype=torch.int32, device=dev),
    )
    U[4, 999] = float("nan")
    ok = ops.finite_rows(U)
    settle(dev)
    assert ok.device.type == dev and torch.equal(ok.cpu(), ref.finite_rows(U.cpu()))
    assert ok.tolist() == [True, True, True, True, False, True]


# ---- U's shape, dtype and layout: checked once, by the native op, for the wrapper and a direct call alike ----
BAD_TENSOR_ARGS = [  # (U on dev, the whole message)
    (lambda dev: torch.zeros(7, device=dev), "finite_rows: U must be a 2-D [K, d] tensor, got shape (7,)"),
    (lambda dev: torch.zeros(2, 3, 4, device=dev), "finite_rows: U must be a 2-D [K, d] tensor, got shape (2, 3, 4)"),
    (lambda dev: torch.zeros((), device=dev), "finite_rows: U must be a 2-D [K, d] tensor, got shape ()"),
    (
        lambda dev: torch.zeros(3, 4, dtype=torch.int32, device=dev),
        "finite_rows: U must have a floating dtype (float16, bfloat16, float32, float64), got torch.int32",
    ),
    (
        lambda dev: torch.zeros(3, 4, dtype=torch.bool, device=dev)[:, ::2],
        "finite_rows: U must have a floating dtype (float16, bfloat16, float32, float64), got torch.bool",
    ),
    (
        lambda dev: torch.zeros(3, 4, dtype=torch.complex64, device=dev),
        "finite_rows: U must have a floating dtype (float16, bfloat16, float32, float64), got torch.complex64",
    ),
]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", range(len(BAD_TENSOR_ARGS)))
def test_bad_tensor_args_same_from_wrapper_and_native(dev, case):
    make, msg = BAD_TENSOR_ARGS[case]
    U = make(dev)
    for fn in (ops.finite_rows, torch.ops.fedkernels.finite_rows):
        one_line(ValueError, "^" + re.escape(msg) + "$", fn, U)


def test_compiled_bad_U_raises_the_native_error():
    """Under torch.compile the fake kernel does not stop tracing on a 0-d U; the native op refuses it."""
    torch._dynamo.reset()
    f = torch.compile(lambda U: ops.finite_rows(U), fullgraph=True)
    one_line(ValueError, r"^finite_rows: U must be a 2-D \[K, d\] tensor, got shape \(\)$", f, torch.zeros(()))


def test_the_native_op_refuses_a_matrix_without_unit_column_stride():
    """The wrapper copies such a U once; a direct call must pass one the kernel reads."""
    U = torch.randn(4, 6)[:, ::2]
    assert torch.equal(ops.finite_rows(U), ref.finite_rows(U))
    one_line(
        ValueError,
        r"^finite_rows: U must have unit column stride, got strides \(6, 2\) \(the fedkernels.ops wrapper copies it once\)$",
        torch.ops.fedkernels.finite_rows,
        U,
    )


# ---- the CUDA kernel's per-thread logic on the host (tests/host_harness.py, tests/cuda_host/finite_rows.cpp) -------
@pytest.fixture(scope="module")
def harness():
    yield from host_harness.session()


# (element size, V = 16 / size): fp32, fp16/bf16, fp64; values are given as float64 (exact)
FR_TYPES = [(4, 4), (2, 8), (8, 2)]


def _finite_case(harness, size, V, K, d, ld, u_off, bad_at, seed=0):
    U = torch.randn(K, ld, generator=gen(seed + K * 31 + d), dtype=torch.float64)
    for r, j, v in bad_at:
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
    ld = -(-d // V) * V  # padded rows: 16-byte aligned
    for u_off, want_vec in ((0, True), (size, False)):  # aligned base / misaligned base
        for r in range(K):
            bad = [(r, cols[r % len(cols)], (nan, inf, -inf)[r % 3])] if r % 2 == 0 else []
            if K > 2 and r >= 2:
                bad = bad[:1] if r % 5 else []
            vec, ok, U = _finite_case(harness, size, V, K, d, ld, u_off, bad, seed=r)
            assert vec == want_vec
            assert torch.equal(ok, ref.finite_rows(U)), (u_off, r)
            if K > 8:
                break


@pytest.mark.parametrize("size,V", FR_TYPES)
def test_finite_rows_misaligned_rows_take_the_scalar_path(harness, size, V):
    K, d = 5, 3 * 256 * 4 * V + 3
    ld = d + 2  # row stride not a multiple of 16 bytes
    assert (ld * size) % 16
    bad = [(1, d - 1, float("nan")), (3, 256 * 4 * V, float("-inf")), (4, 0, float("inf"))]
    vec, ok, U = _finite_case(harness, size, V, K, d, ld, 0, bad)
    assert not vec
    assert ok.tolist() == [True, False, True, False, False]
    assert torch.equal(ok, ref.finite_rows(U))
    # one row: any stride is aligned enough for the vector path
    vec, ok, U = _finite_case(harness, size, V, 1, d, ld, 0, [(0, d - 1, float("nan"))])
    assert vec and ok.tolist() == [False]
