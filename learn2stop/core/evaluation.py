"""One evaluation for every task and stop rule, and the accuracy-compute frontier built on it.

- :class:`Metric`: what a task measures per sample, and how per-sample values aggregate
  (a mean, or e.g. NMSE in dB as a ratio of sums).
- :func:`collect_trace`: one full rollout per chunk records every step's per-sample metric, the
  optional loss, and the scores of any stop signals: a :class:`Trace`.
- :func:`evaluate_rule`: the real early-exit run of one rule (stop times, metric at the stop
  time, steps computed), optionally with the trace's per-step metrics.
- :func:`frontier`: fixed depth, the baseline's fixed depth, classical rules swept, the policy
  calibrated to budgets and the oracle with a price on steps, each point with its measured speed.
"""
from __future__ import annotations

import functools
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from .calibration import _candidates, calibrate_budget, mean_cost_curve
from .distributions import exit_costs, fixed_depth_costs
from .loop import _first, _step, run_with_early_exit, unroll
from .trees import tree_leaves, tree_map
from .rules import StopSignal, first_crossing, reads_at_stop_alone, signal_trace


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


# ----------------------------------------------------------------------------- curves
def oracle_stop_times(trace: Trace, metric: Metric, price: float) -> Tensor:
    """Per-sample best step when each unit of normalised cost costs ``price`` metric units; (N,) 1-based."""
    sign = 1.0 if metric.lower_is_better else -1.0
    return (sign * trace.metric + price * trace.costs[None]).argmin(dim=1) + 1


def _point(trace: Trace, metric: Metric, stops: Tensor, costs: Tensor | None = None, **extra) -> dict:
    costs = trace.costs if costs is None else costs
    return {"mean_steps": float(stops.float().mean()), "mean_cost": float(costs[stops - 1].mean()),
            "metric": metric(trace.at(stops), trace.extras), **extra}


def fixed_depth_curve(trace: Trace, metric: Metric) -> list[dict]:
    """Every fixed depth d = 1..T, at what it costs read out at d alone (``Trace.fixed_depth_costs``)."""
    N = trace.metric.shape[0]
    return [_point(trace, metric, torch.full((N,), d, dtype=torch.long), trace.fixed_depth_costs, depth=d)
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
        out.append(_point(trace, metric, stops, param=signal.to_param(lam), threshold=lam))
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
        out.append(_point(trace, metric, stops, budget=b, param=cal.param, threshold=cal.threshold))
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
    out = [_point(trace, metric, oracle_stop_times(trace, metric, p), price=p) for p in prices]
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


# ----------------------------------------------------------------------------- head to head
def stops_at_cost(scores: Tensor, costs: Tensor, cost: float, generator: torch.Generator | None = None) -> Tensor:
    """(N,) stop times of a threshold rule spending ``cost`` on these samples (mean of ``costs[stop - 1]``).

    The dearest threshold within the cost, with a seeded random share of the samples moved to the next threshold so
    that the mean cost meets it: a randomised rule, the frontier's linear interpolation between two thresholds made
    sample by sample (for a fixed depth, a mix of two depths). Below the rule's cheapest threshold, that threshold.
    """
    cand = _candidates(scores)
    spent = mean_cost_curve(scores, costs, cand)
    within = (spent <= cost + 1e-6).nonzero().flatten()
    k = int(within.max()) if within.numel() else 0
    stops = first_crossing(scores, float(cand[k]))
    if within.numel() == 0 or k + 1 == cand.numel() or float(spent[k]) >= cost:
        return stops
    share = (cost - float(spent[k])) / float(spent[k + 1] - spent[k])
    moved = torch.randperm(stops.numel(), generator=generator)[:round(share * stops.numel())]
    stops[moved] = first_crossing(scores, float(cand[k + 1]))[moved]
    return stops


def paired_difference(metric: Metric, a: Tensor, b: Tensor, extras: dict, resamples: Tensor,
                      level: float = 0.95) -> dict:
    """How much better per-sample values ``a`` aggregate than ``b`` on the same samples (``Metric.gain``), with a
    paired bootstrap interval: ``resamples`` (R, N) sample indices drawn with replacement, the same for every pair
    compared, so the rows of one table share their noise. ``{"diff", "low", "high"}``."""
    diff = metric.gain(metric(a, extras), metric(b, extras))
    boot = []
    for i in resamples:
        ex = {k: v[i] for k, v in extras.items()}
        boot.append(metric.gain(metric(a[i], ex), metric(b[i], ex)))
    boot = torch.tensor(boot)
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=boot.dtype)
    low, high = torch.quantile(boot, q).tolist()
    return {"diff": diff, "low": low, "high": high}


