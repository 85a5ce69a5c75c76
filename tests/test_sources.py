"""Matrix sources (fedkernels.sources): every kind on small files, bf16/fp16, odd sizes; errors name the
client row; streamed results equal the in-memory ops bit for bit and are published only after success."""

import os
import re

import numpy as np
import pytest
import torch

from fedkernels import algorithms, ops
from fedkernels.errors import BadUpdateError
from fedkernels.sources import ClientFilesSource, MatrixSource, MemmapSource, RawFileSource, TensorSource, as_source
from fedkernels.streaming import (
    ChunkedUpdates,
    momentum_file,
    streamed_fedavg,
    streamed_fedaware,
    streamed_kuramoto,
    streamed_weighted_sum,
)

import cli_process  # tests/cli_process.py: the command in a child forked from a pre-imported interpreter

K, D = 5, 1001  # odd d: chunk widths that do not divide it


def _U(dtype=torch.float32, K=K, D=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(K, D, generator=g) * 0.1 + 0.05 * torch.randn(D, generator=g)).to(dtype)


def _raw(U, path):
    U.contiguous().view(torch.uint8).numpy().tofile(path)  # raw little-endian bytes, any dtype
    return str(path)


def _client_files(U, folder):
    paths = []
    for k in range(U.size(0)):
        paths.append(_raw(U[k], folder / f"client{k}.bin"))
    return paths


def _all_sources(U, tmp_path):
    """Every source kind holding U."""
    out = {
        "tensor": TensorSource(U),
        "raw": RawFileSource(_raw(U, tmp_path / "U.bin"), K, D, U.dtype),
        "raw_no_prefetch": RawFileSource(tmp_path / "U.bin", K, D, U.dtype, prefetch=False),
        "clients": ClientFilesSource(_client_files(U, tmp_path), D, U.dtype),
    }
    out["raw_direct"] = RawFileSource(tmp_path / "U.bin", K, D, U.dtype, direct=True)  # (O_DIRECT where the
    out["clients_direct"] = ClientFilesSource(out["clients"].paths, D, U.dtype, direct=True)  # file system has it)
    np_dt = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.uint16}[U.dtype]
    mm = np.memmap(tmp_path / "U.mm", dtype=np_dt, mode="w+", shape=(K, D))
    mm[:] = U.view(torch.int16).numpy().view(np.uint16) if U.dtype == torch.bfloat16 else U.numpy()
    mm.flush()
    ro = np.memmap(tmp_path / "U.mm", dtype=np_dt, mode="r", shape=(K, D))
    bf = torch.bfloat16 if U.dtype == torch.bfloat16 else None
    out["memmap"], out["memmap_ro"] = MemmapSource(mm, dtype=bf), MemmapSource(ro, dtype=bf)
    out["from_file"] = TensorSource(torch.from_file(str(tmp_path / "U.bin"), size=K * D, dtype=U.dtype).view(K, D))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk", [1, 64, 333, 5000])
def test_every_source_yields_the_matrix_in_order(tmp_path, dtype, chunk):
    U = _U(dtype)
    for name, s in _all_sources(U, tmp_path).items():
        assert (s.K, s.d, s.dtype) == (K, D, dtype), name
        blocks = list((a, b, blk.clone()) for a, b, blk in s.chunks(chunk))
        assert [a for a, _, _ in blocks] == list(range(0, D, chunk)), name
        for _, _, blk in blocks:
            assert blk.stride(1) == 1, name  # rows contiguous
        assert torch.equal(torch.cat([blk for _, _, blk in blocks], 1), U), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_streamed_fedavg_and_sum_are_bitwise_the_in_memory_ops(tmp_path, dtype):
    U = _U(dtype)
    x = torch.randn(D)
    n = [3, 7, 1, 9, 4]
    p = torch.tensor(n, dtype=torch.float64)
    p = p / p.sum()
    ref = ops.weighted_sum(U.float(), p, base=x, alpha=0.5)  # bf16/fp16 summed in the model's fp32
    ref_rows = ops.weighted_sum(U.float(), [0.25, -1.5], base=x, rows=[4, 1])
    for name, s in _all_sources(U, tmp_path).items():
        for chunk in (77, 4096):
            got = streamed_fedavg(x, ChunkedUpdates(s, chunk_cols=chunk), n, server_lr=0.5)
            assert got.dtype == torch.float32 and torch.equal(got, ref), (name, chunk)
            got = streamed_weighted_sum(ChunkedUpdates(s, chunk_cols=chunk), [0.25, -1.5], base=x, rows=[4, 1])
            assert torch.equal(got, ref_rows), (name, chunk)


