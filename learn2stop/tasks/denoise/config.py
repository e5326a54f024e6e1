"""The denoising config: the images, the network and its policy, the stages, evaluation and the ``denoise`` command,
and the presets.

Blind Gaussian denoising: the noise level is drawn per training patch and never given to the model.
Defaults are the paper's settings (Sec. 5.3, App. B.3); presets are partial configs over them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ...core import InferenceConfig, MethodConfig, StageConfig
from ...core.objectives import stage_field
from ...utils.config import int_at_least, ints_at_least, non_negative, one_of, positive, require
from ...utils.config_files import preset_config


@dataclass
class DataConfig:
    """Where the images come from. Empty ``train_dir``/``test_dir``: the embedded dead-leaves images."""

    train_dir: str = ""
    """Folder of training images (BSD400 in the paper); empty: the embedded dead-leaves images."""
    test_dir: str = ""
    """Folder of test images (BSD68 in the paper); empty: the embedded dead-leaves images."""
    val_fraction: float = 0.2
    """of the training images, held out for selection and calibration."""
    synthetic_train: int = 60
    """embedded default: images generated for training + validation."""
    synthetic_test: int = 8
    """Embedded default: test images generated."""
    synthetic_size: int = 128
    """Embedded default: side of each image in pixels."""
    max_train_images: int = 0
    """At most this many training images, before the validation split (0: all)."""
    max_test_images: int = 0
    """At most this many test images (0: all)."""
    patch_size: int = 50
    """Side of the training patches in pixels."""
    stride: int = 10
    """Step between training patches in pixels."""
    scales: tuple[float, ...] = (1.0, 0.9, 0.8, 0.7)
    """Resize factors, in (0, 4], at which patches are cut from every training image."""
    sigma_max: float = 55.0
    """Training noise sigma ~ U[0, sigma_max] (paper), unless sigma_set is given."""
    sigma_set: tuple[float, ...] = ()
    """Training noise sigma drawn from this set instead (release: 35, 45, 55); empty: sigma_max."""
    val_patches: int = 256
    """Validation patches (selection and calibration)."""

    def __post_init__(self):
        require(0 < self.val_fraction < 1, "data.val_fraction", f"must be in (0, 1); got {self.val_fraction}")
        ints_at_least(self, "synthetic_train", "synthetic_test", "synthetic_size", "patch_size", "stride", "val_patches",
                      prefix="data.")
        require(self.synthetic_train >= 2, "data.synthetic_train", "needs >= 2 images (train and validation)")
        ints_at_least(self, "max_train_images", "max_test_images", least=0, prefix="data.")
        require(len(self.scales) > 0 and all(0 < s <= 4 for s in self.scales), "data.scales",
                f"must be resize factors in (0, 4]; got {self.scales}")
        non_negative(self.sigma_max, "data.sigma_max")
        require(all(s >= 0 for s in self.sigma_set), "data.sigma_set", f"noise levels must be >= 0; got {self.sigma_set}")
        require(self.synthetic_size >= self.patch_size or bool(self.train_dir), "data.synthetic_size",
                f"must be >= data.patch_size ({self.patch_size}); got {self.synthetic_size}")


@dataclass
class ModelConfig:
    """The network and its policy."""

    depth: int = 20
    """DnCNN's conv layers (paper: 20)."""
    channels: int = 64
    """Feature channels of each layer."""
    outputs: tuple[int, ...] = ()
    """blocks followed by an exit; () = every block 1..depth-2 (paper: 18 exits + the final layer)."""
    head_kernel: int = 1
    """an exit is one conv C->1 of this size (1, or 3 like DnCNN's last layer: on CPUs a 3x3 conv to one channel takes
    about 20 % of a block's time)."""
    policy_hidden: int = 16
    """width of the policy's MLP."""
    policy_min_mass: float = 0.0
    """the policy is first asked at the first exit whose mean validation oracle mass (with the method's price) exceeds
    this; 0 asks it at every exit."""

    def __post_init__(self):
        int_at_least(self.depth, "model.depth", 3)
        ints_at_least(self, "channels", "policy_hidden", prefix="model.")
        one_of(self.head_kernel, (1, 3), "model.head_kernel")
        require(0 <= self.policy_min_mass < 1, "model.policy_min_mass", f"must be in [0, 1); got {self.policy_min_mass}")
        require(all(1 <= p <= self.depth - 2 for p in self.outputs) and list(self.outputs) == sorted(set(self.outputs)),
                "model.outputs", f"must be increasing block indices in 1..{self.depth - 2}; got {self.outputs}")

    @property
    def positions(self) -> tuple[int, ...]:
        return self.outputs or tuple(range(1, self.depth - 1))


