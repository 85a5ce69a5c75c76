"""The DP noise ops (add_gaussian_noise_, weighted_sum_noised, philox_normal): Philox4x32-10 against
Random123's known answers, the native normals bit for bit against the Python reference, their moments,
the rounding rule of the noised write (exact), independence from thread count, chunking and device,
odd shapes/strides/dtypes, opcheck, bad arguments."""

import math
import re

import pytest
import torch

from fedkernels import ops, reference as ref
from devices import DEVICES, one_line  # tests/devices.py: the cuda case skips without a GPU and the CUDA build

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]

# The Python reference's normals are slow (correctly rounded float64 steps per element) and the cases of
# one size share a (seed, counter) across dtypes: each sequence is computed once for the module.
_REF_NORMALS = {}
_ref_philox_normal = ref.philox_normal


def _ref_normals_once(n, seed, counter, j0=0):
    key = (n, seed, counter, j0)
    if key not in _REF_NORMALS:
        _REF_NORMALS[key] = _ref_philox_normal(n, seed, counter, j0)
    return _REF_NORMALS[key].clone()


@pytest.fixture(autouse=True)
def _reference_normals_once(monkeypatch):
    monkeypatch.setattr(ref, "philox_normal", _ref_normals_once)  # ref._noise_like and ref.weighted_sum_noised


# Random123 kat_vectors, "philox4x32 10": counter[4], key[2] -> output[4]
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("ctr,key,want", KAT)
def test_philox_known_answers_native_and_reference(ctr, key, want):
    got = torch.ops.fedkernels.philox4x32_10(torch.tensor([ctr], dtype=torch.int64), key[0], key[1])
    assert tuple(got[0].tolist()) == want
    assert tuple(int(w[0]) for w in ref.philox4x32_10([torch.tensor([c]) for c in ctr], key)) == want


@pytest.mark.parametrize(
    "ctr,got",
    [
        (torch.zeros(3, 3, dtype=torch.int64), "(3, 3) and dtype torch.int64"),
        (torch.zeros(2, 4), "(2, 4) and dtype torch.float32"),
    ],
)
def test_philox_counters_are_int64_rows_of_four(ctr, got):
    want = f"philox4x32_10: ctr must be an int64 tensor of shape (n, 4), got shape {got}"
    one_line(ValueError, "^" + re.escape(want) + "$", torch.ops.fedkernels.philox4x32_10, ctr, 1, 2)


@pytest.mark.parametrize(
    "n,seed,counter,j0",
    [
        (1, 0, 0, 0),
        (2, 1, 1, 1),
        (1001, 12345678901, 7, 3),
        (517, (1 << 63) - 1, (1 << 40) + 3, (1 << 33) + 1),
        (64, 5, 0, 8190),
    ],
)
def test_native_normals_are_the_reference_bits(n, seed, counter, j0):
    got = ops.philox_normal(n, seed, counter, j0)
    assert got.dtype == torch.float64 and got.shape == (n,)
    assert torch.equal(got, ref.philox_normal(n, seed, counter, j0))


def test_normals_are_a_pure_function_of_seed_counter_column():
    a = ops.philox_normal(1000, 3, 4)
    assert torch.equal(a[301:700], ops.philox_normal(399, 3, 4, 301))  # any start, odd or even
    for other in (ops.philox_normal(1000, 4, 4), ops.philox_normal(1000, 3, 5)):
        assert not torch.equal(a, other)
        assert abs(torch.corrcoef(torch.stack([a, other]))[0, 1].item()) < 0.15  # 4.7 sd at n = 1000


