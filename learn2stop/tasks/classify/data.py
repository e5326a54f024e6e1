"""Image classification data: CIFAR-10/100 (binary, python, the shared subset), Tiny-ImageNet,
class-per-folder trees, single images, and batch augmentation in plain torch.

Every loader returns :class:`ImageSet`: uint8 images (N, C, H, W), int64 labels (N,) and the class
names. Every data problem raises :class:`ImageDataError` naming the file or field. The official
CIFAR python batches are pickles; they are read by :class:`RestrictedUnpickler`, which builds numpy
arrays and nothing else, so a tampered file cannot run code.
"""
from __future__ import annotations

import codecs
import pickle
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from ...utils.images import IMAGE_SUFFIXES, is_hidden, read_image, to_uint8
from ...utils.registry import Registry

CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


class ImageDataError(ValueError):
    """A data file, folder or field that cannot be used; the message names it."""


@dataclass
class ImageSet:
    """A labelled image set held in memory.

    Attributes:
        images: uint8 (N, C, H, W).
        labels: int64 (N,), each in [0, len(classes)).
        classes: class names; label k is ``classes[k]``.
        source: the file or folder it came from (named in errors).
        notes: conversions made while loading (grey -> RGB, resized, ...), one line per file.
    """

    images: np.ndarray
    labels: np.ndarray
    classes: list[str]
    source: str = ""
    notes: list[str] = field(default_factory=list)

    def __post_init__(self):
        where = self.source or "image set"
        self.images, self.labels = np.asarray(self.images), np.asarray(self.labels)
        if self.images.dtype != np.uint8 or self.images.ndim != 4:
            raise ImageDataError(f"{where}: images must be uint8 (N, C, H, W); got {self.images.dtype} {self.images.shape}")
        if self.labels.ndim != 1 or len(self.labels) != len(self.images):
            raise ImageDataError(f"{where}: {len(self.images)} images but labels of shape {self.labels.shape}")
        if not np.issubdtype(self.labels.dtype, np.integer):
            raise ImageDataError(f"{where}: labels must be integers; got {self.labels.dtype}")
        self.labels = self.labels.astype(np.int64)
        check_labels(self.labels, len(self.classes), where)

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of every image."""
        return tuple(self.images.shape[1:])

    def subset(self, index: np.ndarray, source: str | None = None) -> "ImageSet":
        """The images at ``index`` (same classes)."""
        return ImageSet(self.images[index], self.labels[index], list(self.classes), source or self.source)

    def tensors(self) -> tuple[Tensor, Tensor]:
        """(uint8 (N, C, H, W), int64 (N,)) torch tensors sharing memory with the arrays."""
        return torch.from_numpy(self.images), torch.from_numpy(self.labels)


def check_labels(labels: np.ndarray, num_classes: int, where: str) -> None:
    """Refuse labels outside [0, num_classes), naming ``where`` and the first bad value."""
    if num_classes < 1:
        raise ImageDataError(f"{where}: no class names")
    bad = (labels < 0) | (labels >= num_classes)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ImageDataError(f"{where}: label {int(labels[i])} (sample {i}) is outside [0, {num_classes}); "
                             f"{int(bad.sum())} labels are out of range")


def _warn_notes(notes: list[str], where: str) -> None:
    if notes:
        shown = "; ".join(notes[:3]) + (f"; and {len(notes) - 3} more" if len(notes) > 3 else "")
        warnings.warn(f"{where}: {len(notes)} image(s) converted: {shown}", stacklevel=3)


# ----------------------------------------------------------------------------- the shared subset
def load_cifar_subset_npz(path: str | Path) -> tuple[ImageSet, ImageSet]:
    """The shared CIFAR-10 subset (``cifar10_subset.npz``, or its folder) as (train, test)."""
    path = Path(path)
    if path.is_dir():
        path = path / "cifar10_subset.npz"
    if not path.is_file():
        raise ImageDataError(f"CIFAR subset file not found: {path}")
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except Exception as e:  # BadZipFile, ValueError (object arrays), OSError
        raise ImageDataError(f"cannot read {path}: {e}") from None
    sets = []
    for split in ("train", "test"):
        for key in (f"{split}_images", f"{split}_labels"):
            if key not in arrays:
                raise ImageDataError(f"{path}: missing array {key!r}; found {sorted(arrays)}")
        images = arrays[f"{split}_images"]
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1:] != (3, 32, 32):
            raise ImageDataError(f"{path}: {split}_images must be uint8 (N, 3, 32, 32); got {images.dtype} {images.shape}")
        sets.append(ImageSet(images, arrays[f"{split}_labels"], list(CIFAR10_CLASSES), f"{path} [{split}]"))
    return sets[0], sets[1]


# ----------------------------------------------------------------------------- CIFAR binary
def _find_dir(path: str | Path, name: str) -> Path:
    """``path`` itself or its subfolder ``name`` (the folder the official archive unpacks to)."""
    path = Path(path)
    if (path / name).is_dir():
        return path / name
    if not path.is_dir():
        raise ImageDataError(f"dataset folder not found: {path}")
    return path


def _read_names(path: Path, fallback: int) -> list[str]:
    if not path.is_file():
        warnings.warn(f"{path} not found: classes are named by their number", stacklevel=3)
        return [str(i) for i in range(fallback)]
    return [line.strip() for line in path.read_text().splitlines() if line.strip()]


def read_cifar_binary(path: Path, label_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Records of ``label_bytes`` label bytes + 3072 image bytes: (uint8 (N, 3, 32, 32), the last label byte)."""
    if not path.is_file():
        raise ImageDataError(f"CIFAR batch not found: {path}")
    raw = np.fromfile(path, dtype=np.uint8)
    record = label_bytes + 3 * 32 * 32
    if raw.size == 0 or raw.size % record:
        raise ImageDataError(f"{path} is truncated or not a CIFAR binary batch: {raw.size} bytes is not a "
                             f"multiple of the {record}-byte record")
    raw = raw.reshape(-1, record)
    return raw[:, label_bytes:].reshape(-1, 3, 32, 32), raw[:, label_bytes - 1].astype(np.int64)


