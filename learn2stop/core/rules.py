"""Stop signals and the threshold rules built on them: one shape for every stop rule.

A *stop signal* scores each running sample at step t (higher = readier to stop); a
:class:`SignalRule` stops a sample at the first step whose score reaches a threshold. The learned
policy (pi_t, or the quantile form 1 - prod_{s<=t} (1 - pi_s)), the classical tolerance test, and
the early-exit heuristics of classifiers (max-softmax confidence, entropy, patience) all fit:

- online, :func:`~learn2stop.core.loop.run_with_early_exit` calls the rule on the active batch;
- offline, :func:`signal_trace` applies the *same* signal to a full rollout, step by step, so
  :func:`first_crossing` gives the stop times of every threshold at once. Calibration and the
  accuracy-compute frontier use that, and a test checks it against the online loop.

Signals that remember earlier steps (quantile, patience, tolerance) keep their state per original
sample (``view.index``) and reset when a new rollout starts (t = 1).
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .loop import (StepView, StopRule, _policy_logits, as_stop_rule, planned_log_q, planned_logits, replan_log_q,
                   replan_scores_late)
from .protocols import member
from ..runtime.registry import attach, get_rule, list_rules
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

    @staticmethod
    def to_param(threshold: float) -> float:
        return threshold

    @staticmethod
    def from_param(param: float) -> float:
        return param

    def __call__(self, view: StepView) -> Tensor:
        raise NotImplementedError

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


class _Stateful(StopSignal):
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


class _PolicyBased(StopSignal):
    """A signal read off a learned policy: asked from its ``min_step``, or once at its ``plan_step``."""

    def __init__(self, policy: nn.Module):
        self.policy = policy
        self.plan_step = member(policy, "plan_step")
        self.first_step = self.plan_step if self.plan_step is not None else int(member(policy, "min_step"))
        self.replan_step = member(policy, "replan_step") if self.plan_step is not None else None
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

    @staticmethod
    def scores(stop_logits: Tensor) -> Tensor:
        return torch.sigmoid(stop_logits.float())

    def __call__(self, view: StepView) -> Tensor:
        return torch.sigmoid(_policy_logits(self.policy, view.inputs, view.output, view.t, view.index.numel()))


@register_signal
class QuantileSignal(_PolicyBased, _Stateful):
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
        logits = _policy_logits(self.policy, view.inputs, view.output, view.t, view.index.numel())
        log_survival = self._state(view, lambda n: torch.zeros(n, device=logits.device, dtype=torch.float32))
        log_survival[view.index] += F.logsigmoid(-logits.float())
        return -log_survival[view.index]


class _LowerStops:
    """Mixin: the rule stops when a quantity falls below the parameter (score = minus it)."""

    @staticmethod
    def to_param(threshold: float) -> float:
        return -threshold

    @staticmethod
    def from_param(param: float) -> float:
        return -param


@register_signal
class PriceSignal(_LowerStops, _PolicyBased):
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
        fused = member(self.policy, "priced_plan")
        times = None if fused is None or threshold == math.inf else fused(view.inputs, view.output, view.t, threshold)
        return times if times is not None else _priced_argmax(view, threshold, lambda: planned_log_q(
            self.policy, view.inputs, view.output, view.t, view.index.numel(), view.num_steps)[:, view.t - 1:])

    def replan_times(self, view: StepView, threshold: float) -> Tensor:
        """At the second plan's step s, for the samples still running: argmax_{t >= s} log q2(t) - price * t / T."""
        fused = member(self.policy, "priced_replan")
        times = None if fused is None or threshold == math.inf else \
            fused(view.inputs, view.output, view.previous_output, view.t, threshold)
        return times if times is not None else _priced_argmax(view, threshold, lambda: replan_scores_late(
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
class ToleranceSignal(_LowerStops, _Keyed):
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


@register_signal
class ConfidenceSignal(_Keyed):
    """Max softmax probability of a classifier's logits (SDN's exit rule)."""

    name = "confidence"

    def __call__(self, view: StepView) -> Tensor:
        return torch.softmax(_leaf(view.output, self.key).float(), dim=-1).amax(dim=-1)


@register_signal
class EntropySignal(_LowerStops, _Keyed):
    """Minus the entropy of the softmax (BranchyNet's rule); the parameter is the entropy bound."""

    name = "entropy"

    def __call__(self, view: StepView) -> Tensor:
        logp = torch.log_softmax(_leaf(view.output, self.key).float(), dim=-1)
        return (logp.exp() * logp).sum(dim=-1)


@register_signal
class PatienceSignal(_Stateful, _Keyed):
    """How many exits in a row the predicted class has stayed the same (PABEE); parameter: patience k."""

    name = "patience"

    def __call__(self, view: StepView) -> Tensor:
        pred = _leaf(view.output, self.key).argmax(dim=-1)
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


class _Signals(Mapping):
    """Rule name -> its torch signal class, for every registered rule with one: a view of the rule registry
    (:mod:`learn2stop.runtime.registry`), not a second table."""

    def __getitem__(self, name: str) -> type:
        signal = get_rule(name).signal if isinstance(name, str) else None
        if signal is None:
            raise KeyError(name)
        return signal

    def __iter__(self) -> Iterator[str]:
        return iter([n for n in list_rules() if get_rule(n).signal is not None])

    def __len__(self) -> int:
        return len(list(iter(self)))


SIGNALS: Mapping[str, type] = _Signals()


def make_signal(name: str, policy: nn.Module | None = None, key: str | Callable | None = None) -> StopSignal:
    """The stop signal called ``name`` (see :data:`SIGNALS`): a policy rule's on ``policy``, a classical
    one's on the output (``key``: which part of it). The one place a signal is built from its name."""
    if name not in SIGNALS:
        raise ValueError(f"unknown stop rule {name!r}; choose one of {', '.join(SIGNALS)}")
    cls = SIGNALS[name]
    if cls.needs_policy:
        if policy is None:
            raise ValueError(f"the {name!r} rule needs a stopping policy, but the model has none")
        return cls(policy)
    return cls(key)


class SignalRule(StopRule):
    """Stop a sample at the first step whose signal reaches ``threshold`` (in score units).

    A threshold of +inf (the calibrators' "never stop early") is never asked: full depth, as :class:`FixedDepth`,
    with no signal computed and no exit read out (the exported rule alike). ``never_stopping`` is the signal asked
    as at inference without stopping: its own cost.

    Example:
        >>> rule = SignalRule(QuantileSignal(policy), threshold=0.5)   # doctest: +SKIP
        >>> run_with_early_exit(model, inputs, rule)                     # doctest: +SKIP
    """

    def __init__(self, signal: StopSignal, threshold: float):
        if not isinstance(threshold, (int, float)) or math.isnan(threshold):
            raise ValueError(f"threshold must be a number; got {threshold!r}")
        self.signal, self.threshold = signal, float(threshold)
        self.first_step, self.plan_step, self.replan_step = signal.first_step, signal.plan_step, signal.replan_step
        if self.threshold == math.inf:  # never stops early: never asked
            self.first_step, self.plan_step, self.replan_step = 1 << 30, None, None
        self.last_probs: Tensor | None = None

    def plan(self, view: StepView) -> Tensor:
        """Stop times of a planning signal: the first crossing of its planned scores (or the signal's own
        direct form of it, ``plan_times``)."""
        times = self.signal.plan_times(view, self.threshold)
        return times if times is not None else first_crossing(self.signal.plan_scores(view), self.threshold)

    def replan(self, view: StepView) -> Tensor:
        """Stop times of the samples still running at the signal's ``replan_step``, from its second plan."""
        return self.signal.replan_times(view, self.threshold)

    @classmethod
    def from_param(cls, signal: StopSignal, param: float) -> "SignalRule":
        return cls(signal, signal.from_param(param))

    @classmethod
    def never_stopping(cls, signal: StopSignal) -> "SignalRule":
        """The signal asked (or planned) as at inference, never stopping a sample before T: its own cost."""
        return cls(signal, signal.asked_never)

    def __call__(self, view: StepView) -> Tensor:
        score = self.signal(view)
        if isinstance(self.signal, PolicySignal):
            self.last_probs = score
        return score >= self.threshold


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
        gen_device = self.generator.device if self.generator is not None else p.device
        return torch.rand(p.shape, generator=self.generator, device=gen_device).to(p.device) < p


# ----------------------------------------------------------------------------- offline form
@torch.no_grad()
def signal_trace(signal: StopSignal, step_outputs: list[Any], inputs: Any) -> Tensor:
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


def sampled_stop_times(stop_logits: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Stop times of the sampled policy (stop at t with probability pi_t) from a full rollout's logits."""
    from .distributions import log_stop_time_distribution, sample_stop_time

    return sample_stop_time(log_stop_time_distribution(stop_logits), generator) + 1


def threshold_stop_times(stop_logits: Tensor, threshold: float = 0.5) -> Tensor:
    """1-based stop times of :class:`PolicyRule` in threshold mode from a full rollout's (B, T-1) stop
    logits (the first t with pi_t >= threshold, else T), without running the model a second time."""
    return first_crossing(PolicySignal.scores(stop_logits), threshold)
