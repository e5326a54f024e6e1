"""Stop signals read off the model's output (tolerance, confidence, entropy, patience, a fixed depth) and the base
every signal shares: one shape for every stop rule.

A *stop signal* scores each running sample at step t (higher = readier to stop); a
:class:`~learn2stop.core.rules.SignalRule` stops a sample at the first step whose score reaches a threshold. The learned
policy (pi_t, or the quantile form 1 - prod_{s<=t} (1 - pi_s)), the classical tolerance test, and
the early-exit heuristics of classifiers (max-softmax confidence, entropy, patience) all fit (the policy's signals
are in :mod:`learn2stop.core.policy_signals`, every signal by its rule's name in :mod:`learn2stop.core.signal_registry`):

- online, :func:`~learn2stop.core.loop.run_with_early_exit` calls the rule on the active batch;
- offline, :func:`~learn2stop.core.rules.signal_trace` applies the *same* signal to a full rollout, step by step, so
  :func:`~learn2stop.core.rules.first_crossing` gives the stop times of every threshold at once. Calibration and the
  accuracy-compute frontier use that, and a test checks it against the online loop.

Signals that remember earlier steps (quantile, patience, tolerance) keep their state per original
sample (``view.index``) and reset when a new rollout starts (t = 1).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor

from ..runtime.registry import attach
from .protocols import member
from .rules import FixedDepth, SignalRule
from .stop_rule import StepView
from .trees import tree_leaves


def register_signal(cls: type) -> type:
    """Attach a torch signal class to its rule's registry entry (``cls.name``); its ``param_name`` and
    ``needs_policy`` are the entry's."""
    entry = attach(cls.name, signal=cls)
    cls.param_name, cls.needs_policy = entry.param_name, entry.needs_policy
    return cls


class StopSignal:
    """Base: ``signal(view) -> (B_active,)`` scores; higher means readier to stop.

    ``name`` is the rule's entry in the rule registry (:mod:`learn2stop.runtime.registry`), which declares
    its ``param_name`` and ``needs_policy`` (copied here by :func:`register_signal`); :meth:`to_param` /
    :meth:`from_param` translate between the score threshold and the parameter users set (e.g. a tolerance is
    the negated score threshold).
    """

    name = "signal"
    param_name = "threshold"
    needs_policy = False
    #: the first step at which the signal can stop a sample; the loop does not ask it before.
    first_step = 1
    #: a signal that plans: read every step's score at once at this step (see :meth:`plan_scores`).
    plan_step: int | None = None
    #: a planning signal that plans the running samples again at this later step (see :meth:`replan_scores`).
    replan_step: int | None = None
    #: a threshold at which the signal is still computed (asked, or planned) as at inference but never stops a
    #: sample before T: what timing the rule's own cost needs (+inf is never asked: :class:`SignalRule`).
    asked_never: float = float(torch.finfo(torch.float32).max)
    #: its scores are stop probabilities, which :class:`~learn2stop.core.rules.SignalRule` reports (``last_probs``)
    reports_probs: bool = False

    @staticmethod
    def to_param(threshold: float) -> float:
        return threshold

    @staticmethod
    def from_param(param: float) -> float:
        return param

    def __call__(self, view: StepView) -> Tensor:
        raise NotImplementedError

    def check_model(self, model: Any) -> None:
        """Refuse, before the first step, a model this signal cannot read, by what the model declares; the default
        reads any."""

    def plan_times(self, view: StepView, threshold: float) -> Tensor | None:
        """A planning signal's stop times at ``threshold`` computed directly, where it has a faster way than the
        first crossing of :meth:`plan_scores`; None: it has none."""
        return None

    def replan_times(self, view: StepView, threshold: float) -> Tensor:
        """The stop times of the samples still running at a second plan (``replan_step``): a rule that reads one."""
        raise ValueError(f"the {self.name!r} rule reads one plan; a second plan is read by the price rule")

    def rule(self, threshold: float) -> Any:
        """The online rule of this signal at a score threshold (:class:`SignalRule`; a signal with a cheaper
        equivalent rule returns that)."""
        return SignalRule(self, threshold)


class StatefulSignal(StopSignal):
    """A signal with per-sample memory, indexed by the sample's position in the original batch (or its slot
    in a stream). The rows asked at the signal's first step start afresh; the others keep their memory, so
    samples at different steps may share the signal (the streaming runner's per-step batches)."""

    _memory: Tensor | None = None  # (rows, ...) per-sample memory, grown as rows with higher indices come

    def _state(self, view: StepView, init: Callable[[int], Tensor]) -> Tensor:
        mem = self._memory
        if mem is not None and view.t > self.first_step:
            return mem
        need = int(view.index.max()) + 1 if view.index.numel() else 0  # once per rollout: the rows start here
        if mem is None or mem.shape[0] < need:
            grown = init(need)
            if mem is not None:
                grown[:mem.shape[0]] = mem
            self._memory = mem = grown
        mem[view.index] = init(view.index.numel())
        return mem


class StopsBelow:
    """Mixin: the rule stops when a quantity falls below the parameter (score = minus it)."""

    @staticmethod
    def to_param(threshold: float) -> float:
        return -threshold

    @staticmethod
    def from_param(param: float) -> float:
        return -param


class _Keyed(StopSignal):
    """A signal that watches one part of the output: a dict key, or a function of the output."""

    def __init__(self, key: str | Callable | None = None):
        self.key = key


def _leaf(output: Any, key: str | Callable | None) -> Tensor:
    if callable(key):
        return key(output)
    if key is not None:
        return output[key]
    leaves = tree_leaves(output)
    return output if isinstance(output, Tensor) else leaves[0]


