"""The stop rules that fill the loop's slot, and their offline form.

:class:`SignalRule` stops a sample at the first step whose stop signal (:mod:`learn2stop.core.signals`,
:mod:`learn2stop.core.policy_signals`) reaches a threshold; :class:`FixedDepth` and :class:`StopAtTimes` need no
signal. Offline, :func:`signal_trace` applies the *same* signal to a full rollout, step by step, so
:func:`first_crossing` gives the stop times of every threshold at once: calibration and the accuracy-compute frontier
use that, and a test checks it against the online loop.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .stop_rule import StepView, StopRule, as_stop_rule
from .trees import tree_leaves


class SignalRule(StopRule):
    """Stop a sample at the first step whose signal reaches ``threshold`` (in score units).

    A threshold of +inf (the calibrators' "never stop early") is never asked: full depth, as :class:`FixedDepth`,
    with no signal computed and no exit read out (the exported rule alike). ``never_stopping`` is the signal asked
    as at inference without stopping: its own cost.

    Example:
        >>> rule = SignalRule(QuantileSignal(policy), threshold=0.5)   # doctest: +SKIP
        >>> run_with_early_exit(model, inputs, rule)                     # doctest: +SKIP
    """

    def __init__(self, signal: Any, threshold: float):
        if not isinstance(threshold, (int, float)) or math.isnan(threshold):
            raise ValueError(f"threshold must be a number; got {threshold!r}")
        self.signal, self.threshold = signal, float(threshold)
        self.first_step, self.plan_step, self.replan_step = signal.first_step, signal.plan_step, signal.replan_step
        if self.threshold == math.inf:  # never stops early: never asked
            self.first_step, self.plan_step, self.replan_step = 1 << 30, None, None
        self.last_probs: Tensor | None = None
        self._asked: list[tuple[int, Tensor]] = []  # this rollout's policy scores by step, checked once at its end

    def plan(self, view: StepView) -> Tensor:
        """Stop times of a planning signal: the first crossing of its planned scores (or the signal's own
        direct form of it, ``plan_times``)."""
        times = self.signal.plan_times(view, self.threshold)
        return times if times is not None else first_crossing(self.signal.plan_scores(view), self.threshold)

    def replan(self, view: StepView) -> Tensor:
        """Stop times of the samples still running at the signal's ``replan_step``, from its second plan."""
        return self.signal.replan_times(view, self.threshold)

    def check_model(self, model: Any) -> None:
        """The signal's refusal of a model it cannot read (:meth:`StopSignal.check_model`)."""
        self.signal.check_model(model)

    @classmethod
    def from_param(cls, signal: Any, param: float) -> "SignalRule":
        return cls(signal, signal.from_param(param))

    @classmethod
    def never_stopping(cls, signal: Any) -> "SignalRule":
        """The signal asked (or planned) as at inference, never stopping a sample before T: its own cost."""
        return cls(signal, signal.asked_never)

    def __call__(self, view: StepView) -> Tensor:
        score = self.signal(view)
        if self.signal.reports_probs:
            self.last_probs = score
        if self.signal.needs_policy:
            self.keep_scores(view.t, score)
        return score >= self.threshold

    def keep_scores(self, t: int, score: Tensor) -> None:
        """Keep a policy's (B_active,) scores at step t for :meth:`nan_scores` (a reference: no computation here,
        in the per-step path); the rule's first step starts a new rollout."""
        if t <= self.first_step:
            self._asked.clear()
        self._asked.append((t, score.detach() if score.requires_grad else score))

    def nan_scores(self) -> tuple[int, int, int] | None:
        """The first step of the rollout just run whose policy scores were NaN, with how many of how many rows (one
        host sync per rollout); None: none."""
        asked, self._asked = self._asked, []
        if not asked or not bool(torch.isnan(torch.cat([s for _, s in asked])).any()):
            return None
        t, score = next((t, s) for t, s in asked if bool(torch.isnan(s).any()))
        return t, int(torch.isnan(score).sum()), score.numel()

    def nan_rows(self) -> Tensor | None:
        """Which rows' policy scores were NaN at the last call (no host sync), taking what :meth:`nan_scores`
        would read; None: no policy scores kept since it was last read."""
        asked, self._asked = self._asked, []
        return torch.isnan(asked[-1][1]) if asked else None


# ----------------------------------------------------------------------------- the basic rules


class FixedDepth(StopRule):
    """Stop every sample at step ``depth`` (default: T, i.e. never early). Asked once, at that step."""

    reads_previous = False  # (the loop reads the model out at the depth alone)

    def __init__(self, depth: int | None = None):
        if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1):
            raise ValueError(f"depth must be an integer >= 1; got {depth!r}")
        self.depth = depth
        self.first_step = depth if depth is not None else 1 << 30  # full depth: never asked

    def __call__(self, view: StepView) -> Tensor:
        stop = self.depth is not None and view.t >= self.depth
        return torch.full((view.index.numel(),), stop, dtype=torch.bool, device=view.index.device)


