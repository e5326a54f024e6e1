"""DnCNN-stop: blind image denoising with a learned depth per image (paper Sec. 5.3, App. B.3).

Pieces: :mod:`.data` (image folders, dead-leaves default images, multi-scale patches, noise),
:mod:`.models` (DnCNN and its deep-supervised step-wise variant), :mod:`.policy` (the stop CNN),
:mod:`.metrics` (PSNR), :mod:`.bm3d_baseline` (optional BM3D), :mod:`.task` (the training task) and
:mod:`.app` (config, presets, CLI commands).
"""
from ..base import TaskSpec, register_task
from .app import COMMANDS, PRESETS, DenoiseAppConfig
from .data import ImageDataError, PatchBank, add_noise, augment, inverse_augment, load_image, synthetic_images
from .metrics import psnr
from .models import DeepSupervisedDnCNN, HeadsOnly
from .policy import DenoisePolicy
from .task import DenoiseTask, sse_loss

register_task(TaskSpec(
    name="denoise",
    description="DnCNN-stop: blind Gaussian denoising, the policy picks the depth per image (Sec. 5.3)",
    config_class=DenoiseAppConfig,
    presets=PRESETS,
    commands=COMMANDS,
))

__all__ = ["DenoiseAppConfig", "DeepSupervisedDnCNN", "DenoisePolicy", "DenoiseTask", "HeadsOnly", "ImageDataError",
           "PatchBank", "add_noise", "augment", "inverse_augment", "load_image", "psnr", "sse_loss", "synthetic_images"]