def test_bf16_file_kuramoto_and_fedaware_match_the_aggregators(tmp_path):
    U = _U(torch.bfloat16)
    Uf = U.float()
    x = torch.randn(D)
    n = [3, 7, 1, 9, 4]
    src = ChunkedUpdates(RawFileSource(_raw(U, tmp_path / "U.bf16"), K, D, torch.bfloat16), chunk_cols=100)
    a_ref, a_str = algorithms.build("kuramoto", mode="S"), algorithms.build("kuramoto", mode="S")
    r, _ = a_ref.aggregate(x, Uf, n)
    s, _ = streamed_kuramoto(x, src, n, aggregator=a_str)
    torch.testing.assert_close(s, r, rtol=1e-6, atol=1e-7)
    # FedAWARE with a disk-backed bf16 momentum table equals the in-memory one with a bf16 table
    N, ids = 7, [0, 2, 3, 5, 6]
    ref = algorithms.build("fedaware", num_clients=N, warmup="startup_full", momentum_dtype=torch.bfloat16)
    st = algorithms.build("fedaware", num_clients=N, warmup="startup_full")
    M = momentum_file(tmp_path / "M.bf16", N, D, torch.bfloat16)
    xr, xs = x.clone(), x.clone()
    for _ in range(2):
        xr, ir = ref.aggregate(xr, Uf, n, ids)
        xs, is_ = streamed_fedaware(xs, src, n, ids, st, M)
        assert torch.equal(xs, xr)
        assert is_["support"] == ir["support"]
    assert torch.equal(M, ref.M)
    assert torch.equal(momentum_file(tmp_path / "M.bf16", N, D, torch.bfloat16), ref.M)  # it is on disk


def test_short_and_wrong_files_name_the_row(tmp_path):
    U = _U()
    path = _raw(U, tmp_path / "U.bin")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 4 * (D + 1))  # the last row and one element of row 3 missing
    with pytest.raises(ValueError, match=r"client row 3 is short"):
        RawFileSource(path, K, D, torch.float32)
    full = _raw(U, tmp_path / "V.bin")
    with pytest.raises(ValueError, match=r"wrong dtype or shape"):
        RawFileSource(full, K, D, torch.bfloat16)  # fp32 bytes read as bf16: twice the size
    with pytest.raises(ValueError, match=r"client row 2 is short"):
        RawFileSource(full, K, 2 * D, torch.float32)  # wrong d
    with pytest.raises(ValueError, match=r"dtype must be one of"):
        RawFileSource(full, K, D, torch.int32)
    paths = _client_files(U, tmp_path)
    with open(paths[2], "r+b") as f:
        f.truncate(10)
    with pytest.raises(ValueError, match=r"client row 2 \(.*client2.bin\) is short"):
        ClientFilesSource(paths, D, torch.float32)
    with pytest.raises(ValueError, match=r"client row 0 \(.*client0.bin\) is too long"):
        ClientFilesSource(paths, D, torch.float16)
    with pytest.raises(ValueError, match=r"uint16"):
        MemmapSource(np.zeros((2, 3), np.float32), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"float64"):
        as_source(np.zeros((2, 3)), dtype=torch.float32)
    with pytest.raises(ValueError, match=r"\[K, d\]"):
        TensorSource(torch.zeros(3))
    with pytest.raises(TypeError, match=r"source must be"):
        as_source(3)
    with pytest.raises(ValueError, match=r"K=4 but the source has K=5"):
        ChunkedUpdates(U, K=4)


