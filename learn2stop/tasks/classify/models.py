"""The networks of early-exit recognition (paper Sec. 5.4; SDN, Kaya et al. 2019), exits attached by one helper.

Each architecture is a plain classifier (``forward(x) -> (B, classes)``) plus the list of points where an
internal classifier may go; :func:`build_network` attaches SDN-style exits with
:func:`learn2stop.core.exits.attach_exits`, the same helper a user calls on their own network:

- VGG with batch norm (``vgg16``, the paper's; narrower variants): conv3x3-BN-ReLU layers, a 2x2
  max-pool after the layers marked 'M', then VGG's three fully connected layers; an exit may follow
  any conv layer but the last.
- CIFAR ResNets (He et al. 2016; ``resnet20``, ``resnet56``): a 3x3 stem, three stages of basic blocks
  (16, 32, 64 channels), global average pooling, one linear layer; an exit may follow any block but the
  last.
- ResNet-18 for 64x64 inputs (``resnet18``, Tiny-ImageNet): a 3x3 stride-1 stem (no max-pool), four
  stages of two basic blocks (64-512 channels).

Exit points default to SDN's FLOP-based placement (:func:`learn2stop.core.exits.sdn_exit_points`: the
candidates nearest 15, 30, ..., 90 % of the network's FLOPs); FLOPs are counted by
``torch.utils.flop_counter.FlopCounterMode`` (a multiply-add counts 2; pooling, BN and ReLU are not counted).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, Union

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ...core.exits import ExitNetwork, attach_exits, sdn_exit_points
from ...utils.registry import Registry

Width = Union[int, str]  # a conv width, or "M" for a 2x2 max-pool after the previous conv


def _check_ints(**values) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1; got {value!r}")


def initialise(net: nn.Module) -> None:
    """Fresh weights from torch's global generator: every layer's default, then :func:`_init_convs`."""
    for m in net.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    _init_convs(net)


def _init_convs(net: nn.Module) -> None:
    """Kaiming (fan-out) convs as VGG/ResNet, BN at identity; linear layers keep torch's default."""
    for m in net.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


# ----------------------------------------------------------------------------- VGG
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


