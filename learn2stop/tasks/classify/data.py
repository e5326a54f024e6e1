"""Image classification data: CIFAR-10/100 (binary, python, the shared subset), Tiny-ImageNet,
class-per-folder trees, single images, and batch augmentation in plain torch.

Every loader returns :class:`ImageSet`: uint8 images (N, C, H, W), int64 labels (N,) and the class
names. Every data problem raises :class:`ImageDataError` naming the file or field. The official
CIFAR python batches are pickles; they are read by :class:`RestrictedUnpickler`, which builds numpy
arrays and nothing else, so a tampered file cannot run code.

Pieces: :mod:`.imageset` (the set, its checks, splits, normalisation and augmentation), :mod:`.cifar` (the
CIFAR formats) and :mod:`.folders` (image files and trees); this module picks the loader of a dataset kind.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ...utils.registry import Registry
from .cifar import (RestrictedUnpickler, load_cifar_binary, load_cifar_python, load_cifar_subset_npz,  # noqa: F401
                    load_pickle, read_cifar_binary, read_cifar_pickle)
from .folders import load_image_file, load_image_folder, load_tiny_imagenet  # noqa: F401
from .imageset import (CIFAR10_CLASSES, Augment, ImageDataError, ImageSet, channel_stats, check_labels,  # noqa: F401
                       normalize, split_validation)

__all__ = ["CIFAR10_CLASSES", "DATASETS", "Augment", "ImageDataError", "ImageSet", "LoadOptions", "RestrictedUnpickler",
           "channel_stats", "check_labels", "list_datasets", "load_cifar_binary", "load_cifar_python",
           "load_cifar_subset_npz", "load_dataset", "load_folder_dataset", "load_image_file", "load_image_folder",
           "load_pickle", "load_tiny_imagenet", "normalize", "read_cifar_binary", "read_cifar_pickle", "split_validation"]


# ----------------------------------------------------------------------------- the dispatcher
@dataclass
class LoadOptions:
    """Options of :func:`load_dataset`; each loader reads the ones it needs."""

    size: int | None = None  # image side for file loaders (Tiny-ImageNet: 64)
    in_channels: int = 3
    resize: bool = True
    test_fraction: float = 0.2  # "folder" with one tree: the share held out as the test split
    seed: int = 0

    def __post_init__(self):
        if self.size is not None and (not isinstance(self.size, int) or self.size < 1):
            raise ValueError(f"size must be an integer >= 1 or None; got {self.size!r}")
        if self.in_channels not in (1, 3):
            raise ValueError(f"in_channels must be 1 or 3; got {self.in_channels!r}")
        if not 0 < self.test_fraction < 1:
            raise ValueError(f"test_fraction must be in (0, 1); got {self.test_fraction!r}")


DATASETS: Registry[Callable[[Path, LoadOptions], tuple[ImageSet, ImageSet]]] = Registry("dataset kind")
DATASETS.register("cifar_subset_npz")(lambda path, o: load_cifar_subset_npz(path))
DATASETS.register("cifar10_bin")(lambda path, o: load_cifar_binary(path, 10))
DATASETS.register("cifar100_bin")(lambda path, o: load_cifar_binary(path, 100))
DATASETS.register("cifar10_py")(lambda path, o: load_cifar_python(path, 10))
DATASETS.register("cifar100_py")(lambda path, o: load_cifar_python(path, 100))
DATASETS.register("tiny_imagenet")(lambda path, o: load_tiny_imagenet(path, o.size or 64, o.in_channels, o.resize))


@DATASETS.register("folder")
def load_folder_dataset(path: Path, o: LoadOptions) -> tuple[ImageSet, ImageSet]:
    """``path/train`` and ``path/test`` trees if both exist (test read with the training classes);
    else one tree ``path/<class>/...`` split by class into train and test (``test_fraction``, ``seed``)."""
    path = Path(path)
    if (path / "train").is_dir() and (path / "test").is_dir():
        train = load_image_folder(path / "train", o.size, o.in_channels, o.resize)
        size = o.size or train.images.shape[-1]
        test = load_image_folder(path / "test", size, o.in_channels, o.resize, classes=train.classes)
        if test.image_shape != train.image_shape:
            raise ImageDataError(f"{path / 'test'}: images {test.image_shape} differ from the training images "
                                 f"{train.image_shape}")
        return train, test
    train, test = split_validation(load_image_folder(path, o.size, o.in_channels, o.resize), o.test_fraction, o.seed)
    train.source, test.source = f"{path} [train part]", f"{path} [test part]"
    return train, test


def list_datasets() -> list[str]:
    return DATASETS.names()


def load_dataset(kind: str, path: str | Path, **options) -> tuple[ImageSet, ImageSet]:
    """(train, test) :class:`ImageSet` of a dataset kind (:func:`list_datasets`) at ``path``.

    ``options`` are :class:`LoadOptions` fields. Hold a validation split out of train with
    :func:`split_validation`; report on test only.
    """
    loader = DATASETS.get(kind)
    unknown = sorted(set(options) - set(LoadOptions.__dataclass_fields__))
    if unknown:
        raise ValueError(f"unknown dataset option(s) {', '.join(unknown)}; "
                         f"options: {', '.join(LoadOptions.__dataclass_fields__)}")
    train, test = loader(Path(path), LoadOptions(**options))
    present = np.unique(train.labels)
    if len(present) < 2:  # one class is no classification: every loss would be 0
        raise ImageDataError(f"{train.source}: the training images hold {len(present)} class(es) "
                             f"({', '.join(train.classes[int(k)] for k in present) or 'none'}); a classifier needs at least 2")
    return train, test
