"""Image classification data: CIFAR-10/100 (binary, python, the shared subset), Tiny-ImageNet,
class-per-folder trees, single images, and batch augmentation in plain torch.

Every loader returns :class:`ImageSet`: uint8 images (N, C, H, W), int64 labels (N,) and the class
names. Every data problem raises :class:`ImageDataError` naming the file or field. The official
CIFAR python batches are pickles; they are read by :class:`RestrictedUnpickler`, which builds numpy
arrays and nothing else, so a tampered file cannot run code.

Pieces: :mod:`.imageset` (the set, its checks, splits, normalisation and augmentation), :mod:`.cifar` (the
CIFAR formats) and :mod:`.folders` (image files and trees); this module picks the loader of a dataset kind, and
holds the images of a run (:class:`Images`: loaded once, checked, normalised) and the training task the trainer
samples.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from ...utils.registry import Registry
from .cifar import (RestrictedUnpickler, load_cifar_binary, load_cifar_python, load_cifar_subset_npz,  # noqa: F401
                    load_pickle, read_cifar_binary, read_cifar_pickle)
from .folders import load_image_file, load_image_folder, load_tiny_imagenet  # noqa: F401
from .imageset import (CIFAR10_CLASSES, Augment, ImageDataError, ImageSet, channel_stats, check_labels,  # noqa: F401
                       normalize, split_validation)
from .metric import error_loss

__all__ = ["CIFAR10_CLASSES", "DATASETS", "Augment", "ClassifyTask", "ImageDataError", "ImageSet", "Images", "LoadOptions",
           "RestrictedUnpickler",
           "channel_stats", "check_labels", "list_datasets", "load_cifar_binary", "load_cifar_python",
           "load_cifar_subset_npz", "load_dataset", "load_folder_dataset", "load_image_file", "load_image_folder",
           "load_pickle", "load_tiny_imagenet", "normalize", "read_cifar_binary", "read_cifar_pickle", "split_validation",
           "synthetic_set"]


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


# ----------------------------------------------------------------------------- the images of a run
def synthetic_set(n_per_class: int, classes: int, size: int, seed: int) -> ImageSet:
    """Class-coded oriented gratings in colour with noise: an embedded, learnable stand-in."""
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.arange(size, dtype=torch.float32), torch.arange(size, dtype=torch.float32), indexing="ij")
    imgs, labels = [], []
    for k in range(classes):
        angle = torch.pi * k / classes + 0.3 * torch.randn(n_per_class, 1, 1, generator=g)
        freq = 0.3 + 0.05 * torch.rand(n_per_class, 1, 1, generator=g)
        wave = torch.sin(freq * (xx * torch.cos(angle) + yy * torch.sin(angle)))  # (n, H, W)
        colour = torch.rand(n_per_class, 3, 1, 1, generator=g)
        img = 0.5 + 0.35 * wave[:, None] * colour + 0.25 * torch.randn(n_per_class, 3, size, size, generator=g)
        imgs.append((img.clamp(0, 1) * 255).to(torch.uint8))
        labels += [k] * n_per_class
    return ImageSet(torch.cat(imgs).numpy(), np.array(labels), [f"class{k}" for k in range(classes)], "synthetic")


class Images:
    """Train / validation / test sets and the training normalisation, loaded once and checked."""

    def __init__(self, cfg):
        """cfg: a :class:`~learn2stop.tasks.classify.config.ClassifyConfig` (its data section and seed)."""
        d = cfg.data
        if d.kind == "synthetic":
            train = synthetic_set(d.synthetic_per_class, d.synthetic_classes, d.size, cfg.seed)
            test = synthetic_set(max(d.synthetic_per_class // 3, 2), d.synthetic_classes, d.size, cfg.seed + 1)
        else:
            train, test = load_dataset(d.kind, d.path, **({"size": d.size} if d.kind in ("tiny_imagenet", "folder") else {}))
        for s in (train, test):
            if s.image_shape[1:] != (d.size, d.size):
                raise ImageDataError(f"{s.source}: images are {s.image_shape[1]}x{s.image_shape[2]}, but data.size "
                                     f"is {d.size}; set --data.size {s.image_shape[1]}")
        self.train, self.val = split_validation(train, d.val_fraction, cfg.seed)
        self.test, self.classes = test, train.classes
        self.mean, self.std = channel_stats(self.train.images)

    def prepare(self, images: Tensor) -> Tensor:
        return normalize(images, self.mean, self.std)

    def batches(self, split: str, batch: int, device) -> list[tuple[Tensor, Tensor]]:
        s = {"train": self.train, "val": self.val, "test": self.test}[split]
        x, y = s.tensors()
        return [(self.prepare(x[i:i + batch]).to(device), y[i:i + batch].to(device)) for i in range(0, len(s), batch)]


class ClassifyTask:
    """Augmented training batches and the fixed validation set, for the trainer.

    ``stop_loss``: the loss of Stage II's oracle, ``"error"`` (0/1) or ``"cross_entropy"`` (the training loss).
    """

    def __init__(self, images: Images, augment: bool, batch: int, stop_loss: str = "error", cutout: int = 0):
        self.images, self.augment, self.batch = images, Augment(cutout=cutout) if augment else None, batch
        self.x, self.y = images.train.tensors()
        self.stop_loss_fn = error_loss if stop_loss == "error" else self.loss_fn

    @staticmethod
    def loss_fn(logits: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(logits, target, reduction="none")

    def sample_batch(self, n: int, generator: torch.Generator, device):
        idx = torch.randint(len(self.y), (n,), generator=generator)
        x = self.x[idx]
        if self.augment is not None:
            x = self.augment(x, generator)
        return self.images.prepare(x).to(device), self.y[idx].to(device)

    def validation_batches(self, device):
        return self.images.batches("val", self.batch, device)
