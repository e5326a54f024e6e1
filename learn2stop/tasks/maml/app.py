"""MAML-stop as a CLI application: config, presets and the train / evaluate / reproduce commands.

``learn2stop maml reproduce --preset quick`` trains MAML and MAML-stop with equal meta-iterations
on task-imbalanced sinusoid regression (no data needed) and writes ``results.md``, ``results.json``
and ``stop_by_shot.png`` into the run directory.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...core.loop import StoppingModel
from ...core.objectives import StageConfig
from ...core.trainer import StagedTrainer, derive_seed
from ...core.trainer import load_finished_stage
from ...utils.config import one_of, positive, require
from ...utils.report import markdown_table, new_figure, save_figure, write_json
from ..base import RunContext
from . import data as D
from .models import NETWORKS, MAMLModel
from .policy import MAMLStopPolicy
from .samplers import FewShotSampler, SinusoidSampler
from .task import MetaLearningTask, early_exit_metrics, fixed_batches, per_step_metrics, stop_steps_by_shot, summarize

SOURCES = ("sinusoid", "omniglot_npz", "omniglot_folders", "miniimagenet")


@dataclass
class DataConfig:
    """Which tasks: the source, its path, and the N-way k1-k2-shot setting.

    source: sinusoid (embedded, no data) | omniglot_npz (background.npz + evaluation.npz) |
        omniglot_folders (images_background/ + images_evaluation/ PNGs) | miniimagenet (images/ + CSVs).
    split_file: Omniglot character order (first 1100 train, 100 val, rest test); "" = path/maml_split.txt.
    k_min, k_max: the task's shot count K ~ U{k_min..k_max}; equal values give the vanilla setting.
    query_per_class: query examples per class (sinusoid: query points per task).
    rotations: add every class rotated by 90/180/270 degrees as new classes (Omniglot).
    noise: sinusoid only, std of the noise on support targets.
    """

    source: str = "omniglot_npz"
    path: str = "../shared/data/omniglot"
    split_file: str = ""
    n_way: int = 20
    k_min: int = 1
    k_max: int = 5
    query_per_class: int = 1
    rotations: bool = True
    image_size: int = 28
    noise: float = 0.0

    def __post_init__(self):
        one_of(self.source, SOURCES, "source")
        require(isinstance(self.k_min, int) and self.k_min >= 1, "k_min", f"must be an integer >= 1; got {self.k_min!r}")
        require(isinstance(self.k_max, int) and self.k_max >= self.k_min, "k_max",
                f"must be an integer >= k_min = {self.k_min}; got {self.k_max!r}")
        require(isinstance(self.n_way, int) and self.n_way >= 1, "n_way", f"must be an integer >= 1; got {self.n_way!r}")
        require(isinstance(self.query_per_class, int) and self.query_per_class >= 1, "query_per_class",
                f"must be an integer >= 1; got {self.query_per_class!r}")
        require(isinstance(self.image_size, int) and self.image_size >= 16, "image_size", f"must be >= 16; got {self.image_size!r}")
        require(self.noise >= 0, "noise", f"must be >= 0; got {self.noise}")
        if self.source != "sinusoid":
            require(self.path != "", "path", f"needed for source = {self.source}")


@dataclass
class ModelConfig:
    """The learner and its inner loop. inner_steps: T (the policy picks among steps 1..T)."""

    network: str = "conv4"
    hidden: int = 64
    inner_steps: int = 10
    inner_lr: float = 0.1
    first_order: bool = False

    def __post_init__(self):
        one_of(self.network, NETWORKS.names(), "network")
        require(isinstance(self.hidden, int) and self.hidden >= 1, "hidden", f"must be an integer >= 1; got {self.hidden!r}")
        require(isinstance(self.inner_steps, int) and self.inner_steps >= 1, "inner_steps",
                f"must be an integer >= 1; got {self.inner_steps!r}")
        positive(self.inner_lr, "inner_lr")


@dataclass
class EvalConfig:
    """Evaluation: ``tasks`` held-out test tasks (same tasks for both methods), ``val_tasks`` for selection.

    mode: the policy's test-time rule: ``threshold`` (stop when pi_t > threshold) or ``sample``
        (stop with probability pi_t, seeded; the release's rule for LISTA-stop).
    per_step: also run every step of both meta-learners (accuracy per step, the fixed-T and oracle
        rows); costs two more passes over the test tasks.
    """

    tasks: int = 600
    val_tasks: int = 100
    chunk: int = 20
    threshold: float = 0.5
    mode: str = "threshold"
    per_step: bool = True

    def __post_init__(self):
        for name in ("tasks", "val_tasks", "chunk"):
            v = getattr(self, name)
            require(isinstance(v, int) and v >= 1, name, f"must be an integer >= 1; got {v!r}")
        require(0 < self.threshold < 1, "threshold", f"must be in (0, 1); got {self.threshold}")
        one_of(self.mode, ("threshold", "sample"), "mode")


def _maml_stage() -> StageConfig:
    return StageConfig(objective="deep_supervision", iterations=60000, batch_size=10, lr=1e-3, eval_every=500,
                       checkpoint_every=500)


def _stage1() -> StageConfig:
    return StageConfig(objective="stage1", variant="sampled", recompute=True, iterations=60000, batch_size=10,
                       lr=1e-3, beta=0.01, eval_every=500, checkpoint_every=500)


def _stage2() -> StageConfig:
    return StageConfig(objective="stage2", variant="map", iterations=5000, batch_size=10, lr=1e-3, beta=0.01,
                       eval_every=500, checkpoint_every=500)


@dataclass
class MAMLConfig:
    """MAML vs MAML-stop (paper Sec. 5.2). Defaults: Omniglot 20-way 1-5-shot, Table 4's setting.

    maml: the baseline, trained on the query loss after all T inner steps.
    stage1: MAML-stop's meta-learner (sampled Stage I with the no-grad pass and recompute, App. B.2).
    stage2: the stopping policy fitted to the oracle with theta frozen.
    """

    seed: int = 0
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    maml: StageConfig = field(default_factory=_maml_stage)
    stage1: StageConfig = field(default_factory=_stage1)
    stage2: StageConfig = field(default_factory=_stage2)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self):
        require(self.maml.objective == "deep_supervision", "maml.objective",
                f"the MAML baseline trains on the last step: must be deep_supervision; got {self.maml.objective!r}")
        require(self.stage1.objective == "stage1", "stage1.objective", f"must be stage1; got {self.stage1.objective!r}")
        require(self.stage2.objective in ("stage2", "stage3"), "stage2.objective",
                f"must be stage2 (or stage3 to fine-tune both); got {self.stage2.objective!r}")
        if self.data.source == "sinusoid":
            require(self.model.network == "mlp", "model.network", "sinusoid regression needs the mlp network")
        else:
            require(self.model.network == "conv4", "model.network", f"image data needs conv4; got {self.model.network!r}")


_ITERS = lambda n, b, every: {"iterations": n, "batch_size": b, "eval_every": every, "checkpoint_every": every}

PRESETS: dict[str, dict] = {
    # ~10 minutes on 2 CPU cores, no data: task-imbalanced sinusoid regression, 1-10 shots, noisy support.
    "quick": {
        "data": {"source": "sinusoid", "path": "", "n_way": 1, "k_min": 1, "k_max": 10, "query_per_class": 20,
                 "rotations": False, "noise": 1.0},
        "model": {"network": "mlp", "hidden": 40, "inner_steps": 10, "inner_lr": 0.02},
        "maml": {**_ITERS(3000, 25, 250), "lr": 1e-3},
        "stage1": {**_ITERS(3000, 25, 250), "lr": 1e-3, "beta": 0.05},
        "stage2": {**_ITERS(3000, 25, 250), "lr": 3e-3, "beta": 0.05},
        "eval": {"tasks": 600, "val_tasks": 200, "chunk": 100},
    },
    # Table 4: Omniglot 20-way 1-5 shot (imbalanced), 10 inner steps, inner lr 0.1, meta-batch 10, outer lr 1e-3, beta 0.01.
    "paper": {},
    # The same setting from the standard PNG folders (path: a folder with images_background/ and images_evaluation/).
    "omniglot-folders": {"data": {"source": "omniglot_folders"}},
    # Table 5's vanilla setting: Omniglot 20-way 5-shot, fixed K.
    "omniglot-vanilla": {"data": {"k_min": 5, "k_max": 5}},
    # MiniImagenet 5-way 1-10 shot: 10 steps, inner lr 0.01, meta-batch 1, outer lr 1e-4, beta 0.01 (32 filters as in MAML).
    "miniimagenet": {
        "data": {"source": "miniimagenet", "path": "data/miniimagenet", "n_way": 5, "k_min": 1, "k_max": 10,
                 "query_per_class": 5, "rotations": False, "image_size": 84},
        "model": {"hidden": 32, "inner_lr": 0.01},
        "maml": {"batch_size": 1, "lr": 1e-4}, "stage1": {"batch_size": 1, "lr": 1e-4}, "stage2": {"batch_size": 1, "lr": 1e-4},
    },
}


# ----------------------------------------------------------------------------- assembly
def load_split(cfg: DataConfig, split: str):
    """The dataset of one split (train / val / test) for an image source, rotations applied if asked."""
    if cfg.source == "omniglot_npz":
        ds = D.load_omniglot_npz(cfg.path, split, cfg.split_file or None)
    elif cfg.source == "omniglot_folders":
        ds = D.load_omniglot_folders(cfg.path, split, cfg.split_file or None, image_size=cfg.image_size)
    elif cfg.source == "miniimagenet":
        ds = D.MiniImagenet(cfg.path, split, image_size=cfg.image_size)
    else:
        return None
    return D.RotatedClasses(ds) if cfg.rotations else ds


def make_sampler(cfg: DataConfig):
    if cfg.source == "sinusoid":
        return SinusoidSampler(cfg.k_min, cfg.k_max, cfg.query_per_class, noise=cfg.noise)
    return FewShotSampler(cfg.n_way, cfg.k_min, cfg.k_max, cfg.query_per_class)


def make_network(cfg: MAMLConfig):
    if cfg.model.network == "mlp":
        return NETWORKS.get("mlp")(in_dim=1, out_dim=1, hidden=cfg.model.hidden)
    channels = 3 if cfg.data.source == "miniimagenet" else 1
    return NETWORKS.get("conv4")(in_channels=channels, image_size=cfg.data.image_size, out_dim=cfg.data.n_way,
                                 hidden=cfg.model.hidden)


def build(cfg: MAMLConfig, device, *, seed_offset: str = "") -> tuple[StoppingModel, StoppingModel]:
    """The two models, same initialisation: MAML (one output after T updates) and MAML-stop (T outputs + policy).

    The initialisation is seeded from ``cfg.seed`` (and ``seed_offset``, to draw other initialisations).
    """
    torch.manual_seed(derive_seed(cfg.seed, "init", seed_offset))
    net = make_network(cfg)
    loss = "mse" if cfg.data.source == "sinusoid" else "cross_entropy"
    T, lr, fo = cfg.model.inner_steps, cfg.model.inner_lr, cfg.model.first_order
    maml = StoppingModel(MAMLModel(net, 1, lr, fo, loss, updates_per_step=T))
    net_stop = make_network(cfg)
    net_stop.load_state_dict(net.state_dict())
    policy = MAMLStopPolicy(net_stop.feat_dim, 1 if loss == "mse" else cfg.data.n_way, T, classification=loss != "mse")
    stop = StoppingModel(MAMLModel(net_stop, T, lr, fo, loss, policy_features=True), policy)
    return maml.to(device), stop.to(device)


def step_view(maml: StoppingModel, cfg: MAMLConfig) -> MAMLModel:
    """The MAML baseline's network seen step by step (T outputs), to report its accuracy per step."""
    m = maml.model
    return MAMLModel(m.net, cfg.model.inner_steps, m.inner_lr, m.first_order, m.loss)


class Data:
    """The train/val/test datasets and the sampler, checked once against the sampler's needs."""

    def __init__(self, cfg: DataConfig):
        self.sampler = make_sampler(cfg)
        self.split = {s: load_split(cfg, s) for s in ("train", "val", "test")}
        if cfg.source != "sinusoid":
            for s, ds in self.split.items():
                self.sampler.check(ds, what=f"{cfg.source} {s} split at {cfg.path}")


# ----------------------------------------------------------------------------- commands
def train(cfg: MAMLConfig, run: RunContext, data: Data | None = None) -> dict:
    """Train MAML (baseline) and MAML-stop (Stage I, then Stage II) with equal meta-iterations."""
    data = data or Data(cfg.data)
    maml, stop = build(cfg, run.device)
    val_seed = derive_seed(cfg.seed, "val")
    summaries = {}
    task = MetaLearningTask(maml.model, data.sampler, data.split["train"], data.split["val"],
                            cfg.eval.val_tasks, val_seed, cfg.eval.chunk)
    trainer = StagedTrainer(maml, task, run.run_dir / "maml", seed=cfg.seed, ctx=run.ctx, progress=run.progress,
                            resume=run.resume)
    summaries["maml"] = trainer.fit("maml", cfg.maml)
    task = MetaLearningTask(stop.model, data.sampler, data.split["train"], data.split["val"],
                            cfg.eval.val_tasks, val_seed, cfg.eval.chunk)
    trainer = StagedTrainer(stop, task, run.run_dir / "stop", seed=cfg.seed, ctx=run.ctx, progress=run.progress,
                            resume=run.resume)
    summaries["stage1"] = trainer.fit("stage1", cfg.stage1)
    summaries["stage2"] = trainer.fit("stage2", cfg.stage2)
    write_json(summaries, run.run_dir / "train_summary.json")
    for name, s in summaries.items():
        run.log(f"{name}: {s['iterations']} iterations, best validation {s['select']} = {s['best_score']:.4g}, {s['seconds']:.0f}s")
    return summaries


def load_trained(cfg: MAMLConfig, run: RunContext) -> tuple[StoppingModel, StoppingModel]:
    maml, stop = build(cfg, run.device)
    load_finished_stage(maml, run.run_dir / "maml" / "checkpoints", "maml", map_location=run.device)
    load_finished_stage(stop, run.run_dir / "stop" / "checkpoints", "stage2", map_location=run.device)
    return maml, stop


def evaluate(cfg: MAMLConfig, run: RunContext, models: tuple | None = None, data: Data | None = None) -> dict:
    """Both methods on the same ``eval.tasks`` held-out test tasks: mean with 95% CI, stop steps by shot."""
    data = data or Data(cfg.data)
    maml, stop = models or load_trained(cfg, run)
    maml.eval(), stop.eval()
    g = torch.Generator().manual_seed(derive_seed(cfg.seed, "test"))
    batches = fixed_batches(data.sampler, data.split["test"], cfg.eval.tasks, g, cfg.eval.chunk)
    exit_ = early_exit_metrics(stop, batches, run.device, cfg.eval.threshold, cfg.eval.mode,
                               seed=derive_seed(cfg.seed, "test-stop"))
    regression = cfg.data.source == "sinusoid"
    scale, name = (1.0, "query MSE (lower is better)") if regression else (100.0, "accuracy % (higher is better)")
    T = cfg.model.inner_steps
    result: dict = {"metric": name}
    if cfg.eval.per_step:
        base = per_step_metrics(step_view(maml, cfg), batches, run.device)  # (n, T)
        full = per_step_metrics(stop.model, batches, run.device)
        best = full["metric"].min(dim=1).values if regression else full["metric"].max(dim=1).values
        rows = {f"MAML ({T} steps)": summarize(base["metric"][:, -1], scale),
                "MAML-stop (learned stop)": summarize(exit_["metric"], scale),
                f"MAML-stop meta-learner, fixed {T} steps": summarize(full["metric"][:, -1], scale),
                "MAML-stop meta-learner, oracle step": summarize(best, scale)}
        result["per_step"] = {"maml": [summarize(base["metric"][:, t], scale)["mean"] for t in range(T)],
                              "maml_stop": [summarize(full["metric"][:, t], scale)["mean"] for t in range(T)]}
    else:
        base = early_exit_metrics(maml, batches, run.device)  # MAML: one output after T updates
        rows = {f"MAML ({T} steps)": summarize(base["metric"], scale),
                "MAML-stop (learned stop)": summarize(exit_["metric"], scale)}
    n = len(exit_["metric"])
    by_shot = stop_steps_by_shot(exit_["shots"], exit_["stop_times"])
    result.update({"tasks": n, "rows": rows, "mean_stop_step": float(exit_["stop_times"].float().mean()),
                   "inner_steps_computed": {"maml": n * T, "maml_stop": int(exit_["steps_computed"])},
                   "stop_by_shot": by_shot})
    table = markdown_table(["method", name, "95% CI +-"], [[k, v["mean"], v["ci95"]] for k, v in rows.items()],
                           digits=3 if regression else 2)
    shots_table = markdown_table(["K (shots)", "tasks", "mean stop step"],
                                 [[k, v["tasks"], v["mean_stop"]] for k, v in by_shot.items()])
    text = (f"# MAML vs MAML-stop: {cfg.data.source}, {cfg.data.n_way}-way {cfg.data.k_min}-{cfg.data.k_max} shot, "
            f"{n} test tasks\n\n{table}\n\nInner steps computed: MAML {n * T}, MAML-stop {exit_['steps_computed']} "
            f"(mean stop step {result['mean_stop_step']:.2f} of {T}).\n\n## Stop step by shot count\n\n{shots_table}\n")
    (run.run_dir / "results.md").write_text(text)
    write_json(result, run.run_dir / "results.json")
    plot_stop_by_shot(by_shot, T, run.run_dir / "stop_by_shot.png")
    run.log(text)
    return result


def plot_stop_by_shot(by_shot: dict, num_steps: int, path: Path) -> Path:
    """Stacked distribution of the stop step for each shot count, with the mean marked."""
    fig, ax = new_figure(figsize=(6, 3.5))
    ks = sorted(by_shot)
    hists = torch.tensor([by_shot[k]["hist"] + [0] * (num_steps - len(by_shot[k]["hist"])) for k in ks], dtype=torch.float)
    frac = hists / hists.sum(dim=1, keepdim=True).clamp_min(1)
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


def reproduce(cfg: MAMLConfig, run: RunContext) -> dict:
    """Train both methods, then evaluate them on the same test tasks."""
    data = Data(cfg.data)
    train(cfg, run, data)
    return evaluate(cfg, run, data=data)