@dataclass
class EvalConfig:
    """Test (and calibration) images: every image at every sigma, one seeded noise per image and sigma."""

    sigmas: tuple[float, ...] = (35.0, 45.0, 55.0, 65.0, 75.0)
    """Noise levels (on the 0-255 scale) at which every test image is denoised."""
    bm3d: bool = True
    """needs the optional 'bm3d' package; skipped (and said so) when absent."""
    bm3d_max_images: int = 0
    """BM3D on at most this many test images (0: every one)."""
    figure_sigmas: tuple[float, ...] = (55.0, 75.0)
    """Noise levels of the comparison figure."""
    crop: int = 96
    """Side in pixels of the figure's crops."""
    seed: int = 2020
    """Seed of the test noise."""
    timing_rounds: int = 3
    """Timing in ms per image: the fastest of this many interleaved rounds."""


    def __post_init__(self):
        require(len(self.sigmas) > 0 and all(s >= 0 for s in self.sigmas), "eval.sigmas",
                f"noise levels must be >= 0; got {self.sigmas}")
        require(all(s >= 0 for s in self.figure_sigmas), "eval.figure_sigmas", f"must be >= 0; got {self.figure_sigmas}")
        int_at_least(self.bm3d_max_images, "eval.bm3d_max_images", 0)
        positive(self.crop, "eval.crop")
        int_at_least(self.timing_rounds, "eval.timing_rounds", 1)


@dataclass
class DenoiseCommandConfig:
    """The ``denoise`` command: an image file or folder in, denoised PNGs and depths out."""

    input: str = ""
    """An image file or a folder of images to denoise."""
    output: str = ""
    """Output folder (default <run-dir>/denoised)."""
    model: str = "stop"
    """stop (what the run deploys: DnCNN-stop with its deployed rule, or its baseline) or dncnn."""
    add_sigma: float = 0.0
    """> 0: add seeded Gaussian noise of this sigma first (a demo on clean images)."""

    def __post_init__(self):
        one_of(self.model, ("stop", "dncnn"), "denoise.model")
        non_negative(self.add_sigma, "denoise.add_sigma")



