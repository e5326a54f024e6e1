"""Measure a trained model: the accuracy-compute frontier in steps and time, and its rules' speed per batch size.

Both are assembled from the core's curves, timing and frontier report, as the built-in tasks' ``frontier`` command
assembles them: curves from one trace per split, speeds measured side by side (round-robin passes, the best each).
"""
from __future__ import annotations

from typing import Any

import torch

from ..core.calibration_file import Calibration
from ..core.inference import InferenceConfig, policy_rules
from ..core.curves import (budget_curve, extend_below, fastest_at_quality, fixed_depth_curve, frontier_point,
                           frontier_summary, oracle_curve, speed_at_quality, sweep_curve)
from ..core.frontier_report import frontier_markdown
from ..core.timing import SPEED_KEYS, speeds_side_by_side
from ..core.model import StoppingModel
from ..core.rules import FixedDepth, SignalRule
from ..core.signal_registry import make_signal
from ..core.trees import tree_leaves, tree_map
from .calibrating import as_metric, default_rule, model_trace
from .data import as_batches, inputs_of
from .guards import check_full_depth, check_rule_cost

DEFAULT_BUDGETS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class FrontierResult(dict):
    """The frontier as a plain dict (curves, full depth, summary, speeds) that prints as its markdown tables."""

    def __str__(self) -> str:
        return frontier_markdown(self)


def _factory(sm: StoppingModel, rule: Any):
    """A rule factory from a stop rule or a :class:`Calibration` (made on the model's policy)."""
    if isinstance(rule, Calibration):
        return lambda: rule.make_rule(sm.policy)
    if isinstance(rule, str):
        raise TypeError(f"rules: {rule!r} is a rule's name; give a stop rule (e.g. SignalRule(ConfidenceSignal(), "
                        f"0.9), FixedDepth(3)) or a Calibration")
    return lambda: rule


def served_rule(sm: StoppingModel) -> Any:
    """The rule ``sm(x)`` uses by default: its calibration's, else the default inference rule, else full depth."""
    if sm.calibration is not None:
        return sm.calibration.make_rule(sm.policy)
    return InferenceConfig().make_rule(sm.policy) if sm.policy is not None else FixedDepth()


def benchmark(sm: StoppingModel, inputs: Any, rules: dict[str, Any] | None = None, *, batch_sizes=(1, 64),
              passes: int = 3) -> dict:
    """Samples per second of each rule, and of full depth, at each batch size served (real early exit, under
    ``torch.inference_mode``, measured side by side on ``inputs``).

    ``rules``: name -> a stop rule or a :class:`Calibration` (default: ``sm.calibration``, else the policy's default
    rule). Returns ``{"batch_sizes", "mean_steps": {name}, "samples_per_s": {name: {batch: v}}, "speedup": {name:
    {batch: x}}}`` (speed-up against full depth). A rule slower than full depth at a batch size warns
    (:class:`~learn2stop.api.guards.RuleCostWarning`): its own cost exceeds what it saves there.
    """
    if rules is None:
        rules = {"calibrated" if sm.calibration is not None else "default": served_rule(sm)}
    factories = {"full depth": lambda: FixedDepth(), **{n: _factory(sm, r) for n, r in rules.items()}}
    T, n_in = sm.num_steps, tree_leaves(inputs)[0].shape[0]
    mean_steps = {n: float(sm(inputs, f()).stop_times.float().mean()) for n, f in factories.items()}
    speeds: dict[str, dict[int, float]] = {n: {} for n in factories}
    for b in batch_sizes:
        b = min(b, n_in)
        got = speeds_side_by_side([(sm.model, f) for f in factories.values()], inputs, b, passes * (3 if b == 1 else 1))
        for n, v in zip(factories, got):
            speeds[n][b] = v
    out = {"batch_sizes": list(speeds["full depth"]), "mean_steps": mean_steps, "samples_per_s": speeds,
           "speedup": {n: {b: v / speeds["full depth"][b] for b, v in s.items()} for n, s in speeds.items()}}
    for n in rules:
        for b, v in speeds[n].items():
            check_rule_cost(n, b, v, speeds["full depth"][b], mean_steps[n], T)
    return out


