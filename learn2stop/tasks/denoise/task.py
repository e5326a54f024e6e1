"""The training task the core trainer needs: blind Gaussian denoising of image patches."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from .data import PatchBank, add_noise, sample_sigmas


def sse_loss(output: Tensor, target: Tensor) -> Tensor:
    """Per-image sum of squared errors (B,), the scale on which the paper sets beta = 0.1."""
    return ((output - target) ** 2).flatten(1).sum(dim=1)


class DenoiseTask:
    """Random noisy training patches and a fixed validation set, for :class:`StagedTrainer`.

    Blind setting: the noise level is drawn per patch and never given to the model.

    Args:
        train_images: float32 (H, W) images in [0, 1] for training patches.
        val_images: other images (a split of the training folder, never the test set).
        patch_size, stride, scales: the multi-scale patch grid (:class:`PatchBank`).
        sigma_max: training sigma ~ U[0, sigma_max] (paper), unless ``sigma_set`` is given (release: 35, 45, 55).
        val_sigmas: noise levels cycled over the validation patches.
        val_patches: number of fixed validation patches (cut from the validation images).
        seed: seeds the validation patches and their noise.
    """

    def __init__(self, train_images: Sequence[np.ndarray], val_images: Sequence[np.ndarray], *, patch_size: int = 50,
                 stride: int = 10, scales: Sequence[float] = (1.0, 0.9, 0.8, 0.7), sigma_max: float = 55.0,
                 sigma_set: Sequence[float] = (), val_sigmas: Sequence[float] = (15, 25, 35, 45, 55),
                 val_patches: int = 128, val_batch: int = 64, seed: int = 0):
        if sigma_max < 0 or any(s < 0 for s in sigma_set):
            raise ValueError(f"noise levels must be >= 0; got sigma_max={sigma_max}, sigma_set={tuple(sigma_set)}")
        self.bank = PatchBank(list(train_images), patch_size=patch_size, stride=stride, scales=tuple(scales))
        self.sigma_max, self.sigma_set = float(sigma_max), tuple(float(s) for s in sigma_set)
        val_bank = PatchBank(list(val_images), patch_size=patch_size, stride=stride, scales=(1.0,))
        g = torch.Generator().manual_seed(seed)
        clean = val_bank.sample(val_patches, g, augment_patches=False)  # (N, 1, P, P)
        sig = torch.tensor([float(val_sigmas[i % len(val_sigmas)]) for i in range(val_patches)])
        noisy = add_noise(clean, sig, g)
        self._val = [(noisy[i:i + val_batch], clean[i:i + val_batch]) for i in range(0, val_patches, val_batch)]

    def loss_fn(self, output: Tensor, target: Tensor) -> Tensor:
        return sse_loss(output, target)

    def sample_batch(self, batch_size: int, generator: torch.Generator, device) -> tuple[Tensor, Tensor]:
        """(noisy, clean) patches (B, 1, P, P); patch, symmetry, sigma and noise all from ``generator``."""
        clean = self.bank.sample(batch_size, generator)
        sigma = sample_sigmas(batch_size, generator, self.sigma_max, self.sigma_set)
        noisy = add_noise(clean, sigma, generator)
        return noisy.to(device), clean.to(device)

    def validation_batches(self, device):
        return [(n.to(device), c.to(device)) for n, c in self._val]
