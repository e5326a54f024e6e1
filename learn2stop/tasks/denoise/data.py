"""Data for blind denoising: training patches, noise, the training / validation / test images and the training task.

Training patches are drawn on the fly from a multi-scale pyramid kept as uint8 (Train400 at 4 scales is about 38 MB),
so memory stays bounded whatever the number of patches: a patch is an index (image, scale, row, column) into a grid
of stride ``stride``, never a stored copy. The noise level is drawn per training patch and never given to the model
(blind denoising). Image files and the embedded dead-leaves default are in :mod:`.images`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from ...core import derive_seed
from .config import DenoiseAppConfig
from .images import ImageDataError, load_folder, synthetic_images
from .metric import sse_loss


# ----------------------------------------------------------------------------- augmentation
NUM_AUGMENTATIONS = 8


def augment(x: Tensor, mode: int) -> Tensor:
    """One of the 8 symmetries of the square on the last two dims: mode = 4 * flip + rotations.

    mode in 0..7: rotate by 90 * (mode % 4) degrees, after a vertical flip if mode >= 4.
    """
    if not 0 <= mode < NUM_AUGMENTATIONS:
        raise ValueError(f"augmentation mode must be in 0..7; got {mode}")
    if mode >= 4:
        x = torch.flip(x, dims=(-2,))
    return torch.rot90(x, k=mode % 4, dims=(-2, -1))


def inverse_augment(x: Tensor, mode: int) -> Tensor:
    """Undo :func:`augment` with the same mode."""
    if not 0 <= mode < NUM_AUGMENTATIONS:
        raise ValueError(f"augmentation mode must be in 0..7; got {mode}")
    x = torch.rot90(x, k=-(mode % 4), dims=(-2, -1))
    if mode >= 4:
        x = torch.flip(x, dims=(-2,))
    return x


# ----------------------------------------------------------------------------- patches
def rescale(img: np.ndarray, scale: float) -> np.ndarray:
    """Bicubic resize of a (H, W) image in [0, 1] by ``scale`` (as DnCNN's data generation)."""
    if scale == 1:
        return img
    from PIL import Image

    h, w = img.shape
    size = (max(int(round(w * scale)), 1), max(int(round(h * scale)), 1))
    out = Image.fromarray(img.astype(np.float32), mode="F").resize(size, Image.BICUBIC)
    return np.clip(np.asarray(out, dtype=np.float32), 0.0, 1.0)


def grid_count(height: int, width: int, patch: int, stride: int) -> int:
    """Number of patch positions on a stride grid (0 if the image is smaller than the patch)."""
    if height < patch or width < patch:
        return 0
    return ((height - patch) // stride + 1) * ((width - patch) // stride + 1)


@dataclass
class PatchBank:
    """Every 50x50 (``patch_size``) patch of a multi-scale pyramid, addressed by one flat index.

    Args:
        images: float32 (H, W) images in [0, 1].
        patch_size, stride: the patch grid on every scaled image.
        scales: resize factors (DnCNN: 1, 0.9, 0.8, 0.7); a scaled image smaller than a patch
            contributes no patch.
    """

    images: Sequence[np.ndarray]
    patch_size: int = 50
    stride: int = 10
    scales: Sequence[float] = (1.0, 0.9, 0.8, 0.7)

    def __post_init__(self):
        if self.patch_size < 1 or self.stride < 1:
            raise ValueError(f"patch_size and stride must be >= 1; got {self.patch_size}, {self.stride}")
        if not self.images:
            raise ImageDataError("no training images to cut patches from")
        # uint8 keeps the pyramid small (4x less than float32), like DnCNN's own patch files
        self._pyramid: list[np.ndarray] = []
        counts = []
        for img in self.images:
            for s in self.scales:
                scaled = rescale(img, s)
                n = grid_count(*scaled.shape, self.patch_size, self.stride)
                if n:
                    self._pyramid.append(np.round(scaled * 255).astype(np.uint8))
                    counts.append(n)
        if not counts:
            smallest = min(min(i.shape) for i in self.images)
            raise ImageDataError(f"every training image is smaller than the {self.patch_size}x{self.patch_size} "
                                 f"patch size (smallest side {smallest}); lower data.patch_size")
        self._cum = torch.tensor(np.cumsum([0] + counts), dtype=torch.long)

    def __len__(self) -> int:
        """Number of distinct patches (before augmentation)."""
        return int(self._cum[-1])

    def patch(self, index: int) -> np.ndarray:
        """Patch ``index`` as float32 (patch_size, patch_size) in [0, 1]."""
        if not 0 <= index < len(self):
            raise IndexError(f"patch index {index} out of range 0..{len(self) - 1}")
        k = int(torch.searchsorted(self._cum, torch.tensor(index), right=True)) - 1
        img = self._pyramid[k]
        local = index - int(self._cum[k])
        cols = (img.shape[1] - self.patch_size) // self.stride + 1
        r, c = divmod(local, cols)
        y, x = r * self.stride, c * self.stride
        return img[y:y + self.patch_size, x:x + self.patch_size].astype(np.float32) / 255.0

    def sample(self, n: int, generator: torch.Generator, augment_patches: bool = True) -> Tensor:
        """``n`` random patches (B, 1, P, P), each with a random symmetry; all draws from ``generator``."""
        idx = torch.randint(len(self), (n,), generator=generator)
        modes = torch.randint(NUM_AUGMENTATIONS if augment_patches else 1, (n,), generator=generator)
        out = [augment(torch.from_numpy(self.patch(int(i))), int(m)) for i, m in zip(idx, modes)]
        return torch.stack(out)[:, None]


# ----------------------------------------------------------------------------- noise
def sample_sigmas(n: int, generator: torch.Generator, sigma_max: float = 55.0,
                  sigma_set: Sequence[float] = ()) -> Tensor:
    """Noise levels on the 0..255 scale: uniform on [0, sigma_max] or drawn from ``sigma_set``."""
    if sigma_set:
        choices = torch.tensor([float(s) for s in sigma_set])
        return choices[torch.randint(len(choices), (n,), generator=generator)]
    return torch.rand(n, generator=generator) * sigma_max


def add_noise(clean: Tensor, sigma: Tensor | float, generator: torch.Generator) -> Tensor:
    """clean + N(0, (sigma/255)^2) per image; ``sigma`` is per image (B,) or one number, on 0..255."""
    sigma = torch.as_tensor(sigma, dtype=clean.dtype)
    if (sigma < 0).any():
        raise ValueError(f"noise level sigma must be >= 0; got {sigma.min().item()}")
    sigma = sigma.reshape(-1, *([1] * (clean.dim() - 1))) if sigma.dim() else sigma
    noise = torch.randn(clean.shape, generator=generator, dtype=clean.dtype)
    return clean + noise * (sigma / 255.0)


# ----------------------------------------------------------------------------- images
def load_training_images(cfg: DenoiseAppConfig) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(train images, validation images): a seeded, disjoint split of the training folder (or dead leaves)."""
    d = cfg.data
    if d.train_dir:
        images, _ = load_folder(d.train_dir, min_size=d.patch_size)
        images = images[:d.max_train_images] if d.max_train_images else images
    else:
        images = synthetic_images(d.synthetic_train, d.synthetic_size, seed=derive_seed(cfg.seed, "dead-leaves-train") % 2**32)
    if len(images) < 2:
        raise ImageDataError(f"need >= 2 training images (training and validation split); found {len(images)}")
    perm = np.random.default_rng(cfg.seed).permutation(len(images))
    n_val = min(max(1, int(round(d.val_fraction * len(images)))), len(images) - 1)
    return [images[i] for i in perm[n_val:]], [images[i] for i in perm[:n_val]]


def load_test_images(cfg: DenoiseAppConfig) -> tuple[list[np.ndarray], list[str]]:
    """(test images, file names): the test folder, or dead-leaves images from another seed."""
    d = cfg.data
    if d.test_dir:
        images, names = load_folder(d.test_dir)
    else:
        images = synthetic_images(d.synthetic_test, d.synthetic_size, seed=derive_seed(cfg.seed, "dead-leaves-test") % 2**32)
        names = [f"dead_leaves_{i:03d}.png" for i in range(len(images))]
    if d.max_test_images:
        images, names = images[:d.max_test_images], names[:d.max_test_images]
    return images, names


@dataclass
class NoisyImage:
    """One evaluation sample: an image at one noise level, with its own seeded noise."""

    noisy: torch.Tensor  # (1, 1, H, W)
    clean: torch.Tensor  # (1, 1, H, W)
    sigma: float
    name: str


def eval_samples(cfg: DenoiseAppConfig, split: str) -> list[NoisyImage]:
    """Every image of ``split`` ("test", or "val": the validation images) at every ``eval.sigmas``, image-major.

    Each (image i, sigma) gets its own noise, seeded by (eval.seed, split, sigma, i): the same on every call.
    """
    if split == "test":
        images, names = load_test_images(cfg)
    else:
        images = load_training_images(cfg)[1]
        names = [f"val_{i:03d}" for i in range(len(images))]
    out = []
    for i, (img, name) in enumerate(zip(images, names)):
        clean = torch.from_numpy(img)[None, None]
        for sigma in cfg.eval.sigmas:
            g = torch.Generator().manual_seed(derive_seed(cfg.eval.seed, f"{split}-noise", float(sigma), i))
            out.append(NoisyImage(add_noise(clean, float(sigma), g), clean, float(sigma), name))
    return out


# ----------------------------------------------------------------------------- training
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
