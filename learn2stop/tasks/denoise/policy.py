"""The stopping policy for DnCNN-stop: a tiny MLP on global statistics of the current estimate.

The paper's policy is a CNN over [noisy, residual, output] at full resolution; asked at every exit it
cost about as much as a DnCNN layer per call. What decides whether more depth pays is mostly how
noisy the image is and how much structure it has, and both show in a few global statistics of the
noisy input x, the current output o and the residual r = x - o (the noise removed so far):

- mean |grad| of x, o and r: the input's roughness, the estimate's structure, and (relative to
  RMS(r)) whether the residual is still white (about 1.13 RMS for white noise) or carries edges;
- mean r^2, mean |r|: the noise level (blind: sigma is never an input);
- mean |d_x o| and mean(|r| |d_x o|): whether the residual concentrates on the estimate's edges;
- var(o): the estimate's contrast.

Their logs go through a BatchNorm and a one-hidden-layer MLP (ratios of statistics are differences
of logs, so the first layer forms them); the step enters as a learned per-step bias of that layer.
Each statistic is a mean over pixels, so any image size works; one call costs about
:data:`FLOPS_PER_PIXEL` elementwise operations per pixel (0.2 % of a 32-channel 3x3 conv) and about
20 small tensor operations.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ...core.policies import MinStep

#: elementwise operations per pixel of one call (copies, differences, absolute values, products, means).
FLOPS_PER_PIXEL = 40
NUM_FEATURES = 8


def image_statistics(inputs: Tensor, output: Tensor, eps: float = 1e-6) -> Tensor:
    """The policy's features of each image, (B, NUM_FEATURES); see the module docstring.

    Columns: log of mean |grad x|, |grad o|, |grad r|, mean r^2, mean |r|, mean |d_x o|,
    mean |r| |d_x o|, var(o).
    """
    r = inputs - output  # (B, 1, H, W) noise removed so far
    z = torch.cat([inputs, output, r], dim=1)  # (B, 3, H, W): x, o, r
    gx = (z[..., :, 1:] - z[..., :, :-1]).abs()  # (B, 3, H, W-1)
    gy = (z[..., 1:, :] - z[..., :-1, :]).abs()  # (B, 3, H-1, W)
    rough = gx.mean((2, 3)) + gy.mean((2, 3))  # (B, 3)
    ra = z[:, 2:, :, 1:].abs()  # (B, 1, H, W-1) |r|, aligned with d_x o
    stats = torch.stack([r.square().mean((1, 2, 3)), ra.mean((1, 2, 3)), gx[:, 1].mean((1, 2)),
                         (ra * gx[:, 1:2]).mean((1, 2, 3)), output.var((1, 2, 3))], dim=1)  # (B, 5)
    return torch.cat([rough, stats], dim=1).add(eps).log()


class DenoisePolicy(MinStep, nn.Module):
    """pi_t = sigmoid(MLP(statistics(x, o_t)) + step bias); one network for every exit.

    Args:
        num_steps: T of the model it stops.
        hidden: width of the hidden layer.

    Attributes:
        min_step: the first exit at which the policy is asked (earlier exits never stop and the
            policy is not run there); saved with the weights.

    Returns (forward): (B,) stop logits.
    """

    def __init__(self, num_steps: int, hidden: int = 16):
        super().__init__()
        if num_steps < 2 or hidden < 1:
            raise ValueError(f"a policy needs num_steps >= 2 and hidden >= 1; got {num_steps}, {hidden}")
        self.num_steps = num_steps
        self.min_step = 1
        self.norm = nn.BatchNorm1d(NUM_FEATURES)  # features on very different scales
        self.first = nn.Linear(NUM_FEATURES, hidden)
        self.step_bias = nn.Parameter(torch.zeros(num_steps, hidden))
        self.out = nn.Linear(hidden, 1)
        nn.init.constant_(self.out.bias, -2.0)  # start cautious: pi_t about 0.12, most images run deep

    @staticmethod
    def macs_per_pixel() -> float:
        """Cost of one call in multiply-accumulates per pixel (two flops each)."""
        return FLOPS_PER_PIXEL / 2

    def forward(self, inputs: Tensor, output: Tensor, t: int) -> Tensor:
        h = self.first(self.norm(image_statistics(inputs, output))) + self.step_bias[t - 1]  # (B, hidden)
        return self.out(torch.relu(h)).squeeze(1)
