"""finite_rows: the native op against the float64 reference."""
import pytest
import torch

from fedkernels import ops, reference as ref

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


def test_finite_rows_opcheck():
    torch.library.opcheck(torch.ops.fedkernels.finite_rows.default, (torch.randn(5, 300),))
