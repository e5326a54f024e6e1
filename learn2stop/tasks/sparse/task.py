"""Sparse recovery as a training task: fresh problems every batch, fixed validation and test sets."""
from __future__ import annotations

import torch
from torch import Tensor

from .problem import ProblemConfig, SparseBatch, fixed_set, make_matrix, sample_problems


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