@register_signal
class ToleranceSignal(StopsBelow, _Keyed):
    """The classical convergence test: minus the relative change ||o_t - o_{t-1}|| / ||o_t||.

    ``key`` picks what to watch: a dict key of the output, or a function of the output (e.g. MAML's
    support loss). It reads the previous output the loop hands over (no copy of its own), so it is
    asked from step 2. The parameter is the tolerance.
    """

    name = "tolerance"
    first_step = 2

    def __call__(self, view: StepView) -> Tensor:
        out = _leaf(view.output, self.key).detach().float()
        if view.previous_output is None:
            return torch.full((out.shape[0],), -math.inf, device=out.device)
        prev = _leaf(view.previous_output, self.key).detach().float()
        flat, before = out.reshape(out.shape[0], -1), prev.reshape(prev.shape[0], -1)
        return -(flat - before).norm(dim=1) / flat.norm(dim=1).clamp_min(1e-12)


class _ClassLogits(_Keyed):
    """A signal that reads a classifier's (batch, classes) logits; anything else (a regressor's output, an image) is
    refused at the signal's first step of each rollout, with what it got, and a model that declares its outputs are
    not logits (``outputs_are_logits`` False: a (B, D) regression looks like logits by shape) before its first step
    (:meth:`check_model`)."""

    #: the scores must be floating logits (a softmax reads them); False: any class scores an argmax reads (one-hot)
    needs_float = True

    def check_model(self, model: Any) -> None:
        """Refuse a model that declares its outputs are not class logits; a ``key`` function makes its own class
        scores from the output (MAML's one-hot answer step), which the declaration does not cover."""
        if member(model, "outputs_are_logits") is False and not callable(self.key):
            raise ValueError(f"the {self.name!r} rule reads a classifier's class logits, and the model "
                             f"{type(model).__name__} declares its outputs are not logits (outputs_are_logits=False): "
                             f"use a rule that does not need classes (tolerance, fixed, or a policy rule)")

    def logits(self, view: StepView) -> Tensor:
        x = _leaf(view.output, self.key)
        if view.t == self.first_step and not (x.dim() == 2 and x.shape[1] >= 2
                                              and (x.is_floating_point() or not self.needs_float)):
            where = "" if self.key is None else f" (key {self.key!r})"
            raise ValueError(f"the {self.name!r} rule reads a classifier's (batch, classes) logits, and the model's "
                             f"output{where} is a {x.dtype} tensor of shape {tuple(x.shape)}: use a rule that does "
                             f"not need classes (tolerance, fixed, or a policy rule)")
        return x


@register_signal
class ConfidenceSignal(_ClassLogits):
    """Max softmax probability of a classifier's logits (SDN's exit rule)."""

    name = "confidence"

    def __call__(self, view: StepView) -> Tensor:
        return torch.softmax(self.logits(view).float(), dim=-1).amax(dim=-1)


@register_signal
class EntropySignal(StopsBelow, _ClassLogits):
    """Minus the entropy of the softmax (BranchyNet's rule); the parameter is the entropy bound."""

    name = "entropy"

    def __call__(self, view: StepView) -> Tensor:
        logp = torch.log_softmax(self.logits(view).float(), dim=-1)
        return (logp.exp() * logp).sum(dim=-1)


@register_signal
class PatienceSignal(StatefulSignal, _ClassLogits):
    """How many exits in a row the predicted class has stayed the same (PABEE); parameter: patience k. It reads the
    argmax of (batch, classes) scores: logits, or integer one-hot votes."""

    name = "patience"
    needs_float = False

    def __call__(self, view: StepView) -> Tensor:
        pred = self.logits(view).argmax(dim=-1)
        mem = self._state(view, lambda n: torch.full((n, 2), -1.0, device=pred.device))  # (last class, run length)
        rows = mem[view.index]
        same = rows[:, 0] == pred.float()
        run = torch.where(same, rows[:, 1] + 1, torch.zeros_like(rows[:, 1]))
        mem[view.index] = torch.stack([pred.float(), run], dim=1)
        return run


@register_signal
class DepthSignal(_Keyed):
    """A fixed depth as a signal: the score at step t is t, so threshold d stops every sample at step d.

    What lets a calibrator choose a fixed depth on held-out data like any other rule (the shallowest depth
    certified to keep a quality, the deepest within a budget), and ``calibrate --fastest`` weigh it against the
    adaptive rules in time. Online it runs as the :class:`FixedDepth` it equals (:meth:`rule`): asked once, read
    out at that depth alone. The parameter is the depth; it reads no output (``key`` is ignored).
    """

    name = "fixed"

    @staticmethod
    def depth(threshold: float) -> int | None:
        """The depth a threshold stops at: the first step t >= threshold (None: +inf, never stops early)."""
        return None if threshold == math.inf else max(1, math.ceil(threshold))

    def __call__(self, view: StepView) -> Tensor:
        return torch.full((view.index.numel(),), float(view.t), device=view.index.device)

    def rule(self, threshold: float) -> "FixedDepth":
        if not isinstance(threshold, (int, float)) or math.isnan(threshold):
            raise ValueError(f"threshold must be a number; got {threshold!r}")
        return FixedDepth(self.depth(float(threshold)))


class ToleranceRule(SignalRule):
    """Stop when the relative change ||out_t - out_{t-1}|| / ||out_t|| falls to ``tol`` or below.

    The classical convergence test of iterative solvers: ``SignalRule(ToleranceSignal(key), -tol)``.
    ``key`` picks a leaf of a dict output (or is a function of the output).
    """

    def __init__(self, tol: float, key: str | Callable | None = None):
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol > 0 or tol == math.inf:
            raise ValueError(f"tol must be a finite number > 0; got {tol!r}")
        super().__init__(ToleranceSignal(key), ToleranceSignal.from_param(tol))
        self.tol = tol
