"""The classify config: data, network, stages, the quick / cifar / paper presets."""
from __future__ import annotations

from typing import ClassVar

from dataclasses import dataclass, field

from ...core import InferenceConfig, MethodConfig, StageConfig
from ...core.objectives import stage_field
from ...utils.config import int_at_least, one_of, require
from .data import list_datasets
from .models import ARCHS

SOURCES = ("synthetic", *list_datasets())


@dataclass
class DataConfig:
    """The images. ``synthetic``: generated class-coded textures (no data needed; tests and demos)."""

    kind: str = "tiny_imagenet"
    """The data set: synthetic or one of the registered image sets (e.g. tiny_imagenet, cifar10)."""
    path: str = "data/tiny-imagenet-200"
    """Folder of the data set."""
    size: int = 64
    """Side in pixels of the network's input images."""
    val_fraction: float = 0.1
    """Share of the training images held out for selection and calibration."""
    augment: bool = True
    """Pad-4 random crop and flip of the training images."""
    cutout: int = 0
    """With augment: zero a square of this side at a random place in each training image (0: off)."""
    synthetic_per_class: int = 60
    """Synthetic: images per class."""
    synthetic_classes: int = 4
    """Synthetic: classes (>= 2)."""

    def __post_init__(self):
        one_of(self.kind, SOURCES, "data.kind")
        require(0 < self.val_fraction < 1, "data.val_fraction", f"must be in (0, 1); got {self.val_fraction}")
        int_at_least(self.size, "data.size", 8)
        require(0 <= self.cutout <= self.size, "data.cutout", f"must be in [0, data.size = {self.size}]; got {self.cutout}")
        int_at_least(self.synthetic_classes, "data.synthetic_classes", 2)  # one class: nothing to classify
        require(self.kind == "synthetic" or self.path != "", "data.path", f"needed for data.kind = {self.kind}")


@dataclass
class ModelConfig:
    """The network: an architecture of :func:`~learn2stop.tasks.classify.models.list_archs`, exits attached."""

    arch: str = "vgg16"
    """The architecture (vgg16, the ResNets, ...: list_archs())."""
    ic_positions: tuple[int, ...] = ()
    """exits after these candidates (1-based; VGG: conv layers, ResNet: residual blocks); () = the architecture's own
    (SDN's FLOP-based placement unless it fixes its own)."""
    fc_width: int = -1
    """VGG's hidden classifier width; -1 = the architecture's, 0 = one linear layer on pooled features."""
    dropout: float = 0.5
    """VGG: dropout probability before each fully connected layer after the first."""
    width: int = 0
    """a ResNet's first-stage channels (the other stages scale with it); 0 = the architecture's."""
    policy_hidden: int = 32
    """Width of the policy's MLP."""
    channels_last: bool = False
    """convolutions on NHWC tensors (measured on the 2-core CPU, vgg6-narrow: training 10 % and inference 1.5x faster
    than NCHW; the quick preset's); the weights and checkpoints are the same either way. Refused for a network with a
    strided 1x1 convolution of fewer than 8 input channels, whose NHWC backward corrupts the heap in PyTorch 2.13 on
    CPU (measured: a ResNet at width 4)."""

    def __post_init__(self):
        one_of(self.arch, ARCHS.names(), "model.arch")
        require(self.fc_width >= -1, "model.fc_width", f"must be >= 0 (or -1: the architecture's); got {self.fc_width}")
        require(self.width >= 0, "model.width", f"must be >= 0; got {self.width}")
        require(0 <= self.dropout < 1, "model.dropout", f"must be in [0, 1); got {self.dropout}")
        require(self.policy_hidden >= 1, "model.policy_hidden", f"must be >= 1; got {self.policy_hidden}")


@dataclass
class PredictConfig:
    input: str = ""
    """an image file or a folder of images."""
    output: str = ""
    """Output file (default <run-dir>/predictions.json)."""


def _stage(**kw):
    # Adam with a cosine schedule after a short warm-up; a light L2 (Adam's coupled weight decay at SDN's 5e-4
    # held the quick network at 48 %: with Adam it acts far more strongly than with SGD)
    base = dict(iterations=60_000, batch_size=128, lr=1e-3, weight_decay=5e-5, lr_schedule="cosine", warmup=50,
                eval_every=1000, checkpoint_every=1000)
    return stage_field(**{**base, **kw})


