"""DnCNN and its deep-supervised variant as a step-wise model (paper Sec. 5.3, App. B.3).

DnCNN (Zhang et al. 2017) with ``depth`` D layers: conv+ReLU, (D-2) x conv+BN+ReLU, conv; 3x3
convolutions without biases, ``channels`` feature maps, predicting the noise (residual learning):
denoised = noisy - prediction. Call layers 1..D-1 the *blocks*; the last conv maps block D-1's
features to the noise.

The deep-supervised variant adds a *head* (conv C->C, BN, ReLU, conv C->1) after each block listed
in ``output_positions`` (paper: blocks 1..18 of 20 layers, plus the final layer: 19 outputs). Step t
runs the blocks from the previous output position up to the t-th, and ``readout(t)`` is the denoised
image from head t (the final conv at t = T), so an image that stops at t costs only its first
``layers_at(t)`` blocks. With no output positions it is plain DnCNN (T = 1).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn


def _conv(cin: int, cout: int) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=3, padding=1, bias=False)


class DeepSupervisedDnCNN(nn.Module):
    """DnCNN with early outputs; a step-wise model for :mod:`learn2stop.core.loop`.

    Args:
        depth: number of conv layers D (paper 20), at least 3.
        channels: feature maps C (paper 64).
        output_positions: blocks (1..D-2) followed by a head, increasing; None = every block 1..D-2,
            () = plain DnCNN. The final layer is always the last output.
        image_channels: 1 for grey images.

    Inputs: the noisy image (B, 1, H, W) in [0, 1]-ish. Output at every step: the denoised image
    (B, 1, H, W) (not clamped; clamp for PSNR).

    Example:
        >>> net = DeepSupervisedDnCNN(depth=5, channels=8, output_positions=(1, 2))
        >>> net.num_steps, [net.layers_at(t) for t in (1, 2, 3)]
        (3, [1, 2, 5])
    """

    def __init__(self, depth: int = 20, channels: int = 64, output_positions: Sequence[int] | None = None,
                 image_channels: int = 1):
        super().__init__()
        if depth < 3:
            raise ValueError(f"DnCNN depth must be >= 3 layers; got {depth}")
        if channels < 1:
            raise ValueError(f"channels must be >= 1; got {channels}")
        positions = tuple(range(1, depth - 1)) if output_positions is None else tuple(int(p) for p in output_positions)
        if any(not 1 <= p <= depth - 2 for p in positions) or list(positions) != sorted(set(positions)):
            raise ValueError(f"output_positions must be increasing block indices in 1..{depth - 2}; got {positions}")
        self.depth, self.channels, self.output_positions = depth, channels, positions
        self.num_steps = len(positions) + 1
        blocks = [nn.Sequential(_conv(image_channels, channels), nn.ReLU(inplace=True))]
        for _ in range(depth - 2):
            blocks.append(nn.Sequential(_conv(channels, channels), nn.BatchNorm2d(channels), nn.ReLU(inplace=True)))
        self.blocks = nn.ModuleList(blocks)  # D-1 blocks
        self.final = _conv(channels, image_channels)
        self.heads = nn.ModuleList(
            nn.Sequential(_conv(channels, channels), nn.BatchNorm2d(channels), nn.ReLU(inplace=True),
                          _conv(channels, image_channels))
            for _ in positions)
        # last block run by step t (1-based): the output positions, then block D-1 for the final conv
        self._ends = positions + (depth - 1,)
        self.block_rows = 0  # image-blocks computed, to check that early exit really skips work
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        # small last layers: the residual starts near zero, i.e. the output near the noisy input
        for m in [self.final] + [h[-1] for h in self.heads]:
            nn.init.normal_(m.weight, std=1e-3)

    def layers_at(self, t: int) -> int:
        """Conv layers on the path to output t (backbone blocks; + 2 for a head, + 1 for the final conv)."""
        return self._ends[t - 1] + (2 if t < self.num_steps else 1)

    def blocks_at(self, t: int) -> int:
        """Backbone blocks computed when stopping at output t."""
        return self._ends[t - 1]

    # ------------------------------------------------------------------ step-wise protocol
    def initial_state(self, inputs: Tensor) -> Tensor:
        if inputs.dim() != 4:
            raise ValueError(f"DnCNN expects noisy images (B, C, H, W); got shape {tuple(inputs.shape)}")
        return inputs

    def step(self, t: int, state: Tensor, inputs: Tensor) -> Tensor:
        """Run blocks (end of step t-1, end of step t]; state: (B, C, H, W) features (the input at t=1)."""
        start = self._ends[t - 2] if t > 1 else 0
        for block in self.blocks[start:self._ends[t - 1]]:
            state = block(state)
        self.block_rows += state.shape[0] * (self._ends[t - 1] - start)
        return state

    def readout(self, t: int, state: Tensor, inputs: Tensor) -> Tensor:
        """Denoised image at output t: noisy - predicted noise, (B, 1, H, W)."""
        layer = self.heads[t - 1] if t < self.num_steps else self.final
        return inputs - layer(state)

    def forward(self, noisy: Tensor) -> Tensor:
        """Full-depth denoising through the final layer only (plain DnCNN inference)."""
        state = noisy
        for block in self.blocks:
            state = block(state)
        return noisy - self.final(state)

    def backbone_state_dict(self) -> dict[str, Tensor]:
        """Weights of the blocks and the final layer (what plain DnCNN and this model share)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("heads.")}


class HeadsOnly(nn.Module):
    """A step-wise view of a deep-supervised DnCNN whose only parameters are its heads.

    Used to warm up freshly added heads on a pre-trained, frozen backbone: the trainer trains
    (and checkpoints) the parameters of the model it is given, so the backbone is kept outside the
    module tree; it also stays in eval mode, so its BatchNorm statistics do not move.
    """

    def __init__(self, net: DeepSupervisedDnCNN):
        super().__init__()
        self.heads = net.heads
        self.__dict__["_net"] = net  # not a submodule: not trained, not saved, not switched to train mode
        self.num_steps = net.num_steps

    def initial_state(self, inputs):
        return self._net.initial_state(inputs)

    def step(self, t, state, inputs):
        self._net.blocks.eval()  # frozen backbone: running BN statistics, no gradients
        with torch.no_grad():
            return self._net.step(t, state, inputs)

    def readout(self, t, state, inputs):
        if t == self.num_steps:  # the final layer belongs to the frozen backbone
            with torch.no_grad():
                return self._net.readout(t, state, inputs)
        return self._net.readout(t, state, inputs)
