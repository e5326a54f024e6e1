"""Measure a trained model: the accuracy-compute frontier in steps and time, and its rules' speed per batch size.

The frontier is the built-in tasks' ``frontier`` command's (:func:`~learn2stop.core.frontier.build_frontier`) on your
model's traces: curves from one trace per split, speeds measured side by side (round-robin passes, the best each).
"""
from __future__ import annotations

from typing import Any


from ..core.calibration_file import Calibration
from ..core.inference import InferenceConfig, policy_rules
from ..core.frontier import DEFAULT_BUDGETS, SpeedPlan, build_frontier
from ..core.frontier_report import frontier_markdown
from ..core.timing import speeds_side_by_side
from ..core.model import StoppingModel
from ..core.rules import FixedDepth
from ..core.signal_registry import make_signal
from ..core.trees import tree_leaves, tree_map
from .calibrating import as_metric, default_rule, model_trace
from .data import as_batches, inputs_of
from .guards import check_full_depth, check_rule_cost



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
    mean steps. The same implementation as the built-in tasks' ``frontier`` command
    (:func:`~learn2stop.core.frontier.build_frontier`), and it prints as that command's markdown tables.
    """
    metric = as_metric(metric)
    main = default_rule(sm) if sm.policy is not None else None
    policy = [main, *(r for r in policy_rules(sm.policy) if r != main)] if main is not None else []
    batches = as_batches(data, "data", device)
    test = model_trace(sm, batches, metric, [*policy, *classical], device)
    T, N = test.num_steps, test.metric.shape[0]
    check_full_depth([metric(test.metric[:, d], test.extras) for d in range(T)], metric.better, "frontier: on the data")
    val = (model_trace(sm, as_batches(calibration_data, "calibration_data", device), metric, policy, device)
           if policy else None)
    plan = None
    if batch_size:
        inputs, size = inputs_of(batches), min(batch_size, N)
        plan = SpeedPlan(tree_map(lambda x: x[:speed_samples], inputs), tree_map(lambda x: x[:4 * size], inputs), size,
                         passes, 3 * passes)
    result = build_frontier(sm, test, val, metric, classical={n: (lambda n=n: make_signal(n)) for n in classical},
                            budgets=budgets, main=main, plan=plan, device=device, batch_n=batch_size or 0,
                            passes=(passes, 3 * passes))
    return FrontierResult(result)
