"""Few-shot datasets: Omniglot (compact .npz arrays or the standard PNG folders), MiniImagenet
(images folder + CSV split files) and the embedded sinusoid-regression toy that needs no data.

Every image dataset here is a list of classes, each a list of images, behind one small interface
(:class:`ClassImages`): ``num_classes``, ``class_sizes`` and ``images(c, idx) -> (n, C, H, W)``
float tensor. Samplers (``samplers.py``) only see that interface. Nothing is downloaded.

Loading checks what would otherwise go wrong silently: class names are unique and aligned with
the image arrays (a misaligned name labels images wrongly), the train/val/test splits share no
class (a shared one leaks test characters into training), and every image of a dataset has one
size, the one asked for when ``image_size`` is given, before any training starts.
"""
from __future__ import annotations

import csv
import math
import zipfile
import zlib
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from ...utils.images import read_image, to_uint8


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


# ----------------------------------------------------------------------------- Omniglot
OMNIGLOT_SPLIT = (1100, 100, 423)  # characters for meta-train / validation / test (MAML split)


def _read_split_file(path: Path) -> list[str]:
    if not path.is_file():
        raise DataError(f"split file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"split file {path} is unreadable or not UTF-8 text: {e}") from None
    names = [ln.strip().strip("/") for ln in text.splitlines() if ln.strip()]
    dup = duplicates(names)
    if dup:
        raise DataError(f"split file {path} lists a character twice: {_listing(dup)}")
    return names


def _split_all(names: list[str], counts: tuple[int, int, int]) -> dict[str, list[str]]:
    """Train/val/test slices of an ordered name list; counts scale down for a smaller list.

    Raises DataError if a split would be empty or two splits would share a name.
    """
    n = len(names)
    if n != sum(counts):  # a smaller (e.g. generated) collection: keep the proportions
        n_train = int(round(n * counts[0] / sum(counts)))
        n_val = max(1, int(round(n * counts[1] / sum(counts))))
        counts = (n_train, n_val, n - n_train - n_val)
    a, b = counts[0], counts[0] + counts[1]
    splits = {"train": names[:a], "val": names[a:b], "test": names[b:]}
    empty = [k for k, v in splits.items() if not v]
    if empty:
        raise DataError(f"{n} characters are too few for train/val/test splits: the {' and '.join(empty)} "
                        f"split(s) would be empty")
    check_disjoint(splits, "characters")
    return splits


def _split_names(names: list[str], split: str, counts: tuple[int, int, int]) -> list[str]:
    """Train/val/test slice of an ordered name list; counts scale down for a smaller list."""
    if split not in ("train", "val", "test"):
        raise DataError(f"split must be 'train', 'val' or 'test'; got {split!r}")
    return _split_all(names, counts)[split]


def _ordered_names(available: list[str], split_file: Path | None, seed: int) -> list[str]:
    """The split order: the split file's, or a seeded shuffle of the sorted names."""
    dup = duplicates(available)
    if dup:
        raise DataError(f"{len(dup)} character name(s) occur twice in the data (they could land in two splits): "
                        f"{_listing(dup)}")
    if split_file is not None:
        order = _read_split_file(split_file)
        missing = sorted(set(order) - set(available))
        if missing:
            raise DataError(f"split file {split_file} names {len(missing)} character(s) not in the data, e.g. {missing[0]!r}")
        return order
    names = sorted(available)
    perm = np.random.default_rng(seed).permutation(len(names))
    return [names[i] for i in perm]


def load_omniglot_npz(root: str | Path, split: str, split_file: str | Path | None = None,
                      image_size: int | None = None) -> ClassImages:
    """Omniglot from ``background.npz`` + ``evaluation.npz`` (28x28 uint8, see shared/data SOURCE.md).

    The characters are ordered by ``maml_split.txt`` (default: ``root/maml_split.txt`` if present,
    else a seeded shuffle of the sorted names) and sliced 1100/100/423. Images are inverted (ink = 1).
    Each file's ``alphabet`` and ``character`` arrays must have one entry per image row, every
    ``alphabet/character`` name must be unique, and with ``image_size`` the images must be
    ``image_size`` x ``image_size`` (the arrays are not resized).
    """
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"Omniglot folder not found: {root}")
    arrays, names = [], []
    for part in ("background", "evaluation"):
        f = root / f"{part}.npz"
        if not f.is_file():
            raise DataError(f"{root} is not an Omniglot .npz folder: {f.name} is missing "
                            f"(expected background.npz and evaluation.npz)")
        try:
            with np.load(f, allow_pickle=False) as z:
                imgs, alph, char = z["images"], z["alphabet"], z["character"]
        except (KeyError, ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as e:
            raise DataError(f"{f} is corrupt, truncated or lacks the arrays images/alphabet/character "
                            f"({type(e).__name__}: {e})") from None
        if imgs.ndim != 4 or imgs.dtype != np.uint8:
            raise DataError(f"{f}: images must be uint8 (characters, drawings, H, W); got {imgs.dtype} {imgs.shape}")
        if alph.ndim != 1 or char.ndim != 1 or not len(alph) == len(char) == imgs.shape[0]:
            raise DataError(f"{f}: misaligned arrays: {imgs.shape[0]} characters of images, alphabet {alph.shape}, "
                            f"character {char.shape}; each needs one entry per character")
        part_names = [f"{str(a).strip()}/{str(c).strip()}" for a, c in zip(alph.tolist(), char.tolist())]
        blank = [n for n in part_names if n.startswith("/") or n.endswith("/")]
        if blank:
            raise DataError(f"{f}: {len(blank)} character(s) with an empty alphabet or character name, e.g. {blank[0]!r}")
        arrays.append(imgs)
        names += part_names
    if arrays[0].shape[1:] != arrays[1].shape[1:]:
        raise DataError(f"background and evaluation images differ in shape: {arrays[0].shape} vs {arrays[1].shape}")
    h, w = arrays[0].shape[2:]
    if image_size is not None and (h, w) != (image_size, image_size):
        raise DataError(f"{root}: the .npz images are {h}x{w}, but data.image_size is {image_size}; "
                        f"set data.image_size {h} or use the PNG folders (which are resized)")
    images = np.concatenate(arrays)
    sf = Path(split_file) if split_file else (root / "maml_split.txt" if (root / "maml_split.txt").is_file() else None)
    order = _split_names(_ordered_names(names, sf, seed=1), split, OMNIGLOT_SPLIT)
    pos = {n: i for i, n in enumerate(names)}
    return ClassImages(images[[pos[n] for n in order]], order, invert=True)


def _load_gray(path: Path, size: int) -> np.ndarray:
    """One drawing as uint8 (size, size) grey, resized with Lanczos (:func:`utils.images.read_image`)."""
    return to_uint8(read_image(path, channels=1, size=size, resample="lanczos", error=DataError)[0][0])


def load_omniglot_folders(root: str | Path, split: str, split_file: str | Path | None = None,
                          image_size: int = 28) -> ClassImages:
    """Omniglot from the standard PNG folders ``root/images_background`` and ``root/images_evaluation``.

    Layout: ``images_{background,evaluation}/<Alphabet>/<characterNN>/<id>_<drawing>.png``. Images
    are converted to 8-bit grey, resized with Lanczos to ``image_size`` and inverted (ink = 1).
    Every character must have the same number of drawings.
    """
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"Omniglot folder not found: {root}")
    chars: dict[str, list[Path]] = {}
    for part in ("images_background", "images_evaluation"):
        d = root / part
        if not d.is_dir():
            raise DataError(f"{root} is not an Omniglot image folder: {part}/ is missing "
                            f"(expected images_background/ and images_evaluation/ of <Alphabet>/<character>/*.png)")
        for alphabet in sorted(p for p in d.iterdir() if p.is_dir()):
            for char in sorted(p for p in alphabet.iterdir() if p.is_dir()):
                files = sorted(char.glob("*.png"))
                if not files:
                    raise DataError(f"character folder {char} holds no .png files")
                name = f"{alphabet.name}/{char.name}"
                if name in chars:
                    raise DataError(f"character {name!r} is in both images_background/ and images_evaluation/; "
                                    f"rename one (one name must mean one character)")
                chars[name] = files
    if not chars:
        raise DataError(f"no <Alphabet>/<character>/ folders with PNGs under {root}/images_background|images_evaluation")
    sizes = {len(v) for v in chars.values()}
    if len(sizes) != 1:
        small = min(chars, key=lambda k: len(chars[k]))
        raise DataError(f"characters have different numbers of drawings {sorted(sizes)}; e.g. {small} has {len(chars[small])}")
    sf = Path(split_file) if split_file else (root / "maml_split.txt" if (root / "maml_split.txt").is_file() else None)
    order = _split_names(_ordered_names(list(chars), sf, seed=1), split, OMNIGLOT_SPLIT)
    images = np.stack([np.stack([_load_gray(f, image_size) for f in chars[n]]) for n in order])
    return ClassImages(images, order, invert=True)


