"""The sparse recovery problem of Sec. 5.1 / App. B.1: y = A x* + noise, x* sparse.

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

from ...utils.config import ints_at_least, one_of, positive, require


@dataclass
class ProblemConfig:
    """Sizes and noise of the problem; defaults are the paper's (m=250, n=500, p=0.1, SNR 20/30/40)."""

    m: int = 250
    """Measurements: rows of the matrix A."""
    n: int = 500
    """Signal length: columns of A."""
    sparsity: float = 0.1
    """Share of non-zero entries of each signal (Bernoulli-Gaussian), in (0, 1]."""
    snrs: tuple[float, ...] = (20.0, 30.0, 40.0)
    """Noise levels in dB of the training mix and of the test sets, one test set each."""
    matrix: str = "gaussian"
    """gaussian (i.i.d., unit-norm columns) or cond5 (its singular values re-spread to condition_number)."""
    condition_number: float = 5.0
    """With matrix cond5: the condition number of A, >= 1."""
    matrix_seed: int = 0
    """Seed of A."""
    test_per_snr: int = 1000
    """Test problems per noise level."""
    test_seed: int = 1
    """Seed of the test sets."""
    val_per_snr: int = 500
    """Validation problems per noise level (selection and calibration)."""
    val_seed: int = 2
    """Seed of the validation sets."""

    def __post_init__(self):
        ints_at_least(self, "m", "n", "test_per_snr", "val_per_snr")
        require(0 < self.sparsity <= 1, "sparsity", f"must be in (0, 1]; got {self.sparsity}")
        require(len(self.snrs) >= 1, "snrs", "needs at least one SNR level")
        one_of(self.matrix, ("gaussian", "cond5"), "matrix")
        positive(self.condition_number, "condition_number")
        require(self.condition_number >= 1, "condition_number", f"must be >= 1; got {self.condition_number}")


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


def check_measurements(y: Tensor, A: Tensor) -> None:
    """Clear errors for measurements that do not fit A (NaN/inf are refused by the loop, for every model)."""
    if y.dim() != 2:
        raise ValueError(f"measurements y must have shape (B, m); got shape {tuple(y.shape)}")
    if y.shape[1] != A.shape[0]:
        raise ValueError(f"measurements have {y.shape[1]} entries but A has {A.shape[0]} rows (A is {A.shape[0]}x{A.shape[1]})")
