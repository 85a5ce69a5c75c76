"""Streamed (column-chunked) aggregation from tensors, memmaps and raw files vs in-memory results."""

import numpy as np
import pytest
import torch

from fedkernels import algorithms, ops
from fedkernels.algorithms.base import BadUpdateError
from fedkernels.streaming import (
    ChunkedUpdates,
    streamed_fedavg,
    streamed_finite_rows,
    streamed_gram,
    streamed_kuramoto,
    streamed_weighted_sum,
    weighted_sum_chunked,
)

K, D = 6, 1003


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(0)
    U = torch.randn(K, D, generator=g) * 0.1 + 0.05 * torch.randn(D, generator=g)
    x = torch.randn(D, generator=g)
    n = torch.randint(5, 50, (K,), generator=g).tolist()
    return U, x, n


def _sources(U, tmp_path):
    path = tmp_path / "U.bin"
    U.numpy().tofile(path)
    mm = np.memmap(tmp_path / "U.mm", dtype=np.float32, mode="w+", shape=(K, D))
    mm[:] = U.numpy()
    mm.flush()
    ro = np.memmap(tmp_path / "U.mm", dtype=np.float32, mode="r", shape=(K, D))
    return {"tensor": U, "memmap": mm, "memmap_ro": ro, "file": str(path)}


@pytest.mark.parametrize("chunk", [37, 256, 5000])
def test_gram_and_sums_match_in_memory(data, tmp_path, chunk):
    U, x, n = data
    p = torch.tensor(n, dtype=torch.float64)
    p = p / p.sum()
    G_ref = ops.gram(U)
    ref = ops.weighted_sum(U, p, base=x, alpha=0.7)
    for name, s in _sources(U, tmp_path).items():
        src = ChunkedUpdates(s, K=K, d=D, chunk_cols=chunk)
        G, fin = streamed_gram(src, screen=True)
        torch.testing.assert_close(G, G_ref, rtol=1e-13, atol=1e-13, msg=name)
        assert bool(fin.all())
        got = streamed_weighted_sum(src, p, base=x, alpha=0.7)
        assert torch.equal(got, ref), name  # per-coordinate: bitwise
        torch.testing.assert_close(streamed_gram(src, rows=[1, 4]), G_ref[[1, 4]], rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_screen_flags_the_bad_rows_from_the_pass(data, dtype):
    """``screen=True``: the [K] finite flags of the whole source with the Gram / the sum, the sum's
    bits unchanged; the former names ``with_finite`` / ``check_finite`` still work, with a
    DeprecationWarning."""

    def same(a, b):  # the same values, NaN where NaN
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)

    U, x, n = data
    U = U.to(dtype)
    U[2, 700] = float("nan")
    U[4, 3] = float("-inf")
    want = torch.tensor([k not in (2, 4) for k in range(K)])
    p = torch.tensor(n, dtype=torch.float64)
    p = p / p.sum()
    src = ChunkedUpdates(U, chunk_cols=256)
    G, fin = streamed_gram(src, screen=True)
    assert torch.equal(fin, want)
    same(G, streamed_gram(src))
    new, fin = streamed_weighted_sum(src, p, base=x, alpha=0.7, screen=True)
    assert torch.equal(fin, want)
    same(new, streamed_weighted_sum(src, p, base=x, alpha=0.7))
    ok = U.isfinite().all(1)
    sel = torch.tensor([0, 1, 3, 5])
    new_sel, fin = streamed_weighted_sum(src, p[sel], base=x, alpha=0.7, rows=sel, screen=True)
    assert torch.equal(fin, want) and bool(new_sel.isfinite().all()) and bool(ok[sel].all())
    with pytest.warns(DeprecationWarning, match=r"streamed_gram: with_finite= is now called screen="):
        G_old, fin_old = streamed_gram(src, with_finite=True)
    assert torch.equal(fin_old, want)
    same(G_old, G)
    with pytest.warns(DeprecationWarning, match=r"streamed_weighted_sum: check_finite= is now called screen="):
        new_old, fin_old = streamed_weighted_sum(src, p, base=x, alpha=0.7, check_finite=True)
    assert torch.equal(fin_old, want)
    same(new_old, new)


