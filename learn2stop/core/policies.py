"""Default stopping policies for the common cases, in the shape the loop calls: ``policy(inputs, output, t) -> (B,)``.

- :class:`ExitPolicy`: for early exits of a classifier (:func:`~learn2stop.core.exits.attach_exits`): a small MLP on
  an exit's class probabilities (sorted top-k, normalised entropy, margin, max logit), the step a learned per-step
  bias of its first layer; a learned, step-aware generalisation of the confidence and entropy rules, at a few
  hundred FLOPs per image.
- :class:`StepMLPPolicy`: the same per-step MLP over features you choose, ``features(inputs, output) -> (B, F)``:
  :func:`logit_signals` (the heuristics' confidence, entropy and margin of a classifier's logits),
  :func:`output_signals` (the log-norm of a regression output and of the inputs), or your own.

Both read only what the step already computed. A policy is called with the step's output, not the previous one:
the change since the last step is what the tolerance rule (``ToleranceSignal``) reads. A planning policy (one call
predicting every step's stop, ``plan_step``) is :class:`~learn2stop.core.planner.PlanMLPPolicy`.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..utils.registry import Registry
from .trees import tree_leaves

#: the library's ready policies, by name (``create_policy``, ``list_policies``); a user's own policy needs no entry
POLICIES: Registry[type] = Registry("policy")


def _logits_of(output: Any) -> Tensor:
    """The (B, K) logits of an output (a tensor, or a tree whose first leaf they are)."""
    logits = output if isinstance(output, Tensor) else tree_leaves(output)[0]
    if logits.dim() != 2:
        raise ValueError(f"a classifier's output must be (batch, classes) logits; got shape {tuple(logits.shape)}")
    return logits


def logit_signals(inputs: Any, output: Any) -> Tensor:
    """(B, 3) the classical exit heuristics of a classifier's logits, as features: the max softmax probability
    (the confidence rule's signal), the entropy normalised by log K (the entropy rule's) and the margin between the
    two most likely classes. Detached: the policy learns from them, not through them."""
    logits = _logits_of(output).detach().float()
    logp = torch.log_softmax(logits, dim=1)
    p = logp.exp()
    top = p.topk(min(2, p.shape[1]), dim=1).values  # (B, 2), descending
    entropy = -(p * logp).sum(1, keepdim=True) / math.log(max(p.shape[1], 2))
    margin = top[:, :1] - (top[:, 1:2] if top.shape[1] > 1 else 0)
    return torch.cat([top[:, :1], entropy, margin], dim=1)


def output_signals(inputs: Any, output: Any) -> Tensor:
    """(B, 2) the log-norms of a regression output and of the inputs (each flattened per sample), detached."""
    out = tree_leaves(output)[0].detach().float().flatten(1)
    x = tree_leaves(inputs)[0].detach().float().flatten(1)
    return torch.stack([out.norm(dim=1).add(1e-6).log(), x.norm(dim=1).add(1e-6).log()], dim=1)


@POLICIES.register("step_mlp")
class StepMLPPolicy(nn.Module):
    """pi_t from ``features(inputs, output)``: an MLP whose first layer has a learned bias per step, so the policy
    reads t (a stop the same features call for at step 2 and at step 9 need not be the same).

    Args:
        num_steps: T of the step-wise model.
        num_features: F, the width of what ``features`` returns.
        features: ``(inputs, output) -> (B, F)``; default :func:`logit_signals` (F = 3).
        hidden: the MLP's width.
        min_step: the first step the policy is asked at (the loop does not call it before).

    Example:
        >>> policy = StepMLPPolicy(model.num_steps, 3)                   # a classifier's exits  # doctest: +SKIP
        >>> policy = StepMLPPolicy(T, 2 * d, features=lambda y, x: torch.cat([y, x], 1))        # doctest: +SKIP
    """

    def __init__(self, num_steps: int, num_features: int = 3, features: Callable[[Any, Any], Tensor] = logit_signals,
                 hidden: int = 16, min_step: int = 1):
        super().__init__()
        for name, v in (("num_steps", num_steps), ("num_features", num_features), ("hidden", hidden),
                        ("min_step", min_step)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {v!r}")
        if not callable(features):
            raise TypeError(f"features must be a function (inputs, output) -> (B, F); got {type(features).__name__}")
        self.num_steps, self.num_features, self.features, self.min_step = num_steps, num_features, features, min_step
        self.first = nn.Linear(num_features, hidden)
        self.step_bias = nn.Parameter(torch.zeros(num_steps, hidden))  # (T, hidden): the step index, learned
        self.out = nn.Linear(hidden, 1)

    def forward(self, inputs: Any, output: Any, t: int) -> Tensor:
        f = self.features(inputs, output)
        if f.dim() != 2 or f.shape[1] != self.num_features:
            raise ValueError(f"features returned shape {tuple(f.shape)}; this policy was built for "
                             f"(batch, {self.num_features}) (num_features)")
        h = F.elu(self.first(f.to(self.first.weight.dtype)) + self.step_bias[t - 1])  # (B, hidden)
        return self.out(h).squeeze(1)  # (B,) stop logits


@POLICIES.register("exit")
class ExitPolicy(nn.Module):
    """pi_t from IC t's logits.

    Args:
        num_classes: K. num_steps: T of the network. top_k: sorted probabilities read. hidden: MLP width.
    """

    def __init__(self, num_classes: int, num_steps: int, top_k: int = 3, hidden: int = 32):
        super().__init__()
        self.num_classes, self.num_steps, self.top_k = num_classes, num_steps, min(top_k, num_classes)
        self.first = nn.Linear(self.top_k + 3, hidden)
        self.step_bias = nn.Parameter(torch.zeros(num_steps, hidden))
        self.rest = nn.Sequential(nn.ELU(), nn.Linear(hidden, 1))  # (a Sequential: the checkpoints' keys)
        self._log_k = math.log(num_classes)

    def features(self, logits: Tensor) -> Tensor:
        logits = logits.detach().float()
        logp = torch.log_softmax(logits, dim=1)
        p = logp.exp()
        top = p.topk(self.top_k, dim=1).values  # (B, k), descending
        ent = (p * logp).sum(1, keepdim=True).div_(-self._log_k)
        margin = top[:, :1] - (top[:, 1:2] if self.top_k > 1 else 0)
        return torch.cat([top, ent, margin, logits.amax(1, keepdim=True).div_(10)], dim=1)  # (B, k + 3)

    def forward(self, inputs: Tensor, logits: Tensor, t: int) -> Tensor:
        # functional, in the modules' order of operations (bit-identical to calling them): asked at every exit, its
        # cost at batch 1 is call overhead
        out = self.rest[1]
        h = F.elu(F.linear(self.features(logits), self.first.weight, self.first.bias) + self.step_bias[t - 1])
        return F.linear(h, out.weight, out.bias).squeeze(1)


class MinStep:
    """Mixin for a policy module asked only from its ``min_step`` (see :func:`~learn2stop.core.train.oracle_min_step`), which its
    checkpoint keeps: ``class MyPolicy(MinStep, nn.Module)``."""

    min_step: int = 1

    def get_extra_state(self) -> dict:
        return {"min_step": int(self.min_step)}

    def set_extra_state(self, state: dict) -> None:
        self.min_step = int(state["min_step"])


def create_policy(name: str, **kwargs: Any) -> nn.Module:
    """A ready policy by name (:func:`list_policies`), built with ``kwargs``: ``create_policy("exit", num_classes=10,
    num_steps=T)`` is ``ExitPolicy(num_classes=10, num_steps=T)``."""
    return POLICIES.get(name)(**kwargs)


def list_policies() -> list[str]:
    """The names of the ready policies: ``step_mlp`` (:class:`StepMLPPolicy`), ``exit`` (:class:`ExitPolicy`),
    ``plan_mlp`` (:class:`~learn2stop.core.planner.PlanMLPPolicy`)."""
    return POLICIES.names()
