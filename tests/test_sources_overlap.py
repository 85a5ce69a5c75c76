"""Host-to-device delivery of a source's chunks (fedkernels.sources.overlapped) (device="auto":
tests/test_pick_device.py).

No GPU here: the copy schedule is driven with a fake CUDA whose streams run queued work only when the host
waits on an event, in an adversarial order (compute first, copy first, random): a missing event between
a buffer's reuse and the work still reading it shows up as wrong chunk data. The real CudaCalls are only
run on a GPU (GPU speed not measured here)."""

import collections
import random

import numpy as np
import pytest
import torch

from fedkernels import algorithms, ops, sources
from fedkernels.sources import chunked
from fedkernels.sources import ChunkedUpdates, RawFileSource, TensorSource, overlapped

import cli_process  # tests/cli_process.py: the command in a child forked from a pre-imported interpreter

K, D = 5, 1001


def _U(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(K, D, generator=g) * 0.1).to(dtype)


class _Event:
    def __init__(self, stream):
        self.stream, self.after, self.done = stream, stream.runs, False  # after the stream's first `runs` kernels


class _Stream:
    def __init__(self, name):
        self.name, self.queue, self.runs = name, collections.deque(), 0


class FakeCuda:
    """CudaCalls' interface over CPU tensors: device work is queued per stream and runs only when the host
    waits (``sync``, ``flush``), picking among the runnable streams by ``policy``."""

    def __init__(self, policy="random", seed=0):
        self.compute, self.copy = _Stream("compute"), _Stream("copy")
        self.policy, self.rng = policy, random.Random(seed)
        self.h2d_issued = 0
        self.copy_waits = []  # per h2d copy: the events the copy stream was told to wait on before it
        self._waits = []

    def buffers(self, numel, dtype):
        return [torch.empty(numel, dtype=dtype) for _ in range(2)], [torch.empty(numel, dtype=dtype) for _ in range(2)]

    def fill(self, dst, src):
        dst.copy_(src)  # host work: now

    def launch(self, stream, fn):
        stream.queue.append(("run", fn))
        stream.runs += 1

    def h2d(self, dst, src):
        assert src.is_contiguous() and dst.is_contiguous()
        self.launch(self.copy, lambda: dst.copy_(src))
        self.h2d_issued += 1
        self.copy_waits.append(self._waits)
        self._waits = []
        return self.record(self.copy)

    def record(self, stream):
        ev = _Event(stream)
        stream.queue.append(("record", ev))
        return ev

    def wait(self, stream, ev):
        stream.queue.append(("wait", ev))
        if stream is self.copy:
            self._waits.append(ev)

    def sync(self, ev):
        while not ev.done:
            self._step()

    def flush(self):
        while self.compute.queue or self.copy.queue:
            self._step()

    def _step(self):
        ready = [s for s in (self.compute, self.copy) if s.queue and (s.queue[0][0] != "wait" or s.queue[0][1].done)]
        assert ready, "deadlock: every stream waits on an event that is never recorded"
        s = {"compute": ready[0], "copy": ready[-1]}.get(self.policy) or self.rng.choice(ready)
        op, x = s.queue.popleft()
        if op == "run":
            x()
        elif op == "record":
            x.done = True


def _consume(chunks, fake, rows=K):
    """Each chunk read by a 'kernel' on the compute stream; returns the blocks that kernel saw and, per
    chunk, how many copies had been issued when it was handed over."""
    seen, issued = [], []
    for a, b, c in chunks:
        assert c.shape == (rows, b - a) and c.is_contiguous()
        fake.launch(fake.compute, lambda a=a, b=b, c=c: seen.append((a, b, c.clone())))
        issued.append(fake.h2d_issued)
    fake.flush()
    return seen, issued


