"""The stop-rule slot of the loop: what a stop rule sees (:class:`StepView`), what it answers (stop now, or a
:class:`Plan`), and the protocol it follows (:class:`StopRule`, with its defaults).

A *stop rule* fills the stopping slot of :func:`~learn2stop.core.loop.run_with_early_exit`: a fixed depth, a
tolerance on the change of the output, or the learned policy (thresholded or sampled) all fit. The loop asks the
rule at its steps and shrinks the batch by the answer, which rows stop now or a :class:`Plan` (rows sorted by planned
depth, run in shrinking contiguous slices without deciding again); the rule owns its planning and replanning. The
rules themselves live in :mod:`learn2stop.core.rules`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection

import torch
from torch import Tensor

from .policy_calls import check_replan_step


@dataclass
class StepView:
    """What a stop rule sees at step t, for the samples still running."""

    t: int
    num_steps: int
    inputs: Any
    output: Any
    previous_output: Any
    state: Any
    index: Tensor  # (B_active,) positions of these samples in the original batch


@dataclass
class Plan:
    """A planning rule's answer at a step t: the running rows sorted by planned depth, deepest first (``order``:
    None keeps them as they are), and ``running[s]``, how many of them are still running after step s (s >= t),
    so the loop runs shrinking contiguous leading slices, with no decision, gather or sync at the steps between."""

    order: Tensor | None
    running: list[int]

    @classmethod
    def of(cls, times: Tensor, t: int, num_steps: int) -> "Plan":
        """The plan of (B,) 1-based stop times in max(t, 1)..T made at step t (t = 0: before the first step;
        :meth:`StopRule.decide` checks and clamps them), with one host sync (the counts; at batch 1 the depth
        itself)."""
        T = num_steps
        running = [0] * (T + 1)
        if times.numel() == 1:  # a single sample: its depth is all there is to know (nothing to sort)
            depth = int(times)
            running[t:depth] = [1] * (depth - t)
            return cls(None, running)
        times, order = torch.sort(times, descending=True, stable=True)
        counts = torch.bincount(times, minlength=T + 1).flip(0).cumsum(0).flip(0)  # counts[s] = #(times >= s)
        running[t:] = counts[t + 1:].tolist() + [0]
        return cls(order, running)


class StopRule:
    """What fills the stop-rule slot of :func:`run_with_early_exit`: the protocol of a stop rule, with its defaults.

    A per-step rule defines ``__call__(view) -> (B,) bool`` (stop now) and is asked at steps ``first_step``..T-1;
    a planning rule sets ``plan_step`` (0: before the first step) and defines ``plan(view) -> (B,)`` stop times, and
    may set ``replan_step`` with ``replan(view) -> (B,)`` for the rows still running there. The loop asks
    :meth:`decide` at :meth:`ask_steps` and shrinks the batch by its answer: it knows nothing of plans. Any
    callable on a :class:`StepView` is a per-step rule too (:func:`as_stop_rule` declares it one).
    """

    first_step: int = 1
    plan_step: int | None = None
    replan_step: int | None = None
    #: a per-step rule reads ``previous_output`` at its first step (the loop reads the model out the step before)
    reads_previous: bool = True
    #: the (B_active,) stop probabilities of the last ``__call__``, for a rule that has them (``record_probs``)
    last_probs: Tensor | None = None

    def __call__(self, view: StepView) -> Tensor:
        raise NotImplementedError

    def plan(self, view: StepView) -> Tensor:
        raise TypeError(f"{type(self).__name__} has a plan_step but no plan(view)")

    def nan_scores(self) -> tuple[int, int, int] | None:
        """Where the scores of the rollout just run were NaN, read once by the loop at its end: (step, rows, of how
        many running), or None (none, or a rule that cannot tell). A NaN stop score never stops a sample (a policy's
        NaN stop logits would run it to the last step silently); the loop refuses it."""
        return None

    def nan_rows(self) -> Tensor | None:
        """The (B_active,) bool rows whose stop scores were NaN at the rule's last call, or None (none kept, or a
        rule that cannot tell): what the streaming runner reads after each call, where one rollout is many requests
        (it takes what :meth:`nan_scores` would read at the end of a rollout)."""
        return None

    def replan(self, view: StepView) -> Tensor:
        raise TypeError(f"{type(self).__name__} has a replan_step but no replan(view)")

    def check_model(self, model: Any) -> None:
        """Refuse, once before the first step (the loop, the stream), a model this rule cannot read, by what the
        model declares (:data:`~learn2stop.core.protocols.MODEL_MEMBERS`); the default reads anything."""

    @property
    def asks_every_step(self) -> bool:
        """A per-step rule: asked at every step from its first, so device mode (``compact_every``) can batch its
        answers; a planning rule is asked only at its plan steps and needs no such mode."""
        return self.plan_step is None

    def check_steps(self, num_steps: int) -> None:
        """Refuse, before the first step, a second plan that does not come after the first and before step T."""
        check_replan_step(self.plan_step, self.replan_step, num_steps)

    @property
    def first_ask(self) -> int:
        """The first step the loop consults the rule at: its plan step, else its first step."""
        return int(self.plan_step) if self.plan_step is not None else int(self.first_step)

    def ask_steps(self, num_steps: int) -> Collection[int]:
        """The steps at which the loop asks :meth:`decide` (never T: step T stops what is left)."""
        if self.plan_step is None:
            return range(self.first_ask, num_steps)
        return {s for s in (self.plan_step, self.replan_step) if s is not None and s < num_steps}

    def read_steps(self, num_steps: int) -> Collection[int]:
        """The steps at which the loop (and the stream) read the model out, besides those where planned rows stop:
        a per-step rule from the step before its first ask (its ``previous_output``; from the ask itself for a rule
        that does not read it) to T; a planning rule at its plan, at its second plan and the step before, and T."""
        T = num_steps
        if self.plan_step is None:
            first = self.first_ask
            return range(min(first - 1 if self.reads_previous else first, T), T + 1)
        return {self.plan_step, T} if self.replan_step is None else {self.plan_step, self.replan_step - 1,
                                                                      self.replan_step, T}

    def decide(self, view: StepView) -> Tensor | Plan:
        """The rule's answer at an asked step: a :class:`Plan` at its plan (and replan) step, else the (B,) bool
        stops of ``__call__``."""
        t, T = view.t, view.num_steps
        if t == self.plan_step:
            return Plan.of(self._checked_plan(self.plan(view), view.index, max(t, 1), T), t, T)
        if t == self.replan_step:
            return Plan.of(self._checked_plan(self.replan(view), view.index, t, T), t, T)
        return self(view)

    def decide_rows(self, view: StepView, planned: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
        """:meth:`decide` for rows that carry their own plan (the streaming runner's requests, which reach a step at
        different times): the (B,) bool rows that stop at ``view.t`` (None at a plan made before the first step)
        and the rows' planned stop steps (None for a per-step rule). ``planned`` is what this returned for these
        rows before (None before their plan). At a second plan, only the rows planned past this step are planned
        again. A planned row stops at its step with no decision."""
        t, T = view.t, view.num_steps
        if t == self.plan_step:
            planned = self._checked_plan(self.plan(view), view.index, max(t, 1), T)
            return (None if t == 0 else planned == t), planned
        if planned is None:
            return self(view), None
        if t == self.replan_step:
            late = planned > t
            if bool(late.any()):
                planned = torch.where(late, self._checked_plan(self.replan(view), view.index, t, T), planned)
        return planned == t, planned

    @staticmethod
    def _checked_plan(times: Any, rows: Tensor, low: int, T: int) -> Tensor:
        """A plan's stop steps for ``rows``, clamped to ``low``..T; anything but (B,) integer steps is refused."""
        if not isinstance(times, Tensor) or times.shape != rows.shape or times.is_floating_point():
            raise ValueError(f"a planning rule must return integer stop steps of shape ({rows.numel()},); got "
                             + (f"{times.dtype} {tuple(times.shape)}" if isinstance(times, Tensor) else repr(times)))
        return times.clamp(low, T)


