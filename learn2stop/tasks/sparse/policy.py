"""Stopping policies for sparse recovery: pi_phi(y, x_t, t) -> stop logit.

Two feature sets, one shared MLP over steps:

- ``"full"``: the release's input [y, y - A x_t, x_t, position] (m + m + n + 2 dims) into a
  MLP (256-128-16 in the ``release`` preset). Its first layer alone costs about as much as a LISTA
  layer, at every step.
- ``"sketch"`` (default): cheap statistics of the same quantities. A fixed random sketch S
  (k x m, k << m) gives S y and the sketched residual S y - (S A) x_t (Johnson-Lindenstrauss:
  their norms track ||y|| and ||y - A x_t||, which reveal the noise level); add log-norms, the
  l1 norm and support size of x_t; the step enters as a learned per-step bias of the first layer.
  Cost per step: k * n for (S A) x_t,
  about k/(m + n) of a LISTA layer.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class SparseStopPolicy(nn.Module):
    """pi_phi for LISTA-stop; see the module docstring for the two feature sets.

    Args:
        A: (m, n) measurement matrix.
        num_steps: T of the predictive model.
        features: "sketch" or "full".
        sketch_dim: k, rows of the random sketch.
        hidden: widths of the MLP's hidden layers.
        seed: seed of the sketch matrix.
    """

    def __init__(self, A: Tensor, num_steps: int, features: str = "sketch", sketch_dim: int = 32,
                 hidden: tuple[int, ...] = (64, 64), seed: int = 0):
        super().__init__()
        if features not in ("sketch", "full"):
            raise ValueError(f"features must be 'sketch' or 'full'; got {features!r}")
        m, n = A.shape
        self.features, self.num_steps = features, num_steps
        self.min_step = 1
        self.register_buffer("A", A.clone())
        if features == "sketch":
            g = torch.Generator().manual_seed(seed)
            S = torch.randn(sketch_dim, m, generator=g) / math.sqrt(sketch_dim)
            self.register_buffer("S", S)
            self.register_buffer("SA", S @ A)  # (k, n): sketched residual at k*n cost per step
            in_dim = 2 * sketch_dim + 4
        else:
            in_dim = 2 * m + n + 2
        widths = [in_dim, *hidden]
        self.first = nn.Linear(in_dim, widths[1]) if hidden else nn.Linear(in_dim, 1)
        # The step enters as a learned per-step bias of the first layer: the same function class as a
        # one-hot step input, without building and multiplying a (B, T) one-hot matrix at every call.
        self.step_bias = nn.Parameter(torch.zeros(num_steps, self.first.out_features))
        layers = []
        for a, b in zip(widths[1:], widths[2:]):
            layers += [nn.ELU(), nn.Linear(a, b)]
        if hidden:
            layers += [nn.ELU(), nn.Linear(widths[-1], 1)]
        self.rest = nn.Sequential(*layers)

    def get_extra_state(self) -> dict:
        return {"min_step": int(self.min_step)}

    def set_extra_state(self, state: dict) -> None:
        self.min_step = int(state["min_step"])

    def extract(self, y: Tensor, x: Tensor, t: int) -> Tensor:
        """The feature vector of each sample at step t; shape (B, in_dim)."""
        if self.features == "full":
            pos = torch.tensor([math.sin(t / self.num_steps), math.cos(t / self.num_steps)], device=y.device, dtype=y.dtype)
            return torch.cat([y, y - x @ self.A.T, x, pos.expand(y.shape[0], 2)], dim=1)
        eps = 1e-6
        sy = y @ self.S.T  # (B, k)
        sr = sy - x @ self.SA.T  # (B, k) sketched residual
        ny, nr = sy.norm(dim=1, keepdim=True), sr.norm(dim=1, keepdim=True)
        l1 = x.abs().sum(dim=1, keepdim=True)
        support = torch.count_nonzero(x, dim=1).unsqueeze(1).to(x.dtype) / x.shape[1]
        logs = torch.log(torch.cat([ny, nr, l1], dim=1) + eps)  # log ||Sy||, log ||S r||, log ||x_t||_1
        return torch.cat([sy / (ny + eps), sr / (nr + eps), logs, support], dim=1)

    def forward(self, y: Tensor, x: Tensor, t: int) -> Tensor:
        h = self.first(self.extract(y, x, t)) + self.step_bias[t - 1]
        return self.rest(h).squeeze(1)
