"""Determinism: every registered aggregator gives the same bits for the same inputs across runs and
across 1 vs 2 intra-op threads (torch.set_num_threads in separate processes), over a few rounds
with state (momentum, control variates, momentum tables, flows)."""

import hashlib
import json
import os
import sys

import pytest

import cli_process  # tests/cli_process.py: the command in a child forked from a pre-imported interpreter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K, N, D, ROUNDS = 6, 9, 40_000 + 7, 3  # d spans several 8192-column parallel chunks, odd tail


def _fingerprints(threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    sys.path.insert(0, ROOT)
    from bench.fuzz import _payloads, agg_names, synthetic_spec
    from fedkernels import algorithms

    out = {}
    for name in agg_names():
        kw = {"local_gc_only": {"lam": 0.5}}.get(name, {})
        agg = algorithms.build(name, on_bad_update="exclude", **kw)
        g = torch.Generator().manual_seed(1234)
        x = torch.randn(D, generator=g)
        agg.setup(spec=synthetic_spec(D), num_clients=N, global_flat=torch.zeros(D))
        h = hashlib.sha256()
        for r in range(ROUNDS):
            ids = sorted(torch.randperm(N, generator=g)[:K].tolist())
            U = torch.randn(K, D, generator=g) * 0.01
            U[1] = U[0]  # duplicate update
            U[2] = 0  # zero-norm update
            n = torch.randint(1, 50, (K,), generator=g).tolist()
            pl = _payloads(name, agg, K, D, torch.float32, g, kw, ids)
            x, info = agg.aggregate(x, U, n, ids, pl)
            h.update(x.numpy().tobytes())
            h.update(json.dumps(info, sort_keys=True, default=str).encode())
        for k, v in sorted(agg.state_dict().items()):
            if isinstance(v, torch.Tensor):
                h.update(
                    k.encode() + v.contiguous().view(torch.uint8).numpy().tobytes()
                    if v.dtype != torch.bool
                    else v.numpy().tobytes()
                )
        out[name] = h.hexdigest()
    return out


def _run(threads: int) -> dict:
    r = cli_process.run(
        [sys.executable, os.path.abspath(__file__), str(threads)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs():
    return {"1a": _run(1), "1b": _run(1), "2": _run(2)}


def test_every_aggregator_is_covered(runs):
    sys.path.insert(0, ROOT)
    from bench.fuzz import agg_names

    assert sorted(runs["1a"]) == sorted(agg_names()) and len(runs["1a"]) >= 10


def test_same_bits_across_runs(runs):
    diff = [n for n in runs["1a"] if runs["1a"][n] != runs["1b"][n]]
    assert not diff, f"not reproducible run to run: {diff}"


def test_same_bits_across_thread_counts(runs):
    diff = [n for n in runs["1a"] if runs["1a"][n] != runs["2"][n]]
    assert not diff, f"1 vs 2 threads differ: {diff}"


if __name__ == "__main__":
    import logging

    logging.disable(logging.WARNING)
    print(json.dumps(_fingerprints(int(sys.argv[1]))))