@pytest.mark.parametrize("policy", ["compute", "copy", "random0", "random1", "random2"])
@pytest.mark.parametrize("width", [64, 333, 1001, 4096])
def test_overlapped_delivers_every_chunk_intact_in_any_stream_order(policy, width):
    U = _U()
    fake = FakeCuda(policy.rstrip("012"), seed=int(policy[-1]) if policy[-1].isdigit() else 0)
    seen, issued = _consume(overlapped(TensorSource(U).chunks(width), K, width, U.dtype, fake), fake)
    n = -(-D // width)
    assert [a for a, _, _ in seen] == list(range(0, D, width))
    assert torch.equal(torch.cat([c for _, _, c in seen], 1), U)
    # overlap: chunk i+1's copy is queued before chunk i is handed to the caller
    assert issued == [min(i + 2, n) for i in range(n)]
    # device buffer reuse: the copy of chunk j waits on the compute of chunk j-2 only (never of chunk j-1,
    # which would serialize copy and compute)
    assert [[(e.stream.name, e.after) for e in w] for w in fake.copy_waits] == [
        [] if j < 2 else [("compute", j - 1)] for j in range(n)
    ]


def test_overlapped_from_a_prefetching_file_source_and_selected_rows(tmp_path):
    """A file source's blocks live in its own staging buffers, refilled by its reader thread: each is copied
    into pinned memory as soon as it is taken, so the lookahead never reads a refilled buffer."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        U = _U(dtype)
        path = tmp_path / f"U.{dtype}".replace("torch.", "")
        U.view(torch.uint8).numpy().tofile(path)
        src = RawFileSource(path, K, D, dtype).select_rows([4, 0, 2])
        fake = FakeCuda("copy")
        seen, _ = _consume(overlapped(src.chunks(100), 3, 100, dtype, fake), fake, rows=3)
        assert torch.equal(torch.cat([c for _, _, c in seen], 1), U[[4, 0, 2]])
        assert seen[0][2].dtype == dtype


def test_chunked_updates_to_cuda_use_the_overlapped_schedule(monkeypatch):
    U = _U(torch.bfloat16)
    fake = FakeCuda("random", seed=3)
    made = []
    monkeypatch.setattr(chunked, "CudaCalls", lambda dev: made.append(dev) or fake)
    cu = ChunkedUpdates(U, chunk_cols=128, device="cuda")
    seen, issued = _consume(cu.chunks(), fake)
    assert made == [torch.device("cuda")] and fake.h2d_issued == len(seen) == 8
    assert torch.equal(torch.cat([c for _, _, c in seen], 1), U)
    # on the CPU: the source's own blocks, no staging
    assert all(c.data_ptr() == U[:, a:b].data_ptr() for a, b, c in ChunkedUpdates(U, chunk_cols=128).chunks())


# ---- bf16 / fp16 through every source kind --------------------------------------------------------------
def _raw_and_client_files(tmp_path, U):
    """U's bytes as one raw row-major file and as one file per client row: (path, [paths])."""
    raw = tmp_path / "U.bin"
    U.view(torch.uint8).numpy().tofile(raw)
    files = []
    for k in range(U.size(0)):
        files.append(str(tmp_path / f"c{k}.bin"))
        U[k].clone().view(torch.uint8).numpy().tofile(files[-1])
    return raw, files


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_sources_from_as_source_paths_and_arrays(tmp_path, dtype):
    """``as_source`` / ``ChunkedUpdates`` take bf16/fp16 as a path, a list of client files, a NumPy array
    (bf16 as uint16) and a tensor; the Gram of every one is the fp64 Gram of the matrix."""
    U = _U(dtype)
    raw, files = _raw_and_client_files(tmp_path, U)
    arr = U.view(torch.int16).numpy().view(np.uint16) if dtype == torch.bfloat16 else U.numpy()
    ref = ops.gram(U)
    for x in (str(raw), files, arr, U):
        cu = ChunkedUpdates(x, K=K, d=D, dtype=dtype, chunk_cols=300)
        assert cu.dtype == dtype
        G = torch.zeros(K, K, dtype=torch.float64)
        for _, _, c in cu.chunks():
            assert c.dtype == dtype
            G += ops.gram(c)
        torch.testing.assert_close(G, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "src_dtype, model_dtype",
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.float16, torch.float64),
        (torch.bfloat16, torch.float64),
    ],
)
def test_half_sources_under_a_model_of_their_dtype_or_wider(tmp_path, src_dtype, model_dtype):
    """A bf16/fp16 model aggregates a source of its dtype (ops.weighted_sum accumulates it in fp32 and
    rounds once to the model's dtype), a float64 model a bf16/fp16 source (converted exactly): from a file,
    per-client files and a memmap the same bits as the in-memory tensor round (FedAvg, column-local), and
    Kuramoto's weights from the fp64 Gram summed over chunks."""
    U = _U(src_dtype)
    raw, files = _raw_and_client_files(tmp_path, U)
    np_dt = np.uint16 if src_dtype == torch.bfloat16 else np.float16
    mm = np.memmap(tmp_path / "U.mm", dtype=np_dt, mode="w+", shape=(K, D))
    mm[:] = U.view(torch.int16).numpy().view(np.uint16) if src_dtype == torch.bfloat16 else U.numpy()
    x = (torch.randn(D, generator=torch.Generator().manual_seed(1)) * 0.1).to(model_dtype)
    n = [3, 7, 1, 9, 4]
    Uin = U.to(model_dtype)  # the in-memory round: a tensor of the model's dtype (exact widening)
    for name in ("fedavg", "kuramoto"):
        ref, _ = algorithms.build(name).aggregate(x, Uin, n)
        for s in (
            RawFileSource(raw, K, D, src_dtype),
            sources.ClientFilesSource(files, D, src_dtype),
            sources.MemmapSource(mm, dtype=src_dtype if src_dtype == torch.bfloat16 else None),
        ):
            got, _ = algorithms.build(name).aggregate(x, ChunkedUpdates(s, chunk_cols=300), n)
            assert got.dtype == model_dtype, (name, s)
            if name == "fedavg":
                assert torch.equal(got, ref), (name, s)
            else:
                tol = 1e-12 if model_dtype == torch.float64 else 1e-2
                torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_bench_case_refuses_without_cuda():
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = cli_process.run(
        [sys.executable, "-c", "from bench.large_model import gpu_overlap; gpu_overlap()"],
        capture_output=True,
        text=True,
        cwd=root,
    )
    assert r.returncode != 0 and "gpu_overlap: needs a CUDA device" in r.stderr


