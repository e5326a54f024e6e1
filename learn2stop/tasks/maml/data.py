"""Few-shot datasets: Omniglot (compact .npz arrays or the standard PNG folders), MiniImagenet
(images folder + CSV split files) and the embedded sinusoid-regression toy that needs no data.

Every image dataset here is a list of classes, each a list of images, behind one small interface
(:class:`ClassImages`): ``num_classes``, ``class_sizes`` and ``images(c, idx) -> (n, C, H, W)``
float tensor. Samplers (``samplers.py``) only see that interface. Nothing is downloaded.

Loading checks what would otherwise go wrong silently: class names are unique and aligned with
the image arrays (a misaligned name labels images wrongly), the train/val/test splits share no
class (a shared one leaks test characters into training), and every image of a dataset has one
size, the one asked for when ``image_size`` is given, before any training starts.

Pieces: :mod:`.classes` (the interface and its checks), :mod:`.omniglot`; MiniImagenet and the sinusoid here.
"""
from __future__ import annotations

import csv
import math
from pathlib import Path


import numpy as np
import torch
from torch import Tensor

from ...utils.images import read_image, to_uint8
from .classes import ClassImages, DataError, RotatedClasses, check_disjoint, duplicates
from .omniglot import OMNIGLOT_SPLIT, _load_gray, load_omniglot_folders, load_omniglot_npz

__all__ = ["OMNIGLOT_SPLIT", "ClassImages", "DataError", "MiniImagenet", "RotatedClasses", "Sinusoid", "_load_gray",
           "check_disjoint", "duplicates", "load_omniglot_folders", "load_omniglot_npz"]


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
