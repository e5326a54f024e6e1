"""MAML's metric and losses: per-example losses, masked means over padded tasks, the query metric the core reports
(query MSE or accuracy), the risk range of calibration, and the confidence interval of the report."""
from __future__ import annotations

import math

from torch import Tensor
from torch.nn import functional as F

from ...core import Metric


def loss_kind(cfg) -> str:
    """The task's loss (cfg: a MAMLConfig): squared error for sinusoid regression, else cross-entropy."""
    return "mse" if cfg.data.source == "sinusoid" else "cross_entropy"



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


def task_metric(cfg) -> Metric:
    """What the core reports per task (cfg: a MAMLConfig): query MSE (lower is better) or accuracy in %."""
    kind = loss_kind(cfg)
    per_task = lambda output, target: query_metric(output, target, kind)
    if kind == "mse":
        return Metric("query MSE", per_task, lower_is_better=True)
    return Metric("accuracy (%)", per_task, lower_is_better=False, aggregate=lambda v, ex: 100 * v.double().mean())


def risk_range(cfg) -> tuple[float, float] | None:
    """The range of the risk losses calibration certifies: none for squared error (unbounded), [-1, 1] for accuracy
    (differences of fractions)."""
    return None if loss_kind(cfg) == "mse" else (-1.0, 1.0)  # accuracy: fractions, bounded