def test_normal_moments():
    """2e6 normals: mean, variance, skewness, excess kurtosis within 6 standard errors (the bounds of a
    fixed draw: 6 sd, not luck), the pair's two normals uncorrelated, the tail bound |N| <= 8.58."""
    n = 2_000_000
    x = ops.philox_normal(n, 20240601, 11)
    m, v = x.mean().item(), x.var().item()
    z = (x - m) / math.sqrt(v)
    assert abs(m) < 6 / math.sqrt(n)
    assert abs(v - 1) < 6 * math.sqrt(2 / n)
    assert abs((z**3).mean().item()) < 6 * math.sqrt(6 / n)
    assert abs((z**4).mean().item() - 3) < 6 * math.sqrt(24 / n)
    assert abs(torch.corrcoef(torch.stack([x[0::2], x[1::2]]))[0, 1].item()) < 6 / math.sqrt(n / 2)
    assert x.abs().max().item() <= math.sqrt(-2 * math.log(2.0**-53))
    # the CDF at a few points (Kolmogorov bound 1.95 / sqrt(n): 0.1% level)
    for t in (-2.0, -1.0, 0.0, 0.5, 1.5):
        assert abs((x <= t).double().mean().item() - 0.5 * math.erfc(-t / math.sqrt(2))) < 1.95 / math.sqrt(n)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 2, 7, 8193, 20001])
def test_add_gaussian_noise_is_the_reference_rounding(device, dtype, n):
    if dtype == torch.float64 and n > 8193:
        n = 3001  # the float64 reference rounds each fma exactly in Python: keep it small
    x = (torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64) * 3).to(dtype)
    want = ref._noise_like(x, 0.7, 99, 5)
    got = x.clone().to(device)
    assert ops.add_gaussian_noise_(got, 0.7, 99, 5) is got
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("device", DEVICES)
def test_add_gaussian_noise_blocks_with_offset_equal_the_whole(device):
    x = torch.randn(50_001, generator=torch.Generator().manual_seed(1)).to(device)
    whole = ops.add_gaussian_noise_(x.clone(), 2.0, 7, 1)
    parts = torch.cat(
        [
            ops.add_gaussian_noise_(x[a:b].clone(), 2.0, 7, 1, offset=a)
            for a, b in ((0, 8191), (8191, 30000), (30000, 50_001))
        ]
    )
    assert torch.equal(whole, parts)


def test_add_gaussian_noise_sigma_zero_and_multidim():
    x = torch.randn(3, 5, 7)
    y = x.clone()
    ops.add_gaussian_noise_(y, 0.0, 1, 1)
    assert torch.equal(x, y)
    ops.add_gaussian_noise_(y, 1.5, 1, 1)
    assert torch.equal(y.reshape(-1), ops.add_gaussian_noise_(x.reshape(-1).clone(), 1.5, 1, 1))


