"""DnCNN-stop as a CLI application: config, presets and the train/evaluate/reproduce/denoise commands.

    learn2stop denoise reproduce --preset quick              # ~10 min on 2 CPU cores, no data needed
    learn2stop denoise reproduce --preset paper --data.train_dir ../shared/data/denoising/Train400 \
        --data.test_dir ../shared/data/denoising/BSD68
    learn2stop denoise denoise --run-dir runs/denoise-quick --denoise.input noisy.png
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ...core import PolicyRule, StageConfig, StagedTrainer, StoppingModel, derive_seed, run_with_early_exit
from ...utils.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from ...utils.config import ConfigError, non_negative, one_of, positive, require, to_dict
from ...utils.report import markdown_table, new_figure, save_figure, write_json
from ..base import RunContext
from .bm3d_baseline import bm3d_available, bm3d_denoise
from .data import ImageDataError, add_noise, list_images, load_folder, load_image, save_image, synthetic_images
from .metrics import psnr
from .models import DeepSupervisedDnCNN, HeadsOnly
from .policy import DenoisePolicy
from .task import DenoiseTask

#: paper Table 6 (BSD68, PSNR dB) at sigma 35, 45, 55, 65, 75.
PAPER_TABLE6 = {
    "sigmas": (35, 45, 55, 65, 75),
    "DnCNN-stop": (27.61, 26.59, 25.79, 23.56, 18.62),
    "DnCNN": (27.60, 26.56, 25.71, 22.19, 17.90),
    "BM3D": (26.81, 25.97, 25.21, 24.60, 24.08),
}


# ----------------------------------------------------------------------------- config
@dataclass
class DataConfig:
    """Where the images come from. Empty ``train_dir``/``test_dir``: the embedded dead-leaves images."""

    train_dir: str = ""
    test_dir: str = ""
    val_fraction: float = 0.2  # of the training images, held out for model and policy selection
    synthetic_train: int = 60  # embedded default: images generated for training + validation
    synthetic_test: int = 8
    synthetic_size: int = 128
    max_train_images: int = 0  # 0 = all (before the validation split)
    max_test_images: int = 0  # 0 = all
    patch_size: int = 50
    stride: int = 10
    scales: tuple[float, ...] = (1.0, 0.9, 0.8, 0.7)
    sigma_max: float = 55.0  # training sigma ~ U[0, sigma_max] (paper) ...
    sigma_set: tuple[float, ...] = ()  # ... or from this set (release: 35, 45, 55)
    val_patches: int = 256

    def __post_init__(self):
        require(0 < self.val_fraction < 1, "data.val_fraction", f"must be in (0, 1); got {self.val_fraction}")
        for name in ("synthetic_train", "synthetic_test", "synthetic_size", "patch_size", "stride", "val_patches"):
            require(isinstance(getattr(self, name), int) and getattr(self, name) >= 1, f"data.{name}",
                    f"must be an integer >= 1; got {getattr(self, name)!r}")
        require(self.synthetic_train >= 2, "data.synthetic_train", "needs >= 2 images (train and validation)")
        for name in ("max_train_images", "max_test_images"):
            require(isinstance(getattr(self, name), int) and getattr(self, name) >= 0, f"data.{name}",
                    f"must be an integer >= 0; got {getattr(self, name)!r}")
        require(len(self.scales) > 0 and all(0 < s <= 4 for s in self.scales), "data.scales",
                f"must be resize factors in (0, 4]; got {self.scales}")
        non_negative(self.sigma_max, "data.sigma_max")
        require(all(s >= 0 for s in self.sigma_set), "data.sigma_set", f"noise levels must be >= 0; got {self.sigma_set}")
        require(self.synthetic_size >= self.patch_size or bool(self.train_dir), "data.synthetic_size",
                f"must be >= data.patch_size ({self.patch_size}); got {self.synthetic_size}")


@dataclass
class ModelConfig:
    depth: int = 20
    channels: int = 64
    outputs: tuple[int, ...] = ()  # blocks followed by a head; () = every block 1..depth-2 (paper: 18 heads)
    policy_channels: int = 64

    def __post_init__(self):
        require(isinstance(self.depth, int) and self.depth >= 3, "model.depth", f"must be an integer >= 3; got {self.depth!r}")
        positive(self.channels, "model.channels")
        positive(self.policy_channels, "model.policy_channels")
        require(all(1 <= p <= self.depth - 2 for p in self.outputs) and list(self.outputs) == sorted(set(self.outputs)),
                "model.outputs", f"must be increasing block indices in 1..{self.depth - 2}; got {self.outputs}")

    @property
    def positions(self) -> tuple[int, ...]:
        return self.outputs or tuple(range(1, self.depth - 1))


@dataclass
class EvalConfig:
    sigmas: tuple[float, ...] = (35.0, 45.0, 55.0, 65.0, 75.0)
    threshold: float = 0.5  # stop when pi_t > threshold
    bm3d: bool = True  # needs the optional 'bm3d' package; skipped (and said so) when absent
    bm3d_max_images: int = 0  # 0 = every test image
    diagnostics: bool = True  # also the stop model's last and best (oracle) output
    figure_sigmas: tuple[float, ...] = (55.0, 75.0)
    crop: int = 96
    seed: int = 2020

    def __post_init__(self):
        require(len(self.sigmas) > 0 and all(s >= 0 for s in self.sigmas), "eval.sigmas",
                f"noise levels must be >= 0; got {self.sigmas}")
        require(all(s >= 0 for s in self.figure_sigmas), "eval.figure_sigmas", f"must be >= 0; got {self.figure_sigmas}")
        require(0 < self.threshold < 1, "eval.threshold", f"must be in (0, 1); got {self.threshold}")
        require(self.bm3d_max_images >= 0, "eval.bm3d_max_images", f"must be >= 0; got {self.bm3d_max_images}")
        positive(self.crop, "eval.crop")


@dataclass
class DenoiseCommandConfig:
    """The ``denoise`` command: an image file or folder in, denoised PNGs and depths out."""

    input: str = ""
    output: str = ""  # default <run-dir>/denoised
    model: str = "stop"  # stop (DnCNN-stop, early exit) or dncnn
    add_sigma: float = 0.0  # > 0: add seeded Gaussian noise first (a demo on clean images)

    def __post_init__(self):
        one_of(self.model, ("stop", "dncnn"), "denoise.model")
        non_negative(self.add_sigma, "denoise.add_sigma")


@dataclass
class DenoiseAppConfig:
    """DnCNN-stop (paper Sec. 5.3, App. B.3). Defaults: the paper's settings (see ``paper`` preset)."""

    seed: int = 0
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    # DnCNN pre-training: 50 epochs of ~403k patches at batch 256 = 78.7k iterations, lr 1e-3, /10 at half
    dncnn: StageConfig = field(default_factory=lambda: StageConfig(
        objective="deep_supervision", iterations=78700, batch_size=256, lr=1e-3, lr_schedule="step",
        lr_decay_at=(0.5,), eval_every=1000, checkpoint_every=1000))
    # fresh heads on the frozen pre-trained backbone (ours: without it the oracle never picks a random head)
    heads: StageConfig = field(default_factory=lambda: StageConfig(
        objective="deep_supervision", iterations=5000, batch_size=256, lr=1e-3, select="none",
        eval_every=1000, checkpoint_every=1000))
    # Stage I fine-tuning: 50 epochs, lr 1e-4, oracle weights softmin(SSE / 0.1)
    stage1: StageConfig = field(default_factory=lambda: StageConfig(
        objective="stage1", variant="marginal", beta=0.1, iterations=78700, batch_size=256, lr=1e-4,
        eval_every=1000, checkpoint_every=1000))
    # Stage II policy: MAP target (release), Adam lr 1e-3
    stage2: StageConfig = field(default_factory=lambda: StageConfig(
        objective="stage2", variant="map", beta=0.1, iterations=20000, batch_size=256, lr=1e-3,
        eval_every=1000, checkpoint_every=1000))
    # optional Stage III (0 iterations = skipped)
    stage3: StageConfig = field(default_factory=lambda: StageConfig(
        objective="stage3", beta=0.1, iterations=0, batch_size=64, lr=1e-5, eval_every=500, checkpoint_every=500))
    eval: EvalConfig = field(default_factory=EvalConfig)
    denoise: DenoiseCommandConfig = field(default_factory=DenoiseCommandConfig)

    def __post_init__(self):
        require(self.dncnn.objective == "deep_supervision", "dncnn.objective", "must be deep_supervision (the baseline)")
        require(self.heads.objective == "deep_supervision", "heads.objective", "must be deep_supervision")
        require(self.stage1.objective in ("stage1", "deep_supervision"), "stage1.objective",
                f"must be stage1 (or deep_supervision for an ablation); got {self.stage1.objective!r}")
        require(self.stage2.objective == "stage2", "stage2.objective", f"must be stage2; got {self.stage2.objective!r}")
        require(self.stage3.objective in ("stage3", "aevb"), "stage3.objective", f"must be stage3 or aevb; got {self.stage3.objective!r}")


