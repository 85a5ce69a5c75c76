"""The batched executor (fedkernels.sim.batched, clients_at_once=N): a round's clients stacked and trained
as one vmapped computation must give what the sequential loop gives: each round, run from the same
state by both, gives the same update to a bound derived from fp32 rounding (UPDATE_REL below) and the
same logged metrics. Unequal client sizes (a client smaller
than the batch, short tail batches), per-client epochs and learning rates, every client rule; a rule or
model it cannot batch trains sequentially with one line saying why."""

import copy
import logging
import math
import os
import sys

import numpy as np
import pytest
import torch
from torch import nn

from fedkernels.sim import presets
from fedkernels.sim.config import apply_overrides
from fedkernels.sim.assemble import torch_settings
from fedkernels.sim.report import TIMING_KEYS
from fedkernels.sim.simulation import Simulation
from round_states import RoundStates

import cli_process  # tests/cli_process.py: the command in a child forked from a pre-imported interpreter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = (13, 61, 97, 150)  # 13 < batch 32 (B = 13); 61, 97, 150 end with a short tail batch


def _data_and_parts():
    from fedkernels.sim.data import load_dataset

    tr, te = load_dataset("digits")
    perm = np.random.default_rng(0).permutation(len(tr.y))
    parts, s = [], 0
    for n in SIZES:
        parts.append(perm[s : s + n])
        s += n
    return tr, te, parts


DATA = None


def sim(*overrides, model_fn=None, parts=None, train=None, start=None):
    """A run of the smoke preset (3 rounds, 4 clients) on DATA, and its states: ``states[0]`` holds the
    initial model, ``states[r]`` the state after round r. ``start``: one of these states, to run the
    one round after it instead."""
    global DATA
    if DATA is None:
        DATA = _data_and_parts()
    tr, te, p = DATA
    cfg = apply_overrides(
        presets.get("smoke"),
        [
            "threads=1",
            "verbose=false",
            "plots=false",
            "progress=false",
            "rounds=3",
            "num_clients=4",
            "client_loss=participants",
            *overrides,
        ],
    )
    rec = RoundStates(bn_steps=True)
    s = Simulation(
        cfg,
        write_outputs=False,
        train=train or tr,
        test=te,
        client_indices=parts or p,
        model_fn=model_fn,
        callbacks=[rec],
    )
    if start is None:
        s.run()
    else:
        with torch_settings(s.cfg):  # as run() sets up (threads: the data's normalisation)
            s.setup()
        if "round" in start:
            s.load_state(copy.deepcopy(start))
        else:
            s.global_flat.copy_(start["global"])
        s.run(stop_after=s.start_round + 1)
    return s, rec.states


# Two executors (or chunkings) run the same arithmetic in another order (a vmapped matmul sums in
# another order than the per-client one): their fp32 results part by rounding, about 1e-7 relative
# per operation, and across a round's local steps (at most 3 epochs x 5 batches here) the update
# parts by about 5e-7 relative (measured <= 5e-7). A ReLU input within rounding of 0 can take
# opposite signs under the two orders: that one sample's gradient through that one unit, at most
# 1/B of the unit's batch gradient in one of the round's steps, moves the update by at most about
# 1/(B * sqrt(units) * steps) ~ 1e-3 relative (seen: 5e-5 in one FedECADO round on AVX-512). The
# global model's trajectory is chaotic across rounds (a 1e-7 change after round 1 grows to 1e-2 by
# round 3 for deep models), so each round is compared from the same state, as a relative bound on
# the round's update (||u_a - u_b|| <= UPDATE_REL ||u_a||), never round after round.
UPDATE_REL = 1e-3
# Some rounds are ill-conditioned in themselves: a deep BatchNorm model whose last BatchNorm sees 1x1
# maps (ResNet-18 on 8x8 digits) moves its first round's update by 3e-3 when the starting model moves
# by one fp32 rounding (measured with torch's scalar kernels, ATEN_CPU_CAPABILITY=default; 1e-6 with
# its AVX-512 ones). There the bound is the round's own response to a rounding-level change of its
# start (``perturbed``: the first executor again from the state times 1 +- 2^-24), times SLACK.
SLACK = 10


