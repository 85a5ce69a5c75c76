"""Every aggregator on a matrix source: ``aggregate(x, source, ...)`` is the same
method as ``aggregate(x, tensor, ...)`` with the same result (bit for bit for the column-local methods,
the Gram-based ones to fp64 summation order), state included, over 3 rounds; bad rows are screened in
the same pass and named with their source row; a method that cannot stream refuses at once."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from bench.cpu_hostwork import methods, spec_of
from fedkernels import algorithms, ops
from fedkernels.algorithms.base import AggResult, Aggregator, RoundInput
from fedkernels.errors import BadUpdateError
from fedkernels.sources import ChunkedUpdates, ClientFilesSource, MemmapSource, RawFileSource, TensorSource
from fedkernels.streaming import momentum_file, streamed_fedaware

SPEC = spec_of([(40, 12), (40,), (12, 40), (12,)])  # d = 1012: chunks of 100 do not divide it
D, N = SPEC.d, 8
ROUNDS = [[0, 2, 5], [1, 2, 3, 4, 6], [7, 0, 5, 6, 1, 3, 4, 2]]  # the last round completes exploration
GRAM_BASED = {"kuramoto", "fedaware"}  # weights from chunk sums (kstats, a Gram) added over chunks: not bitwise
CASES = [(m, {}) for m in methods() if m != "fedecado"] + [
    ("local_gc_only", {"lam": 0.5}),
    ("fedavgm", {"nesterov": True}),
    ("kuramoto", {"mode": "P", "guard": False}),
    ("kuramoto", {"mode": "C"}),
    ("fedaware", {"warmup": "startup_full", "extension": "fedavgm"}),
    ("fedaware", {"init": "first_update", "elud": False}),
    ("fedaware", {"variant": "na", "warmup": "mask"}),
]
CASES = [c for c in CASES if not (c[0] == "local_gc_only" and not c[1])]


def _raw(U, path):
    U.contiguous().view(torch.uint8).numpy().tofile(path)
    return str(path)


def _source(kind, U, tmp_path, r):
    if kind == "tensor":
        return ChunkedUpdates(TensorSource(U), chunk_cols=100)
    if kind == "memmap":
        mm = np.memmap(tmp_path / f"U{r}.mm", dtype=np.float32, mode="w+", shape=tuple(U.shape))
        mm[:] = U.numpy()
        return ChunkedUpdates(MemmapSource(mm), chunk_cols=100)
    return ChunkedUpdates(RawFileSource(_raw(U, tmp_path / f"U{r}.bin"), U.size(0), D), chunk_cols=333)


def _payloads(agg, K, g):
    pl = {"local_steps": 5, "pgvc_skipped_steps": 0, "local_gc": 1, "phase": 0.5}
    if isinstance(getattr(agg, "mu", None), float):
        pl["prox_mu"] = agg.mu
    if getattr(agg, "d_c", None) is not None:
        dc = torch.randn(K, agg.d_c, generator=g) * 1e-3
        return [dict(pl, delta_c=dc[k], phase=0.1 * k) for k in range(K)]
    return [dict(pl, phase=0.1 * k) for k in range(K)]


def _pair(name, opts):
    aggs = [algorithms.build(name, **opts) for _ in range(2)]
    x = torch.randn(D, generator=torch.Generator().manual_seed(1))
    for a in aggs:
        a.setup(SPEC, num_clients=N, global_flat=x)
    return aggs, x


def _close(a, b, exact, what):
    if exact:
        assert torch.equal(a, b), what
    else:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9, msg=what)


def _same_state(s1, s2, exact, what):
    assert s1.keys() == s2.keys()
    for k, v in s1.items():
        if isinstance(v, torch.Tensor):
            _close(v, s2[k], exact or not v.is_floating_point(), f"{what}: state {k}")
        else:
            assert v == s2[k], f"{what}: state {k}"


@pytest.mark.parametrize("kind", ["tensor", "memmap", "raw"])
@pytest.mark.parametrize(
    "name,opts", CASES, ids=[f"{m}{'-' + '-'.join(map(str, o.values())) if o else ''}" for m, o in CASES]
)
def test_every_aggregator_on_a_source_equals_the_tensor_run(tmp_path, kind, name, opts):
    (ref, got), x = _pair(name, opts)
    xr = xs = x
    g = torch.Generator().manual_seed(2)
    exact = name not in GRAM_BASED
    for r, ids in enumerate(ROUNDS):
        K = len(ids)
        U = torch.randn(K, D, generator=g) * 1e-2 + 1e-2 * torch.randn(D, generator=g)
        n = [float(10 + 3 * k) for k in range(K)]
        pl = _payloads(ref, K, g)
        a = ref.aggregate(xr, U, n, ids, [dict(p) for p in pl])
        b = got.aggregate(xs, _source(kind, U, tmp_path, r), n, ids, [dict(p) for p in pl])
        _close(b.params, a.params, exact, f"{name} round {r}")
        assert b.params.dtype == x.dtype and b.info.keys() == a.info.keys()
        xr, xs = a.params, b.params
    _same_state(ref.state_dict(), got.state_dict(), exact, name)


def test_bf16_file_source_under_an_fp32_model_is_the_fp32_run(tmp_path):
    """A bfloat16 file is summed in the model's float32: the result of the float32 tensor of its values."""
    g = torch.Generator().manual_seed(3)
    U = (torch.randn(5, D, generator=g) * 1e-2).to(torch.bfloat16)
    x = torch.randn(D, generator=g)
    src = ChunkedUpdates(RawFileSource(_raw(U, tmp_path / "U.bf16"), 5, D, torch.bfloat16), chunk_cols=128)
    n = [3.0, 1.0, 4.0, 1.0, 5.0]
    for name, exact in (("fedavg", True), ("scaffold", True), ("kuramoto", False)):
        (ref, got), _ = _pair(name, {})
        pl = _payloads(ref, 5, g)
        a = ref.aggregate(x, U.float(), n, [0, 1, 2, 3, 4], pl)
        b = got.aggregate(x, src, n, [0, 1, 2, 3, 4], pl)
        _close(b.params, a.params, exact, name)