def _quick_stage(**kw) -> dict:
    return {"eval_every": 100, "checkpoint_every": 100, "batch_size": 32, **kw}


PRESETS: dict[str, dict] = {
    # ~10 minutes on 2 CPU cores: embedded dead-leaves images, a 10-layer 32-channel DnCNN (8 outputs)
    "quick": {
        "data": {"patch_size": 40, "val_patches": 96, "synthetic_train": 60, "synthetic_test": 8, "synthetic_size": 128},
        "model": {"depth": 10, "channels": 32, "policy_channels": 16},
        "dncnn": _quick_stage(iterations=1000, lr=2e-3, lr_schedule="step", lr_decay_at=[0.6]),
        "heads": _quick_stage(iterations=200, lr=2e-3, select="none"),
        "stage1": _quick_stage(iterations=300, lr=2e-4),
        "stage2": _quick_stage(iterations=300, lr=2e-3),
        "eval": {"crop": 64},
    },
    # the paper's settings (the dataclass defaults) on Train400 / BSD68
    "paper": {
        "data": {"train_dir": "../shared/data/denoising/Train400", "test_dir": "../shared/data/denoising/BSD68"},
    },
}


# ----------------------------------------------------------------------------- building blocks
def load_training_images(cfg: DenoiseAppConfig) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(train images, validation images): a seeded, disjoint split of the training folder (or dead leaves)."""
    d = cfg.data
    if d.train_dir:
        images, _ = load_folder(d.train_dir, min_size=d.patch_size)
        images = images[:d.max_train_images] if d.max_train_images else images
    else:
        images = synthetic_images(d.synthetic_train, d.synthetic_size, seed=derive_seed(cfg.seed, "dead-leaves-train") % 2**32)
    if len(images) < 2:
        raise ImageDataError(f"need >= 2 training images (training and validation split); found {len(images)}")
    perm = np.random.default_rng(cfg.seed).permutation(len(images))
    n_val = min(max(1, int(round(d.val_fraction * len(images)))), len(images) - 1)
    return [images[i] for i in perm[n_val:]], [images[i] for i in perm[:n_val]]


def load_test_images(cfg: DenoiseAppConfig) -> tuple[list[np.ndarray], list[str]]:
    """(test images, file names): the test folder, or dead-leaves images from another seed."""
    d = cfg.data
    if d.test_dir:
        images, names = load_folder(d.test_dir)
    else:
        images = synthetic_images(d.synthetic_test, d.synthetic_size, seed=derive_seed(cfg.seed, "dead-leaves-test") % 2**32)
        names = [f"dead_leaves_{i:03d}.png" for i in range(len(images))]
    if d.max_test_images:
        images, names = images[:d.max_test_images], names[:d.max_test_images]
    return images, names


def build_models(cfg: DenoiseAppConfig, device=None) -> tuple[DeepSupervisedDnCNN, StoppingModel]:
    """Plain DnCNN (T = 1) and the deep-supervised DnCNN with its policy, on ``device``."""
    m = cfg.model
    torch.manual_seed(derive_seed(cfg.seed, "init") % 2**63)
    dncnn = DeepSupervisedDnCNN(m.depth, m.channels, output_positions=())
    net = DeepSupervisedDnCNN(m.depth, m.channels, output_positions=m.positions)
    policy = DenoisePolicy(net.num_steps, m.policy_channels)
    return dncnn.to(device), StoppingModel(net, policy).to(device)


def train(cfg: DenoiseAppConfig, run: RunContext) -> dict:
    """DnCNN baseline, then heads warm-up, Stage I and Stage II (and optional Stage III) for DnCNN-stop."""
    train_imgs, val_imgs = load_training_images(cfg)
    d = cfg.data
    task = DenoiseTask(train_imgs, val_imgs, patch_size=d.patch_size, stride=d.stride, scales=d.scales,
                       sigma_max=d.sigma_max, sigma_set=d.sigma_set, val_patches=d.val_patches, seed=cfg.seed)
    run.log(f"denoise: {len(train_imgs)} training / {len(val_imgs)} validation images, "
            f"{len(task.bank)} distinct {d.patch_size}x{d.patch_size} patches (x8 symmetries)")
    dncnn, sm = build_models(cfg, run.device)
    kw = dict(seed=cfg.seed, ctx=run.ctx, progress=run.progress, resume=run.resume)
    summaries = [StagedTrainer(StoppingModel(dncnn), task, run.run_dir, **kw).fit("dncnn", cfg.dncnn)]
    sm.model.load_state_dict(dncnn.backbone_state_dict(), strict=False)  # heads stay fresh
    if cfg.heads.iterations > 0:
        summaries.append(StagedTrainer(StoppingModel(HeadsOnly(sm.model)), task, run.run_dir, **kw).fit("heads", cfg.heads))
    trainer = StagedTrainer(sm, task, run.run_dir, **kw)
    summaries.append(trainer.fit("stage1", cfg.stage1))
    summaries.append(trainer.fit("stage2", cfg.stage2))
    if cfg.stage3.iterations > 0:
        summaries.append(trainer.fit("stage3", cfg.stage3))
    if run.ctx.is_main:
        save_checkpoint({"config": to_dict(cfg.model), "dncnn": dncnn.state_dict(), "stop": sm.state_dict()},
                        run.run_dir / "models.pt")
        write_json(summaries, run.run_dir / "train_summary.json")
    for s in summaries:
        run.log(f"  {s['stage']}: {s['iterations']} iterations, best validation {s['select']} = "
                f"{s['best_score']:.4g}, {s['seconds']:.0f} s")
    return {"stages": summaries}


def load_models(cfg: DenoiseAppConfig, run_dir: Path, device=None) -> tuple[DeepSupervisedDnCNN, StoppingModel]:
    path = Path(run_dir) / "models.pt"
    if not path.is_file():
        raise CheckpointError(f"no trained models in {run_dir} (expected {path}); run the 'train' command first")
    ck = load_checkpoint(path, map_location=device or "cpu")
    saved = ck.get("config", {})
    current = to_dict(cfg.model)
    if saved != current:
        raise ConfigError(f"model: {path} was trained with model config {saved}, but the config asks for {current}; "
                          f"pass the same --preset/--model.* as for training")
    dncnn, sm = build_models(cfg, device)
    try:
        dncnn.load_state_dict(ck["dncnn"])
        sm.load_state_dict(ck["stop"])
    except (KeyError, RuntimeError) as e:
        raise CheckpointError(f"{path} does not fit this model: {e}") from None
    return dncnn.eval(), sm.eval()


@torch.no_grad()
def denoise_with_stop(sm: StoppingModel, noisy: torch.Tensor, threshold: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """Early-exit denoising: (denoised (B, 1, H, W), stop output index t (B,)); stopped images skip later layers."""
    r = run_with_early_exit(sm.model, noisy, PolicyRule(sm.policy, threshold=threshold))
    return r.outputs, r.stop_times


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


# ----------------------------------------------------------------------------- evaluation
def evaluate(cfg: DenoiseAppConfig, run: RunContext) -> dict:
    """PSNR per image and sigma for DnCNN, DnCNN-stop and BM3D; Table 6, per-image JSON and a figure."""
    dncnn, sm = load_models(cfg, run.run_dir, run.device)
    test_imgs, names = load_test_images(cfg)
    net: DeepSupervisedDnCNN = sm.model
    use_bm3d = cfg.eval.bm3d and bm3d_available()
    if cfg.eval.bm3d and not use_bm3d:
        run.log("denoise: the optional 'bm3d' package is not installed (pip install bm3d): BM3D column skipped")
    n_bm3d = len(test_imgs) if cfg.eval.bm3d_max_images == 0 else min(cfg.eval.bm3d_max_images, len(test_imgs))
    per_image, summary, examples = [], [], {}
    for sigma in cfg.eval.sigmas:
        rows = []
        for i, (img, name) in enumerate(zip(test_imgs, names)):
            clean = torch.from_numpy(img)[None, None].to(run.device)
            g = torch.Generator().manual_seed(derive_seed(cfg.eval.seed, "test-noise", float(sigma), i))
            noisy = add_noise(clean.cpu(), float(sigma), g).to(run.device)  # a different noise for every image
            with torch.no_grad():
                out_d, sec_d = _timed(lambda: dncnn(noisy))
                (out_s, t_s), sec_s = _timed(lambda: denoise_with_stop(sm, noisy, cfg.eval.threshold))
            t = int(t_s[0])
            row = {"image": name, "sigma": float(sigma), "psnr_noisy": float(psnr(noisy, clean)),
                   "psnr_dncnn": float(psnr(out_d, clean)), "psnr_stop": float(psnr(out_s, clean)),
                   "stop_output": t, "stop_layers": net.layers_at(t), "sec_dncnn": sec_d, "sec_stop": sec_s}
            if cfg.eval.diagnostics:
                with torch.no_grad():
                    r = sm.unroll(noisy, use_policy=False, keep_outputs=True)
                scores = [float(psnr(o, clean)) for o in r.step_outputs]
                row.update(psnr_stop_last=scores[-1], psnr_stop_oracle=max(scores),
                           oracle_output=int(np.argmax(scores)) + 1)
            out_b = None
            if use_bm3d and i < n_bm3d:
                out_b, sec_b = _timed(lambda: bm3d_denoise(noisy[0, 0].cpu().numpy(), float(sigma)))
                row.update(psnr_bm3d=float(psnr(torch.from_numpy(out_b)[None, None], clean.cpu())), sec_bm3d=sec_b)
            rows.append(row)
            if i == 0 and sigma in cfg.eval.figure_sigmas:
                examples[float(sigma)] = {"clean": img, "noisy": noisy[0, 0].cpu().numpy(), "bm3d": out_b,
                                          "dncnn": out_d[0, 0].cpu().numpy(), "stop": out_s[0, 0].cpu().numpy(),
                                          "depth": f"{net.layers_at(t)}/{net.depth} layers"}
        per_image.extend(rows)
        mean = lambda k: float(np.mean([r[k] for r in rows if k in r])) if any(k in r for r in rows) else None
        summary.append({"sigma": float(sigma), "DnCNN-stop": mean("psnr_stop"), "DnCNN": mean("psnr_dncnn"),
                        "BM3D": mean("psnr_bm3d"), "depth_layers": mean("stop_layers"), "depth_output": mean("stop_output"),
                        "stop_last": mean("psnr_stop_last"), "stop_oracle": mean("psnr_stop_oracle"),
                        "noisy": mean("psnr_noisy"), "sec_dncnn": mean("sec_dncnn"), "sec_stop": mean("sec_stop"),
                        "sec_bm3d": mean("sec_bm3d")})
        s = summary[-1]
        run.log(f"  sigma {sigma:g}: DnCNN-stop {s['DnCNN-stop']:.2f} dB (depth {s['depth_layers']:.1f} of "
                f"{net.depth} layers), DnCNN {s['DnCNN']:.2f} dB"
                + (f", BM3D {s['BM3D']:.2f} dB" if s["BM3D"] is not None else ""))
    bm3d_note = ("BM3D: noise level given" + ("" if n_bm3d == len(test_imgs) else f", first {n_bm3d} images only")
                 if use_bm3d else "BM3D: not run (package 'bm3d' not installed)" if cfg.eval.bm3d else "BM3D: off")
    table = table6(summary, net.depth, bm3d_note, paper=bool(cfg.data.test_dir))
    if run.ctx.is_main:
        write_json({"summary": summary, "per_image": per_image, "bm3d": bm3d_note}, run.run_dir / "results.json")
        (run.run_dir / "table6.md").write_text(table + "\n")
        if examples:
            comparison_figure(examples, cfg.eval.crop, run.run_dir / "denoise_crops.png")
    run.log(table)
    return {"summary": summary}


def table6(summary: list[dict], depth: int, bm3d_note: str, paper: bool = True) -> str:
    """Paper-Table-6-style markdown: PSNR per sigma for each method, depth used, the paper's numbers beside."""
    headers = ["sigma", "DnCNN-stop", "DnCNN", "BM3D", "stop depth (layers)", "stop: last / oracle",
               "ms/img stop", "ms/img DnCNN", "ms/img BM3D"]
    if paper:
        headers += ["paper DnCNN-stop", "paper DnCNN", "paper BM3D"]
    rows = []
    for s in summary:
        diag = "-" if s["stop_last"] is None else f"{s['stop_last']:.2f} / {s['stop_oracle']:.2f}"
        row = [f"{s['sigma']:g}", s["DnCNN-stop"], s["DnCNN"], s["BM3D"], f"{s['depth_layers']:.1f} / {depth}", diag,
               1000 * s["sec_stop"], 1000 * s["sec_dncnn"], None if s["sec_bm3d"] is None else 1000 * s["sec_bm3d"]]
        if paper:
            k = PAPER_TABLE6["sigmas"].index(int(s["sigma"])) if int(s["sigma"]) in PAPER_TABLE6["sigmas"] else None
            row += [None if k is None else PAPER_TABLE6[m][k] for m in ("DnCNN-stop", "DnCNN", "BM3D")]
        rows.append(row)
    return (f"PSNR (dB, data range 1, clamped), mean over test images; {bm3d_note}\n\n"
            + markdown_table(headers, rows, digits=2))


