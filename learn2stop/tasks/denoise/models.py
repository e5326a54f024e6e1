"""DnCNN and its deep-supervised, early-exit variant as a step-wise model (paper Sec. 5.3, App. B.3).

DnCNN (Zhang et al. 2017) with ``depth`` D layers: conv+ReLU, (D-2) x conv+BN+ReLU, conv; 3x3
convolutions without biases, ``channels`` C feature maps, predicting the noise (residual learning):
denoised = noisy - prediction. Call layers 1..D-1 the *blocks*; the last conv maps block D-1's
features to the noise.

The early-exit variant adds a *head* after each block listed in ``output_positions``: one conv
C -> 1 (1x1 by default; 3x3 makes the exit after block k a (k+1)-layer DnCNN sharing the first k
blocks). A 1x1 head costs 1/(9C) of a block (the paper's heads, conv C->C + BN + ReLU + conv C->1,
cost a whole block each: with one at every block, a full-depth image paid about twice the network).
Step t runs the blocks from the previous exit up to the t-th, and ``readout(t)`` is the denoised
image from head t (the final conv at t = T), so an image that stops at t costs its first
``blocks_at(t)`` blocks and t heads (:attr:`~DeepSupervisedDnCNN.exit_costs`). With no output
positions it is plain DnCNN (T = 1).

The classical baseline, BM3D (Dabov et al. 2007) with the true noise level, runs through the optional ``bm3d``
package (:func:`bm3d_denoise`).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import Tensor, nn


def _conv(cin: int, cout: int, kernel: int = 3) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=kernel, padding=kernel // 2, bias=False)


class DeepSupervisedDnCNN(nn.Module):
    """DnCNN with cheap early exits; a step-wise model for :mod:`learn2stop.core.loop`.

    Args:
        depth: number of conv layers D (paper 20), at least 3.
        channels: feature maps C (paper 64).
        output_positions: blocks (1..D-2) followed by a head, increasing; None = every block 1..D-2,
            () = plain DnCNN. The final layer is always the last output.
        image_channels: 1 for grey images.
        head_kernel: 1 (a 1x1 conv C->1, default) or 3 (3x3, like the final layer: 9x the multiply-adds,
            and on CPUs a 3x3 conv with one output channel runs at a fraction of the speed of the
            others, about 20 % of a block's time instead of 1/C).
        frozen_backbone: train only the heads: the blocks and the final conv run without gradients
            and keep their BatchNorm statistics (the heads warm-up on a pre-trained DnCNN).
        policy_macs: multiply-accumulates per pixel of one call of the stopping policy, counted in
            :attr:`exit_costs` (the policy is asked at every exit but the last).

    Inputs: the noisy image (B, 1, H, W). Output at every step: the denoised image (B, 1, H, W)
    (not clamped; clamp for PSNR).

    Example:
        >>> net = DeepSupervisedDnCNN(depth=5, channels=8, output_positions=(1, 2))
        >>> net.num_steps, [net.layers_at(t) for t in (1, 2, 3)]
        (3, [2, 3, 5])
    """

    outputs_are_logits = False  # a denoised image, not class logits (protocols.MODEL_MEMBERS)

    def __init__(self, depth: int = 20, channels: int = 64, output_positions: Sequence[int] | None = None,
                 image_channels: int = 1, head_kernel: int = 1, frozen_backbone: bool = False,
                 policy_macs: float = 0.0):
        super().__init__()
        if depth < 3:
            raise ValueError(f"DnCNN depth must be >= 3 layers; got {depth}")
        if channels < 1:
            raise ValueError(f"channels must be >= 1; got {channels}")
        if head_kernel not in (1, 3):
            raise ValueError(f"head_kernel must be 1 or 3; got {head_kernel}")
        positions = tuple(range(1, depth - 1)) if output_positions is None else tuple(int(p) for p in output_positions)
        if any(not 1 <= p <= depth - 2 for p in positions) or list(positions) != sorted(set(positions)):
            raise ValueError(f"output_positions must be increasing block indices in 1..{depth - 2}; got {positions}")
        self.depth, self.channels, self.output_positions = depth, channels, positions
        self.image_channels, self.head_kernel = image_channels, head_kernel
        self.frozen_backbone, self.policy_macs = frozen_backbone, float(policy_macs)
        self.num_steps = len(positions) + 1
        blocks = [nn.Sequential(_conv(image_channels, channels), nn.ReLU(inplace=True))]
        for _ in range(depth - 2):
            blocks.append(nn.Sequential(_conv(channels, channels), nn.BatchNorm2d(channels), nn.ReLU(inplace=True)))
        self.blocks = nn.ModuleList(blocks)  # D-1 blocks
        self.final = _conv(channels, image_channels)
        self.heads = nn.ModuleList(_conv(channels, image_channels, head_kernel) for _ in positions)
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
        for m in [self.final, *self.heads]:
            nn.init.normal_(m.weight, std=1e-3)

    def train(self, mode: bool = True) -> "DeepSupervisedDnCNN":
        super().train(mode)
        if self.frozen_backbone:
            self.blocks.eval()  # a frozen backbone keeps its running BatchNorm statistics
        return self

    # ------------------------------------------------------------------ depth and cost
    def layers_at(self, t: int) -> int:
        """Conv layers on the path to output t: the blocks run plus the head (or the final conv)."""
        return self._ends[t - 1] + 1

    def blocks_at(self, t: int) -> int:
        """Backbone blocks computed when stopping at output t."""
        return self._ends[t - 1]

    def block_macs(self) -> list[float]:
        """Multiply-accumulates per pixel of each block (D-1,): 9 C for the first, 9 C^2 after."""
        c, k = self.channels, self.image_channels
        return [9.0 * k * c] + [9.0 * c * c] * (self.depth - 2)

    def _macs_to(self) -> tuple[list[float], float, float]:
        """(the blocks' MACs per pixel up to output t = 1..T, an exit head's, the final conv's)."""
        blocks = torch.tensor(self.block_macs(), dtype=torch.float64).cumsum(0)
        to = [float(blocks[self._ends[t - 1] - 1]) for t in range(1, self.num_steps + 1)]
        return to, float(self.head_kernel ** 2 * self.channels * self.image_channels), 9.0 * self.channels * self.image_channels

    @property
    def exit_costs(self) -> list[float]:
        """Cumulative multiply-accumulates per pixel of stopping at output t = 1..T, shape (T,).

        Everything an image that stops at t has computed: blocks 1..blocks_at(t), the heads of
        outputs 1..t (the final conv at T) and the policy at outputs 1..min(t, T-1) (an upper bound
        when the policy skips its first exits, ``min_step``: 0.2 % of a block per call). The core
        normalises by the last entry (see :func:`learn2stop.core.distributions.exit_costs`).
        """
        to, head, final = self._macs_to()
        T = self.num_steps
        return [to[t - 1] + ((t - 1) * head + (final if t == T else head)) + (t - 1 if t == T else t) * self.policy_macs
                for t in range(1, T + 1)]  # summed in the order they always were (the price prior reads them)

    @property
    def fixed_exit_costs(self) -> list[float]:
        """Multiply-accumulates per pixel of output t read alone (a fixed depth): blocks 1..blocks_at(t) and
        head t (the final conv at T), no earlier head and no policy; shape (T,)."""
        to, head, final = self._macs_to()
        return [to[t - 1] + (final if t == self.num_steps else head) for t in range(1, self.num_steps + 1)]

    # ------------------------------------------------------------------ step-wise protocol
    def initial_state(self, inputs: Tensor) -> Tensor:
        if inputs.dim() != 4:
            raise ValueError(f"DnCNN expects noisy images (B, C, H, W); got shape {tuple(inputs.shape)}")
        return inputs

    def step(self, t: int, state: Tensor, inputs: Tensor) -> Tensor:
        """Run blocks (end of step t-1, end of step t]; state: (B, C, H, W) features (the input at t=1)."""
        start = self._ends[t - 2] if t > 1 else 0
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.frozen_backbone):
            for block in self.blocks[start:self._ends[t - 1]]:
                state = block(state)
        self.block_rows += state.shape[0] * (self._ends[t - 1] - start)
        return state

    def readout(self, t: int, state: Tensor, inputs: Tensor) -> Tensor:
        """Denoised image at output t: noisy - predicted noise, (B, 1, H, W)."""
        if t < self.num_steps:
            return inputs - self.heads[t - 1](state)
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.frozen_backbone):
            return inputs - self.final(state)

    def forward(self, noisy: Tensor) -> Tensor:
        """Full-depth denoising through the final layer only (plain DnCNN inference)."""
        state = noisy
        for block in self.blocks:
            state = block(state)
        return noisy - self.final(state)

    def load_backbone(self, other: "DeepSupervisedDnCNN") -> None:
        """Copy the blocks and the final layer of another DnCNN of the same depth and width (heads untouched)."""
        backbone = {k: v for k, v in other.state_dict().items() if not k.startswith("heads.")}
        try:
            missing, unexpected = self.load_state_dict(backbone, strict=False)
        except RuntimeError as e:
            raise ValueError(f"load_backbone: the two DnCNNs differ in their backbone: {e}") from None
        bad = [k for k in missing if not k.startswith("heads.")] + list(unexpected)
        if bad:
            raise ValueError(f"load_backbone: the two DnCNNs differ in their backbone ({', '.join(bad[:4])})")


# ----------------------------------------------------------------------------- BM3D, the classical baseline
def bm3d_available() -> bool:
    """True if the optional ``bm3d`` package imports (``pip install bm3d``)."""
    try:
        import bm3d  # noqa: F401
    except Exception:  # an ImportError, or a broken binary dependency
        return False
    return True


def bm3d_denoise(noisy: np.ndarray, sigma: float) -> np.ndarray:
    """Denoise a (H, W) image in [0, 1]-ish given the noise std ``sigma`` on the 0..255 scale.

    Raises:
        ImportError: with the install command, if ``bm3d`` is absent.
    """
    try:
        import bm3d
    except ImportError:
        raise ImportError("BM3D needs the optional package 'bm3d' (pip install bm3d)") from None
    if sigma < 0:
        raise ValueError(f"sigma must be >= 0; got {sigma}")
    if sigma == 0:
        return np.asarray(noisy, dtype=np.float32)
    out = bm3d.bm3d(np.asarray(noisy, dtype=np.float64), sigma_psd=sigma / 255.0)
    return np.asarray(out, dtype=np.float32)