def head_to_head(trace: Trace, metric: Metric, policy: str, thresholds: list[float],
                 rules: dict[str, tuple[Trace, str]], by: str, resamples: int = 1000, level: float = 0.95,
                 seed: int = 0) -> dict:
    """The learned rule against each other rule at the learned rule's own cost, on the same samples.

    For each of the policy's ``thresholds`` (its frontier points on ``trace``), every rule in ``rules`` (a column
    name -> (a trace of the same samples in the same order: this model's, or another network's; one of its signals,
    ``"fixed"`` for a fixed depth, at that model's fixed-depth costs when budgeted by cost: :func:`budget_costs`)) is
    set on its trace to
    spend what the policy spends (:func:`stops_at_cost`: its best case, the threshold chosen on the very samples
    scored), and the difference in the metric gets a paired bootstrap interval (:func:`paired_difference`). An
    interval that holds 0 says the two rules are not told apart on this many samples. ``by``: ``"steps"`` (t / T)
    or ``"cost"``.
    """
    N = trace.metric.shape[0]
    for col, (tr, name) in rules.items():
        if tr.metric.shape[0] != N:
            raise ValueError(f"head_to_head: {col!r} is scored on {tr.metric.shape[0]} samples, the policy on {N}")
        if name not in tr.signals:
            raise KeyError(f"head_to_head: {col!r}: the trace has no {name!r} signal; it has "
                           f"{', '.join(tr.signals) or 'none'}")
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(N, (resamples, N), generator=g)
    rows = []
    for thr in thresholds:
        stops = first_crossing(trace.signals[policy], thr)
        cost = float(budget_costs(trace, by)[stops - 1].mean())
        mine = trace.at(stops)
        row = {"threshold": thr, "cost": cost, "mean_steps": float(stops.float().mean()),
               "metric": metric(mine, trace.extras), "rules": {}}
        for col, (tr, name) in rules.items():
            own = budget_costs(tr, by, name)
            other = stops_at_cost(tr.signals[name], own, cost, torch.Generator().manual_seed(seed))
            theirs = tr.at(other)
            row["rules"][col] = {"metric": metric(theirs, trace.extras), "cost": float(own[other - 1].mean()),
                                 **paired_difference(metric, mine, theirs, trace.extras, idx, level)}
        rows.append(row)
    return {"policy": policy, "by": by, "resamples": resamples, "level": level, "samples": N, "rows": rows}


def head_to_head_markdown(h2h: dict, metric_name: str) -> str:
    """The head-to-head table: a row per policy point, a column per rule, "diff [low, high]" (positive: the policy
    better), and a verdict per cell: ahead / behind when the interval excludes 0, else tie."""
    from ..utils.report import markdown_table

    rules = list(h2h["rows"][0]["rules"]) if h2h["rows"] else []
    rows = []
    for row in h2h["rows"]:
        cells = []
        for r in rules:
            c = row["rules"][r]
            verdict = "ahead" if c["low"] > 0 else "behind" if c["high"] < 0 else "tie"
            dearer = f" (at {100 * c['cost']:.1f} %)" if abs(c["cost"] - row["cost"]) > 0.005 else ""
            cells.append(f"{c['diff']:+.3g} [{c['low']:+.3g}, {c['high']:+.3g}] {verdict}{dearer}")
        rows.append([f"{100 * row['cost']:.1f}", row["metric"], *cells])
    axis = "FLOPs" if h2h["by"] == "cost" else "steps"
    return (f"\n\n## The learned rule against each rule at its cost\n\n"
            f"The policy ({h2h['policy']}) at each of its points, and each rule set on the test samples to spend the "
            f"same ({axis}; a randomised mix of two thresholds where none spends it exactly): the policy's lead in "
            f"{metric_name} (positive: the policy better) and its {100 * h2h['level']:.0f} % paired bootstrap interval "
            f"over the {h2h['samples']} test samples ({h2h['resamples']} resamples). \"tie\": the interval holds 0; "
            f"\"(at x %)\": the rule cannot spend as little, and is compared where it can.\n\n"
            + markdown_table([f"{axis} %", f"policy {metric_name}", *rules], rows, digits=4))