def perturbed(state, seed=0):
    """``state`` with every element of its global model moved by one fp32 rounding (x (1 +- 2^-24))."""
    st = copy.deepcopy(state)
    g = st["global"]
    sign = torch.randint(0, 2, g.shape, generator=torch.Generator().manual_seed(seed)).to(g.dtype) * 2 - 1
    st["global"] = g * (1 + sign * 2.0**-24)
    return st


def _apart(a, b):
    return float((a.double() - b.double()).norm())


def assert_same_update(start, a, b, what="", c=None):
    """The round's update from ``start`` (a tensor, the global model before the round) by two executors
    (``a``, ``b``: the new global models); ``c``: the first executor's from the perturbed start."""
    ua, ub = a.double() - start.double(), b.double() - start.double()
    assert torch.isfinite(ub).all(), what
    err, ref = _apart(ua, ub), float(ua.norm())
    bound = max(UPDATE_REL * ref, 0.0 if c is None else SLACK * _apart(a, c))
    assert err <= bound, f"{what}: the updates part by {err:.3g} ({err / max(ref, 1e-300):.3g} relative)"


def assert_rel_close(a, b, what="", c=None):
    """Two tensors that a round computed from the same state, to UPDATE_REL relative (2-norm), or
    within SLACK times their distance to ``c`` (the same from the perturbed start)."""
    err, ref = _apart(a, b), float(a.double().norm())
    bound = max(UPDATE_REL * max(ref, 1e-12), 0.0 if c is None else SLACK * _apart(a, c))
    assert err <= bound, f"{what}: {err:.3g} apart ({err / max(ref, 1e-300):.3g} relative)"


