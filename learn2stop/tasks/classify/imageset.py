"""The image set every classify loader returns, its checks, splits, normalisation and batch augmentation."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


class ImageDataError(ValueError):
    """A data file, folder or field that cannot be used; the message names it."""


@dataclass
class ImageSet:
    """A labelled image set held in memory.

    Attributes:
        images: uint8 (N, C, H, W).
        labels: int64 (N,), each in [0, len(classes)).
        classes: class names; label k is ``classes[k]``.
        source: the file or folder it came from (named in errors).
        notes: conversions made while loading (grey -> RGB, resized, ...), one line per file.
    """

    images: np.ndarray
    labels: np.ndarray
    classes: list[str]
    source: str = ""
    notes: list[str] = field(default_factory=list)

    def __post_init__(self):
        where = self.source or "image set"
        self.images, self.labels = np.asarray(self.images), np.asarray(self.labels)
        if self.images.dtype != np.uint8 or self.images.ndim != 4:
            raise ImageDataError(f"{where}: images must be uint8 (N, C, H, W); got {self.images.dtype} {self.images.shape}")
        if self.labels.ndim != 1 or len(self.labels) != len(self.images):
            raise ImageDataError(f"{where}: {len(self.images)} images but labels of shape {self.labels.shape}")
        if not np.issubdtype(self.labels.dtype, np.integer):
            raise ImageDataError(f"{where}: labels must be integers; got {self.labels.dtype}")
        self.labels = self.labels.astype(np.int64)
        check_labels(self.labels, len(self.classes), where)

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of every image."""
        return tuple(self.images.shape[1:])

    def subset(self, index: np.ndarray, source: str | None = None) -> "ImageSet":
        """The images at ``index`` (same classes)."""
        return ImageSet(self.images[index], self.labels[index], list(self.classes), source or self.source)

    def tensors(self) -> tuple[Tensor, Tensor]:
        """(uint8 (N, C, H, W), int64 (N,)) torch tensors sharing memory with the arrays."""
        return torch.from_numpy(self.images), torch.from_numpy(self.labels)


def check_labels(labels: np.ndarray, num_classes: int, where: str) -> None:
    """Refuse labels outside [0, num_classes), naming ``where`` and the first bad value."""
    if num_classes < 1:
        raise ImageDataError(f"{where}: no class names")
    bad = (labels < 0) | (labels >= num_classes)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ImageDataError(f"{where}: label {int(labels[i])} (sample {i}) is outside [0, {num_classes}); "
                             f"{int(bad.sum())} labels are out of range")


def _warn_notes(notes: list[str], where: str) -> None:
    if notes:
        shown = "; ".join(notes[:3]) + (f"; and {len(notes) - 3} more" if len(notes) > 3 else "")
        warnings.warn(f"{where}: {len(notes)} image(s) converted: {shown}", stacklevel=3)


# ----------------------------------------------------------------------------- splits
def split_validation(data: ImageSet, fraction: float, seed: int) -> tuple[ImageSet, ImageSet]:
    """(train, val): a seeded split holding out ``fraction`` of each class (at least one where it has 2+)."""
    if not 0 < fraction < 1:
        raise ValueError(f"validation fraction must be in (0, 1); got {fraction}")
    rng = np.random.default_rng(seed)
    val = []
    for k in range(data.num_classes):
        idx = np.flatnonzero(data.labels == k)
        take = min(max(int(round(fraction * len(idx))), 1 if len(idx) > 1 else 0), len(idx) - 1) if len(idx) else 0
        val.append(rng.permutation(idx)[:take])
    held = np.zeros(len(data), dtype=bool)
    held[np.concatenate(val)] = True
    if not held.any():
        raise ImageDataError(f"{data.source}: too few images ({len(data)}) to hold out a validation split")
    return (data.subset(np.flatnonzero(~held), f"{data.source} [train part]"),
            data.subset(np.flatnonzero(held), f"{data.source} [validation part]"))


