"""Stopping policies for sparse recovery: pi_phi(y, x_t, t) -> stop logit, or a plan of the depth.

:class:`SparseDepthPlanner` (default): asked once per sample, at its ``plan_step``, it predicts the whole
stop-time distribution q_phi(t | y, x_s) over the remaining steps from a few statistics that reveal the
noise level and how far the iteration is from converging (the norms of the state and the support). One
call per sample instead of one per step, and the loop then runs the batch sorted by planned depth. With
``replan_step`` it plans once more, at that later step, for the samples still running: from the size of the
last move (the tolerance test's signal) and a few norms, all without a product with A.

:class:`SparseStopPolicy` asks at every step, with two feature sets over one shared MLP:

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
from torch.nn import functional as F

from ...core.policies import MinStep


def support_size(x: Tensor, absolute: Tensor | None = None) -> Tensor:
    """(B,) the number of nonzeros of each row, as x's dtype: the same count as ``count_nonzero`` or the 0-norm (an
    integer, exact in float below 2^24), as sign(|x|) summed. ``absolute``: |x|, where the caller has it (one pass
    fewer). Why this form: on a (1000, 250) batch on one thread it was the fastest measured, ahead of |sign(x)|
    summed, x.bool() summed and ``count_nonzero`` (several times slower)."""
    return torch.sign(x.abs() if absolute is None else absolute).sum(dim=1)


class SparseStopPolicy(MinStep, nn.Module):
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

    def extract(self, y: Tensor, x: Tensor, t: int) -> Tensor:
        """The feature vector of each sample at step t; shape (B, in_dim)."""
        if self.features == "full":
            pos = torch.tensor([math.sin(t / self.num_steps), math.cos(t / self.num_steps)], device=y.device, dtype=y.dtype)
            return torch.cat([y, y - x @ self.A.T, x, pos.expand(y.shape[0], 2)], dim=1)
        eps = 1e-6
        sy = y @ self.S.T  # (B, k)
        sr = sy - x @ self.SA.T  # (B, k) sketched residual
        ny, nr = sy.norm(dim=1, keepdim=True), sr.norm(dim=1, keepdim=True)
        absolute = x.abs()
        l1 = absolute.sum(dim=1, keepdim=True)
        support = support_size(x, absolute).unsqueeze(1) / x.shape[1]
        logs = torch.log(torch.cat([ny, nr, l1], dim=1) + eps)  # log ||Sy||, log ||S r||, log ||x_t||_1
        return torch.cat([sy / (ny + eps), sr / (nr + eps), logs, support], dim=1)

    def forward(self, y: Tensor, x: Tensor, t: int) -> Tensor:
        h = self.first(self.extract(y, x, t)) + self.step_bias[t - 1]
        return self.rest(h).squeeze(1)


def _mlp(width: int, hidden: tuple[int, ...], out: int) -> nn.Sequential:
    layers = []
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    return nn.Sequential(*layers, nn.Linear(width, out))


def _state_norms(y: Tensor, x: Tensor, previous: Tensor | None = None) -> Tensor:
    """(B, 4) log ||x||_1, log ||x||_2, log ||y|| and the support fraction of x (the first plan's ``norms``); with
    ``previous``, (B, 6): the last move's log size and log size relative to ||x|| before the support (the second
    plan's). No product with A."""
    norm = torch.linalg.vector_norm
    size, absolute = norm(x, dim=1), x.abs()  # |x| read twice: the l1 norm and the support
    cols = [absolute.sum(dim=1), size, norm(y, dim=1)]
    if previous is not None:
        move = norm(x - previous, dim=1)
        cols += [move, move / (size + 1e-6)]
    logs = torch.stack(cols, dim=1).add(1e-6).log()
    return torch.cat([logs, (support_size(x, absolute) / x.shape[1])[:, None]], dim=1)


def _head(h: Tensor, norm: nn.BatchNorm1d, net: nn.Sequential, training: bool) -> Tensor:
    """A ReLU MLP on features standardised by ``norm``. Training: the module (batch statistics, and it gathers
    them); inference: the gathered ones. The layers run functionally (no module calls on the hot path)."""
    h = norm(h) if training else F.batch_norm(h, norm.running_mean, norm.running_var, eps=norm.eps)
    for layer in net:
        h = F.linear(h, layer.weight, layer.bias) if isinstance(layer, nn.Linear) else F.relu(h)
    return h


class SparseDepthPlanner(MinStep, nn.Module):
    """q_phi(t | y, x_s) for t = 1..T from the state at step s = ``plan_step``: a planning policy.

    Its inputs, computed once per sample: four statistics with no product with A: log ||x_s||_1, log ||x_s||_2, the
    support fraction of x_s (from the shrinkage the step just did) and log ||y||, standardised by the statistics of
    the training batches. A few reductions over x_s, a small fraction of a LISTA step, where statistics of the
    residual y - A x_s and the gradient A^T r would cost two products with A: they plan about as well.

    Returns the (B, T-1) stop logits of steps 1..T-1 that induce the planned q_phi
    (:func:`~learn2stop.core.distributions.stop_logits_from_distribution`), so every Stage II loss and
    every policy rule applies unchanged.

    With ``replan=True`` a second head can plan again, at ``replan_step`` s2 (set, like ``min_step``, from the
    validation oracle before Stage II, and kept in the checkpoint; None: one plan), the samples still running
    (:meth:`replan_log_q`): what the tolerance rule learns from the steps after the plan, and a single plan
    cannot see (on the quick problem: from behind the tolerance rule at 70-90 % of the steps to ahead of it).

    Args:
        A: (m, n) measurement matrix (only its shape is read: the plan reads no product with A).
        num_steps: T.
        hidden: widths of the ReLU MLPs.
        replan: give it the second head.
    """

    in_dim = 4
    replan_dim = 6

    def __init__(self, A: Tensor, num_steps: int, hidden: tuple[int, ...] = (64, 64), replan: bool = False):
        super().__init__()
        self.num_steps = num_steps
        self.min_step = 1
        self.replan_step: int | None = None
        # the norms are standardised by the training batches' statistics, as the second head's inputs (below); by a
        # moving average, since Stage III and AEVB train the first plan while theta moves
        self.plan_norm = nn.BatchNorm1d(self.in_dim, affine=False, momentum=0.01)
        self.net = _mlp(self.in_dim, hidden, num_steps)
        # the second head: steps s2..T from the state at s2. Its inputs are standardised by the statistics of the
        # training batches (theta is frozen in Stage II, so they do not drift); without it the second plan fits worse.
        self.replan_norm = nn.BatchNorm1d(self.replan_dim, affine=False, momentum=None) if replan else None
        self.replan_net = _mlp(self.replan_dim, hidden, num_steps) if replan else None  # read from s2 on

    @property
    def plan_step(self) -> int:
        """The step at which the depth is planned (``min_step``: the oracle never stops before it)."""
        return self.min_step

    def extract(self, y: Tensor, x: Tensor) -> Tensor:
        """The (B, 4) raw features of the state x = x_s (see the class text). Written in few operations: at batch 1
        each costs its dispatch (a few microseconds), and this runs once per sample on the inference path."""
        return _state_norms(y, x)

    def plan_log_q(self, y: Tensor, x: Tensor, t: int) -> Tensor:
        """The planned (B, T) log q_phi (the price rule reads it directly); the MLP run functionally (no
        module calls on the hot path)."""
        return torch.log_softmax(_head(self.extract(y, x), self.plan_norm, self.net, self.training), dim=1)

    def forward(self, y: Tensor, x: Tensor, t: int) -> Tensor:
        from ...core.distributions import stop_logits_from_distribution

        return stop_logits_from_distribution(self.plan_log_q(y, x, t))

    def extract_late(self, y: Tensor, x: Tensor, previous: Tensor) -> Tensor:
        """The (B, 6) features of the second plan, none of them a product with A: log ||x||_1, log ||x||_2, the
        support fraction, log ||y||, and the last move's log size and log size relative to ||x||."""
        return _state_norms(y, x, previous)

    def replan_log_q(self, y: Tensor, x: Tensor, previous: Tensor, t: int) -> Tensor:
        """The second plan's (B, T) log q_phi of steps t..T (``replan_step``; earlier entries are never read)
        from the state at t and the one before it."""
        if self.replan_net is None or self.replan_step is None or t != self.replan_step:
            raise ValueError(f"this planner plans again only at its replan_step ({self.replan_step}); asked at step {t}")
        # logits of steps 1..T; the loop renormalises them on t..T
        return _head(self.extract_late(y, x, previous), self.replan_norm, self.replan_net, self.training)

    def get_extra_state(self) -> dict:
        return {**super().get_extra_state(), "replan_step": self.replan_step}

    def set_extra_state(self, state: dict) -> None:
        super().set_extra_state(state)
        again = state["replan_step"]
        if again is not None and self.replan_net is None:
            raise ValueError(f"the checkpoint plans again at step {again}, and this planner has no second head "
                             "(build it with replan=True: policy.replan_mass > 0)")
        self.replan_step = again
