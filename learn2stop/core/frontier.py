"""The ``frontier`` command: the accuracy-compute frontier of a trained run in steps (or cost) and in wall-clock
time, against fixed depth, the classical rules, the baseline and the oracle (``frontier.md`` / ``.json`` /
``.png``), with the learned rule's head-to-head table and its own cost."""
from __future__ import annotations

import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..utils.report import write_json, write_text_atomic
from .inference import policy_rules
from .curves import (budget_curve, extend_below, fastest_at_quality, fixed_depth_curve, frontier_point,
                     frontier_summary, oracle_curve, speed_at_quality, sweep_curve)
from .frontier_report import frontier_markdown, frontier_plot, frontier_time_plot
from .head_to_head import head_to_head
from .timing import SPEED_KEYS, speeds_side_by_side
from .model import StoppingModel
from .trace import Metric, Trace, collect_trace
from .loop import run_with_early_exit
from .trees import tree_leaves
from .rules import FixedDepth, SignalRule
from .signal_registry import make_signal
from .signals import DepthSignal
from .calibrate import shuffled, timing_passes, timing_slice
from .task import (Run, StoppingApp, check_policy_rule, require_trained, stop_model_trace)
from .train import load_stage



DEFAULT_BUDGETS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


@dataclass
class SpeedPlan:
    """What the frontier times: the inputs at batch 1 (``one``, timed one by one) and at ``batch_n`` (``big``), the
    round-robin passes at each (``passes_batch1``, ``passes``), and the backends side by side (name -> runner; the
    first gives each point's ``samples_per_s_*``)."""

    one: Any
    big: Any
    batch_n: int
    passes: int
    passes_batch1: int
    runners: dict[str, Callable] = field(default_factory=lambda: {"torch": run_with_early_exit})


def frontier_command(app: StoppingApp, cfg: Any, run: Run, *, budgets=DEFAULT_BUDGETS, speed: bool = True) -> dict:
    """The accuracy-compute frontier of a trained run: ``frontier.json``, ``frontier.md``, ``frontier.png``.

    The stop model's traces on test and validation, the baseline's and those of the task's ``frontier_also``
    trainings, measured by :func:`build_frontier`. The run's ``runners`` (:mod:`learn2stop.backends`; eager torch by
    default) are timed side by side. The first gives each point's ``samples_per_s_*``
    and the time plot; every one has its speeds in ``point["speeds"][name]`` and its "In time" table, all against
    the first backend's reference (e.g. ONNX Runtime's policy against eager LISTA). A point a backend cannot run
    has none.
    """
    require_trained(run.run_dir, app.stop_stage, "frontier")
    dev = run.device
    metric = app.metric(cfg)
    sm = load_stage(app, cfg, run.run_dir, app.stop_stage, dev)
    t0 = time.perf_counter()
    test = stop_model_trace(app, cfg, sm, "test", dev)
    val = stop_model_trace(app, cfg, sm, "val", dev) if sm.policy is not None else None
    others: list[tuple[str, Trace, Any]] = []
    if app.baseline_stage and (Path(run.run_dir) / "checkpoints" / f"{app.baseline_stage}.pt").is_file():
        base = load_stage(app, cfg, run.run_dir, app.baseline_stage, dev)
        if base.num_steps > 1:
            others.append(("baseline_", collect_trace(base.model, app.eval_batches(cfg, "test", dev), metric, dev,
                                                      extras=app.trace_extras(cfg)), base.model))
    for prefix, stage in app.frontier_also.items():
        other = load_stage(app, cfg, run.run_dir, stage, dev)
        others.append((f"{prefix}_", collect_trace(other.model, app.eval_batches(cfg, "test", dev), metric, dev,
                                                   signals={**app.classical_signals(cfg), "fixed": DepthSignal},
                                                   extras=app.trace_extras(cfg)), other.model))
    if sm.policy is not None:
        check_policy_rule(app.inference(cfg).rule, sm, "inference.rule")
    plan = None
    if speed:
        inputs = shuffled(app.speed_inputs(cfg, dev))
        bn = min(app.speed_batch, tree_leaves(inputs)[0].shape[0])
        plan = SpeedPlan(timing_slice(app, inputs, 1), timing_slice(app, inputs, bn), bn, timing_passes(app, bn),
                         timing_passes(app, 1), run.runners)
    result = build_frontier(sm, test, val, metric, classical=app.classical_signals(cfg), budgets=budgets,
                            budget_by=app.budget_by, main=app.policy_rule(cfg) if sm.policy is not None else None,
                            others=others, plan=plan, cost_unit=app.cost_unit(cfg, sm), device=dev,
                            reference=f"{app.baseline_stage} at full depth", batch_n=min(app.speed_batch, test.metric.shape[0]),
                            passes=(app.speed_passes, timing_passes(app, 1)),
                            log=lambda m: run.log(f"frontier: traces of {test.metric.shape[0]} test samples in "
                                                  f"{time.perf_counter() - t0:.1f}s; {m}"), warn=run.log)
    if run.ctx.is_main:
        out = Path(run.run_dir)
        write_json(result, out / "frontier.json")
        write_text_atomic(out / "frontier.md", frontier_markdown(result) + "\n")
        frontier_plot(result, out / "frontier.png", x="mean_cost" if app.budget_by == "cost" else "mean_steps")
        if speed:
            frontier_time_plot(result, out / "frontier_time.png")
        run.log(frontier_markdown(result))
    return result