def test_aggregators_take_an_auto_source_and_say_where_they_ran(monkeypatch):
    from fedkernels.streaming import streamed_kuramoto

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    U = _U()
    x = torch.randn(D)
    n = [3, 7, 1, 9, 4]
    for name in ("fedavg", "fedavgm", "kuramoto"):
        ref, _ = algorithms.build(name).aggregate(x, U, n)
        got, info = algorithms.build(name).aggregate(x, ChunkedUpdates(U, chunk_cols=100, device="auto"), n)
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
        assert info["device"] == "cpu: no CUDA device", name
    assert streamed_kuramoto(x, ChunkedUpdates(U, device="auto"), n)[1]["device"] == "cpu: no CUDA device"
    agg = algorithms.build("fedaware", num_clients=6, warmup="startup_full")
    assert agg.aggregate(x, ChunkedUpdates(U, chunk_cols=100, device="auto"), n, [0, 1, 2, 3, 5])[1]["device"]
    U[2, 5] = float("nan")
    got, info = algorithms.build("fedavg", on_bad_update="exclude").aggregate(
        x, ChunkedUpdates(U, chunk_cols=100, device="auto"), n
    )
    assert info["excluded"][0]["client_id"] == 2 and info["device"] == "cpu: no CUDA device"
    out = torch.empty_like(x)  # aggregate(out=) holds for a placed round too
    got, _ = algorithms.build("fedavg", on_bad_update="exclude").aggregate(
        x, ChunkedUpdates(U, chunk_cols=100, device="auto"), n, out=out
    )
    assert got is out and torch.equal(out, algorithms.build("fedavg", on_bad_update="exclude").aggregate(x, U, n)[0])
