"""Reading image files, once for every task: the bit depth scaled, oversized files refused, folders listed.

:func:`read_image` returns float32 (C, H, W) in [0, 1] whatever the file holds: 8-bit images are
divided by 255, 16-bit ones (PNG, TIFF) by 65535, float images (TIFF) are taken as they are when they
lie in [0, 1] and otherwise rescaled by their maximum, with a note. Colour is converted to grey or RGB
as asked (with a note), and an image of another size is resized (with a note) or refused. A photo is read
the way up a viewer shows it: its EXIF orientation (a camera's sideways or mirrored rows) is applied first,
with a note, so that sizes, resizing and pixels are those of the upright image. A file too large to decode
safely (a "decompression bomb") is refused from its header, before any pixel is read.
:func:`list_image_files` lists a folder's image files, skipping hidden files (``.DS_Store``, ``._a.png``).

Every problem raises the caller's error class (default :class:`ImageReadError`) with a one-line
message naming the file.

Example:
    >>> img, notes = read_image("photo.png", channels=3, size=32)  # doctest: +SKIP
    >>> img.shape, img.dtype
    ((3, 32, 32), dtype('float32'))
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")
#: more pixels than this are refused (Pillow's own bomb limit is 89 Mpixels; a 20k x 20k image is 400).
MAX_PIXELS = 100_000_000

#: the EXIF orientation tag, and what each of its values other than 1 (as stored) asks a viewer to do.
_ORIENTATION = 0x0112
_TURNS = {2: "mirrored left to right", 3: "turned 180 degrees", 4: "flipped top to bottom",
          5: "mirrored along its main diagonal", 6: "turned 90 degrees clockwise",
          7: "mirrored along its other diagonal", 8: "turned 90 degrees anticlockwise"}

_RESAMPLE = {"bilinear": "BILINEAR", "lanczos": "LANCZOS", "bicubic": "BICUBIC", "nearest": "NEAREST"}


class ImageReadError(ValueError):
    """An image file or folder that cannot be used; the message names it."""


def is_hidden(path: Path) -> bool:
    """A dot file (``.DS_Store``, macOS ``._name`` forks, ``.thumbnails``)."""
    return path.name.startswith(".")


def list_image_files(folder: str | os.PathLike, recursive: bool = False, suffixes: Sequence[str] = IMAGE_SUFFIXES,
                     error: type[Exception] = ImageReadError) -> list[Path]:
    """The image files of ``folder`` (by suffix), sorted; hidden files and folders are skipped.

    Raises ``error`` if the folder is missing, is a file, or holds no image.
    """
    folder = Path(folder)
    if not folder.exists():
        raise error(f"image folder not found: {folder}")
    if not folder.is_dir():
        raise error(f"expected a folder of images, got a file: {folder}")
    found = folder.rglob("*") if recursive else folder.iterdir()
    files = sorted(p for p in found if p.is_file() and p.suffix.lower() in suffixes
                   and not any(part.startswith(".") for part in p.relative_to(folder).parts))
    if not files:
        raise error(f"no images ({', '.join(suffixes)}) in folder {folder}" + (" or its subfolders" if recursive else "")
                    + ("; it is empty" if not any(folder.iterdir()) else ""))
    return files


def _to_float(im, path: Path, notes: list[str], error) -> np.ndarray:
    """The decoded image as float32 (H, W) or (H, W, C) in [0, 1], scaled by its bit depth."""
    mode = im.mode
    if mode.startswith("I;16"):
        return np.asarray(im, dtype=np.float32) / 65535.0
    if mode == "I":  # 16-bit PNGs open as "I" in some Pillow versions; other 32-bit integers by their range
        arr = np.asarray(im, dtype=np.float64)
        lo, hi = float(arr.min()), float(arr.max())
        if lo < 0:
            raise error(f"{path}: a 32-bit integer image with negative values (min {lo:g}); save it as 8 or 16 bit")
        if im.format == "PNG" or hi > 255:
            if hi > 65535:
                notes.append(f"{path}: 32-bit integer image rescaled by its maximum {hi:g}")
                return (arr / hi).astype(np.float32)
            return (arr / 65535.0).astype(np.float32)
        return (arr / 255.0).astype(np.float32)
    if mode == "F":
        arr = np.asarray(im, dtype=np.float32)
        if not np.isfinite(arr).all():
            raise error(f"{path}: a float image holding NaN or infinite values")
        lo, hi = float(arr.min()), float(arr.max())
        if lo < 0:
            raise error(f"{path}: a float image with negative values (min {lo:g}); "
                        f"save it in [0, 1] or as an 8- or 16-bit image")
        if hi > 1:
            notes.append(f"{path}: float image with values up to {hi:g} rescaled to [0, 1] by its maximum")
            return arr / hi
        return arr
    return np.asarray(im, dtype=np.float32) / 255.0


def read_image(path: str | os.PathLike, channels: int = 3, size: int | None = None, resize: bool = True,
               resample: str = "bilinear", max_pixels: int = MAX_PIXELS,
               error: type[Exception] = ImageReadError) -> tuple[np.ndarray, list[str]]:
    """One image file as float32 (channels, H, W) in [0, 1], and notes on what was converted.

    Args:
        channels: 1 (grey, ITU-R 601 luma) or 3 (RGB); other colour layouts are converted with a note.
        size: resize to ``size`` x ``size`` (with a note) unless it is already; None keeps the size.
        resize: False refuses an image of another size instead.
        resample: "bilinear", "lanczos", "bicubic" or "nearest".
        max_pixels: larger images are refused from their header, before decoding.
        error: the exception class raised (a task's own data error).
    """
    from PIL import Image, ImageOps, UnidentifiedImageError

    path = Path(path)
    if channels not in (1, 3):
        raise ValueError(f"channels must be 1 or 3; got {channels}")
    if resample not in _RESAMPLE:
        raise ValueError(f"resample must be one of {sorted(_RESAMPLE)}; got {resample!r}")
    if not path.is_file():
        raise error(f"image not found: {path}" if not path.exists() else f"not an image file: {path}")
    notes: list[str] = []
    try:
        with warnings.catch_warnings():  # our own limit below says it better than Pillow's warning
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(path)
        with im:
            w, h = im.size
            if w * h > max_pixels:
                raise error(f"{path} is {w}x{h} ({w * h / 1e6:.0f} Mpixels), more than the "
                            f"{max_pixels / 1e6:.0f} Mpixel limit for one image; crop or shrink it first")
            if w == 0 or h == 0:
                raise error(f"{path} is an empty {w}x{h} image")
            im.load()  # decode now: a truncated file fails here, naming it
            try:
                orientation = im.getexif().get(_ORIENTATION, 1)
            except Exception as e:  # unreadable EXIF: the pixels are still there, as stored
                orientation = 1
                notes.append(f"{path}: its EXIF metadata cannot be read ({e}); read as stored")
            if orientation in _TURNS:  # upright, as a viewer shows it; 1 (or a bad value) is as stored
                ImageOps.exif_transpose(im, in_place=True)
                notes.append(f"{path}: turned upright by its EXIF orientation {orientation} ({_TURNS[orientation]}); "
                             f"stored as {w}x{h}, read as {im.size[0]}x{im.size[1]}")
                w, h = im.size
            high = im.mode.startswith("I") or im.mode == "F"
            if high:
                arr = _to_float(im, path, notes, error)[..., None]  # (H, W, 1)
                if channels == 3:
                    arr = np.repeat(arr, 3, axis=2)
                    notes.append(f"{path}: {im.mode} grey image converted to RGB")
            else:
                want = "RGB" if channels == 3 else "L"
                if im.mode != want:
                    if want == "L" and im.mode not in ("1", "LA", "La"):
                        notes.append(f"{path}: colour image (mode {im.mode}) converted to greyscale (ITU-R 601 luma)")
                    else:
                        notes.append(f"{path}: {im.mode} image converted to {'greyscale' if want == 'L' else want}")
                    im = im.convert(want)
                arr = _to_float(im, path, notes, error)
                arr = arr[..., None] if arr.ndim == 2 else arr
            if size is not None and (w, h) != (size, size):
                if not resize:
                    raise error(f"{path} is {w}x{h}, not {size}x{size} (resizing is off)")
                notes.append(f"{path}: resized from {w}x{h} to {size}x{size}")
                filt = getattr(Image.Resampling, _RESAMPLE[resample])
                arr = np.stack([np.asarray(Image.fromarray(np.ascontiguousarray(arr[..., c]), mode="F")
                                           .resize((size, size), filt), dtype=np.float32)
                                for c in range(arr.shape[2])], axis=2)
    except error:
        raise
    except Image.DecompressionBombError as e:
        raise error(f"{path} is too large to decode safely, more than Pillow's limit for one image ({e}); "
                    f"crop or shrink it first") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError, MemoryError) as e:
        raise error(f"cannot read image {path}: not an image, truncated or corrupt ({e})") from None
    arr = np.clip(arr, 0.0, 1.0).transpose(2, 0, 1)  # (C, H, W); resampling may overshoot slightly
    return np.ascontiguousarray(arr, dtype=np.float32), notes


def to_uint8(img: np.ndarray) -> np.ndarray:
    """A float image in [0, 1] as uint8 (rounded)."""
    return (np.clip(img, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


__all__ = ["IMAGE_SUFFIXES", "ImageReadError", "MAX_PIXELS", "is_hidden", "list_image_files", "read_image", "to_uint8"]