def test_fedavg_and_kuramoto_match_aggregators(data, tmp_path):
    U, x, n = data
    src = ChunkedUpdates(str(_sources(U, tmp_path)["file"]), K=K, d=D, chunk_cols=100)
    ref, _ = algorithms.build("fedavg", server_lr=0.5).aggregate(x, U, n)
    assert torch.equal(streamed_fedavg(x, src, n, server_lr=0.5), ref)
    for mode in ("S", "P"):
        a_ref = algorithms.build("kuramoto", mode=mode, guard=False)
        a_str = algorithms.build("kuramoto", mode=mode, guard=False)
        for _ in range(2):  # the round counter advances in both
            r, info_r = a_ref.aggregate(x, U, n)
            s, info_s = streamed_kuramoto(x, src, n, aggregator=a_str)
            torch.testing.assert_close(s, r, rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(info_s["weights"], info_r["weights"], rtol=1e-9, atol=1e-12)
        assert a_str.round == 2


def test_bad_rows_are_rejected_and_global_untouched(data, tmp_path):
    U, x, n = data
    U = U.clone()
    U[3, 777] = float("nan")
    src = ChunkedUpdates(U, chunk_cols=64)
    assert streamed_finite_rows(src).tolist() == [True, True, True, False, True, True]
    x0 = x.clone()
    with pytest.raises(BadUpdateError, match="row 3"):
        streamed_fedavg(x, src, n)
    with pytest.raises(BadUpdateError, match="row 3"):
        streamed_kuramoto(x, src, n)
    assert torch.equal(x, x0)


def test_bad_sources():
    with pytest.raises(ValueError, match="K and d"):
        ChunkedUpdates("/nonexistent")
    with pytest.raises(ValueError, match="\\[K, d\\]"):
        ChunkedUpdates(torch.zeros(3))
    with pytest.raises(ValueError, match="chunk_cols"):
        ChunkedUpdates(torch.zeros(2, 3), chunk_cols=0)
    with pytest.raises(TypeError, match="source"):
        ChunkedUpdates([[1.0]])


def test_fedaware_bf16_and_host_momentum_table(data):
    U, x, n = data
    ids = [0, 2, 3, 5, 6, 7]
    ref = algorithms.build("fedaware", num_clients=8, warmup="startup_full")
    bf = algorithms.build("fedaware", num_clients=8, warmup="startup_full", momentum_dtype=torch.bfloat16)
    host = algorithms.build("fedaware", num_clients=8, warmup="startup_full", momentum_device="cpu")
    r, _ = ref.aggregate(x, U, n, ids)
    b, info = bf.aggregate(x, U, n, ids)
    h, _ = host.aggregate(x, U, n, ids)
    assert bf.M.dtype == torch.bfloat16 and b.dtype == torch.float32
    assert torch.equal(h, r)
    torch.testing.assert_close(b, r, rtol=0, atol=0.02 * float(U.abs().max()))
    # the chunked mixed-dtype sum itself equals the fp32 sum of the bf16-rounded rows
    Mb = U.to(torch.bfloat16)
    c = torch.rand(K, dtype=torch.float64)
    got = weighted_sum_chunked(Mb, c, base=x, alpha=0.5, rows=list(range(K)), out_dtype=torch.float32, chunk_cols=100)
    assert torch.equal(got, ops.weighted_sum(Mb.float(), c, base=x, alpha=0.5))


def test_layering_algorithms_do_not_import_streaming():
    """Imports run downward: the aggregators need neither streaming nor distributed, and
    BadUpdateError / weighted_sum_chunked live below them (fedkernels.errors / fedkernels.ops)."""
    import subprocess
    import sys

    code = (
        "import sys, fedkernels.algorithms as a, fedkernels.errors as e, fedkernels.ops as o; "
        "bad = [m for m in ('fedkernels.streaming', 'fedkernels.distributed') if m in sys.modules]; "
        "assert not bad, bad; assert a.BadUpdateError is e.BadUpdateError; "
        "import fedkernels.streaming as s; assert s.weighted_sum_chunked is o.weighted_sum_chunked"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
