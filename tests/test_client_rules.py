"""Client rules and payloads: every method with a client side refuses a round without its payload
(one message naming the key and how to provide it), and the README's snippet runs as written."""

import os
import re
import sys

import pytest
import torch
from torch import nn

from fedkernels import FlatSpec
from fedkernels.algorithms import BadUpdateError, build

import cli_process  # tests/cli_process.py: the command in a child forked from a pre-imported interpreter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NEEDS = [
    ("scaffold", {}, "delta_c"),
    ("fedpvr", {"n_ctrl": "all"}, "delta_c"),
    ("fednova", {}, "local_steps"),
    ("fedecado", {"hessian": "identity"}, "T"),
    ("fedprox", {"mu": 0.1}, "prox_mu"),
    ("gcfed", {}, "local_gc"),
    ("local_gc", {}, "local_gc"),
    ("fedpgvc", {}, "pgvc_skipped_steps"),
]


@pytest.mark.parametrize("name,opts,key", NEEDS)
def test_missing_client_side_raises_one_clear_error(name, opts, key):
    m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    spec = FlatSpec.from_module(m)
    w = spec.flatten(m)
    agg = build(name, **opts)
    agg.setup(spec, num_clients=3, global_flat=w)
    with pytest.raises(BadUpdateError) as e:
        agg.aggregate(w, torch.zeros(2, spec.d), [1, 1], [0, 1])
    msg = str(e.value)
    assert "\n" not in msg and repr(key) in msg and "agg.client_rule()" in msg and "rule.end(ctx, model)" in msg
    # under on_bad_update="exclude" the clients are dropped and reported, never used silently
    agg = build(name, on_bad_update="exclude", **opts)
    agg.setup(spec, num_clients=3, global_flat=w)
    res = agg.aggregate(w, torch.ones(2, spec.d), [1, 1], [0, 1])
    assert res.info.get("skipped") and len(res.info["excluded"]) == 2 and torch.equal(res.params, w)


def test_no_client_side_needed_where_training_is_fedavg():
    w = torch.zeros(5)
    for name, opts in (("fedprox", {"mu": 0.0}), ("global_gc", {}), ("fedavg", {}), ("fedavgm", {})):
        agg = build(name, **opts)
        if name == "global_gc":
            agg.setup(FlatSpec.from_module(nn.Linear(4, 1)), 2, w)
        assert torch.isfinite(agg.aggregate(w, torch.ones(2, 5), [1, 1]).params).all()


def test_fedprox_mu_mismatch_is_named():
    with pytest.raises(BadUpdateError, match=r"mu=0.5 but the server has mu=0.1"):
        build("fedprox", mu=0.1).aggregate(torch.zeros(3), torch.ones(1, 3), [1], payloads=[{"prox_mu": 0.5}])


def test_library_doc_round_snippet_runs_as_written(tmp_path):
    text = open(os.path.join(ROOT, "docs", "library.md")).read()
    at = text.index("## A whole round in your own training loop")
    block = re.search(r"```python\n(.*?)```", text[at:], re.S).group(1)
    assert "spec.load_(model, glob)" in block and "rule.end(ctx, model)" in block
    script = tmp_path / "snippet.py"
    script.write_text(block)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = cli_process.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    for name, key in (("scaffold", "delta_c"), ("fedprox", "prox_mu"), ("gcfed", "local_gc"), ("fedecado", "T")):
        line = next(l for l in out.stdout.splitlines() if l.startswith(name + " "))
        assert repr(key) in line
