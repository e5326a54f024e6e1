"""DnCNN-stop: blind image denoising with a learned depth per image (paper Sec. 5.3, App. B.3).

Pieces: :mod:`.data` (image folders, dead-leaves default images, multi-scale patches, noise),
:mod:`.models` (DnCNN and its early-exit variant with cheap exits and declared exit costs),
:mod:`.policy` (the stop MLP on image statistics), :mod:`.metrics` (PSNR and Table 6),
:mod:`.bm3d_baseline` (optional BM3D), :mod:`.task` (config, presets, images, the training task) and :mod:`.app` (the
:class:`~learn2stop.core.task.StoppingApp` and the CLI commands; registers the task).
"""
from .app import APP, evaluate, reproduce, train
from .data import ImageDataError, PatchBank, add_noise, augment, inverse_augment, load_image, synthetic_images
from .metrics import psnr
from .models import DeepSupervisedDnCNN
from .policy import DenoisePolicy, image_statistics
from .task import PRESETS, DenoiseAppConfig, DenoiseTask, preset, sse_loss

__all__ = ["APP", "DenoiseAppConfig", "DeepSupervisedDnCNN", "DenoisePolicy", "DenoiseTask", "ImageDataError",
           "PRESETS", "PatchBank", "add_noise", "augment", "evaluate", "image_statistics", "inverse_augment",
           "load_image", "preset", "psnr", "reproduce", "sse_loss", "synthetic_images", "train"]
