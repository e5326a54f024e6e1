"""The stopping policy for DnCNN-stop: a small CNN shared over the outputs (App. B.3)."""
from __future__ import annotations

import torch
from torch import Tensor, nn


class DenoisePolicy(nn.Module):
    """pi_t from the noisy image and the current estimate; one network for every output t.

    Input channels: [noisy, predicted noise (noisy - output), output]; then conv+BN+ReLU+max-pool
    twice, a conv, global average pooling (so any image size works), and a linear layer that also
    sees t / T (the release has no position input; giving it costs nothing and lets one shared
    network set a depth-dependent bias).

    Args:
        num_steps: T of the model it stops.
        channels: feature maps (release: 64).

    Returns (forward): (B,) stop logits, pi_t = sigmoid(logit).
    """

    def __init__(self, num_steps: int, channels: int = 64, image_channels: int = 1):
        super().__init__()
        self.num_steps = num_steps
        c = channels
        self.features = nn.Sequential(
            nn.Conv2d(3 * image_channels, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=True),
            nn.MaxPool2d(2, ceil_mode=True),
            nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=True),
            nn.MaxPool2d(2, ceil_mode=True),
            nn.Conv2d(c, c, 3, padding=1),
        )
        self.linear = nn.Linear(c + 1, 1)

    def forward(self, inputs: Tensor, output: Tensor, t: int) -> Tensor:
        x = torch.cat([inputs, inputs - output, output], dim=1)  # (B, 3, H, W)
        h = self.features(x).mean(dim=(2, 3))  # (B, c)
        pos = h.new_full((h.shape[0], 1), t / self.num_steps)
        return self.linear(torch.cat([h, pos], dim=1)).squeeze(1)
