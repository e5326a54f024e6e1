"""Image files for blind denoising, in and out, and the embedded synthetic default (dead-leaves images).

Images are float32 arrays in [0, 1] of shape (H, W) (one grey channel).
"""
from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
from torch import Tensor

from ...utils.checkpoint import atomic_write
from ...utils.images import list_image_files, read_image


class ImageDataError(ValueError):
    """A folder or image that cannot be used; the message names the path."""


# ----------------------------------------------------------------------------- loading
def list_images(folder: str | Path) -> list[Path]:
    """Sorted image files of ``folder`` (by suffix, hidden files skipped); a clear error if it is missing or has none."""
    return list_image_files(folder, error=ImageDataError)


def load_image(path: str | Path) -> np.ndarray:
    """One image as float32 (H, W) in [0, 1] (read by :func:`utils.images.read_image`): 16-bit images
    scaled by 65535, float images above 1 rescaled by their maximum, colour converted to grey
    (ITU-R 601 luma), each with a warning naming the file.

    Raises:
        ImageDataError: if the file is missing, unreadable, too large or not an image.
    """
    img, notes = read_image(path, channels=1, error=ImageDataError)
    for note in notes:
        warnings.warn(note + ("; the denoiser works on one grey channel" if "converted" in note else ""), stacklevel=2)
    return img[0]


def check_image_size(img: np.ndarray, path: str | Path, min_size: int,
                     reason: str = "patch size; remove it or lower data.patch_size") -> None:
    """Raise ImageDataError naming the file if either side of a (H, W) image is below ``min_size``."""
    if min(img.shape) < min_size:
        raise ImageDataError(f"image {path} is {img.shape[1]}x{img.shape[0]} (width x height), smaller than "
                             f"the {min_size}x{min_size} {reason}")


def load_folder(folder: str | Path, min_size: int = 1,
                reason: str = "patch size; remove it or lower data.patch_size") -> tuple[list[np.ndarray], list[str]]:
    """All images of a folder and their file names; an image with a side below ``min_size`` is an error.

    ``reason`` ends the message: what the minimum is and what to do (default: the training patch).
    """
    images, names = [], []
    for path in list_images(folder):
        img = load_image(path)
        check_image_size(img, path, min_size, reason)
        images.append(img)
        names.append(path.name)
    return images, names


def save_image(img: np.ndarray | Tensor, path: str | Path) -> None:
    """Write an image in [0, 1] as 8-bit grey (PNG by suffix), atomically (a temporary file renamed into place).

    ``img``: (H, W), or (1, H, W) / (1, 1, H, W) with the leading singleton dims dropped, so a
    1xN or 1x1 image keeps its orientation (a bare ``squeeze`` would not).
    """
    from PIL import Image

    if isinstance(img, Tensor):
        img = img.detach().cpu().numpy()
    arr = np.asarray(img, dtype=np.float32)
    while arr.ndim > 2 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 2 or arr.size == 0:
        raise ImageDataError(f"cannot save {path}: expected a (H, W) grey image; got shape {np.asarray(img).shape}")
    if not np.isfinite(arr).all():
        raise ImageDataError(f"cannot save {path}: the image holds NaN or infinite values")
    arr = np.clip(arr, 0, 1)
    if Path(path).is_dir():
        raise ImageDataError(f"cannot save {path}: it is a folder")
    blocker = next((p for p in Path(path).parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ImageDataError(f"cannot save {path}: {blocker} is a file, not a folder")
    fmt = Image.registered_extensions().get(Path(path).suffix.lower())
    if fmt is None:
        raise ImageDataError(f"cannot save {path}: {Path(path).suffix or 'no suffix'} is not an image format; use .png")
    image = Image.fromarray((arr * 255.0 + 0.5).astype(np.uint8), mode="L")
    atomic_write(path, lambda f: image.save(f, format=fmt), public=True)  # a kill leaves the old file or none, never half


# ----------------------------------------------------------------------------- synthetic default
def dead_leaves_image(size: int, generator: np.random.Generator, r_min: float = 1.5, r_max: float | None = None,
                      num_shapes: int | None = None) -> np.ndarray:
    """A grey "dead leaves" image: occluding discs with power-law radii and textured grey levels.

    The dead-leaves model reproduces the scale invariance, occlusions and edge statistics of
    natural images (Lee, Mumford & Huang 2001); denoisers trained on it come close to those
    trained on photographs (Achddou et al. 2021). It lets the CLI run with no user data and
    nothing downloaded. Radii follow p(r) ~ r^-3 on [r_min, r_max]; each disc gets a grey level,
    a linear shading and, for some, a sinusoidal texture; later discs lie under earlier ones.

    Returns:
        float32 (size, size) in [0, 1].
    """
    r_max = r_max or size / 3
    num_shapes = num_shapes or int(6 * size * size / (r_min * 40))
    img = np.full((size, size), np.nan, dtype=np.float32)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    # inverse-CDF sampling of p(r) ~ r^-3 on [r_min, r_max]
    u = generator.random(num_shapes)
    radii = (r_min ** -2 - u * (r_min ** -2 - r_max ** -2)) ** -0.5
    for r in radii:
        cy, cx = generator.uniform(-r, size + r, size=2)
        y0, y1 = max(int(cy - r), 0), min(int(cy + r) + 2, size)
        x0, x1 = max(int(cx - r), 0), min(int(cx + r) + 2, size)
        if y0 >= y1 or x0 >= x1:
            continue
        sub_y, sub_x = yy[y0:y1, x0:x1], xx[y0:y1, x0:x1]
        inside = ((sub_y - cy) ** 2 + (sub_x - cx) ** 2 <= r * r) & np.isnan(img[y0:y1, x0:x1])
        if not inside.any():
            continue
        level = generator.uniform(0.05, 0.95)
        gy, gx = generator.normal(0, 0.15 / max(r, 4.0), size=2)
        value = level + gy * (sub_y - cy) + gx * (sub_x - cx)
        if generator.random() < 0.3:  # a striped texture on some leaves
            freq, angle = generator.uniform(0.3, 1.2), generator.uniform(0, math.pi)
            value = value + 0.08 * np.sin(freq * (np.cos(angle) * sub_x + np.sin(angle) * sub_y))
        block = img[y0:y1, x0:x1]
        block[inside] = value[inside]
        if not np.isnan(img).any():
            break
    img[np.isnan(img)] = generator.uniform(0.05, 0.95)
    # a light blur so that edges are anti-aliased, as in photographs
    k = np.array([0.25, 0.5, 0.25], dtype=np.float32)
    img = np.apply_along_axis(lambda v: np.convolve(np.pad(v, 1, mode="edge"), k, mode="valid"), 0, img)
    img = np.apply_along_axis(lambda v: np.convolve(np.pad(v, 1, mode="edge"), k, mode="valid"), 1, img)
    return np.clip(img, 0.0, 1.0).astype(np.float32)


def synthetic_images(count: int, size: int, seed: int) -> list[np.ndarray]:
    """``count`` dead-leaves images of ``size`` x ``size``, deterministic in ``seed``."""
    return [dead_leaves_image(size, np.random.default_rng([seed, i])) for i in range(count)]
