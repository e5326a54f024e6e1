"""Calibrate a trained model's stop rule on held-out data: to a budget, or to a certified quality loss.

One full rollout per batch scores every threshold at once (:func:`~learn2stop.core.trace.collect_trace`); the
calibrators are :mod:`learn2stop.core.calibration`'s. Several rules at once: each is calibrated for the same target
and the one that runs fastest at the batch size served is kept (the others' speeds recorded in ``chosen_by``).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from ..core.calibration import CalibrationTarget, calibrate_budget
from ..core.calibration_file import Calibration
from ..core.inference import policy_rules
from ..core.risk_control import calibrate_risk
from ..core.curves import budget_costs, rule_costs
from ..core.timing import speeds_side_by_side
from ..core.trace import Metric, Trace, collect_trace
from ..core.model import StoppingModel
from ..core.rules import first_crossing
from ..core.signal_registry import SIGNALS, make_signal
from .data import as_batches, inputs_of
from .guards import check_certified, check_reference


def as_metric(metric: Any) -> Metric:
    """A :class:`Metric`, or a per-sample function ``(output, target) -> (B,)`` (lower is better) made one."""
    if isinstance(metric, Metric):
        return metric
    if callable(metric):
        name = getattr(metric, "__name__", "metric")
        return Metric(name if name.isidentifier() else "metric", metric)
    raise TypeError(f"metric: expected a Metric or a function (output, target) -> (B,); got {type(metric).__name__}")


def default_rule(sm: StoppingModel) -> str:
    """The rule calibrated when none is named: the policy's quantile rule (or the first it supports); a fixed depth
    without a policy."""
    if sm.policy is None:
        return "fixed"
    rules = policy_rules(sm.policy)
    return "quantile" if "quantile" in rules else rules[0]


def model_trace(sm: StoppingModel, batches: list, metric: Metric, rules: list[str], device: Any = None) -> Trace:
    """Every step's per-sample metric and each rule's scores, from one full rollout per batch (eval mode)."""
    for r in rules:
        if r not in SIGNALS:
            raise ValueError(f"rule: unknown stop rule {r!r}; choose among {', '.join(SIGNALS)}")
    was_training = sm.training
    sm.eval()
    try:
        return collect_trace(sm.model, batches, metric, device,
                             signals={r: (lambda r=r: make_signal(r, sm.policy)) for r in rules})
    finally:
        sm.train(was_training)


def reference_values(sm: StoppingModel, trace: Trace, reference: Any, batches: list, metric: Metric,
                     device: Any = None) -> tuple[torch.Tensor, str]:
    """(N,) per-sample metric of the reference, and its name: ``None`` the model's full depth, an integer d its fixed
    depth d, a :class:`StoppingModel` (or step-wise model: a baseline) its full depth."""
    T = trace.num_steps
    if reference is None:
        return trace.metric[:, -1], "full depth"
    if isinstance(reference, int) and not isinstance(reference, bool):
        if not 1 <= reference <= T:
            raise ValueError(f"reference: a fixed depth must be in 1..{T}; got {reference}")
        return trace.metric[:, reference - 1], f"fixed depth {reference}"
    model = reference.model if isinstance(reference, StoppingModel) else reference
    if not hasattr(model, "num_steps"):
        raise TypeError(f"reference: expected None (full depth), a depth, or a baseline model; "
                        f"got {type(reference).__name__}")
    was_training = model.training
    model.eval()
    try:
        base = collect_trace(model, batches, metric, device)
    finally:
        model.train(was_training)
    if base.metric.shape[0] != trace.metric.shape[0]:
        raise ValueError("reference: the baseline scored a different number of samples")
    return base.metric[:, -1], f"baseline {type(model).__name__} at full depth"


def calibrate(sm: StoppingModel, data: Any, metric: Any, *, budget: float | None = None, epsilon: float | None = None,
              delta: float | None = None, rule: str | list[str] | None = None, reference: Any = None,
              loss_range: tuple[float, float] | None = None, by: str = "steps", test_data: Any = None,
              speed_batch: int = 1, speed_passes: int = 3, device: Any = None, attach: bool = True) -> Calibration:
    """Calibrate ``sm``'s stop rule on ``data`` (held-out batches, or a sampling function) and attach it.

    Args:
        metric: a :class:`Metric` or per-sample ``(output, target) -> (B,)`` (lower is better).
        budget: mean cost at most this fraction of full depth; or ``epsilon`` (with ``delta``, default 0.1): the
            metric worse than ``reference`` by at most epsilon with probability >= 1 - delta (Learn-then-Test).
        rule: a rule's name (default :func:`default_rule`), or several: each calibrated, the fastest at
            ``speed_batch`` kept (``"all"``: the policy's rules, tolerance and a fixed depth).
        reference: what quality is measured against: None (full depth), a depth, or a baseline model.
        loss_range: bounds of the per-sample excess metric, for finite-sample p-values (else the CLT's).
        by: what a budget counts: ``"steps"`` (t / T) or ``"cost"`` (the model's ``exit_costs``).
        test_data: scored with the calibrated rule, into ``Calibration.test``.
        attach: set ``sm.calibration`` (used by ``sm(x)``, saved by ``save_pretrained``, exported by ``export``).
    A certified rule that never stops early, or a reference worse than a fixed depth, warns
    (:class:`~learn2stop.api.guards.CalibrationWarning`).
    """
    target = CalibrationTarget(budget=budget, epsilon=epsilon, delta=delta)
    if by not in ("steps", "cost"):
        raise ValueError(f"by: 'steps' or 'cost'; got {by!r}")
    metric = as_metric(metric)
    if rule == "all":
        rules = [*(policy_rules(sm.policy) if sm.policy is not None else ()), "tolerance", "fixed"]
    else:
        rules = [default_rule(sm)] if rule is None else [rule] if isinstance(rule, str) else list(rule)
    batches = as_batches(data, "data", device)
    val = model_trace(sm, batches, metric, rules, device)
    sign = 1.0 if metric.lower_is_better else -1.0
    if target.budget is None:
        ref, ref_name = reference_values(sm, val, reference, batches, metric, device)
        fixed = [metric(val.metric[:, d], val.extras) for d in range(val.num_steps)]
        check_reference(ref_name, metric(ref, val.extras), fixed, metric.better, target.epsilon)
        risk_losses = sign * (val.metric - ref[:, None])  # (N, T) excess metric of stopping at t

    cals: dict[str, Calibration] = {}
    for r in rules:
        costs, to_param = budget_costs(val, by, r), make_signal(r, sm.policy).to_param
        if target.budget is not None:
            cal = calibrate_budget(val.signals[r], costs, target.budget, r, to_param)
        else:
            cal = calibrate_risk(val.signals[r], risk_losses, target.epsilon, target.risk_level, r, costs=costs,
                                 loss_range=loss_range, to_param=to_param)
            check_certified(r, cal.calibration["mean_steps"], val.num_steps, target.epsilon)
        cal.calibration["metric"] = metric(val.at(first_crossing(val.signals[r], cal.threshold)), val.extras)
        cals[r] = cal
    cal = cals[rules[0]] if len(rules) == 1 else _fastest(sm, cals, inputs_of(batches), speed_batch, speed_passes)
    if test_data is not None:
        test = model_trace(sm, as_batches(test_data, "test_data", device), metric, [cal.rule], device)
        stops = first_crossing(test.signals[cal.rule], cal.threshold)
        cal.test = {"metric": metric(test.at(stops), test.extras),
                    "full_depth_metric": metric(test.metric[:, -1], test.extras),
                    "mean_steps": float(stops.float().mean()), "mean_cost": float(rule_costs(test, cal.rule)[stops - 1].mean()), "samples": int(stops.numel())}
    if attach:
        sm.calibration = cal
    return cal


def _fastest(sm: StoppingModel, cals: dict[str, Calibration], inputs: Any, batch: int, passes: int) -> Calibration:
    """The calibrated rule with the most samples/s at batch ``batch`` on ``inputs``, timed side by side."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"speed_batch: the batch size timed must be an integer >= 1; got {batch!r}")
    names = list(cals)
    speeds = speeds_side_by_side([(sm.model, lambda c=cals[r]: c.make_rule(sm.policy)) for r in names], inputs, batch,
                                 passes)
    timed = {r: v for r, v in zip(names, speeds) if v is not None}
    best = max(timed, key=timed.get)
    cal = cals[best]
    cal.target = {**cal.target, "fastest_at_batch": batch}
    cal.chosen_by = {"batch_size": batch, "passes": passes, "samples_per_s": timed,
                     "candidates": {r: {"param": c.param if math.isfinite(c.param) else None,
                                        "mean_steps": c.calibration["mean_steps"], "metric": c.calibration["metric"]}
                                    for r, c in cals.items()}}
    return cal
