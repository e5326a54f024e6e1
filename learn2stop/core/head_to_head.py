"""The learned rule against each other rule at the learned rule's own cost, on the same samples.

A threshold rule is set to spend a given mean cost on a trace (:func:`stops_at_cost`, a seeded mix of two
thresholds where none spends it exactly), and the difference in the metric between two rules on the same
samples gets a paired bootstrap interval (:func:`paired_difference`); :func:`head_to_head` does both for every
point of the policy and every rule compared.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .calibration import candidate_thresholds, mean_cost_curve
from .curves import budget_costs
from .rules import first_crossing
from .trace import Metric, Trace


def stops_at_cost(scores: Tensor, costs: Tensor, cost: float, generator: torch.Generator | None = None) -> Tensor:
    """(N,) stop times of a threshold rule spending ``cost`` on these samples (mean of ``costs[stop - 1]``).

    The dearest threshold within the cost, with a seeded random share of the samples moved to the next threshold so
    that the mean cost meets it: a randomised rule, the frontier's linear interpolation between two thresholds made
    sample by sample (for a fixed depth, a mix of two depths). Below the rule's cheapest threshold, that threshold.
    """
    cand = candidate_thresholds(scores)
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