def load_cifar_binary(path: str | Path, num_classes: int = 10) -> tuple[ImageSet, ImageSet]:
    """CIFAR-10 (``cifar-10-batches-bin``) or CIFAR-100 (``cifar-100-binary``, fine labels) as (train, test)."""
    if num_classes == 10:
        root = _find_dir(path, "cifar-10-batches-bin")
        train_files, test_files = [root / f"data_batch_{i}.bin" for i in range(1, 6)], [root / "test_batch.bin"]
        names, label_bytes = _read_names(root / "batches.meta.txt", 10), 1
    elif num_classes == 100:
        root = _find_dir(path, "cifar-100-binary")
        train_files, test_files = [root / "train.bin"], [root / "test.bin"]
        names, label_bytes = _read_names(root / "fine_label_names.txt", 100), 2  # coarse, fine
    else:
        raise ValueError(f"num_classes must be 10 or 100 for CIFAR; got {num_classes}")
    sets = []
    for files in (train_files, test_files):
        parts = [read_cifar_binary(f, label_bytes) for f in files]
        for f, (_, labels) in zip(files, parts):
            check_labels(labels, len(names), str(f))
        sets.append(ImageSet(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
                             names, str(files[0] if len(files) == 1 else root)))
    return sets[0], sets[1]


# ----------------------------------------------------------------------------- CIFAR python (pickles)
def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    """How protocol-2 pickles rebuild bytes; only the latin-1 codec is allowed."""
    if codecs.lookup(encoding).name != "iso8859-1":
        raise pickle.UnpicklingError(f"refused global _codecs.encode with codec {encoding!r}")
    return codecs.encode(text, "latin1")


