"""The in-memory dataset type and the deterministic, stratified splits every loader uses."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Tuple

import numpy as np
import torch

__all__ = ["TensorData", "DatasetNotFoundError", "stratified_split", "stratified_subsample", "subsample"]


class DatasetNotFoundError(FileNotFoundError):
    """A dataset's files are missing; the message says how to get them."""


@dataclass
class TensorData:
    """An in-memory dataset: ``x`` float32 [N, C, H, W] (or [N, F]), ``y`` int64 [N]."""

    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    name: str
    input_shape: Tuple[int, ...]  # x.shape[1:]
    mean: Optional[Tuple[float, ...]] = None  # normalisation applied (per channel), if any
    std: Optional[Tuple[float, ...]] = None
    augment: Optional[str] = None  # suggested train augmentation ("crop_flip")
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
        if owners is not None and len(owners) == len(self):  # per-sample owners follow the rows
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


def stratified_split(y: np.ndarray, test_fraction: float = 0.2, seed: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """(train_idx, test_idx), stratified by label; the test set has ceil(fraction * N) rows."""
    y = np.asarray(y)
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    n_test = int(np.ceil(test_fraction * len(y)))
    test = stratified_subsample(y, n_test, seed)
    mask = np.ones(len(y), dtype=bool)
    mask[test] = False
    return np.flatnonzero(mask), test


def subsample(x, y, owners, n: Optional[int], seed: int):
    """A stratified, deterministic subset of ``n`` rows of (x, y, owners) (all when n is None)."""
    if n is None:
        return x, y, owners
    keep = stratified_subsample(y, int(n), seed)
    return x[keep], y[keep], (None if owners is None else owners[keep])