def reads_at_stop_alone(rule: Any, num_steps: int) -> bool:
    """Whether the loop reads the model out at a rule's stop step alone: a :class:`FixedDepth`, or a rule never asked
    before the last step (a never-stopping threshold). Such a stop costs the model's ``fixed_exit_costs``, not its
    ``exit_costs`` (which count every exit up to t)."""
    if isinstance(rule, FixedDepth):
        return True
    rule = as_stop_rule(rule)
    return rule.plan_step is None and rule.first_ask >= num_steps


class StopAtTimes(StopRule):
    """Stop each sample at a given 1-based step (e.g. sampled from the oracle): a plan made before step 1.

    Args:
        stop_times: (B,) integer steps >= 1, one per sample of the batch it will be run on.
    """

    plan_step = 0

    def __init__(self, stop_times: Tensor):
        if not isinstance(stop_times, Tensor) or stop_times.dim() != 1 or stop_times.is_floating_point() \
                or stop_times.dtype == torch.bool:
            raise ValueError("stop_times must be a 1-D integer tensor of 1-based steps, one per sample; got "
                             + (f"{stop_times.dtype} of shape {tuple(stop_times.shape)}" if isinstance(stop_times, Tensor)
                                else type(stop_times).__name__))
        if stop_times.numel() and int(stop_times.min()) < 1:
            raise ValueError(f"stop_times must be >= 1 (1-based steps); got a minimum of {int(stop_times.min())}")
        self.stop_times = stop_times

    def plan(self, view: StepView) -> Tensor:
        if self.stop_times.shape[0] <= int(view.index.max()):
            raise ValueError(f"stop_times has {self.stop_times.shape[0]} entries for a batch of {view.index.numel()} samples")
        times = self.stop_times.to(view.index.device)[view.index]
        if int(times.max()) > view.num_steps:
            raise ValueError(f"stop_times go up to step {int(times.max())} but the model has {view.num_steps} steps")
        return times

    def __call__(self, view: StepView) -> Tensor:
        return self.plan(view) <= view.t


# ----------------------------------------------------------------------------- offline form


@torch.no_grad()
def signal_trace(signal: Any, step_outputs: list[Any], inputs: Any) -> Tensor:
    """The signal's scores at steps 1..T-1 of a full rollout; shape (B, T-1).

    Feeds the signal exactly the views the online loop would give it if no sample stopped (from its
    first step; earlier steps score -inf, never stopping; a planning signal once, at its plan step), so
    ``first_crossing(trace, thr)`` equals the stop times of ``SignalRule(signal, thr)``.
    """
    T = len(step_outputs)
    B = tree_leaves(step_outputs[0])[0].shape[0]
    device = tree_leaves(step_outputs[0])[0].device
    index = torch.arange(B, device=device)

    def view(t: int) -> StepView:
        return StepView(t, T, inputs, step_outputs[t - 1], step_outputs[t - 2] if t > 1 else None, None, index)

    out = torch.full((B, max(T - 1, 0)), -math.inf, device=device)
    if signal.plan_step is not None:
        if 1 <= signal.plan_step < T:
            out = signal.plan_scores(view(signal.plan_step)).float()
            if signal.replan_step is not None:
                out = signal.replan_scores(out, view(signal.replan_step))
        return out
    for t in range(max(signal.first_step, 1), T):
        out[:, t - 1] = signal(view(t)).float()
    return out


def first_crossing(scores: Tensor, threshold: float | Tensor) -> Tensor:
    """1-based stop times: the first t with scores[:, t-1] >= threshold, else T = scores.shape[1] + 1.

    ``threshold`` may be a scalar or a (K,) tensor of thresholds, giving (K, B) stop times.
    """
    B, Tm1 = scores.shape
    thr = torch.as_tensor(threshold, dtype=scores.dtype, device=scores.device)
    hit = scores.unsqueeze(0) >= thr.reshape(-1, 1, 1)  # (K, B, T-1)
    hit = torch.cat([hit, torch.ones(*hit.shape[:2], 1, dtype=torch.bool, device=scores.device)], dim=2)
    times = hit.float().argmax(dim=2) + 1
    return times[0] if thr.dim() == 0 else times
