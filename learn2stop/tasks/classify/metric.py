"""Early-exit recognition's metric and losses: accuracy per image, the 0/1 error of Stage II's oracle, the
consistency risk that calibration certifies, and the accuracy lead of the stop model over the network alone."""
from __future__ import annotations

from torch import Tensor

from ...core import Metric


def accuracy() -> Metric:
    """Accuracy in %, from each image's right (1) or wrong (0) top-1 class."""
    return Metric("accuracy (%)", lambda logits, y: (logits.argmax(1) == y).float(), lower_is_better=False,
                  aggregate=lambda v, ex: 100 * v.double().mean())


def error_loss(logits: Tensor, target: Tensor) -> Tensor:
    """The 0/1 error per image, (B,): the loss of Stage II's oracle when ``stop_loss = "error"``."""
    return (logits.argmax(1) != target).to(logits.dtype)


def consistency_losses(trace) -> tuple[Tensor, tuple[float, float]]:
    """Wrong where full depth is right (CALM's consistency form), in [0, 1]: epsilon is in accuracy fraction.

    trace: a :class:`~learn2stop.core.trace.Trace` whose ``metric`` (N, T) is each image's accuracy at each exit.
    """
    return (trace.metric[:, -1:] - trace.metric).clamp_min(0), (0.0, 1.0)


def accuracy_lead(stop, base) -> float:
    """The accuracy lead (fraction) at full depth of the stop model's trace over the baseline's. Not the mean of
    the clamped :func:`consistency_losses`, which counts only the images the stop model gets right and the
    baseline wrong; a risk <= this lead bounds the deployed accuracy below by the baseline's."""
    return float((stop.metric[:, -1] - base.metric[:, -1]).double().mean())
