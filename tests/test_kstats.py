"""kstats: Kuramoto's statistics in one pass, against the float64 reference (two passes: the mean, then
the rows against it) and the Gram route (dot = G p, nsq = diag G, nbar = p'G p); shapes, strides, dtypes,
thread counts, the flags, edge cases, bad inputs."""

import re
import subprocess
import sys

import pytest
import torch

from fedkernels import ops, reference as ref
from devices import DEVICES, FLOATS, gen, one_line, randn  # tests/devices.py: every case on cpu and cuda
import host_harness  # tests/host_harness.py: the CUDA kernels' per-thread logic on the host
from host_harness import hexf

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# (K, d): odd sizes, one chunk and several, one part and many (K = 16, d = 200k: 64 parts), K >> d
SHAPES = [
    (1, 1),
    (2, 3),
    (3, 17),
    (5, 1000),
    (7, 4099),
    (16, 2048 * 3 + 5),
    (33, 257),
    (1000, 76),
    (300, 150),
    (4, 70001),
]


def _weights(K, seed=0):
    p = torch.rand(K, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.1
    return p / p.sum()


def _close(got, want, U, p, tol=1e-12):
    """dot, nsq, nbar within tol relative to the sums of magnitudes they are made of (fp64 rounding)."""
    A = U.to(torch.float64).abs()
    m = p.abs() @ A
    for g, w, scale in ((got[0], want[0], A @ m), (got[1], want[1], (A * A).sum(1)), (got[2], want[2], m @ m)):
        assert g.dtype == torch.float64 and g.shape == w.shape
        assert torch.all((g - w).abs() <= tol * scale + 1e-300), (g, w)


def _odd(K, d, dtype, seed=0):
    """U as a strided view: rows of a wider buffer, from column 1."""
    big = torch.randn(K, d + 5, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.3
    return big.to(dtype)[:, 1 : 1 + d]


@pytest.mark.parametrize("K,d", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kstats_matches_reference_and_gram_route(K, d, dtype):
    U = _odd(K, d, dtype, seed=K + d)
    assert U.stride(0) == d + 5
    p = _weights(K, seed=d)
    got = ops.kstats(U, p)
    _close(got, ref.kstats(U, p), U, p)
    G = ref.gram(U)
    _close(got, (G @ p, torch.diagonal(G), p @ G @ p), U, p)  # spec §9 item 4: 1e-12
    assert got[3].tolist() == [True] * K
    assert got[0].shape == (K,) and got[2].shape == () and got[3].dtype == torch.bool


def test_kstats_list_weights_and_contiguous_matches_strided():
    U = _odd(9, 333, torch.float32)
    p = _weights(9).tolist()
    a, b = ops.kstats(U, p), ops.kstats(U.contiguous(), torch.tensor(p, dtype=torch.float64))
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("K,d", [(16, 200_000), (300, 5000), (1000, 76)])
def test_kstats_same_bits_with_1_and_2_threads(K, d):
    """K = 16: threads take the 64 parts of d; K = 300: 2 parts; K = 1000, d = 76: one part."""
    U, p = _odd(K, d, torch.float32, seed=3), _weights(K, 3)
    n0 = torch.get_num_threads()
    try:
        out = []
        for n in (1, 2):
            torch.set_num_threads(n)
            out.append(ops.kstats(U, p))
    finally:
        torch.set_num_threads(n0)
    for a, b in zip(*out):
        assert torch.equal(a, b)
    for a, b in zip(out[0], ops.kstats(U, p)):  # and across calls
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K,d", [(1, 1), (5, 3), (12, 1031), (40, 7000)])
def test_kstats_flags_are_exact(K, d, dtype):
    U = _odd(K, d, dtype, seed=K)
    for k in range(1, K, 2):
        U[k, (k * 13) % d] = (float("nan"), float("inf"), float("-inf"))[k % 3]
    U[0].fill_(torch.finfo(dtype).max)  # finite, the largest values (fp64: its squared norm overflows)
    ok = ops.kstats(U, _weights(K))[3]
    assert ok.tolist() == ref.finite_rows(U).tolist() == [k % 2 == 0 for k in range(K)]


def test_kstats_good_rows_stats_after_dropping_bad_rows():
    U = _odd(6, 500, torch.float32)
    U[2, 7] = float("nan")
    dot, nsq, nbar, ok = ops.kstats(U, _weights(6))
    assert ok.tolist() == [True, True, False, True, True, True]
    assert torch.isnan(nbar) and torch.isnan(dot).all()  # the mean saw the NaN
    assert torch.isfinite(nsq[ok]).all()
    keep = ok.nonzero().reshape(-1)
    p = _weights(6)[keep]
    p = p / p.sum()
    _close(ops.kstats(U[keep], p), ref.kstats(U[keep], p), U[keep], p)


def test_kstats_empty_and_zero_columns():
    dot, nsq, nbar, ok = ops.kstats(torch.zeros(0, 5), torch.zeros(0, dtype=torch.float64))
    assert dot.shape == nsq.shape == ok.shape == (0,) and float(nbar) == 0.0
    dot, nsq, nbar, ok = ops.kstats(torch.zeros(3, 0), _weights(3))
    assert torch.equal(dot, torch.zeros(3, dtype=torch.float64)) and torch.equal(nsq, dot)
    assert float(nbar) == 0.0 and ok.tolist() == [True] * 3
    z = ops.kstats(torch.zeros(4, 9), _weights(4))  # zero rows: zeros, finite
    assert float(z[0].abs().sum() + z[1].sum() + z[2]) == 0.0 and z[3].all()


def test_kstats_bad_inputs_name_the_argument():
    U = torch.randn(4, 10)
    with pytest.raises(ValueError, match="kstats: U must be a 2-D"):
        ops.kstats(torch.randn(10), [1.0])
    with pytest.raises(ValueError, match="floating dtype"):
        ops.kstats(torch.ones(2, 3, dtype=torch.int64), [0.5, 0.5])
    with pytest.raises(ValueError, match=r"kstats: p must be a 1-D tensor of length 4"):
        ops.kstats(U, [0.5, 0.5])
    with pytest.raises(ValueError, match="kstats: p must be finite"):
        ops.kstats(U, [0.25, float("nan"), 0.25, 0.5])


def test_kstats_has_no_derivative():
    U = torch.randn(3, 8, requires_grad=True)
    dot = torch.ops.fedkernels.kstats(U, torch.full((3,), 1 / 3, dtype=torch.float64))[0]
    with pytest.raises(RuntimeError, match="fedkernels.kstats has no derivative"):
        dot.sum().backward()


# ---- one list of samples drives correctness and opcheck on every device (pytorch/extension-cpp) -------------
def sample_inputs(dev):
    """Arguments of torch.ops.fedkernels.kstats (U, p): one element; float32 rows with a NaN in one; a
    bfloat16 column chunk of a wider buffer (unaligned rows). p: host float64 weights on every device."""
    U = randn(dev, 5, 300, seed=1)
    U[2, 17] = float("nan")
    return [
        [randn(dev, 1, 1, dtype=torch.float64, seed=2), _weights(1)],
        [U, _weights(5, seed=3)],
        [randn(dev, 4, 1003, dtype=torch.bfloat16, seed=4)[:, 1:1000], _weights(4, seed=5)],
    ]


@pytest.mark.parametrize("dev", DEVICES)
def test_kstats_samples_match_reference(dev):
    for U, p in sample_inputs(dev):
        got = torch.ops.fedkernels.kstats(U, p)
        assert all(t.device == U.device for t in got)
        want = ref.kstats(U.cpu(), p)
        assert torch.equal(got[3].cpu(), want[3])
        good = want[3]  # a NaN row: NaN in its own dot and nsq and in nbar
        if good.all():
            _close([t.cpu() for t in got], want, U.cpu(), p)
        else:
            assert torch.isnan(got[2]) and torch.isnan(got[1][~good.to(U.device)]).all()


@pytest.mark.parametrize("dev", DEVICES)
def test_kstats_opcheck(dev):
    for args in sample_inputs(dev):
        torch.library.opcheck(
            torch.ops.fedkernels.kstats.default, tuple(args), test_utils=("test_schema", "test_faketensor")
        )


def test_kstats_sharded_sums_the_shards():
    """Column shards: each shard's mean is exact (column-local), so the ranks' sums add up to the whole."""

    class TwoShards:  # stands for 2 ranks holding U[:, :a] and U[:, a:]
        def __init__(self, other):
            self.other = other

        def all_reduce_sum(self, t):
            return t + self.other.pop(0)

        def all_reduce_max(self, t):
            return t

        def all_reduce_and(self, m):
            return m & self.other.pop(0)

    U, p = _odd(7, 301, torch.float64), _weights(7)
    d2, n2, b2, ok2 = ops.kstats(U[:, 150:], p)
    ok2 = ok2.clone()
    ok2[3] = False
    with ops.reduce_across(TwoShards([torch.cat([d2, n2, b2.reshape(1)]), ok2])):
        dot, nsq, nbar, ok = ops.kstats(U[:, :150], p)
    _close((dot, nsq, nbar), ref.kstats(U, p), U, p)
    assert ok.tolist() == [True, True, True, False, True, True, True]


# ---- on every device (cpu, and cuda where there is one: tests/devices.py) --------------------
@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("K,d", [(1, 1), (3, 7), (10, 4099), (100, 300), (1000, 76), (2, 262177)])
def test_kstats_matches_reference_and_cpu(dev, K, d, dtype):
    base = randn(dev, K, d + 3, dtype=dtype, seed=K + d)
    U = base[:, 1 : 1 + d]  # row stride d + 3, unaligned start
    p = torch.rand(K, generator=gen(d), dtype=torch.float64) + 0.1
    p /= p.sum()
    got = ops.kstats(U, p)
    assert all(t.device.type == dev for t in got)
    want = ref.kstats(U.cpu(), p)
    A = U.cpu().double().abs()
    m = p @ A
    for g, w, S in zip(got[:3], want[:3], (A @ m, (A * A).sum(1), m @ m)):
        assert g.dtype == torch.float64 and torch.all((g.cpu() - w).abs() <= 1e-12 * S + 1e-300)
    assert got[3].cpu().tolist() == [True] * K
    again = ops.kstats(U, p)
    assert all(torch.equal(a, b) for a, b in zip(got, again))  # bitwise: fixed order, no atomics


@pytest.mark.parametrize("dev", DEVICES)
def test_kstats_flags_exact(dev):
    for dtype in FLOATS:
        U = randn(dev, 6, 999, dtype=dtype, seed=2)
        U[1, 5], U[3, 998] = float("nan"), float("-inf")
        U[0] = torch.finfo(dtype).max  # finite (fp64: its squared norm overflows)
        ok = ops.kstats(U, torch.full((6,), 1 / 6, dtype=torch.float64))[3]
        assert ok.cpu().tolist() == [True, False, True, False, True, True], dtype


@pytest.mark.parametrize("dev", DEVICES)
def test_kstats_empty(dev):
    dot, nsq, nbar, ok = ops.kstats(torch.empty(3, 0, device=dev), torch.full((3,), 1 / 3, dtype=torch.float64))
    assert float(dot.abs().sum() + nsq.sum() + nbar) == 0.0 and ok.all() and dot.device.type == dev


# ---- U's and p's shapes, dtypes and layout: checked once, by the native op, for the wrapper and a direct call
FLOATING = "must have a floating dtype (float16, bfloat16, float32, float64)"
HALF = torch.full((2,), 0.5, dtype=torch.float64)
BAD_TENSOR_ARGS = [  # (U on dev, p (host), the whole message)
    (lambda dev: torch.zeros(2, device=dev), HALF, "kstats: U must be a 2-D [K, d] tensor, got shape (2,)"),
    (lambda dev: torch.zeros(2, 3, 1, device=dev), HALF, "kstats: U must be a 2-D [K, d] tensor, got shape (2, 3, 1)"),
    (lambda dev: torch.zeros(2, 3, dtype=torch.int64, device=dev), HALF, f"kstats: U {FLOATING}, got torch.int64"),
    (lambda dev: torch.zeros(2, 3, dtype=torch.bool, device=dev), HALF, f"kstats: U {FLOATING}, got torch.bool"),
    (
        lambda dev: torch.zeros(4, 3, device=dev),
        HALF,
        "kstats: p must be a 1-D tensor of length 4 (one per selected row), got shape (2,)",
    ),
    (  # p's shape is wrong: its shape is the error, not its NaN
        lambda dev: torch.zeros(3, 5, device=dev),
        torch.tensor([float("nan"), 1.0], dtype=torch.float64),
        "kstats: p must be a 1-D tensor of length 3 (one per selected row), got shape (2,)",
    ),
    (
        lambda dev: torch.zeros(2, 3, device=dev),
        HALF[:, None],
        "kstats: p must be a 1-D tensor of length 2 (one per selected row), got shape (2, 1)",
    ),
]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", range(len(BAD_TENSOR_ARGS)))
def test_bad_tensor_args_same_from_wrapper_and_native(dev, case):
    make, p, msg = BAD_TENSOR_ARGS[case]
    U = make(dev)
    for fn in (ops.kstats, torch.ops.fedkernels.kstats):
        one_line(ValueError, "^" + re.escape(msg) + "$", fn, U, p)


def test_compiled_bad_U_raises_the_native_error():
    """Under torch.compile the fake kernel does not stop tracing on a 0-d U; the native op refuses it."""
    torch._dynamo.reset()
    f = torch.compile(lambda U, p: ops.kstats(U, p), fullgraph=True)
    one_line(ValueError, r"^kstats: U must be a 2-D \[K, d\] tensor, got shape \(\)$", f, torch.zeros(()), HALF)


def test_the_native_op_takes_what_the_wrapper_makes():
    """The wrapper copies a U without unit column stride once and reads integer weights as float64; a
    direct call must pass what the kernel reads."""
    U, F = torch.randn(3, 8, dtype=torch.float64)[:, ::2], torch.ops.fedkernels
    p = torch.tensor([1, 0, 2])
    got, want = ops.kstats(U, p), F.kstats(U.contiguous(), p.double())
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    msg = (
        r"^kstats: U must have unit column stride, got strides \(8, 2\) \(the fedkernels.ops wrapper copies it once\)$"
    )
    one_line(ValueError, msg, F.kstats, U, p.double())
    one_line(ValueError, f"^kstats: p {re.escape(FLOATING)}, got torch.int64$", F.kstats, U.contiguous(), p)


# ---- the CUDA kernel's per-thread logic on the host (tests/host_harness.py, tests/cuda_host/kstats.cpp) ------------
@pytest.fixture(scope="module")
def harness():
    yield from host_harness.session()


@pytest.mark.parametrize("eb,dtype", [(4, torch.float32), (8, torch.float64), (2, torch.float16)])
@pytest.mark.parametrize(
    "K,d,parts,tw",
    [
        (1, 1, 1, 256),
        (3, 5, 1, 256),
        (7, 700, 3, 256),
        (100, 300, 3, 128),
        (1000, 70, 3, 32),
        (2, 256 * 1024 + 33, 513, 256),
    ],
)
def test_kstats_emulation_matches_reference(harness, eb, dtype, K, d, parts, tw):
    """kstats_parts / kstats_final emulated around kstats_hd::: every element of U read exactly once per phase
    (ERR otherwise), the plan's parts and tile width (fp32 at K = 1000: 32 columns; 1025 tiles: 2 per
    part: 513 parts), dot / nsq / nbar against the float64 reference."""
    U = torch.randn(K, d, generator=gen(K * 3 + d), dtype=torch.float64).to(dtype)
    p = torch.rand(K, generator=gen(d), dtype=torch.float64) + 0.1
    p /= p.sum()
    ans = harness("kstats", eb, K, d, U.double(), p)
    got = torch.tensor([hexf(x) for x in ans[2:]], dtype=torch.float64)
    if eb == 4:
        assert (int(ans[0]), int(ans[1])) == (parts, tw)
    dot, nsq, nbar, _ = ref.kstats(U, p)
    torch.testing.assert_close(got, torch.cat([dot, nsq, nbar.reshape(1)]), rtol=1e-12, atol=1e-12)
