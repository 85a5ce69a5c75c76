"""gram: the native op against the float64 reference (shapes, rows, layouts, determinism, bad inputs)."""

import math
import re
import sys

import pytest
import torch
from torch.testing import assert_close

from fedkernels import ops, reference as ref
from devices import DEVICES, FLOATS, gen, one_line, randn, settle  # tests/devices.py: every case on cpu and cuda
import host_harness  # tests/host_harness.py: the CUDA kernels' per-thread logic on the host
from host_harness import hexf

import cli_process  # tests/cli_process.py: the command in a child forked from a pre-imported interpreter

SHAPES = [(1, 1), (2, 3), (3, 17), (5, 1000), (7, 4099), (16, 2048 * 3 + 5), (33, 257), (10, 70001)]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


# ---- gram ------------------------------------------------------------------------------------
@pytest.mark.parametrize("K,d", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gram_matches_reference(K, d, dtype):
    U = torch.randn(K, d, dtype=torch.float64).to(dtype)
    G = ops.gram(U)
    assert G.dtype == torch.float64 and G.shape == (K, K)
    # products of fp32/fp16/bf16 values are exact in fp64: gram matches the fp64 reference on the
    # same (rounded) inputs to fp64 summation error, for every input dtype
    assert_close(G, ref.gram(U), rtol=1e-12, atol=1e-12 * d)
    assert torch.equal(G, G.T)


@pytest.mark.parametrize("K,d", [(6, 1001), (13, 5000)])
def test_gram_rows_subset(K, d):
    U = torch.randn(K, d, dtype=torch.float64)
    rows = [K - 1, 0, 3, 3]
    assert_close(ops.gram(U, rows=rows), ref.gram(U, rows), rtol=1e-12, atol=1e-10)
    assert_close(ops.gram(U, rows=torch.tensor(rows)), ref.gram(U, rows), rtol=1e-12, atol=1e-10)


def test_gram_noncontiguous_and_column_chunks():
    U = torch.randn(9, 3001, dtype=torch.float32)
    # transposed storage (column stride != 1) is copied once
    Ut = torch.randn(3001, 9).T
    assert_close(ops.gram(Ut), ref.gram(Ut), rtol=1e-12, atol=1e-9)
    # strided rows
    assert_close(ops.gram(U[::2]), ref.gram(U[::2]), rtol=1e-12, atol=1e-9)
    # column chunks are views (no copy) and their grams sum to the full gram
    G = sum(ops.gram(U[:, a : a + 1000]) for a in range(0, 3001, 1000))
    assert_close(G, ref.gram(U), rtol=1e-12, atol=1e-9)


def test_gram_large_values_fp64_accuracy():
    # fp32 inputs whose fp32 Gram would lose digits: we must match fp64 to ~1e-12 relative
    U = (torch.randn(4, 200_000, dtype=torch.float64) * 1e3 + 1e4).float()
    G = ops.gram(U)
    R = ref.gram(U)
    assert ((G - R).abs() / R.abs()).max() < 1e-12


def test_gram_deterministic_across_calls_and_threads():
    U = torch.randn(12, 300_001)
    g1, g2 = ops.gram(U), ops.gram(U)
    assert torch.equal(g1, g2)
    code = (
        "import torch, fedkernels.ops as o; torch.manual_seed(1); U = torch.randn(12, 300001); "
        "torch.set_num_threads({n}); G = o.gram(U); import sys; sys.stdout.write(G.numpy().tobytes().hex())"
    )
    outs = [
        cli_process.run([sys.executable, "-c", code.format(n=n)], capture_output=True, text=True, check=True).stdout
        for n in (1, 2)
    ]
    assert outs[0] == outs[1] and len(outs[0]) == 12 * 12 * 16


def test_gram_empty_and_edge():
    assert ops.gram(torch.zeros(0, 5)).shape == (0, 0)
    assert torch.equal(ops.gram(torch.zeros(3, 0)), torch.zeros(3, 3, dtype=torch.float64))
    assert ops.gram(torch.ones(3, 4), rows=[]).shape == (0, 3)


def test_gram_bad_inputs_name_the_argument():
    U = torch.randn(4, 10)
    with pytest.raises(ValueError, match="U must be a 2-D"):
        ops.gram(torch.randn(10))
    with pytest.raises(TypeError, match="U must be a torch.Tensor"):
        ops.gram([[1.0, 2.0]])
    with pytest.raises(ValueError, match="floating dtype"):
        ops.gram(torch.ones(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="rows must lie in"):
        ops.gram(U, rows=[0, 4])
    with pytest.raises(ValueError, match="rows must hold integer"):
        ops.gram(U, rows=torch.tensor([0.5]))


# ---- one list of samples drives correctness, gradients and opcheck on every device (pytorch/extension-cpp) ----
def sample_inputs(dev, *, requires_grad=False):
    """Arguments of torch.ops.fedkernels.gram (U, rows): one element, float32 and float64 column chunks of a
    wider buffer (row stride d + 3, unaligned start), a row subset with a repeat (rows on the device)."""

    def U(K, d, dtype, seed):
        return randn(dev, K, d + 3, dtype=dtype, seed=seed)[:, 1 : 1 + d].requires_grad_(requires_grad)

    return [
        [U(1, 1, torch.float64, 1), None],
        [U(5, 300, torch.float32, 2), None],
        [U(6, 257, torch.float64, 3), torch.tensor([4, 0, 0, 2], device=dev)],
    ]


def _grad_tol(U):
    """The gradient is rounded to U's dtype (float32: 2^-24 relative)."""
    return (1e-11, 1e-11 * U.shape[1]) if U.dtype == torch.float64 else (1e-5, 1e-5 * U.shape[1])


@pytest.mark.parametrize("dev", DEVICES)
def test_gram_samples_match_reference(dev):
    for U, rows in sample_inputs(dev):
        G = torch.ops.fedkernels.gram(U, rows)
        assert G.dtype == torch.float64 and G.device.type == dev
        # exact float64 products for every input dtype: only the summation order differs
        assert_close(G, ref.gram(U, rows), rtol=1e-11, atol=1e-11 * U.shape[1])


@pytest.mark.parametrize("dev", DEVICES)
def test_gram_samples_gradients_match_reference(dev):
    for U, rows in sample_inputs(dev, requires_grad=True):
        W = randn(dev, U.shape[0] if rows is None else len(rows), U.shape[0], dtype=torch.float64, seed=9)
        (got,) = torch.autograd.grad((ops.gram(U, rows=rows) * W).sum(), U)
        (want,) = torch.autograd.grad((ref.gram(U, rows) * W).sum(), U)
        rtol, atol = _grad_tol(U)
        assert got.dtype == U.dtype and got.device == U.device
        assert_close(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dev", DEVICES)
def test_gram_opcheck(dev):  # with requires_grad (the autograd checks, ~30x slower): tests/test_autograd.py
    for U, rows in sample_inputs(dev):
        torch.library.opcheck(torch.ops.fedkernels.gram.default, (U, rows))


# ---- gram_screened: the rows' finite flags from the Gram pass (its diagonal) -----------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("K,d", [(1, 1), (5, 3), (12, 1031), (40, 77)])  # (40, 77): the broadcast kernel
def test_gram_screened_flags_are_exact(K, d, dtype):
    from fedkernels import reference

    g = torch.Generator().manual_seed(K + d)
    big = torch.randn(K, d + 3, generator=g).to(dtype)
    U = big[:, 1 : 1 + d]
    for k in range(1, K, 2):
        U[k, (k * 13) % d] = (float("nan"), float("inf"), float("-inf"))[k % 3]
    U[0].fill_(torch.finfo(dtype).max)  # finite, the largest values: still finite
    G, ok = ops.gram_screened(U)
    assert ok.tolist() == reference.gram_screened(U)[1].tolist() == [k % 2 == 0 for k in range(K)]
    assert torch.equal(G.nan_to_num(), ops.gram(U).nan_to_num())


def test_gram_screened_fp64_overflow_is_flagged():
    """The documented limit: a finite fp64 row whose squared norm overflows is flagged."""
    U = torch.tensor([[1e200, 1.0], [1.0, 2.0]], dtype=torch.float64)
    assert ops.gram_screened(U)[1].tolist() == [False, True]
    assert ops.finite_rows(U).tolist() == [True, True]


def test_gram_screened_checks_its_arguments_once(monkeypatch):
    """One metadata check per call: gram_screened does not re-run gram's checks."""
    import importlib

    gram_mod = importlib.import_module("fedkernels.ops.gram")  # (ops.gram is the function)
    calls = []
    for name in ("_matrix", "_needs_kernel"):
        real = getattr(gram_mod, name)
        monkeypatch.setattr(
            gram_mod, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k)
        )
    U = torch.randn(4, 10)
    G, ok = ops.gram_screened(U)
    assert calls == ["_matrix", "_needs_kernel"] and ok.all() and torch.equal(G, ops.gram(U))
    with pytest.raises(ValueError, match=r"gram_screened: U must be a 2-D \[K, d\] tensor"):
        ops.gram_screened(torch.zeros(3))


# ---- the two CPU kernels: broadcast (clients along the vectors) and column vectors ------------------
# FEDKERNELS_GRAM_PATH forces one; unset, the kernel picks by shape. Shapes: K off the register tiles
# (8 x 16 AVX-512, 4 x 12 AVX2) and the old 4 x 4, d off the vector width and below it, d split into
# several sub-chunks (128 columns at K >= 128) and into parts (K < 128, d >= 4096).
PATHS = ["bcast", "cols"]
ODD_SHAPES = [(1, 3), (2, 1), (7, 5), (16, 9), (17, 77), (33, 130), (130, 300), (131, 700), (250, 76), (19, 8200)]


def _odd_matrix(K, d, dtype, layout, seed):
    """K x d in `layout`: contiguous, row-sliced (every other row of a 2K x d), or column-sliced
    (an unaligned column window of a wider matrix, row stride d + 5)."""
    g = torch.Generator().manual_seed(seed)
    if layout == "rows":
        return torch.randn(2 * K, d, generator=g, dtype=torch.float64).to(dtype)[::2]
    if layout == "cols":
        return torch.randn(K, d + 5, generator=g, dtype=torch.float64).to(dtype)[:, 3 : 3 + d]
    return torch.randn(K, d, generator=g, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("K,d", ODD_SHAPES)
def test_gram_paths_odd_shapes_match_reference(monkeypatch, path, K, d):
    monkeypatch.setenv("FEDKERNELS_GRAM_PATH", path)
    for i, (dtype, layout) in enumerate(
        [(torch.float32, "plain"), (torch.float64, "rows"), (torch.float16, "cols"), (torch.bfloat16, "rows")]
    ):
        U = _odd_matrix(K, d, dtype, layout, seed=K * 7 + d + i)
        G = ops.gram(U)
        assert G.shape == (K, K)
        assert_close(G, ref.gram(U), rtol=1e-12, atol=1e-12 * d, msg=f"{dtype} {layout}")
        assert torch.equal(G, G.T)  # exactly symmetric


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("K,d", [(5, 40), (17, 77), (131, 300), (40, 9000)])
def test_gram_paths_rows_repeats_out_of_order(monkeypatch, path, K, d):
    monkeypatch.setenv("FEDKERNELS_GRAM_PATH", path)
    U = _odd_matrix(K, d, torch.float32, "cols", seed=K + d)
    perm = torch.randperm(K, generator=torch.Generator().manual_seed(K))
    cases = {
        "permutation": perm,  # every row, out of order
        "cover with repeats": torch.cat([perm, perm[:3], perm[-2:]]),  # every row, some twice
        "subset with repeats": torch.tensor([K - 1, 0, K // 2, 0, K - 1]),
        "one row": torch.tensor([K // 3]),
    }
    G = ops.gram(U)
    for name, rows in cases.items():
        Gr = ops.gram(U, rows=rows)
        assert Gr.shape == (len(rows), K)
        assert_close(Gr, ref.gram(U, rows), rtol=1e-12, atol=1e-12 * d, msg=name)
        if path == "bcast" and name.startswith(("permutation", "cover")):
            # rows that list every row take the symmetric product: the very same bits as gram(U)
            assert torch.equal(Gr, G[rows]), name


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("K,d", [(300, 200), (40, 20_000), (130, 1000)])
def test_gram_paths_same_bits_with_1_and_2_threads(monkeypatch, path, K, d):
    """K = 300: threads share the client panels of one part; K = 40: threads take parts of d."""
    monkeypatch.setenv("FEDKERNELS_GRAM_PATH", path)
    U = _odd_matrix(K, d, torch.float32, "plain", seed=d)
    rows = torch.cat([torch.arange(K - 1, -1, -1), torch.tensor([1])])
    n0 = torch.get_num_threads()
    try:
        out = []
        for n in (1, 2):
            torch.set_num_threads(n)
            out.append((ops.gram(U), ops.gram(U, rows=rows), ops.gram(U, rows=[3, 1, 3])))
    finally:
        torch.set_num_threads(n0)
    for a, b in zip(*out):
        assert torch.equal(a, b)
    assert torch.equal(out[0][0], out[0][0].T)


def test_gram_auto_path_is_one_of_the_two(monkeypatch):
    """Unset, the kernel picks a path by shape: its result is bitwise that path's."""
    for K, d in [(4, 50), (1000, 76), (20, 5000)]:
        U = _odd_matrix(K, d, torch.float32, "plain", seed=K)
        monkeypatch.delenv("FEDKERNELS_GRAM_PATH", raising=False)
        G = ops.gram(U)
        forced = []
        for path in PATHS:
            monkeypatch.setenv("FEDKERNELS_GRAM_PATH", path)
            forced.append(torch.equal(G, ops.gram(U)))
        assert any(forced), (K, d)


def test_gram_path_variable_bad_value(monkeypatch):
    monkeypatch.setenv("FEDKERNELS_GRAM_PATH", "fast")
    with pytest.raises(ValueError, match="FEDKERNELS_GRAM_PATH=fast: expected auto, cols or bcast"):
        ops.gram(torch.ones(3, 4))


# ---- on every device (cpu, and cuda where there is one: tests/devices.py) --------------------
# K <= 16: path R; K > 16: fp64 tensor cores (one diagonal block up to K = 128, off-diagonal blocks above)
GRAM_SHAPES = [(1, 1), (2, 3), (3, 7), (10, 4099), (16, 1000), (17, 513), (33, 2000), (70, 1031), (130, 777)]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("K,d", GRAM_SHAPES)
def test_gram_matches_reference_on_every_device(dev, K, d, dtype):
    U = randn(dev, K, d, dtype=dtype, seed=K * 1000 + d)
    G = ops.gram(U)
    assert G.dtype == torch.float64 and G.device.type == dev and G.shape == (K, K)
    want = ref.gram(U)  # exact float64 products: only the summation order differs
    torch.testing.assert_close(G, want, rtol=1e-11, atol=1e-11 * d)
    assert torch.equal(G, G.T)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("K,d", [(5, 100), (12, 3333), (40, 777)])
def test_gram_rows_and_noncontiguous(dev, K, d):
    base = randn(dev, K, d + 9, seed=3)
    U = base[:, 4 : 4 + d]  # row stride d + 9, unaligned start
    rows = torch.tensor([K - 1, 0, 2, 2], device=dev)
    G = ops.gram(U, rows=rows)
    torch.testing.assert_close(G, ref.gram(U, rows=rows), rtol=1e-11, atol=1e-11 * d)
    torch.testing.assert_close(ops.gram(U), ref.gram(U), rtol=1e-11, atol=1e-11 * d)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("K,d", [(10, 100_003), (64, 20_000)])
def test_gram_deterministic_and_matches_cpu(dev, K, d):
    U = randn(dev, K, d, seed=11)
    G1, G2 = ops.gram(U), ops.gram(U)
    assert torch.equal(G1, G2)  # bitwise: fixed-order reduction, no atomics
    torch.testing.assert_close(G1.cpu(), ops.gram(U.cpu()), rtol=1e-11, atol=1e-11 * d)


@pytest.mark.parametrize("dev", DEVICES)
def test_gram_empty(dev):
    U = torch.empty(3, 0, device=dev)
    assert torch.equal(ops.gram(U), torch.zeros(3, 3, dtype=torch.float64, device=dev))


@pytest.mark.parametrize("dev", DEVICES)
def test_bad_args_gram(dev):
    U, F = randn(dev, 5, 257, seed=53), torch.ops.fedkernels
    one_line(ValueError, r"gram: U must be a 2-D \[K, d\] tensor, got shape \(5, 257, 1\)", ops.gram, U[..., None])
    one_line(ValueError, r"gram: U must be a 2-D \[K, d\] tensor, got shape \(5, 257, 1\)", F.gram, U[..., None], None)
    one_line(ValueError, r"gram: rows must lie in \[0, 5\), got min -1 max 2", ops.gram, U, rows=[2, -1])
    one_line(RuntimeError, r"gram: rows( entry|\[1\] =) 5 out of range \[0, 5\)", F.gram, U, torch.tensor([1, 5]))
    one_line(
        ValueError,
        r"gram: rows must hold integer row indices, got dtype torch.float32",
        ops.gram,
        U,
        rows=torch.tensor([1.0]),
    )
    G = ops.gram(U, rows=[4, 1])
    settle(dev)
    torch.testing.assert_close(G, ref.gram(U, rows=[4, 1]), rtol=1e-11, atol=1e-11 * 257)


# ---- U's and rows' shapes, dtypes and layout: checked once, by the native op, for the wrappers and a direct call
FLOATING = "must have a floating dtype (float16, bfloat16, float32, float64)"
BAD_TENSOR_ARGS = [  # (U on dev, rows (host), the whole message of gram)
    (lambda dev: torch.zeros(7, device=dev), None, "gram: U must be a 2-D [K, d] tensor, got shape (7,)"),
    (lambda dev: torch.zeros(2, 3, 4, device=dev), None, "gram: U must be a 2-D [K, d] tensor, got shape (2, 3, 4)"),
    (lambda dev: torch.zeros(4, device=dev), torch.tensor([0]), "gram: U must be a 2-D [K, d] tensor, got shape (4,)"),
    (lambda dev: torch.zeros(3, 4, dtype=torch.int64, device=dev), None, f"gram: U {FLOATING}, got torch.int64"),
    (lambda dev: torch.zeros(3, 4, dtype=torch.bool, device=dev)[:, ::2], None, f"gram: U {FLOATING}, got torch.bool"),
    (
        lambda dev: torch.zeros(3, 4, device=dev),
        torch.tensor([[0, 1]]),
        "gram: rows must be a 1-D sequence of row indices, got shape (1, 2)",
    ),
    (
        lambda dev: torch.zeros(3, 4, device=dev),
        torch.tensor(1),
        "gram: rows must be a 1-D sequence of row indices, got shape ()",
    ),
    (
        lambda dev: torch.zeros(3, 4, device=dev),
        torch.tensor([1.0]),
        "gram: rows must hold integer row indices, got dtype torch.float32",
    ),
    (
        lambda dev: torch.zeros(3, 4, device=dev),
        torch.tensor([True]),
        "gram: rows must hold integer row indices, got dtype torch.bool",
    ),
]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", range(len(BAD_TENSOR_ARGS)))
def test_bad_tensor_args_same_from_wrapper_and_native(dev, case):
    make, rows, msg = BAD_TENSOR_ARGS[case]
    U = make(dev)
    one_line(ValueError, "^" + re.escape(msg) + "$", ops.gram, U, rows=rows)
    one_line(ValueError, "^" + re.escape(msg) + "$", torch.ops.fedkernels.gram, U, rows)
    if rows is None:  # gram_screened calls the native gram and says its own name
        one_line(ValueError, "^" + re.escape(msg.replace("gram:", "gram_screened:", 1)) + "$", ops.gram_screened, U)


def test_compiled_bad_rows_raise_the_native_error():
    """Under torch.compile the fake kernel does not stop tracing on 0-d rows; the native op refuses them."""
    torch._dynamo.reset()
    f = torch.compile(lambda U, r: ops.gram(U, rows=r), fullgraph=True)
    msg = r"^gram: rows must be a 1-D sequence of row indices, got shape \(\)$"
    one_line(ValueError, msg, f, torch.zeros(3, 4), torch.tensor(1))


def test_the_native_op_refuses_a_matrix_without_unit_column_stride():
    """The wrappers copy such a U once; a direct call must pass one the kernel reads."""
    U = torch.randn(4, 6, dtype=torch.float64)[:, ::2]
    assert_close(ops.gram(U), ref.gram(U), rtol=1e-12, atol=1e-12)
    one_line(
        ValueError,
        r"^gram: U must have unit column stride, got strides \(6, 2\) \(the fedkernels.ops wrapper copies it once\)$",
        torch.ops.fedkernels.gram,
        U,
        None,
    )


# ---- the CUDA kernel's per-thread logic on the host (tests/host_harness.py, tests/cuda_host/gram.cpp) --------------
@pytest.fixture(scope="module")
def harness():
    yield from host_harness.session()


def _gram_emulate(harness, U, rows=None, eb=4):
    K, d = U.shape
    sym = rows is None
    ans = harness("gram", eb, 0 if sym else len(rows), K, d, int(sym), [] if sym else list(rows), U.double())
    k = K if sym else len(rows)
    return int(ans[0]), torch.tensor([hexf(x) for x in ans[1:]], dtype=torch.float64).view(k, K)


@pytest.mark.parametrize("eb,dtype", [(4, torch.float32), (8, torch.float64), (2, torch.bfloat16)])
@pytest.mark.parametrize("K,d", [(1, 1), (3, 5), (16, 600), (17, 513), (33, 129), (100, 200), (130, 70)])
def test_gram_emulation_matches_reference(harness, eb, dtype, K, d):
    """Path R (K <= 16) and path T (DMMA tiles, diagonal and off-diagonal blocks at K = 130 > 128):
    every staged slot, every 8x8 tile and every output element exactly once per part (ERR
    otherwise), the fragment layout through an mma built from the PTX layout, G exactly symmetric."""
    U = torch.randn(K, d, generator=gen(K * 7 + d), dtype=torch.float64).to(dtype)
    _, G = _gram_emulate(harness, U, eb=eb)
    want = ref.gram(U)
    torch.testing.assert_close(G, want, rtol=1e-12, atol=1e-12 * d)
    assert torch.equal(G, G.T)
    if K <= 16:
        assert torch.equal(G, _gram_r_model(U))  # path R: the documented order, bit for bit


@pytest.mark.parametrize("k,K,d", [(5, 20, 300), (20, 3, 257), (3, 140, 65), (17, 17, 64)])
def test_gram_emulation_rows_duplicates_bad_rows(harness, k, K, d):
    U = torch.randn(K, d, generator=gen(k + K + d), dtype=torch.float64).float()
    rows = [(i * 7) % K for i in range(k)]
    rows[-1] = rows[0]  # a duplicate
    _, G = _gram_emulate(harness, U, rows=rows)
    torch.testing.assert_close(G, ref.gram(U, rows=rows), rtol=1e-12, atol=1e-12 * d)
    bad = list(rows)
    bad[1] = K  # out of range: a NaN row, the others intact
    _, G = _gram_emulate(harness, U, rows=bad)
    assert torch.isnan(G[1]).all()
    keep = [i for i in range(k) if i != 1]
    torch.testing.assert_close(G[keep], ref.gram(U, rows=[bad[i] for i in keep]), rtol=1e-12, atol=1e-12 * d)


def _fma(a: float, b: float, c: float) -> float:
    from fractions import Fraction

    if not all(math.isfinite(x) for x in (a, b, c)):
        return a * b + c
    return float(Fraction(a) * Fraction(b) + Fraction(c))  # exact, then one correct rounding


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
                s = s + _butterfly(part[32 * w : 32 * w + 32])
            G[i, j] = G[j, i] = s
    return G


def test_gram_final_reduction_is_the_documented_order(harness):
    """G[i][j] = part_0 + ... + part_7 (warp order), part_w = sum of parts w, w + 8, ... from 0.0."""
    g = gen(11)
    for n in (1, 7, 8, 9, 100, 1024):
        vals = (
            torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-8, 9, (n,), generator=g)
        ).tolist()
        got = hexf(harness("gramred", n, vals)[1])
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
            assert seq != t  # the order matters for these values: the check above can fail


def test_gram_plan(harness):
    def plan(k, K, d, sym, eb):
        r = [int(x) for x in harness("gramplan", k, K, d, int(sym), eb)]
        return dict(zip(["path_r", "tile", "kp", "Kp", "pairs", "part_cols", "nparts", "ws"], r))

    p = plan(100, 100, 11_220_132, True, 4)  # ResNet-18, K = 100: one diagonal block, 1024 parts
    assert p["path_r"] == 0 and p["tile"] == 128 and p["pairs"] == 1 and 1000 <= p["nparts"] <= 1024
    for k, K, d, sym in [
        (16, 16, 10**6, True),
        (17, 17, 5, True),
        (100, 100, 11_220_132, True),
        (1000, 1000, 10**6, True),
        (5, 300, 12345, False),
        (300, 2, 999, False),
        (1, 1, 1, True),
        (129, 129, 4097, True),
    ]:
        for eb in (2, 4, 8):
            p = plan(k, K, d, sym, eb)
            align = 256 if p["path_r"] else (32 if eb == 8 else 64)
            assert p["part_cols"] % align == 0
            assert (p["nparts"] - 1) * p["part_cols"] < d <= p["nparts"] * p["part_cols"]  # every column in one part
            assert p["ws"] == p["nparts"] * p["kp"] * p["Kp"] * 8 <= 256 << 20
            assert p["nparts"] <= 1024 and p["kp"] >= k and p["Kp"] >= K
            t = p["tile"]
            n_t = -(-K // t)
            assert p["pairs"] == (n_t * (n_t + 1) // 2 if sym else -(-k // t) * n_t)
