"""A stopping policy's calls, checked where the loop makes them: its stop logits at a step, a planning policy's
plan (stop logits, or log q_phi directly) and its second plan.

Each checks the shape the policy returned; a plan is checked for NaN or inf once per rollout (one call). The
per-step logits are checked for NaN by the loop itself, folded into the host synchronisation it already makes.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .protocols import PolicySteps, member
from .trees import tree_detach, tree_leaves


#: logit used for steps a policy declares it never stops at (sigmoid(-50) ~ 2e-22).
NEVER_STOP_LOGIT = -50.0


def policy_logits(policy: nn.Module, inputs: Any, output: Any, t: int, B: int) -> Tensor:
    """The policy's stop logits at step t; a policy with ``min_step`` is not even called before it."""
    if t < member(policy, "min_step"):
        leaf = tree_leaves(output)[0]
        return torch.full((B,), NEVER_STOP_LOGIT, device=leaf.device, dtype=leaf.dtype)
    logits = policy(inputs, output, t)
    if logits.shape != (B,):
        raise ValueError(f"a policy must return one stop logit per sample, shape ({B},); got {tuple(logits.shape)}")
    return logits


def planned_log_q(policy: nn.Module, inputs: Any, output: Any, t: int, B: int, T: int) -> Tensor:
    """A planning policy's (B, T) log q_phi from its one call at step t = ``plan_step``; only steps t..T are
    meant to be read (q_phi renormalised on them stops at the same argmax). From its ``plan_log_q`` when it has
    one (no round trip through stop logits: about 80 µs at batch 1, more than a LISTA step), else from its logits."""
    direct = member(policy, "plan_log_q")
    if direct is None:
        from .distributions import log_stop_time_distribution

        return log_stop_time_distribution(planned_logits(policy, inputs, output, t, B, T).float())
    log_q = direct(inputs, output, t)
    if log_q.shape != (B, T):
        raise ValueError(f"a planning policy's plan_log_q (plan_step={t}) must return log q_phi of steps 1..T, "
                         f"shape ({B}, {T}); got {tuple(log_q.shape)}")
    if not bool(torch.isfinite(log_q[:, t - 1:]).all()):
        raise ValueError(f"the planning policy returned NaN or inf log q_phi at its plan step {t}")
    return log_q.float()


def check_replan_step(plan_step: int | None, replan_step: int | None, T: int) -> None:
    """A second plan comes after the first and before the last step."""
    if replan_step is None:
        return
    if plan_step is None or isinstance(replan_step, bool) or not isinstance(replan_step, int) \
            or not plan_step < replan_step < T:
        raise ValueError(f"replan_step must be an integer after the plan step ({plan_step}) and before the last step "
                         f"({T}); got {replan_step!r}")


def replan_scores_late(policy: nn.Module, inputs: Any, output: Any, previous: Any, t: int, B: int, T: int) -> Tensor:
    """A re-planning policy's second plan at t = ``replan_step`` as it returns it, steps t..T only: (B, T - t + 1)
    log q_phi up to a constant per row (what an argmax reads; checked once per rollout)."""
    log_q = policy.replan_log_q(inputs, output, previous, t)
    if log_q.shape != (B, T):
        raise ValueError(f"a planning policy's replan_log_q (replan_step={t}) must return log q_phi of steps 1..T, "
                         f"shape ({B}, {T}); got {tuple(log_q.shape)}")
    late = log_q[:, t - 1:].float()
    if not bool(torch.isfinite(late).all()):
        raise ValueError(f"the planning policy returned NaN or inf log q_phi at its replan step {t}")
    return late


def replan_log_q(policy: nn.Module, inputs: Any, output: Any, previous: Any, t: int, B: int, T: int) -> Tensor:
    """A re-planning policy's second plan at t = ``replan_step``: (B, T) log q_phi, renormalised on steps t..T
    and very unlikely (finite, so that differences stay defined) before them."""
    late = replan_scores_late(policy, inputs, output, previous, t, B, T)
    return torch.cat([late.new_full((B, t - 1), REPLAN_PAST_LOG_Q), torch.log_softmax(late, dim=1)], dim=1)


#: log q of the steps a second plan cannot choose any more (before it): finite, so that ratios of log q stay defined.
REPLAN_PAST_LOG_Q = -1e4


def planned_logits(policy: nn.Module, inputs: Any, output: Any, t: int, B: int, T: int) -> Tensor:
    """A planning policy's (B, T-1) stop logits for steps 1..T-1, from its one call at step t = ``plan_step``.

    Steps before t cannot stop any more (their logits are set to ``NEVER_STOP_LOGIT``), so the planned
    q_phi puts its mass on t..T, and every policy rule reads its stop time off these logits at once.
    """
    logits = policy(inputs, output, t)
    if logits.shape != (B, T - 1):
        raise ValueError(f"a planning policy (plan_step={t}) must return the stop logits of steps 1..T-1 at once, "
                         f"shape ({B}, {T - 1}); got {tuple(logits.shape)}")
    if not bool(torch.isfinite(logits[:, t - 1:]).all()):  # one call per rollout: the check is cheap here
        raise ValueError(f"the planning policy returned NaN or inf stop logits at its plan step {t}")
    if t > 1:
        logits = torch.cat([logits.new_full((B, t - 1), NEVER_STOP_LOGIT), logits[:, t - 1:]], dim=1)
    return logits


class PolicyRecord:
    """What a full unroll records of a stopping policy, step by step: a per-step policy's stop logits at steps
    1..T-1 (from its ``min_step``), a planning policy's one plan at its ``plan_step`` and, for a re-planning one, its
    second plan at ``replan_step``. The loop hands it each step's output and knows nothing of how the policy decides.

    ``model_grad`` False (Stage II: theta frozen) feeds the policy detached outputs, so only the policy gets
    gradients.
    """

    def __init__(self, policy: nn.Module, B: int, T: int, model_grad: bool = True):
        self.policy, self.B, self.T, self.model_grad = policy, B, T, model_grad
        steps = PolicySteps.of(policy)
        self.plan_step, self.replan_step = steps.plan, steps.replan
        check_replan_step(self.plan_step, self.replan_step, T)
        self.logits: list[Tensor] = []
        self.planned = self.replanned = self.previous = None

    def observe(self, t: int, inputs: Any, output: Any) -> None:
        """Record what the policy says of step t's output (called at every step 1..T)."""
        asked = t < self.T and (self.plan_step is None or t == self.plan_step)
        again = self.replan_step is not None and t in (self.replan_step - 1, self.replan_step)
        if not (asked or again):  # a planner's steps between its plans: nothing read, nothing detached
            return
        seen = output if self.model_grad else tree_detach(output)
        if asked:
            if self.plan_step is None:
                self.logits.append(policy_logits(self.policy, inputs, seen, t, self.B))
            else:
                self.planned = planned_logits(self.policy, inputs, seen, t, self.B, self.T)
        if again:
            if t == self.replan_step:
                self.replanned = replan_log_q(self.policy, inputs, seen, self.previous, t, self.B, self.T)
            self.previous = seen

    def stop_logits(self, device: torch.device | None) -> Tensor:
        """(B, T-1) stop logits of steps 1..T-1 (a re-planning policy's: its first plan's)."""
        if self.planned is not None:
            return self.planned
        if self.logits:
            return torch.stack(self.logits, dim=1)
        return torch.full((self.B, self.T - 1), NEVER_STOP_LOGIT, device=device)
