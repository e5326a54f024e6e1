"""MAML's per-example losses and metrics, masked means over padded tasks, and the confidence interval."""
from __future__ import annotations

import math

from torch import Tensor
from torch.nn import functional as F


def per_example_loss(out: Tensor, y: Tensor, kind: str) -> Tensor:
    """Cross-entropy (y: class ids) or squared error summed over outputs (y: targets); shape (n,)."""
    if kind == "cross_entropy":
        return F.cross_entropy(out, y, reduction="none")
    return ((out - y) ** 2).sum(dim=-1)


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    return (values * mask).sum(dim=-1) / mask.sum(dim=-1).clamp_min(1)


def query_loss(output: dict, target: Tensor, kind: str) -> Tensor:
    """Mean query loss per task (cross-entropy or squared error): output["pred"] (B, Q, out) -> (B,)."""
    pred = output["pred"]
    per = per_example_loss(pred.flatten(0, 1), target.flatten(0, 1), kind)
    return per.view(pred.shape[0], -1).mean(dim=1)


def query_metric(output: dict, target: Tensor, kind: str) -> Tensor:
    """Per task: the fraction of query examples classified right (cross_entropy), or the query MSE; (B,)."""
    pred = output["pred"]
    if kind == "cross_entropy":
        return (pred.argmax(dim=-1) == target).float().mean(dim=1)
    return ((pred - target) ** 2).sum(dim=-1).mean(dim=1)


def confidence_interval(values: Tensor) -> tuple[float, float]:
    """Mean and 95% half-width 1.96 * std / sqrt(n) (the paper's evaluation over 600 tasks)."""
    v = values.double()
    n = v.numel()
    half = 1.96 * float(v.std(unbiased=True)) / math.sqrt(n) if n > 1 else float("nan")
    return float(v.mean()), half