@pytest.mark.parametrize("kind", ["raw", "clients", "memmap", "raw_direct"])
def test_nan_in_a_chunk_names_the_row_and_nothing_is_written(tmp_path, kind):
    U = _U(torch.bfloat16)
    U[3, 700] = float("nan")
    s = _all_sources(U, tmp_path)[kind]
    with pytest.raises(BadUpdateError, match=r"client row 3 .*columns 600\.\.699|client row 3.*columns 700"):
        for _ in s.chunks(100, check_finite=True):
            pass
    with pytest.raises(BadUpdateError, match=r"client row 3( \(.*client3.bin\))? contains NaN/Inf"):
        list(s.chunks(64, check_finite=True))
    x = torch.randn(D)
    x0 = x.clone()
    out = torch.full((D,), 7.0)
    outfile = tmp_path / "new.bin"
    n = [1, 2, 3, 4, 5]
    for call in (
        lambda o: streamed_fedavg(x, ChunkedUpdates(s, chunk_cols=100), n, out=o),
        lambda o: streamed_kuramoto(x, ChunkedUpdates(s, chunk_cols=100), n, out=o),
    ):
        for o in (out, x, outfile):
            with pytest.raises(BadUpdateError, match="client row 3"):
                call(o)
    assert torch.equal(x, x0) and bool((out == 7.0).all())  # untouched, not half-written
    assert sorted(os.listdir(tmp_path)).count("new.bin") == 0
    assert not [f for f in os.listdir(tmp_path) if f.startswith("new.bin.tmp")]
    agg = algorithms.build("fedaware", num_clients=6, warmup="startup_full")
    M = momentum_file(tmp_path / "M.bin", 6, D, torch.float32)
    with pytest.raises(BadUpdateError, match="client row 3"):
        streamed_fedaware(x, ChunkedUpdates(s, chunk_cols=100), n, [0, 1, 2, 3, 4], agg, M, out=out)
    assert agg.Gm is None or not bool(agg.seen.any())  # the aggregator's state unchanged
    assert not bool(M.any()) and bool((out == 7.0).all())


def test_out_file_is_written_whole_and_renamed(tmp_path):
    U = _U(torch.float16)
    x = torch.randn(D)
    n = [1, 2, 3, 4, 5]
    dst = tmp_path / "model.f32"
    dst.write_bytes(b"old")
    new = streamed_fedavg(
        x, ChunkedUpdates(RawFileSource(_raw(U, tmp_path / "U.f16"), K, D, torch.float16), chunk_cols=300), n, out=dst
    )
    p = torch.tensor(n, dtype=torch.float64)
    ref = ops.weighted_sum(U.float(), p / p.sum(), base=x)
    assert torch.equal(new, ref)
    assert torch.equal(torch.from_file(str(dst), size=D, dtype=torch.float32), ref)
    assert sorted(os.listdir(tmp_path)) == ["U.f16", "model.f32"]
    new.zero_()  # the returned tensor maps the file privately (copy-on-write)
    assert torch.equal(torch.from_file(str(dst), size=D, dtype=torch.float32), ref)
    with pytest.raises(ValueError, match="is a folder"):
        streamed_fedavg(x, U, n, out=tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        streamed_fedavg(x, U, n, out=tmp_path / "nope" / "m.bin")
    with pytest.raises(ValueError, match=r"out must have dtype torch.float32"):
        streamed_fedavg(x, U, n, out=torch.empty(D, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"num_examples has 2 entries, expected K=5"):
        streamed_fedavg(x, U, [1, 2])


def test_source_is_the_interface():
    assert issubclass(RawFileSource, MatrixSource) and issubclass(ClientFilesSource, MatrixSource)
    s = as_source(torch.zeros(2, 3))
    assert isinstance(s, TensorSource) and as_source(s) is s and s.nbytes == 24


def test_large_model_bench_runs_and_cleans_up(tmp_path):
    """bench/large_model.py as a user runs it: a tiny round from a file, its JSON, no file left behind;
    a run that cannot fit on the disk is refused (exit 2) before anything is written."""
    import json
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    work = tmp_path / "work"
    work.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "bench.large_model",
        "--d",
        "5000",
        "--K",
        "3",
        "--dir",
        str(work),
        "--methods",
        "fedavg,fedaware",
        "--out",
        str(tmp_path / "r.json"),
    ]
    r = cli_process.run(cmd, capture_output=True, text=True, cwd=root)
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "r.json").read_text())["runs"][0]
    row, aware = res["methods"]
    assert row["method"] == "fedavg" and row["result_ok"] and row["GBps_read"] > 0 and row["peak_rss_GB"] > 0
    assert aware["method"] == "fedaware" and aware["result_ok"] and len(aware["info"]["lam"]) == 3
    assert res["dd_s"] > 0 and res["file_GB"] == 3 * 5000 * 2 / 1e9
    assert res["complete"] and res["read_path"]["read_GBps"] > 0 and "load average" in res["uptime_before"]
    assert aware["floor_with_table_s"] > aware["floor_s"] and aware["info"]["table_dtype"] == "bf16"
    assert all(len(m["loadavg_before"]) == 3 and m["top_calls_own_s"] for m in (row, aware))
    assert row["read_mode"] == res["read_path"]["read_mode"] == "buffered"  # (a small file: cached reads)
    assert os.listdir(work) == []
    r = cli_process.run(
        cmd[:-2] + ["--margin-gb", "1e9", "--out", str(tmp_path / "s.json")], capture_output=True, text=True, cwd=root
    )
    assert r.returncode == 2 and "GB free" in r.stderr and "lower --d" in r.stderr
    assert os.listdir(work) == [] and not (tmp_path / "s.json").exists()