def _wsum_args(K, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(K, d + 3, generator=g, dtype=torch.float64).to(dtype)
    U = big[:, 2 : 2 + d]  # rows with a stride: not contiguous
    coef = torch.rand(K, generator=g, dtype=torch.float64)
    base = torch.randn(d, generator=g, dtype=torch.float64).to(dtype)
    return U, coef, base


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K,d", [(1, 1), (3, 17), (10, 8193), (33, 2 * 8192 + 5)])
def test_weighted_sum_noised_is_weighted_sum_plus_noise_exactly(device, dtype, K, d):
    """The noised pass has weighted_sum's bits plus the noise with the stated rounding: fp64 one fma,
    otherwise the float32 add of float(sigma n), then the dtype's rounding; sigma = 0 is weighted_sum."""
    U, coef, base = _wsum_args(K, d, dtype, K + d)
    U, base = U.to(device), base.to(device)
    rows = list(range(K))[::-1]
    sigma, seed, counter = 0.37, 2**40 + 1, 3
    plain = ops.weighted_sum(U, coef, base, 0.5, rows)
    assert torch.equal(ops.weighted_sum_noised(U, coef, base, 0.5, rows, sigma=0.0, seed=seed, counter=counter), plain)
    got = ops.weighted_sum_noised(U, coef, base, 0.5, rows, sigma=sigma, seed=seed, counter=counter).cpu()
    assert got.dtype == dtype
    if dtype in (torch.float16, torch.bfloat16):  # the sum is rounded to the dtype after the float32 add
        ref32 = ops.weighted_sum(U.float().cpu(), coef, base.float().cpu(), 0.5, rows)
        want = (ref32 + (sigma * ops.philox_normal(d, seed, counter)).float()).to(dtype)
        assert torch.equal(got, want)
    elif dtype == torch.float32:
        assert torch.equal(got, plain.cpu() + (sigma * ops.philox_normal(d, seed, counter)).float())
    elif d < 9000:
        assert torch.equal(got, ref._noise_like(plain.cpu(), sigma, seed, counter))
    # and the fp64 reference, within the weighted sum's rounding
    want64 = ref.weighted_sum_noised(U.cpu(), coef, base.cpu(), 0.5, rows, sigma, seed, counter)
    scale = (coef.abs() * 0.5) @ U.cpu().double().abs()[rows] + base.cpu().double().abs() + 10 * sigma
    tol = {torch.float64: 1e-14, torch.float32: 1e-6}.get(dtype, 1e-2)
    assert torch.all((got.double() - want64).abs() <= tol * scale)


@pytest.mark.parametrize("device", DEVICES)
def test_weighted_sum_noised_column_blocks_with_offset_equal_the_whole(device):
    U, coef, base = _wsum_args(12, 40_000, torch.float32, 3)
    U, base = U.to(device), base.to(device)
    whole = ops.weighted_sum_noised(U, coef, base, sigma=1.0, seed=1, counter=9)
    parts = torch.cat(
        [
            ops.weighted_sum_noised(U[:, a:b], coef, base[a:b], sigma=1.0, seed=1, counter=9, offset=a)
            for a, b in ((0, 8193), (8193, 17000), (17000, 40_000))
        ]
    )
    assert torch.equal(whole, parts)


def test_same_bits_with_1_and_2_threads():
    U, coef, base = _wsum_args(7, 100_003, torch.float32, 5)
    x = torch.randn(100_003, dtype=torch.float64)
    n0 = torch.get_num_threads()
    res = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            res.append(
                (
                    ops.weighted_sum_noised(U, coef, base, sigma=0.5, seed=2, counter=3),
                    ops.add_gaussian_noise_(x.clone(), 0.5, 2, 3),
                )
            )
    finally:
        torch.set_num_threads(n0)
    assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])


def test_wide_out_of_half_updates():
    U, coef, _ = _wsum_args(5, 1001, torch.bfloat16, 8)
    base = torch.randn(1001, dtype=torch.float64)
    got = ops.weighted_sum_noised(U, coef, base, sigma=0.2, seed=1, counter=1)
    assert got.dtype == torch.float64
    assert torch.equal(got, ref._noise_like(ops.weighted_sum(U, coef, base), 0.2, 1, 1))


def test_opcheck():
    U, coef, base = _wsum_args(4, 33, torch.float32, 1)
    U = U.contiguous()
    torch.library.opcheck(torch.ops.fedkernels.weighted_sum_noised.default, (U, coef, base, 1.0, None, 0.5, 3, 4, 0))
    torch.library.opcheck(torch.ops.fedkernels.add_gaussian_noise_.default, (torch.randn(17), 0.5, 3, 4, 0))


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(sigma=-1.0), "sigma must be a finite number >= 0"),
        (dict(sigma=float("nan")), "sigma must be a finite number >= 0"),
        (dict(seed=-1), "seed must be an int"),
        (dict(seed=1.5), "seed must be an int"),
        (dict(counter=True), "counter must be an int"),
        (dict(counter=1 << 63), "counter must be an int"),
        (dict(offset=-2), "offset must be an int"),
    ],
)
def test_bad_arguments(kw, match):
    args = dict(sigma=1.0, seed=1, counter=1, offset=0) | kw
    with pytest.raises(ValueError, match=match):
        ops.add_gaussian_noise_(torch.zeros(4), args["sigma"], args["seed"], args["counter"], args["offset"])
    with pytest.raises(ValueError, match=match):
        ops.weighted_sum_noised(torch.zeros(2, 4), [1.0, 1.0], **args)


