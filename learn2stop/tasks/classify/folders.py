"""Images as files: one image, class-per-folder trees, Tiny-ImageNet's layout."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from ...utils.images import IMAGE_SUFFIXES, is_hidden, read_image, to_uint8
from .cifar import _find_dir
from .imageset import ImageDataError, ImageSet, _warn_notes

# ----------------------------------------------------------------------------- image files
def load_image_file(path: str | Path, size: int | None = None, in_channels: int = 3,
                    resize: bool = True) -> tuple[np.ndarray, list[str]]:
    """One image as uint8 (C, H, W), and notes on what was converted (read by :func:`utils.images.read_image`).

    Grey, palette or RGBA images become RGB (``in_channels`` 3) or grey (1), with a note; 16-bit and
    float images are scaled by their depth; an image not ``size`` x ``size`` is resized (bilinear)
    with a note, or refused if ``resize`` is False.

    Raises:
        ImageDataError: missing, not an image, truncated, corrupt or too large, or of the wrong size.
    """
    if in_channels not in (1, 3):
        raise ValueError(f"in_channels must be 1 or 3; got {in_channels}")
    img, notes = read_image(path, in_channels, size, resize, error=ImageDataError)
    return to_uint8(img), notes


def _stack(files: Sequence[Path], size: int | None, in_channels: int, resize: bool,
           where: str) -> tuple[np.ndarray, list[str]]:
    """Decode ``files`` into uint8 (N, C, H, W); without ``size`` every image must match the first."""
    arrays, notes = [], []
    for f in files:
        arr, note = load_image_file(f, size, in_channels, resize)
        if arrays and arr.shape != arrays[0].shape:
            raise ImageDataError(f"{f} is {arr.shape[2]}x{arr.shape[1]} but {files[0]} is "
                                 f"{arrays[0].shape[2]}x{arrays[0].shape[1]}: images of one set must have one size "
                                 f"(give a size to resize them)")
        arrays.append(arr)
        notes += note
    _warn_notes(notes, where)
    return np.stack(arrays), notes


def _image_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and not is_hidden(p) and p.suffix.lower() in IMAGE_SUFFIXES)


def load_image_folder(root: str | Path, size: int | None = None, in_channels: int = 3, resize: bool = True,
                      classes: Sequence[str] | None = None) -> ImageSet:
    """A class-per-folder tree ``root/<class>/*.png|jpg|...`` as one :class:`ImageSet`.

    Classes are the subfolder names, sorted, unless ``classes`` fixes the order (a test tree read
    with the training classes); files of other suffixes and hidden files are ignored.
    """
    root = Path(root)
    if not root.is_dir():
        raise ImageDataError(f"image folder not found: {root}")
    found = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if classes is None:
        if len(found) < 2:
            raise ImageDataError(f"{root} holds {len(found)} class folder(s) ({', '.join(found) or 'none'}); "
                                 f"a class-per-folder tree needs at least 2")
        classes = found
    else:
        extra = sorted(set(found) - set(classes))
        if extra:
            raise ImageDataError(f"{root}: class folder(s) {', '.join(extra)} are not among the training classes")
    files, labels = [], []
    for k, name in enumerate(classes):
        if name not in found:
            continue
        images = _image_files(root / name)
        if not images:
            raise ImageDataError(f"class folder {root / name} has no images ({', '.join(IMAGE_SUFFIXES)})")
        files += images
        labels += [k] * len(images)
    if not files:
        raise ImageDataError(f"no images under {root}")
    images, notes = _stack(files, size, in_channels, resize, str(root))
    return ImageSet(images, np.array(labels, dtype=np.int64), list(classes), str(root), notes)


def load_tiny_imagenet(path: str | Path, size: int = 64, in_channels: int = 3,
                       resize: bool = True) -> tuple[ImageSet, ImageSet]:
    """Tiny-ImageNet-200 (``tiny-imagenet-200`` or its parent) as (train, test = the val folder).

    Classes in ``wnids.txt`` order, named from ``words.txt`` (first synonym) where present.
    """
    root = _find_dir(path, "tiny-imagenet-200")
    wnids_file = root / "wnids.txt"
    if not wnids_file.is_file():
        raise ImageDataError(f"Tiny-ImageNet class list not found: {wnids_file}")
    wnids = [w.strip() for w in wnids_file.read_text().splitlines() if w.strip()]
    index = {w: k for k, w in enumerate(wnids)}
    names = list(wnids)
    if (root / "words.txt").is_file():
        words = dict(line.split("\t", 1) for line in (root / "words.txt").read_text().splitlines() if "\t" in line)
        first = [words.get(w, w).split(",")[0].strip() for w in wnids]
        names = [n if first.count(n) == 1 else f"{n} ({w})" for n, w in zip(first, wnids)]
    files, labels = [], []
    for w in wnids:
        folder = root / "train" / w / "images"
        images = _image_files(folder) if folder.is_dir() else []
        if not images:
            raise ImageDataError(f"Tiny-ImageNet class {w}: no training images in {folder}")
        files += images
        labels += [index[w]] * len(images)
    train_images, train_notes = _stack(files, size, in_channels, resize, str(root / "train"))
    train = ImageSet(train_images, np.array(labels), names, str(root / "train"), train_notes)

    ann = root / "val" / "val_annotations.txt"
    if not ann.is_file():
        raise ImageDataError(f"Tiny-ImageNet validation labels not found: {ann}")
    files, labels = [], []
    for n, line in enumerate(ann.read_text().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) < 2 or parts[1] not in index:
            raise ImageDataError(f"{ann} line {n}: expected 'file<TAB>wnid<TAB>box', with a wnid of {wnids_file}; "
                                 f"got {line!r}")
        files.append(root / "val" / "images" / parts[0])
        labels.append(index[parts[1]])
    if not files:
        raise ImageDataError(f"{ann} lists no images")
    test_images, test_notes = _stack(files, size, in_channels, resize, str(root / "val"))
    return train, ImageSet(test_images, np.array(labels), names, str(root / "val"), test_notes)
