"""Per-token exit rules for the language model, and the per-exit signals they threshold.

Every rule has the interface of :func:`~.models.score_with_exits` and :func:`~.generate.generate`:
``rule(t, logits, h, h_prev) -> bool mask`` with logits (..., V) at exit t, h (..., C) the hidden state there and
h_prev the one at the exit before (the embedding at t = 1). A rule stops a token when its signal is >= its threshold
``lam`` (the form Learn-then-Test calibrates, :func:`~learn2stop.core.risk_control.calibrate_risk`):

- ``margin``: CALM's softmax response, top-1 minus top-2 probability;
- ``saturation``: CALM's hidden-state saturation, cos(h, h_prev);
- ``policy``: the learned policy's stop probability (:mod:`.policy`);
- ``fixed``: the step index t itself (a threshold k stops every token at exit k);
- ``full``: never before the last exit.
The last two stop every token at one step whatever it reads: they say which (``depth``, :func:`fixed_depth`), and
scoring and generation then run that many steps as a plain truncated model, asking nothing at the exits before.
The oracle (each token's best exit given its label) is not a rule of this form: it needs the labels, so it is a
bound, scored with a known exit per position (:func:`planned_rule`).

Every rule here is an :class:`ExitRule`: the decision and what scoring and generation need to know of it, declared
(``reads_logits``, ``depth``). A rule that does not read the logits (saturation, fixed, full, planned, and a policy
that reads the hidden state alone) gets None for them, and generation then runs the exit's readout (final norm and
LM head) only for the tokens that stop there. A plain function given as a rule is taken as one that reads the logits
and decides per token (:func:`as_exit_rule`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

RULES = ("policy", "margin", "saturation", "fixed", "full")


@dataclass(frozen=True)
class ExitRule:
    """A per-token exit rule: ``decide(t, logits, h, h_prev) -> bool mask`` (stop now), and what running it needs.

    ``reads_logits``: whether ``decide`` reads the exit's logits (if not it gets None, and the readout runs only
    where tokens stop); ``depth``: the step by which it stops every token whatever it reads (inf: never early; None:
    it decides per token), so that a model cut there runs instead and nothing is asked."""

    decide: Callable[[int, Tensor | None, Tensor, Tensor], Tensor]
    name: str = "custom"
    lam: float = math.nan
    reads_logits: bool = True
    depth: float | None = None

    def __call__(self, t: int, logits: Tensor | None, h: Tensor, h_prev: Tensor) -> Tensor:
        return self.decide(t, logits, h, h_prev)


def as_exit_rule(rule) -> ExitRule | None:
    """``rule`` as an :class:`ExitRule`: None (no rule) and an ExitRule as given, a plain function
    ``(t, logits, h, h_prev) -> bool mask`` as one that reads the logits and decides per token."""
    if rule is None or isinstance(rule, ExitRule):
        return rule
    if callable(rule):
        return ExitRule(rule)
    raise TypeError(f"exit_rule must be None, an ExitRule or a function (t, logits, h, h_prev) -> bool mask; "
                    f"got {type(rule).__name__}")


def softmax_margin(logits: Tensor) -> Tensor:
    """Top-1 minus top-2 probability of logits (..., V): (...,) in [0, 1]."""
    top = logits.float().softmax(-1).topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def saturation(h: Tensor, h_prev: Tensor) -> Tensor:
    """cos(h, h_prev) of hidden states (..., C): (...,) in [-1, 1]."""
    return F.cosine_similarity(h.float(), h_prev.float(), dim=-1)


def signal_of(name: str, t: int, logits: Tensor, h: Tensor, h_prev: Tensor) -> Tensor:
    """The (...,) signal of the fixed rule ``name`` at exit t (stop when >= its threshold); the policy's is its
    stop probability (:func:`make_rule`)."""
    if name == "margin":
        return softmax_margin(logits)
    if name == "saturation":
        return saturation(h, h_prev)
    if name == "fixed":
        return h.new_full(h.shape[:-1], float(t))
    if name == "full":
        return h.new_full(h.shape[:-1], -math.inf)
    raise ValueError(f"rule must be one of {', '.join(RULES)}; got {name!r}")


def make_rule(name: str, lam: float, policy=None) -> ExitRule:
    """The exit rule ``name`` at threshold ``lam`` (inf: full depth)."""
    if name not in RULES:
        raise ValueError(f"rule must be one of {', '.join(RULES)}; got {name!r}")
    if not isinstance(lam, (int, float)) or math.isnan(lam):
        raise ValueError(f"rule {name!r}: the threshold must be a number; got {lam!r}")
    if name == "policy" and policy is None:
        raise ValueError("rule 'policy' needs a trained policy (the run has no Stage II checkpoint?)")

    if name == "policy":  # the policy's weights taken once, not looked up at every exit of every token
        stop_probability = policy.stop_probability_fn()

        def decide(t: int, logits: Tensor, h: Tensor, h_prev: Tensor) -> Tensor:
            return stop_probability(t, logits, h, h_prev) >= lam
    else:
        def decide(t: int, logits: Tensor, h: Tensor, h_prev: Tensor) -> Tensor:
            return signal_of(name, t, logits, h, h_prev) >= lam

    depth = None  # decides per token
    if name == "full" or (name == "fixed" and lam == math.inf):
        depth = math.inf
    elif name == "fixed":
        depth = 1 if lam <= 1 else math.ceil(lam)
    return ExitRule(decide, name, float(lam), name == "margin" or (name == "policy" and policy.reads_logits), depth)


def planned_rule(exits: Tensor) -> ExitRule:
    """The rule that stops each position at its given 1-based exit, exits (B, T) (the oracle's bound)."""
    return ExitRule(lambda t, logits, h, h_prev: exits == t, "planned", reads_logits=False)


def fixed_depth(rule, num_steps: int) -> int | None:
    """The step by which ``rule`` has stopped every token whatever it reads (``num_steps`` for no rule or one that
    never stops early), None for a rule that decides per token (:attr:`ExitRule.depth`)."""
    rule = as_exit_rule(rule)
    if rule is None:
        return num_steps
    return None if rule.depth is None else int(min(rule.depth, num_steps))


def reads_logits(rule) -> bool:
    """Whether an exit rule reads the exit's logits (:attr:`ExitRule.reads_logits`; a plain function does)."""
    rule = as_exit_rule(rule)
    return rule is None or rule.reads_logits
