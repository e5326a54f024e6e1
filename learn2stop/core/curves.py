"""The accuracy-compute curves read off a :class:`~.trace.Trace`, and the numbers that summarise them.

Each curve is a list of points ``{"mean_steps", "mean_cost", "metric", ...}`` (:func:`frontier_point`):
every fixed depth, a classical rule swept over thresholds, a rule calibrated to budgets (extended below its
cheapest budget while it still beats the speed reference), and the oracle with a price on steps. The
summaries: the policy's share of full depth to match it and its gain over fixed depth
(:func:`frontier_summary`), and each curve's speed where it reaches a reference quality
(:func:`speed_at_quality`, :func:`fastest_at_quality`).
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor

from .calibration import calibrate_budget
from .rules import first_crossing
from .signals import StopSignal
from .timing import SPEED_KEYS
from .trace import Metric, Trace


def oracle_stop_times(trace: Trace, metric: Metric, price: float) -> Tensor:
    """Per-sample best step when each unit of normalised cost costs ``price`` metric units; (N,) 1-based."""
    sign = 1.0 if metric.lower_is_better else -1.0
    return (sign * trace.metric + price * trace.costs[None]).argmin(dim=1) + 1


def frontier_point(trace: Trace, metric: Metric, stops: Tensor, costs: Tensor | None = None, **extra) -> dict:
    """One point of a curve: the mean steps and mean cost (``costs``, (T,); default the trace's) of stopping each
    sample at ``stops`` (N,), 1-based, and the metric aggregated there, with ``extra`` fields (budget, param, ...)."""
    costs = trace.costs if costs is None else costs
    return {"mean_steps": float(stops.float().mean()), "mean_cost": float(costs[stops - 1].mean()),
            "metric": metric(trace.at(stops), trace.extras), **extra}


def fixed_depth_curve(trace: Trace, metric: Metric) -> list[dict]:
    """Every fixed depth d = 1..T, at what it costs read out at d alone (``Trace.fixed_depth_costs``)."""
    N = trace.metric.shape[0]
    return [frontier_point(trace, metric, torch.full((N,), d, dtype=torch.long), trace.fixed_depth_costs, depth=d)
            for d in range(1, trace.num_steps + 1)]


def sweep_curve(trace: Trace, metric: Metric, scores: Tensor, signal: StopSignal, points: int = 12) -> list[dict]:
    """A classical rule swept over thresholds chosen so that its mean steps spread over the range."""
    vals = scores.float().cummax(dim=1).values.flatten()
    vals = vals[torch.isfinite(vals)]
    if vals.numel() == 0:
        return []
    thr = torch.quantile(vals.double(), torch.linspace(0.02, 1.0, points, dtype=torch.float64)).float().unique()
    out = []
    for lam in thr.tolist():
        stops = first_crossing(scores, lam)
        out.append(frontier_point(trace, metric, stops, param=signal.to_param(lam), threshold=lam))
    return _dedupe(out)


def budget_curve(trace: Trace, metric: Metric, val: Trace, name: str, signal: StopSignal,
                 budgets: Iterable[float], by: str = "steps") -> list[dict]:
    """The rule calibrated on validation scores to each budget, scored on this trace."""
    costs = budget_costs(val, by)
    out = []
    for b in budgets:
        try:
            cal = calibrate_budget(val.signals[name], costs, b, signal.name, signal.to_param)
        except ValueError:
            continue  # budget below one step: not reachable
        stops = first_crossing(trace.signals[name], cal.threshold)
        out.append(frontier_point(trace, metric, stops, budget=b, param=cal.param, threshold=cal.threshold))
    return out


#: budgets tried below a budget curve's cheapest one when that point already beats the speed reference
LOWER_BUDGETS = (0.2, 0.15, 0.12, 0.1, 0.07, 0.05, 0.03, 0.02)


def extend_below(curve: list[dict], trace: Trace, metric: Metric, val: Trace, name: str, signal: StopSignal,
                 goal: float, by: str = "steps") -> list[dict]:
    """A budget curve with cheaper budgets added (:data:`LOWER_BUDGETS`, each below the curve's cheapest) while its
    cheapest point is still better than ``goal`` (the speed reference's metric): the crossing of the reference then
    lies between points of the curve, and its speed there is measured, not bounded by the cheapest budget's. A budget
    the rule cannot spend so little on (below its first asked step), or that costs no less than the cheapest point,
    adds nothing."""
    out = list(curve)
    for b in LOWER_BUDGETS:
        cheapest = min(out, key=lambda p: p["mean_cost"], default=None)
        if cheapest is None or metric.gain(cheapest["metric"], goal) <= 0:  # no longer strictly better
            break
        if b >= cheapest.get("budget", 0.0):
            continue
        new = budget_curve(trace, metric, val, name, signal, [b], by)
        if new and new[0]["mean_cost"] < cheapest["mean_cost"]:
            out.insert(0, new[0])
    return out


def oracle_curve(trace: Trace, metric: Metric, points: int = 14) -> list[dict]:
    """The per-sample best step under a swept price on cost (a bound: it needs the target)."""
    spread = float((trace.metric.max() - trace.metric.min()).abs()) or 1.0
    prices = [0.0] + [spread * 10 ** e for e in torch.linspace(-4, 0.5, points - 1).tolist()]
    out = [frontier_point(trace, metric, oracle_stop_times(trace, metric, p), price=p) for p in prices]
    return _dedupe(out)


def rule_costs(trace: Trace, rule: str | None = None) -> Tensor:
    """(T,) what stopping at t costs a rule on this trace: a fixed depth (``"fixed"``) reads no earlier exit, so it
    costs the model's fixed-depth costs (``Trace.fixed_depth_costs``); every other rule the trace's costs."""
    return trace.fixed_depth_costs if rule == "fixed" else trace.costs


def budget_costs(trace: Trace, by: str, rule: str | None = None) -> Tensor:
    """(T,) what a budget counts a stop at t as: the rule's costs (:func:`rule_costs`) for a task budgeted by cost
    (FLOPs, MACs), else the fraction of the steps, t / T."""
    T = trace.num_steps
    return rule_costs(trace, rule) if by == "cost" else torch.arange(1, T + 1, dtype=torch.float32) / T


def _dedupe(points: list[dict]) -> list[dict]:
    seen, out = set(), []
    for p in sorted(points, key=lambda p: p["mean_steps"]):
        key = round(p["mean_steps"], 6)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out

def interpolate(curve: list[dict], x: float, key: str = "mean_steps") -> float | None:
    """The curve's metric at ``x`` by linear interpolation (None outside its range)."""
    pts = sorted(curve, key=lambda p: p[key])
    for a, b in zip(pts, pts[1:]):
        if a[key] <= x <= b[key]:
            w = 0.0 if b[key] == a[key] else (x - a[key]) / (b[key] - a[key])
            return a["metric"] + w * (b["metric"] - a["metric"])
    if pts and abs(pts[-1][key] - x) < 1e-9:
        return pts[-1]["metric"]
    return None


def frontier_summary(curves: dict[str, list[dict]], metric: Metric, full_depth: dict, num_steps: int,
                     x: str = "mean_steps") -> dict:
    """Two numbers: the fraction of full depth the policy needs to match full depth, and its gain over
    fixed depth at equal mean steps (best over the policy's points, and at each)."""
    policy = sorted(curves.get("policy", []), key=lambda p: p[x])
    full_x = full_depth[x]
    match = next((p for p in policy if metric.better(p["metric"], full_depth["metric"])), None)
    gains = []
    for p in policy:
        f = interpolate(curves["fixed_depth"], p[x], x)
        if f is not None:
            gains.append({"budget": p.get("budget"), x: p[x], "gain": metric.gain(p["metric"], f)})
    best = max(gains, key=lambda g: g["gain"]) if gains else None
    return {"fraction_to_match_full_depth": None if match is None else match[x] / full_x,
            "gain_over_fixed_depth_best": None if best is None else best["gain"],
            "gain_over_fixed_depth_best_at": None if best is None else best[x] / full_x,
            "gain_over_fixed_depth": gains}


def speed_at_quality(curves: dict[str, list[dict]], metric: Metric, target: dict) -> dict[str, dict]:
    """How fast each curve runs where it first reaches ``target``'s metric (e.g. the baseline at full depth).

    Along a curve sorted by mean steps, the first point at least as good as the target and the point before
    it bracket the crossing; its mean steps and time per sample (at batch 1 and at the large batch) are
    interpolated linearly in the metric. ``speedup_*`` is the ratio to the target's own speed. A curve that
    never reaches the target says so (``reaches: False``, with its best metric); one whose cheapest point is already
    better than the target reaches it somewhere below that point, so its speed there is only a lower bound
    (``lower_bound: True``).
    """
    out: dict[str, dict] = {}
    goal = target["metric"]
    for name, pts in curves.items():
        pts = sorted(pts, key=lambda p: p["mean_steps"])
        if not pts:
            continue
        hit = next((i for i, p in enumerate(pts) if metric.better(p["metric"], goal)), None)
        if hit is None:
            best = max(pts, key=lambda p: -p["metric"] if metric.lower_is_better else p["metric"])
            out[name] = {"reaches": False, "best_metric": best["metric"]}
            continue
        b = pts[hit]
        a = pts[hit - 1] if hit > 0 else b
        span = metric.gain(b["metric"], a["metric"])
        w = 1.0 if span <= 0 else min(max(metric.gain(goal, a["metric"]) / span, 0.0), 1.0)  # share of the way a -> b
        row = {"reaches": True, "mean_steps": a["mean_steps"] + w * (b["mean_steps"] - a["mean_steps"]),
               "lower_bound": hit == 0 and metric.gain(b["metric"], goal) > 0}
        for key in SPEED_KEYS:
            if key in a and key in b and target.get(key):
                per_sample = (1 - w) / a[key] + w / b[key]  # time per sample, interpolated
                row[key] = 1.0 / per_sample
                row["speedup_" + key.rsplit("_", 1)[1]] = row[key] / target[key]
        out[name] = row
    return out


def fastest_at_quality(at: dict[str, dict]) -> dict[str, dict]:
    """From :func:`speed_at_quality`'s rows: at batch 1 and at the large batch, the curve that runs fastest where it
    reaches the reference quality (the rule to deploy for speed at that batch size; the oracle, which needs the
    target, is left out). ``{"batch1": {"curve", "speedup", "lower_bound"}, "batchN": ...}``; a batch size no
    curve has a speed at is absent."""
    out = {}
    for size in ("batch1", "batchN"):
        rows = [(r["speedup_" + size], name, r.get("lower_bound", False)) for name, r in at.items()
                if name != "oracle" and r.get("reaches") and r.get("speedup_" + size) is not None]
        if rows:
            speedup, name, bound = max(rows, key=lambda r: r[0])
            out[size] = {"curve": name, "speedup": speedup, "lower_bound": bound}
    return out
