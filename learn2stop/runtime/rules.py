"""The stop rules of :mod:`learn2stop.core.rules` in numpy, for the deployed runtime.

Each rule scores the running rows at a step where it is asked and stops those whose score reaches
the manifest's threshold (score units, as :class:`~learn2stop.core.rules.SignalRule` compares):

- ``threshold``: pi_t = sigmoid(logit_t);
- ``quantile``: -log prod_{s<=t} (1 - pi_s), i.e. 1 - prod (1 - pi_s) >= alpha (memory: one float per row);
- ``price`` (planning policies only): the plan's q_phi re-priced, stop at argmax_t log q_phi(t) - price t / T;
- ``confidence``: the max softmax probability of the output; ``entropy``: minus the softmax entropy;
- ``tolerance``: minus the relative change of the output since the previous step (memory: that output);
- ``fixed``: nobody is asked; the export ends at the depth.

A planning policy (``plan_step``) gives all its logits at once: the same scores over the plan fix each
row's stop step there; one that plans again (``replan_step``) gives the rows still running a second
(B, T) log q_phi there, which the price rule reads as :meth:`~learn2stop.core.policy_signals.PriceSignal.replan_times`. Arithmetic is float32, as in torch, so stop times match the torch loop.
"""
from __future__ import annotations

import functools

import numpy as np

from .registry import attach, get_rule


def log_sigmoid(x: np.ndarray) -> np.ndarray:
    """log sigmoid(x), stable for large |x| (float32 in, float32 out)."""
    return (np.minimum(x, 0) - np.log1p(np.exp(-np.abs(x)))).astype(np.float32, copy=False)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return np.exp(log_sigmoid(x))