def close(a, b, path="", c=None):
    """Every number of two metric records of one round from the same state equal to UPDATE_REL (the
    metrics are smooth functions of the model and of the updates), accuracy to one test sample
    (a test sample at a near-tie of its two best logits may change its class), or within SLACK times
    their distance to ``c`` (the first executor's record from the perturbed start); timings left out."""
    if isinstance(a, dict):
        assert set(a) == set(b), (path, set(a) ^ set(b))
        for k in a:
            if k not in TIMING_KEYS:
                close(a[k], b[k], f"{path}.{k}", None if c is None else c[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            close(x, y, f"{path}[{i}]", None if c is None else c[i])
    elif path.endswith(".accuracy"):
        assert abs(a - b) <= max(1.5 / len(DATA[1].y), 0 if c is None else SLACK * abs(a - c)), (path, a, b)
    elif isinstance(a, float) and not isinstance(a, bool):
        spread = 0.0 if c is None or math.isnan(c) else SLACK * abs(a - c)
        assert (math.isnan(a) and math.isnan(b)) or abs(a - b) <= max(UPDATE_REL * abs(a) + 1e-5, spread), (path, a, b)
    elif isinstance(a, torch.Tensor):
        assert_rel_close(a, b, path, c)
    elif path.endswith(".iterations"):  # an iterative solve (FedAWARE's min-norm) on inputs equal to fp32
        assert abs(a - b) <= 1, (path, a, b)  # rounding may cross its stop threshold one step apart
    else:
        assert a == b, (path, a, b)


def each_round_from_the_same_state(s1, states, *overrides, sensitivity=None, **kw):
    """Every round of run ``s1`` (its ``states``) run again from the state before it with ``overrides``
    (another executor): the same update to UPDATE_REL and the same metrics (``close``). ``sensitivity``:
    ``s1``'s own overrides, to bound each round by its response to a rounding-level change of its start
    (SLACK; the perturbed runs go to ``s2.perturbed``). Returns the last of these one-round runs, its
    ``metrics`` the list of the rounds' metrics."""
    rounds, ms, s3 = len(states) - 1, [], None
    s2 = None
    for r in range(rounds):
        s2, st2 = sim(*overrides, start=states[r], **kw)
        c = m3 = None
        if sensitivity is not None:
            s3, st3 = sim(*sensitivity, start=perturbed(states[r], r), **kw)
            c, m3 = st3[-1]["global"], s3.metrics[-1]
        assert_same_update(states[r]["global"], states[r + 1]["global"], st2[-1]["global"], f"round {r + 1}", c)
        ms.append(s2.metrics[-1])
        close(s1.metrics[r], s2.metrics[-1], f"round {r + 1}", m3)
    s2.metrics, s2.perturbed = ms, s3
    return s2


def same_run(*overrides, sensitivity=False, **kw):
    """The sequential loop and the batched executor (4 clients at once): each round from the same state
    (``sensitivity``: bounded by the round's response to a rounding-level change of its start too)."""
    s1, states = sim("clients_at_once=off", *overrides, **kw)
    assert s1.batched is None and len(states) == 4
    s1.round_states = states
    s2 = each_round_from_the_same_state(
        s1,
        states,
        "clients_at_once=4",
        *overrides,
        **kw,
        sensitivity=("clients_at_once=off", *overrides) if sensitivity else None,
    )
    assert s2.batched is not None, "the batched executor was not used"
    return s1, s2


HETERO = ["train.hetero.enabled=true", "train.hetero.lr_range=[0.02,0.2]", "train.hetero.epochs_range=[1,3]"]

METHODS = {
    "fedavg": [],
    "fedavg-momentum-wd": ["train.momentum=0.9", "train.weight_decay=0.01"],
    "fedavg-nesterov-clip-steps": ["train.momentum=0.5", "train.nesterov=true", "train.grad_clip=0.5", "train.steps=7"],
    "fedavg-drop-last": ["train.drop_last=true", "train.epochs=2"],
    "fedavg-hetero": HETERO,
    "fedprox": ["algorithm.name=fedprox", "algorithm.options.mu=0.5", *HETERO],
    "fedprox-loss": ["algorithm.name=fedprox", "algorithm.options.mu=0.5", "algorithm.options.prox=loss"],
    "scaffold": ["algorithm.name=scaffold", *HETERO],
    "scaffold-momentum-clip": [
        "algorithm.name=scaffold",
        "algorithm.options.momentum_correction=true",
        "algorithm.options.weighting=samples",
        "train.momentum=0.9",
        "train.grad_clip=1.0",
    ],
    "scaffold-nesterov-clip": [
        "algorithm.name=scaffold",
        "train.momentum=0.9",
        "train.nesterov=true",
        "train.grad_clip=0.5",
    ],
    "scaffold-unfused": ["algorithm.name=scaffold", "algorithm.options.fused_step=false", "train.grad_clip=1.0"],
    "fedpvr": ["algorithm.name=fedpvr", "algorithm.options.n_ctrl=1", *HETERO],
    "fedpvr-two-ranges": [
        "algorithm.name=fedpvr",
        "model.options.hidden=[32,16]",  # fc1 and fc3: two
        "algorithm.options.ctrl_modules=[fc1,fc3]",
        "train.momentum=0.5",
    ],  # flat ranges
    "fednova": ["algorithm.name=fednova", "train.momentum=0.5", *HETERO],
    "fedavgm": ["algorithm.name=fedavgm"],
    "fedaware": ["algorithm.name=fedaware"],
    "kuramoto-S": ["algorithm.name=kuramoto", "algorithm.options.mode=S", "algorithm.options.kappa0=0.5"],
    "kuramoto-C": ["algorithm.name=kuramoto", "algorithm.options.mode=C", "algorithm.options.kappa0=0.2"],
    "local_gc": ["algorithm.name=local_gc", "train.momentum=0.9", "train.weight_decay=0.001", "train.grad_clip=1.0"],
    "gcfed-skip-unfused": [
        "algorithm.name=gcfed",
        "algorithm.options.vector_policy=skip",
        "algorithm.options.fused_step=false",
    ],
    "global_gc": ["algorithm.name=global_gc"],
    "local_gc_only": ["algorithm.name=local_gc_only", "algorithm.options.lam=0.5"],
    "fedpgvc-hadamard": ["algorithm.name=fedpgvc", *HETERO],
    "fedpgvc-additive-clip": [
        "algorithm.name=fedpgvc",
        "algorithm.options.mode=additive",
        "algorithm.options.loss_clip=1.0",
    ],
    "fedpgvc-layer_scalar-norm": [
        "algorithm.name=fedpgvc",
        "algorithm.options.mode=layer_scalar",
        "algorithm.options.stat=norm",
    ],
    "fedpgvc-layer_scalar-mean": ["algorithm.name=fedpgvc", "algorithm.options.mode=layer_scalar"],
    "fedpgvc-layer_normalize": ["algorithm.name=fedpgvc", "algorithm.options.mode=layer_normalize"],
    "fedpgvc-lr_matched": ["algorithm.name=fedpgvc", "algorithm.options.mode=lr_matched"],
    "fedecado": ["algorithm.name=fedecado", *HETERO],  # round 1 Hutchinson: sequential, then batched
    "fedecado-partial": ["algorithm.name=fedecado", "clients_per_round=3", *HETERO],  # round 3: 0 | 1 new | 3
    "fedecado-identity": ["algorithm.name=fedecado", "algorithm.options.hessian=identity", *HETERO],
}


@pytest.mark.parametrize("name", list(METHODS))
def test_batched_equals_sequential_round_by_round(name):
    s1, s2 = same_run(*METHODS[name])
    assert [m["local_steps"] for m in s1.metrics] == [m["local_steps"] for m in s2.metrics]
    if name.startswith(("scaffold", "fedpvr")):  # the server's control variates agree too (round 3's)
        for k, v in s1.agg.state_dict().items():
            if isinstance(v, torch.Tensor):
                assert_rel_close(v, s2.agg.state_dict()[k], k)


def test_unequal_sizes_and_steps_are_what_the_clients_trained():
    s1, s2 = same_run(*HETERO)
    steps = s2.metrics[0]["local_steps"]
    assert len(set(steps)) > 1  # the chunk really mixes clients of different step counts
    assert steps == s1.metrics[0]["local_steps"]


def test_deterministic_for_a_seed():
    a, ra = sim("clients_at_once=4", *HETERO)
    b, rb = sim("clients_at_once=4", *HETERO)
    assert len(ra) == 4 and all(torch.equal(x["global"], y["global"]) for x, y in zip(ra, rb))
    c, rc = sim("clients_at_once=4", "seed=1", *HETERO)
    assert not torch.equal(ra[-1]["global"], rc[-1]["global"])


def test_chunks_of_clients_equal_one_chunk():
    s1, r1 = sim("clients_at_once=4", "algorithm.name=scaffold", *HETERO)
    each_round_from_the_same_state(s1, r1, "clients_at_once=3", "algorithm.name=scaffold", *HETERO)  # 3 + 1


def _bad_data():
    """Client 1 has no samples ("has no training examples"); five of client 2's samples are NaN."""
    tr, te, parts = _data_and_parts()
    parts = list(parts)
    parts[1] = np.zeros(0, dtype=np.int64)
    x = tr.x.clone()
    x[parts[2][:5]] = float("nan")
    bad = copy.copy(tr)
    bad.x = x
    return bad, parts


def test_bad_clients_excluded_as_in_the_sequential_loop():
    bad, parts = _bad_data()
    s1, s2 = same_run(parts=parts, train=bad)
    ex1 = [m["excluded"] for m in s1.metrics]
    assert ex1 == [m["excluded"] for m in s2.metrics]
    assert [e["client_id"] for e in ex1[0]] == [1, 2]
    assert [m["num_updates"] for m in s2.metrics] == [2, 2, 2]


def test_fedpgvc_skips_the_non_finite_steps_as_in_the_sequential_loop():
    bad, parts = _bad_data()  # nan_policy "skip": client 2 drops its NaN batches and stays finite
    s1, s2 = same_run("algorithm.name=fedpgvc", "train.momentum=0.5", parts=parts, train=bad)
    assert [e["client_id"] for e in s2.metrics[0]["excluded"]] == [1]


class GNNet(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.norm = nn.GroupNorm(4, 8)
        self.fc = nn.Linear(8 * 8 * 8, num_classes)

    def forward(self, x):
        return self.fc(torch.relu(self.norm(self.conv(x))).flatten(1))


class BNNet(GNNet):
    def __init__(self, num_classes):
        super().__init__(num_classes)
        self.norm = nn.BatchNorm2d(8)


def test_groupnorm_conv_model_trains_batched():
    same_run("algorithm.name=gcfed", "train.momentum=0.9", model_fn=lambda nc, c, s: GNNet(nc))


class BN1dNet(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(64, 32), nn.BatchNorm1d(32), nn.Linear(32, num_classes)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x.flatten(1)))))


