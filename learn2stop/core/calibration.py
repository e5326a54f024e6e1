"""Calibrating a stop rule's parameter on held-out data for what the user asks.

- :func:`calibrate_budget`: the most generous rule whose mean cost (steps, or the model's ``exit_costs`` such as
  FLOPs) is at most a budget B, as a fraction of full depth;
- :func:`calibrate_match`: the cheapest rule as good as a goal on these samples (empirical, no guarantee);
- :func:`~learn2stop.core.risk_control.calibrate_risk`: the cheapest rule whose metric is worse than full depth by
  at most epsilon, with the Learn-then-Test guarantee (:mod:`learn2stop.core.risk_control`).

All work on a (N, T-1) score trace of one signal (see :mod:`learn2stop.core.rules`): the stop time of threshold lam
is the first t whose running maximum of scores reaches lam, so every candidate threshold is scored at once without
running the model again. The result is a :class:`~learn2stop.core.calibration_file.Calibration`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..utils.config import ConfigError
from .calibration_file import Calibration
from .rules import first_crossing
from .signal_registry import SIGNALS


# ----------------------------------------------------------------------------- cost of thresholds


def _sorted_crossings(scores: Tensor, costs: Tensor) -> tuple[Tensor, Tensor]:
    """Flattened running maxima of the scores, sorted, with the cost each adds when it is below lam."""
    run_max = scores.float().cummax(dim=1).values  # (N, T-1): stop time(lam) = 1 + #{t: run_max_t < lam}
    dc = costs.float().diff().to(scores.device).expand_as(run_max)  # cost of going on from t to t+1
    values, order = run_max.flatten().sort()
    return values, dc.flatten()[order]


def mean_cost_curve(scores: Tensor, costs: Tensor, thresholds: Tensor) -> Tensor:
    """Mean normalised cost of the rule at each threshold, (K,), without computing stop times."""
    values, added = _sorted_crossings(scores, costs)
    cum = torch.cat([added.new_zeros(1), added.cumsum(0)])
    below = torch.searchsorted(values, thresholds.to(values), right=False)  # entries < lam
    return float(costs[0]) + cum[below] / scores.shape[0]


def candidate_thresholds(scores: Tensor, max_candidates: int | None = None) -> Tensor:
    """Distinct thresholds worth trying, ascending: the running maxima (and +inf = full depth)."""
    vals = scores.float().cummax(dim=1).values.flatten().unique()
    vals = vals[vals > -math.inf]  # -inf marks steps where the rule is not asked: no threshold may stop there
    if max_candidates and vals.numel() > max_candidates:
        q = torch.linspace(0, 1, max_candidates, dtype=torch.float64)
        vals = torch.quantile(vals.double(), q).float().unique()
    return torch.cat([vals, vals.new_full((1,), math.inf)])


def cost_spaced_thresholds(scores: Tensor, costs: Tensor, n: int) -> Tensor:
    """At most ``n`` thresholds, descending from +inf (full depth), spaced by the mean cost they give on ``scores``
    (N, T-1), the gaps growing quadratically away from full depth: the order of a fixed sequence whose every test
    is expensive (a model run per threshold), fine where a small quality loss is certified and coarse far from it.
    Each is the largest threshold whose mean cost on ``scores`` is at most its target."""
    cand = candidate_thresholds(scores)  # ascending, +inf last
    cost = mean_cost_curve(scores, costs, cand)  # non-decreasing with the threshold
    top, low = float(cost[-1]), float(cost.min())
    targets = top - (top - low) * (torch.arange(1, n, dtype=torch.float64) / max(n - 1, 1)) ** 2
    at = (torch.searchsorted(cost.double(), targets, right=True) - 1).clamp_min(0)
    picked = cand[at].unique()
    return torch.cat([picked.new_full((1,), math.inf), picked[picked < math.inf].flip(0)])


def check_budget(budget: float, flag: str = "--budget") -> None:
    if not (isinstance(budget, (int, float)) and math.isfinite(budget) and 0 < budget <= 1):
        raise ConfigError(f"{flag}: the budget is a fraction of full depth in (0, 1]; got {budget!r}")


def check_risk(epsilon: float, delta: float) -> None:
    if not (isinstance(epsilon, (int, float)) and math.isfinite(epsilon) and epsilon >= 0):
        raise ConfigError(f"--epsilon: the allowed loss of quality must be a finite number >= 0; got {epsilon!r}")
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise ConfigError(f"--delta: the risk level must be in (0, 1); got {delta!r}")


@dataclass(frozen=True)
class CalibrationTarget:
    """What ``calibrate`` aims at, checked once when made: a budget (mean cost at most ``budget`` of full depth)
    or a risk level (quality worse than full depth by at most ``epsilon``, with probability >= 1 - ``delta``).
    Exactly one of ``budget`` and ``epsilon``; ``delta`` goes with ``epsilon`` only (default 0.1)."""

    budget: float | None = None
    epsilon: float | None = None
    delta: float | None = None

    def __post_init__(self) -> None:
        if (self.budget is None) == (self.epsilon is None):
            raise ConfigError("calibrate: give exactly one target: --budget B (mean cost as a fraction of full depth) "
                              "or --epsilon E [--delta D] (allowed loss of quality with risk level delta)")
        if self.budget is not None:
            check_budget(self.budget)
            if self.delta is not None:
                raise ConfigError("--delta: the risk level goes with --epsilon; a --budget target has none")
        else:
            check_risk(self.epsilon, self.risk_level)

    @property
    def risk_level(self) -> float:
        return 0.1 if self.delta is None else self.delta


def check_scores(scores: Any, signal_name: str) -> None:
    """(N, T-1) finite-or-inf scores of a known signal, N >= 1 (ValueError naming the argument otherwise)."""
    if not isinstance(scores, Tensor):
        raise TypeError(f"scores: expected a (N, T-1) tensor; got {type(scores).__name__}")
    if scores.dim() != 2 or scores.shape[0] == 0 or scores.shape[1] == 0:
        raise ValueError(f"scores: expected a (N, T-1) tensor with N >= 1 samples and T >= 2 steps; "
                         f"got shape {tuple(scores.shape)}")
    if torch.isnan(scores).any():
        raise ValueError(f"scores: {int(torch.isnan(scores).sum())} NaN value(s) in the signal trace; "
                         f"a NaN score cannot be compared with a threshold")
    if not isinstance(signal_name, str) or signal_name not in SIGNALS:
        raise ValueError(f"signal_name: must be one of {list(SIGNALS)}; got {signal_name!r}")


def check_costs(costs: Any, steps: int) -> None:
    if not isinstance(costs, Tensor) or costs.dim() != 1 or costs.numel() != steps:
        shape = tuple(costs.shape) if isinstance(costs, Tensor) else type(costs).__name__
        raise ValueError(f"costs: expected a ({steps},) tensor, one cumulative cost per step (T = scores.shape[1] + 1); "
                         f"got {shape}")
    if not torch.isfinite(costs).all():
        raise ValueError("costs: NaN or infinite values; every step's cost must be a finite number")


#: how far a mean cost may sit above a budget and still meet it: costs are float32, where 1 step of 10 is 0.10000000149
BUDGET_ROUNDING = 1e-6


def calibrate_budget(scores: Tensor, costs: Tensor, budget: float, signal_name: str, to_param=lambda x: x) -> Calibration:
    """The largest threshold whose mean cost on these samples is at most ``budget`` (fraction of c_T = 1).

    Args:
        scores: (N, T-1) signal trace on calibration data.
        costs: (T,) normalised cumulative costs (c_T = 1; ``t / T`` counts steps).
        budget: B in (0, 1].
    Returns:
        A :class:`Calibration`; its realised mean cost is <= B, and the next larger candidate
        threshold would exceed B.
    """
    check_budget(budget)
    check_scores(scores, signal_name)
    check_costs(costs, scores.shape[1] + 1)
    if float(costs[0]) > budget + BUDGET_ROUNDING:
        raise ConfigError(f"--budget: {budget} is below the cost of the first step ({float(costs[0]):.3f}): "
                          "no rule can spend less")
    cand = candidate_thresholds(scores)
    cost = mean_cost_curve(scores, costs, cand)
    ok = (cost <= budget + BUDGET_ROUNDING).nonzero().flatten()
    if ok.numel() == 0:
        raise ConfigError(f"--budget: {budget} is below the least this {signal_name} rule can spend "
                          f"({float(cost.min()):.3f} of full depth: it is not asked before its first step)")
    k = int(ok.max())
    thr = float(cand[k])
    stops = first_crossing(scores, thr)
    return Calibration(rule=signal_name, param=to_param(thr), threshold=thr,
                       target={"kind": "budget", "budget": float(budget)},
                       calibration={"mean_cost": float(cost[k]), "mean_steps": float(stops.float().mean()),
                                    "samples": int(scores.shape[0])})


def calibrate_match(scores: Tensor, costs: Tensor, metric_at, better, goal: float, signal_name: str,
                    to_param=lambda x: x, max_candidates: int = 200) -> Calibration | None:
    """The cheapest threshold whose metric on these samples is at least as good as ``goal``: an empirical
    operating point, with no guarantee on new data (what is left when risk control has no lead to spend).

    Args:
        scores: (N, T-1) signal trace. costs: (T,) normalised cumulative costs.
        metric_at: (N,) stop times -> the aggregated metric there. better(a, b): a is at least as good as b.
    Returns:
        A :class:`Calibration` (target kind ``match``), or None when no threshold reaches ``goal``.
    """
    check_scores(scores, signal_name)
    check_costs(costs, scores.shape[1] + 1)
    cand = candidate_thresholds(scores, max_candidates)
    cost = mean_cost_curve(scores, costs, cand)
    for k in cost.argsort(stable=True).tolist():  # the cheapest first
        stops = first_crossing(scores, float(cand[k]))
        value = metric_at(stops)
        if better(value, goal):
            thr = float(cand[k])
            return Calibration(rule=signal_name, param=to_param(thr), threshold=thr,
                               target={"kind": "match", "goal": float(goal), "guarantee": "none (empirical)"},
                               calibration={"metric": float(value), "mean_cost": float(cost[k]),
                                            "mean_steps": float(stops.float().mean()), "samples": int(scores.shape[0])})
    return None
