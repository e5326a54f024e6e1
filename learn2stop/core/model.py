"""The object users train and deploy: a step-wise model together with its stopping policy."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .calibration import InferenceConfig
from .distributions import log_stop_time_distribution
from .loop import Rollout, StopRule, check_rule, check_stepwise, run_with_early_exit, unroll
from .rules import FixedDepth, PolicyRule
from .trees import batch_size, check_batch_first, check_inputs


class StoppingModel(nn.Module):
    """A step-wise model together with its stopping policy: the object users train and deploy.

    Example:
        >>> sm = StoppingModel(model, policy)               # doctest: +SKIP
        >>> result = sm(inputs)                  # early exit with the default rule  # doctest: +SKIP
        >>> result.outputs, result.stop_times, result.steps_computed                   # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, policy: nn.Module | None = None):
        super().__init__()
        check_stepwise(model)
        self.model = model
        self.policy = policy

    @property
    def num_steps(self) -> int:
        return self.model.num_steps

    def unroll(self, inputs: Any, target: Any = None, loss_fn=None, *, use_policy: bool = True,
               model_grad: bool = True, keep_outputs: bool = False, grad_steps=None) -> Rollout:
        """Full-depth rollout recording per-step losses and stop logits (see :func:`unroll`)."""
        check_inputs(inputs)
        check_batch_first(inputs)
        if target is not None and batch_size(target) != batch_size(inputs):
            raise ValueError(f"target has batch size {batch_size(target)} but the inputs have {batch_size(inputs)}")
        return unroll(self.model, inputs, target=target, loss_fn=loss_fn,
                      policy=self.policy if use_policy else None, model_grad=model_grad, keep_outputs=keep_outputs,
                      grad_steps=grad_steps)

    def forward(self, inputs: Any, rule: StopRule | None = None, *, inference: Any = None,
                mode: str | None = None, threshold: float | None = None, generator: torch.Generator | None = None,
                record_probs: bool = False, compact_every: int | None = None) -> Rollout:
        """Inference that really stops.

        The rule is, in order: ``rule`` (e.g. a calibrated one: ``calibration.make_rule(sm.policy)``);
        the policy with ``mode`` ("threshold" / "sample") and ``threshold`` if either is given; else
        ``inference`` (an :class:`~learn2stop.core.calibration.InferenceConfig`), by default the same
        rule the CLI and validation use (quantile, alpha 0.5). Without a policy: full depth. ``compact_every``:
        the device mode of :func:`run_with_early_exit` (no host synchronisation between compactions).
        """
        if rule is None:
            if self.policy is None:
                rule = FixedDepth()
            elif mode is not None or threshold is not None:
                rule = PolicyRule(self.policy, mode=mode or "threshold",
                                  threshold=0.5 if threshold is None else threshold, generator=generator)
            else:
                rule = (inference or InferenceConfig()).make_rule(self.policy, generator)
        check_inputs(inputs)
        check_batch_first(inputs)
        check_rule(rule)
        return run_with_early_exit(self.model, inputs, rule, record_probs=record_probs, compact_every=compact_every)

    def stop_distribution(self, inputs: Any) -> Tensor:
        """q_phi(t | x) for t = 1..T from a full rollout; shape (B, T)."""
        if self.policy is None:
            raise ValueError("this StoppingModel has no policy")
        return log_stop_time_distribution(self.unroll(inputs).stop_logits).exp()
