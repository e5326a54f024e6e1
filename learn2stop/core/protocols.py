"""What users hand the library, declared once: a step-wise model and a stopping policy, with their optional members
and what each one's absence means.

Nothing needs to subclass anything (wrap, don't subclass): a model or a policy declares an optional member by having
it, and every reader (the loop, the rules, calibration, the costs, the objectives, export and the backends) looks it
up with :func:`member`, the one place that does, so a default is written here and nowhere else. A stop rule's
optional members are those of :class:`~learn2stop.core.stop_rule.StopRule`, with their defaults there.

The model's optional members:

- ``exit_costs``: cumulative cost of stopping at t = 1..T (FLOPs, MACs); absent: t;
- ``fixed_exit_costs``: the cost of stopping at t when the model is read out at t alone (a fixed depth: no earlier
  exit head evaluated), in the units of ``exit_costs``; absent: ``exit_costs``;
- ``outputs_are_logits``: whether its outputs are a classifier's class logits (True: an exit network), or not (False:
  a regressor, a denoiser), which the class-probability rules (confidence, entropy, patience) refuse before the first
  step; absent (None): unknown, accepted (the rules still check the output's shape);
- ``input_shape`` / ``input_dtype``: the per-sample shape (a tuple) and dtype of its one input tensor, against which
  the streaming runner checks every request; absent: the stream's first request is the reference.

The policy's optional members:

- ``min_step``: the first step it is asked at (pi_t = 0 before); absent: 1;
- ``plan_step``: it plans every step's stop at once, at this step; absent: asked per step;
- ``plan_log_q``: ``plan_log_q(inputs, output, t) -> (B, T)`` log q_phi, what a planning policy's stop logits are
  made from, read directly by rules that want the plan (the price rule); absent: from the logits;
- ``replan_step``: a planning policy revises the plan of the samples still running, once, at this later step, with
  ``replan_log_q(inputs, output, previous_output, t) -> (B, T)`` log q_phi of steps t..T given the run so far (its
  q_phi is then :func:`~learn2stop.core.distributions.replanned_log_q` of the two plans); absent: one plan;
- ``auxiliary_loss``: ``auxiliary_loss(inputs, target) -> scalar or None``, what a part of the policy learns from the
  targets besides the stop (MAML's posterior-mean estimate), added to its stage's loss; absent: none.

A runner's (:mod:`learn2stop.backends`) optional member:

- ``takes_all``: it takes a whole stream of requests at once (the streaming runner), so a timing's warm-up hands
  it a short stream rather than one batch; absent: False.

The training task's optional member:

- ``stop_loss_fn``: ``stop_loss_fn(output, target) -> (B,)``, the loss whose oracle Stage II's policy fits and is
  selected on; absent: its ``loss_fn``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

#: the optional members of a step-wise model and their defaults (see the module's text)
MODEL_MEMBERS: dict[str, Any] = {"exit_costs": None, "fixed_exit_costs": None, "outputs_are_logits": None,
                                 "input_shape": None, "input_dtype": None}
#: the optional members of a stopping policy and their defaults (see the module's text)
POLICY_MEMBERS: dict[str, Any] = {"min_step": 1, "plan_step": None, "plan_log_q": None, "replan_step": None,
                                  "auxiliary_loss": None}
#: the optional members of a training task (:class:`~learn2stop.core.trainer.TrainingTask`) and their defaults
TASK_MEMBERS: dict[str, Any] = {"stop_loss_fn": None}
#: the optional members of a runner (a backend's early-exit loop) and their defaults
RUNNER_MEMBERS: dict[str, Any] = {"takes_all": False}
OPTIONAL_MEMBERS: dict[str, Any] = {**MODEL_MEMBERS, **POLICY_MEMBERS, **TASK_MEMBERS, **RUNNER_MEMBERS}


def member(obj: Any, name: str) -> Any:
    """The optional member ``name`` of a model, a policy, a training task or a runner (:data:`OPTIONAL_MEMBERS`), or what its absence means
    (also for ``obj`` None: no policy); a name not declared here is a KeyError, so that no reader invents one."""
    default = OPTIONAL_MEMBERS[name]
    return default if obj is None else getattr(obj, name, default)


@dataclass(frozen=True)
class PolicySteps:
    """Where a stopping policy is asked, read once from its optional members: a per-step policy from ``first`` (its
    ``min_step``) to T-1; a planning policy once, at ``plan``, and, for one that plans again, at ``replan`` (a
    ``replan_step`` without a ``plan_step`` means nothing and reads as None)."""

    first: int
    plan: int | None
    replan: int | None

    @classmethod
    def of(cls, policy: Any) -> "PolicySteps":
        plan = member(policy, "plan_step")
        if plan is not None:
            return cls(plan, plan, member(policy, "replan_step"))
        return cls(member(policy, "min_step"), None, None)


@runtime_checkable
class StepwiseModel(Protocol):
    """A model the loop drives (:mod:`learn2stop.core.loop`); its optional members are :data:`MODEL_MEMBERS`."""

    num_steps: int

    def initial_state(self, inputs: Any) -> Any: ...

    def step(self, t: int, state: Any, inputs: Any) -> Any: ...

    def readout(self, t: int, state: Any, inputs: Any) -> Any: ...


class StoppingPolicy(Protocol):
    """``policy(inputs, output, t) -> (B,)`` stop logits (pi_t = sigmoid(logit), paper Eq. 2), or for a planning
    policy (B, T-1) at its ``plan_step``; its optional members are :data:`POLICY_MEMBERS`."""

    def __call__(self, inputs: Any, output: Any, t: int) -> Any: ...
