"""A default planning policy: the whole stop-time distribution q_phi(t | x) predicted once per sample.

:class:`PlanMLPPolicy` is asked once, at its ``plan_step``, with the features of that step's output and returns
the (B, T-1) stop logits that induce its planned q_phi, so every Stage II loss, rule and calibrator reads it as it
reads a per-step policy; the price rule reads the plan itself (``plan_log_q``). One policy call per sample instead
of one per step: the cheap choice where the policy's own cost matters at batch 1, and where the first step already
says how hard the sample is (its scale, its noise, its first exit's confidence).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .distributions import stop_logits_from_distribution
from .policies import POLICIES, MinStep, output_signals


@POLICIES.register("plan_mlp")
class PlanMLPPolicy(MinStep, nn.Module):
    """q_phi(t | x) for t = 1..T from ``features(inputs, output)`` at step ``plan_step`` (= ``min_step``).

    The features are standardised by the statistics of the training batches (a running average, as theta may still
    move in Stage III or AEVB), then a ReLU MLP gives the plan's T logits.

    Args:
        num_steps: T of the step-wise model.
        num_features: F, the width of what ``features`` returns.
        features: ``(inputs, output) -> (B, F)``; default :func:`~learn2stop.core.policies.output_signals` (F = 2,
            the log-norms of the output and of the inputs); :func:`~learn2stop.core.policies.logit_signals` (F = 3)
            for a classifier's exits.
        hidden: widths of the MLP's hidden layers.
        plan_step: the step whose output the plan reads (the loop asks nothing before it).

    Example:
        >>> policy = PlanMLPPolicy(model.num_steps, 2)                    # a solver's first iterate  # doctest: +SKIP
    """

    def __init__(self, num_steps: int, num_features: int = 2, features: Callable[[Any, Any], Tensor] = output_signals,
                 hidden: tuple[int, ...] = (32, 32), plan_step: int = 1):
        super().__init__()
        for name, v in (("num_steps", num_steps), ("num_features", num_features), ("plan_step", plan_step)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {v!r}")
        if num_steps < 2:
            raise ValueError(f"num_steps must be at least 2 (a plan over one step has nothing to choose); got {num_steps}")
        if plan_step >= num_steps:
            raise ValueError(f"plan_step must be below num_steps ({num_steps}); got {plan_step}")
        if not callable(features):
            raise TypeError(f"features must be a function (inputs, output) -> (B, F); got {type(features).__name__}")
        self.num_steps, self.num_features, self.features = num_steps, num_features, features
        self.min_step = plan_step
        self.norm = nn.BatchNorm1d(num_features, affine=False, momentum=0.01)
        layers: list[nn.Module] = []
        width = num_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        self.net = nn.Sequential(*layers, nn.Linear(width, num_steps))

    @property
    def plan_step(self) -> int:
        """The step at which the depth is planned (``min_step``: it is never asked before)."""
        return self.min_step

    def plan_log_q(self, inputs: Any, output: Any, t: int) -> Tensor:
        """The planned (B, T) log q_phi (normalised)."""
        f = self.features(inputs, output)
        if f.dim() != 2 or f.shape[1] != self.num_features:
            raise ValueError(f"features returned shape {tuple(f.shape)}; this policy was built for "
                             f"(batch, {self.num_features}) (num_features)")
        f = f.to(self.net[0].weight.dtype)
        if self.training:
            f = self.norm(f)
        else:
            f = F.batch_norm(f, self.norm.running_mean, self.norm.running_var, eps=self.norm.eps)
        return torch.log_softmax(self.net(f), dim=1)

    def forward(self, inputs: Any, output: Any, t: int) -> Tensor:
        """The (B, T-1) stop logits of steps 1..T-1 that induce the plan (those before ``plan_step`` are never read)."""
        return stop_logits_from_distribution(self.plan_log_q(inputs, output, t))
