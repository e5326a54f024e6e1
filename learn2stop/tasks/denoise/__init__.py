"""DnCNN-stop: blind image denoising with a learned depth per image (paper Sec. 5.3, App. B.3).

Pieces: :mod:`.config` (config and presets), :mod:`.images` (image files, dead-leaves default images), :mod:`.data`
(multi-scale patches, noise, the training, validation and test images, the training task), :mod:`.models` (DnCNN and
its early-exit variant with cheap exits and declared exit costs; the optional BM3D baseline), :mod:`.policy` (the stop
MLP on image statistics), :mod:`.metric` (PSNR, the per-image SSE), :mod:`.report` (Table 6, the crops figure),
:mod:`.commands` (evaluate, denoise) and :mod:`.app` (the :class:`~learn2stop.core.task.StoppingApp`; registers the
task).
"""
from .app import APP, evaluate, reproduce, train
from .config import PRESETS, DenoiseAppConfig, preset
from .data import DenoiseTask, PatchBank, add_noise, augment, inverse_augment
from .images import ImageDataError, load_image, synthetic_images
from .metric import psnr, sse_loss
from .models import DeepSupervisedDnCNN
from .policy import DenoisePolicy, image_statistics

__all__ = ["APP", "DenoiseAppConfig", "DeepSupervisedDnCNN", "DenoisePolicy", "DenoiseTask", "ImageDataError",
           "PRESETS", "PatchBank", "add_noise", "augment", "evaluate", "image_statistics", "inverse_augment",
           "load_image", "preset", "psnr", "reproduce", "sse_loss", "synthetic_images", "train"]
