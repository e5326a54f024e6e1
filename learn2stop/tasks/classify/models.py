"""VGG-BN with internal classifiers as a step-wise model (paper Sec. 5.4; SDN, Kaya et al. 2019).

A Shallow-Deep Network adds *internal classifiers* (ICs) after some conv layers of a plain CNN.
Here the CNN is VGG with batch norm: conv3x3-BN-ReLU layers, a 2x2 max-pool after the layers
marked 'M' in the width list, then a three-layer fully connected classifier. Step t runs the conv
layers from the previous IC position up to the t-th, and ``readout(t)`` is IC t's logits (the
network's own classifier at t = T), so an image that exits at t costs only its first
``convs_at(t)`` conv layers plus the ICs it passed.

FLOPs are measured with ``torch.utils.flop_counter.FlopCounterMode`` (multiply-adds count 2;
pooling, BN and ReLU are not counted): :func:`flop_table`, :func:`step_flops`, :func:`exit_flops`,
:func:`full_network_flops`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

from ...utils.registry import Registry

Width = Union[int, str]  # a conv width, or "M" for a 2x2 max-pool after the previous conv

#: SDN places its ICs where the cumulative cost first reaches these fractions of the network's FLOPs.
SDN_FRACTIONS = (0.15, 0.30, 0.45, 0.60, 0.75, 0.90)


class ICHead(nn.Module):
    """SDN's internal classifier: mixed max/avg pooling to ``pool_size``^2, flatten, one linear layer.

    mix = sigmoid(alpha) * maxpool + (1 - sigmoid(alpha)) * avgpool, alpha a learnable scalar
    (starts at 0: an even mix). A feature map already no larger than ``pool_size`` is not pooled
    (and the head then has no alpha).

    Args:
        channels: C of the incoming feature map (B, C, S, S).
        in_size: its spatial size S.
        num_classes: logits out.
        pool_size: side of the pooled map (SDN: 4).
    """

    def __init__(self, channels: int, in_size: int, num_classes: int, pool_size: int = 4):
        super().__init__()
        self.pool_size = pool_size
        self.pools = in_size > pool_size
        out = pool_size if self.pools else in_size
        self.alpha = nn.Parameter(torch.zeros(())) if self.pools else None
        self.linear = nn.Linear(channels * out * out, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        if self.pools:
            mix = torch.sigmoid(self.alpha)
            x = mix * F.adaptive_max_pool2d(x, self.pool_size) + (1 - mix) * F.adaptive_avg_pool2d(x, self.pool_size)
        return self.linear(x.flatten(1))  # (B, num_classes)


def conv_layer_sizes(widths: Sequence[Width], input_size: int, in_channels: int = 3) -> list[tuple[int, int, int, bool]]:
    """Per conv layer: (in channels, out channels, spatial size of the conv, pooled after it)."""
    layers: list[list] = []
    cin = in_channels
    size = input_size
    for w in widths:
        if w == "M":
            if not layers or layers[-1][3]:
                raise ValueError(f"widths: 'M' must follow a conv width (one pool per conv); got {list(widths)}")
            layers[-1][3] = True
            continue
        if not isinstance(w, int) or isinstance(w, bool) or w < 1:
            raise ValueError(f"widths must hold positive ints and 'M'; got {w!r} in {list(widths)}")
        if layers and layers[-1][3]:
            size //= 2
        layers.append([cin, w, size, False])
        cin = w
    if not layers:
        raise ValueError("widths must hold at least one conv width")
    return [tuple(layer) for layer in layers]


def sdn_ic_positions(layer_flops: Sequence[int], total_flops: int,
                     fractions: Sequence[float] = SDN_FRACTIONS) -> tuple[int, ...]:
    """Conv layers (1-based, excluding the last) whose cumulative FLOPs are nearest each fraction.

    For VGG16-BN this gives (2, 4, 6, 7, 9, 10), SDN's own placement ("15, 30, 45, 60, 75, 90
    percent of GFLOPs"); positions that coincide are kept once.
    """
    cum, run = [], 0
    for f in layer_flops[:-1]:  # no IC after the last conv: the classifier sits there
        run += f
        cum.append(run / total_flops)
    picks = {min(range(len(cum)), key=lambda i: abs(cum[i] - frac)) + 1 for frac in fractions} if cum else set()
    return tuple(sorted(picks))


class VGGEarlyExit(nn.Module):
    """VGG with batch norm and internal classifiers; a step-wise model for :mod:`learn2stop.core.loop`.

    Args:
        widths: conv widths and 'M' (2x2 max-pool after the previous conv), as classic VGG cfgs.
        num_classes: classes (CIFAR-10: 10, CIFAR-100: 100, Tiny-ImageNet: 200).
        input_size: side of the square input (32 for CIFAR, 64 for Tiny-ImageNet).
        ic_positions: conv layers (1-based, 1..L-1, increasing) followed by an IC; None = SDN's
            placement (:func:`sdn_ic_positions`), () = the plain network (T = 1).
        fc_width: width of the two hidden fully connected layers (SDN CIFAR: 512).
        dropout: dropout probability in the classifier.
        pool_size: side of the ICs' pooled map.
        in_channels: image channels.

    Inputs: images (B, in_channels, input_size, input_size), normalised floats. Output at every
    step: logits (B, num_classes).

    Example:
        >>> net = VGGEarlyExit([8, "M", 16, "M", 16], num_classes=10, input_size=32, ic_positions=(1, 2), fc_width=16)
        >>> net.num_steps, [net.convs_at(t) for t in (1, 2, 3)]
        (3, [1, 2, 3])
    """

    def __init__(self, widths: Sequence[Width], num_classes: int, input_size: int = 32,
                 ic_positions: Sequence[int] | None = None, fc_width: int = 512, dropout: float = 0.5,
                 pool_size: int = 4, in_channels: int = 3):
        super().__init__()
        for name, value in (("num_classes", num_classes), ("input_size", input_size), ("fc_width", fc_width),
                            ("pool_size", pool_size), ("in_channels", in_channels)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
        if not 0 <= dropout < 1:
            raise ValueError(f"dropout must be in [0, 1); got {dropout}")
        layers = conv_layer_sizes(widths, input_size, in_channels)
        pools = sum(p for *_, p in layers)
        final_size = input_size // 2 ** pools
        if final_size < 1:
            raise ValueError(f"input_size {input_size} is too small for {pools} 2x2 max-pools")
        self.widths, self.num_classes, self.input_size, self.in_channels = list(widths), num_classes, input_size, in_channels
        self.convs = nn.ModuleList()
        out_sizes = []  # spatial size after each conv layer (after its pool)
        for cin, cout, size, pooled in layers:
            block = [nn.Conv2d(cin, cout, 3, padding=1, bias=False),  # BN's shift makes a conv bias redundant
                     nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
            if pooled:
                block.append(nn.MaxPool2d(2))
            self.convs.append(nn.Sequential(*block))
            out_sizes.append(size // 2 if pooled else size)
        c_last = layers[-1][1]
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(c_last * final_size * final_size, fc_width), nn.ReLU(inplace=True), nn.Dropout(dropout),
            nn.Linear(fc_width, fc_width), nn.ReLU(inplace=True), nn.Dropout(dropout),
            nn.Linear(fc_width, num_classes))
        if ic_positions is None:
            layer_flops = [2 * 9 * cin * cout * size * size for cin, cout, size, _ in layers]
            fc_flops = 2 * sum(m.in_features * m.out_features for m in self.classifier if isinstance(m, nn.Linear))
            ic_positions = sdn_ic_positions(layer_flops, sum(layer_flops) + fc_flops)
        positions = tuple(int(p) for p in ic_positions)
        L = len(layers)
        if any(not 1 <= p <= L - 1 for p in positions) or list(positions) != sorted(set(positions)):
            raise ValueError(f"ic_positions must be increasing conv-layer indices in 1..{L - 1}; got {positions}")
        self.ic_positions = positions
        self.heads = nn.ModuleList(ICHead(layers[p - 1][1], out_sizes[p - 1], num_classes, pool_size) for p in positions)
        self.num_steps = len(positions) + 1
        self._ends = positions + (L,)  # last conv layer run by step t (1-based)
        self.conv_rows = 0  # image-conv-layers computed, to check that early exit really skips work
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Kaiming (fan-out) convs as SDN/VGG, BN at identity; linear layers keep torch's default."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    @property
    def num_convs(self) -> int:
        return len(self.convs)

    def convs_at(self, t: int) -> int:
        """Conv layers computed when exiting at step t."""
        return self._ends[t - 1]

    def _run_convs(self, x: Tensor, start: int, end: int) -> Tensor:
        for layer in self.convs[start:end]:
            x = layer(x)
        self.conv_rows += x.shape[0] * (end - start)
        return x

    # ------------------------------------------------------------------ step-wise protocol
    def initial_state(self, inputs: Tensor) -> Tensor:
        """Check the images: (B, in_channels, input_size, input_size) floats; they are the state x_0."""
        expected = f"(B, {self.in_channels}, {self.input_size}, {self.input_size})"
        if not isinstance(inputs, Tensor) or inputs.dim() != 4:
            shape = tuple(inputs.shape) if isinstance(inputs, Tensor) else type(inputs).__name__
            raise ValueError(f"VGGEarlyExit expects images {expected}; got {shape}")
        if not inputs.is_floating_point():
            raise ValueError(f"VGGEarlyExit expects float images (normalise uint8 images first); got {inputs.dtype}")
        _, c, h, w = inputs.shape
        if c != self.in_channels or h != self.input_size or w != self.input_size:
            raise ValueError(f"VGGEarlyExit expects images {expected}; got {tuple(inputs.shape)}")
        return inputs

    def step(self, t: int, state: Tensor, inputs: Tensor) -> Tensor:
        """Run conv layers (end of step t-1, end of step t]; state: (B, C, S, S) features."""
        start = self._ends[t - 2] if t > 1 else 0
        return self._run_convs(state, start, self._ends[t - 1])

    def readout(self, t: int, state: Tensor, inputs: Tensor) -> Tensor:
        """Logits (B, num_classes) of IC t, or of the network's classifier at t = T."""
        return self.heads[t - 1](state) if t < self.num_steps else self.classifier(state)

    def forward(self, x: Tensor) -> Tensor:
        """The network alone: every conv layer and the final classifier, no IC; (B, num_classes)."""
        return self.classifier(self._run_convs(self.initial_state(x), 0, self.num_convs))

    def backbone_state_dict(self) -> dict[str, Tensor]:
        """Weights of the convs and the classifier (what the plain CNN and this model share)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("heads.")}


# ----------------------------------------------------------------------------- presets
@dataclass(frozen=True)
class VGGConfig:
    """A named network size: conv widths, classifier width and (optionally) fixed IC positions."""

    widths: tuple
    fc_width: int
    ic_positions: tuple[int, ...] | None = None  # None: SDN's FLOP-based placement


M = "M"
VGG_CONFIGS: Registry[VGGConfig] = Registry("VGG config")
VGG_CONFIGS.register("vgg16")(VGGConfig(  # the paper's VGG16-BN (SDN's CIFAR variant)
    (64, 64, M, 128, 128, M, 256, 256, 256, M, 512, 512, 512, M, 512, 512, 512, M), fc_width=512))
VGG_CONFIGS.register("vgg16-quarter")(VGGConfig(  # same depth and ICs, 1/16 of the FLOPs
    (16, 16, M, 32, 32, M, 64, 64, 64, M, 128, 128, 128, M, 128, 128, 128, M), fc_width=128))
VGG_CONFIGS.register("vgg11-half")(VGGConfig(  # VGG11 (cfg A) at half width
    (32, M, 64, M, 128, 128, M, 256, 256, M, 256, 256, M), fc_width=256))
VGG_CONFIGS.register("vgg6-narrow")(VGGConfig(  # the quick preset: minutes on a CPU, an IC after every conv
    (32, 32, M, 64, 64, M, 128, 128, M), fc_width=128, ic_positions=(1, 2, 3, 4, 5)))


def list_vgg_configs() -> list[str]:
    return VGG_CONFIGS.names()


def build_vgg(name: str, num_classes: int, input_size: int = 32, ic_positions: Sequence[int] | None = None,
              **kw) -> VGGEarlyExit:
    """A :class:`VGGEarlyExit` of the named size; ``kw`` overrides fc_width, dropout, pool_size, in_channels.

    ``ic_positions`` None takes the preset's positions, or SDN's placement where the preset has none.

    Example:
        >>> build_vgg("vgg16", num_classes=10).ic_positions
        (2, 4, 6, 7, 9, 10)
    """
    cfg = VGG_CONFIGS.get(name)
    kw.setdefault("fc_width", cfg.fc_width)
    positions = ic_positions if ic_positions is not None else cfg.ic_positions
    return VGGEarlyExit(list(cfg.widths), num_classes, input_size, positions, **kw)


# ----------------------------------------------------------------------------- FLOPs
@dataclass(frozen=True)
class FlopTable:
    """Per-sample FLOPs of each step t = 1..T: its conv layers (backbone) and its readout head.

    ``heads[-1]`` is the network's classifier; the other heads are the ICs.
    """

    backbone: tuple[int, ...]
    heads: tuple[int, ...]

    @property
    def steps(self) -> list[int]:
        """Cost of step t alone: its conv layers and its own readout."""
        return [b + h for b, h in zip(self.backbone, self.heads)]

    @property
    def exits(self) -> list[int]:
        """Cost of exiting at t: conv layers of steps 1..t and the heads of steps 1..t.

        A sample that reaches step t has evaluated every earlier IC to decide to go on.
        """
        out, run = [], 0
        for s in self.steps:
            run += s
            out.append(run)
        return out


def _count(fn):
    """(fn(), the FLOPs it ran) under torch's FlopCounterMode."""
    with FlopCounterMode(display=False) as counter:
        out = fn()
    return out, int(counter.get_total_flops())