def _bn_parts():
    """SIZES with 90 for 97: no batch of one sample (which would train sequentially, see below)."""
    tr, te, parts = _data_and_parts()
    return [parts[0], parts[1], np.concatenate([parts[2], parts[3]])[:90], parts[3][:150]]


def _batchnorm_statistics(s):
    return [
        (m.running_mean.clone(), m.running_var.clone(), int(m.num_batches_tracked))
        for m in s.model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
    ]


def _same_statistics(s1, s2):
    st1, st2 = _batchnorm_statistics(s1), _batchnorm_statistics(s2)
    st3 = (
        _batchnorm_statistics(s2.perturbed) if getattr(s2, "perturbed", None) is not None else [(None,) * 3] * len(st1)
    )
    assert st1 and len(st1) == len(st2)
    before = s1.round_states[-2]["tracked"]  # the last round's steps (it ran from the same state)
    for (m1, v1, n1), (m2, v2, n2), (m3, v3, _), n0 in zip(st1, st2, st3, before):
        assert n1 - n0 == n2 > 0  # every client step counted once, as in the sequential loop
        assert_rel_close(m1, m2, "running_mean", m3)  # the last round's, from the same state
        assert_rel_close(v1, v2, "running_var", v3)


@pytest.mark.parametrize("name", ["fedavg", "scaffold", "fedprox", "fedavg-momentum-wd"])
@pytest.mark.parametrize("net", [BNNet, BN1dNet])
def test_batchnorm_statistics_are_carried_per_client(name, net):
    """BatchNorm trains batched: batch statistics over each client's real samples (short tail batches,
    a client smaller than the batch), its running statistics carried per client in the buffer columns."""
    over = {
        "fedavg": [],
        "scaffold": ["algorithm.name=scaffold", "train.grad_clip=1.0"],
        "fedprox": METHODS["fedprox"] + ["train.grad_clip=0.5"],
        "fedavg-momentum-wd": METHODS[name],
    }[name]
    s1, s2 = same_run(*over, model_fn=lambda nc, c, s: net(nc), parts=_bn_parts())
    assert s2.batched.dp < s2.spec.d  # the running statistics are trailing columns of the flat vector
    _same_statistics(s1, s2)
    if name == "scaffold":  # buffers carry no control variate, in both executors
        for k, v in s1.agg.state_dict().items():
            if isinstance(v, torch.Tensor):
                assert_rel_close(v, s2.agg.state_dict()[k], k)


