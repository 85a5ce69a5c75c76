"""sparse_weighted_sum: K index/value lists (CSR-like) summed into a dense float32/float64 result, against the
float64 reference (the lists densified by index_add_) with a bound from the arithmetic, duplicates, empty lists,
the flags, thread counts, bad inputs; CUDA cases skip without a GPU."""

import re

import pytest
import torch

from fedkernels import ops, reference as ref
from devices import DEVICES, one_line  # tests/devices.py: the cuda case skips without a GPU and the CUDA build

VALS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _lists(K, d, nnz_max, seed=0, dups=True, idx_dtype=torch.int64, val_dtype=torch.float32):
    """K sorted lists of random lengths 0..nnz_max (list 1 empty when K > 1), with repeated indices."""
    g = torch.Generator().manual_seed(seed)
    idx, val = [], []
    for k in range(K):
        m = 0 if k == 1 else int(torch.randint(0, nnz_max + 1, (1,), generator=g))
        i = torch.randint(0, max(d, 1), (m,), generator=g) if d else torch.zeros(0, dtype=torch.int64)
        if not dups:
            i = torch.unique(i)
        idx.append(torch.sort(i).values.to(idx_dtype))
        val.append(torch.randn(i.numel(), generator=g, dtype=torch.float64).to(val_dtype))
    return ops.stack_lists(idx, val)


def _bound(idx, val, off, coef, d, alpha, rows, base, odt):
    o = off.tolist()
    K = len(o) - 1
    A = torch.zeros(K, d, dtype=torch.float64)
    for k in range(K):
        A[k].index_add_(0, idx[o[k] : o[k + 1]].long(), val[o[k] : o[k + 1]].double().abs())
    r = torch.arange(K) if rows is None else torch.as_tensor(rows)
    mag = (torch.as_tensor(coef, dtype=torch.float64).abs() * abs(alpha)) @ A[r]
    if base is not None:
        mag = mag + base.double().abs()
    n = (off[1:] - off[:-1]).max().item() if K else 0
    return (len(r) * max(n, 1) + 2) * torch.finfo(odt).eps * mag + 1e-300


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vdt", VALS)
@pytest.mark.parametrize("idt", [torch.int32, torch.int64])
@pytest.mark.parametrize(
    "K,d,nnz", [(1, 1, 3), (1, 17, 5), (3, 16384 + 3, 4000), (5, 50001, 9000), (16, 1000, 700), (4, 7, 0)]
)
def test_matches_reference(device, vdt, idt, K, d, nnz):
    idx, val, off = _lists(K, d, nnz, seed=K + d, idx_dtype=idt, val_dtype=vdt)
    coef = (torch.rand(K, dtype=torch.float64) - 0.3).tolist()
    odt = torch.float64 if vdt == torch.float64 else torch.float32
    base = torch.randn(d, dtype=odt)
    out, ok = ops.sparse_weighted_sum(idx.to(device), val.to(device), off, coef, d, base=base.to(device), alpha=1.3)
    want, wok = ref.sparse_weighted_sum(idx, val, off, coef, d, base=base, alpha=1.3)
    assert out.dtype == odt and ok.tolist() == wok.tolist() == [True] * K
    assert torch.all((out.cpu().double() - want).abs() <= _bound(idx, val, off, coef, d, 1.3, None, base, odt))


@pytest.mark.parametrize("device", DEVICES)
def test_rows_subset_out_dtype_and_no_base(device):
    K, d = 6, 3000
    idx, val, off = _lists(K, d, 500, seed=2, val_dtype=torch.bfloat16)
    rows, coef = [4, 0, 4, 2], [1.0, -0.5, 0.25, 3.0]
    out, ok = ops.sparse_weighted_sum(idx.to(device), val.to(device), off, coef, d, rows=rows, out_dtype=torch.float64)
    want, _ = ref.sparse_weighted_sum(idx, val, off, coef, d, rows=rows)
    assert out.dtype == torch.float64 and ok.shape == (4,)
    assert torch.all((out.cpu() - want).abs() <= _bound(idx, val, off, coef, d, 1.0, rows, None, torch.float64))


def test_duplicates_summed_in_list_order_and_exact_single_entries():
    idx = torch.tensor([2, 2, 2, 5, 0, 9])
    val = torch.tensor([1.0, 2.0, 4.0, -1.0, 0.5, 8.0])
    out, ok = ops.sparse_weighted_sum(idx, val, [0, 4, 6], [1.0, 2.0], 10)
    assert out.tolist() == [1.0, 0, 7.0, 0, 0, -1.0, 0, 0, 0, 16.0] and ok.all()


def test_matches_torch_index_add_for_distinct_indices():
    """One entry per (list, index) and exact products (power-of-two coefficients, small integers): every
    order gives the same sum, so the dense torch composition is bit-equal."""
    K, d = 8, 40000
    g = torch.Generator().manual_seed(7)
    idx = [torch.randperm(d, generator=g)[:3000].sort().values for _ in range(K)]
    val = [torch.randint(-50, 50, (3000,), generator=g).float() for _ in range(K)]
    coef = [2.0 ** -(k % 3) for k in range(K)]
    want = torch.zeros(d)
    for k in range(K):
        want.index_add_(0, idx[k], coef[k] * val[k])
    i, v, o = ops.stack_lists(idx, val)
    assert torch.equal(ops.sparse_weighted_sum(i, v, o, coef, d)[0], want)


