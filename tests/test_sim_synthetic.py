"""Generated datasets (FedProx Synthetic(alpha, beta), Gaussian mixture), the "natural" partition and
the three presets built on them (fedecado-synthetic, fedaware-synthetic, kuramoto-synthetic)."""

import math

import numpy as np
import pytest
import torch

from fedkernels.sim import presets
from fedkernels.sim.config import apply_overrides
from fedkernels.sim.data import DATASETS, generate_gmm, generate_synthetic, load_dataset
from fedkernels.sim.partition import check_partition, partition
from fedkernels.sim.simulation import Simulation


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def synth():
    return load_dataset("synthetic", seed=3)


# ---- synthetic -------------------------------------------------------------------------------------
def test_synthetic_registered_and_shapes(synth):
    assert "synthetic" in DATASETS and "gmm" in DATASETS
    tr, te = synth
    assert tr.x.dtype == torch.float32 and tr.x.shape[1] == 60 and tr.input_shape == (60,)
    assert te.x.shape[1] == 60 and tr.num_classes == te.num_classes == 10
    assert tr.y.dtype == torch.int64 and 0 <= int(tr.y.min()) and int(tr.y.max()) < 10
    o_tr, o_te = tr.meta["client_ids"], te.meta["client_ids"]
    assert isinstance(o_tr, np.ndarray) and o_tr.dtype == np.int64 and len(o_tr) == len(tr)
    assert len(o_te) == len(te) and tr.meta["num_users"] == 30
    n_tr = np.bincount(o_tr, minlength=30)
    n_te = np.bincount(o_te, minlength=30)
    assert len(n_tr) == 30 and len(n_te) == 30
    sizes = n_tr + n_te
    assert sizes.min() >= 50  # lognormal(4, 2) + 50
    np.testing.assert_array_equal(n_tr, (0.9 * sizes).astype(np.int64))  # FedProx's 90/10 per user
    assert len(np.unique(tr.labels)) >= 5


def test_synthetic_deterministic_and_seeded(synth):
    tr, te = synth
    tr2, te2 = load_dataset("synthetic", seed=3)
    assert torch.equal(tr.x, tr2.x) and torch.equal(tr.y, tr2.y) and torch.equal(te.x, te2.x)
    np.testing.assert_array_equal(tr.meta["client_ids"], tr2.meta["client_ids"])
    tr3, _ = load_dataset("synthetic", seed=4)
    assert tr3.x.shape != tr.x.shape or not torch.equal(tr3.x, tr.x)


def test_synthetic_generator_statistics():
    # within-user covariance is diag(j^-1.2): pooled per-user variance of every feature
    xtr, ytr, otr, xte, yte, ote = generate_synthetic(seed=0)
    x = np.concatenate([xtr, xte])
    o = np.concatenate([otr, ote])
    centred = x - np.stack([x[o == k].mean(0) for k in range(30)])[o]
    var = (centred**2).sum(0) / (len(x) - 30)
    np.testing.assert_allclose(var, np.arange(1, 61) ** -1.2, rtol=0.12)
    # iid: every user's features are centred at 0 and share one model
    xi, yi, oi, *_ = generate_synthetic(seed=0, iid=True, num_users=5, dim=8, num_classes=3)
    assert abs(float(xi.mean())) < 0.1 and set(np.unique(yi)) <= {0, 1, 2} and xi.shape[1] == 8
    # options change the data: dim, users, classes
    x2, y2, o2, *_ = generate_synthetic(num_users=4, dim=7, num_classes=3, seed=1, max_user_samples=60)
    assert x2.shape[1] == 7 and set(np.unique(o2)) == {0, 1, 2, 3} and y2.max() < 3
    assert np.bincount(o2).max() <= int(0.9 * 60)


def test_generated_subset_keeps_owners_aligned(synth):
    tr, _ = synth
    idx = np.array([5, 0, len(tr) - 1])
    sub = tr.subset(idx)
    np.testing.assert_array_equal(sub.meta["client_ids"], tr.meta["client_ids"][idx])
    small, _ = load_dataset("synthetic", seed=3, max_train=500, max_test=100)
    assert len(small) == 500 and len(small.meta["client_ids"]) == 500
    # each kept row is a row of the full set with the same owner
    full = {tuple(r): int(c) for r, c in zip(tr.x[:, :3].tolist(), tr.meta["client_ids"])}
    assert all(full[tuple(r)] == int(c) for r, c in zip(small.x[:, :3].tolist(), small.meta["client_ids"]))


