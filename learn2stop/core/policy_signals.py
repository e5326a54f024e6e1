"""Stop signals read off a learned stopping policy (pi_t, the quantile of q_phi, the price of a planned q_phi), the
rule that asks the policy (:class:`PolicyRule`, thresholded or sampled), and their stop times from a full rollout's
logits."""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..runtime.registry import get_rule
from .policy_calls import planned_log_q, planned_logits, policy_logits, replan_log_q, replan_scores_late
from .protocols import PolicySteps
from .rules import SignalRule, first_crossing
from .signals import StatefulSignal, StopsBelow, StopSignal, register_signal
from .stop_rule import StepView


class _PolicyBased(StopSignal):
    """A signal read off a learned policy: asked from its ``min_step``, or once at its ``plan_step``."""

    def __init__(self, policy: nn.Module):
        self.policy = policy
        steps = PolicySteps.of(policy)
        self.plan_step, self.first_step, self.replan_step = steps.plan, int(steps.first), steps.replan
        if self.replan_step is not None and not get_rule(self.name).plans:  # a planning rule reads both plans
            raise ValueError(f"the {self.name!r} rule reads one plan, and this policy plans again at step "
                             f"{self.replan_step} (replan_step): use the price rule")

    def plan_scores(self, view: StepView) -> Tensor:
        """The (B, T-1) scores of every step at once, from a planning policy's one call; -inf before the
        plan step (it is past: no threshold may stop there, offline or online)."""
        scores = self.scores(planned_logits(self.policy, view.inputs, view.output, view.t, view.index.numel(),
                                            view.num_steps))
        if view.t > 1:
            scores[:, :view.t - 1] = -math.inf
        return scores

    @staticmethod
    def scores(stop_logits: Tensor) -> Tensor:
        raise NotImplementedError


@register_signal
class PolicySignal(_PolicyBased):
    """pi_t = sigmoid(policy logit): the paper's stopping policy (Eq. 2)."""

    name = "threshold"
    reports_probs = True

    @staticmethod
    def scores(stop_logits: Tensor) -> Tensor:
        return torch.sigmoid(stop_logits.float())

    def __call__(self, view: StepView) -> Tensor:
        return torch.sigmoid(policy_logits(self.policy, view.inputs, view.output, view.t, view.index.numel()))


@register_signal
class QuantileSignal(_PolicyBased, StatefulSignal):
    """The probability that q_phi has stopped by step t, 1 - prod_{s<=t} (1 - pi_s), as a score.

    Thresholding it at alpha stops at the alpha-quantile of each sample's stop-time distribution.
    The score is -log prod_{s<=t} (1 - pi_s) (a monotone transform of that CDF, which in float32 rounds
    to 1.0 once q_phi is sharp and would merge distinct thresholds); the parameter is alpha itself.
    """

    name = "quantile"

    @staticmethod
    def scores(stop_logits: Tensor) -> Tensor:
        return -F.logsigmoid(-stop_logits.float()).cumsum(dim=1)

    @staticmethod
    def to_param(threshold: float) -> float:
        return -math.expm1(-threshold) if math.isfinite(threshold) else 1.0

    @staticmethod
    def from_param(param: float) -> float:
        return -math.log1p(-param) if param < 1 else math.inf

    def __call__(self, view: StepView) -> Tensor:
        logits = policy_logits(self.policy, view.inputs, view.output, view.t, view.index.numel())
        log_survival = self._state(view, lambda n: torch.zeros(n, device=logits.device, dtype=torch.float32))
        log_survival[view.index] += F.logsigmoid(-logits.float())
        return -log_survival[view.index]