def _numpy_globals() -> dict[tuple[str, str], Any]:
    try:
        from numpy._core import multiarray, numeric
    except ImportError:  # numpy < 2
        from numpy.core import multiarray, numeric
    allowed = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype, ("_codecs", "encode"): _latin1_encode}
    for mod in ("numpy.core", "numpy._core"):  # files written by numpy 1 and numpy 2
        allowed[(f"{mod}.multiarray", "_reconstruct")] = multiarray._reconstruct
        allowed[(f"{mod}.multiarray", "scalar")] = multiarray.scalar
        allowed[(f"{mod}.numeric", "_frombuffer")] = numeric._frombuffer
    return allowed


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that builds numpy arrays, dtypes and plain containers, and refuses every other global.

    A pickle can call any importable function while loading (``os.system`` through ``__reduce__``);
    CIFAR batches only need numpy's array reconstruction, so nothing else is looked up, let alone run.
    """

    ALLOWED = _numpy_globals()

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refused global {module}.{name}") from None


def load_pickle(path: str | Path) -> Any:
    """Read a CIFAR python pickle (``encoding='bytes'``, as the official python-2 files need) safely."""
    path = Path(path)
    if not path.is_file():
        raise ImageDataError(f"CIFAR batch not found: {path}")
    try:
        with open(path, "rb") as f:
            return RestrictedUnpickler(f, encoding="bytes").load()
    except pickle.UnpicklingError as e:
        if "refused global" in str(e):
            raise ImageDataError(f"{path}: {e}; a CIFAR batch holds only numpy arrays and lists, so this file "
                                 f"was not loaded (it could run code)") from None
        raise ImageDataError(f"cannot read {path}: truncated or not a CIFAR python batch ({e})") from None
    except Exception as e:  # EOFError (truncated), ValueError, TypeError, ...
        raise ImageDataError(f"cannot read {path}: truncated or not a CIFAR python batch ({type(e).__name__}: {e})") from None


def _field(batch: Any, path: Path, *keys: str) -> Any:
    """The first of ``keys`` present in a batch dict whose keys are bytes (official) or str."""
    if not isinstance(batch, dict):
        raise ImageDataError(f"{path}: expected a dict of arrays, got {type(batch).__name__}")
    for key in keys:
        for k in (key.encode(), key):
            if k in batch:
                return batch[k]
    raise ImageDataError(f"{path}: missing field {' or '.join(repr(k) for k in keys)}; "
                         f"found {sorted(str(k) for k in batch)}")


def _decode_names(names: Any, path: Path) -> list[str]:
    if not isinstance(names, (list, tuple)):
        raise ImageDataError(f"{path}: class names must be a list; got {type(names).__name__}")
    return [n.decode("utf-8") if isinstance(n, bytes) else str(n) for n in names]


def read_cifar_pickle(path: Path, label_key: str) -> tuple[np.ndarray, np.ndarray]:
    """One python batch: data (N, 3072) uint8 (array or lists) and labels -> ((N, 3, 32, 32), (N,))."""
    batch = load_pickle(path)
    data, labels = _field(batch, path, "data"), _field(batch, path, label_key)
    try:
        data = np.asarray(data)
        labels = np.asarray(labels, dtype=np.int64)
    except (ValueError, TypeError) as e:
        raise ImageDataError(f"{path}: 'data' or {label_key!r} is not a regular array ({e})") from None
    if data.ndim != 2 or data.shape[1] != 3072 or not np.issubdtype(data.dtype, np.integer) \
            or (data.size and (data.min() < 0 or data.max() > 255)):
        raise ImageDataError(f"{path}: 'data' must be (N, 3072) bytes 0..255; got {data.dtype} {data.shape}")
    if labels.shape != (len(data),):
        raise ImageDataError(f"{path}: {len(data)} images but {label_key!r} has shape {labels.shape}")
    return data.astype(np.uint8).reshape(-1, 3, 32, 32), labels


def load_cifar_python(path: str | Path, num_classes: int = 10) -> tuple[ImageSet, ImageSet]:
    """CIFAR-10 (``cifar-10-batches-py``) or CIFAR-100 (``cifar-100-python``, fine labels) as (train, test)."""
    if num_classes == 10:
        root = _find_dir(path, "cifar-10-batches-py")
        train_files, test_files = [root / f"data_batch_{i}" for i in range(1, 6)], [root / "test_batch"]
        meta, names_key, label_key = root / "batches.meta", "label_names", "labels"
    elif num_classes == 100:
        root = _find_dir(path, "cifar-100-python")
        train_files, test_files = [root / "train"], [root / "test"]
        meta, names_key, label_key = root / "meta", "fine_label_names", "fine_labels"
    else:
        raise ValueError(f"num_classes must be 10 or 100 for CIFAR; got {num_classes}")
    if meta.is_file():
        names = _decode_names(_field(load_pickle(meta), meta, names_key), meta)
    else:
        warnings.warn(f"{meta} not found: classes are named by their number", stacklevel=2)
        names = [str(i) for i in range(num_classes)]
    sets = []
    for files in (train_files, test_files):
        parts = [read_cifar_pickle(f, label_key) for f in files]
        for f, (_, labels) in zip(files, parts):
            check_labels(labels, len(names), f"{f} [{label_key}]")
        sets.append(ImageSet(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
                             names, str(files[0] if len(files) == 1 else root)))
    return sets[0], sets[1]


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


# ----------------------------------------------------------------------------- splits
def split_validation(data: ImageSet, fraction: float, seed: int) -> tuple[ImageSet, ImageSet]:
    """(train, val): a seeded split holding out ``fraction`` of each class (at least one where it has 2+)."""
    if not 0 < fraction < 1:
        raise ValueError(f"validation fraction must be in (0, 1); got {fraction}")
    rng = np.random.default_rng(seed)
    val = []
    for k in range(data.num_classes):
        idx = np.flatnonzero(data.labels == k)
        take = min(max(int(round(fraction * len(idx))), 1 if len(idx) > 1 else 0), len(idx) - 1) if len(idx) else 0
        val.append(rng.permutation(idx)[:take])
    held = np.zeros(len(data), dtype=bool)
    held[np.concatenate(val)] = True
    if not held.any():
        raise ImageDataError(f"{data.source}: too few images ({len(data)}) to hold out a validation split")
    return (data.subset(np.flatnonzero(~held), f"{data.source} [train part]"),
            data.subset(np.flatnonzero(held), f"{data.source} [validation part]"))


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


# ----------------------------------------------------------------------------- tensors
def channel_stats(images: np.ndarray | Tensor, chunk: int = 4096) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of uint8 images (N, C, H, W), on the [0, 1] scale (chunked, float64)."""
    x = torch.as_tensor(images)
    if x.dim() != 4:
        raise ValueError(f"channel_stats expects images (N, C, H, W); got {tuple(x.shape)}")
    scale = 255.0 if x.dtype == torch.uint8 else 1.0
    total = torch.zeros(x.shape[1], dtype=torch.float64)
    squares = torch.zeros_like(total)
    for i in range(0, x.shape[0], chunk):
        part = x[i:i + chunk].to(torch.float64) / scale  # (b, C, H, W)
        total += part.sum(dim=(0, 2, 3))
        squares += (part ** 2).sum(dim=(0, 2, 3))
    n = x.shape[0] * x.shape[2] * x.shape[3]
    mean = total / n
    std = (squares / n - mean ** 2).clamp_min(0).sqrt()
    return tuple(mean.tolist()), tuple(std.tolist())