# ---- gmm --------------------------------------------------------------------------------------------
def test_gmm_shapes_determinism_and_noise():
    tr, te = load_dataset("gmm", seed=1)
    assert tr.x.shape == (6000, 64) and te.x.shape == (2000, 64) and tr.input_shape == (64,)
    assert tr.num_classes == 10 and "client_ids" not in tr.meta
    np.testing.assert_array_equal(np.bincount(tr.labels), np.full(10, 600))  # balanced
    tr2, te2 = load_dataset("gmm", seed=1)
    assert torch.equal(tr.x, tr2.x) and torch.equal(te.y, te2.y)
    tr3, _ = load_dataset("gmm", seed=2)
    assert not torch.equal(tr.x, tr3.x)
    # x = mean_y + N(0, I): unit within-class variance; class means spread by class_sep
    xtr, ytr, xte, yte = generate_gmm(num_classes=4, dim=16, n_train=4000, n_test=10, class_sep=2.0, seed=0)
    means = np.stack([xtr[ytr == c].mean(0) for c in range(4)])
    resid = xtr - means[ytr]
    assert abs(float(resid.var()) - 1.0) < 0.05
    assert 1.3 < float(means.std()) < 2.7
    assert xte.shape == (10, 16) and np.bincount(ytr).tolist() == [1000] * 4


def test_gmm_standardize():
    tr, te = load_dataset("gmm", n_train=500, n_test=50, standardize=True)
    assert torch.allclose(tr.x.mean(0), torch.zeros(64), atol=1e-5)
    assert torch.allclose(tr.x.std(0, unbiased=False), torch.ones(64), atol=1e-4)
    assert tr.meta["options"]["standardize"] is True


@pytest.mark.parametrize(
    "name,opts,word",
    [
        ("synthetic", {"num_users": 0}, "num_users"),
        ("synthetic", {"alpha": -1.0}, "alpha"),
        ("synthetic", {"beta": float("nan")}, "beta"),
        ("synthetic", {"dim": "60"}, "dim"),
        ("synthetic", {"num_classes": 1}, "num_classes"),
        ("synthetic", {"train_fraction": 1.0}, "train_fraction"),
        ("synthetic", {"seed": -1}, "seed"),
        ("synthetic", {"iid": "yes"}, "iid"),
        ("synthetic", {"max_user_samples": 1}, "max_user_samples"),
        ("synthetic", {"n_train": 10}, "n_train"),  # a gmm option: unknown here
        ("gmm", {"class_sep": 0.0}, "class_sep"),
        ("gmm", {"n_train": 5}, "n_train"),  # fewer than the classes
        ("gmm", {"n_test": 0}, "n_test"),
        ("gmm", {"dim": 2.5}, "dim"),
        ("gmm", {"standardize": 1}, "standardize"),
        ("gmm", {"alpha": 1.0}, "alpha"),
    ],
)
def test_bad_generator_options(name, opts, word):
    with pytest.raises(ValueError, match=word):
        load_dataset(name, **opts)


def test_file_datasets_reject_generator_options():
    with pytest.raises(TypeError, match="seed"):
        load_dataset("digits", seed=1)


# ---- natural partition ------------------------------------------------------------------------------
def test_natural_partition_matches_owners(synth):
    tr, _ = synth
    owners = tr.meta["client_ids"]
    parts = partition(tr.labels, 30, "natural", seed=0, owners=owners)
    assert len(parts) == 30
    check_partition(parts, len(tr))  # disjoint, every sample once
    for k, p in enumerate(parts):
        assert len(p) > 0 and np.all(owners[p] == k) and np.all(np.diff(p) > 0)
    # the seed plays no part
    again = partition(tr.labels, 30, "natural", seed=9, owners=torch.from_numpy(owners))
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))


