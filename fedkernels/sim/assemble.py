"""What a simulation is built from (``Simulation.setup``): its device, its data (the dataset
registry, or data a caller injected, with seeded subsets), the client partition, the model (seeded
initialisation), the training transform (augmentation) and the pre-drawn client schedule."""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from .seeds import derive_seed, STREAM_INIT, STREAM_SAMPLING, STREAM_SUBSET
from .config import RunConfig

log = logging.getLogger("fedkernels.sim")

__all__ = [
    "load_data",
    "partition_clients",
    "build_model",
    "train_transform",
    "sample_schedule",
    "resolve_device",
    "deterministic",
    "torch_settings",
]


def _subset(data, n: Optional[int], seed: int, which: int):
    if n is None or n >= len(data.y):
        return data.x, data.y
    g = torch.Generator().manual_seed(derive_seed(seed, STREAM_SUBSET, which))
    idx = torch.randperm(len(data.y), generator=g)[: int(n)].sort().values
    return data.x[idx], data.y[idx]


def load_data(cfg: RunConfig, train=None, test=None) -> Tuple[object, object, Tuple[torch.Tensor, ...], int]:
    """``(train, test, (x, y, xt, yt), num_classes)``: the config's dataset (``train``/``test`` None)
    or the injected one (a seeded random subset when ``data.train_subset``/``test_subset`` ask)."""
    if train is None or test is None:
        from .data import GENERATED, dataset_key, load_dataset

        kw = dict(cfg.data.options)
        if dataset_key(cfg.data.name) in GENERATED:
            kw.setdefault("seed", cfg.seed)  # generated data: a new draw per run seed unless pinned
        kw.setdefault("max_train", cfg.data.train_subset)
        kw.setdefault("max_test", cfg.data.test_subset)
        train, test = load_dataset(cfg.data.name, root=cfg.data.root, **kw)
        x, y, xt, yt = train.x, train.y, test.x, test.y
    else:
        x, y = _subset(train, cfg.data.train_subset, 0, 0)
        xt, yt = _subset(test, cfg.data.test_subset, 0, 1)
    return train, test, (x, y, xt, yt), int(getattr(train, "num_classes", int(y.max()) + 1))


def partition_clients(
    cfg: RunConfig, y: torch.Tensor, train, client_indices: Optional[Sequence] = None
) -> List[torch.Tensor]:
    """The clients' index tensors: ``client_indices`` or the config's seeded partition of ``y``."""
    if client_indices is not None:
        parts = client_indices
    else:
        from .partition import partition

        pseed = cfg.partition.seed if cfg.partition.seed is not None else cfg.seed
        popts = dict(cfg.partition.options)
        if cfg.partition.scheme.lower() == "natural":  # per-sample owners of the data (synthetic)
            popts.setdefault("owners", (getattr(train, "meta", None) or {}).get("client_ids"))
        parts = partition(y.cpu().numpy(), cfg.num_clients, cfg.partition.scheme, pseed, **popts)
    if len(parts) != cfg.num_clients:
        raise ValueError(f"partition gave {len(parts)} clients, expected num_clients={cfg.num_clients}")
    return [torch.as_tensor(np.asarray(p), dtype=torch.long) for p in parts]


def build_model(
    cfg: RunConfig, x: torch.Tensor, num_classes: int, model_fn: Optional[Callable[..., nn.Module]] = None
) -> nn.Module:
    """The run's model for inputs like ``x``, initialised from the run seed's init stream."""
    in_ch = int(x.shape[1]) if x.dim() >= 2 else 1
    size = int(x.shape[-1]) if x.dim() >= 3 else int(x.shape[-1])
    torch.manual_seed(derive_seed(cfg.seed, STREAM_INIT))
    from .lora import wrap  # lora.*: the model wrapped by peft, its LoRA init from the same stream

    if model_fn is not None:
        return wrap(cfg, model_fn(num_classes, in_ch, size))
    from .models import build_model as build

    mopts = dict(cfg.model.options)
    if x.dim() == 2:  # flat [N, F] rows (synthetic, gmm): MLP / logreg take in_features=F
        mopts.setdefault("in_features", int(x.shape[1]))
    return wrap(cfg, build(cfg.model.name, num_classes, in_ch, size, **mopts))


def train_transform(cfg: RunConfig, train, transform: Optional[Callable] = None) -> Optional[Callable]:
    """The train-batch transform: ``transform``, or the dataset's augmentation when ``data.augment``."""
    if transform is not None or not cfg.data.augment:
        return transform
    from .data import Augment

    recipe = cfg.data.augment if isinstance(cfg.data.augment, str) else "auto"
    tr = Augment.for_data(train, recipe) if hasattr(train, "augment") else None
    if tr is None:
        log.warning("data.augment is set but dataset %r has no train transform; training without one", cfg.data.name)
    return tr


def sample_schedule(seed: int, num_clients: int, per_round: int, rounds: int) -> List[List[int]]:
    """Client ids of every round, drawn up front (uniform without replacement, sorted within a
    round). Round r's draw does not depend on ``rounds``: a longer run extends a shorter one."""
    rng = np.random.default_rng(derive_seed(seed, STREAM_SAMPLING, num_clients, per_round))
    out = []
    for _ in range(rounds):
        if per_round >= num_clients:
            out.append(list(range(num_clients)))
            rng.permutation(num_clients)  # keep the stream aligned whatever per_round is
        else:
            out.append(sorted(int(c) for c in rng.choice(num_clients, per_round, replace=False)))
    return out


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available (use device=cpu or auto)")
    return dev


@contextmanager
def deterministic(on: bool):
    """``torch.use_deterministic_algorithms(True, warn_only=True)`` inside (when ``on``); the previous
    setting after."""
    prev = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    if on:
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        if on:
            torch.use_deterministic_algorithms(prev, warn_only=prev_warn)


@contextmanager
def torch_settings(cfg: RunConfig):
    """A run's torch settings inside: ``threads`` (intra-op threads) and deterministic algorithms
    (``deterministic``; default: on CUDA, with cuBLAS's deterministic workspace); the previous ones after."""
    cuda = resolve_device(cfg.device).type == "cuda"
    det = cfg.deterministic if cfg.deterministic is not None else cuda
    if det and cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    prev_threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    try:
        with deterministic(det):
            yield
    finally:
        if cfg.threads:
            torch.set_num_threads(prev_threads)
