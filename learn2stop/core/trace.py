"""What a task measures, and one rollout's record of it at every step.

- :class:`Metric`: what a task measures per sample, and how per-sample values aggregate
  (a mean, or e.g. NMSE in dB as a ratio of sums).
- :func:`collect_trace`: one full rollout per chunk records every step's per-sample metric, the
  optional loss, and the scores of any stop signals: a :class:`Trace`, which the curves
  (:mod:`.curves`) and the head-to-head comparison (:mod:`.head_to_head`) read without rerunning the model.
- :func:`evaluate_rule`: the real early-exit run of one rule (stop times, metric at the stop
  time, steps computed).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from .distributions import exit_costs, fixed_depth_costs
from .loop import run_with_early_exit, unroll
from .rules import reads_at_stop_alone, signal_trace
from .signals import StopSignal
from .trees import tree_map


@dataclass
class Metric:
    """A task's quality measure.

    name: shown in tables ("NMSE (dB)", "accuracy (%)").
    per_sample: ``(output, target) -> (B,)`` values (errors, 0/1 correctness, PSNR, ...).
    lower_is_better: direction of the aggregated metric.
    aggregate: ``(values (N,), extras {name: (N,)}) -> float`` over a whole set; default: the mean.
        ``extras`` are the per-sample side data of the trace (e.g. each target's energy for a
        ratio of sums).
    """

    name: str
    per_sample: Callable[[Any, Any], Tensor]
    lower_is_better: bool = True
    aggregate: Callable[[Tensor, dict], float] | None = None

    def __call__(self, values: Tensor, extras: dict | None = None) -> float:
        if self.aggregate is not None:
            return float(self.aggregate(values, extras or {}))
        return float(values.double().mean())

    def better(self, a: float, b: float) -> bool:
        """a at least as good as b."""
        return a <= b if self.lower_is_better else a >= b

    def gain(self, a: float, b: float) -> float:
        """How much better a is than b (positive = better), in the metric's units."""
        return (b - a) if self.lower_is_better else (a - b)


@dataclass
class Trace:
    """Per-sample, per-step quantities of full rollouts over a set (N samples, T steps)."""

    metric: Tensor  # (N, T) per-sample metric values at each step
    costs: Tensor  # (T,) normalised cumulative cost of stopping at t (c_T = 1)
    signals: dict[str, Tensor] = field(default_factory=dict)  # name -> (N, T-1) scores
    losses: Tensor | None = None  # (N, T) training losses, if a loss_fn was given
    extras: dict[str, Tensor] = field(default_factory=dict)  # per-sample (N,) side data, e.g. SNR, shots
    fixed_costs: Tensor | None = None  # (T,) cost of stopping at t read out there alone (a fixed depth); None: costs

    @property
    def num_steps(self) -> int:
        return self.metric.shape[1]

    @property
    def fixed_depth_costs(self) -> Tensor:
        """(T,) what a fixed depth t costs, on the scale of ``costs`` (no earlier exit read)."""
        return self.costs if self.fixed_costs is None else self.fixed_costs

    def at(self, stop_times: Tensor) -> Tensor:
        """Per-sample metric values at the given 1-based stop times; (N,)."""
        return self.metric.gather(1, (stop_times.to(self.metric.device) - 1).unsqueeze(1)).squeeze(1)


def _to(tree: Any, device) -> Any:
    return tree_map(lambda x: x.to(device), tree)


@torch.no_grad()
def collect_trace(model: Any, batches: Iterable[tuple[Any, Any]], metric: Metric, device=None,
                  signals: dict[str, Callable[[], StopSignal]] | None = None, loss_fn=None,
                  extras: Callable[[Any, Any], dict[str, Tensor]] | None = None) -> Trace:
    """Run every step on every batch once and record the metric, the loss and the signals' scores.

    Args:
        model: a step-wise model (its ``exit_costs``, if any, become the trace's costs).
        batches: (inputs, target) pairs; moved to ``device``.
        signals: name -> factory of a fresh :class:`StopSignal` (a stateful signal must not be shared).
        extras: ``(inputs, target) -> {name: (B,)}`` side data kept per sample.
    """
    signals = signals or {}
    metric_rows, loss_rows, extra_rows = [], [], []
    sig_rows: dict[str, list[Tensor]] = {k: [] for k in signals}
    made = {k: f() for k, f in signals.items()}
    for inputs, target in batches:
        inputs, target = _to(inputs, device), _to(target, device)
        r = unroll(model, inputs, keep_outputs=True, model_grad=False)
        metric_rows.append(torch.stack([metric.per_sample(o, target).float() for o in r.step_outputs], 1).cpu())
        if loss_fn is not None:
            loss_rows.append(torch.stack([loss_fn(o, target).float() for o in r.step_outputs], 1).cpu())
        for k, sig in made.items():
            sig_rows[k].append(signal_trace(sig, r.step_outputs, inputs).cpu())
        if extras is not None:
            extra_rows.append({k: v.cpu() for k, v in extras(inputs, target).items()})
    return Trace(metric=torch.cat(metric_rows), costs=exit_costs(model), fixed_costs=fixed_depth_costs(model),
                 signals={k: torch.cat(v) for k, v in sig_rows.items()},
                 losses=torch.cat(loss_rows) if loss_rows else None,
                 extras={k: torch.cat([e[k] for e in extra_rows]) for k in extra_rows[0]} if extra_rows else {})


@torch.no_grad()
def evaluate_rule(model: Any, batches: Iterable[tuple[Any, Any]], rule_factory: Callable[[], Any], metric: Metric,
                  device=None, extras: Callable[[Any, Any], dict[str, Tensor]] | None = None,
                  runner: Callable[..., Any] = run_with_early_exit) -> dict[str, Any]:
    """Real early exit with one rule over a set: stop times, per-sample metric at the stop, steps computed.

    ``rule_factory()`` gives a fresh rule per batch (stateful rules reset themselves at t = 1, so
    one rule also works). ``runner``: where it runs (see :mod:`learn2stop.backends`). Returns {"stop_times" (N,), "values" (N,), "metric", "mean_steps",
    "mean_cost", "steps_computed"}.
    """
    times, values, extra_rows = [], [], []
    rule = rule_factory()
    for inputs, target in batches:
        inputs, target = _to(inputs, device), _to(target, device)
        r = runner(model, inputs, rule)
        times.append(r.stop_times.cpu())
        values.append(metric.per_sample(r.outputs, target).float().cpu())
        if extras is not None:
            extra_rows.append({k: v.cpu() for k, v in extras(inputs, target).items()})
    stop_times, vals = torch.cat(times), torch.cat(values)
    ex = {k: torch.cat([e[k] for e in extra_rows]) for k in extra_rows[0]} if extra_rows else {}
    costs = fixed_depth_costs(model) if reads_at_stop_alone(rule, model.num_steps) else exit_costs(model)
    return {"stop_times": stop_times, "values": vals, "metric": metric(vals, ex), "extras": ex,
            "mean_steps": float(stop_times.float().mean()), "mean_cost": float(costs[stop_times - 1].mean()),
            "steps_computed": int(stop_times.sum())}
