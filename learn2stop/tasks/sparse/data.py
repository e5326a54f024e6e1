"""The sparse recovery data of Sec. 5.1 / App. B.1: y = A x* + noise, x* sparse; fresh problems every training
batch, fixed validation and test sets.

A (m x n) has iid N(0, 1/m) entries and unit-norm columns (the paper's text); the official code
additionally re-conditions it to condition number 5 (``matrix="cond5"``). Signals are
Bernoulli(p) x N(0, 1); each sample's noise has std = std(A x*) * 10^(-SNR/20) with SNR drawn
from the configured levels. All randomness comes from explicit generators, so a seed fixes A
and the test set.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .config import ProblemConfig


def make_matrix(cfg: ProblemConfig) -> Tensor:
    """The fixed, seeded measurement matrix A, shape (m, n), unit-norm columns."""
    g = torch.Generator().manual_seed(cfg.matrix_seed)
    A = torch.randn(cfg.m, cfg.n, generator=g, dtype=torch.float64) / cfg.m ** 0.5
    if cfg.matrix == "cond5":
        # Replace the singular values by a log-spaced profile 1 -> 1/kappa (the release's re-conditioning).
        U, S, Vh = torch.linalg.svd(A, full_matrices=False)
        k = S.numel()
        profile = torch.logspace(0, -torch.log10(torch.tensor(cfg.condition_number, dtype=torch.float64)).item(), k, dtype=torch.float64)
        A = U @ torch.diag(profile * S[0]) @ Vh
    A = A / A.norm(dim=0, keepdim=True)
    return A.float()


@dataclass
class SparseBatch:
    """Measurements, ground truth and the SNR of each sample."""

    y: Tensor  # (B, m)
    x: Tensor  # (B, n)
    snr: Tensor  # (B,)

    def to(self, device) -> "SparseBatch":
        return SparseBatch(self.y.to(device), self.x.to(device), self.snr.to(device))

    def __len__(self) -> int:
        return self.y.shape[0]

    def select(self, idx) -> "SparseBatch":
        return SparseBatch(self.y[idx], self.x[idx], self.snr[idx])


def sample_problems(A: Tensor, cfg: ProblemConfig, batch_size: int, generator: torch.Generator,
                    snr: float | None = None) -> SparseBatch:
    """Draw ``batch_size`` problems; SNR uniform over ``cfg.snrs`` unless one is given."""
    m, n = A.shape
    support = torch.rand(batch_size, n, generator=generator) < cfg.sparsity
    x = torch.randn(batch_size, n, generator=generator) * support
    clean = x @ A.T  # (B, m)
    if snr is None:
        levels = torch.tensor(cfg.snrs, dtype=torch.float32)
        snrs = levels[torch.randint(len(cfg.snrs), (batch_size,), generator=generator)]
    else:
        snrs = torch.full((batch_size,), float(snr))
    std = clean.std(dim=1, keepdim=True) * 10 ** (-snrs[:, None] / 20)
    y = clean + std * torch.randn(batch_size, m, generator=generator)
    return SparseBatch(y, x, snrs)


def fixed_set(A: Tensor, cfg: ProblemConfig, per_snr: int, seed: int) -> SparseBatch:
    """A fixed set with ``per_snr`` samples at each SNR level, in SNR blocks (the test protocol)."""
    g = torch.Generator().manual_seed(seed)
    parts = [sample_problems(A, cfg, per_snr, g, snr=s) for s in cfg.snrs]
    return SparseBatch(torch.cat([p.y for p in parts]), torch.cat([p.x for p in parts]), torch.cat([p.snr for p in parts]))


def check_measurements(y: Tensor, A: Tensor) -> None:
    """Clear errors for measurements that do not fit A (NaN/inf are refused by the loop, for every model)."""
    if y.dim() != 2:
        raise ValueError(f"measurements y must have shape (B, m); got shape {tuple(y.shape)}")
    if y.shape[1] != A.shape[0]:
        raise ValueError(f"measurements have {y.shape[1]} entries but A has {A.shape[0]} rows (A is {A.shape[0]}x{A.shape[1]})")


class SparseRecoveryTask:
    """Supplies batches and the per-sample loss ||x_t - x*||^2 to :class:`~learn2stop.StagedTrainer`.

    Args:
        cfg: the problem's sizes and noise.
        val_chunk: validation batch size (bounded memory).
    """

    def __init__(self, cfg: ProblemConfig, val_chunk: int = 1500):
        self.cfg = cfg
        self.A = make_matrix(cfg)
        self.val = fixed_set(self.A, cfg, cfg.val_per_snr, cfg.val_seed)
        self.val_chunk = val_chunk
        self._test: SparseBatch | None = None

    @property
    def test(self) -> SparseBatch:
        """The fixed test set: ``test_per_snr`` samples per SNR level, seeded (App. B.1)."""
        if self._test is None:
            self._test = fixed_set(self.A, self.cfg, self.cfg.test_per_snr, self.cfg.test_seed)
        return self._test

    @staticmethod
    def loss_fn(output: Tensor, target: Tensor) -> Tensor:
        """Squared error per sample, ||x_t - x*||^2; shape (B,)."""
        return (output - target).pow(2).sum(dim=1)

    def sample_batch(self, batch_size: int, generator: torch.Generator, device) -> tuple[Tensor, Tensor]:
        b = sample_problems(self.A, self.cfg, batch_size, generator)
        return b.y.to(device), b.x.to(device)

    def validation_batches(self, device):
        for i in range(0, len(self.val), self.val_chunk):
            chunk = self.val.select(slice(i, i + self.val_chunk))
            yield chunk.y.to(device), chunk.x.to(device)
