"""The depth planner's numpy copy, for the price rule's plans of small batches at inference.

The price rule's plans of a small batch (:func:`~learn2stop.core.fastpath.numpy_eligible`) run in numpy: a plan in
torch is some 25 small operations, each paying its dispatch, which at batch 1 costs more than the arithmetic
(``benchmarks/sparse_planner_cost.py`` times both forms side by side).
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor, nn

from ...core.fastpath import NUMPY_ACTIVATIONS
from ...runtime.rules import priced_argmax

#: the planner's activation, ReLU: at equal or better quality than ELU on the quick frontier, and on a 2-core CPU
#: 6 µs against ELU's 89 µs for a (1000, 64) batch (a plan a quarter cheaper)
_relu_np = NUMPY_ACTIVATIONS["relu"]


def _state_norms_np(y: np.ndarray, x: np.ndarray, previous: np.ndarray | None = None) -> np.ndarray:
    """:func:`.policy._state_norms` in numpy: the same statistics in the same order, (B, 4) or (B, 6) float32. A
    single row takes scalar arithmetic: 5.6 µs on the quick problem against 16.5 for the array form."""
    if x.shape[0] == 1:
        xa, ya = x[0], y[0]
        size = math.sqrt(float(xa @ xa))
        cols = [float(np.abs(xa).sum()), size, math.sqrt(float(ya @ ya))]
        if previous is not None:
            d = xa - previous[0]
            move = math.sqrt(float(d @ d))
            cols += [move, move / (size + 1e-6)]
        return np.array([[*(math.log(c + 1e-6) for c in cols), np.count_nonzero(xa) / xa.shape[0]]], dtype=np.float32)
    size = np.sqrt(np.einsum("ij,ij->i", x, x))
    cols = [np.abs(x).sum(axis=1), size, np.sqrt(np.einsum("ij,ij->i", y, y))]
    if previous is not None:
        d = x - previous
        move = np.sqrt(np.einsum("ij,ij->i", d, d))
        cols += [move, move / (size + np.float32(1e-6))]
    logs = np.log(np.stack(cols, axis=1) + np.float32(1e-6))
    support = np.count_nonzero(x, axis=1).astype(np.float32) / np.float32(x.shape[1])
    return np.concatenate([logs, support[:, None]], axis=1)


class _NumpyHead:
    """A frozen numpy copy of a planner head (its standardisation folded into the first layer) that gives the
    price rule's stop steps, argmax_{u >= t} logit(u) - price * u / T (the argmax of log q_phi, which differs
    from the logits by a constant per row); the last layer's columns of steps t..T are kept per t."""

    def __init__(self, norm: nn.BatchNorm1d, net: nn.Sequential):
        lins = [layer for layer in net if isinstance(layer, nn.Linear)]
        weights = [layer.weight.detach().double().t() for layer in lins]
        biases = [layer.bias.detach().double() for layer in lins]
        # (f - mean) / std @ W + b = f @ (W / std) + (b - mean / std @ W)
        inv = (norm.running_var.detach().double() + norm.eps).rsqrt()
        biases[0] = biases[0] - (norm.running_mean.detach().double() * inv) @ weights[0]
        weights[0] = weights[0] * inv[:, None]
        self.layers = [(w.float().numpy().copy(), b.float().numpy().copy()) for w, b in zip(weights, biases)]
        self.act = _relu_np
        self.T = self.layers[-1][1].shape[0]
        self._last: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def stop_steps(self, f: np.ndarray, t: int, threshold: float) -> Tensor:
        last = self._last.get(t)
        if last is None:
            w, b = self.layers[-1]
            last = self._last[t] = (w[:, t - 1:].copy(), b[t - 1:].copy())
        h = f
        for w, b in self.layers[:-1]:
            h = self.act(h @ w + b)
        z = h @ last[0] + last[1]  # the logits of steps t..T
        if not np.isfinite(z.sum()):
            raise ValueError(f"the planning policy returned NaN or inf log q_phi at step {t}")
        z -= z.max(axis=1, keepdims=True)  # <= 0, as log q: the largest price (never stop early) cannot overflow
        return torch.from_numpy(priced_argmax(z, t, self.T, threshold))
