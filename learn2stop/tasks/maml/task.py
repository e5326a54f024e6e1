"""Where the tasks come from (data config, datasets, samplers), the training task for the core
trainer, and the report pieces of ``evaluate``."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ...core.trees import tree_map
from ...utils.config import ints_at_least, one_of, require
from . import data as D
from .losses import confidence_interval
from .models import MAMLModel
from .samplers import FewShotSampler, SinusoidSampler

SOURCES = ("sinusoid", "omniglot_npz", "omniglot_folders", "miniimagenet")


@dataclass
class DataConfig:
    """Which tasks: the source, its path, and the N-way k1-k2-shot setting."""

    source: str = "omniglot_npz"
    """sinusoid (embedded, no data) | omniglot_npz (background.npz + evaluation.npz) | omniglot_folders
    (images_background/ + images_evaluation/ PNGs) | miniimagenet (images/ + CSVs)."""
    path: str = "../shared/data/omniglot"
    """Folder of the data set (unused by sinusoid)."""
    split_file: str = ""
    """Omniglot character order (first 1100 train, 100 val, rest test); "" = path/maml_split.txt."""
    n_way: int = 20
    """Classes per task (N)."""
    k_min: int = 1
    """the task's shot count K ~ U{k_min..k_max}; equal values give the vanilla setting."""
    k_max: int = 5
    """the task's shot count K ~ U{k_min..k_max}; equal values give the vanilla setting."""
    query_per_class: int = 1
    """query examples per class (sinusoid: query points per task)."""
    rotations: bool = True
    """add every class rotated by 90/180/270 degrees as new classes (Omniglot)."""
    image_size: int = 28
    """Side in pixels to which images are resized (>= 16)."""
    noise: float = 0.0
    """sinusoid only, std of the noise on support targets."""

    def __post_init__(self):
        one_of(self.source, SOURCES, "source")
        ints_at_least(self, "k_min", "n_way", "query_per_class")
        if self.source != "sinusoid":  # one class is no classification: every label is 0 and the loss is 0
            require(self.n_way >= 2, "n_way", f"a few-shot task needs at least 2 classes; got {self.n_way}")
        require(isinstance(self.k_max, int) and self.k_max >= self.k_min, "k_max",
                f"must be an integer >= k_min = {self.k_min}; got {self.k_max!r}")
        ints_at_least(self, "image_size", least=16)
        require(self.noise >= 0, "noise", f"must be >= 0; got {self.noise}")
        if self.source != "sinusoid":
            require(self.path != "", "path", f"needed for source = {self.source}")


class Data:
    """The train/val/test datasets and the sampler, checked once against the sampler's needs."""

    def __init__(self, cfg: DataConfig):
        if cfg.source == "sinusoid":
            self.sampler = SinusoidSampler(cfg.k_min, cfg.k_max, cfg.query_per_class, noise=cfg.noise)
            self.split = {"train": None, "val": None, "test": None}  # tasks are generated, not loaded
            return
        self.sampler = FewShotSampler(cfg.n_way, cfg.k_min, cfg.k_max, cfg.query_per_class)
        load = {"omniglot_npz": lambda s: D.load_omniglot_npz(cfg.path, s, cfg.split_file or None, image_size=cfg.image_size),
                "omniglot_folders": lambda s: D.load_omniglot_folders(cfg.path, s, cfg.split_file or None, image_size=cfg.image_size),
                "miniimagenet": lambda s: D.MiniImagenet(cfg.path, s, image_size=cfg.image_size)}[cfg.source]
        self.split = {s: load(s) for s in ("train", "val", "test")}
        if cfg.rotations:
            self.split = {s: D.RotatedClasses(ds) for s, ds in self.split.items()}
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


# ----------------------------------------------------------------------------- report pieces
def summarize(values: Tensor, scale: float = 1.0) -> dict[str, float]:
    """Mean and 95% half-width of per-task values (times ``scale``, e.g. 100 for accuracy in %)."""
    mean, half = confidence_interval(values * scale)
    return {"mean": mean, "ci95": half}


def stop_steps_by_shot(shots: Tensor, stop_times: Tensor) -> dict[int, dict[str, Any]]:
    """Per shot count K: tasks, mean stop step and the histogram of stop steps 1..max."""
    out = {}
    for k in sorted(set(shots.tolist())):
        s = stop_times[shots == k]
        out[int(k)] = {"tasks": int(s.numel()), "mean_stop": float(s.float().mean()),
                       "hist": torch.bincount(s, minlength=int(stop_times.max()) + 1)[1:].tolist()}
    return out


def results_markdown(result: dict, title: str, num_steps: int) -> str:
    """``results.md``: the methods' table with 95% CIs, the rule and steps computed, stop step by shot."""
    from ...utils.report import markdown_table

    name = f"{result['metric']} ({'lower' if result['lower_is_better'] else 'higher'} is better)"
    table = markdown_table(["method", name, "95% CI +-"], [[k, v["mean"], v["ci95"]] for k, v in result["rows"].items()],
                           digits=3 if result["lower_is_better"] else 2)
    shots = markdown_table(["K (shots)", "tasks", "mean stop step"],
                           [[k, v["tasks"], v["mean_stop"]] for k, v in result["stop_by_shot"].items()])
    steps = result["inner_steps_computed"]
    return (f"# MAML vs MAML-stop: {title}\n\n{table}\n\nMAML-stop stops with the {result['rule']}. Inner steps "
            f"computed: MAML {steps['maml']}, MAML-stop {steps['maml_stop']} (mean stop step "
            f"{result['mean_stop_step']:.2f} of {num_steps}).\n\n## Stop step by shot count\n\n{shots}\n")


def plot_stop_by_shot(by_shot: dict, num_steps: int, path: Path) -> Path:
    """Stacked distribution of the stop step for each shot count, with the mean marked."""
    from ...utils.report import new_figure, save_figure

    fig, ax = new_figure(figsize=(6, 3.5))
    ks = sorted(by_shot)
    hists = torch.tensor([by_shot[k]["hist"] + [0] * (num_steps - len(by_shot[k]["hist"])) for k in ks], dtype=torch.float)
    frac = hists / hists.sum(dim=1, keepdim=True).clamp_min(1)  # (K values, T)
    bottom = torch.zeros(len(ks))
    cmap = __import__("matplotlib").colormaps["viridis"]
    for t in range(num_steps):
        ax.bar(ks, frac[:, t], bottom=bottom, color=cmap(t / max(num_steps - 1, 1)), label=f"t={t + 1}")
        bottom += frac[:, t]
    ax2 = ax.twinx()
    ax2.plot(ks, [by_shot[k]["mean_stop"] for k in ks], "k-o", label="mean stop step")
    ax2.set_ylim(0.5, num_steps + 0.5)
    ax2.set_ylabel("mean stop step")
    ax.set_xlabel("shots K of the task")
    ax.set_ylabel("fraction of tasks")
    ax.set_title("MAML-stop: stop step by shot count")
    ax.legend(fontsize=6, ncol=2, loc="upper left", bbox_to_anchor=(1.12, 1.0))
    return save_figure(fig, path)