@pytest.mark.parametrize(
    "name,opts",
    [("fedavg", {}), ("kuramoto", {}), ("fedaware", {"elud": False}), ("fedaware", {"warmup": "startup_full"})],
)
def test_exclude_drops_bad_rows_of_a_source_like_a_tensor(tmp_path, name, opts):
    """on_bad_update='exclude': a NaN row (found in the screening pass) and a row with a bad count are
    dropped; the rest is the tensor run's result, and the source's rows keep their names."""
    g = torch.Generator().manual_seed(4)
    U = torch.randn(6, D, generator=g) * 1e-2
    U[4, 555] = float("nan")
    n = [5.0, 0.0, 2.0, 7.0, 1.0, 3.0]  # row 1: a bad count (dropped in validate)
    ids = [6, 1, 0, 3, 7, 2]
    (ref, got), x = _pair(name, dict(opts, on_bad_update="exclude"))
    paths = [_raw(U[k], tmp_path / f"c{k}.bin") for k in range(6)]
    a = ref.aggregate(x, U, n, ids)
    b = got.aggregate(x, ChunkedUpdates(ClientFilesSource(paths, D), chunk_cols=100), n, ids)
    assert [e["client_id"] for e in b.info["excluded"]] == [e["client_id"] for e in a.info["excluded"]] == [1, 7]
    _close(b.params, a.params, name not in GRAM_BASED, name)
    # raise: the NaN is named with the client, its file and the columns of the chunk; the state is that of
    # the same failure on a tensor (nothing advanced), the global model untouched
    (agg_t, agg), _ = _pair(name, opts)
    x0 = x.clone()
    files = [paths[k] for k in (0, 2, 3, 4, 5)]
    args = ([5.0, 2.0, 7.0, 1.0, 3.0], [6, 0, 3, 7, 2])
    with pytest.raises(BadUpdateError, match=r"client 7 \(row 3\): update contains NaN/Inf"):
        agg_t.aggregate(x, torch.stack([U[k] for k in (0, 2, 3, 4, 5)]), *args)
    with pytest.raises(
        BadUpdateError,
        match=r"client 7 \(row 3\): update contains NaN/Inf.*"
        r"\(source: client row 3 \(.*c4\.bin\)(, columns 500\.\.599 of d=1012)?\)",
    ):
        agg.aggregate(x, ChunkedUpdates(ClientFilesSource(files, D), chunk_cols=100), *args)
    assert torch.equal(x, x0) and agg.round == agg_t.round == 0
    _same_state(agg_t.state_dict(), agg.state_dict(), True, name)


