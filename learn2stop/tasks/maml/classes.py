"""The few-shot image interface: a list of classes, each a list of images (:class:`ClassImages`), its
rotated variant, and the checks every loader applies (unique, disjoint class names)."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import Tensor


class DataError(ValueError):
    """A dataset folder or file is missing, in the wrong layout, or corrupt; the message says which."""


def _listing(names: Sequence[str], limit: int = 5) -> str:
    names = list(names)
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" ... ({len(names)} in all)" if len(names) > limit else "")


def duplicates(names: Sequence[str]) -> list[str]:
    """Names that occur more than once, sorted."""
    seen, twice = set(), set()
    for n in names:
        (twice if n in seen else seen).add(n)
    return sorted(twice)


def check_disjoint(splits: dict[str, Sequence[str]], what: str = "classes") -> None:
    """Raise DataError if a name occurs twice in one split or in two splits (a train/test leak).

    Example:
        >>> check_disjoint({"train": ["a/1", "a/2"], "test": ["a/2"]})
        Traceback (most recent call last):
        ...
        learn2stop.tasks.maml.data.DataError: 1 of the classes are in both the train and the test split: 'a/2'
    """
    for split, names in splits.items():
        dup = duplicates(names)
        if dup:
            raise DataError(f"the {split} split lists {len(dup)} of the {what} twice: {_listing(dup)}")
    parts = list(splits.items())
    for i, (a, names_a) in enumerate(parts):
        for b, names_b in parts[i + 1:]:
            both = sorted(set(names_a) & set(names_b))
            if both:
                raise DataError(f"{len(both)} of the {what} are in both the {a} and the {b} split: {_listing(both)}")


# ----------------------------------------------------------------------------- the interface
class ClassImages:
    """Images grouped by class, held in memory as one uint8 array (see :class:`MiniImagenet` for lazy loading).

    Args:
        images: uint8 array (n_classes, n_per_class, H, W) (grayscale) or
            (n_classes, n_per_class, H, W, 3) (RGB).
        names: one name per class (error messages, splits).
        invert: map x -> 1 - x / 255 (Omniglot: ink = 1), else x / 255.
    """

    def __init__(self, images: np.ndarray, names: Sequence[str], invert: bool = False):
        if images.ndim not in (4, 5) or (images.ndim == 5 and images.shape[-1] != 3):
            raise DataError(f"images must be (classes, per_class, H, W[, 3]); got shape {images.shape}")
        if min(images.shape[1:4]) < 1:
            raise DataError(f"images must have >= 1 image per class and >= 1 pixel a side; got shape {images.shape}")
        if len(names) != images.shape[0]:
            raise DataError(f"{len(names)} class names for {images.shape[0]} classes")
        dup = duplicates(names)
        if dup:
            raise DataError(f"class names must be unique (a repeated name mislabels images); given twice: {_listing(dup)}")
        self.array, self.names, self.invert = images, list(names), invert

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of every image."""
        h, w = self.array.shape[2:4]
        return (3 if self.array.ndim == 5 else 1, h, w)

    @property
    def num_classes(self) -> int:
        return len(self.names)

    @property
    def class_sizes(self) -> list[int]:
        return [self.array.shape[1]] * self.num_classes

    def images(self, c: int, idx: Tensor) -> Tensor:
        """Images ``idx`` of class ``c`` as float (n, C, H, W) in [0, 1]."""
        x = torch.from_numpy(np.ascontiguousarray(self.array[c, idx.numpy()])).float() / 255.0
        if self.invert:
            x = 1.0 - x
        return x.permute(0, 3, 1, 2) if x.dim() == 4 else x.unsqueeze(1)


class RotatedClasses:
    """Class augmentation: every class also rotated by 90, 180 and 270 degrees as new classes.

    Class ``4 * c + k`` is class ``c`` of ``base`` rotated by ``k * 90`` degrees (MAML's Omniglot).
    """

    def __init__(self, base):
        c, h, w = base.image_shape
        if h != w:
            raise DataError(f"rotation augmentation needs square images; got {h}x{w} (a 90-degree turn changes the size)")
        self.base = base
        self.names = [f"{n}@rot{90 * k}" for n in base.names for k in range(4)]

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return self.base.image_shape

    @property
    def num_classes(self) -> int:
        return 4 * self.base.num_classes

    @property
    def class_sizes(self) -> list[int]:
        return [s for s in self.base.class_sizes for _ in range(4)]

    def images(self, c: int, idx: Tensor) -> Tensor:
        return torch.rot90(self.base.images(c // 4, idx), k=c % 4, dims=(-2, -1))
