"""The inference setting: which stop rule, with which parameter, a trained model stops by.

One :class:`InferenceConfig` decides how a trained model stops, everywhere: validation during training, evaluation,
the frontier, benchmarks, the CLI and the Python API; :func:`active_rule` puts a run's calibrated rule
(:mod:`learn2stop.core.calibration_file`) in its place where there is one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..runtime.registry import get_rule, list_rules
from ..utils.config import one_of, require
from .calibration_file import Calibration, check_param
from .loop import Rollout
from .policy_signals import PolicyRule, sampled_stop_times
from .protocols import PolicySteps
from .rules import first_crossing
from .signal_registry import SIGNALS, make_signal


def policy_rules(policy) -> tuple[str, ...]:
    """The policy rules (the registry's ``offered_by="policy"``) a policy supports: all of them for a planning
    policy, those that do not plan for a per-step one, and the planning ones alone for one that plans twice
    (``replan_step``)."""
    steps = PolicySteps.of(policy)
    plans = steps.plan is not None
    if steps.replan is not None:
        return tuple(list_rules(offered_by="policy", plans=True))
    return tuple(list_rules(offered_by="policy") if plans else list_rules(offered_by="policy", plans=False))


@dataclass
class InferenceConfig:
    """How a trained stopping model stops at test time."""

    rule: str = "quantile"
    """``quantile`` (stop once q_phi's CDF reaches ``param`` = alpha), ``threshold`` (stop when pi_t >= ``param``), a
    classical rule (``tolerance``, ``confidence``, ``entropy``, ``patience``), or ``fixed`` (every sample stops at
    step ``param``)."""
    param: float = 0.5
    """the rule's parameter."""
    sampled: bool = False
    """stop with probability pi_t instead (the paper's stochastic q_phi); ignores rule/param."""
    use_calibrated: bool = True
    """use ``calibration.json`` of the run directory when it exists."""
    serve_batch: int = 1
    """the batch size the model is served at: ``reproduce`` deploys the rule that is fastest at it among those
    certified to keep the baseline's quality, timed on this machine."""

    def __post_init__(self):
        one_of(self.rule, list(SIGNALS), "inference.rule")
        require(isinstance(self.param, (int, float)) and not isinstance(self.param, bool) and math.isfinite(self.param),
                "inference.param", f"must be a finite number; got {self.param!r}")
        check_param(self.rule, self.param, "inference.param")
        for name, value in (("sampled", self.sampled), ("use_calibrated", self.use_calibrated)):
            require(isinstance(value, bool), f"inference.{name}", f"must be true or false; got {value!r}")
        require(isinstance(self.serve_batch, int) and not isinstance(self.serve_batch, bool) and self.serve_batch >= 1,
                "inference.serve_batch", f"must be an integer >= 1; got {self.serve_batch!r}")

    @property
    def uses_policy(self) -> bool:
        return self.sampled or get_rule(self.rule).needs_policy

    def signal(self, policy=None, key=None):
        return make_signal(self.rule, policy, key)

    def make_rule(self, policy=None, generator: torch.Generator | None = None, key=None):
        """The online stop rule for :func:`~learn2stop.core.loop.run_with_early_exit`."""
        if self.sampled:
            if policy is None:
                raise ValueError("sampled inference needs a stopping policy, but the model has none")
            return PolicyRule(policy, mode="sample", generator=generator)
        signal = self.signal(policy, key)
        return signal.rule(signal.from_param(self.param))

    def stop_times(self, rollout: Rollout, generator: torch.Generator | None = None) -> Tensor:
        """Stop times of this rule read off a full rollout's stop logits (policy rules only)."""
        if not self.uses_policy:
            raise ValueError(f"stop times of the {self.rule!r} rule need the outputs; use signal_trace")
        if rollout.stop_logits is None:
            raise ValueError("this rule needs a policy's stop logits; the rollout has none")
        if rollout.replan_log_q is not None and (self.sampled or not get_rule(self.rule).plans):
            raise ValueError(f"the rollout's policy plans twice; its second plan is read by the price rule, not "
                             f"{'sampled inference' if self.sampled else f'the {self.rule} rule'}")
        if self.sampled:
            return sampled_stop_times(rollout.stop_logits, generator)
        scores = policy_scores(rollout.stop_logits, self.rule)
        if rollout.replan_log_q is not None:
            scores = SIGNALS[self.rule].revise(scores, rollout.replan_log_q, rollout.replan_step)
        return first_crossing(scores, SIGNALS[self.rule].from_param(self.param))


def policy_scores(stop_logits: Tensor, rule: str) -> Tensor:
    """The (B, T-1) scores of a policy rule from stop logits, as its signal computes them online:
    pi_t, for the quantile rule -log prod_{s<=t} (1 - pi_s) (see :class:`QuantileSignal`), for the price
    rule minus the least price that stops by t (:class:`PriceSignal`)."""
    if rule not in SIGNALS or not get_rule(rule).needs_policy:
        raise ValueError(f"not a policy rule: {rule!r}")
    return SIGNALS[rule].scores(stop_logits)


def active_rule(inference: InferenceConfig, calibration: Calibration | None = None, policy=None, key=None,
                generator: torch.Generator | None = None) -> tuple[Any, str]:
    """The rule a command uses: ``calibration`` (a run's, already loaded and checked) if given, else ``inference``'s.

    Returns (rule, description).
    """
    if not isinstance(inference, InferenceConfig):
        raise TypeError(f"inference: expected an InferenceConfig (e.g. InferenceConfig(rule='quantile', param=0.5)); "
                        f"got {inference!r}")
    if calibration is not None:
        c = calibration
        return c.make_rule(policy, key), f"calibrated {c.rule} rule ({c.target}), {c.rule} parameter {c.param:.4g}"
    desc = "sampled policy" if inference.sampled else f"{inference.rule} rule, parameter {inference.param:g}"
    return inference.make_rule(policy, generator, key), desc
