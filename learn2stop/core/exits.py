"""Early exits attached to any network: a classifier becomes a step-wise model with internal classifiers.

:func:`attach_exits` takes a network whose output is (batch, classes) logits and the names of the
modules after which an exit goes (or the network as a list of blocks). It traces the network once
with ``torch.fx``, cuts its forward into segments at those modules, runs one example input to give
each exit an SDN-style head of the right width (Kaya et al. 2019: mixed max/avg pooling to 4x4, then
a linear layer), and counts the FLOPs of every segment and head with
``torch.utils.flop_counter.FlopCounterMode``. The result is an :class:`ExitNetwork`: step t runs
segment t, ``readout(t)`` is exit t's logits (the network's own output at t = T), and ``exit_costs``
are the cumulative FLOPs of exiting at t, so :class:`~learn2stop.core.model.StoppingModel`, the stages,
calibration and the frontier use it as they are.

    >>> import torch
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
    ...                     nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    >>> exits = attach_exits(net, after=["1", "3"], example_input=torch.zeros(1, 3, 16, 16))
    >>> exits.num_steps, len(exits.exit_costs)
    (3, 3)

Only what runs between two exits is computed at a step, so an image that stops at exit t costs the
first t segments and the heads it passed, never the rest.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .flops import FlopTable, count_flops
from .graph_cut import Block, cut_forward


#: SDN places its internal classifiers where the cumulative cost first reaches these fractions of the network's FLOPs.
SDN_FRACTIONS = (0.15, 0.30, 0.45, 0.60, 0.75, 0.90)


class ExitHead(nn.Module):
    """SDN's internal classifier: mixed max/avg pooling to ``pool_size``^2, flatten, one linear layer.

    mix = sigmoid(alpha) * maxpool + (1 - sigmoid(alpha)) * avgpool, alpha a learnable scalar (starts
    at 0: an even mix). A feature map no larger than ``pool_size`` is not pooled (the head then has no
    alpha); features (B, D) go straight to the linear layer.

    Args:
        shape: the incoming features' shape without the batch: (C, H, W) or (D,).
        num_classes: logits out.
        pool_size: side of the pooled map (SDN: 4).
    """

    def __init__(self, shape: Sequence[int], num_classes: int, pool_size: int = 4):
        super().__init__()
        shape = tuple(int(s) for s in shape)
        if len(shape) not in (1, 3):
            raise ValueError(f"an exit head reads (B, C, H, W) feature maps or (B, D) features; got (B, {shape})")
        self.pool_size = pool_size
        self.pools = len(shape) == 3 and max(shape[1:]) > pool_size
        if len(shape) == 3:
            c, h, w = shape
            features = c * (pool_size * pool_size if self.pools else h * w)
        else:
            features = shape[0]
        self.alpha = nn.Parameter(torch.zeros(())) if self.pools else None
        self.linear = nn.Linear(features, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        if self.pools:
            mix = torch.sigmoid(self.alpha)
            x = mix * F.adaptive_max_pool2d(x, self.pool_size) + (1 - mix) * F.adaptive_avg_pool2d(x, self.pool_size)
        return self.linear(x.flatten(1))  # (B, num_classes)


# ----------------------------------------------------------------------------- the step-wise model


class ExitNetwork(nn.Module):
    """A network cut into segments with an exit head after each but the last; a step-wise model.

    Build it with :func:`attach_exits`. Step t runs segment t; ``readout(t)`` is exit t's logits
    (B, num_classes), at t = T the network's own output. ``forward`` is the network alone.

    Attributes:
        backbone: the wrapped network (its weights are the model's; nothing is copied).
        heads: the exit heads, one per cut.
        after: the exit points, in forward order.
        flops: :class:`FlopTable`, per-sample FLOPs of every segment and head.
        exit_costs: cumulative FLOPs of exiting at t = 1..T (the price's and the frontier's cost).
        fixed_exit_costs: FLOPs of stopping at t with no rule reading the earlier exits (a fixed depth).
        network_flops: FLOPs of the network alone (= the sum of the segments').
        rows_computed: samples times segments computed since the last reset (early exit skips rows).
    """

    outputs_are_logits = True  # every exit reads out class logits (protocols.MODEL_MEMBERS)

    def __init__(self, backbone: nn.Module, segments: list, after: list[str], heads: nn.ModuleList,
                 input_shape: tuple[int, ...], input_dtype: torch.dtype, num_classes: int):
        super().__init__()
        self.backbone, self.heads = backbone, heads
        self._segments, self.after = segments, list(after)
        self.num_steps = len(segments)
        self.num_classes, self.input_shape, self.input_dtype = num_classes, tuple(input_shape), input_dtype
        self.rows_computed = 0
        self.flops = FlopTable((), ())
        self.exit_costs: list[int] = []
        self.fixed_exit_costs: list[int] = []
        self.network_flops = 0

    # ------------------------------------------------------------------ step-wise protocol
    def initial_state(self, inputs: Tensor) -> Tensor:
        """Check the inputs against the example input's shape (without the batch); they are x_0."""
        if not isinstance(inputs, Tensor) or tuple(inputs.shape[1:]) != self.input_shape or inputs.dim() < 1:
            got = tuple(inputs.shape) if isinstance(inputs, Tensor) else type(inputs).__name__
            raise ValueError(f"{type(self.backbone).__name__} with exits expects inputs (B, "
                             f"{', '.join(map(str, self.input_shape))}) like its example_input; got {got}")
        if inputs.is_floating_point() != self.input_dtype.is_floating_point:
            raise ValueError(f"{type(self.backbone).__name__} with exits expects {self.input_dtype} inputs like its "
                             f"example_input; got {inputs.dtype}")
        return inputs

    def step(self, t: int, state: Tensor, inputs: Any = None) -> Tensor:
        """Segment t of the network: (B, ...) features at cut t-1 -> features at cut t (logits at T)."""
        out = self._segments[t - 1](self.backbone, state)
        self.rows_computed += state.shape[0]
        return out

    def readout(self, t: int, state: Tensor, inputs: Any = None) -> Tensor:
        """Logits (B, num_classes) of exit t; at t = T the network's own output."""
        return self.heads[t - 1](state) if t < self.num_steps else state

    def forward(self, x: Tensor) -> Tensor:
        """The network alone (no exit head): (B, num_classes)."""
        return self.backbone(x)

    def __deepcopy__(self, memo: dict) -> "ExitNetwork":
        """A copy with its own weights; the segments (which nodes to run, not weights) are shared."""
        memo[id(self._segments)] = self._segments
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            new.__dict__[k] = copy.deepcopy(v, memo)
        return new

    def extra_repr(self) -> str:
        return f"exits after {self.after}, {self.num_classes} classes, {self.network_flops / 1e6:.2f} MFLOPs"


def _restore_modes(module: nn.Module) -> Callable[[], None]:
    modes = [(m, m.training) for m in module.modules()]
    return lambda: [m.train(mode) for m, mode in modes]


def attach_exits(backbone: nn.Module | None = None, after: Sequence[str] | None = None, *,
                 blocks: Sequence[nn.Module] | None = None, example_input: Tensor, num_classes: int | None = None,
                 pool_size: int = 4) -> ExitNetwork:
    """Turn a classifier into a step-wise model with SDN-style exits after the named modules.

    Args:
        backbone: the network; its output must be (batch, classes) logits.
        after: names of the modules (as in ``backbone.named_modules()``) after which an exit goes, e.g.
            ``["layer1", "layer2.0"]``; any order (kept in forward order). The network is traced with
            torch.fx and cut after each: no skip connection may cross a cut.
        blocks: instead of ``backbone`` and ``after``: the network as blocks run one after the other (no
            tracing); an exit goes after every block but the last, whose output is the logits.
        example_input: one batch (B, ...) of the inputs the network takes, e.g. ``torch.zeros(1, 3, 32, 32)``;
            it is run once (eval mode, no gradients) to size the heads and count FLOPs per sample.
        num_classes: the classes the output must have (default: whatever the network outputs).
        pool_size: side of the heads' pooled map (SDN: 4).

    Returns:
        :class:`ExitNetwork` (on the backbone's device and dtype), with ``exit_costs`` in FLOPs.

    Raises:
        ValueError: a module that does not exist, an exit after the last layer, two exits at one point, a
            cut crossed by a skip connection, an output that is not (batch, classes), or an example input
            the network cannot take; the message names the module or argument.
    """
    if blocks is not None:
        if backbone is not None or after is not None:
            raise ValueError("attach_exits: give either backbone and after, or blocks, not both")
        blocks = list(blocks)
        if len(blocks) < 2 or not all(isinstance(b, nn.Module) for b in blocks):
            raise ValueError(f"blocks: at least two nn.Modules (an exit goes after every block but the last); "
                             f"got {[type(b).__name__ for b in blocks]}")
        backbone = nn.Sequential(*blocks)
        after = [str(i) for i in range(len(blocks) - 1)]
        segments: list = [Block(i) for i in range(len(blocks))]
    else:
        if not isinstance(backbone, nn.Module):
            raise TypeError(f"backbone: an nn.Module; got {type(backbone).__name__}")
        if after is None:
            raise ValueError("after: name the modules to put an exit after (or pass blocks=[...])")
        after, segments = cut_forward(backbone, after)
    net = type(backbone).__name__
    if not isinstance(example_input, Tensor) or example_input.dim() < 1 or example_input.shape[0] < 1:
        raise ValueError(f"example_input: one batch of inputs (B, ...) as a tensor, e.g. torch.zeros(1, 3, 32, 32); "
                         f"got {tuple(example_input.shape) if isinstance(example_input, Tensor) else type(example_input).__name__}")
    if not isinstance(pool_size, int) or isinstance(pool_size, bool) or pool_size < 1:
        raise ValueError(f"pool_size: an integer >= 1; got {pool_size!r}")
    x = example_input[:1]
    restore = _restore_modes(backbone)
    backbone.eval()
    try:
        with torch.no_grad():
            try:
                out, network_flops = count_flops(lambda: backbone(x))
            except Exception as e:
                raise ValueError(f"example_input of shape {tuple(example_input.shape)} does not run through {net} "
                                 f"({type(e).__name__}: {e})") from None
            if not isinstance(out, Tensor) or out.dim() != 2 or out.shape[0] != 1:
                got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
                raise ValueError(f"{net}'s output must be (batch, classes) logits; for an example batch of 1 it is {got}")
            if num_classes is not None and out.shape[1] != num_classes:
                raise ValueError(f"num_classes is {num_classes} but {net} outputs {out.shape[1]} classes")
            num_classes = int(out.shape[1])
            cut_states, seg_flops, state = [], [], x
            for k, seg in enumerate(segments):
                state, f = count_flops(lambda: seg(backbone, state))
                seg_flops.append(f)
                if k < len(segments) - 1:
                    if not isinstance(state, Tensor) or state.dim() not in (2, 4):
                        got = tuple(state.shape) if isinstance(state, Tensor) else type(state).__name__
                        raise ValueError(f"after: the output of {after[k]!r} is {got}; an exit head reads "
                                         f"(B, C, H, W) feature maps or (B, D) features")
                    cut_states.append(state)
            p = next(backbone.parameters(), None)
            kw = {"device": p.device, "dtype": p.dtype} if p is not None else {}
            heads = nn.ModuleList(ExitHead(s.shape[1:], num_classes, pool_size).to(**kw) for s in cut_states)
            model = ExitNetwork(backbone, segments, after, heads, tuple(example_input.shape[1:]), example_input.dtype,
                                num_classes)
            head_flops = [count_flops(lambda: head(s.to(**kw)))[1] for head, s in zip(heads, cut_states)]
    finally:
        restore()
    heads.train(backbone.training)
    model.flops = FlopTable(tuple(seg_flops), tuple(head_flops) + (0,))
    model.exit_costs = model.flops.exits
    model.fixed_exit_costs = model.flops.fixed
    model.network_flops = network_flops
    return model


def sdn_exit_points(backbone: nn.Module, candidates: Sequence[str], example_input: Tensor,
                    fractions: Sequence[float] = SDN_FRACTIONS) -> list[str]:
    """SDN's placement: among ``candidates`` (module names, e.g. every block), those whose cumulative FLOPs
    are nearest each fraction of the network's FLOPs; coinciding picks are kept once, in forward order.

    For VGG16-BN this gives its conv layers 2, 4, 6, 7, 9, 10 (SDN: "15, 30, 45, 60, 75, 90 percent of GFLOPs").
    """
    order, segments = cut_forward(backbone, candidates)
    restore = _restore_modes(backbone)
    backbone.eval()
    try:
        with torch.no_grad():
            state, cum, run = example_input[:1], [], 0
            for seg in segments:
                state, f = count_flops(lambda: seg(backbone, state))
                run += f
                cum.append(run)
    finally:
        restore()
    total = cum[-1]
    picks = {min(range(len(order)), key=lambda i: abs(cum[i] / total - frac)) for frac in fractions}
    return [order[i] for i in sorted(picks)]
