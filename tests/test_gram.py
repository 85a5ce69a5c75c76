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
@pytest.mark.parametrize("K,d", [(1, 1), (5, 3), (12, 1031)])
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
    """One metadata check per call (issue #27): gram_screened does not re-run gram's checks."""
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