def test_fedaware_disk_table_is_untouched_by_a_bad_round(tmp_path):
    U = torch.randn(5, D) * 1e-2
    U[2, 901] = float("inf")
    agg = algorithms.build("fedaware", num_clients=6, warmup="startup_full", elud=False)
    M = momentum_file(tmp_path / "M.bin", 6, D)
    x = torch.randn(D)
    out = torch.full((D,), 7.0)
    with pytest.raises(BadUpdateError, match=r"client 2 \(row 2\).*columns 900\.\.999"):
        streamed_fedaware(x, ChunkedUpdates(U, chunk_cols=100), [1] * 5, [0, 1, 2, 3, 4], agg, M, out=out)
    assert not bool(M.any()) and bool((out == 7.0).all()) and not bool(agg.seen.any()) and agg.round == 0


def test_fedecado_refuses_a_source_before_reading_it():
    class Counting(TensorSource):
        read = 0

        def _blocks(self, chunk_cols):
            for blk in super()._blocks(chunk_cols):
                self.read += 1
                yield blk

    agg = algorithms.build("fedecado", num_clients=4)
    s = Counting(torch.zeros(2, D))
    with pytest.raises(ValueError) as e:
        agg.aggregate(torch.zeros(D), s, [1, 1], [0, 1], [{"T": 0.1}, {"T": 0.1}])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("fedecado.aggregate: updates from a chunked source")
    assert "backward-Euler" in msg and "pass a [K, d] tensor" in msg and s.read == 0 and agg.round == 0


def test_a_source_of_the_wrong_shape_dtype_or_device_is_named():
    agg = algorithms.build("fedavg")
    x = torch.zeros(D)
    with pytest.raises(ValueError, match=r"fedavg.aggregate: updates \(.*\) has d=7 columns, expected d=1012"):
        agg.aggregate(x, TensorSource(torch.zeros(2, 7)), [1, 1])
    with pytest.raises(ValueError, match=r"has dtype torch.float64, expected global_flat's torch.float32"):
        agg.aggregate(x, TensorSource(torch.zeros(2, D, dtype=torch.float64)), [1, 1])
    with pytest.raises(ValueError, match=r"delivers its chunks to meta but global_flat is on cpu"):
        agg.aggregate(x, ChunkedUpdates(torch.zeros(2, D), device="meta"), [1, 1])
    with pytest.raises(ValueError, match=r"num_examples has 3 entries, expected K=2"):
        agg.aggregate(x, TensorSource(torch.zeros(2, D)), [1, 1, 1])
    assert agg.round == 0


def test_a_method_that_reads_rin_U_directly_is_stopped_not_given_numbers():
    """A source round has no U tensor: a method reading ``rin.U`` raises instead of computing."""

    class Direct(Aggregator):
        name = "direct"

        def _aggregate(self, rin: RoundInput) -> AggResult:
            return AggResult(ops.weighted_sum(rin.U, [1.0] * rin.K, base=rin.global_flat), {})

    U = torch.randn(3, D)
    x = torch.zeros(D)
    assert torch.equal(Direct().aggregate(x, U, [1, 1, 1]).params, ops.weighted_sum(U, [1.0] * 3, base=x))
    with pytest.raises(RuntimeError, match=r"chunked source: RoundInput.U holds no data"):
        Direct().aggregate(x, TensorSource(U), [1, 1, 1])