def test_a_bad_chunk_stops_the_pass_there():
    """On the host a NaN is reported from the chunk that holds it (row and columns), without reading on."""

    class Counting(TensorSource):
        read = 0

        def _blocks(self, chunk_cols):
            for blk in super()._blocks(chunk_cols):
                self.read += 1
                yield blk

    U = _U()
    U[2, 705] = float("inf")
    x = torch.zeros(D)
    for fn in (lambda s: streamed_fedavg(x, s, [1] * K), lambda s: streamed_kuramoto(x, s, [1] * K)):
        s = Counting(U)
        with pytest.raises(
            BadUpdateError,
            match=r"client 2 \(row 2\): update contains NaN/Inf.*\(source: client row 2, columns 700\.\.799 of d=1001\)",
        ):
            fn(ChunkedUpdates(s, chunk_cols=100))
        assert s.read == 8


def _resident_kb(path) -> int:
    """Rss (kB) of this process's mapping of ``path`` (/proc/self/smaps)."""
    path, rss, inside = os.path.realpath(path), 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if len(head) >= 5 and re.fullmatch(r"[0-9a-f]+-[0-9a-f]+", head[0]):  # a mapping's header line
                inside = len(head) >= 6 and head[5] == path
            elif inside and line.startswith("Rss:"):
                rss += int(head[1])
    return rss


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs /proc/self/smaps (Linux)")
def test_a_new_table_file_is_paged_in_when_it_fits(tmp_path, monkeypatch):
    """A new zero table that fits in memory is mapped up front (no page fault per 4 KB page in its first
    round); one that does not fit (here: a zero share of the memory allowed) is left to fault in. Both
    read as zeros and write through to the file."""
    from fedkernels.algorithms import tables

    N, d = 4, 1 << 16  # 1 MiB of fp32
    M = momentum_file(tmp_path / "M.bin", N, d)
    assert _resident_kb(tmp_path / "M.bin") == N * d * 4 // 1024
    monkeypatch.setattr(tables, "PAGE_IN_FRACTION", 0.0)
    L = momentum_file(tmp_path / "L.bin", N, d)
    assert _resident_kb(tmp_path / "L.bin") == 0
    for T, name in ((M, "M.bin"), (L, "L.bin")):
        assert not T.any()
        T[1, 5] = 2.5
        assert torch.from_file(str(tmp_path / name), size=N * d)[d + 5] == 2.5
    assert not tables.page_in(L) and tables.PAGE_IN_FRACTION == 0.0