def _probe(model: VGGEarlyExit) -> Tensor:
    p = next(model.parameters())
    return torch.zeros(1, model.in_channels, model.input_size, model.input_size, device=p.device, dtype=p.dtype)


@torch.no_grad()
def flop_table(model: VGGEarlyExit) -> FlopTable:
    """Measure each step's backbone and head FLOPs for one sample with torch's FlopCounterMode.

    Runs in eval mode (no BN statistics move) and leaves ``conv_rows`` and the mode as they were.
    """
    was_training, rows = model.training, model.conv_rows
    model.eval()
    try:
        state = model.initial_state(_probe(model))
        backbone, heads = [], []
        for t in range(1, model.num_steps + 1):
            state, flops = _count(lambda: model.step(t, state, None))
            backbone.append(flops)
            heads.append(_count(lambda: model.readout(t, state, None))[1])
    finally:
        model.train(was_training)
        model.conv_rows = rows
    return FlopTable(tuple(backbone), tuple(heads))


def step_flops(model: VGGEarlyExit) -> list[int]:
    """Per-sample FLOPs of step t = 1..T: its conv layers plus its own readout head."""
    return flop_table(model).steps


def exit_flops(model: VGGEarlyExit) -> list[int]:
    """Per-sample FLOPs of exiting at t = 1..T (conv layers and heads of steps 1..t)."""
    return flop_table(model).exits


@torch.no_grad()
def full_network_flops(model: VGGEarlyExit) -> int:
    """Per-sample FLOPs of :meth:`VGGEarlyExit.forward`: every conv and the classifier, no IC."""
    was_training, rows = model.training, model.conv_rows
    model.eval()
    try:
        x = _probe(model)
        return _count(lambda: model(x))[1]
    finally:
        model.train(was_training)
        model.conv_rows = rows
