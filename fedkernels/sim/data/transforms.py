"""Batched tensor transforms (no torchvision) on any device, drawing their randomness from a
``torch.Generator``: :func:`normalize`, :func:`random_crop`, :func:`random_hflip`, and
:class:`Augment` (crop + flip, the CIFAR recipe of the GC-Fed / FedAWARE code). Random-crop padding
uses the value a black pixel takes after normalisation, as torchvision's pad-then-normalise does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence, Union

import torch

if TYPE_CHECKING:
    from .base import TensorData

__all__ = ["normalize", "random_crop", "random_hflip", "Augment"]


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
        raise ValueError(f"mean/std: expected {c} values (one per channel), got {m.numel()}, {s.numel()}")
    if bool((s <= 0).any()):
        raise ValueError("std: every value must be > 0")
    return (x - m.view(-1, 1, 1)) / s.view(-1, 1, 1)


def _rand(shape, generator: Optional[torch.Generator], high: Optional[int] = None) -> torch.Tensor:
    dev = generator.device if generator is not None else torch.device("cpu")
    if high is None:
        return torch.rand(shape, generator=generator, device=dev)
    return torch.randint(0, high, shape, generator=generator, device=dev)


def random_crop(
    x: torch.Tensor,
    size: Optional[int] = None,
    padding: int = 4,
    generator: Optional[torch.Generator] = None,
    fill: Union[float, torch.Tensor] = 0.0,
) -> torch.Tensor:
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
    padded[:, :, padding : padding + h, padding : padding + w] = x
    i = _rand((n,), generator, hp - size + 1).to(x.device)
    j = _rand((n,), generator, wp - size + 1).to(x.device)
    ar = torch.arange(size, device=x.device)
    rows = (i[:, None] + ar)[:, :, None]  # [N, size, 1]
    cols = (j[:, None] + ar)[:, None, :]  # [N, 1, size]
    b = torch.arange(n, device=x.device)[:, None, None]
    out = padded.permute(0, 2, 3, 1)[b, rows, cols]  # [N, size, size, C]
    return out.permute(0, 3, 1, 2).contiguous()


def random_hflip(x: torch.Tensor, p: float = 0.5, generator: Optional[torch.Generator] = None) -> torch.Tensor:
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

    def __init__(
        self,
        crop_padding: int = 4,
        flip: bool = True,
        fill: Union[float, torch.Tensor] = 0.0,
        size: Optional[int] = None,
    ):
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
        return cls(crop_padding=max(1, data.input_shape[1] // 8), flip=True, fill=0.0 if fill is None else fill)

    def __call__(self, x: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        if self.crop_padding > 0:
            x = random_crop(x, self.size, self.crop_padding, generator, self.fill)
        if self.flip:
            x = random_hflip(x, 0.5, generator)
        return x

    def __repr__(self) -> str:
        return f"Augment(crop_padding={self.crop_padding}, flip={self.flip})"