class BNNoBiasNet(BNNet):
    def __init__(self, num_classes):
        super().__init__(num_classes)
        self.conv = nn.Conv2d(1, 8, 3, padding=1, bias=False)


@pytest.mark.parametrize("name", ["fedpgvc-hadamard", "fedpgvc-layer_normalize", "kuramoto-C", "fedecado"])
def test_batchnorm_with_the_other_rules(name):
    """FedPGVC's rho (a jacobian), its per-layer normalisation, Kuramoto's gradient norm, FedECADO's flows.
    (No conv bias before the BatchNorm: that bias's gradient is 0 up to rounding, which layer_normalize
    scales to tau, so both executors would step it by different rounding noise.)"""
    s1, s2 = same_run(*METHODS[name], model_fn=lambda nc, c, s: BNNoBiasNet(nc), parts=_bn_parts())
    _same_statistics(s1, s2)


@pytest.mark.parametrize("method,steps", [("fedavg", 2), ("scaffold", 1)])
def test_resnet18_batchnorm_trains_batched(method, steps):
    """models.py's ResNet-18 with norm=bn (width 4, so it runs in seconds), few local steps: on 8x8
    digits its layer4 BatchNorm sees 1x1 maps, which makes a round ill-conditioned (see SLACK): each
    round is also bounded by its own response to a rounding-level change of its start. The shallow
    BatchNorm models above compare every method and step count."""
    s1, s2 = same_run(
        "model.options={}",
        "model.name=resnet18_gn",
        "model.options.norm=bn",
        "model.options.width=4",
        f"train.steps={steps}",
        f"algorithm.name={method}",
        parts=_bn_parts(),
        sensitivity=True,
    )
    _same_statistics(s1, s2)


