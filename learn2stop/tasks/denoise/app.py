"""DnCNN-stop on the core pipeline: the :class:`StoppingApp` and the train / evaluate / reproduce / denoise commands.

    learn2stop denoise reproduce --preset quick --threads 1      # ~12 min on one CPU core, no data needed
    learn2stop denoise frontier  --run-dir runs/denoise-quick --threads 1
    learn2stop denoise calibrate --run-dir runs/denoise-quick --epsilon 0.1 --delta 0.1 --threads 1
    learn2stop denoise denoise   --run-dir runs/denoise-quick --denoise.input noisy.png

The core runs the stages, calibration and the frontier (:mod:`learn2stop.core.train`, :mod:`~learn2stop.core.deploy`,
:mod:`~learn2stop.core.frontier`); the config and presets are in :mod:`.config`, the data in :mod:`.data`, PSNR in
:mod:`.metric`, the evaluate and denoise commands in :mod:`.commands`, the report in :mod:`.report`. Python API (the
CLI calls these)::

    from learn2stop.tasks.denoise import preset, reproduce
    results = reproduce(preset("quick"), "runs/denoise-quick")
"""
from __future__ import annotations

from pathlib import Path

import torch

from ...core import Metric, StoppingModel, derive_seed
from ...core.task import Stage, StoppingApp
from ...core.train import min_step_hook
from ...core.signals import ToleranceSignal
from ...utils.config import to_dict
from ...utils.seeding import drawing_from
from ..base import RunContext, TaskSpec, register_task
from . import commands
from .config import PRESETS, DenoiseAppConfig
from .data import DenoiseTask, NoisyImage, eval_samples, load_training_images
from .metric import psnr
from .models import DeepSupervisedDnCNN
from .policy import DenoisePolicy

# ----------------------------------------------------------------------------- the app


class DenoiseApp(StoppingApp):
    """DnCNN-stop: DnCNN baseline, exits warmed up on its frozen backbone, Stage I, II, optional III."""

    stop_stage = "stage2"
    baseline_stage = "heads"  # the frontier's baseline: DnCNN with exits on its frozen backbone
    baseline_label = "DnCNN (its exits warmed up on the frozen backbone)"
    budget_by = "cost"  # budgets in multiply-accumulates (the model's exit_costs), not in exits
    speed_batch = 8  # 8 test images at once (larger CPU batches of 128x128 images thrash the allocator)
    export_dynamic_dims = {"inputs": [2, 3]}  # export: images of any height and width
    speed_samples = 24  # the first 24 test samples (image-major: every sigma of the first images)

    def task(self, cfg: DenoiseAppConfig) -> DenoiseTask:
        d = cfg.data

        def make():
            train_imgs, val_imgs = load_training_images(cfg)
            return DenoiseTask(train_imgs, val_imgs, patch_size=d.patch_size, stride=d.stride, scales=d.scales,
                               sigma_max=d.sigma_max, sigma_set=d.sigma_set, val_patches=d.val_patches, seed=cfg.seed)
        return self.cached(f"task {to_dict(d)} {cfg.seed}", make)

    def eval_set(self, cfg: DenoiseAppConfig, split: str) -> list[NoisyImage]:
        """The evaluation samples of a split (see :func:`.task.eval_samples`), cached."""
        return self.cached(f"{split} {to_dict(cfg.data)} {to_dict(cfg.eval)} {cfg.seed}", lambda: eval_samples(cfg, split))

    def build_models(self, cfg: DenoiseAppConfig, device) -> dict[str, StoppingModel]:
        m = cfg.model
        with drawing_from(torch.Generator().manual_seed(derive_seed(cfg.seed, "init"))):  # not the caller's RNG
            net = lambda positions, **kw: DeepSupervisedDnCNN(m.depth, m.channels, positions, head_kernel=m.head_kernel, **kw)
            policy = DenoisePolicy(len(m.positions) + 1, m.policy_hidden)
            models = {"baseline": StoppingModel(net(())),
                      "heads": StoppingModel(net(m.positions, frozen_backbone=True)),
                      "stop": StoppingModel(net(m.positions, policy_macs=policy.macs_per_pixel()), policy)}
        return {k: v.to(device) for k, v in models.items()}

    def training_task(self, cfg, key, sm):
        return self.task(cfg)

    def stages(self, cfg: DenoiseAppConfig) -> list[Stage]:
        def copy_backbone(key):
            def hook(models, app, cfg, run):
                models[key].model.load_backbone(models["baseline"].model)
            return hook

        min_step = min_step_hook(lambda c: c.model.policy_min_mass, cap=True)

        heads = cfg.heads.iterations > 0
        stages = [Stage("baseline", "baseline", cfg.baseline, describe="DnCNN, last-layer loss"),
                  Stage("heads", "heads", cfg.heads, before=copy_backbone("heads"),
                        describe="exits on the frozen DnCNN, uniform deep supervision"),
                  Stage("stage1", "stop", cfg.stage1, init_from="heads" if heads else None,
                        before=None if heads else copy_backbone("stop"), describe="DnCNN-stop Stage I (price on MACs)"),
                  Stage("stage2", "stop", cfg.stage2, before=min_step, describe="DnCNN-stop Stage II (policy)")]
        if cfg.stage3.iterations > 0:
            stages.append(Stage("stage3", "stop", cfg.stage3, describe="Stage III (beta-VAE fine-tuning of both)"))
        return stages

    def eval_batches(self, cfg: DenoiseAppConfig, split: str, device):
        """One image per batch: test images may differ in size."""
        return [(s.noisy.to(device), s.clean.to(device)) for s in self.eval_set(cfg, split)]

    def metric(self, cfg) -> Metric:
        return Metric("PSNR (dB)", psnr, lower_is_better=False)

    def classical_signals(self, cfg):
        return {"tolerance": ToleranceSignal}

    def training_note(self, cfg) -> str:
        return (f"denoise: {len(self.task(cfg).bank)} distinct {cfg.data.patch_size}x{cfg.data.patch_size} training "
                f"patches (x8 symmetries); {len(self.eval_set(cfg, 'val')) // len(cfg.eval.sigmas)} validation images")

    def cost_unit(self, cfg, sm):
        return "macs_per_pixel", float(sm.model.exit_costs[-1])


APP = DenoiseApp()


# ----------------------------------------------------------------------------- commands
def evaluate(cfg: DenoiseAppConfig, run: RunContext | str | Path) -> dict:
    """PSNR per image and sigma of DnCNN, DnCNN-stop (real early exit, deployed rule) and BM3D: Table 6.

    :func:`.commands.evaluate` on this task's app."""
    return commands.evaluate(APP, cfg, run)


def denoise_files(cfg: DenoiseAppConfig, run: RunContext | str | Path) -> dict:
    """Denoise an image file or every image of a folder with the deployed rule; write PNGs and depths.

    :func:`.commands.denoise_files` on this task's app."""
    return commands.denoise_files(APP, cfg, run)


SPEC = register_task(TaskSpec(
    name="denoise",
    description="DnCNN-stop: blind Gaussian denoising, the policy picks the depth per image (Sec. 5.3)",
    config_class=DenoiseAppConfig,
    presets=PRESETS,
    commands={"evaluate": evaluate, "denoise": denoise_files},
    app=APP,
))
#: the DnCNN baseline, exits warm-up, Stage I and II (and optional III), resumable; reproduce: train, deploy the
#: calibrated default, evaluate (Table 6, the figure). The core's commands (:mod:`learn2stop.core.commands`).
train, reproduce = SPEC.commands["train"], SPEC.commands["reproduce"]