def frontier(sm: StoppingModel, data: Any, metric: Any, *, calibration_data: Any, budgets=DEFAULT_BUDGETS,
             classical: tuple[str, ...] = ("tolerance",), batch_size: int | None = 64, passes: int = 2,
             speed_samples: int = 200, device: Any = None) -> FrontierResult:
    """The accuracy-compute frontier of ``sm`` on ``data`` (test batches or a sampling function).

    Curves: every fixed depth, the ``classical`` rules swept over thresholds, the policy's rules calibrated on
    ``calibration_data`` to each budget (what a deployment gets), and the oracle (the per-sample best step, a bound).
    With ``batch_size``, each point's samples/s at batch 1 (on the first ``speed_samples`` inputs) and at that batch
    (on up to four batches), and where each curve first reaches full
    depth's quality, how fast (``speed_at_quality``; ``fastest_at_quality``: the rule to serve at each batch size).
    ``summary``: the fraction of full depth the policy needs to match it, and its gain over fixed depth at equal
    mean steps. Prints as the markdown tables of the built-in tasks' ``frontier`` command.
    """
    metric = as_metric(metric)
    policy = [default_rule(sm), *(r for r in policy_rules(sm.policy) if r != default_rule(sm))] if sm.policy else []
    batches = as_batches(data, "data", device)
    test = model_trace(sm, batches, metric, [*policy, *classical], device)
    T, N = test.num_steps, test.metric.shape[0]
    check_full_depth([metric(test.metric[:, d], test.extras) for d in range(T)], metric.better, "frontier: on the data")
    full = frontier_point(test, metric, torch.full((N,), T, dtype=torch.long), test.fixed_depth_costs)
    curves = {"fixed_depth": fixed_depth_curve(test, metric)}
    how: dict[str, Any] = {"fixed_depth": lambda p: (lambda: FixedDepth(p["depth"]))}
    for name in classical:
        curves[name] = sweep_curve(test, metric, test.signals[name], make_signal(name))
        how[name] = lambda p, n=name: (lambda: SignalRule(make_signal(n), p["threshold"]))
    if policy:
        val = model_trace(sm, as_batches(calibration_data, "calibration_data", device), metric, policy, device)
        for i, rule in enumerate(policy):
            name, signal = "policy" if i == 0 else f"policy_{rule}", make_signal(rule, sm.policy)
            curves[name] = extend_below(budget_curve(test, metric, val, rule, signal, budgets), test, metric, val, rule,
                                        signal, full["metric"])
            how[name] = lambda p, r=rule: (lambda: SignalRule(make_signal(r, sm.policy), p["threshold"]))
    curves["oracle"] = oracle_curve(test, metric)
    result = FrontierResult(metric=metric.name, lower_is_better=metric.lower_is_better, num_steps=T, full_depth=full,
                            batch_n=batch_size or 0, device=str(device or "cpu"), test_samples=N, curves=curves,
                            speed_passes=passes, policy_overhead=None)
    if batch_size:
        inputs = inputs_of(batches)
        jobs = [(full, lambda: FixedDepth())] + [(p, how[n](p)) for n, pts in curves.items() if n in how for p in pts]
        for key, size in zip(SPEED_KEYS, (1, min(batch_size, N))):
            part = tree_map(lambda x: x[:speed_samples if size == 1 else 4 * size], inputs)
            got = speeds_side_by_side([(sm.model, f) for _, f in jobs], part, size, passes * (3 if size == 1 else 1))
            for (point, _), v in zip(jobs, got):
                point[key] = v
        result["batch_n"] = min(batch_size, N)
        result["speed_reference"] = {"name": "full depth", "metric": full["metric"], **{k: full[k] for k in SPEED_KEYS}}
        result["speed_at_quality"] = speed_at_quality(curves, metric, full)
        result["fastest_at_quality"] = fastest_at_quality(result["speed_at_quality"])
    result["summary"] = frontier_summary(curves, metric, full, T)
    return result