def test_a_batch_of_one_sample_trains_sequentially_under_batchnorm(monkeypatch):
    """Client 2 (97 samples, batch 32) ends each epoch with a batch of one sample, which BatchNorm refuses
    where its maps are 1x1: it trains in the sequential loop, in its place; the others batched."""
    from fedkernels.sim.batched import BatchedExecutor

    chunks = []
    orig = BatchedExecutor._train_chunk

    def spy(self, r, items, factor):
        chunks.append([cid for _, cid, _, _, _ in items])
        return orig(self, r, items, factor)

    monkeypatch.setattr(BatchedExecutor, "_train_chunk", spy)
    s1, s2 = same_run(model_fn=lambda nc, c, s: BNNet(nc))
    assert chunks == [[0, 1], [3]] * 3, chunks
    _same_statistics(s1, s2)


class CumulativeBNNet(BNNet):
    def __init__(self, num_classes):
        super().__init__(num_classes)
        self.norm = nn.BatchNorm2d(8, momentum=None)


class MyBN(nn.BatchNorm2d):
    pass


class MyBNNet(BNNet):
    def __init__(self, num_classes):
        super().__init__(num_classes)
        self.norm = MyBN(8)


class BufferNet(GNNet):
    def __init__(self, num_classes):
        super().__init__(num_classes)
        self.register_buffer("scale", torch.ones(1))


@pytest.mark.parametrize(
    "net,words",
    [
        (CumulativeBNNet, "momentum=None"),
        (MyBNNet, "has MyBN (norm)"),
        (BufferNet, "buffers other than BatchNorm statistics (scale"),
    ],
)
def test_batchnorm_it_cannot_carry_is_refused_with_one_line(caplog, net, words):
    with caplog.at_level(logging.WARNING, logger="fedkernels.sim"):
        s, _ = sim("clients_at_once=4", "rounds=1", model_fn=lambda nc, c, s: net(nc))
    assert s.batched is None
    lines = [r.getMessage() for r in caplog.records if "clients_at_once" in r.getMessage()]
    assert len(lines) == 1 and words in lines[0] and "one at a time" in lines[0], lines


@pytest.mark.parametrize(
    "overrides,words",
    [
        (["algorithm.name=fedpgvc", "algorithm.options.mode=code"], ["mode 'code'"]),
        (["algorithm.name=gcfed", "algorithm.options.local_order=post_wd"], ["local_order='post_wd'"]),
        (["train.optimizer=adam"], ["adam"]),
    ],
)
def test_rules_that_cannot_be_batched_fall_back_with_one_line(caplog, overrides, words):
    with caplog.at_level(logging.WARNING, logger="fedkernels.sim"):
        s, r = sim("clients_at_once=4", "rounds=1", *overrides)
    assert s.batched is None and len(r) == 2  # the initial model and round 1
    lines = [r.getMessage() for r in caplog.records if "clients_at_once" in r.getMessage()]
    assert len(lines) == 1, lines
    for w in words:
        assert w in lines[0], lines[0]


