"""fedkernels.compress: the codecs' encodings (bounds from their definitions), error feedback, QSGD's seeded
unbiased rounding, the server's round on compressed rows against the same method on the decoded rows, the
refusal of methods that need more than weighted sums, and the simulator's compress section through the CLI."""

import json
import os
import sys

import pytest
import torch

from fedkernels import algorithms, compress

import cli_process  # tests/cli_process.py: the command in a child forked from a pre-imported interpreter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _U(K=5, d=1003, seed=0):
    return torch.randn(K, d, generator=torch.Generator().manual_seed(seed)) * 0.01


@pytest.mark.parametrize(
    "kind,opts,bound", [("int8_block", {"block": 100}, 0.5 / 127), ("fp8", {"block": 64}, 2.0**-4)]
)
def test_block_codecs_error_within_their_rounding(kind, opts, bound):
    """int8: |x - D(C(x))| <= scale / 2 = absmax / 254 per block; e4m3: 3 mantissa bits, half an ulp <= 2^-4 |x|
    above the subnormals (absmax / 448 * 2^-9 below them)."""
    U = _U()
    c = compress.make_codec(kind, U.size(1), **opts)
    rows = c.encode_rows(U, list(range(5)), 0)
    D = rows.dense()
    B = opts["block"]
    for b in range(0, U.size(1), B):
        x, y = U[:, b : b + B], D[:, b : b + B]
        amax = x.abs().amax(1, keepdim=True)
        lim = amax * bound if kind == "int8_block" else torch.maximum(x.abs() * bound, amax / 448 * 2.0**-9)
        assert torch.all((x - y).abs() <= lim * (1 + 1e-6) + 1e-12)
    assert rows.nbytes() == [U.size(1) + 4 * -(-U.size(1) // B)] * 5 == [c.row_bytes()] * 5


def test_topk_keeps_the_largest_entries_sorted():
    U = _U(3, 500)
    rows = compress.make_codec("topk", 500, k=20).encode_rows(U, [7, 8, 9], 0)
    o = rows.offsets.tolist()
    for r in range(3):
        idx = rows.idx[o[r] : o[r + 1]].long()
        assert torch.equal(idx, torch.sort(torch.topk(U[r].abs(), 20).indices).values)
        assert torch.equal(rows.val[o[r] : o[r + 1]], U[r, idx])
    assert rows.nbytes() == [160] * 3


def test_qsgd_is_seeded_and_unbiased():
    U = _U(2, 300)
    c = compress.make_codec("qsgd", 300, levels=4, block=100, seed=3)
    a, b = c.encode_rows(U, [0, 1], 5), c.encode_rows(U, [0, 1], 5)
    assert torch.equal(a.Q, b.Q) and torch.equal(a.scales, b.scales)  # same (seed, round, client): same bits
    assert not torch.equal(a.Q, c.encode_rows(U, [0, 1], 6).Q)
    # unbiased: the mean over many rounds approaches U (each entry's variance <= (norm / s)^2 / 4)
    mean = sum(c.encode_rows(U, [0, 1], r).dense() for r in range(400)) / 400
    norm = U.view(2, 3, 100).norm(dim=2).repeat_interleave(100, dim=1)
    assert torch.all((mean - U).abs() <= 5 * norm / 4 / 2 / 20 + 1e-9)  # 5 sd of the 400-round mean
    lv = a.Q.abs().max()
    assert lv <= 4


def test_error_feedback_carries_what_was_dropped():
    U = _U(2, 200)
    c = compress.make_codec("topk", 200, k=10, error_feedback=True)
    r1 = c.encode_rows(U, [4, 9], 0)
    assert torch.allclose(c.residuals[4] + r1.dense()[0], U[0], atol=0, rtol=0)
    r2 = c.encode_rows(U, [4, 9], 1)  # the second round compresses U + residual
    V = U[0] + (U[0] - r1.dense()[0])
    assert torch.equal(r2.idx[:10].long(), torch.sort(torch.topk(V.abs(), 10).indices).values)
    c.load_state_dict(c.state_dict())
    assert set(c.residuals) == {4, 9}


@pytest.mark.parametrize("method", ["fedavg", "fedavgm", "fedprox", "fednova"])
@pytest.mark.parametrize(
    "kind,opts", [("int8_block", {"block": 77}), ("fp8", {}), ("qsgd", {"levels": 8}), ("topk", {"ratio": 0.05})]
)
def test_server_round_equals_the_method_on_decoded_rows(method, kind, opts):
    """The compressed round and the method on the dense decoded rows differ only by the fp32 rounding of the two
    sums (the codes' weights rounded once, summation order): a bound from the arithmetic, far below the update."""
    K, d = 6, 2001
    U, g = _U(K, d), torch.randn(d)
    n, ids = [5, 10, 3, 8, 2, 7], [3, 1, 4, 0, 9, 2]
    payloads = (
        [{"local_steps": 3 + k} for k in range(K)]
        if method == "fednova"
        else [{"prox_mu": 0.01}] * K
        if method == "fedprox"
        else None
    )
    rows = compress.make_codec(kind, d, **opts).encode_rows(U, ids, 0)
    opts = {"mu": 0.01} if method == "fedprox" else {}
    a, b = algorithms.build(method, **opts), algorithms.build(method, **opts)
    for r in range(2):  # twice: server state (momentum) advances alike
        got = compress.aggregate_compressed(a, g, rows, n, ids, payloads, kind=kind)
        want = b.aggregate(g, rows.dense(), n, ids, payloads)
        tol = 64 * torch.finfo(torch.float32).eps * (g.abs() + 4 * rows.dense().abs().sum(0))
        assert torch.all((got.params - want.params).abs() <= tol)
        assert got.info["num_clients"] == K and a.round == b.round == r + 1


def test_bad_compressed_rows_are_excluded_or_raise():
    U = _U(4, 300)
    rows = compress.make_codec("int8_block", 300, block=50).encode_rows(U, [0, 1, 2, 3], 0)
    rows.scales[2, 1] = float("nan")
    g = torch.zeros(300)
    with pytest.raises(ValueError, match=r"fedavg.aggregate: client 2 \(row 2\): compressed update contains NaN/Inf"):
        compress.aggregate_compressed(algorithms.build("fedavg"), g, rows, [1] * 4, [0, 1, 2, 3])
    res = compress.aggregate_compressed(
        algorithms.build("fedavg", on_bad_update="exclude"), g, rows, [1] * 4, [0, 1, 2, 3]
    )
    assert [e["client_id"] for e in res.info["excluded"]] == [2] and res.info["num_clients"] == 3
    want = rows.select([0, 1, 3]).dense().mean(0)
    assert torch.allclose(res.params, want, rtol=0, atol=1e-7)


def test_methods_that_need_more_than_weighted_sums_are_refused():
    rows = compress.make_codec("fp8", 100).encode_rows(_U(2, 100), [0, 1], 0)
    for name, what in (("kuramoto", "ops.kstats"), ("fedaware", "Gram matrix"), ("fedecado", "backward-Euler")):
        with pytest.raises(ValueError, match=f"compress.kind=fp8: method '{name}' needs .*{what}") as e:
            compress.aggregate_compressed(algorithms.build(name), torch.zeros(100), rows, [1, 1], [0, 1], kind="fp8")
        assert "\n" not in str(e.value)


def test_each_method_declares_whether_it_composes_with_a_codec():
    """Composability is the method's declaration (reads_beyond_weighted_sum), not a list in compress: a method
    defined here runs on packed rows when it declares None and is refused otherwise; a wrapper answers for
    itself (norm bounding reads the norms) or for the method inside it (a server optimiser's step)."""
    from fedkernels.algorithms.base import _REGISTRY
    from fedkernels.algorithms.fedavg import FedAvg

    assert compress.weighted_sum_methods() == sorted(
        n for n, c in _REGISTRY.items() if c.reads_beyond_weighted_sum is None
    )
    assert {"fedavg", "fedprox", "fedavgm", "fednova", "scaffold", "fedpvr"} <= set(compress.weighted_sum_methods())
    assert not {"kuramoto", "fedaware", "fedecado", "median", "krum"} & set(compress.weighted_sum_methods())

    class Halved(FedAvg):  # a weighted-sum method of a user's own, unregistered: nothing in compress names it
        name = "halved"

        def _aggregate(self, rin):
            return algorithms.AggResult(rin.weighted_sum(self.weights(rin), base=rin.global_flat, alpha=0.5), {})

    class Undeclared(Halved):
        reads_beyond_weighted_sum = "more of the updates than a weighted sum"

    K, d = 3, 500
    U, g, n, ids = _U(K, d), torch.randn(d), [2, 3, 5], [0, 1, 2]
    rows = compress.make_codec("int8_block", d, block=50).encode_rows(U, ids, 0)
    got = compress.aggregate_compressed(Halved(), g, rows, n, ids, kind="int8_block")
    want = Halved().aggregate(g, rows.dense(), n, ids).params  # the same method on the decoded rows
    assert torch.all(
        (got.params - want).abs() <= 64 * torch.finfo(torch.float32).eps * (g.abs() + rows.dense().abs().sum(0))
    )
    with pytest.raises(ValueError, match=r"^compress.kind=int8_block: method 'halved' needs more of the updates"):
        compress.aggregate_compressed(Undeclared(), g, rows, n, ids, kind="int8_block")
    with pytest.raises(
        ValueError, match=r"^compress.kind=fp8: method 'fedavg' with norm_bound needs each update's norm"
    ):
        compress.check_method(algorithms.build("fedavg", norm_bound=1.0), "fp8")
    # a server optimiser after fedavg: its step on fedavg's compressed round, bit for bit
    wrapped = algorithms.build("fedavg", server_opt="adam")
    got = compress.aggregate_compressed(wrapped, g, rows, n, ids, kind="int8_block")
    plain = compress.aggregate_compressed(algorithms.build("fedavg"), g, rows, n, ids, kind="int8_block")
    step = algorithms.build("fedavg", server_opt="adam").opt.step_(g, plain.params.clone(), 0, from_model=True)
    assert torch.equal(got.params, step)


@pytest.mark.parametrize(
    "kwargs,msg",
    [
        (dict(kind="zip"), "compress.kind: expected one of int8_block, fp8, topk, qsgd, got 'zip'"),
        (dict(kind="int8_block", block=0), r"compress.block: expected an int in \[1, d = 100\]"),
        (dict(kind="fp8", block=101), r"compress.block: expected an int in \[1, d = 100\]"),
        (dict(kind="topk", k=0), r"compress.k: expected an int in \[1, d = 100\], got 0"),
        (dict(kind="topk", k=101), r"compress.k: expected an int in \[1, d = 100\], got 101"),
        (dict(kind="topk"), "topk needs exactly one of them"),
        (dict(kind="topk", ratio=1.5), r"compress.ratio: expected a number in \(0, 1\]"),
        (dict(kind="topk", k=5, block=4), "topk has no blocks"),
        (dict(kind="qsgd", levels=0), r"compress.levels: expected an int in \[1, 127\]"),
        (dict(kind="qsgd", levels=128), r"compress.levels: expected an int in \[1, 127\]"),
        (dict(kind="int8_block", k=3), "only topk keeps k entries"),
    ],
)
def test_codec_options_one_line_errors(kwargs, msg):
    with pytest.raises(ValueError, match=msg) as e:
        compress.make_codec(d=100, **kwargs)
    assert "\n" not in str(e.value)


def _cli(tmp_path, *args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return cli_process.run(
        [
            sys.executable,
            "-m",
            "fedkernels.sim.cli",
            "run",
            "--preset",
            "smoke",
            f"out_dir={tmp_path}",
            "rounds=2",
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_cli_compressed_run_records_bytes_sent(tmp_path):
    p = _cli(tmp_path, "compress.kind=topk", "compress.ratio=0.1", "compress.error_feedback=true")
    assert p.returncode == 0, p.stderr
    run = next(d for d in os.listdir(tmp_path) if d.startswith("smoke"))
    ms = [json.loads(x) for x in open(os.path.join(tmp_path, run, "metrics.jsonl"))]
    d = ms[0]["bytes_dense"] // (4 * ms[0]["num_updates"])
    k = round(0.1 * d)
    assert [m["bytes_sent"] for m in ms] == [m["num_updates"] * 8 * k for m in ms]
    assert ms[0]["agg"]["codec"] == f"topk(k={k}, error_feedback=on)"


@pytest.mark.parametrize(
    "args,msg",
    [
        (["compress.kind=int8_block", "compress.block=0"], "compress.block must be >= 1, got 0"),
        (["compress.kind=int8_block", "compress.block=100000000"], r"compress.block: expected an int in \[1, d = "),
        (["compress.kind=topk", "compress.k=0"], "compress.k must be >= 1, got 0"),
        (["compress.kind=topk", "compress.k=100000000"], r"compress.k: expected an int in \[1, d = "),
        (["compress.kind=qsgd", "compress.levels=0"], r"compress.levels must be in \[1, 127\]"),
        (["compress.kind=gzip"], "compress.kind must be none|int8_block|fp8|topk|qsgd, got 'gzip'"),
        (["compress.ratio=0.1"], "compress.ratio is set but compress.kind is none"),
        (["compress.kind=fp8", "algorithm.name=kuramoto"], "method 'kuramoto' needs"),
        (
            ["compress.kind=topk", "compress.k=5", "compress.residual_file=r.f32"],
            "compress.residual_file is set ('r.f32') but compress.error_feedback is false",
        ),
        (
            [
                "compress.kind=topk",
                "compress.k=5",
                "compress.error_feedback=true",
                "compress.residual_file=/no/dir/r.f32",
            ],
            "compress: residual_file '/no/dir/r.f32': folder '/no/dir' does not exist",
        ),
    ],
)
def test_cli_bad_compress_options_exit_2_and_write_nothing(tmp_path, args, msg):
    p = _cli(tmp_path, *args)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert msg in p.stderr or __import__("re").search(msg, p.stderr), p.stderr
    assert len([x for x in p.stderr.strip().splitlines() if x.strip()]) == 1
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("kind", ["int8_block", "fp8"])
def test_block_code_file_round_equals_in_memory_bit_for_bit(tmp_path, kind):
    """sources.BlockCodeFile: the codes read from disk in column blocks, each block summed by the same op: every
    output element is the same fma chain as in memory (rows in order), so the same bits; rows dropped by select."""
    from fedkernels.sources import BlockCodeFile

    K, d, B = 5, 70001, 128
    rows = compress.make_codec(kind, d, block=B).encode_rows(_U(K, d), list(range(K)), 0)
    rows.Q.view(torch.uint8).numpy().tofile(tmp_path / "q.bin")
    rows.scales.numpy().tofile(tmp_path / "s.bin")
    f = BlockCodeFile(tmp_path / "q.bin", tmp_path / "s.bin", K, d, B, dtype=rows.Q.dtype)
    f.chunk_cols = lambda: 4 * B  # many blocks
    g, n = torch.randn(d), [1, 2, 3, 4, 5]
    for method in ("fedavg", "fedavgm"):
        a = compress.aggregate_compressed(algorithms.build(method), g, f, n, list(range(K)))
        b = compress.aggregate_compressed(algorithms.build(method), g, rows, n, list(range(K)))
        assert torch.equal(a.params, b.params)
    sub = f.select([4, 0, 2])
    want = rows.select([4, 0, 2]).weighted_sum([0.5, 0.25, 1.0])
    got = sub.weighted_sum([0.5, 0.25, 1.0])
    assert torch.equal(got[0], want[0]) and got[1].tolist() == [True] * 3
    with pytest.raises(ValueError, match=r"BlockCodeFile: scales file .* must hold K x ceil\(d / block\) = 5 x 547"):
        BlockCodeFile(tmp_path / "q.bin", tmp_path / "q.bin", K, d, B)
    with pytest.raises(ValueError, match="RawFileSource: .* has 350005 bytes, expected exactly"):
        BlockCodeFile(tmp_path / "q.bin", tmp_path / "s.bin", K - 1, d, B)


@pytest.mark.parametrize("kind", ["int8_block", "fp8"])
def test_tiny_blocks_encode_without_nan(kind):
    """A block whose absmax / qmax is subnormal: its inverse would overflow (0 * inf = NaN codes); the codecs divide."""
    U = torch.zeros(2, 64)
    U[0, :32] = 1e-44
    U[1] = torch.randn(64)
    rows = compress.make_codec(kind, 64, block=32).encode_rows(U, [0, 1], 0)
    out, ok = rows.weighted_sum([1.0, 1.0])
    assert ok.tolist() == [True, True] and torch.isfinite(out).all()


def test_a_nan_update_leaves_no_residual():
    U = _U(2, 100)
    c = compress.make_codec("topk", 100, k=5, error_feedback=True)
    c.encode_rows(U, [0, 1], 0)
    U[1, 3] = float("nan")
    c.encode_rows(U, [0, 1], 1)
    assert set(c.residuals) == {0}  # client 1's NaN is not carried into its next round


# ---- compressed rows as one of the round runner's input forms -------------------------------------------------
KINDS_OPTS = [("int8_block", {"block": 77}), ("fp8", {}), ("qsgd", {"levels": 8}), ("topk", {"ratio": 0.05})]


@pytest.mark.parametrize("kind,opts", KINDS_OPTS)
@pytest.mark.parametrize("gdt", [torch.float32, torch.float64])
def test_runner_takes_compressed_rows_and_reruns_without_bad_rows(kind, opts, gdt):
    """agg.aggregate(g, rows) is the round runner's round on packed rows: a bad row under exclude is dropped before
    any state changes (FedAvgM's momentum is not touched by the aborted pass), so the round and the next equal a
    fresh run on the good rows alone, bit for bit; under raise the runner names the client and row."""
    K, d = 5, 1500
    ids, n = [8, 2, 5, 0, 3], [4.0, 1.0, 7.0, 2.0, 5.0]
    rows = compress.make_codec(kind, d, **opts).encode_rows(_U(K, d), ids, 0)
    bad = rows.select(range(K))
    if kind == "topk":
        bad.val[bad.offsets[2]] = float("inf")
    else:
        bad.scales[2, 0] = float("nan")
    good = [0, 1, 3, 4]
    g = torch.randn(d, generator=torch.Generator().manual_seed(1)).to(gdt)
    a = algorithms.build("fedavgm", on_bad_update="exclude", server_lr=0.7)
    b = algorithms.build("fedavgm", server_lr=0.7)
    for _ in range(2):
        got = a.aggregate(g, bad, n, ids)
        want = b.aggregate(g, rows.select(good), [n[k] for k in good], [ids[k] for k in good])
        assert torch.isfinite(got.params).all() and torch.equal(got.params, want.params)
        assert got.info["excluded"] == [{"client_id": 5, "reason": "compressed update contains NaN/Inf"}]
        assert got.info["num_clients"] == 4 and a.round == b.round
    with pytest.raises(ValueError, match=r"fedavgm.aggregate: client 5 \(row 2\): compressed update contains NaN/Inf"):
        algorithms.build("fedavgm").aggregate(g, bad, n, ids)
    # the library entry point is the same round
    c = algorithms.build("fedavgm", on_bad_update="exclude", server_lr=0.7)
    assert torch.equal(
        compress.aggregate_compressed(c, g, bad, n, ids, kind=kind).params,
        algorithms.build("fedavgm", on_bad_update="exclude", server_lr=0.7).aggregate(g, bad, n, ids).params,
    )


def test_runner_refuses_other_reads_of_compressed_rows_in_one_line():
    rows = compress.make_codec("int8_block", 100).encode_rows(_U(3, 100), [0, 1, 2], 0)
    for name, what in (
        ("kuramoto", "per-row statistics"),
        ("fedaware", "the Gram matrix"),
        ("krum", "the Gram matrix"),
    ):
        with pytest.raises(ValueError, match=f"{name}: compressed rows: this method reads {what}") as e:
            algorithms.build(name, **({"num_clients": 3} if name == "fedaware" else {})).aggregate(
                torch.zeros(100), rows, [1, 1, 1], [0, 1, 2]
            )
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"fedavg.aggregate: the compressed rows have d=100 columns, expected d=99"):
        algorithms.build("fedavg").aggregate(torch.zeros(99), rows, [1, 1, 1], [0, 1, 2])


class _BN(torch.nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 8, 3, padding=1, bias=False)
        self.norm = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8 * 8 * 8, num_classes)

    def forward(self, x):
        return self.fc(torch.relu(self.norm(self.conv(x))).flatten(1))


@pytest.mark.parametrize("kind,opts", KINDS_OPTS)
def test_buffers_sent_beside_the_codes_average_as_dense_rows(kind, opts):
    """A BatchNorm model's buffers sent uncompressed beside the codes: the buffer columns of the new model are the
    dense path's buffer average bit for bit (whatever FedAvgM's momentum does to the parameters); without them the
    buffers are the sample-weighted average of the decoded buffer columns."""
    from fedkernels.algorithms.buffers import buffer_ranges
    from fedkernels.flat import FlatSpec

    spec = FlatSpec.from_module(_BN())
    ((a, b),) = buffer_ranges(spec)
    K, d = 4, spec.d
    U = _U(K, d, seed=3)
    ids, n = [0, 1, 2, 3], [3.0, 9.0, 1.0, 6.0]
    g = spec.flatten(_BN()).clone()
    rows = compress.make_codec(kind, d, **opts).encode_rows(U, ids, 0)

    def agg():
        m = algorithms.build("fedavgm", server_lr=1.5)
        m.setup(spec, K, g)
        return m

    dense, side, dec = agg(), agg(), agg()
    for _ in range(2):  # the second round: momentum is non-zero
        want = dense.aggregate(g, U, n, ids).params
        got = side.aggregate(g, rows.with_dense_columns([(a, b)], U[:, a:b]), n, ids).params
        assert torch.equal(got[a:b], want[a:b])
        got2 = dec.aggregate(g, rows, n, ids).params
        p = torch.tensor(n, dtype=torch.float64) / sum(n)
        assert torch.equal(
            got2[a:b], __import__("fedkernels").ops.weighted_sum(rows.dense()[:, a:b].contiguous(), p, base=g[a:b])
        )
        assert torch.equal(got[:a], got2[:a])  # the parameters: the codes' round either way
    assert set(rows.with_dense_columns([(a, b)], U[:, a:b]).select([2, 0]).dense_columns([(a, b)]).tolist()[0]) == set(
        U[2, a:b].tolist()
    )


@pytest.mark.parametrize(
    "kind,opts",
    [
        ("int8_block", ["compress.block=64"]),
        ("fp8", []),
        ("qsgd", []),
        ("topk", ["compress.ratio=0.05", "compress.error_feedback=true"]),
    ],
)
def test_batchnorm_model_under_each_codec_keeps_running_var_valid(kind, opts):
    """A simulated BatchNorm model trained 3 rounds with FedAvgM (server momentum, which alone drives a running
    variance negative) under each codec: every running variance >= 0, finite losses, and the bytes sent count the
    buffers sent beside the codes."""
    import numpy as np
    from test_buffers import _run  # its BatchNorm model, data and hetero settings

    s = _run("fedavgm", f"compress.kind={kind}", *opts)
    assert len(s.metrics) == 3
    for m in s.metrics:
        assert np.isfinite(m["test_loss"]) and np.isfinite(m["accuracy"]), (kind, m["round"], m["test_loss"])
        assert m["bytes_sent"] == m["num_updates"] * (s.compression.codec.row_bytes() + 16 * 4)
    s.global_model()
    bn = s.model.norm
    assert torch.isfinite(bn.running_mean).all() and bool((bn.running_var >= 0).all()), bn.running_var


# ---- error-feedback residuals in a per-client file table -------------------------------------------------------
def test_residual_file_keeps_the_same_numbers_as_memory_and_checkpoints_by_reference(tmp_path):
    """topk with error feedback: residuals in a file table give the same rows, bit for bit, as in memory (a NaN
    client's residual dropped in both); state_dict references the file (no N x d copy) and load_state_dict reopens
    it at the state's version, refusing a table that moved on since."""
    from fedkernels.algorithms import tables

    d, N = 300, 6
    path = str(tmp_path / "res.f32")
    mem = compress.make_codec("topk", d, k=7, error_feedback=True)
    fil = compress.make_codec("topk", d, k=7, error_feedback=True, residual_file=path, num_clients=N)
    for r, ids in enumerate([[0, 3, 5], [3, 1, 0], [5, 3, 2]]):
        U = _U(3, d, seed=r)
        if r == 1:
            U[1, 4] = float("nan")  # client 1: no residual kept
        a, b = mem.encode_rows(U, ids, r), fil.encode_rows(U, ids, r)
        ok = [k for k in range(3) if not (r == 1 and k == 1)]  # (the NaN row's values are NaN in both)
        assert torch.equal(a.select(ok).idx, b.select(ok).idx) and torch.equal(a.select(ok).val, b.select(ok).val)
    assert fil.has == set(mem.residuals) == {0, 2, 3, 5}
    for c, e in mem.residuals.items():
        assert torch.equal(fil.table[c], e)
    st = fil.state_dict()
    assert tables.is_reference(st["residuals"]) and st["residuals"]["version"] == 3 and st["has"] == [0, 2, 3, 5]
    again = compress.make_codec("topk", d, k=7, error_feedback=True, residual_file=path, num_clients=N)
    again.load_state_dict(st)
    U = _U(3, d, seed=9)
    x, y = mem.encode_rows(U, [2, 0, 4], 3), again.encode_rows(U, [2, 0, 4], 3)
    assert torch.equal(x.idx, y.idx) and torch.equal(x.val, y.val)
    stale = compress.make_codec("topk", d, k=7, error_feedback=True, residual_file=path, num_clients=N)
    with pytest.raises(ValueError, match=r"residual_file .* is at version 4 \(done\), the state expects version 3"):
        stale.load_state_dict(st)
    into_mem = compress.make_codec("topk", d, k=7, error_feedback=True)
    into_mem.load_state_dict(again.state_dict())  # a file's rows into a codec without one
    assert set(into_mem.residuals) == {0, 2, 3, 4, 5} and torch.equal(into_mem.residuals[4], again.table[4])
    fresh = compress.make_codec("topk", d, k=7, error_feedback=True, residual_file=path, num_clients=N)
    with pytest.raises(ValueError, match="compress.residual_file .* already exists"):
        fresh.encode_rows(U, [0, 1, 2], 0)


@pytest.mark.parametrize(
    "kwargs,msg",
    [
        (
            dict(residual_file="x.f32", num_clients=4),
            "compress.residual_file: set .* but compress.error_feedback is off",
        ),
        (dict(residual_file="x.f32", error_feedback=True), r"compress.residual_file: needs num_clients .*, got None"),
        (
            dict(residual_file="/no/such/dir/x.f32", error_feedback=True, num_clients=4),
            "folder '/no/such/dir' does not exist",
        ),
    ],
)
def test_residual_file_options_one_line_errors(kwargs, msg):
    with pytest.raises(ValueError, match=msg) as e:
        compress.make_codec("topk", 100, k=5, **kwargs)
    assert "\n" not in str(e.value)


def test_cli_error_feedback_from_a_file_resumes_bit_identical(tmp_path):
    """Through the CLI: a topk + error-feedback run with compress.residual_file, stopped after 2 rounds (its
    checkpoint references the file) and resumed to 4, ends with the same model as an uninterrupted 4-round run,
    and as the same run with the residuals in memory; the file is a 30 x d float32 table."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    common = [
        "--preset",
        "smoke",
        "data.train_subset=400",
        "client_loss=none",
        "plots=false",
        "threads=1",
        "--no-progress",
        "compress.kind=topk",
        "compress.ratio=0.05",
        "compress.error_feedback=true",
    ]

    def fk(*args):
        p = cli_process.run(
            [sys.executable, "-m", "fedkernels", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert p.returncode == 0, p.stderr[-2000:]
        return p

    def final(name):
        return torch.load(tmp_path / "runs" / name / "final_model.pt", weights_only=True)["flat"]

    fk("run", *common, "rounds=4", "--name", "mem")
    fk("run", *common, "rounds=4", f"compress.residual_file={tmp_path / 'full.f32'}", "--name", "full")
    fk(
        "run",
        *common,
        "rounds=2",
        "checkpoint_every=1",
        f"compress.residual_file={tmp_path / 'cut.f32'}",
        "--name",
        "cut",
    )
    r = fk("run", "--resume", "runs/cut", "rounds=4", "--no-progress")
    assert "resumed from runs/cut/checkpoints/ckpt_round_000002.pt (round 2)" in r.stdout
    assert torch.equal(final("cut"), final("full")) and torch.equal(final("full"), final("mem"))
    cfg = __import__("yaml").safe_load(open(tmp_path / "runs" / "full" / "config.yaml"))
    d = final("full").numel()
    assert os.path.getsize(tmp_path / "full.f32") == cfg["num_clients"] * d * 4
    assert open(str(tmp_path / "full.f32") + ".state").read().split() == ["4", "done"]


def test_block_code_file_bad_row_is_excluded_by_the_runner(tmp_path):
    """A codes file with a NaN scale in row 1: under exclude the runner drops that row (BlockCodeFile.select) and
    the round equals the in-memory rows' round, bit for bit; under raise it names client and row."""
    from fedkernels.sources import BlockCodeFile

    K, d, B = 4, 5000, 64
    rows = compress.make_codec("int8_block", d, block=B).encode_rows(_U(K, d), list(range(K)), 0)
    rows.scales[1, 7] = float("nan")
    rows.Q.view(torch.uint8).numpy().tofile(tmp_path / "q.bin")
    rows.scales.numpy().tofile(tmp_path / "s.bin")
    f = BlockCodeFile(tmp_path / "q.bin", tmp_path / "s.bin", K, d, B)
    g, n, ids = torch.randn(d), [1.0, 2.0, 3.0, 4.0], [5, 6, 7, 8]
    a = algorithms.build("fedavgm", on_bad_update="exclude").aggregate(g, f, n, ids)
    b = algorithms.build("fedavgm", on_bad_update="exclude").aggregate(g, rows, n, ids)
    assert torch.equal(a.params, b.params) and a.info["excluded"] == b.info["excluded"] == [
        {"client_id": 6, "reason": "compressed update contains NaN/Inf"}
    ]
    with pytest.raises(ValueError, match=r"client 6 \(row 1\): compressed update contains NaN/Inf"):
        algorithms.build("fedavg").aggregate(g, f, n, ids)


def test_weighted_sum_methods_constant_reads_the_declarations():
    """``compress.WEIGHTED_SUM_METHODS`` (the public name) is ``weighted_sum_methods()`` as a tuple: the
    methods that declared they read U only through weighted sums, the FedAvg family and SCAFFOLD among them,
    and no method that reads more."""
    from fedkernels import compress

    names = compress.WEIGHTED_SUM_METHODS
    assert names == tuple(compress.weighted_sum_methods())
    assert {"fedavg", "fedprox", "fedavgm", "fednova", "scaffold", "scaffold_partial", "fedpvr"} <= set(names)
    assert not {"kuramoto", "fedaware", "fedecado", "krum", "median"} & set(names)