# ----------------------------------------------------------------------------- speed
class BackendError(ValueError):
    """A backend (runner) that cannot run this model or rule: the message names which and why."""


def measure_speed(model: Any, inputs: Any, rule_factory: Callable[[], Any], batch_size: int, repeats: int = 3,
                  max_seconds: float = 2.0, runner: Callable[..., Any] = run_with_early_exit,
                  warmup: bool = True) -> float:
    """Samples per second of real early exit with a rule, in batches of ``batch_size`` (wall clock).

    Runs over ``inputs`` (batch-first tree) chunk by chunk, after one warm-up chunk (which also compiles
    or exports, for such a ``runner``; ``warmup=False`` skips it when the caller has already run this
    model, rule and backend on these inputs), ``repeats`` times, and keeps the fastest pass (the least disturbed
    by other work on the machine). A pass stops early after ``max_seconds``. On CUDA the clock waits for
    the device. Runs under ``torch.inference_mode``. A runner that ``takes_all`` (the stream) gets every input
    in one call with ``max_batch=batch_size``: its throughput with at most that many rows per step call.
    """
    leaves = tree_leaves(inputs)
    n = leaves[0].shape[0]
    cuda = leaves[0].is_cuda
    if getattr(runner, "takes_all", False):  # the warm-up: a short stream
        runner = functools.partial(runner, max_batch=batch_size)
        chunks, warm = [inputs], tree_map(lambda x: x[:2 * batch_size], inputs)
    else:
        chunks = [tree_map(lambda x: x[i:i + batch_size], inputs) for i in range(0, n, batch_size)]
        warm = chunks[0]
    best = 0.0
    with torch.inference_mode():  # as a deployment runs: no autograd bookkeeping, for every rule alike
        if warmup:
            runner(model, warm, rule_factory())
        for _ in range(repeats):
            if cuda:
                torch.cuda.synchronize()
            done, t0 = 0, time.perf_counter()
            for c in chunks:
                runner(model, c, rule_factory())
                done += tree_leaves(c)[0].shape[0]
                if time.perf_counter() - t0 > max_seconds:
                    break
            if cuda:
                torch.cuda.synchronize()
            best = max(best, done / max(time.perf_counter() - t0, 1e-9))
    return best


def speeds_side_by_side(jobs: list[tuple[Any, Callable[[], Any]]], inputs: Any, batch_size: int, passes: int,
                        runner: Callable[..., Any] = run_with_early_exit, skip: set[int] | None = None,
                        log: Callable[[str], None] | None = None) -> list[float | None]:
    """Samples per second of each ``(model, rule_factory)`` job on ``inputs`` in batches of ``batch_size``, measured
    side by side: ``passes`` round-robin passes over the jobs, the best per job, so that a drift in the machine's
    load hits every job alike. Only the first pass warms up (and compiles or exports, for such a ``runner``).

    A job the backend cannot run (:class:`BackendError`) gets None, is added to ``skip`` (jobs listed there are not
    run: share one set across batch sizes) and is reported through ``log``.
    """
    skip = set() if skip is None else skip
    best: list[float | None] = [None] * len(jobs)
    for round_ in range(passes):
        for i, (model, factory) in enumerate(jobs):
            if i in skip:
                continue
            try:
                v = measure_speed(model, inputs, factory, batch_size, repeats=1, runner=runner, warmup=round_ == 0)
            except BackendError as e:
                skip.add(i)
                if log is not None:
                    log(f"{e}; that job has no speed on this backend")
                continue
            best[i] = max(best[i] or 0.0, v)
    return [None if i in skip else b for i, b in enumerate(best)]