def test_bad_tensors():
    with pytest.raises(ValueError, match="x must be contiguous"):
        ops.add_gaussian_noise_(torch.zeros(4, 4).T, 1.0, 1, 1)
    with pytest.raises(ValueError, match="floating dtype"):
        ops.add_gaussian_noise_(torch.zeros(4, dtype=torch.int32), 1.0, 1, 1)
    with pytest.raises(ValueError, match="coef must be a 1-D tensor of length 2"):
        ops.weighted_sum_noised(torch.zeros(2, 4), [1.0], sigma=1.0, seed=1, counter=1)
    with pytest.raises(RuntimeError, match="no derivative"):
        ops.add_gaussian_noise_(torch.zeros(4, requires_grad=True), 1.0, 1, 1)


# ---- bad tensors: one ValueError, the same words from the wrapper and from the native op ------------------------
def _noise_bad(dev):
    """{case: (op, its arguments with one bad tensor, the message after "<op>: ")}."""
    U, c = torch.randn(4, 10, device=dev), [0.5, -1.0, 2.0, 0.25]
    floating = "must have a floating dtype (float16, bfloat16, float32, float64), got"
    wider = " or a wider torch.float32 / torch.float64"
    x, ws = "add_gaussian_noise_", "weighted_sum_noised"

    def z(*shape, dtype=torch.float32):
        return torch.zeros(*shape, dtype=dtype, device=dev)

    return {
        "x int": (x, dict(x=z(4, dtype=torch.int32)), f"x {floating} torch.int32"),
        "x strided": (x, dict(x=z(4, 4).T), "x must be contiguous (it is written in place)"),
        "U 1-D": (ws, dict(U=U[0], coef=c), "U must be a 2-D [K, d] tensor, got shape (10,)"),
        "U int": (ws, dict(U=z(4, 10, dtype=torch.int64), coef=c), f"U {floating} torch.int64"),
        "coef length": (
            ws,
            dict(U=U, coef=c[:3]),
            "coef must be a 1-D tensor of length 4 (one per selected row), got shape (3,)",
        ),
        "rows float": (
            ws,
            dict(U=U, coef=c[:2], rows=torch.tensor([0.0, 1.0])),
            "rows must hold integer row indices, got dtype torch.float32",
        ),
        "base length": (ws, dict(U=U, coef=c, base=z(9)), "base must be a 1-D tensor of length 10, got shape (9,)"),
        "base dtype": (
            ws,
            dict(U=U, coef=c, base=z(10, dtype=torch.float64)),
            "base must have dtype torch.float32 (the dtype of U), got torch.float64",
        ),
        "base narrower": (
            ws,
            dict(U=U.bfloat16(), coef=c, base=z(10, dtype=torch.float16)),
            f"base must have dtype torch.bfloat16 (the dtype of U){wider}, got torch.float16",
        ),
        "base elsewhere": (ws, dict(U=U, coef=c, base=torch.zeros(10)), "base is on cpu but U is on cuda:0"),
    }


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", list(_noise_bad("cpu")))
def test_bad_tensor_args_same_from_wrapper_and_native(dev, case):
    if case.endswith("elsewhere") and dev == "cpu":
        pytest.skip("a second device needs a GPU")
    op, kw, msg = _noise_bad(dev)[case]
    want = "^" + re.escape(f"{op}: {msg}") + "$"
    noise = dict(sigma=1.0, seed=1, counter=2, offset=0)
    F = torch.ops.fedkernels
    if op == "add_gaussian_noise_":
        one_line(ValueError, want, ops.add_gaussian_noise_, kw["x"], **noise)
        one_line(ValueError, want, F.add_gaussian_noise_, kw["x"], *noise.values())
        return
    one_line(ValueError, want, ops.weighted_sum_noised, **kw, **noise)
    coef = torch.tensor(kw["coef"], dtype=torch.float64)  # the host vectors the wrapper passes
    one_line(
        ValueError, want, F.weighted_sum_noised, kw["U"], coef, kw.get("base"), 1.0, kw.get("rows"), *noise.values()
    )
