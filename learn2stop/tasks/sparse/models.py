"""LISTA (learned, untied per-layer weights) and the classical ISTA / FISTA, all as step-wise models.

One step is one iteration; the readout is the current estimate x_t (B, n). Because ISTA and
FISTA fill the same protocol, a fixed depth, a tolerance rule or a learned policy can drive any
of them through the same loop.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .data import check_measurements


def soft_threshold(v: Tensor, theta: Tensor | float) -> Tensor:
    """eta_theta(v) = sign(v) * max(|v| - theta, 0), the proximal map of theta * ||.||_1."""
    return torch.sign(v) * torch.relu(v.abs() - theta)


def smooth_soft_threshold(v: Tensor, theta: Tensor | float, k: float = 5.0) -> Tensor:
    """tanh(k v / 2) * relu(|v| - theta): the release's smoothed shrinkage (differentiable at 0)."""
    return torch.tanh(k * v / 2) * torch.relu(v.abs() - theta)


class LISTA(nn.Module):
    """x_t = eta_{lambda_t}(W_b^t y + W_x^t x_{t-1}), t = 1..T, x_0 = 0 (paper Eq. 10).

    Untied per-layer W_x (n x n), W_b (n x m) and scalar thresholds, initialised from ISTA:
    W_x = I - A^T A / L, W_b = A^T / L, lambda = rho / L (REFERENCE: L = 3, rho = 0.1).

    Args:
        A: (m, n) measurement matrix (kept as a buffer for checks and policies).
        num_steps: T.
        L, rho: the ISTA step size and l1 weight of the initialisation.
        shrinkage: "soft" (textbook) or "smooth" (release).
    """

    outputs_are_logits = False  # a sparse code, not class logits (protocols.MODEL_MEMBERS)

    def __init__(self, A: Tensor, num_steps: int = 20, L: float = 3.0, rho: float = 0.1, shrinkage: str = "soft"):
        super().__init__()
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1; got {num_steps}")
        if shrinkage not in ("soft", "smooth"):
            raise ValueError(f"shrinkage must be 'soft' or 'smooth'; got {shrinkage!r}")
        m, n = A.shape
        self.num_steps = num_steps
        self.shrinkage = shrinkage
        self.register_buffer("A", A.clone())
        eye = torch.eye(n, dtype=A.dtype)
        # Each layer owns its tensors: clone, so no two thresholds share storage (a pitfall of the release).
        self.W_x = nn.Parameter((eye - A.T @ A / L).unsqueeze(0).repeat(num_steps, 1, 1).clone())  # (T, n, n)
        self.W_b = nn.Parameter((A.T / L).unsqueeze(0).repeat(num_steps, 1, 1).clone())  # (T, n, m)
        self.theta = nn.Parameter(torch.full((num_steps,), rho / L, dtype=A.dtype))

    def _shrink(self, v: Tensor, t: int) -> Tensor:
        th = self.theta[t - 1]
        return soft_threshold(v, th) if self.shrinkage == "soft" else smooth_soft_threshold(v, th)

    def initial_state(self, y: Tensor) -> Tensor:
        check_measurements(y, self.A)
        return y.new_zeros(y.shape[0], self.A.shape[1])

    def step(self, t: int, x: Tensor, y: Tensor) -> Tensor:
        v = y @ self.W_b[t - 1].T  # (B, n)
        if t > 1:  # x_0 = 0: the first layer needs no W_x product
            v = v + x @ self.W_x[t - 1].T
        return self._shrink(v, t)

    def readout(self, t: int, x: Tensor, y: Tensor) -> Tensor:
        return x


class ISTA(nn.Module):
    """x_t = eta_{rho/L}(x_{t-1} + A^T (y - A x_{t-1}) / L), x_0 = 0; no learned parameters.

    ``L`` and ``rho`` are numbers, or (B, 1) tensors giving each sample its own values, which
    lets a grid search run as one batched full-depth unroll.
    """

    outputs_are_logits = False  # a sparse code, not class logits (protocols.MODEL_MEMBERS)

    def __init__(self, A: Tensor, num_steps: int, L: float | Tensor, rho: float | Tensor):
        super().__init__()
        if bool((torch.as_tensor(L) <= 0).any()) or bool((torch.as_tensor(rho) < 0).any()):
            raise ValueError(f"{type(self).__name__} needs L > 0 and rho >= 0; got L={L}, rho={rho}")
        self.num_steps = num_steps
        self.L = L if isinstance(L, Tensor) else float(L)
        self.rho = rho if isinstance(rho, Tensor) else float(rho)
        self.register_buffer("A", A.clone())

    def initial_state(self, y: Tensor) -> Tensor:
        check_measurements(y, self.A)
        return y.new_zeros(y.shape[0], self.A.shape[1])

    def step(self, t: int, x: Tensor, y: Tensor) -> Tensor:
        grad = (x @ self.A.T - y) @ self.A  # (B, n) gradient of 1/2 ||y - A x||^2
        return soft_threshold(x - grad / self.L, self.rho / self.L)

    def readout(self, t: int, x: Tensor, y: Tensor) -> Tensor:
        return x


class FISTA(ISTA):
    """FISTA (Beck & Teboulle 2009): ISTA steps at an extrapolated point with Nesterov momentum.

    State is (x_t, z_t, s_t): the iterate, the extrapolated point and the momentum scalar per
    sample; the readout is the extrapolated point z_t, as in the release (REFERENCE).
    """

    def initial_state(self, y: Tensor):
        x = super().initial_state(y)
        return {"x": x, "z": x, "s": y.new_ones(y.shape[0])}

    def step(self, t: int, state, y: Tensor):
        z = state["z"]
        x_new = soft_threshold(z - ((z @ self.A.T - y) @ self.A) / self.L, self.rho / self.L)
        s = state["s"]
        s_new = (1 + torch.sqrt(1 + 4 * s * s)) / 2
        z_new = x_new + ((s - 1) / s_new)[:, None] * (x_new - state["x"])
        return {"x": x_new, "z": z_new, "s": s_new}

    def readout(self, t: int, state, y: Tensor) -> Tensor:
        return state["z"]