def _softmax_scores(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    z = logits.astype(np.float32, copy=False)
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    s = e.sum(axis=-1, keepdims=True)
    return e / s, z - np.log(s)


class Rule:
    """Base: ``decide(t, output, logit) -> (B_active,) bool``; ``compact(keep)`` follows the batch."""

    uses_logit = False
    uses_output = False

    def __init__(self, threshold: float):
        self.threshold = np.float32(threshold)

    def start(self, batch: int) -> None:
        pass

    def compact(self, keep: np.ndarray) -> None:
        pass

    def decide(self, t: int, output, logit: np.ndarray | None) -> np.ndarray:
        raise NotImplementedError

    def plan_stop_steps(self, plan: np.ndarray, t: int = 1) -> np.ndarray:
        """1-based stop step of each row from a planning policy's (B, T-1) logits, made at step t (T if none
        reached; the steps before t cannot stop)."""
        scores = self.plan_scores(plan.astype(np.float32, copy=False))
        hit = np.concatenate([scores >= self.threshold, np.ones((plan.shape[0], 1), bool)], axis=1)
        return hit.argmax(axis=1) + 1

    def plan_scores(self, plan: np.ndarray) -> np.ndarray:
        raise ValueError(f"the {type(self).__name__} rule cannot read a planning policy's logits")

    def replan_stop_steps(self, log_q: np.ndarray, t: int) -> np.ndarray:
        raise ValueError(f"the {type(self).__name__} rule reads one plan; a second plan is read by the price rule")


class ThresholdRule(Rule):
    uses_logit = True

    def decide(self, t, output, logit):
        return sigmoid(logit.astype(np.float32, copy=False)) >= self.threshold

    def plan_scores(self, plan):
        return sigmoid(plan)


class QuantileRule(Rule):
    uses_logit = True

    def start(self, batch):
        self.log_survival = np.zeros(batch, np.float32)  # log prod_{s<=t} (1 - pi_s) of each running row

    def compact(self, keep):
        self.log_survival = self.log_survival[keep]

    def decide(self, t, output, logit):
        self.log_survival += log_sigmoid(-logit.astype(np.float32, copy=False))
        return -self.log_survival >= self.threshold

    def plan_scores(self, plan):
        return -np.cumsum(log_sigmoid(-plan), axis=1, dtype=np.float32)


class PriceRule(Rule):
    """A planning policy's q_phi re-priced (stop at argmax_t log q_phi(t) - price * t / T), as
    :class:`~learn2stop.core.policy_signals.PriceSignal`: score_t = -min_{s<=t} max_{s'>t} (log q(s') - log q(s)) / (c_s' - c_s)."""

    def decide(self, t, output, logit):
        raise ValueError("the price rule reads a planned q_phi: it needs a planning policy (one with plan_step)")

    def replan_stop_steps(self, log_q, t):
        """1-based stop steps of the rows still running at a second plan's step t: argmax over s >= t of the
        (B, T) second plan minus price * s / T (a constant per row, its normalisation on s >= t, is no matter)."""
        return priced_argmax(log_q[:, t - 1:].astype(np.float32, copy=False), t, log_q.shape[1], self.threshold)

    def plan_stop_steps(self, plan, t=1):
        """Online, the stop steps directly: argmax over s >= t of log q_phi(s) - price * s / T (the first crossing of
        :meth:`plan_scores`, as the torch rule's ``plan_times``, without the O(T^3) envelope: at batch 1 that was
        most of what the plan cost here)."""
        log_q = _log_q(plan.astype(np.float32, copy=False))
        return priced_argmax(log_q[:, t - 1:], t, log_q.shape[1], self.threshold)

    def plan_scores(self, plan):
        log_q = _log_q(plan)
        B, T = log_q.shape
        c = np.arange(1, T + 1, dtype=np.float32) / np.float32(T)
        dc = c[None, :] - c[:, None]  # (T, T) c_s' - c_s
        ratio = (log_q[:, None, :] - log_q[:, :, None]) / np.where(dc > 0, dc, np.float32(1))  # (B, s, s')
        cols = [ratio[:, :t, t:].max(axis=2).min(axis=1) for t in range(1, T)]
        return -np.stack(cols, axis=1) if cols else np.zeros((B, 0), np.float32)


def priced_argmax(late: np.ndarray, t: int, T: int, threshold: float) -> np.ndarray:
    """1-based stop steps argmax over s = t..T of ``late`` (B, T - t + 1: log q_phi of those steps, up to a constant
    per row, at most 0) + threshold * s / T (threshold = -price); +inf ("never stop early"): T; -inf (an infinite
    price): t, as the torch rule."""
    if threshold == np.inf:
        return np.full(late.shape[0], T, dtype=np.int64)
    return (late + _price_column(t, T, float(threshold))).argmax(axis=1) + t


@functools.lru_cache(maxsize=256)
def _price_column(t: int, T: int, threshold: float) -> np.ndarray:
    """threshold * s / T for s = t..T, float32 (read-only: shared by every call at that step and price)."""
    c = np.float32(threshold) * (np.arange(t, T + 1, dtype=np.float32) / np.float32(T))
    c.flags.writeable = False
    return c


def _log_q(plan: np.ndarray) -> np.ndarray:
    """The (B, T) log q_phi induced by (B, T-1) stop logits (Eq. 2), float32."""
    zero = np.zeros((plan.shape[0], 1), np.float32)
    log_survival = np.concatenate([zero, np.cumsum(log_sigmoid(-plan), axis=1, dtype=np.float32)], axis=1)
    return log_survival + np.concatenate([log_sigmoid(plan), zero], axis=1)


class ConfidenceRule(Rule):
    uses_output = True

    def decide(self, t, output, logit):
        return _softmax_scores(output)[0].max(axis=-1) >= self.threshold


class EntropyRule(Rule):
    uses_output = True

    def decide(self, t, output, logit):
        p, logp = _softmax_scores(output)
        return (p * logp).sum(axis=-1) >= self.threshold


class ToleranceRule(Rule):
    """The classical convergence test: minus the relative change of the output since the previous step."""

    uses_output = True

    def start(self, batch):
        self.previous = None  # (B_active, D) the previous step's output of each running row

    def compact(self, keep):
        if self.previous is not None:
            self.previous = self.previous[keep]

    def decide(self, t, output, logit):
        out = output[0] if isinstance(output, list) else output
        flat = out.reshape(out.shape[0], -1).astype(np.float32, copy=False)
        before, self.previous = self.previous, flat
        if before is None:
            return np.zeros(flat.shape[0], bool)
        change = np.linalg.norm(flat - before, axis=1) / np.maximum(np.linalg.norm(flat, axis=1), np.float32(1e-12))
        return -change >= self.threshold


class FixedRule(Rule):
    def decide(self, t, output, logit):
        raise AssertionError("a fixed depth is never asked: its export ends at the depth")


for _name, _rule in {"threshold": ThresholdRule, "quantile": QuantileRule, "confidence": ConfidenceRule,
                     "entropy": EntropyRule, "tolerance": ToleranceRule, "price": PriceRule, "fixed": FixedRule}.items():
    attach(_name, numpy_rule=_rule)


def make_rule(spec: dict) -> Rule:
    """The numpy rule of a manifest's ``rule`` entry (threshold null = never stops early), from the rule registry."""
    thr = spec.get("threshold")
    return get_rule(spec["name"]).numpy_rule(np.inf if thr is None else float(thr))
