"""FLOP counting of a network cut into steps: what each step's segment and exit head cost per sample, and the
cumulative cost of exiting at t (the ``exit_costs`` of an :class:`~learn2stop.core.exits.ExitNetwork`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch.utils.flop_counter import FlopCounterMode


@dataclass(frozen=True)
class FlopTable:
    """Per-sample FLOPs of each step t = 1..T: its segment of the network (backbone) and its exit head.

    ``heads[-1]`` is 0: the network's own classifier is part of the last segment.
    """

    backbone: tuple[int, ...]
    heads: tuple[int, ...]

    @property
    def steps(self) -> list[int]:
        """Cost of step t alone: its segment and its own exit head."""
        return [b + h for b, h in zip(self.backbone, self.heads)]

    @property
    def exits(self) -> list[int]:
        """Cost of exiting at t: segments 1..t and the heads of steps 1..t (an image that reaches t has
        evaluated every earlier exit to decide to go on)."""
        out, run = [], 0
        for s in self.steps:
            run += s
            out.append(run)
        return out

    @property
    def fixed(self) -> list[int]:
        """Cost of stopping at t when no rule reads the earlier exits (a fixed depth): segments 1..t and
        head t alone (at T the network alone)."""
        out, run = [], 0
        for b, h in zip(self.backbone, self.heads):
            run += b
            out.append(run + h)
        return out


def count_flops(fn: Callable[[], Any]) -> tuple[Any, int]:
    """(fn(), the FLOPs it ran) under torch's FlopCounterMode (a multiply-add counts 2)."""
    with FlopCounterMode(display=False) as counter:
        out = fn()
    return out, int(counter.get_total_flops())
