"""The tasks of a MAML run: the sources' train/val/test splits and their sampler (:class:`Data`), the fixed
evaluation task batches, the training task the core trainer samples, and MiniImagenet.

Every image dataset is a list of classes, each a list of images, behind one small interface
(:class:`~.classes.ClassImages`): ``num_classes``, ``class_sizes`` and ``images(c, idx) -> (n, C, H, W)``
float tensor. Samplers (:mod:`.samplers`, with the embedded sinusoid-regression toy that needs no data) only see
that interface. Nothing is downloaded.

Loading checks what would otherwise go wrong silently: class names are unique and aligned with
the image arrays (a misaligned name labels images wrongly), the train/val/test splits share no
class (a shared one leaks test characters into training), and every image of a dataset has one
size, the one asked for when ``image_size`` is given, before any training starts.

Pieces: :mod:`.classes` (the interface and its checks), :mod:`.omniglot` (compact .npz arrays or the standard PNG
folders), :mod:`.samplers`; MiniImagenet (images folder + CSV split files) here.
"""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ...core.trees import tree_map
from ...utils.images import read_image, to_uint8
from .classes import DataError, RotatedClasses, check_disjoint
from .config import DataConfig
from .learner import MAMLModel
from .omniglot import load_omniglot_folders, load_omniglot_npz
from .samplers import FewShotSampler, SinusoidSampler


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


class Data:
    """The train/val/test datasets and the sampler, checked once against the sampler's needs."""

    def __init__(self, cfg: DataConfig):
        if cfg.source == "sinusoid":
            self.sampler = SinusoidSampler(cfg.k_min, cfg.k_max, cfg.query_per_class, noise=cfg.noise)
            self.split = {"train": None, "val": None, "test": None}  # tasks are generated, not loaded
            return
        self.sampler = FewShotSampler(cfg.n_way, cfg.k_min, cfg.k_max, cfg.query_per_class)
        load = {"omniglot_npz": lambda s: load_omniglot_npz(cfg.path, s, cfg.split_file or None, image_size=cfg.image_size),
                "omniglot_folders": lambda s: load_omniglot_folders(cfg.path, s, cfg.split_file or None, image_size=cfg.image_size),
                "miniimagenet": lambda s: MiniImagenet(cfg.path, s, image_size=cfg.image_size)}[cfg.source]
        self.split = {s: load(s) for s in ("train", "val", "test")}
        if cfg.rotations:
            self.split = {s: RotatedClasses(ds) for s, ds in self.split.items()}
        for s, ds in self.split.items():
            self.sampler.check(ds, what=f"{cfg.source} {s} split at {cfg.path}")


def to_device(tree: Any, device) -> Any:
    return tree_map(lambda x: x.to(device), tree)


class MetaLearningTask:
    """Training task for :class:`~learn2stop.core.trainer.StagedTrainer`: meta-batches of tasks.

    Args:
        model: the :class:`MAMLModel` whose ``task_loss`` is the per-task query loss.
        sampler: a task sampler (``samplers.py``); ``train_data`` / ``val_data``: the datasets it draws from.
        val_tasks: number of fixed validation tasks; ``val_seed`` fixes them; ``chunk``: tasks per forward.
        val_batches: the fixed validation batches themselves (then ``val_data``, ``val_tasks``,
            ``val_seed`` and ``chunk`` are unused), so that selection and calibration share them.
    """

    def __init__(self, model: MAMLModel, sampler, train_data, val_data, val_tasks: int = 100, val_seed: int = 0,
                 chunk: int = 20, val_batches: list | None = None):
        self.model, self.sampler, self.train_data = model, sampler, train_data
        if val_batches is None:
            val_batches = fixed_batches(sampler, val_data, val_tasks, torch.Generator().manual_seed(val_seed), chunk)
        self._val = val_batches

    def loss_fn(self, output: dict, target: Tensor) -> Tensor:
        return self.model.task_loss(output, target)

    def sample_batch(self, batch_size: int, generator: torch.Generator, device) -> tuple[dict, Tensor]:
        inputs, target = self.sampler.batch(self.train_data, batch_size, generator)
        return to_device(inputs, device), to_device(target, device)

    def validation_batches(self, device):
        return [(to_device(i, device), to_device(t, device)) for i, t in self._val]


def fixed_batches(sampler, data, num_tasks: int, generator: torch.Generator, chunk: int) -> list[tuple[dict, Tensor]]:
    """``num_tasks`` tasks drawn once with ``generator``, in meta-batches of at most ``chunk``."""
    out, left = [], num_tasks
    while left > 0:
        n = min(chunk, left)
        out.append(sampler.batch(data, n, generator))
        left -= n
    return out
