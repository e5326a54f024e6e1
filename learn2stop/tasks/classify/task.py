"""The images of a classify run (loaded once, checked, normalised) and the training task the trainer samples."""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from .config import ClassifyConfig
from .data import Augment, ImageDataError, ImageSet, channel_stats, load_dataset, normalize, split_validation

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

    def __init__(self, cfg: ClassifyConfig):
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


def error_loss(logits: Tensor, target: Tensor) -> Tensor:
    """The 0/1 error per image, (B,): the loss of Stage II's oracle when ``stop_loss = "error"``."""
    return (logits.argmax(1) != target).to(logits.dtype)


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