def _has_o_direct(folder) -> bool:
    try:
        os.close(os.open(_raw(torch.zeros(1024), folder / "probe.bin"), os.O_RDONLY | os.O_DIRECT))
        return True
    except (OSError, AttributeError):
        return False


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_direct_reads_give_the_same_blocks(tmp_path, dtype, monkeypatch):
    """O_DIRECT reads (rows at offsets that are not multiples of 4096 and step by a d * itemsize that is
    not either; a header; odd widths; one block and prefetched blocks; a row selection) give the bytes of
    buffered reads; a header that is not a multiple of the itemsize, pin_memory or direct=False read
    buffered; by default a source reads direct only when it is larger than the available memory."""
    from fedkernels.sources import files

    if not _has_o_direct(tmp_path):
        pytest.skip("the test folder's file system refuses O_DIRECT")
    Kd, Dd, es = 6, 3001, torch.empty(0, dtype=dtype).element_size()
    U = _U(dtype, Kd, Dd)
    for off in (0, 4 * es, 4096 + 2 * es):
        path = tmp_path / f"U{off}.bin"
        with open(path, "wb") as f:
            f.write(b"h" * off)
            f.write(U.view(torch.uint8).numpy().tobytes())
        for chunk, prefetch in ((1000, True), (3001, True), (777, False), (1, True)):
            s = RawFileSource(path, Kd, Dd, dtype, offset=off, direct=True, prefetch=prefetch)
            got = torch.cat([c.clone() for _, _, c in s.chunks(chunk)], 1)
            assert s.read_mode == "direct" and torch.equal(got.view(torch.uint8), U.view(torch.uint8)), (off, chunk)
        sel = torch.cat([c.clone() for _, _, c in s.select_rows([4, 0, 5]).chunks(500)], 1)
        assert torch.equal(sel.view(torch.uint8), U[[4, 0, 5]].view(torch.uint8))
    c = ClientFilesSource(_client_files(U, tmp_path), Dd, dtype, direct=True)
    assert torch.equal(torch.cat([b.clone() for _, _, b in c.chunks(640)], 1).view(torch.uint8), U.view(torch.uint8))
    assert c.read_mode == "direct"
    with open(tmp_path / "odd.bin", "wb") as f:
        f.write(b"h")
        f.write(U.view(torch.uint8).numpy().tobytes())
    for s in (
        RawFileSource(tmp_path / "odd.bin", Kd, Dd, dtype, offset=1, direct=True),
        RawFileSource(tmp_path / "U0.bin", Kd, Dd, dtype, direct=False),
        RawFileSource(tmp_path / "U0.bin", Kd, Dd, dtype, direct=True, pin_memory=True),
        RawFileSource(tmp_path / "U0.bin", Kd, Dd, dtype),
    ):  # small: fits in memory
        got = torch.cat([b.clone() for _, _, b in s.chunks(1000)], 1)
        assert s.read_mode == "buffered" and torch.equal(got.view(torch.uint8), U.view(torch.uint8))
    monkeypatch.setattr(files, "available_bytes", lambda device: s.nbytes - 1)  # larger than the memory
    list(s.chunks(1000))
    assert s.read_mode == "direct"
    with pytest.raises(ValueError, match=r"^RawFileSource: direct must be None, True or False, got 'yes'$"):
        RawFileSource(tmp_path / "U0.bin", Kd, Dd, dtype, direct="yes")


@pytest.mark.parametrize("direct", [False, True])
def test_a_file_that_shrinks_after_validation_names_the_row(tmp_path, direct):
    U = _U(torch.float32, 4, 5000)
    path = _raw(U, tmp_path / "U.bin")
    s = RawFileSource(path, 4, 5000, torch.float32, direct=direct)
    os.truncate(path, 4 * (2 * 5000 + 100))  # row 2 ends after 100 elements
    with pytest.raises(OSError, match=r"short read of client row 2 from .*U\.bin at byte"):
        list(s.chunks(1000))


def test_file_sources_read_large_blocks_and_hand_out_chunks(tmp_path, monkeypatch):
    """The disk sees reads of READ_BYTES (a whole number of chunks) whatever width the caller asks for;
    the chunks handed out are the matrix's columns in order."""
    from fedkernels.sources import files

    U = _U()
    path = _raw(U, tmp_path / "U.bin")
    monkeypatch.setattr(files, "READ_BYTES", K * 4 * 300)  # 3 chunks of 100 columns per read
    for prefetch in (True, False):
        s = RawFileSource(path, K, D, torch.float32, prefetch=prefetch)
        reads = []
        real = s._read
        monkeypatch.setattr(s, "_read", lambda fds, st, a, b: reads.append((a, b)) or real(fds, st, a, b))
        got = [(a, b, c.clone()) for a, b, c in s.chunks(100)]
        assert reads == [(0, 300), (300, 600), (600, 900), (900, 1001)]
        assert [(a, b) for a, b, _ in got] == [(a, min(a + 100, D)) for a in range(0, D, 100)]
        assert torch.equal(torch.cat([c for _, _, c in got], 1), U)