@dataclass
class ClassifyConfig:
    """VGG with internal classifiers: the network alone, SDN training, Stage I + II (paper Table 7)."""

    #: read-only sections, left out of the run's fingerprint: the test-time rule, the inputs of ``predict``, the evaluation batch and the table's budget
    reader_fields: ClassVar[tuple[str, ...]] = ('inference', 'predict', 'eval_batch', 'table_budget')
    #: where the data lies: a reading command on a trained run may find it elsewhere (a moved folder, another machine)
    location_fields: ClassVar[tuple[str, ...]] = ("data.path",)

    seed: int = 0
    """Seed of training: initialisation, data order and augmentation."""
    data: DataConfig = field(default_factory=DataConfig)
    """The images."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The network, its exits and the policy."""
    method: MethodConfig = field(default_factory=lambda: MethodConfig(beta=1.0))
    inference: InferenceConfig = field(default_factory=lambda: InferenceConfig(rule="threshold"))
    """The test-time stop rule: the policy's own pi_t thresholded (measured on both quick networks: above the quantile
    of q_phi at every FLOPs budget from 30 to 70 %, by up to 8 points)."""
    baseline: StageConfig = _stage(objective="deep_supervision", variant="last", select="last")
    """The network alone (its last output)."""
    sdn: StageConfig = _stage(objective="deep_supervision", variant="weighted", select="oracle")
    """SDN training: every exit, weighted (Kaya et al.)."""
    stage1: StageConfig = _stage(objective="stage1", variant="marginal", iterations=20_000, lr=1e-4)
    """Stage I: the network under the oracle; marginal keeps the oracle as fixed weights (through q*, expected pushes
    each image's worse exits up)."""
    stage2: StageConfig = _stage(objective="stage2", variant="forward_kl", iterations=3000, lr=3e-3, weight_decay=0.0,
                                 beta=0.1, price=0.3,
                                 lr_schedule="constant", eval_every=250, checkpoint_every=250)
    """Stage II: the policy fitted to the oracle on the 0/1 error (stop_loss): beta 0.1 makes it the first exits that
    are right; a price of 0.3 errors per network's FLOPs trades them against computation."""
    stage3: StageConfig = _stage(objective="stage3", iterations=0, lr=1e-4)
    """Optional Stage III (0 iterations: skipped)."""
    sdn_tau: tuple[float, ...] = (0.15, 0.3, 0.45, 0.6, 0.75, 0.9)
    """SDN's final IC weights (interpolated to the ICs)."""
    sdn_from: str = "scratch"
    """SDN training from scratch (Kaya et al.'s) or baseline: fine-tuned from the trained network alone (the usual way
    to add exits to a network one has, at a fraction of the cost)."""
    stop_loss: str = "error"
    """The loss whose oracle Stage II's policy fits: error (the 0/1 error a user deploys on) or cross_entropy (the
    paper's l, which trains the network). Measured on the quick VGG and ResNet-20: the error oracle's policy is 1-2
    points above the cross-entropy one at 30-60 % of the FLOPs."""
    eval_batch: int = 256
    """Images per forward pass in evaluation."""
    table_budget: float = 0.5
    """Table 7 compares the policy and the confidence rule at this share of the FLOPs."""
    predict: PredictConfig = field(default_factory=PredictConfig)
    """The inputs of the predict command."""

    def __post_init__(self):
        for name, obj in (("baseline", "deep_supervision"), ("sdn", "deep_supervision"), ("stage1", "stage1"),
                          ("stage2", "stage2"), ("stage3", "stage3")):
            require(getattr(self, name).objective == obj, f"{name}.objective", f"must be {obj!r}")
        require(len(self.sdn_tau) >= 1 and all(0 < t <= 1 for t in self.sdn_tau), "sdn_tau", "weights in (0, 1]")
        one_of(self.sdn_from, ("scratch", "baseline"), "sdn_from")
        one_of(self.stop_loss, ("error", "cross_entropy"), "stop_loss")
        require(self.eval_batch >= 1, "eval_batch", "must be >= 1")
        require(0 < self.table_budget <= 1, "table_budget", f"must be in (0, 1]; got {self.table_budget}")


def _quick(it: int, **kw) -> dict:
    """A short stage of the CPU presets: the same optimiser as :func:`_stage` (Adam, cosine, warm-up), lr 2e-3."""
    return {"iterations": it, "batch_size": 128, "lr": 2e-3, "eval_every": max(it // 5, 1),
            "checkpoint_every": max(it // 5, 1), **kw}


PRESETS: dict[str, dict] = {
    # The CIFAR-10 subset of ../shared/data (4,068 train / 1,017 test), a narrow 6-conv VGG with 5 exits whose
    # classifier is one linear layer like its exits (VGG's 3-layer head with dropout 0.5 was the weakest exit).
    # Batch 64 (measured: +2 points over batch 128 at the same number of images), 2,600 iterations (45 epochs;
    # at 1,700 SDN's fine-tuning left the final classifier below 72 %); SDN fine-tunes the trained network alone
    # (45 + 7 epochs instead of 2 x 45 from scratch). Stage I at batch 64 and lr 1e-4: half the time
    # of batch 128, and its oracle exit above SDN's on VGG and ResNet-20 (at lr 2e-4 it tied on ResNet-20).
    "quick": {"data": {"kind": "cifar_subset_npz", "path": "../shared/data/cifar10-subset", "size": 32},
              "model": {"arch": "vgg6-narrow", "fc_width": 0, "dropout": 0.2, "channels_last": True},
              "baseline": _quick(2600, batch_size=64), "sdn": _quick(400, batch_size=64, lr=1e-3, warmup=20),
              "sdn_from": "baseline", "stage1": _quick(100, batch_size=64, lr=1e-4, warmup=0),
              "stage2": _quick(200, lr=3e-3, weight_decay=0.0, lr_schedule="constant", warmup=0, beta=0.1, price=0.3),
              "method": {"beta": 1.0, "price": 1.0}},
    # VGG16-BN on the same subset (a few CPU-hours; benchmarks/classify_cifar.py).
    "cifar": {"data": {"kind": "cifar_subset_npz", "path": "../shared/data/cifar10-subset", "size": 32},
              "model": {"arch": "vgg16"}, "baseline": _quick(6000, lr=1e-3), "sdn": _quick(6000, lr=1e-3),
              "stage1": _quick(2000, lr=1e-4, variant="expected", warmup=0),
              "stage2": _quick(1500, lr=3e-3, weight_decay=0.0, lr_schedule="constant", warmup=0, beta=0.1, price=0.3),
              "method": {"beta": 3.0, "price": 1.0}},
    # The paper: VGG16-BN on Tiny-ImageNet at 64x64 (a GPU job; the dataclass defaults).
    "paper": {},
}