def test_same_bits_with_1_and_2_threads():
    idx, val, off = _lists(16, 200_000, 20000, seed=3)
    coef = torch.rand(16, dtype=torch.float64)
    n0 = torch.get_num_threads()
    try:
        got = []
        for n in (1, 2):
            torch.set_num_threads(n)
            got.append(ops.sparse_weighted_sum(idx, val, off, coef, 200_000)[0])
    finally:
        torch.set_num_threads(n0)
    assert torch.equal(got[0], got[1])


@pytest.mark.parametrize("device", DEVICES)
def test_flags_are_exact(device):
    idx, val, off = _lists(6, 30000, 2000, seed=4, dups=False)
    o = off.tolist()
    val[o[2] + 3] = float("nan")
    val[o[4]] = float("inf")
    val[o[5] + 1] = 0.0 * val[o[5] + 1]  # a zero is fine
    out, ok = ops.sparse_weighted_sum(idx.to(device), val.to(device), off, [1.0] * 6, 30000)
    assert ok.tolist() == [True, True, False, True, False, True]
    assert ok.tolist() == ref.sparse_weighted_sum(idx, val, off, [1.0] * 6, 30000)[1].tolist()
    out, ok = ops.sparse_weighted_sum(idx.to(device), val.to(device), off, [1.0] * 4, 30000, rows=[0, 1, 3, 5])
    assert ok.all() and torch.isfinite(out).all()


def test_empty_shapes():
    out, ok = ops.sparse_weighted_sum(torch.zeros(0, dtype=torch.int64), torch.zeros(0), [0], [], 5)
    assert torch.equal(out, torch.zeros(5)) and ok.numel() == 0
    out, ok = ops.sparse_weighted_sum(torch.zeros(0, dtype=torch.int64), torch.zeros(0), [0, 0], [2.0], 0)
    assert out.shape == (0,) and ok.tolist() == [True]


def test_bad_inputs_one_line_value_errors():
    idx, val = torch.tensor([1, 4, 0, 3]), torch.ones(4)
    f = ops.sparse_weighted_sum
    cases = [
        (lambda: f(idx, val, [0, 2, 4], [1.0, 1.0], 4), r"idx must lie in \[0, d = 4\), got min 0 max 4"),
        (
            lambda: f(torch.tensor([1, 4, 3, 0]), val, [0, 2, 4], [1.0, 1.0], 5),
            r"idx must be non-decreasing within each list, list 1 has idx\[3\] = 0 < idx\[2\] = 3",
        ),
        (lambda: f(torch.tensor([-1, 4, 0, 3]), val, [0, 2, 4], [1.0, 1.0], 5), "idx must lie in"),
        (lambda: f(idx.float(), val, [0, 2, 4], [1.0, 1.0], 5), "idx must be a 1-D int32/int64"),
        (lambda: f(idx, val[:3], [0, 2, 4], [1.0, 1.0], 5), "val must be a 1-D tensor of idx's length 4"),
        (lambda: f(idx, val.long(), [0, 2, 4], [1.0, 1.0], 5), "val must have a floating dtype"),
        (lambda: f(idx, val, [0, 2, 3], [1.0, 1.0], 5), "offsets must run from 0 to nnz = 4"),
        (lambda: f(idx, val, [0, 3, 2, 4], [1.0] * 3, 5), r"offsets must be non-decreasing, got offsets\[1\] = 3"),
        (lambda: f(idx, val, [0.0, 2.0, 4.0], [1.0, 1.0], 5), "offsets must hold integers"),
        (lambda: f(idx, val, [0, 2, 4], [1.0], 5), "coef must be a 1-D tensor of length 2"),
        (lambda: f(idx, val, [0, 2, 4], [1.0, 1.0], -1), "d must be an int >= 0"),
        (lambda: f(idx, val, [0, 2, 4], [1.0, 1.0], 5, rows=[2]), r"rows must lie in \[0, 2\)"),
        (lambda: f(idx, val, [0, 2, 4], [1.0, 1.0], 5, alpha=float("nan")), "alpha must be a finite number"),
        (
            lambda: f(idx, val, [0, 2, 4], [1.0, 1.0], 5, base=torch.zeros(5, dtype=torch.bfloat16)),
            "base must be float32 or float64",
        ),
    ]
    for call, msg in cases:
        with pytest.raises(ValueError, match=msg) as e:
            call()
        assert "\n" not in str(e.value) and str(e.value).startswith("sparse_weighted_sum: ")
    with pytest.raises(ValueError, match="stack_lists: list 0 must be two 1-D tensors of one length"):
        ops.stack_lists([torch.tensor([1, 2])], [torch.ones(3)])