def comparison_figure(examples: dict, crop: int, path: Path) -> Path:
    """Crops of ground truth, noisy, BM3D, DnCNN and DnCNN-stop, one row per sigma."""
    cols = [("clean", "ground truth"), ("noisy", "noisy"), ("bm3d", "BM3D"), ("dncnn", "DnCNN"), ("stop", "DnCNN-stop")]
    fig, axes = new_figure(len(examples), len(cols), figsize=(2.4 * len(cols), 2.5 * len(examples)), squeeze=False)
    for r, (sigma, ex) in enumerate(sorted(examples.items())):
        h, w = ex["clean"].shape
        c = min(crop, h, w)
        y0, x0 = (h - c) // 2, (w - c) // 2
        for k, (key, title) in enumerate(cols):
            ax = axes[r][k]
            ax.axis("off")
            img = ex[key]
            if img is None:
                ax.set_title(f"{title}\n(not run)", fontsize=8)
                continue
            crop_img = np.clip(img[y0:y0 + c, x0:x0 + c], 0, 1)
            ax.imshow(crop_img, cmap="gray", vmin=0, vmax=1)
            label = f"{title} sigma={sigma:g}" if key == "noisy" else title
            if key != "clean":
                p = 10 * np.log10(1.0 / max(float(np.mean((np.clip(img, 0, 1) - ex["clean"]) ** 2)), 1e-12))
                label += f"\n{p:.2f} dB" + (f", {ex['depth']}" if key == "stop" else "")
            ax.set_title(label, fontsize=8)
    return save_figure(fig, path)