# ----------------------------------------------------------------------------- tensors
def channel_stats(images: np.ndarray | Tensor, chunk: int = 4096) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of uint8 images (N, C, H, W), on the [0, 1] scale (chunked, float64)."""
    x = torch.as_tensor(images)
    if x.dim() != 4:
        raise ValueError(f"channel_stats expects images (N, C, H, W); got {tuple(x.shape)}")
    scale = 255.0 if x.dtype == torch.uint8 else 1.0
    total = torch.zeros(x.shape[1], dtype=torch.float64)
    squares = torch.zeros_like(total)
    for i in range(0, x.shape[0], chunk):
        part = x[i:i + chunk].to(torch.float64) / scale  # (b, C, H, W)
        total += part.sum(dim=(0, 2, 3))
        squares += (part ** 2).sum(dim=(0, 2, 3))
    n = x.shape[0] * x.shape[2] * x.shape[3]
    mean = total / n
    std = (squares / n - mean ** 2).clamp_min(0).sqrt()
    return tuple(mean.tolist()), tuple(std.tolist())


def normalize(images: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """(x / 255 - mean) / std per channel: uint8 (B, C, H, W) -> float32 (float input taken as [0, 1])."""
    x = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
    m = torch.as_tensor(mean, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    s = torch.as_tensor(std, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    if m.shape[1] != x.shape[1] or s.shape[1] != x.shape[1]:
        raise ValueError(f"mean/std have {m.shape[1]}/{s.shape[1]} channels, images have {x.shape[1]}")
    return (x - m) / s


class Augment:
    """Random crop after zero padding, random horizontal flip and optional cutout, per image, on (B, C, H, W).

    The standard CIFAR augmentation (pad 4, crop 32, flip), in plain torch on any device and dtype;
    ``cutout`` > 0 then zeroes a square of that side centred anywhere in the image, clipped at its border
    (DeVries & Taylor, 2017). All draws come from the ``generator`` given at each call (a CPU generator),
    so runs repeat; cutout draws last, so without it the batches are those of the plain augmentation.
    """

    def __init__(self, pad: int = 4, flip: bool = True, cutout: int = 0):
        if pad < 0:
            raise ValueError(f"pad must be >= 0; got {pad}")
        if cutout < 0:
            raise ValueError(f"cutout must be >= 0; got {cutout}")
        self.pad, self.flip, self.cutout = pad, flip, cutout

    def __call__(self, images: Tensor, generator: torch.Generator) -> Tensor:
        B, C, H, W = images.shape
        dev = images.device
        x = images
        if self.pad:
            p = self.pad
            x = F.pad(images, (p, p, p, p))  # (B, C, H + 2p, W + 2p), zeros
            dy = torch.randint(0, 2 * p + 1, (B,), generator=generator).to(dev)
            dx = torch.randint(0, 2 * p + 1, (B,), generator=generator).to(dev)
            rows = (dy[:, None] + torch.arange(H, device=dev))[:, :, None]  # (B, H, 1)
            cols = (dx[:, None] + torch.arange(W, device=dev))[:, None, :]  # (B, 1, W)
            x = x[torch.arange(B, device=dev)[:, None, None], :, rows, cols].permute(0, 3, 1, 2)  # (B, C, H, W)
        if self.flip:
            flip = (torch.rand(B, generator=generator) < 0.5).to(dev).view(B, 1, 1, 1)
            x = torch.where(flip, x.flip(-1), x)
        if self.cutout:
            cy = torch.randint(0, H, (B,), generator=generator).to(dev).view(B, 1, 1, 1)
            cx = torch.randint(0, W, (B,), generator=generator).to(dev).view(B, 1, 1, 1)
            top, left = cy - self.cutout // 2, cx - self.cutout // 2
            r = torch.arange(H, device=dev).view(1, 1, H, 1)
            c = torch.arange(W, device=dev).view(1, 1, 1, W)
            hole = (r >= top) & (r < top + self.cutout) & (c >= left) & (c < left + self.cutout)
            x = x.masked_fill(hole, 0)
        return x.contiguous()
