"""Sparse recovery's metric: NMSE in dB (App. B.1, a ratio of sums over the set), overall and per SNR level,
and the risk losses that calibration bounds."""
from __future__ import annotations

import torch
from torch import Tensor

from ...core import Metric
from ...core.trace import Trace
from .data import SparseBatch, SparseRecoveryTask


def db_ratio(errors: Tensor, energy: Tensor) -> Tensor:
    """10 log10(errors / energy): the one NMSE formula (App. B.1, a ratio of sums), elementwise."""
    return 10 * torch.log10(errors / energy)


def nmse_db(estimate: Tensor, truth: Tensor) -> float:
    """NMSE in dB = 10 log10( sum_i ||x_hat_i - x_i||^2 / sum_i ||x_i||^2 ) (App. B.1, ratio of sums)."""
    if estimate.shape != truth.shape:
        raise ValueError(f"estimate shape {tuple(estimate.shape)} does not match truth shape {tuple(truth.shape)}")
    return float(db_ratio((estimate - truth).pow(2).sum(), truth.pow(2).sum()))


def nmse_from_errors(errors: Tensor, batch: SparseBatch) -> dict[str, float]:
    """NMSE (dB) over the whole set ('mixed') and per SNR level, from per-sample squared errors (N,)."""
    out = {"mixed": float(db_ratio(errors.sum(), batch.x.pow(2).sum()))}
    for s in batch.snr.unique().tolist():
        m = batch.snr == s
        out[f"{s:g}"] = float(db_ratio(errors[m].sum(), batch.x[m].pow(2).sum()))
    return out


def nmse_by_snr(estimate: Tensor, batch: SparseBatch) -> dict[str, float]:
    """NMSE (dB) over the whole set ('mixed') and per SNR level."""
    if estimate.shape != batch.x.shape:
        raise ValueError(f"estimate shape {tuple(estimate.shape)} does not match truth shape {tuple(batch.x.shape)}")
    return nmse_from_errors((estimate - batch.x).pow(2).flatten(1).sum(1), batch)


def nmse_metric() -> Metric:
    """The task's :class:`~learn2stop.core.Metric`: per-sample squared errors, aggregated as NMSE (dB) over a set
    (the ``energy`` extra, :func:`energy_extras`, is each sample's ||x*||^2)."""
    return Metric("NMSE (dB)", SparseRecoveryTask.loss_fn, lower_is_better=True,
                  aggregate=lambda v, ex: db_ratio(v.double().sum(), ex["energy"].double().sum()))


def energy_extras(y: Tensor, x: Tensor) -> dict[str, Tensor]:
    """Each sample's signal energy ||x*||^2 (B,), the denominator of the NMSE, kept beside a trace."""
    return {"energy": x.pow(2).sum(dim=1)}


def excess_nmse(trace: Trace) -> tuple[Tensor, None]:
    """Excess squared error over full depth, per unit of mean signal energy (NMSE in linear units)."""
    scale = trace.extras["energy"].double().mean().float()
    return (trace.metric - trace.metric[:, -1:]) / scale, None