def reproduce(cfg: DenoiseAppConfig, run: RunContext) -> dict:
    """Train everything, then evaluate (Table 6 and the figure)."""
    out = train(cfg, run)
    out.update(evaluate(cfg, run))
    return out


# ----------------------------------------------------------------------------- denoise files
def denoise_files(cfg: DenoiseAppConfig, run: RunContext) -> dict:
    """Denoise an image file or every image of a folder; write PNGs and the depth used per image."""
    c = cfg.denoise
    if not c.input:
        raise ConfigError("denoise.input: give an image file or folder (--denoise.input PATH)")
    src = Path(c.input)
    if not src.exists():
        raise ImageDataError(f"input not found: {src}")
    files = list_images(src) if src.is_dir() else [src]
    out_dir = Path(c.output) if c.output else run.run_dir / "denoised"
    dncnn, sm = load_models(cfg, run.run_dir, run.device)
    net = sm.model
    records = []
    for k, path in enumerate(files):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            img = load_image(path)
        for w in caught:
            run.log(f"  note: {w.message}")
        x = torch.from_numpy(img)[None, None]
        if c.add_sigma > 0:
            x = add_noise(x, c.add_sigma, torch.Generator().manual_seed(derive_seed(cfg.seed, "denoise", k)))
            save_image(x[0, 0], out_dir / f"{path.stem}_noisy.png")
        x = x.to(run.device)
        t0 = time.perf_counter()
        if c.model == "stop":
            out, t = denoise_with_stop(sm, x, cfg.eval.threshold)
            t = int(t[0])
            layers = net.layers_at(t)
        else:
            with torch.no_grad():
                out = dncnn(x)
            t, layers = 1, dncnn.depth
        sec = time.perf_counter() - t0
        dst = out_dir / f"{path.stem}_denoised.png"
        save_image(out[0, 0].clamp(0, 1), dst)
        rec = {"input": str(path), "output": str(dst), "model": c.model, "stop_output": t, "layers": layers,
               "of_layers": net.depth, "seconds": round(sec, 4)}
        records.append(rec)
        run.log(f"  {path.name} -> {dst}  ({layers} of {net.depth} layers, {sec * 1000:.0f} ms)")
    if run.ctx.is_main:
        write_json(records, out_dir / "depths.json")
    return {"images": records}


COMMANDS = {"train": train, "evaluate": evaluate, "reproduce": reproduce, "denoise": denoise_files}