def test_a_source_round_gives_its_shape_not_a_tensor_stand_in():
    """validate and the exclude policy read the source's UpdatesShape (K, d, dtype, device) directly: no
    tensor stand-in; after an exclusion K counts the kept rows; the method sees the model's dtype (a
    bf16 source is summed in it) and device."""
    seen = []

    class Look(Aggregator):
        name = "look"

        def _aggregate(self, rin: RoundInput) -> AggResult:
            seen.append((type(rin.updates).__name__, rin.K, rin.d, rin.dtype, rin.device))
            return AggResult(rin.weighted_sum([1.0] * rin.K, base=rin.global_flat), {})

    U = torch.randn(4, D)
    U[2, 7] = float("nan")
    x = torch.zeros(D)
    res = Look(on_bad_update="exclude").aggregate(
        x, ChunkedUpdates(TensorSource(U.bfloat16()), chunk_cols=100), [1, 1, 1, 1]
    )
    assert res.info["excluded"] == [{"client_id": 2, "reason": "update contains NaN/Inf"}]
    assert seen[-1] == ("UpdatesShape", 3, D, torch.float32, torch.device("cpu"))
    Look().aggregate(x, U[[0, 1, 3]], [1, 1, 1])
    assert seen[-1] == ("Tensor", 3, D, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("name", ["fedavg", "kuramoto"])
def test_float64_source_excludes_like_a_tensor(name):
    """float64: a flagged row is confirmed on the tensor path (a Gram diagonal may overflow); on a source
    the flags come from an exact screen and the flagged row is dropped all the same."""
    U = torch.randn(4, D, dtype=torch.float64)
    U[1, 3] = float("inf")
    x = torch.randn(D, dtype=torch.float64)
    a = algorithms.build(name, on_bad_update="exclude").aggregate(x, U, [1, 2, 3, 4])
    b = algorithms.build(name, on_bad_update="exclude").aggregate(x, ChunkedUpdates(U, chunk_cols=50), [1, 2, 3, 4])
    assert a.info["excluded"] == b.info["excluded"] == [{"client_id": 1, "reason": "update contains NaN/Inf"}]
    _close(b.params, a.params, name not in GRAM_BASED, name)


class _Watching(TensorSource):
    """A source that records, each time the consumer asks for the next block, what ``out`` holds in the
    columns of the block it just finished (the out= pass writes a chunk as it is summed)."""

    def __init__(self, U, out):
        super().__init__(U)
        self.out, self.seen = out, []

    def _blocks(self, chunk_cols):
        for a, b, blk in super()._blocks(chunk_cols):
            yield a, b, blk
            self.seen.append((a, b, self.out[a:b].clone()))


@pytest.mark.parametrize(
    "name,opts",
    [
        ("fedavg", {}),
        ("kuramoto", {}),
        ("kuramoto", {"mode": "C"}),
        ("scaffold", {}),
        ("fedaware", {"warmup": "startup_full", "elud": False}),
        ("fedaware", {"variant": "na", "warmup": "mask"}),
    ],
)
def test_out_is_written_chunk_by_chunk_in_the_result_pass(name, opts):
    """aggregate(..., out=buf) on a source: params is buf, the same bits as without out, and each chunk of
    buf holds its final value as soon as the pass moved past it (not copied in at the end)."""
    (ref, got), x = _pair(name, opts)
    g = torch.Generator().manual_seed(5)
    for r, ids in enumerate(ROUNDS[:2]):
        K = len(ids)
        U = torch.randn(K, D, generator=g) * 1e-2
        n = [float(3 + k) for k in range(K)]
        pl = _payloads(ref, K, g)
        a = ref.aggregate(x, ChunkedUpdates(U, chunk_cols=100), n, ids, [dict(p) for p in pl])
        buf = torch.full((D,), float("nan"))
        src = _Watching(U, buf)
        b = got.aggregate(x, ChunkedUpdates(src, chunk_cols=100), n, ids, [dict(p) for p in pl], out=buf)
        assert b.params is buf and torch.equal(buf, a.params), f"{name} round {r}"
        if name != "fedaware" and opts.get("mode") != "C":  # (FedAWARE: its table's sum after the pass;
            last = {(a_, b_): v for a_, b_, v in src.seen}  # Kuramoto C: x + sum, then + the sync term)
            assert len(last) == 11 and all(torch.equal(v, a.params[a_:b_]) for (a_, b_), v in last.items())
        x = a.params


def test_out_of_a_tensor_round_and_a_skipped_round_and_bad_outs():
    x = torch.randn(D)
    U = torch.randn(3, D)
    ref = algorithms.build("fedavg").aggregate(x, U, [1, 2, 3]).params
    buf = torch.empty(D)
    assert algorithms.build("fedavg").aggregate(x, U, [1, 2, 3], out=buf).params is buf and torch.equal(buf, ref)
    U[:, 5] = float("nan")  # every client excluded: the round is skipped, out = global
    res = algorithms.build("fedavg", on_bad_update="exclude").aggregate(
        x, ChunkedUpdates(U, chunk_cols=100), [1, 2, 3], out=buf
    )
    assert res.info["skipped"] and res.params is buf and torch.equal(buf, x)
    agg = algorithms.build("fedavg")
    for bad, msg in (
        (
            torch.empty(D, dtype=torch.float64),
            r"out must be a contiguous \[d=1012\] tensor of "
            r"global_flat's dtype torch.float32 on cpu, got shape \(1012,\) torch.float64",
        ),
        (torch.empty(2 * D)[::2], r"\(not contiguous\)"),
        (x, r"out shares memory with global_flat"),
        ("m.bin", r"out must be a \[d\] tensor or None"),
    ):
        with pytest.raises(ValueError, match=msg):
            agg.aggregate(x, TensorSource(U), [1, 2, 3], out=bad)
    assert agg.round == 0


def _fedaware_rounds(agg, x, rounds, seed=6):
    g = torch.Generator().manual_seed(seed)
    res = []
    for ids in rounds:
        U = torch.randn(len(ids), D, generator=g) * 1e-2 + 1e-2 * torch.randn(D, generator=g)
        res.append(agg.aggregate(x, ChunkedUpdates(U, chunk_cols=100), [2.0] * len(ids), ids).params)
        x = res[-1]
    return res


def test_fedaware_momentum_file_is_the_in_memory_table_and_checkpoints_as_a_reference(tmp_path):
    path = tmp_path / "M.bin"
    opts = dict(num_clients=N, warmup="startup_full")
    mem, disk = algorithms.build("fedaware", **opts), algorithms.build("fedaware", momentum_file=str(path), **opts)
    x = torch.randn(D)
    for a, b in zip(_fedaware_rounds(mem, x, ROUNDS[:2]), _fedaware_rounds(disk, x, ROUNDS[:2])):
        assert torch.equal(a, b)  # the same code on another storage: the same bits
    assert torch.equal(disk.M, mem.M) and path.stat().st_size == N * D * 4
    assert torch.equal(torch.from_file(str(path), size=N * D).view(N, D), mem.M)  # the table is the file
    st = disk.state_dict()
    assert st["M"] == {"file": str(path), "shape": [N, D], "dtype": "float32", "version": 2}
    torch.save(st, tmp_path / "ck.pt")
    st = torch.load(tmp_path / "ck.pt", weights_only=True)
    again = algorithms.build("fedaware", **opts)  # (a file table is adopted from the state)
    again.load_state_dict(st)
    y = torch.randn(D)
    assert torch.equal(_fedaware_rounds(again, y, ROUNDS[2:])[0], _fedaware_rounds(mem, y, ROUNDS[2:])[0])
    with pytest.raises(
        ValueError,
        match=r"momentum_file .*M\.bin' is at version 3 \(done\), the state expects "
        r"version 2 \(done\): the table changed after this state was saved",
    ):
        algorithms.build("fedaware", **opts).load_state_dict(st)
    with pytest.raises(ValueError, match=r"fedaware: momentum_file .*M\.bin' already exists: remove it, or load"):
        _fedaware_rounds(algorithms.build("fedaware", momentum_file=str(path), **opts), x, ROUNDS[:1])
    mem_st = mem.state_dict()  # an in-memory table into a new file
    other = algorithms.build("fedaware", momentum_file=str(tmp_path / "M2.bin"), **opts)
    other.load_state_dict(mem_st)
    assert torch.equal(torch.from_file(str(tmp_path / "M2.bin"), size=N * D).view(N, D), mem.M)


@pytest.mark.parametrize(
    "value,msg",
    [
        ("{tmp}/nope/M.bin", r"^fedaware: momentum_file '.*/nope/M\.bin': folder '.*/nope' does not exist$"),
        ("{tmp}", r"^fedaware: momentum_file '.*' is a folder, expected a file path$"),
        ("", r"^fedaware: momentum_file must be a file path or None, got ''$"),
        (3, r"momentum_file"),
    ],
)
def test_fedaware_bad_momentum_file_is_refused_in_one_line(tmp_path, value, msg):
    v = value.format(tmp=tmp_path) if isinstance(value, str) else value
    with pytest.raises(ValueError, match=msg) as e:
        algorithms.build("fedaware", num_clients=4, momentum_file=v)
    assert "\n" not in str(e.value)
    with pytest.raises(
        ValueError,
        match=r"^fedaware: momentum_file keeps the table in a host mapping of the file, "
        r"so momentum_device must be None or 'cpu', got 'meta'$",
    ):
        algorithms.build("fedaware", num_clients=4, momentum_file=str(tmp_path / "M"), momentum_device="meta")


class _Failing(TensorSource):
    """Raises OSError when block ``at`` of pass ``on_pass`` (0-based) is read, like a disk read error."""

    def __init__(self, U, on_pass, at):
        super().__init__(U)
        self.on_pass, self.at, self.passes = on_pass, at, -1

    def _blocks(self, chunk_cols):
        self.passes += 1
        for a, b, blk in super()._blocks(chunk_cols):
            if self.passes == self.on_pass and a == self.at:
                raise OSError("simulated read error")
            yield a, b, blk


def test_fedaware_failed_momentum_pass_is_named_and_refuses_to_go_on(tmp_path):
    """A read error in the momentum pass (pass 1 after the screening pass, elud=False): before the first
    write, M is as it was and the aggregator goes on; after it, the torn table is named (columns, clients),
    the marker says 'updating', and further rounds, state_dict and loading that file are refused."""
    path = str(tmp_path / "M.bin")
    agg = algorithms.build("fedaware", num_clients=N, warmup="startup_full", elud=False, momentum_file=path)
    x = torch.randn(D)
    U = torch.randn(3, D) * 1e-2
    with pytest.raises(OSError, match="simulated read error"):
        agg.aggregate(x, ChunkedUpdates(_Failing(U, 1, 0), chunk_cols=100), [1, 1, 1], [0, 2, 5])
    assert not bool(agg.M.any()) and agg.round == 0 and open(path + ".state").read() == "0 done\n"
    st = agg.state_dict()
    ok = agg.aggregate(x, ChunkedUpdates(U, chunk_cols=100), [1, 1, 1], [0, 2, 5])  # goes on
    assert bool(agg.M.any()) and open(path + ".state").read() == "1 done\n" and ok.info["num_clients"] == 3
    with pytest.raises(
        RuntimeError,
        match=r"momentum update of round 1 failed at column 500 of d=1012 \(OSError: simulated "
        r"read error\): .* clients \[1, 2, 3\] hold the new momenta in columns "
        r"0\.\.499, the old ones from column 500 on; this aggregator refuses",
    ):
        agg.aggregate(x, ChunkedUpdates(_Failing(U, 1, 500), chunk_cols=100), [1, 1, 1], [1, 2, 3])
    assert open(path + ".state").read() == "2 updating\n"
    with pytest.raises(RuntimeError, match="refuses further rounds"):
        agg.aggregate(x, ChunkedUpdates(U, chunk_cols=100), [1, 1, 1], [0, 2, 5])
    with pytest.raises(RuntimeError, match="refuses further rounds"):
        agg.state_dict()
    with pytest.raises(ValueError, match=r"is at version 2 \(updating\), the state expects version 0"):
        algorithms.build("fedaware", num_clients=N).load_state_dict(st)


@pytest.mark.parametrize("name", ["scaffold", "fedpvr"])
def test_control_variates_on_the_host_or_in_a_file_are_the_in_memory_tables(tmp_path, name):
    """control_device='cpu' and control_file=PATH: the same params, c and c_i (bit for bit) over 3 rounds
    on a source; a file table checkpoints as a reference and continues from it."""
    path = tmp_path / "C.bin"
    x = torch.randn(D, generator=torch.Generator().manual_seed(1))
    aggs = [algorithms.build(name, **o) for o in ({}, {"control_device": "cpu"}, {"control_file": str(path)})]
    for a in aggs:
        a.setup(SPEC, num_clients=N, global_flat=x)
    g = torch.Generator().manual_seed(7)
    xs = [x] * 3
    for r, ids in enumerate(ROUNDS):
        K = len(ids)
        U = torch.randn(K, D, generator=g) * 1e-2
        pl = _payloads(aggs[0], K, g)
        res = [
            a.aggregate(xi, ChunkedUpdates(U, chunk_cols=100), [1.0] * K, ids, [dict(p) for p in pl]).params
            for a, xi in zip(aggs, xs)
        ]
        assert all(torch.equal(res[0], v) for v in res[1:]), f"{name} round {r}"
        xs = res
        if r == 0:
            st = aggs[2].state_dict()
    ref = aggs[0]
    for a in aggs[1:]:
        assert torch.equal(a.c, ref.c) and torch.equal(a.c_table, ref.c_table)
        assert torch.equal(a.client_payload(5)["c_i"], ref.client_payload(5)["c_i"])
    assert torch.equal(torch.from_file(str(path), size=N * ref.d_c).view(N, ref.d_c), ref.c_table)
    assert st["c_table"] == {"file": str(path), "shape": [N, ref.d_c], "dtype": "float32", "version": 1}
    with pytest.raises(
        ValueError, match=r"control_file .*C\.bin' is at version 3 \(done\), the state expects version 1"
    ):
        algorithms.build(name).load_state_dict(st)
    torch.save(aggs[2].state_dict(), tmp_path / "ck.pt")
    again = algorithms.build(name)
    again.setup(SPEC, num_clients=N)
    again.load_state_dict(torch.load(tmp_path / "ck.pt", weights_only=True))
    assert again.c_table.data_ptr() != aggs[2].c_table.data_ptr() and torch.equal(again.c_table, ref.c_table)
    U = torch.randn(3, D, generator=g) * 1e-2
    pl = _payloads(ref, 3, g)
    a = ref.aggregate(xs[0], U, [1.0] * 3, [1, 4, 6], [dict(p) for p in pl])
    b = again.aggregate(xs[0], ChunkedUpdates(U, chunk_cols=100), [1.0] * 3, [1, 4, 6], [dict(p) for p in pl])
    assert torch.equal(a.params, b.params) and torch.equal(ref.c_table, again.c_table)
    assert open(f"{path}.state").read() == "4 done\n"


def test_bad_control_table_options_are_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"^scaffold: control_file '.*/nope/C\.bin': folder '.*/nope' does not exist$"):
        algorithms.build("scaffold", control_file=str(tmp_path / "nope" / "C.bin"))
    with pytest.raises(
        ValueError,
        match=r"^scaffold: control_file keeps the table in a host mapping of the file, so "
        r"control_device must be None or 'cpu', got 'meta'$",
    ):
        algorithms.build("scaffold", control_file=str(tmp_path / "C.bin"), control_device="meta")
    with pytest.raises(
        ValueError,
        match=r"^scaffold: control_device must be a device \(e\.g\. 'cpu'\) or None, "
        r"got 'gpu0'$",
    ):
        algorithms.build("scaffold", control_device="gpu0")
    agg = algorithms.build("scaffold", control_file=str(tmp_path / "C.bin"))
    with pytest.raises(ValueError, match=r"^scaffold: needs the number of clients N for its control_file table"):
        agg.aggregate(torch.zeros(D), torch.zeros(2, D), [1, 1], [0, 1], [{"delta_c": torch.zeros(D)}] * 2)
    assert agg.round == 0 and not os.path.exists(tmp_path / "C.bin")


def test_control_file_payload_rows_can_go_to_worker_processes(tmp_path):
    """client_payload copies a file table's row out: torch shares a mapped file's storage by descriptor,
    which a worker queue cannot send (the simulator's workers=N)."""
    from multiprocessing.reduction import ForkingPickler

    agg = algorithms.build("scaffold", num_clients=4, control_file=str(tmp_path / "C.bin"))
    agg.setup(None, num_clients=4, global_flat=torch.zeros(D))
    pl = agg.client_payload(3)
    assert torch.equal(pl["c_i"], agg.c_table[3])
    ForkingPickler.dumps(pl["c_i"])