def build_frontier(sm: StoppingModel, test: Trace, val: Trace | None, metric: Metric, *, classical: dict[str, Callable],
                   budgets=DEFAULT_BUDGETS, budget_by: str = "steps", main: str | None = None,
                   others: list[tuple[str, Trace, Any]] = (), plan: SpeedPlan | None = None,
                   cost_unit: tuple[str, float] | None = None, device: Any = None, reference: str = "full depth",
                   batch_n: int | None = None, passes: tuple[int, int] = (0, 0),
                   log: Callable[[str], None] | None = None, warn: Callable[[str], None] | None = None) -> dict:
    """The frontier of a stop model from its traces: what ``frontier`` writes and the Python API's ``frontier``
    returns (one implementation for both).

    Curves: every fixed depth and each ``classical`` rule (name -> signal factory) swept over thresholds on the
    ``test`` trace (where it has their scores), the policy's rules (``main`` first) calibrated on ``val`` to each
    of ``budgets`` (by ``budget_by``: steps or cost) and extended below while the cheapest still reaches the speed
    reference, the main rule swept over thresholds on test (``policy_swept``), and the oracle. ``others``: (curve
    prefix, test trace, model) of other networks drawn too; the one prefixed ``baseline_`` is the speed reference
    (``reference`` names it) and its exits are not rivals of the learned rule. ``plan``: time every point side by
    side (:class:`SpeedPlan`). ``passes``: (passes, passes at batch 1), recorded. ``log``: told when the traces are
    read and the speeds are next; ``warn``: a backend that cannot run a point.
    """
    T, N = test.num_steps, test.metric.shape[0]
    curves: dict[str, list[dict]] = {}
    how: dict[str, tuple[Callable[[dict], Callable], Any]] = {}  # curve -> (point -> rule factory, model to time)
    rivals: dict[str, tuple[Trace, str]] = {}  # the head-to-head's columns: the one-line rules of stopping networks

    def network(prefix: str, trace: Trace, model: Any) -> None:
        """A network's fixed depths, and the classical rules swept when its trace has their scores."""
        curves[f"{prefix}fixed_depth"] = fixed_depth_curve(trace, metric)
        if prefix != "baseline_":  # the baseline is the speed reference; its exits (if any) are not trained to stop
            rivals.update({prefix + name: (trace, name) for name in (*classical, "fixed") if name in trace.signals})
        how[f"{prefix}fixed_depth"] = (lambda p: (lambda: FixedDepth(p["depth"])), model)
        for name, factory in classical.items():
            if name in trace.signals:
                curves[prefix + name] = sweep_curve(trace, metric, trace.signals[name], factory())
                how[prefix + name] = (lambda p, f=factory: (lambda: SignalRule(f(), p["threshold"])), model)

    network("", test, sm.model)
    for prefix, trace, model in others:
        network(prefix, trace, model)
    ref_pts = curves.get("baseline_fixed_depth")
    ref = max(ref_pts, key=lambda p: p["mean_steps"]) if ref_pts else None  # the speed reference (below), or full depth
    full = frontier_point(test, metric, torch.full((N,), T, dtype=torch.long), test.fixed_depth_costs)
    goal = (ref if ref is not None else full)["metric"]
    if main is not None:
        for rule in (main, *(r for r in policy_rules(sm.policy) if r != main)):
            name = "policy" if rule == main else f"policy_{rule}"
            signal = make_signal(rule, sm.policy)
            # cheaper budgets while the cheapest still beats the speed reference: where it reaches it is then measured
            curves[name] = extend_below(budget_curve(test, metric, val, rule, signal, budgets, budget_by), test,
                                        metric, val, rule, signal, goal, budget_by)
            how[name] = (lambda p, r=rule: (lambda: SignalRule(make_signal(r, sm.policy), p["threshold"])), sm.model)
        # The main rule swept over thresholds on the test trace, as the classical rules are: the like-for-like
        # comparison of the rules' rankings (the budget curve above is what calibration on validation deploys).
        curves["policy_swept"] = sweep_curve(test, metric, test.signals[main], make_signal(main, sm.policy))
        how["policy_swept"] = how["policy"]  # the same rule at other thresholds
    curves["oracle"] = oracle_curve(test, metric)
    if log is not None:
        log("measuring speeds" if plan is not None else "no speeds measured")
    overhead = None
    runners = plan.runners if plan is not None else {}
    if plan is not None:
        jobs = [(full, lambda: FixedDepth(), sm.model)]
        asked: dict = {}
        if main is not None:  # the policy's own cost: its main rule asked as at inference, never stopping early
            jobs.append((asked, lambda: SignalRule.never_stopping(make_signal(main, sm.policy)), sm.model))
        jobs += [(p, how[name][0](p), how[name][1]) for name, pts in curves.items() if name in how for p in pts]
        for bname, runner in runners.items():
            unsupported: set[int] = set()
            for key, data, size, n in (("samples_per_s_batch1", plan.one, 1, plan.passes_batch1),
                                       ("samples_per_s_batchN", plan.big, plan.batch_n, plan.passes)):
                got = speeds_side_by_side([(model, factory) for _, factory, model in jobs], data, size, n, runner,
                                          skip=unsupported, log=(None if warn is None else
                                                                 lambda m, b=bname: warn(f"frontier ({b}): {m}")))
                for (point, _, _), v in zip(jobs, got):
                    if v is not None:
                        point.setdefault("speeds", {}).setdefault(bname, {})[key] = v
        first = next(iter(runners))
        for point, _, _ in jobs:
            point.update(point.get("speeds", {}).get(first, {}))
        if asked:
            overhead = {"batch1": full["samples_per_s_batch1"] / asked["samples_per_s_batch1"] - 1,
                        "batchN": full["samples_per_s_batchN"] / asked["samples_per_s_batchN"] - 1}
    if cost_unit is not None:
        for p in [full] + [p for pts in curves.values() for p in pts]:
            p[f"mean_{cost_unit[0]}"] = p["mean_cost"] * cost_unit[1]
    result = {"metric": metric.name, "lower_is_better": metric.lower_is_better, "num_steps": T,
              "full_depth": full, "batch_n": plan.batch_n if plan is not None else (N if batch_n is None else batch_n),
              "device": str(device or "cpu"), "backend": next(iter(runners), "torch"), "test_samples": N,
              "budget_by": budget_by, "curves": curves, "speed_passes": passes[0], "speed_passes_batch1": passes[1],
              "policy_overhead": overhead}
    if plan is not None:  # the number a user cares about: how much faster at the quality they have today
        ref = ref if ref is not None else full
        result["speed_reference"] = {"name": reference if ref_pts else "full depth",
                                     "metric": ref["metric"], **{k: ref[k] for k in SPEED_KEYS if k in ref}}
        result["speed_at_quality"] = speed_at_quality(curves, metric, ref)
        result["fastest_at_quality"] = fastest_at_quality(result["speed_at_quality"])
        result["backends"] = list(runners)
        for bname in list(runners)[1:]:
            moved = {n: [{**{k: v for k, v in p.items() if k not in SPEED_KEYS}, **p.get("speeds", {}).get(bname, {})}
                         for p in pts] for n, pts in curves.items()}
            result.setdefault("speed_at_quality_by_backend", {})[bname] = speed_at_quality(moved, metric, ref)
    result["summary"] = frontier_summary(curves, metric, full, T)
    if main is not None and curves["policy"]:  # is the learned rule better than the one-line rules, or noise?
        result["head_to_head"] = head_to_head(test, metric, main, [p["threshold"] for p in curves["policy"]], rivals,
                                              budget_by)
    if budget_by == "cost":
        result["summary_by_cost"] = frontier_summary(curves, metric, full, T, x="mean_cost")
    return result