@dataclass
class DenoiseAppConfig:
    """DnCNN-stop (paper Sec. 5.3, App. B.3). Defaults: the paper's settings (see the ``paper`` preset)."""

    #: read-only sections, left out of the run's fingerprint: the test-time rule, the evaluation settings and the inputs of ``denoise``
    reader_fields: ClassVar[tuple[str, ...]] = ('inference', 'eval', 'denoise')
    #: where the data lies: a reading command on a trained run may find it elsewhere (a moved folder, another machine)
    location_fields: ClassVar[tuple[str, ...]] = ("data.train_dir", "data.test_dir")

    seed: int = 0
    """Seed of training: initialisation, patch order and training noise."""
    data: DataConfig = field(default_factory=DataConfig)
    """The training and test images."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """DnCNN with exits, and its policy."""
    method: MethodConfig = field(default_factory=lambda: MethodConfig(beta=0.1))
    """beta (0.1 on the per-patch SSE, paper), depth prior and price on computation (lambda, in SSE units per full
    network), inherited by every stage."""
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    """the test-time stop rule (replaced by ``calibration.json`` once a run is calibrated)."""
    baseline: StageConfig = stage_field(objective="deep_supervision", iterations=78700, batch_size=256, lr=1e-3,
                                   lr_schedule="step", lr_decay_at=(0.5,), eval_every=1000, checkpoint_every=1000)
    """DnCNN pre-training (paper: 50 epochs of about 403k patches at batch 256, lr 1e-3, /10 at half)."""
    heads: StageConfig = stage_field(objective="deep_supervision", iterations=5000, batch_size=256, lr=1e-3, select="none",
                                eval_every=1000, checkpoint_every=1000)
    """Fresh exits trained on the frozen pre-trained backbone (the oracle never picks an untrained exit)."""
    stage1: StageConfig = stage_field(objective="stage1", variant="marginal", iterations=78700, batch_size=256, lr=1e-4,
                                 select="none", eval_every=1000, checkpoint_every=1000)
    """Stage I fine-tuning under the oracle q*(t) ~ exp(-(SSE_t + price c_t) / beta)."""
    stage2: StageConfig = stage_field(objective="stage2", variant="forward_kl", iterations=20000, batch_size=256, lr=1e-3,
                                 select="none", eval_every=1000, checkpoint_every=1000)
    """Stage II: the policy (validation ignores the price, so the last weights are kept)."""
    stage3: StageConfig = stage_field(objective="stage3", iterations=0, batch_size=64, lr=1e-5, select="none",
                                 eval_every=500, checkpoint_every=500)
    """Optional Stage III (0 iterations: skipped)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Test noise levels, BM3D and the figure."""
    denoise: DenoiseCommandConfig = field(default_factory=DenoiseCommandConfig)
    """The inputs of the denoise command."""

    def __post_init__(self):
        for name in ("baseline", "heads", "stage1", "stage2", "stage3"):
            allowed = {"baseline": ("deep_supervision",), "heads": ("deep_supervision",),
                       "stage1": ("stage1", "deep_supervision"), "stage2": ("stage2",), "stage3": ("stage3", "aevb")}[name]
            got = getattr(self, name).objective
            require(got in allowed, f"{name}.objective", f"must be {' or '.join(allowed)} for this stage; got {got!r}")


def _cpu_schedule(every: int, baseline: int, heads: int, stage1: int, stage2: int) -> dict:
    """The CPU presets' stages at batch 32: DnCNN at lr 2e-3 (/10 at 60 %), the exits at 5e-3, Stage I at 5e-4 and
    Stage II at 3e-3 (both cosine to 5 %), validated and checkpointed every ``every`` iterations."""
    kw = {"eval_every": every, "checkpoint_every": every, "batch_size": 32}
    cosine = {"lr_schedule": "cosine", "lr_min_factor": 0.05}
    return {"baseline": {**kw, "iterations": baseline, "lr": 2e-3, "lr_schedule": "step", "lr_decay_at": [0.6]},
            "heads": {**kw, "iterations": heads, "lr": 5e-3},
            "stage1": {**kw, "iterations": stage1, "lr": 5e-4, **cosine},
            "stage2": {**kw, "iterations": stage2, "lr": 3e-3, **cosine}}


PRESETS: dict[str, dict] = {
    # ~11 min on one CPU core: embedded dead-leaves images, a 10-layer 32-channel DnCNN (8 exits). Stage I
    # with a price on MACs and a soft oracle (beta 1 on the patch SSE; at 0.1 Stage I trains one exit and
    # the others fall 5-16 dB behind); the policy is not asked at exits 1-2 (no oracle mass there)
    "quick": {
        "data": {"patch_size": 40, "val_patches": 96, "synthetic_train": 60, "synthetic_test": 8, "synthetic_size": 128},
        "model": {"depth": 10, "channels": 32, "policy_min_mass": 0.05},
        "method": {"beta": 1.0, "price": 0.5},
        **_cpu_schedule(100, 1000, 100, 800, 400),
        "eval": {"crop": 64},
    },
    # Table 6 on a CPU: Train400 to all 68 BSD68 images, the paper's protocol on a 17-layer, 32-channel DnCNN
    # (15 exits, about a fifth of the paper's MACs) and 80k patches for DnCNN against the paper's 20M (40x40; sigma
    # ~ U[0, 55] as in the paper); Stage I with the quick preset's price and soft oracle
    "paper-cpu": {
        "data": {"train_dir": "../shared/data/denoising/Train400", "test_dir": "../shared/data/denoising/BSD68",
                 "patch_size": 40},
        "model": {"depth": 17, "channels": 32, "policy_min_mass": 0.05},
        "method": {"beta": 1.0, "price": 0.5},
        **_cpu_schedule(250, 2500, 200, 1200, 600),
        "eval": {"bm3d_max_images": 4},
    },
    # the paper's settings (the dataclass defaults) on Train400 / BSD68
    "paper": {
        "data": {"train_dir": "../shared/data/denoising/Train400", "test_dir": "../shared/data/denoising/BSD68"},
    },
}


def preset(name: str = "quick", **overrides: Any) -> DenoiseAppConfig:
    """The config of a named preset, with optional nested overrides (dicts)."""
    return preset_config(DenoiseAppConfig, PRESETS, name, "denoise", **overrides)
