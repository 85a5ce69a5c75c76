"""The decoded-dataset cache (fedkernels.sim.data.cache): hit, miss, stale source, corrupted or
truncated entry (decoded again), disabled, unwritable; and through load_dataset on IDX files."""

import gzip
import json
import os
import struct

import numpy as np
import pytest
import torch

from fedkernels.sim.data import cache as cache_mod
from fedkernels.sim.data import files as files_mod
from fedkernels.sim.data.cache import cache_dir, cached_decode


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("FEDKERNELS_CACHE", str(d))
    return d / "decoded"


def write_idx(path, arr):
    arr = np.ascontiguousarray(arr)
    code = {np.dtype(np.uint8): 0x08}[arr.dtype]
    head = struct.pack(">HBB", 0, code, arr.ndim) + b"".join(struct.pack(">I", s) for s in arr.shape)
    with gzip.open(path, "wb") as f:
        f.write(head + arr.tobytes())


class Counting:
    def __init__(self):
        self.calls = 0

    def __call__(self, p):
        self.calls += 1
        return (files_mod.read_idx(p),)


@pytest.fixture
def src(tmp_path):
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, size=(50, 28, 28), dtype=np.uint8)
    p = tmp_path / "imgs-idx3-ubyte.gz"
    write_idx(p, a)
    return p, a


def test_miss_then_hit(cache, src):
    p, a = src
    dec = Counting()
    (x1,) = cached_decode(p, "idx", dec)
    (x2,) = cached_decode(p, "idx", dec)
    assert dec.calls == 1
    assert np.array_equal(x1, a) and np.array_equal(x2, a) and x2.dtype == np.uint8
    man = list(cache.glob("*.json"))
    assert len(man) == 1 and json.loads(man[0].read_text())["arrays"][0]["shape"] == [50, 28, 28]


@pytest.mark.parametrize("damage", ["flip", "truncate", "manifest", "missing"])
def test_damaged_entry_is_decoded_again(cache, src, damage, caplog):
    p, a = src
    dec = Counting()
    cached_decode(p, "idx", dec)
    npy = next(cache.glob("*.0.npy"))
    if damage == "flip":  # one byte of the pixel data changed
        raw = bytearray(npy.read_bytes())
        raw[-10] ^= 0xFF
        npy.write_bytes(bytes(raw))
    elif damage == "truncate":
        npy.write_bytes(npy.read_bytes()[:200])
    elif damage == "manifest":
        next(cache.glob("*.json")).write_text("{not json")
    else:
        npy.unlink()
    (x,) = cached_decode(p, "idx", dec)
    assert dec.calls == 2 and np.array_equal(x, a)
    assert "damaged" in caplog.text
    (x,) = cached_decode(p, "idx", dec)  # the entry was rewritten: a hit again
    assert dec.calls == 2 and np.array_equal(x, a)


def test_changed_source_is_a_miss(cache, src):
    p, a = src
    dec = Counting()
    cached_decode(p, "idx", dec)
    b = a.copy()
    b[0, 0, 0] ^= 1
    write_idx(p, b)
    os.utime(p, ns=(1, 1))  # a different mtime whatever the clock resolution
    (x,) = cached_decode(p, "idx", dec)
    assert dec.calls == 2 and np.array_equal(x, b)


def test_disabled_and_unwritable(tmp_path, src, monkeypatch):
    p, a = src
    monkeypatch.setenv("FEDKERNELS_CACHE", "off")
    assert cache_dir() is None
    dec = Counting()
    cached_decode(p, "idx", dec)
    cached_decode(p, "idx", dec)
    assert dec.calls == 2
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("FEDKERNELS_CACHE", str(blocker))  # a file where the directory should be
    (x,) = cached_decode(p, "idx", dec)
    assert dec.calls == 3 and np.array_equal(x, a)
    monkeypatch.delenv("FEDKERNELS_CACHE")
    assert cache_dir() == cache_mod.Path.home() / ".cache" / "fedkernels" / "decoded"


def test_load_dataset_uses_the_cache(cache, tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    root = tmp_path / "fm"
    root.mkdir()
    arrays = {}
    for split, n in (("train", 60), ("t10k", 20)):
        x = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        y = np.tile(np.arange(10, dtype=np.uint8), n // 10)
        write_idx(root / f"{split}-images-idx3-ubyte.gz", x)
        write_idx(root / f"{split}-labels-idx1-ubyte.gz", y)
        arrays[split] = (x, y)
    from fedkernels.sim.data import load_dataset

    tr1, te1 = load_dataset("fmnist", root=str(root))
    calls = []
    orig = files_mod.read_idx
    monkeypatch.setattr(files_mod, "read_idx", lambda p: calls.append(p) or orig(p))
    tr2, te2 = load_dataset("fmnist", root=str(root))
    assert calls == []  # every file came from the cache
    assert torch.equal(tr1.x, tr2.x) and torch.equal(te1.y, te2.y)
    assert torch.equal(tr2.y, torch.from_numpy(arrays["train"][1].astype(np.int64)))
    assert len(list(cache.glob("*.json"))) == 4