def test_a_users_own_rule_is_not_batched():
    from fedkernels.algorithms.fedprox import FedProxRule
    from fedkernels.sim.batched import rule_reason

    class Mine(FedProxRule):
        pass

    assert rule_reason(FedProxRule(None, mu=0.1)) is None
    assert "Mine has no batched form" in rule_reason(Mine(None, mu=0.1))

    class Declared(FedProxRule):  # a user's subclass becomes batchable by naming its form
        batched_form = FedProxRule.batched_form

    assert rule_reason(Declared(None, mu=0.1)) is None


def test_fedecado_epoch_time_with_fixed_steps_is_not_batched():
    from fedkernels import algorithms
    from fedkernels.sim.batched import rule_reason

    rule = algorithms.build("fedecado", time_unit="epoch").client_rule()
    assert rule_reason(rule, fixed_steps=False) is None
    assert "time_unit='epoch' counts client time in epochs" in rule_reason(rule, fixed_steps=True)
    assert rule_reason(algorithms.build("fedecado").client_rule(), fixed_steps=True) is None


def test_auto_is_sequential_on_the_cpu():
    s, _ = sim("rounds=1")
    assert s.cfg.clients_at_once == "auto" and s.batched is None


def _fk(*args, cwd):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return cli_process.run(
        [sys.executable, "-m", "fedkernels", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_cli_fallback_line_and_bad_value(tmp_path):
    p = _fk(
        "run",
        "--preset",
        "smoke",
        "rounds=1",
        "plots=false",
        "threads=1",
        "--no-progress",
        "clients_at_once=2",
        "algorithm.name=fedpgvc",
        "algorithm.options.mode=code",
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [x for x in p.stderr.splitlines() if "clients_at_once" in x]
    assert len(lines) == 1 and "one at a time" in lines[0] and "mode 'code'" in lines[0], p.stderr
    q = _fk("run", "--preset", "smoke", "clients_at_once=0", cwd=tmp_path)
    err = [x for x in q.stderr.splitlines() if x.strip()]
    assert q.returncode == 2 and len(err) == 1 and "clients_at_once" in err[0] and "auto, off" in err[0], q.stderr


@pytest.mark.parametrize(
    "value,ok",
    [("auto", True), ("off", True), (False, True), (3, True), (0, False), ("many", False), (True, False), (-2, False)],
)
def test_config_check(value, ok):
    from fedkernels.sim.config import set_dotted

    cfg = presets.get("smoke")
    set_dotted(cfg, "clients_at_once", value)
    if ok:
        cfg.validate()
    else:
        with pytest.raises(ValueError, match="clients_at_once must be auto, off or an integer >= 1"):
            cfg.validate()


def test_config_excludes_workers():
    cfg = apply_overrides(presets.get("smoke"), ["clients_at_once=4", "workers=2"])
    with pytest.raises(ValueError, match="clients_at_once=4 and workers=2 exclude each other"):
        cfg.validate()


def test_chunk_size_from_free_memory():
    from fedkernels.errors import RunError
    from fedkernels.sim.batched import chunk_size, client_bytes

    per = client_bytes(10_000, 9_000, 300_000, momentum=True)
    assert per == 4 * (3 * 10_000 + 9_000) + 300_000  # G, its accumulation, momentum; activations
    assert client_bytes(10_000, 9_000, 0, momentum=False, rho=True) == 4 * 4 * 10_000
    assert chunk_size(8 * 2**20, per, 100) == (4 * 2**20) // per  # half the free memory
    assert chunk_size(8 * 2**30, per, 100) == 100  # never more than the round
    assert chunk_size(None, per, 17) == 17  # free memory unknown: the whole round
    with pytest.raises(
        RunError,
        match=r"clients_at_once=auto: one client needs about 0.4 MiB .* on cuda:0 "
        r"and 0.5 MiB are free",
    ):
        chunk_size(2**19, per, 100, "cuda:0")


def test_free_memory_on_the_cpu_is_the_available_ram():
    from fedkernels.sim.batched import free_memory

    free = free_memory(torch.device("cpu"))
    if os.path.exists("/proc/meminfo"):
        with open("/proc/meminfo") as f:
            avail = [int(x.split()[1]) * 1024 for x in f if x.startswith("MemAvailable:")][0]
        assert abs(free - avail) < max(avail // 4, 2**26)  # (the kernel's figure moves meanwhile)


def test_auto_sizes_chunks_each_round_and_stops_when_one_client_does_not_fit(monkeypatch):
    """auto, as on CUDA (here on the CPU, with a pretended free memory): chunks sized from the free memory
    round by round; a client that does not fit stops the run with one line, at set-up or in a later round."""
    import fedkernels.sim.batched as B
    from fedkernels.errors import RunError

    free = {"bytes": 2**40}
    monkeypatch.setattr(B, "AUTO_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(B, "free_memory", lambda dev: free["bytes"])
    spy, chunks = B.BatchedExecutor._train_chunk, []

    def train_chunk(self, r, items, f):  # after round 1's chunk: room for 1.5 clients
        chunks.append(len(items))
        free["bytes"] = 3 * self.per_client // 2 * 2
        return spy(self, r, items, f)

    monkeypatch.setattr(B.BatchedExecutor, "_train_chunk", train_chunk)
    s, states = sim("rounds=2")
    assert s.batched is not None and chunks == [4, 1, 1, 1, 1], chunks
    each_round_from_the_same_state(s, states, "rounds=2", "clients_at_once=off")
    free["bytes"] = 2**10  # at set-up
    with pytest.raises(RunError, match=r"^clients_at_once=auto: one client needs about .* MiB of working memory"):
        sim("rounds=1")
    chunks.clear()
    free["bytes"] = 2**40

    def shrink(self, r, items, f):  # in round 2
        chunks.append(len(items))
        free["bytes"] = 2**10
        return spy(self, r, items, f)

    monkeypatch.setattr(B.BatchedExecutor, "_train_chunk", shrink)
    with pytest.raises(RunError, match="one client needs about"):
        sim("rounds=2")
    assert chunks == [4]


def test_a_client_that_must_train_sequentially_keeps_its_place(monkeypatch):
    """FedECADO, 3 of 4 clients per round (seed 0: [0, 2, 3], [0, 2, 3], [0, 1, 3]): client 1's first
    participation (its Hutchinson estimate) trains in the sequential loop between two batched chunks."""
    from fedkernels.sim.batched import BatchedExecutor

    chunks = []
    orig = BatchedExecutor._train_chunk

    def spy(self, r, items, factor):
        chunks.append((r, [cid for _, cid, _, _, _ in items]))
        return orig(self, r, items, factor)

    monkeypatch.setattr(BatchedExecutor, "_train_chunk", spy)
    s, _ = sim("clients_at_once=4", "algorithm.name=fedecado", "clients_per_round=3", *HETERO)
    assert chunks == [(1, [0, 2, 3]), (2, [0]), (2, [3])], chunks
    assert s.metrics[2]["clients"] == [0, 1, 3] and s.metrics[2]["num_updates"] == 3


def test_the_chunk_trains_in_the_rows_of_the_update_buffer(monkeypatch):
    """No [C, d] copy: the stacked weights are the buffer's rows, turned into the updates in place."""
    from fedkernels.algorithms.base import BatchedRule

    seen = []
    orig = BatchedRule.begin
    monkeypatch.setattr(BatchedRule, "begin", lambda self, ch: (seen.append(ch.W), orig(self, ch))[-1])
    s, _ = sim("clients_at_once=4", "rounds=1")
    W = seen[0]
    assert (
        W.untyped_storage().data_ptr() == s.buf.data.untyped_storage().data_ptr()
        and W.data_ptr() == s.buf.data.data_ptr()
    )