class VGG(nn.Module):
    """VGG with batch norm: ``features`` (one block per conv layer) then ``classifier``.

    Args:
        widths: conv widths and 'M' (2x2 max-pool after the previous conv), as classic VGG cfgs.
        num_classes: classes. input_size: side of the square input. in_channels: image channels.
        fc_width: width of the two hidden fully connected layers (SDN CIFAR: 512); 0 = one linear
            layer on the flattened last feature map instead (the exits' form).
        dropout: dropout probability before each fully connected layer after the first (before the one, for 0).

    Example:
        >>> VGG([8, "M", 16], num_classes=10, input_size=32, fc_width=16)(torch.zeros(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """

    def __init__(self, widths: Sequence[Width], num_classes: int, input_size: int = 32, fc_width: int = 512,
                 dropout: float = 0.5, in_channels: int = 3):
        super().__init__()
        _check_ints(num_classes=num_classes, input_size=input_size, in_channels=in_channels)
        if not isinstance(fc_width, int) or fc_width < 0:
            raise ValueError(f"fc_width must be an integer >= 0; got {fc_width!r}")
        if not 0 <= dropout < 1:
            raise ValueError(f"dropout must be in [0, 1); got {dropout}")
        layers = conv_layer_sizes(widths, input_size, in_channels)
        pools = sum(p for *_, p in layers)
        final_size = input_size // 2 ** pools
        if final_size < 1:
            raise ValueError(f"input_size {input_size} is too small for {pools} 2x2 max-pools")
        blocks = []
        for cin, cout, _, pooled in layers:
            block = [nn.Conv2d(cin, cout, 3, padding=1, bias=False),  # BN's shift makes a conv bias redundant
                     nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
            if pooled:
                block.append(nn.MaxPool2d(2))
            blocks.append(nn.Sequential(*block))
        self.features = nn.Sequential(*blocks)
        c = layers[-1][1]
        if fc_width:
            self.classifier = nn.Sequential(
                nn.Flatten(),
                nn.Linear(c * final_size * final_size, fc_width), nn.ReLU(inplace=True), nn.Dropout(dropout),
                nn.Linear(fc_width, fc_width), nn.ReLU(inplace=True), nn.Dropout(dropout),
                nn.Linear(fc_width, num_classes))
        else:  # like the exits: one linear layer on the last feature map (VGG16's is 1x1: global pooling)
            self.classifier = nn.Sequential(nn.Flatten(), nn.Dropout(dropout),
                                            nn.Linear(c * final_size * final_size, num_classes))
        _init_convs(self)

    def exit_candidates(self) -> list[str]:
        """Where an exit may go: after any conv layer but the last."""
        return [f"features.{i}" for i in range(len(self.features) - 1)]

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


# ----------------------------------------------------------------------------- ResNets
class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN plus the shortcut (1x1 conv + BN where the shape changes), then ReLU."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """A ResNet of basic blocks: 3x3 stem, stages ``layer1..layerN``, global average pooling, ``fc``.

    Args:
        blocks: basic blocks per stage. widths: channels per stage. strides: first block's stride per stage.
        num_classes: classes. in_channels: image channels.

    Example:
        >>> ResNet((1, 1), (8, 16), (1, 2), num_classes=10)(torch.zeros(2, 3, 16, 16)).shape
        torch.Size([2, 10])
    """

    def __init__(self, blocks: Sequence[int], widths: Sequence[int], strides: Sequence[int], num_classes: int,
                 in_channels: int = 3):
        super().__init__()
        _check_ints(num_classes=num_classes, in_channels=in_channels, **{f"blocks[{i}]": b for i, b in enumerate(blocks)},
                    **{f"widths[{i}]": w for i, w in enumerate(widths)})
        if not len(blocks) == len(widths) == len(strides) >= 1:
            raise ValueError(f"blocks, widths and strides need one entry per stage; got {blocks}, {widths}, {strides}")
        self.stem = nn.Sequential(nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU(inplace=True))
        cin = widths[0]
        self.stages = len(blocks)
        for i, (n, w, s) in enumerate(zip(blocks, widths, strides), 1):
            layer = [BasicBlock(cin, w, s)] + [BasicBlock(w, w) for _ in range(n - 1)]
            setattr(self, f"layer{i}", nn.Sequential(*layer))
            cin = w
        self.fc = nn.Linear(cin, num_classes)
        _init_convs(self)

    def exit_candidates(self) -> list[str]:
        """Where an exit may go: after any residual block but the last."""
        names = [f"layer{i}.{j}" for i in range(1, self.stages + 1) for j in range(len(getattr(self, f"layer{i}")))]
        return names[:-1]

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        for i in range(1, self.stages + 1):
            x = getattr(self, f"layer{i}")(x)
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))  # (B, classes)


# ----------------------------------------------------------------------------- the registry
@dataclass(frozen=True)
class Arch:
    """A named architecture: ``build(num_classes, input_size, in_channels, fc_width, dropout, width)`` -> a plain
    network with ``exit_candidates()``; ``exits``: default exit positions (1-based among the candidates), None = SDN's."""

    build: Callable[..., nn.Module]
    exits: tuple[int, ...] | None = None
    input_size: int = 32  # the size it is designed for (documentation and the CLI's check)


M = "M"
ARCHS: Registry[Arch] = Registry("architecture")


def _vgg(widths: tuple, fc: int) -> Callable[..., nn.Module]:
    def build(num_classes, input_size, in_channels, fc_width=None, dropout=0.5, width=None):
        return VGG(widths, num_classes, input_size, fc if fc_width is None else fc_width, dropout, in_channels)
    return build


def _resnet(blocks: tuple, widths: tuple, strides: tuple) -> Callable[..., nn.Module]:
    def build(num_classes, input_size, in_channels, fc_width=None, dropout=0.5, width=None):
        scaled = widths if not width else tuple(w * width // widths[0] for w in widths)
        return ResNet(blocks, scaled, strides, num_classes, in_channels)
    return build


ARCHS.register("vgg16")(Arch(_vgg(  # the paper's VGG16-BN (SDN's CIFAR variant)
    (64, 64, M, 128, 128, M, 256, 256, 256, M, 512, 512, 512, M, 512, 512, 512, M), 512)))
ARCHS.register("vgg16-quarter")(Arch(_vgg(  # same depth and exits, 1/16 of the FLOPs
    (16, 16, M, 32, 32, M, 64, 64, 64, M, 128, 128, 128, M, 128, 128, 128, M), 128)))
ARCHS.register("vgg11-half")(Arch(_vgg((32, M, 64, M, 128, 128, M, 256, 256, M, 256, 256, M), 256)))  # cfg A, half width
ARCHS.register("vgg6-narrow")(Arch(_vgg(  # the quick preset: minutes on a CPU, an exit after every conv
    (32, 32, M, 64, 64, M, 128, 128, M), 128), exits=(1, 2, 3, 4, 5)))
ARCHS.register("resnet20")(Arch(_resnet((3, 3, 3), (16, 32, 64), (1, 2, 2))))
ARCHS.register("resnet56")(Arch(_resnet((9, 9, 9), (16, 32, 64), (1, 2, 2))))
ARCHS.register("resnet18")(Arch(_resnet((2, 2, 2, 2), (64, 128, 256, 512), (1, 2, 2, 2)), input_size=64))


def list_archs() -> list[str]:
    return ARCHS.names()


def build_network(arch: str, num_classes: int, input_size: int = 32, exits: Sequence[int] | None = None, *,
                  in_channels: int = 3, fc_width: int | None = None, dropout: float = 0.5, width: int | None = None,
                  pool_size: int = 4) -> ExitNetwork:
    """The named architecture with SDN-style exits attached (:func:`~learn2stop.core.exits.attach_exits`).

    Args:
        arch: a name of :func:`list_archs`.
        exits: exit positions, 1-based among the network's candidates (VGG: conv layers; ResNet: residual
            blocks), increasing; None = the architecture's default (SDN's FLOP-based placement unless it fixes its own).
        fc_width: VGG's hidden classifier width (None = the architecture's; 0 = one linear layer on the
            flattened last feature map). dropout: VGG's classifier dropout. width: a ResNet's first-stage channels (None = its own;
            the other stages scale with it). pool_size: side of the exit heads' pooled map.

    Example:
        >>> build_network("vgg16", num_classes=10).after
        ['features.1', 'features.3', 'features.5', 'features.6', 'features.8', 'features.9']
    """
    a = ARCHS.get(arch)
    net = a.build(num_classes, input_size, in_channels, fc_width=fc_width, dropout=dropout, width=width)
    example = torch.zeros(1, in_channels, input_size, input_size)
    candidates = net.exit_candidates()
    positions = exits if exits is not None else a.exits
    if positions is None:
        after = sdn_exit_points(net, candidates, example)
    else:
        positions = tuple(int(p) for p in positions)
        if not positions or any(not 1 <= p <= len(candidates) for p in positions) or list(positions) != sorted(set(positions)):
            raise ValueError(f"exit positions must be increasing indices in 1..{len(candidates)} (the exit points of "
                             f"{arch}: {candidates[0]} .. {candidates[-1]}); got {positions}")
        after = [candidates[p - 1] for p in positions]
    return attach_exits(net, after, example_input=example, num_classes=num_classes, pool_size=pool_size)
