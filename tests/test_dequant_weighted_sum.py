"""dequant_weighted_sum: int8 / float8 e4m3 blockwise rows summed into a float32/float64 result without a
dequantised copy, against the float64 reference (a bound from the arithmetic: one rounding of each weight, one
fma per code), the flags, thread counts, strides, bad inputs; CUDA cases skip without a GPU."""

import re

import pytest
import torch

from fedkernels import ops, reference as ref
from devices import DEVICES, one_line  # tests/devices.py: the cuda case skips without a GPU and the CUDA build

CODES = [torch.int8, torch.float8_e4m3fn]
# (K, d, block): one column, blocks that do not divide d (a short last block), a block wider than d, one
# block per column, several 8192-column chunks, a block across a chunk boundary
SHAPES = [
    (1, 1, 1),
    (1, 7, 3),
    (3, 100, 7),
    (2, 50, 64),
    (5, 301, 1),
    (4, 8193, 64),
    (6, 20000, 1000),
    (16, 2 * 8192 + 5, 4096),
    (7, 300, 300),
    (9, 12345, 5000),
]


def _codes(K, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int8:
        return torch.randint(-127, 128, (K, d), generator=g, dtype=torch.int8)
    return (torch.randn(K, d, generator=g) * 40).to(torch.float8_e4m3fn)


def _scales(K, nb, seed=1):
    return torch.rand(K, nb, generator=torch.Generator().manual_seed(seed)) * 0.02 + 1e-4


def _bound(Q, S, block, coef, alpha, rows, base, odt):
    """(n + 2) eps of the accumulation type times the sum of magnitudes: one rounding of each weight
    alpha coef scale, one fma per code, the add of base; the float64 reference's own error is below it."""
    A = ref.dequantize_blocks(Q, S, block).abs()
    r = torch.arange(Q.size(0)) if rows is None else torch.as_tensor(rows)
    c = torch.as_tensor(coef, dtype=torch.float64).abs() * abs(alpha)
    mag = c @ A[r] + (0 if base is None else base.double().abs())
    return (len(r) + 2) * torch.finfo(odt).eps * mag + 1e-300


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("K,d,block", SHAPES)
@pytest.mark.parametrize("odt", [torch.float32, torch.float64])
def test_matches_reference(device, code, K, d, block, odt):
    Q, S = _codes(K, d, code, seed=K + d), _scales(K, -(-d // block))
    coef = (torch.rand(K, dtype=torch.float64) - 0.3).tolist()
    base = torch.randn(d, dtype=odt)
    out, ok = ops.dequant_weighted_sum(Q.to(device), S.to(device), coef, block, base=base.to(device), alpha=0.7)
    want, wok = ref.dequant_weighted_sum(Q, S, coef, block, base=base, alpha=0.7)
    assert out.dtype == odt and out.device.type == device and ok.tolist() == wok.tolist() == [True] * K
    assert torch.all((out.cpu().double() - want).abs() <= _bound(Q, S, block, coef, 0.7, None, base, odt))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("code", CODES)
def test_rows_subset_repeats_and_default_dtype(device, code):
    K, d, block = 6, 1001, 100
    Q, S = _codes(K, d, code), _scales(K, 11)
    rows, coef = [5, 0, 0, 3], [0.25, -1.0, 0.5, 2.0]
    out, ok = ops.dequant_weighted_sum(Q.to(device), S.to(device), coef, block, rows=rows)
    want, _ = ref.dequant_weighted_sum(Q, S, coef, block, rows=rows)
    assert out.dtype == torch.float32 and ok.shape == (4,)
    assert torch.all((out.cpu().double() - want).abs() <= _bound(Q, S, block, coef, 1.0, rows, None, torch.float32))
    empty, ok0 = ops.dequant_weighted_sum(Q.to(device), S.to(device), [], block, rows=[])
    assert torch.equal(empty.cpu(), torch.zeros(d)) and ok0.numel() == 0


def test_every_e4m3_code_converts_exactly():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(1, -1)
    out, ok = ops.dequant_weighted_sum(codes, torch.ones(1, 1), [1.0], 256, out_dtype=torch.float64)
    want = codes.to(torch.float64)[0]
    nan = torch.isnan(want)
    assert nan.sum() == 2 and torch.equal(torch.isnan(out), nan) and torch.equal(out[~nan], want[~nan])
    assert ok.tolist() == [False]  # the NaN codes flag the row
    keep = codes[:, ~nan]
    assert ops.dequant_weighted_sum(keep, torch.ones(1, 1), [1.0], 256)[1].tolist() == [True]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("code", CODES)
def test_flags_are_exact_and_good_rows_sum_after_dropping(device, code):
    K, d, block = 7, 9000, 128
    Q, S = _codes(K, d, code), _scales(K, -(-d // block))
    S[1, 3] = float("nan")
    S[3, -1] = float("inf")  # the short last block
    S[5, 40] = float("-inf")
    if code == torch.float8_e4m3fn:
        Q.view(torch.uint8)[6, 8500] = 0x7F  # a NaN code
    S[0].fill_(3e38)  # finite, huge: its weights need float64 (|w| > 3e38)
    bad = [1, 3, 5] + ([6] if code == torch.float8_e4m3fn else [])
    out, ok = ops.dequant_weighted_sum(Q.to(device), S.to(device), [1.0] * K, block)
    assert (
        ok.tolist() == [k not in bad for k in range(K)] == ref.dequant_weighted_sum(Q, S, [1.0] * K, block)[1].tolist()
    )
    keep = [k for k in range(1, K) if k not in bad]
    out, ok = ops.dequant_weighted_sum(Q.to(device), S.to(device), [0.5] * len(keep), block, rows=keep)
    assert ok.all() and torch.isfinite(out).all()


def test_huge_weights_accumulate_in_float64():
    """alpha coef scale = +-1e40 does not fit in float32: the rows cancel exactly in float64."""
    Q = torch.ones(2, 10, dtype=torch.int8)
    S = torch.full((2, 1), 1e30)
    out, ok = ops.dequant_weighted_sum(Q, S, [1e10, -1e10], 10)
    assert out.dtype == torch.float32 and torch.equal(out, torch.zeros(10)) and ok.all()


@pytest.mark.parametrize("code", CODES)
def test_same_bits_with_1_and_2_threads_and_strided_rows(code):
    K, d, block = 16, 3 * 8192 + 77, 300
    big = _codes(K, d + 9, code, seed=4)
    Q = big[:, 3 : 3 + d]  # row stride d + 9, no copy
    S = _scales(K, -(-d // block), seed=5)
    coef = torch.rand(K, dtype=torch.float64)
    n0 = torch.get_num_threads()
    try:
        got = []
        for n in (1, 2):
            torch.set_num_threads(n)
            got.append(ops.dequant_weighted_sum(Q, S, coef, block)[0])
    finally:
        torch.set_num_threads(n0)
    assert torch.equal(got[0], got[1])
    assert torch.equal(got[0], ops.dequant_weighted_sum(Q.contiguous(), S, coef, block)[0])


def test_empty_shapes():
    out, ok = ops.dequant_weighted_sum(torch.zeros(3, 0, dtype=torch.int8), torch.zeros(3, 0), [1.0] * 3, 4)
    assert out.shape == (0,) and ok.tolist() == [True] * 3
    out, ok = ops.dequant_weighted_sum(
        torch.zeros(0, 5, dtype=torch.int8), torch.zeros(0, 2), [], 3, base=torch.ones(5, dtype=torch.float64)
    )
    assert torch.equal(out, torch.ones(5, dtype=torch.float64)) and ok.numel() == 0


def test_bad_inputs_one_line_value_errors():
    Q, S = _codes(3, 10, torch.int8), _scales(3, 4)
    f = ops.dequant_weighted_sum
    cases = [
        (lambda: f(Q.float(), S, [1.0] * 3, 3), "Q must hold int8 or float8_e4m3fn"),
        (lambda: f(Q[0], S, [1.0] * 3, 3), "Q must be a 2-D"),
        (lambda: f(Q, S, [1.0] * 3, 0), "block must be an int >= 1"),
        (lambda: f(Q, S, [1.0] * 3, 2.5), "block must be an int >= 1"),
        (lambda: f(Q, S, [1.0] * 3, 4), r"scales must be \[K, ceil\(d / block\)\] = \[3, 3\]"),
        (lambda: f(Q, S.double(), [1.0] * 3, 3), "scales must be float32"),
        (lambda: f(Q, S, [1.0] * 2, 3), "coef must be a 1-D tensor of length 3"),
        (lambda: f(Q, S, [1.0, float("nan"), 1.0], 3), "coef must be finite"),
        (lambda: f(Q, S, [1.0] * 3, 3, alpha=float("inf")), "alpha must be a finite number"),
        (lambda: f(Q, S, [1.0] * 3, 3, rows=[0, 3]), r"rows must lie in \[0, 3\)"),
        (lambda: f(Q, S, [1.0] * 3, 3, base=torch.zeros(10, dtype=torch.float16)), "base must be float32 or float64"),
        (lambda: f(Q, S, [1.0] * 3, 3, base=torch.zeros(9)), "base must be a 1-D tensor of length 10"),
        (
            lambda: f(Q, S, [1.0] * 3, 3, base=torch.zeros(10), out_dtype=torch.float64),
            "out_dtype torch.float64 differs",
        ),
        (lambda: f(Q, S, [1.0] * 3, 3, out_dtype=torch.bfloat16), "out_dtype must be torch.float32 or torch.float64"),
    ]
    for call, msg in cases:
        with pytest.raises(ValueError, match=msg) as e:
            call()
        assert "\n" not in str(e.value) and str(e.value).startswith("dequant_weighted_sum: ")


def test_opcheck_and_no_derivative():
    Q, S = _codes(4, 77, torch.float8_e4m3fn), _scales(4, 3)
    fp8 = (Q, S, torch.ones(4, dtype=torch.float64), 30, None, 1.0, None, None)
    i8 = (
        Q.view(torch.uint8).view(torch.int8),
        S,
        torch.ones(2, dtype=torch.float64),
        30,
        torch.zeros(77, dtype=torch.float64),
        0.5,
        torch.tensor([3, 1]),
        None,
    )
    op = torch.ops.fedkernels.dequant_weighted_sum.default
    torch.library.opcheck(op, i8, test_utils=("test_schema", "test_faketensor"))
    # the schema check's mutation probe multiplies the inputs, which torch does not do on float8
    torch.library.opcheck(op, fp8, test_utils=("test_faketensor",))
    Sg = S.clone().requires_grad_()
    out, _ = torch.ops.fedkernels.dequant_weighted_sum(Q, Sg, torch.ones(4, dtype=torch.float64), 30)
    with pytest.raises(RuntimeError, match="fedkernels.dequant_weighted_sum has no derivative"):
        out.sum().backward()


def test_cuda_per_thread_logic_on_the_host(tmp_path):
    """The CUDA kernels' host-checkable logic (csrc/cuda/*.cuh under FEDKERNELS_HD_ONLY, compiled with g++): the
    e4m3 conversion of every code equals torch's, the sparse kernel's binary search finds each list's first entry
    at or after a column, and a run of equal indices starts where the index changes."""
    import os
    import shutil
    import subprocess

    if shutil.which("g++") is None:
        pytest.skip("no g++")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = tmp_path / "hd.cpp"
    src.write_text(f"""#define FEDKERNELS_HD_ONLY
#include "{root}/csrc/cuda/dequant_weighted_sum.cuh"
#include "{root}/csrc/cuda/sparse_weighted_sum.cuh"
#include <cstdio>
using namespace fedkernels::cuda;
int main() {{
  for (int b = 0; b < 256; ++b) std::printf("%.17g\\n", (double)dq::e4m3((uint8_t)b));
  const int64_t idx[] = {{1, 3, 3, 3, 7, 9}};
  for (int v = 0; v <= 10; ++v) std::printf("%ld\\n", (long)sp::lower_bound(idx, 0, 6, v));
  for (int p = 0; p < 6; ++p) std::printf("%d\\n", (int)sp::run_start(idx, 0, p));
}}
""")
    exe = tmp_path / "hd"
    subprocess.run(["g++", "-std=c++17", "-O1", str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()
    got = torch.tensor([float(x) for x in out[:256]], dtype=torch.float64)
    want = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan) and torch.equal(got[~nan], want[~nan])
    assert [int(x) for x in out[256:267]] == [0, 0, 1, 1, 4, 4, 4, 4, 5, 5, 6]
    assert [int(x) for x in out[267:]] == [1, 1, 0, 0, 1, 1]


# ---- bad tensors: one ValueError, the same words from the wrapper and from the native op ------------------------
def _dequant_bad(dev):
    """{case: (arguments with one bad tensor, the message after "dequant_weighted_sum: ")}."""
    Q, S, c = _codes(3, 10, torch.int8).to(dev), _scales(3, 4).to(dev), [1.0, -0.5, 2.0]

    def z(*shape, dtype=torch.float32):
        return torch.zeros(*shape, dtype=dtype, device=dev)

    return {
        "Q 1-D": (dict(Q=Q[0]), "Q must be a 2-D [K, d] tensor of codes, got shape (10,)"),
        "Q float": (dict(Q=Q.float()), "Q must hold int8 or float8_e4m3fn codes, got torch.float32"),
        "scales shape": (
            dict(block=4),
            "scales must be [K, ceil(d / block)] = [3, 3] (one per row and block of 4), got shape (3, 4)",
        ),
        "scales 1-D": (
            dict(scales=S[0]),
            "scales must be [K, ceil(d / block)] = [3, 4] (one per row and block of 3), got shape (4,)",
        ),
        "scales dtype": (dict(scales=S.double()), "scales must be float32, got torch.float64"),
        "coef length": (
            dict(coef=c[:2]),
            "coef must be a 1-D tensor of length 3 (one per selected row), got shape (2,)",
        ),
        "rows 2-D": (dict(coef=c[:2], rows=[[0, 1]]), "rows must be a 1-D sequence of row indices, got shape (1, 2)"),
        "base length": (dict(base=z(9)), "base must be a 1-D tensor of length 10, got shape (9,)"),
        "base half": (
            dict(base=z(10, dtype=torch.float16)),
            "base must be float32 or float64 (the result's dtype), got torch.float16",
        ),
        "base int": (
            dict(base=z(10, dtype=torch.int64)),
            "base must be float32 or float64 (the result's dtype), got torch.int64",
        ),
        "out_dtype not base's": (
            dict(base=z(10), out_dtype=torch.float64),
            "out_dtype torch.float64 differs from base's dtype torch.float32",
        ),
        "scales elsewhere": (dict(scales=S.cpu()), "scales is on cpu but Q is on cuda:0"),
        "base elsewhere": (dict(base=torch.zeros(10)), "base is on cpu but the rows are on cuda:0"),
    }, dict(Q=Q, scales=S, coef=c, block=3)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", list(_dequant_bad("cpu")[0]))
def test_bad_tensor_args_same_from_wrapper_and_native(dev, case):
    if case.endswith("elsewhere") and dev == "cpu":
        pytest.skip("a second device needs a GPU")
    cases, good = _dequant_bad(dev)
    kw, msg = cases[case]
    a = good | kw
    want = "^" + re.escape(f"dequant_weighted_sum: {msg}") + "$"
    one_line(ValueError, want, ops.dequant_weighted_sum, **a)
    coef = torch.tensor(a["coef"], dtype=torch.float64)  # the host vectors the wrapper passes
    rows = None if a.get("rows") is None else torch.as_tensor(a["rows"])
    args = (a["Q"], a["scales"], coef, a["block"], a.get("base"), 1.0, rows, a.get("out_dtype"))
    one_line(ValueError, want, torch.ops.fedkernels.dequant_weighted_sum, *args)