# ----------------------------------------------------------------------------- MiniImagenet
def _read_split_csv(csv_path: Path) -> list[tuple[int, str, str]]:
    """(line number, file name, label) rows of a MiniImagenet split CSV; a file listed twice is an error."""
    rows, first_line = [], {}
    try:
        with open(csv_path, newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None or [h.strip() for h in header[:2]] != ["filename", "label"]:
                raise DataError(f"{csv_path} must start with the header 'filename,label'; got {header}")
            for i, row in enumerate(reader, start=2):
                if len(row) < 2 or not row[0].strip() or not row[1].strip():
                    raise DataError(f"{csv_path} line {i}: expected 'filename,label'; got {row}")
                name, label = row[0].strip(), row[1].strip()
                if name in first_line:
                    raise DataError(f"{csv_path} line {i}: {name} is listed twice (first on line {first_line[name]}); "
                                    f"one image must have one label")
                first_line[name] = i
                rows.append((i, name, label))
    except (UnicodeDecodeError, csv.Error) as e:
        raise DataError(f"{csv_path} is not a UTF-8 CSV file: {e}") from None
    return rows


class MiniImagenet:
    """MiniImagenet in its standard layout: ``root/images/*.jpg`` and ``root/{train,val,test}.csv``.

    Each CSV has a header ``filename,label`` and one row per image (Ravi & Larochelle split:
    64/16/20 classes, 600 images each). Images are read lazily, converted to RGB and resized to
    ``image_size`` (84); a corrupt file raises :class:`DataError` naming it when it is read.
    """

    def __init__(self, root: str | Path, split: str, image_size: int = 84):
        root = Path(root)
        if not root.is_dir():
            raise DataError(f"MiniImagenet folder not found: {root}")
        if split not in ("train", "val", "test"):
            raise DataError(f"split must be 'train', 'val' or 'test'; got {split!r}")
        csv_path, img_dir = root / f"{split}.csv", root / "images"
        if not img_dir.is_dir():
            raise DataError(f"{root} is not a MiniImagenet folder: images/ is missing")
        if not csv_path.is_file():
            raise DataError(f"{root} is not a MiniImagenet folder: {split}.csv is missing")
        rows = _read_split_csv(csv_path)
        by_class: dict[str, list[Path]] = {}
        for line, name, label in rows:
            path = img_dir / name
            if not path.is_file():
                raise DataError(f"{csv_path} line {line}: image {path} does not exist")
            by_class.setdefault(label, []).append(path)
        if not by_class:
            raise DataError(f"{csv_path} lists no images")
        # the other splits must share no class and no image with this one (a silent train/test leak)
        for other in ("train", "val", "test"):
            other_csv = root / f"{other}.csv"
            if other == split or not other_csv.is_file():
                continue
            other_rows = _read_split_csv(other_csv)
            check_disjoint({split: sorted(by_class), other: sorted({r[2] for r in other_rows})}, "classes")
            check_disjoint({split: [r[1] for r in rows], other: [r[1] for r in other_rows]}, "image files")
        self.names = sorted(by_class)
        self.files = [by_class[n] for n in self.names]
        self.image_size = image_size

    @property
    def num_classes(self) -> int:
        return len(self.names)

    @property
    def class_sizes(self) -> list[int]:
        return [len(f) for f in self.files]

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of every image (all are resized to ``image_size``)."""
        return (3, self.image_size, self.image_size)

    def images(self, c: int, idx: Tensor) -> Tensor:
        # read and resized as float (utils.images.read_image), then quantised like the stored 8-bit files
        out = [to_uint8(read_image(self.files[c][i], channels=3, size=self.image_size, error=DataError)[0])
               for i in idx.tolist()]
        return torch.from_numpy(np.stack(out)).float() / 255.0  # (n, 3, H, W)


# ----------------------------------------------------------------------------- sinusoid
class Sinusoid:
    """The classic MAML toy: y = A sin(x - phase), A ~ U[0.1, 5], phase ~ U[0, pi], x ~ U[-5, 5].

    Needs no data. A task's support size is its shot count K; ``noise`` adds Gaussian noise to
    the support targets only (query targets stay clean), which makes few-shot tasks easy to overfit.
    """

    def __init__(self, noise: float = 0.0):
        self.noise = noise

    def task(self, k: int, q: int, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """One task: support (k, 1), (k, 1) and query (q, 1), (q, 1)."""
        amp = 0.1 + 4.9 * torch.rand((), generator=generator)
        phase = math.pi * torch.rand((), generator=generator)
        x = -5 + 10 * torch.rand(k + q, 1, generator=generator)
        y = amp * torch.sin(x - phase)
        ys = y[:k] + self.noise * torch.randn(k, 1, generator=generator)
        return x[:k], ys, x[k:], y[k:]