def test_natural_partition_errors():
    y = np.zeros(6, dtype=np.int64)
    owners = np.array([0, 1, 2, 0, 1, 2])
    with pytest.raises(ValueError, match="num_clients"):
        partition(y, 4, "natural", owners=owners)
    with pytest.raises(ValueError, match="owners"):
        partition(y, 3, "natural")
    with pytest.raises(ValueError, match="owners"):
        partition(y, 3, "natural", owners=owners[:5])
    with pytest.raises(ValueError, match="owners"):
        partition(y, 3, "natural", owners=np.array([0, 1, 2, 0, 1, -1]))


# ---- presets: two rounds of every variant on a shrunken setup ---------------------------------------
SHRINK = {
    "fedecado-synthetic": {
        "num_clients": 6,
        "data.options.num_users": 6,
        "data.options.max_user_samples": 80,
        "train.hetero.epochs_range": [1, 2],
    },
    "fedaware-synthetic": {"num_clients": 10, "data.options.n_train": 600, "data.options.n_test": 200},
    "kuramoto-synthetic": {"data.options.n_train": 600, "data.options.n_test": 200, "train.epochs": 1},
}


@pytest.mark.parametrize("preset", sorted(SHRINK))
def test_preset_two_rounds(preset, tmp_path):
    base = presets.get(preset)
    assert base.data.name in ("synthetic", "gmm")
    ov = {"rounds": 2, "plots": False, "verbose": False, "progress": False, "out_dir": str(tmp_path), **SHRINK[preset]}
    base = apply_overrides(base, [f"{k}={v}" for k, v in ov.items()])
    for label, var in presets.variants(preset).items():
        cfg = base.copy()
        cfg.algorithm.name = var["name"]
        cfg.algorithm.options = dict(var.get("options", {}))
        s = Simulation(cfg, write_outputs=False)
        summary = s.run()
        assert summary["rounds_completed"] == 2, label
        acc = summary["final_accuracy"]
        assert acc is not None and math.isfinite(acc) and 0.0 <= acc <= 1.0, (label, acc)
        assert bool(torch.isfinite(s.global_flat).all()), label
        # logreg on flat rows: F * C + C parameters (in_features taken from the data)
        F = s.x.shape[1]
        assert s.spec.d == F * 10 + 10, label
    if preset == "fedecado-synthetic":
        owners = s._train.meta["client_ids"]
        assert all(np.all(owners[p.cpu().numpy()] == k) for k, p in enumerate(s.parts))


def test_fedecado_synthetic_model_has_610_params():
    cfg = presets.get("fedecado-synthetic")
    assert cfg.partition.scheme == "natural" and cfg.num_clients == cfg.data.options["num_users"] == 30
    s = Simulation(cfg, write_outputs=False).setup()
    assert s.spec.d == 610 and s.per_round == 9


def _small(seed, extra=()):
    cfg = presets.get("kuramoto-synthetic")
    ov = [
        "rounds=1",
        "verbose=false",
        "progress=false",
        "plots=false",
        "data.options.n_train=400",
        "data.options.n_test=100",
        "train.epochs=1",
        f"seed={seed}",
        *extra,
    ]
    return Simulation(apply_overrides(cfg, ov), write_outputs=False)


def test_generated_data_follows_run_seed_unless_pinned():
    a, b = _small(1).setup(), _small(2).setup()
    assert not torch.equal(a.x, b.x)
    c, d = _small(1, ["data.options.seed=7"]).setup(), _small(2, ["data.options.seed=7"]).setup()
    assert torch.equal(c.x, d.x)
    assert torch.equal(_small(1).setup().x, a.x)


def test_global_loss_is_the_sample_weighted_client_loss():
    s = _small(0)
    s.run()
    m = s.metrics[-1]
    from fedkernels.sim.evaluate import client_losses

    s.spec.load_(s.model, s.global_flat)
    cl = np.array(client_losses(s.model, s.x, s.y, s.parts, range(len(s.parts))))
    n = np.array([p.numel() for p in s.parts], dtype=float)
    assert m["global_loss"] == pytest.approx(float(n @ cl / n.sum()), rel=1e-9)
    assert m["global_loss"] != pytest.approx(m["client_loss_mean"], rel=1e-6)  # unequal shards differ