@register_signal
class PriceSignal(StopsBelow, _PolicyBased):
    """One planned q_phi for every budget: stop at argmax_t log q_phi(t) - price * c_t (a planning policy only).

    A planning policy trained at one price predicts q_phi ~ q* ~ exp(-(l_t + price_0 c_t) / beta); adding
    -(price - price_0) c_t to its log re-prices the plan, so one policy serves every budget and calibration
    picks the price, not only a threshold. The stop time falls as the price rises; its score at step t is
    minus the least price at which the plan stops by t, lam*_t = min_{s<=t} max_{s'>t} (log q(s') - log q(s))
    / (c_s' - c_s), so the usual first crossing (score >= -price) gives the stop time of every price at once.
    The parameter is the price per full depth (c_t = t / T) in log-probability units.
    """

    name = "price"

    @staticmethod
    def scores(stop_logits: Tensor) -> Tensor:
        from .distributions import log_stop_time_distribution

        return PriceSignal.envelope(log_stop_time_distribution(stop_logits.float()))

    @staticmethod
    def envelope(log_q: Tensor) -> Tensor:
        """(B, T-1) scores of a planned (B, T) log q: minus the least price that stops by t, t = 1..T-1."""
        T = log_q.shape[1]
        c = torch.arange(1, T + 1, dtype=log_q.dtype, device=log_q.device) / T
        dc = c[None, :] - c[:, None]  # (T, T) c_s' - c_s
        ratio = (log_q[:, None, :] - log_q[:, :, None]) / dc.where(dc > 0, torch.ones_like(dc))  # (B, s, s')
        cols = [ratio[:, :t, t:].amax(dim=2).amin(dim=1) for t in range(1, T)]  # lam*_t, t = 1..T-1
        return -torch.stack(cols, dim=1) if cols else log_q.new_zeros(log_q.shape[0], 0)

    def plan_times(self, view: StepView, threshold: float) -> Tensor:
        """Online, the stop times directly: argmax_t log q_phi(t) - price * t / T over the steps from the plan
        step (equal to the first crossing of :meth:`scores`, without its O(T^3) envelope)."""
        return _priced_argmax(view, threshold, lambda: planned_log_q(
            self.policy, view.inputs, view.output, view.t, view.index.numel(), view.num_steps)[:, view.t - 1:])

    def replan_times(self, view: StepView, threshold: float) -> Tensor:
        """At the second plan's step s, for the samples still running: argmax_{t >= s} log q2(t) - price * t / T."""
        return _priced_argmax(view, threshold, lambda: replan_scores_late(
            self.policy, view.inputs, view.output, view.previous_output, view.t, view.index.numel(), view.num_steps))

    def replan_scores(self, scores: Tensor, view: StepView) -> Tensor:
        """The (B, T-1) scores of the first plan (:meth:`plan_scores`) revised by the second, made at step s =
        view.t: a sample stops by t >= s at a price if its first plan stopped by s, or its second by t, so its
        score there is the larger of the two (the online rule's first crossing, offline)."""
        return self.revise(scores, replan_log_q(self.policy, view.inputs, view.output, view.previous_output, view.t,
                                                view.index.numel(), view.num_steps), view.t)

    @staticmethod
    def revise(scores: Tensor, log_q2: Tensor, s: int) -> Tensor:
        """First-plan scores (B, T-1) revised by a second plan's (B, T) log q made at step s (see :meth:`replan_scores`)."""
        out = scores.clone()
        out[:, s - 1:] = torch.maximum(scores[:, s - 1:s], PriceSignal.envelope(log_q2)[:, s - 1:])
        return out

    def __call__(self, view: StepView) -> Tensor:
        raise ValueError("the price rule reads a planned q_phi: it needs a planning policy (one with plan_step)")


def _priced_argmax(view: StepView, threshold: float, late_log_q: Callable[[], Tensor]) -> Tensor:
    """Stop steps argmax_{t >= view.t} log q(t) - price * t / T (threshold = -price) from ``late_log_q()``, the
    (B, T - view.t + 1) log q of steps view.t..T up to a constant per row; +inf ("never stop early") plans depth T
    without asking the policy."""
    T = view.num_steps
    if threshold == math.inf:
        return torch.full((view.index.numel(),), T, dtype=torch.long, device=view.index.device)
    late = late_log_q()
    c = torch.arange(view.t, T + 1, dtype=late.dtype, device=late.device) / T
    return (late + threshold * c).argmax(dim=1) + view.t


class PolicyRule(SignalRule):
    """Ask a learned policy: stop once pi_t >= threshold (``SignalRule(PolicySignal(policy), threshold)``),
    or, in sample mode, stop at step t with probability pi_t (the paper's q_phi).

    A planning policy (one with ``plan_step``) is asked once, at that step, and the same rule reads
    each sample's stop time off its planned stop logits.

    Args:
        policy: ``policy(inputs, output, t) -> (B,)`` stop logits (or (B, T-1) for a planning policy).
        mode: ``"threshold"`` (deterministic) or ``"sample"`` (stochastic).
        threshold: stop probability from which a sample stops in threshold mode.
        generator: random generator for sample mode (draws on its device; CPU by default).
    """

    def __init__(self, policy: nn.Module, mode: str = "threshold", threshold: float = 0.5,
                 generator: torch.Generator | None = None):
        if mode not in ("threshold", "sample"):
            raise ValueError(f"mode must be 'threshold' or 'sample'; got {mode!r}")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold < 1:
            raise ValueError(f"threshold must be a number in (0, 1); got {threshold!r}")
        super().__init__(PolicySignal(policy), threshold)
        self.policy, self.mode, self.generator = policy, mode, generator

    def plan(self, view: StepView) -> Tensor:
        if self.mode == "threshold":
            return super().plan(view)
        return sampled_stop_times(planned_logits(self.policy, view.inputs, view.output, view.t, view.index.numel(),
                                                 view.num_steps), self.generator)

    def __call__(self, view: StepView) -> Tensor:
        if self.mode == "threshold":
            return super().__call__(view)
        p = self.last_probs = self.signal(view)
        self.keep_scores(view.t, p)
        gen_device = self.generator.device if self.generator is not None else p.device
        return torch.rand(p.shape, generator=self.generator, device=gen_device).to(p.device) < p


def sampled_stop_times(stop_logits: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Stop times of the sampled policy (stop at t with probability pi_t) from a full rollout's logits."""
    from .distributions import log_stop_time_distribution, sample_stop_time

    return sample_stop_time(log_stop_time_distribution(stop_logits), generator) + 1


def threshold_stop_times(stop_logits: Tensor, threshold: float = 0.5) -> Tensor:
    """1-based stop times of :class:`PolicyRule` in threshold mode from a full rollout's (B, T-1) stop
    logits (the first t with pi_t >= threshold, else T), without running the model a second time."""
    return first_crossing(PolicySignal.scores(stop_logits), threshold)