def measure_exit_costs(model: Any, inputs: Any, repeats: int = 5) -> list[float]:
    """Cumulative wall-clock seconds of exiting at steps 1..T, on this machine, for the batch ``inputs``.

    Each step's time is the fastest of ``repeats`` full rollouts (after one warm-up rollout), under
    ``torch.inference_mode``; on CUDA the clock waits for the device. A price on time instead of FLOPs:
    the result can be a model's ``exit_costs``. Measured on the 2-core CPU with the quick ResNet-20 at
    batch 256, the cumulative time of its exits ran 4-18 points of the whole above their FLOPs share (its
    early 32x32 blocks do fewer FLOPs per second than the late 8x8 ones), so FLOPs undercount what an early
    exit costs there (``benchmarks/exit_costs.py`` prints both).
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1; got {repeats!r}")
    cuda = tree_leaves(inputs)[0].is_cuda
    T = model.num_steps
    best = [math.inf] * T
    with torch.inference_mode():
        for rollout in range(repeats + 1):  # rollout 0 warms up
            state = _first(model.initial_state, model, inputs)
            for t in range(1, T + 1):
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                state, _ = _step(model, t, state, inputs)
                if cuda:
                    torch.cuda.synchronize()
                if rollout:
                    best[t - 1] = min(best[t - 1], time.perf_counter() - t0)
    return list(itertools.accumulate(best))


# ----------------------------------------------------------------------------- summaries
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


SPEED_KEYS = ("samples_per_s_batch1", "samples_per_s_batchN")


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


def frontier_markdown(result: dict, x: str = "mean_steps") -> str:
    from ..utils.report import markdown_table

    name = result["metric"]
    rows = []
    for curve, pts in result["curves"].items():
        for p in pts:
            rows.append([curve, p.get("budget", p.get("param", p.get("depth", p.get("price")))), p["mean_steps"],
                         100 * p["mean_cost"], p["metric"], p.get("samples_per_s_batch1"), p.get("samples_per_s_batchN")])
    s = result["summary"]
    frac = s["fraction_to_match_full_depth"]
    gain = s["gain_over_fixed_depth_best"]
    head = (f"# Accuracy-compute frontier ({name}, {'lower' if result['lower_is_better'] else 'higher'} is better)\n\n"
            f"Full depth ({result['num_steps']} steps): {result['full_depth']['metric']:.4g}. "
            f"Policy matches full depth with {'-' if frac is None else f'{100 * frac:.1f} %'} of its steps; "
            f"best gain over fixed depth at equal mean steps: {'-' if gain is None else f'{gain:+.4g}'}"
            + ("" if gain is None else f" (at {100 * s['gain_over_fixed_depth_best_at']:.0f} % of the steps)") + ".\n"
            f"Speeds: samples/s at batch 1 and batch {result['batch_n']}, measured side by side in one process"
            f" on {result['device']} (best of {result.get('speed_passes', 3)} passes"
            + (f", {result['speed_passes_batch1']} at batch 1" if "speed_passes_batch1" in result else "") + ")."
            + ("" if not result.get("policy_overhead") else
               f" The policy's own cost at full depth: +{100 * result['policy_overhead']['batch1']:.0f} % time at batch 1, "
               f"+{100 * result['policy_overhead']['batchN']:.0f} % at batch {result['batch_n']}.")
            + "\n\n")
    table = markdown_table(["curve", "budget / param", "mean steps", "cost %", name, "samples/s @1",
                            f"samples/s @{result['batch_n']}"], rows, digits=3)
    if result.get("head_to_head"):
        table += head_to_head_markdown(result["head_to_head"], name)
    at = result.get("speed_at_quality")
    if not at:
        return head + table
    ref = result["speed_reference"]
    return head + table + "".join(_time_table(result, at, ref, backend)
                                  for backend, at in [(result.get("backend", "torch"), at),
                                                      *result.get("speed_at_quality_by_backend", {}).items()])


def _time_table(result: dict, at: dict, ref: dict, backend: str) -> str:
    """The "In time" table of one backend: each curve's speed where it reaches the reference quality."""
    from ..utils.report import markdown_table

    lines = []  # (speed-up at batch N for the order, row)
    for curve, r in at.items():
        if r["reaches"] and r.get("lower_bound"):  # better than the reference at its cheapest point already
            bound = lambda v: None if v is None else f">= {v:.3g}"
            lines.append((r.get("speedup_batchN"), [f"{curve} (cheapest point)", f"<= {r['mean_steps']:.3g}",
                          bound(r.get("speedup_batch1")), bound(r.get("speedup_batchN")), r.get("samples_per_s_batch1"),
                          r.get("samples_per_s_batchN")]))
        elif r["reaches"]:
            lines.append((r.get("speedup_batchN"), [curve, r["mean_steps"], r.get("speedup_batch1"),
                          r.get("speedup_batchN"), r.get("samples_per_s_batch1"), r.get("samples_per_s_batchN")]))
        else:
            lines.append((None, [curve, f"never (best {r['best_metric']:.4g})", None, None, None, None]))
    lines = [row for _, row in sorted(lines, key=lambda l: -(l[0] or 0))]
    first = result.get("backend", "torch")
    where = "" if backend == first and not result.get("speed_at_quality_by_backend") else \
        f", backend {backend}" + ("" if backend == first else f" (speed-ups against {ref['name']} in {first})")
    fastest = fastest_at_quality(at)
    said = [f"at batch {1 if size == 'batch1' else result['batch_n']} {f['curve']} "
            f"({'>= ' if f['lower_bound'] else ''}{f['speedup']:.3g}x)" for size, f in fastest.items()]
    return (f"\n\n## In time: speed at the quality of {ref['name']} ({ref['metric']:.4g}){where}\n\n"
            + (f"Fastest there: {'; '.join(said)}.\n\n" if said else "")
            + markdown_table(["curve", "mean steps", "speed-up @1", f"speed-up @{result['batch_n']}", "samples/s @1",
                              f"samples/s @{result['batch_n']}"], lines, digits=3))


