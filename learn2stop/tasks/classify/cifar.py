"""CIFAR-10/100 on disk: the shared subset (one .npz), the binary batches and the python pickles.

The official CIFAR python batches are pickles; they are read by :class:`RestrictedUnpickler`, which builds
numpy arrays and nothing else, so a tampered file cannot run code.
"""
from __future__ import annotations

import codecs
import pickle
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from .imageset import CIFAR10_CLASSES, ImageDataError, ImageSet, check_labels

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