def test_opcheck_and_no_derivative():
    idx, val, off = _lists(4, 500, 60, seed=9)
    op = torch.ops.fedkernels.sparse_weighted_sum.default
    torch.library.opcheck(
        op, (idx, val, off, torch.ones(4, dtype=torch.float64), 500), test_utils=("test_schema", "test_faketensor")
    )
    torch.library.opcheck(
        op,
        (
            idx.int(),
            val.double(),
            off,
            torch.ones(2, dtype=torch.float64),
            500,
            torch.zeros(500, dtype=torch.float64),
            0.5,
            torch.tensor([3, 0]),
            None,
        ),
        test_utils=("test_schema", "test_faketensor"),
    )
    vg = val.clone().requires_grad_()
    out, _ = torch.ops.fedkernels.sparse_weighted_sum(idx, vg, off, torch.ones(4, dtype=torch.float64), 500)
    with pytest.raises(RuntimeError, match="fedkernels.sparse_weighted_sum has no derivative"):
        out.sum().backward()


# ---- bad tensors: one ValueError, the same words from the wrapper and from the native op ------------------------
def _sparse_bad(dev):
    """{case: (arguments with one bad tensor, the message after "sparse_weighted_sum: ")}."""
    idx = torch.tensor([0, 2, 5, 1, 3, 3], device=dev)
    val = torch.randn(6, generator=torch.Generator().manual_seed(3)).to(dev)
    good = dict(idx=idx, val=val, offsets=[0, 3, 6], coef=[1.0, -0.5], d=8)

    def z(*shape, dtype=torch.float32):
        return torch.zeros(*shape, dtype=dtype, device=dev)

    return {
        "idx 2-D": (dict(idx=idx.view(3, 2)), "idx must be a 1-D int32/int64 tensor, got shape (3, 2) torch.int64"),
        "idx 2-D, lists of its rows": (
            dict(idx=idx.view(2, 3), offsets=[0, 1, 2]),
            "idx must be a 1-D int32/int64 tensor, got shape (2, 3) torch.int64",
        ),
        "idx float": (dict(idx=idx.float()), "idx must be a 1-D int32/int64 tensor, got shape (6,) torch.float32"),
        "val length": (dict(val=val[:5]), "val must be a 1-D tensor of idx's length 6, got shape (5,)"),
        "val 2-D": (dict(val=val.view(2, 3)), "val must be a 1-D tensor of idx's length 6, got shape (2, 3)"),
        "val int": (
            dict(val=val.long()),
            "val must have a floating dtype (float16, bfloat16, float32, float64), got torch.int64",
        ),
        "offsets 2-D": (
            dict(offsets=[[0, 3, 6]]),
            "offsets must be a 1-D sequence of K + 1 list starts, got shape (1, 3)",
        ),
        "offsets empty": (
            dict(offsets=torch.zeros(0, dtype=torch.int64)),
            "offsets must be a 1-D sequence of K + 1 list starts, got shape (0,)",
        ),
        "offsets float": (dict(offsets=torch.tensor([0.0, 3.0, 6.0])), "offsets must hold integers, got torch.float32"),
        "coef length": (
            dict(coef=[1.0]),
            "coef must be a 1-D tensor of length 2 (one per selected row), got shape (1,)",
        ),
        "rows float": (
            dict(rows=torch.tensor([0.0, 1.0])),
            "rows must hold integer row indices, got dtype torch.float32",
        ),
        "base length": (dict(base=z(9)), "base must be a 1-D tensor of length 8, got shape (9,)"),
        "base half": (
            dict(base=z(8, dtype=torch.float16)),
            "base must be float32 or float64 (the result's dtype), got torch.float16",
        ),
        "out_dtype not base's": (
            dict(base=z(8, dtype=torch.float64), out_dtype=torch.float32),
            "out_dtype torch.float32 differs from base's dtype torch.float64",
        ),
        "val elsewhere": (dict(val=val.cpu()), "val is on cpu but idx is on cuda:0"),
        "base elsewhere": (dict(base=torch.zeros(8)), "base is on cpu but the rows are on cuda:0"),
    }, good


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", list(_sparse_bad("cpu")[0]))
def test_bad_tensor_args_same_from_wrapper_and_native(dev, case):
    if case.endswith("elsewhere") and dev == "cpu":
        pytest.skip("a second device needs a GPU")
    cases, good = _sparse_bad(dev)
    kw, msg = cases[case]
    a = good | kw
    want = "^" + re.escape(f"sparse_weighted_sum: {msg}") + "$"
    one_line(ValueError, want, ops.sparse_weighted_sum, **a)
    offsets = torch.as_tensor(a["offsets"])  # the host vectors the wrapper passes
    coef = torch.tensor(a["coef"], dtype=torch.float64)
    rows = a.get("rows")
    args = (a["idx"], a["val"], offsets, coef, a["d"], a.get("base"), 1.0, rows, a.get("out_dtype"))
    one_line(ValueError, want, torch.ops.fedkernels.sparse_weighted_sum, *args)
