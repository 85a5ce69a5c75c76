"""gram: the native op against the float64 reference (shapes, rows, layouts, determinism, bad inputs)."""
import subprocess
import sys

import pytest
import torch
from torch.testing import assert_close

from fedkernels import ops, reference as ref

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
    G = sum(ops.gram(U[:, a:a + 1000]) for a in range(0, 3001, 1000))
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
    outs = [subprocess.run([sys.executable, "-c", code.format(n=n)], capture_output=True, text=True, check=True).stdout
            for n in (1, 2)]
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


def test_gram_opcheck():
    U = torch.randn(5, 300)
    torch.library.opcheck(torch.ops.fedkernels.gram.default, (U, None))
    torch.library.opcheck(torch.ops.fedkernels.gram.default, (U, torch.tensor([1, 3])))


# ---- gram_screened: the rows' NaN/Inf flags from the Gram pass (its diagonal) -----------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("K,d", [(1, 1), (5, 3), (12, 1031), (40, 77)])  # (40, 77): the broadcast kernel
def test_gram_screened_flags_are_exact(K, d, dtype):
    from fedkernels import reference
    g = torch.Generator().manual_seed(K + d)
    big = torch.randn(K, d + 3, generator=g).to(dtype)
    U = big[:, 1:1 + d]
    for k in range(1, K, 2):
        U[k, (k * 13) % d] = (float("nan"), float("inf"), float("-inf"))[k % 3]
    U[0].fill_(torch.finfo(dtype).max)                 # finite, the largest values: still finite
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
    from fedkernels.ops import _checks
    gram_mod = importlib.import_module("fedkernels.ops.gram")    # (ops.gram is the function)
    calls = []
    for name in ("_matrix", "_needs_kernel"):
        real = getattr(_checks, name)
        monkeypatch.setattr(gram_mod, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
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
        return torch.randn(K, d + 5, generator=g, dtype=torch.float64).to(dtype)[:, 3:3 + d]
    return torch.randn(K, d, generator=g, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("K,d", ODD_SHAPES)
def test_gram_paths_odd_shapes_match_reference(monkeypatch, path, K, d):
    monkeypatch.setenv("FEDKERNELS_GRAM_PATH", path)
    for i, (dtype, layout) in enumerate([(torch.float32, "plain"), (torch.float64, "rows"),
                                         (torch.float16, "cols"), (torch.bfloat16, "rows")]):
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
        "permutation": perm,                                            # every row, out of order
        "cover with repeats": torch.cat([perm, perm[:3], perm[-2:]]),   # every row, some twice
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
