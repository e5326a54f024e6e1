"""Image quality: PSNR with data range 1 on outputs clamped to [0, 1] (the task's metric), and the per-image sum of
squared errors that training and the oracle read."""
from __future__ import annotations

import torch
from torch import Tensor


def psnr(estimate: Tensor, clean: Tensor, data_range: float = 1.0, clamp: bool = True) -> Tensor:
    """Per-image PSNR in dB: 10 log10(range^2 / MSE) over all but the batch dim.

    Args:
        estimate, clean: (B, ...) images; ``estimate`` is clamped to [0, data_range] first by default.
    Returns:
        (B,) PSNR; +inf where the estimate is exact.
    """
    if estimate.shape != clean.shape:
        raise ValueError(f"estimate and clean images differ in shape: {tuple(estimate.shape)} vs {tuple(clean.shape)}")
    if clamp:
        estimate = estimate.clamp(0.0, data_range)
    mse = ((estimate.double() - clean.double()) ** 2).flatten(1).mean(dim=1)
    return (10 * torch.log10(data_range ** 2 / mse)).float()


def sse_loss(output: Tensor, target: Tensor) -> Tensor:
    """Per-image sum of squared errors (B,), the scale on which the paper sets beta = 0.1."""
    return ((output - target) ** 2).flatten(1).sum(dim=1)