def frontier_plot(result: dict, path, x: str = "mean_steps") -> None:
    from ..utils.report import new_figure, save_figure

    fig, ax = new_figure(figsize=(6.5, 4.2))
    styles = {"oracle": dict(color="k", ls=":", marker="."), "policy": dict(color="tab:red", marker="o", lw=2),
              "fixed_depth": dict(color="tab:blue", marker="s", ms=3), "baseline_fixed_depth": dict(color="tab:green", marker="^", ms=3)}
    scale = 100.0 if x == "mean_cost" else 1.0
    for name, pts in result["curves"].items():
        pts = sorted(pts, key=lambda p: p[x])
        ax.plot([scale * p[x] for p in pts], [p["metric"] for p in pts], label=name, **styles.get(name, dict(marker="x", ms=4)))
    f = result["full_depth"]
    ax.axhline(f["metric"], color="gray", lw=0.8, ls="--", label="full depth")
    ax.set_xlabel("mean cost (% of full)" if x == "mean_cost" else "mean steps")
    ax.set_ylabel(result["metric"])
    ax.set_title(result.get("title", "accuracy-compute frontier"), fontsize=9)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def plt_null_formatter():
    from matplotlib.ticker import NullFormatter

    return NullFormatter()


def frontier_time_plot(result: dict, path) -> None:
    """The frontier in wall-clock time: metric against milliseconds per sample, at batch 1 and the large batch."""
    from ..utils.report import new_figure, save_figure

    fig, axes = new_figure(figsize=(10, 4.2), ncols=2)
    for ax, key, label in zip(axes, SPEED_KEYS, ("batch 1", f"batch {result['batch_n']}")):
        for name, pts in result["curves"].items():
            pts = sorted((p for p in pts if p.get(key)), key=lambda p: p["mean_steps"])  # in the curve's order
            if pts:
                ax.plot([1e3 / p[key] for p in pts], [p["metric"] for p in pts], label=name, marker=".", ms=4,
                        lw=2 if name == "policy" else 1)
        ref = result.get("speed_reference")
        if ref:
            ax.axhline(ref["metric"], color="gray", lw=0.8, ls="--", label=ref["name"])
        ax.set_xlabel(f"ms per sample ({label}, {result['device']})")
        ax.set_ylabel(result["metric"])
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(plt_null_formatter())
    axes[0].legend(fontsize=6)
    save_figure(fig, path)