class RecordingProbs(StopRule):
    """A per-step rule that records the stop probabilities it reports (``last_probs``) at each step it is asked."""

    def __init__(self, rule: StopRule, B: int, T: int, device: torch.device):
        if not rule.asks_every_step:
            raise ValueError("record_probs=True needs a per-step rule; this rule plans the depth")
        self.rule = rule
        self.first_step, self.reads_previous = rule.first_step, rule.reads_previous
        self.probs = torch.full((B, max(T - 1, 0)), float("nan"), device=device)

    def __call__(self, view: StepView) -> Tensor:
        stop = self.rule.decide(view)
        reported = self.rule.last_probs
        if reported is None:
            raise ValueError("record_probs=True needs a rule that reports stop probabilities (PolicyRule)")
        self.probs[view.index, view.t - 1] = reported.to(self.probs)
        return stop

    def nan_scores(self) -> tuple[int, int, int] | None:
        return self.rule.nan_scores()


class _Declared(StopRule):
    """A rule that does not derive from :class:`StopRule` (a function, a user's class): its optional members read
    once, here, with the protocol's defaults."""

    def __init__(self, rule: Any):
        self.rule = rule
        for name in ("first_step", "plan_step", "replan_step", "reads_previous"):  # the defaults: StopRule's
            setattr(self, name, getattr(rule, name, vars(StopRule)[name]))

    def __call__(self, view: StepView) -> Tensor:
        return self.rule(view)

    @property
    def last_probs(self) -> Tensor | None:
        return getattr(self.rule, "last_probs", None)

    def plan(self, view: StepView) -> Tensor:
        return self.rule.plan(view)

    def replan(self, view: StepView) -> Tensor:
        return self.rule.replan(view)

    def nan_scores(self) -> tuple[int, int, int] | None:
        read = getattr(self.rule, "nan_scores", None)
        return read() if callable(read) else None

    def nan_rows(self) -> Tensor | None:
        read = getattr(self.rule, "nan_rows", None)
        return read() if callable(read) else None

    def check_model(self, model: Any) -> None:
        check = getattr(self.rule, "check_model", None)
        if callable(check):
            check(model)


def as_stop_rule(rule: Any) -> StopRule:
    """``rule`` as a :class:`StopRule` (itself if it is one); refuses what cannot fill the slot (a rule's name,
    None), saying what can."""
    if isinstance(rule, StopRule):
        return rule
    if not (callable(rule) or callable(getattr(rule, "plan", None))):
        hint = (" (build it: InferenceConfig(rule=...).make_rule(policy), or a calibration's make_rule)"
                if isinstance(rule, str) else "")
        raise TypeError(f"rule must be a stop rule (a callable on a StepView, or a planning rule with plan()); "
                        f"got {type(rule).__name__} {rule!r}{hint}")
    return _Declared(rule)


def check_rule(rule: Any) -> None:
    """Refuse what cannot fill the stop-rule slot (a rule's name, None), saying what can."""
    as_stop_rule(rule)