def normalize(images: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """(x / 255 - mean) / std per channel: uint8 (B, C, H, W) -> float32 (float input taken as [0, 1])."""
    x = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
    m = torch.as_tensor(mean, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    s = torch.as_tensor(std, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    if m.shape[1] != x.shape[1] or s.shape[1] != x.shape[1]:
        raise ValueError(f"mean/std have {m.shape[1]}/{s.shape[1]} channels, images have {x.shape[1]}")
    return (x - m) / s


class Augment:
    """Random crop after zero padding and random horizontal flip, per image, on a (B, C, H, W) batch.

    The standard CIFAR augmentation (pad 4, crop 32, flip), in plain torch on any device and dtype;
    all draws come from the ``generator`` given at each call (a CPU generator), so runs repeat.
    """

    def __init__(self, pad: int = 4, flip: bool = True):
        if pad < 0:
            raise ValueError(f"pad must be >= 0; got {pad}")
        self.pad, self.flip = pad, flip

    def __call__(self, images: Tensor, generator: torch.Generator) -> Tensor:
        B, C, H, W = images.shape
        dev = images.device
        x = images
        if self.pad:
            p = self.pad
            x = F.pad(images, (p, p, p, p))  # (B, C, H + 2p, W + 2p), zeros
            dy = torch.randint(0, 2 * p + 1, (B,), generator=generator).to(dev)
            dx = torch.randint(0, 2 * p + 1, (B,), generator=generator).to(dev)
            rows = (dy[:, None] + torch.arange(H, device=dev))[:, :, None]  # (B, H, 1)
            cols = (dx[:, None] + torch.arange(W, device=dev))[:, None, :]  # (B, 1, W)
            x = x[torch.arange(B, device=dev)[:, None, None], :, rows, cols].permute(0, 3, 1, 2)  # (B, C, H, W)
        if self.flip:
            flip = (torch.rand(B, generator=generator) < 0.5).to(dev).view(B, 1, 1, 1)
            x = torch.where(flip, x.flip(-1), x)
        return x.contiguous()
