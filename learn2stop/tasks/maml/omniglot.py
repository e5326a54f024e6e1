"""Omniglot: the compact .npz arrays or the standard PNG folders, split by character (MAML's split)."""
from __future__ import annotations

import zipfile
import zlib
from pathlib import Path


import numpy as np


from ...utils.images import read_image, to_uint8
from .classes import ClassImages, DataError, _listing, check_disjoint, duplicates


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
