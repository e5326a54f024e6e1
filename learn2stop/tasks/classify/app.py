"""Early-exit image recognition (paper Sec. 5.4, Table 7): VGG-BN and ResNets with internal classifiers (--model.arch).

    learn2stop classify reproduce --preset quick        # CIFAR-10 subset of ../shared/data, vgg6-narrow
    learn2stop classify reproduce --preset quick --model.arch resnet20 --run-dir runs/classify-quick-resnet20
    learn2stop classify frontier --run-dir runs/classify-quick
    learn2stop classify predict --run-dir runs/classify-quick --predict.input photo.png

Trainings on one architecture: the network alone (last classifier only), SDN (internal classifiers
weighted by SDN's tau), and Stage I with the oracle (softmin of the cross-entropies, beta = 1,
optionally with a price on FLOPs), then the Stage II policy. Exit rules compared on the same
networks: confidence (SDN), entropy, patience (PABEE), the learned policy calibrated to budgets,
and the oracle exit (the first internal classifier that is right: a bound).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from ...core import InferenceConfig, MethodConfig, Metric, StageConfig, StoppingModel, derive_seed
from ...core.evaluation import collect_trace, evaluate_rule
from ...core.objectives import stage_field
from ...core.pipeline import Stage, StoppingApp, check_config, deployed_rule, load_stage, stop_model_trace
from ...core.rules import SIGNALS, ConfidenceSignal, EntropySignal, PatienceSignal, first_crossing
from ...core.calibration import calibrate_budget
from ...utils.config import ConfigError, int_at_least, one_of, require
from ...utils.report import markdown_table, write_json
from ...utils.images import list_image_files
from ..base import TaskSpec, as_run, register_task, train_pipeline
from .data import Augment, ImageDataError, ImageSet, channel_stats, list_datasets, load_dataset, load_image_file, \
    normalize, split_validation
from .models import ARCHS, build_network, initialise
from .policy import ExitPolicy

PAPER_TABLE7 = {"VGG16": 58.60, "SDN training (best IC)": 77.78, "Stage I (oracle exit)": 83.26}
SOURCES = ("synthetic", *list_datasets())


@dataclass
class DataConfig:
    """The images. ``synthetic``: generated class-coded textures (no data needed; tests and demos)."""

    kind: str = "tiny_imagenet"
    path: str = "data/tiny-imagenet-200"
    size: int = 64
    val_fraction: float = 0.1
    augment: bool = True
    synthetic_per_class: int = 60
    synthetic_classes: int = 4

    def __post_init__(self):
        one_of(self.kind, SOURCES, "data.kind")
        require(0 < self.val_fraction < 1, "data.val_fraction", f"must be in (0, 1); got {self.val_fraction}")
        int_at_least(self.size, "data.size", 8)
        int_at_least(self.synthetic_classes, "data.synthetic_classes", 2)  # one class: nothing to classify
        require(self.kind == "synthetic" or self.path != "", "data.path", f"needed for data.kind = {self.kind}")


@dataclass
class ModelConfig:
    """The network: an architecture of :func:`~learn2stop.tasks.classify.models.list_archs`, exits attached.

    ic_positions: exits after these candidates (1-based; VGG: conv layers, ResNet: residual blocks);
        () = the architecture's own (SDN's FLOP-based placement unless it fixes its own).
    fc_width: VGG's hidden classifier width; -1 = the architecture's, 0 = one linear layer on pooled features.
    width: a ResNet's first-stage channels (the other stages scale with it); 0 = the architecture's.
    """

    arch: str = "vgg16"
    ic_positions: tuple[int, ...] = ()
    fc_width: int = -1
    dropout: float = 0.5
    width: int = 0
    policy_hidden: int = 32

    def __post_init__(self):
        one_of(self.arch, ARCHS.names(), "model.arch")
        require(self.fc_width >= -1, "model.fc_width", f"must be >= 0 (or -1: the architecture's); got {self.fc_width}")
        require(self.width >= 0, "model.width", f"must be >= 0; got {self.width}")
        require(0 <= self.dropout < 1, "model.dropout", f"must be in [0, 1); got {self.dropout}")
        require(self.policy_hidden >= 1, "model.policy_hidden", f"must be >= 1; got {self.policy_hidden}")


@dataclass
class PredictConfig:
    input: str = ""  # an image file or a folder of images
    output: str = ""  # default <run-dir>/predictions.json


def _stage(**kw):
    # Adam with a cosine schedule after a short warm-up; a light L2 (Adam's coupled weight decay at SDN's 5e-4
    # held the quick network at 48 %: with Adam it acts far more strongly than with SGD)
    base = dict(iterations=60_000, batch_size=128, lr=1e-3, weight_decay=5e-5, lr_schedule="cosine", warmup=50,
                eval_every=1000, checkpoint_every=1000)
    return stage_field(**{**base, **kw})


@dataclass
class ClassifyConfig:
    """VGG with internal classifiers: the network alone, SDN training, Stage I + II (paper Table 7)."""

    seed: int = 0
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    method: MethodConfig = field(default_factory=lambda: MethodConfig(beta=1.0))
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    baseline: StageConfig = _stage(objective="deep_supervision", variant="last", select="last")
    sdn: StageConfig = _stage(objective="deep_supervision", variant="weighted", select="oracle")
    # marginal: the oracle as fixed weights; through q* (expected) pushes each image's worse exits up
    stage1: StageConfig = _stage(objective="stage1", variant="marginal", iterations=20_000, lr=1e-4)
    stage2: StageConfig = _stage(objective="stage2", variant="forward_kl", iterations=3000, lr=3e-3, weight_decay=0.0,
                                 lr_schedule="constant", eval_every=250, checkpoint_every=250)
    stage3: StageConfig = _stage(objective="stage3", iterations=0, lr=1e-4)
    sdn_tau: tuple[float, ...] = (0.15, 0.3, 0.45, 0.6, 0.75, 0.9)  # SDN's final IC weights (interpolated to the ICs)
    eval_batch: int = 256
    table_budget: float = 0.5  # Table 7 compares the policy and the confidence rule at this share of the FLOPs
    predict: PredictConfig = field(default_factory=PredictConfig)

    def __post_init__(self):
        for name, obj in (("baseline", "deep_supervision"), ("sdn", "deep_supervision"), ("stage1", "stage1"),
                          ("stage2", "stage2"), ("stage3", "stage3")):
            require(getattr(self, name).objective == obj, f"{name}.objective", f"must be {obj!r}")
        require(len(self.sdn_tau) >= 1 and all(0 < t <= 1 for t in self.sdn_tau), "sdn_tau", "weights in (0, 1]")
        require(self.eval_batch >= 1, "eval_batch", "must be >= 1")
        require(0 < self.table_budget <= 1, "table_budget", f"must be in (0, 1]; got {self.table_budget}")


def _quick(it: int, **kw) -> dict:
    """A short stage of the CPU presets: the same optimiser as :func:`_stage` (Adam, cosine, warm-up), lr 2e-3."""
    return {"iterations": it, "batch_size": 128, "lr": 2e-3, "eval_every": max(it // 5, 1),
            "checkpoint_every": max(it // 5, 1), **kw}


PRESETS: dict[str, dict] = {
    # The CIFAR-10 subset of ../shared/data (4,068 train / 1,017 test), a narrow 6-conv VGG with 5 exits whose
    # classifier is one linear layer like its exits (VGG's 3-layer head with dropout 0.5 was the weakest exit).
    "quick": {"data": {"kind": "cifar_subset_npz", "path": "../shared/data/cifar10-subset", "size": 32},
              "model": {"arch": "vgg6-narrow", "fc_width": 0, "dropout": 0.2},
              "baseline": _quick(700), "sdn": _quick(800), "stage1": _quick(150, lr=2e-4, warmup=0),
              "stage2": _quick(300, lr=3e-3, weight_decay=0.0, lr_schedule="constant", warmup=0),
              "method": {"beta": 1.0, "price": 1.0}},
    # VGG16-BN on the same subset (a few CPU-hours; benchmarks/classify_cifar.py).
    "cifar": {"data": {"kind": "cifar_subset_npz", "path": "../shared/data/cifar10-subset", "size": 32},
              "model": {"arch": "vgg16"}, "baseline": _quick(6000, lr=1e-3), "sdn": _quick(6000, lr=1e-3),
              "stage1": _quick(2000, lr=1e-4, variant="expected", warmup=0),
              "stage2": _quick(1500, lr=3e-3, weight_decay=0.0, lr_schedule="constant", warmup=0),
              "method": {"beta": 3.0, "price": 1.0}},
    # The paper: VGG16-BN on Tiny-ImageNet at 64x64 (a GPU job; the dataclass defaults).
    "paper": {},
}


# ----------------------------------------------------------------------------- data
def synthetic_set(n_per_class: int, classes: int, size: int, seed: int) -> ImageSet:
    """Class-coded oriented gratings in colour with noise: an embedded, learnable stand-in."""
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.arange(size, dtype=torch.float32), torch.arange(size, dtype=torch.float32), indexing="ij")
    imgs, labels = [], []
    for k in range(classes):
        angle = torch.pi * k / classes + 0.3 * torch.randn(n_per_class, 1, 1, generator=g)
        freq = 0.3 + 0.05 * torch.rand(n_per_class, 1, 1, generator=g)
        wave = torch.sin(freq * (xx * torch.cos(angle) + yy * torch.sin(angle)))  # (n, H, W)
        colour = torch.rand(n_per_class, 3, 1, 1, generator=g)
        img = 0.5 + 0.35 * wave[:, None] * colour + 0.25 * torch.randn(n_per_class, 3, size, size, generator=g)
        imgs.append((img.clamp(0, 1) * 255).to(torch.uint8))
        labels += [k] * n_per_class
    return ImageSet(torch.cat(imgs).numpy(), np.array(labels), [f"class{k}" for k in range(classes)], "synthetic")


class Images:
    """Train / validation / test sets and the training normalisation, loaded once and checked."""

    def __init__(self, cfg: ClassifyConfig):
        d = cfg.data
        if d.kind == "synthetic":
            train = synthetic_set(d.synthetic_per_class, d.synthetic_classes, d.size, cfg.seed)
            test = synthetic_set(max(d.synthetic_per_class // 3, 2), d.synthetic_classes, d.size, cfg.seed + 1)
        else:
            train, test = load_dataset(d.kind, d.path, **({"size": d.size} if d.kind in ("tiny_imagenet", "folder") else {}))
        for s in (train, test):
            if s.image_shape[1:] != (d.size, d.size):
                raise ImageDataError(f"{s.source}: images are {s.image_shape[1]}x{s.image_shape[2]}, but data.size "
                                     f"is {d.size}; set --data.size {s.image_shape[1]}")
        self.train, self.val = split_validation(train, d.val_fraction, cfg.seed)
        self.test, self.classes = test, train.classes
        self.mean, self.std = channel_stats(self.train.images)

    def prepare(self, images: Tensor) -> Tensor:
        return normalize(images, self.mean, self.std)

    def batches(self, split: str, batch: int, device) -> list[tuple[Tensor, Tensor]]:
        s = {"train": self.train, "val": self.val, "test": self.test}[split]
        x, y = s.tensors()
        return [(self.prepare(x[i:i + batch]).to(device), y[i:i + batch].to(device)) for i in range(0, len(s), batch)]


class ClassifyTask:
    """Augmented training batches and the fixed validation set, for the trainer."""

    def __init__(self, images: Images, augment: bool, batch: int):
        self.images, self.augment, self.batch = images, Augment() if augment else None, batch
        self.x, self.y = images.train.tensors()

    @staticmethod
    def loss_fn(logits: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(logits, target, reduction="none")

    def sample_batch(self, n: int, generator: torch.Generator, device):
        idx = torch.randint(len(self.y), (n,), generator=generator)
        x = self.x[idx]
        if self.augment is not None:
            x = self.augment(x, generator)
        return self.images.prepare(x).to(device), self.y[idx].to(device)

    def validation_batches(self, device):
        return self.images.batches("val", self.batch, device)


# ----------------------------------------------------------------------------- the pipeline
class ClassifyApp(StoppingApp):
    budget_by = "cost"  # budgets and the frontier's x-axis in FLOPs
    frontier_also = {"sdn": "sdn"}  # the confidence, entropy and patience rules on the SDN-trained network too
    speed_batch = 256
    speed_samples = 200

    def __init__(self):
        self._images: dict[str, Images] = {}
        self._networks: dict[str, Any] = {}

    def images(self, cfg: ClassifyConfig) -> Images:
        key = repr((cfg.data, cfg.seed))
        if key not in self._images:
            self._images = {key: Images(cfg)}
        return self._images[key]

    def network(self, cfg: ClassifyConfig):
        m, imgs = cfg.model, self.images(cfg)
        key = repr((m, cfg.data.size, len(imgs.classes), imgs.train.image_shape[0]))
        if key not in self._networks:  # tracing, placing exits and counting FLOPs once; every model is a copy
            try:  # exit_costs: cumulative FLOPs of exiting at t, the price's and the frontier's cost
                self._networks = {key: build_network(
                    m.arch, len(imgs.classes), cfg.data.size, m.ic_positions or None, in_channels=imgs.train.image_shape[0],
                    fc_width=None if m.fc_width < 0 else m.fc_width, dropout=m.dropout, width=m.width or None)}
            except ValueError as e:
                raise ConfigError(f"model ({m.arch} at data.size {cfg.data.size}): {e}") from None
        return copy.deepcopy(self._networks[key])

    def build_models(self, cfg: ClassifyConfig, device) -> dict[str, StoppingModel]:
        torch.manual_seed(derive_seed(cfg.seed, "init") % 2**63)
        nets = {k: self.network(cfg) for k in ("baseline", "sdn", "stop")}
        for net in nets.values():
            initialise(net)  # fresh weights drawn under this seed, whenever the template was built
        n = nets["stop"]
        policy = ExitPolicy(n.num_classes, n.num_steps, hidden=cfg.model.policy_hidden)
        return {k: StoppingModel(v, policy if k == "stop" else None).to(device) for k, v in nets.items()}

    def training_task(self, cfg, key, sm):
        return ClassifyTask(self.images(cfg), cfg.data.augment, cfg.eval_batch)

    def stages(self, cfg: ClassifyConfig) -> list[Stage]:
        T = self.network(cfg).num_steps
        tau = np.interp(np.linspace(0, 1, T - 1), np.linspace(0, 1, len(cfg.sdn_tau)), cfg.sdn_tau).tolist()
        sdn = StageConfig(**{**cfg.sdn.__dict__, "step_weights": tuple(tau) + (1.0,)})
        out = [Stage("baseline", "baseline", cfg.baseline, describe="the network alone (last classifier)"),
               Stage("sdn", "sdn", sdn, describe=f"SDN: IC losses weighted {[round(t, 2) for t in tau]} + final"),
               # Stage I fine-tunes the SDN network: trained from scratch on the oracle alone, each image's
               # loss concentrates on whichever exit already fits it, and the other exits decay (measured:
               # final classifier 9 %, oracle exit 98 % on VGG16 / CIFAR subset), which no label-free rule can use.
               Stage("stage1", "stop", cfg.stage1, init_from="sdn", describe="Stage I: oracle-weighted IC losses, from SDN"),
               Stage("stage2", "stop", cfg.stage2, describe="Stage II: the exit policy")]
        if cfg.stage3.iterations > 0:
            out.append(Stage("stage3", "stop", cfg.stage3, describe="Stage III"))
        return out

    def eval_batches(self, cfg, split, device):
        return self.images(cfg).batches(split, cfg.eval_batch, device)

    def metric(self, cfg) -> Metric:
        return Metric("accuracy (%)", lambda logits, y: (logits.argmax(1) == y).float(), lower_is_better=False,
                      aggregate=lambda v, ex: 100 * v.double().mean())

    def classical_signals(self, cfg):
        return {"confidence": ConfidenceSignal, "entropy": EntropySignal, "patience": PatienceSignal}

    def risk_losses(self, cfg, trace):
        """Wrong where full depth is right (CALM's consistency form), in [0, 1]: epsilon is in accuracy fraction."""
        return (trace.metric[:, -1:] - trace.metric).clamp_min(0), (0.0, 1.0)

    def cost_unit(self, cfg, sm):
        return "flops", float(sm.model.exit_costs[-1])


APP = ClassifyApp()



# ----------------------------------------------------------------------------- commands
def train(cfg: ClassifyConfig, run) -> dict:
    check_config(cfg)  # a dict or a class: one clear TypeError, not an AttributeError deep in the loader
    imgs = APP.images(cfg)
    return train_pipeline(APP, cfg, run, f"classify: {len(imgs.train)} train / {len(imgs.val)} validation / "
                          f"{len(imgs.test)} test images, {len(imgs.classes)} classes, {cfg.data.size}x{cfg.data.size}")


@torch.no_grad()
def evaluate(cfg: ClassifyConfig, run) -> dict:
    """Table 7: every training's accuracy per exit, oracle exit, and the rules at equal FLOPs."""
    check_config(cfg)
    run = as_run(run)
    dev, metric = run.device, APP.metric(cfg)
    test = APP.eval_batches(cfg, "test", dev)
    rows, result = [], {"per_exit": {}}
    traces = {}
    for stage, label in (("baseline", "network alone"), ("sdn", "SDN training"), ("stage2", "Stage I (+ II policy)")):
        sm = load_stage(APP, cfg, run.run_dir, stage, dev)
        if stage == "stage2":
            tr = stop_model_trace(APP, cfg, sm, "test", dev)
        else:
            tr = collect_trace(sm.model, test, metric, dev,
                               signals={k: f for k, f in APP.classical_signals(cfg).items()})
        traces[stage] = (tr, sm)
        acc = (100 * tr.metric.mean(0)).tolist()
        result["per_exit"][label] = acc
        rows.append([label, acc[-1], max(acc), 1 + int(np.argmax(acc)), 100 * float(tr.metric.amax(1).mean())])
    full_flops = traces["baseline"][1].model.network_flops
    tr, sm = traces["stage2"]
    val = stop_model_trace(APP, cfg, sm, "val", dev)
    flops = torch.tensor(sm.model.exit_costs, dtype=torch.float64)
    rule_rows = []
    for name, network in (("policy", "stage2"), ("confidence", "stage2"), ("confidence", "sdn"), ("entropy", "stage2"),
                          ("patience", "stage2")):
        trace = traces[network][0]
        key = "quantile" if name == "policy" else name
        vtrace = val if network == "stage2" else collect_trace(traces[network][1].model, APP.eval_batches(cfg, "val", dev),
                                                               metric, dev, signals={name: APP.classical_signals(cfg)[name]})
        cal = calibrate_budget(vtrace.signals[key], vtrace.costs, cfg.table_budget, key,
                               SIGNALS[key].to_param)
        stops = first_crossing(trace.signals[key], cal.threshold)
        rule_rows.append([f"{name} on {'Stage I' if network == 'stage2' else 'SDN'} network", cfg.table_budget,
                          metric(trace.at(stops)), float(flops[stops - 1].mean() / full_flops) * 100,
                          float(stops.float().mean())])
    sm_rule, desc = deployed_rule(APP, cfg, run.run_dir, sm)
    deployed = evaluate_rule(sm.model, test, lambda: sm_rule, metric, dev, runner=run.runner)
    result.update({"table": rows, "rules_at_equal_flops": rule_rows, "full_network_flops": full_flops,
                   "deployed": {"rule": desc, "accuracy": deployed["metric"], "mean_steps": deployed["mean_steps"],
                                "flops_fraction": float(flops[deployed["stop_times"] - 1].mean() / full_flops)}})
    table = markdown_table(["training", "final classifier %", "best single exit %", "best exit", "oracle exit %"], rows)
    rules = markdown_table(["rule", "budget (FLOPs share, validation)", "test accuracy %", "test FLOPs % of network",
                            "mean exit"], rule_rows)
    paper = ", ".join(f"{k} {v:.2f}" for k, v in PAPER_TABLE7.items())
    text = (f"# Table 7: early-exit recognition ({cfg.model.arch}, {cfg.data.kind}, {len(tr.metric)} test images)\n\n"
            f"{table}\n\nPaper (VGG16-BN, Tiny-ImageNet): {paper}.\n\n## Exit rules at equal FLOPs\n\n{rules}\n\n"
            f"Deployed ({desc}): {deployed['metric']:.2f} % at {100 * result['deployed']['flops_fraction']:.1f} % "
            f"of the network's FLOPs ({full_flops / 1e6:.1f} MFLOPs per image).\n")
    if run.ctx.is_main:
        (run.run_dir / "table7.md").write_text(text)
        write_json(result, run.run_dir / "results.json")
    run.log(text)
    return result


@torch.no_grad()
def predict(cfg: ClassifyConfig, run) -> dict:
    """An image file or folder in: class, exit step and FLOPs spent per image out (``predictions.json``)."""
    run = as_run(run)
    src = Path(cfg.predict.input)
    if not cfg.predict.input or not src.exists():
        raise ConfigError(f"predict.input: give an image file or folder; got {cfg.predict.input!r}")
    imgs = APP.images(cfg)
    files = list_image_files(src, recursive=True, error=ImageDataError) if src.is_dir() else [src]
    arrays = []
    for f in files:
        arr, notes = load_image_file(f, cfg.data.size, imgs.train.image_shape[0])
        for n in notes:
            run.log(f"note: {n}")
        arrays.append(arr)
    sm = load_stage(APP, cfg, run.run_dir, APP.stop_stage, run.device)
    rule, desc = deployed_rule(APP, cfg, run.run_dir, sm)
    from ...core.loop import run_with_early_exit

    x = imgs.prepare(torch.from_numpy(np.stack(arrays))).to(run.device)
    r = run_with_early_exit(sm.model, x, rule)
    flops = sm.model.exit_costs
    out = [{"file": str(f), "class": imgs.classes[int(c)], "exit": int(t), "flops": int(flops[int(t) - 1])}
           for f, c, t in zip(files, r.outputs.argmax(1).tolist(), r.stop_times.tolist())]
    path = Path(cfg.predict.output) if cfg.predict.output else run.run_dir / "predictions.json"
    if run.ctx.is_main:
        write_json({"rule": desc, "predictions": out}, path)
    for o in out:
        run.log(f"{o['file']}: {o['class']} (exit {o['exit']}/{sm.num_steps}, {o['flops'] / 1e6:.2f} MFLOPs)")
    return {"predictions": out}


def reproduce(cfg: ClassifyConfig, run) -> dict:
    """Train every network, Table 7, then the frontier."""
    from ...core.pipeline import frontier_command

    run = as_run(run)
    train(cfg, run)
    out = evaluate(cfg, run)
    out["frontier"] = frontier_command(APP, cfg, run)["summary"]
    return out


SPEC = register_task(TaskSpec(
    name="classify",
    description="Early-exit image recognition: VGG and ResNets with internal classifiers, SDN vs Stage I + policy (Sec. 5.4, Table 7)",
    config_class=ClassifyConfig,
    presets=PRESETS,
    commands={"train": train, "evaluate": evaluate, "reproduce": reproduce, "predict": predict},
    app=APP,
))
