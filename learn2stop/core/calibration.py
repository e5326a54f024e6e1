"""The inference setting (which stop rule, which parameter) and its calibration on held-out data.

One :class:`InferenceConfig` decides how a trained model stops, everywhere: validation during
training, evaluation, the frontier, benchmarks, the CLI and the Python API. A calibrator sets its
parameter on held-out data for what the user asks:

- :func:`calibrate_budget`: the most generous rule whose mean cost (steps, or the model's
  ``exit_costs`` such as FLOPs) is at most a budget B, as a fraction of full depth;
- :func:`calibrate_risk`: the cheapest rule whose metric is worse than full depth by at most
  epsilon, with the Learn-then-Test guarantee (Angelopoulos et al. 2021, as used by CALM): on new
  data drawn like the calibration data, the bound holds with probability at least 1 - delta.

Both work on a (N, T-1) score trace of one signal (see :mod:`learn2stop.core.rules`): the stop time
of threshold lam is the first t whose running maximum of scores reaches lam, so every candidate
threshold is scored at once without running the model again.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..runtime.registry import get_rule, list_rules
from ..utils.config import ConfigError, one_of, require
from .loop import Rollout
from .protocols import member
from .rules import SIGNALS, PolicyRule, first_crossing, make_signal, sampled_stop_times

CALIBRATION_FILE = "calibration.json"


def policy_rules(policy) -> tuple[str, ...]:
    """The policy rules (the registry's ``offered_by="policy"``) a policy supports: all of them for a planning
    policy, those that do not plan for a per-step one, and the planning ones alone for one that plans twice
    (``replan_step``)."""
    plans = member(policy, "plan_step") is not None
    if plans and member(policy, "replan_step") is not None:
        return tuple(list_rules(offered_by="policy", plans=True))
    return tuple(list_rules(offered_by="policy") if plans else list_rules(offered_by="policy", plans=False))


@dataclass
class InferenceConfig:
    """How a trained stopping model stops at test time."""

    rule: str = "quantile"
    """``quantile`` (stop once q_phi's CDF reaches ``param`` = alpha), ``threshold`` (stop when pi_t >= ``param``), a
    classical rule (``tolerance``, ``confidence``, ``entropy``, ``patience``), or ``fixed`` (every sample stops at
    step ``param``)."""
    param: float = 0.5
    """the rule's parameter."""
    sampled: bool = False
    """stop with probability pi_t instead (the paper's stochastic q_phi); ignores rule/param."""
    use_calibrated: bool = True
    """use ``calibration.json`` of the run directory when it exists."""
    serve_batch: int = 1
    """the batch size the model is served at: ``reproduce`` deploys the rule that is fastest at it among those
    certified to keep the baseline's quality, timed on this machine."""

    def __post_init__(self):
        one_of(self.rule, list(SIGNALS), "inference.rule")
        require(isinstance(self.param, (int, float)) and not isinstance(self.param, bool) and math.isfinite(self.param),
                "inference.param", f"must be a finite number; got {self.param!r}")
        check_param(self.rule, self.param, "inference.param")
        for name in ("sampled", "use_calibrated"):
            require(isinstance(getattr(self, name), bool), f"inference.{name}",
                    f"must be true or false; got {getattr(self, name)!r}")
        require(isinstance(self.serve_batch, int) and not isinstance(self.serve_batch, bool) and self.serve_batch >= 1,
                "inference.serve_batch", f"must be an integer >= 1; got {self.serve_batch!r}")

    @property
    def uses_policy(self) -> bool:
        return self.sampled or get_rule(self.rule).needs_policy

    def signal(self, policy=None, key=None):
        return make_signal(self.rule, policy, key)

    def make_rule(self, policy=None, generator: torch.Generator | None = None, key=None):
        """The online stop rule for :func:`~learn2stop.core.loop.run_with_early_exit`."""
        if self.sampled:
            if policy is None:
                raise ValueError("sampled inference needs a stopping policy, but the model has none")
            return PolicyRule(policy, mode="sample", generator=generator)
        signal = self.signal(policy, key)
        return signal.rule(signal.from_param(self.param))

    def stop_times(self, rollout: Rollout, generator: torch.Generator | None = None) -> Tensor:
        """Stop times of this rule read off a full rollout's stop logits (policy rules only)."""
        if not self.uses_policy:
            raise ValueError(f"stop times of the {self.rule!r} rule need the outputs; use signal_trace")
        if rollout.stop_logits is None:
            raise ValueError("this rule needs a policy's stop logits; the rollout has none")
        if rollout.replan_log_q is not None and (self.sampled or not get_rule(self.rule).plans):
            raise ValueError(f"the rollout's policy plans twice; its second plan is read by the price rule, not "
                             f"{'sampled inference' if self.sampled else f'the {self.rule} rule'}")
        if self.sampled:
            return sampled_stop_times(rollout.stop_logits, generator)
        scores = policy_scores(rollout.stop_logits, self.rule)
        if rollout.replan_log_q is not None:
            scores = SIGNALS[self.rule].revise(scores, rollout.replan_log_q, rollout.replan_step)
        return first_crossing(scores, SIGNALS[self.rule].from_param(self.param))


def check_param(rule: str, param: float, field: str) -> None:
    """Refuse a finite parameter outside the rule's range (its registry entry's ``in_range``), naming ``field``; a
    calibration may also hold inf (never stop early)."""
    entry = get_rule(rule)
    require(entry.in_range(param), field, f"the {rule} rule's parameter must be {entry.param_range}; got {param!r}")


def policy_scores(stop_logits: Tensor, rule: str) -> Tensor:
    """The (B, T-1) scores of a policy rule from stop logits, as its signal computes them online:
    pi_t, for the quantile rule -log prod_{s<=t} (1 - pi_s) (see :class:`QuantileSignal`), for the price
    rule minus the least price that stops by t (:class:`PriceSignal`)."""
    if rule not in SIGNALS or not get_rule(rule).needs_policy:
        raise ValueError(f"not a policy rule: {rule!r}")
    return SIGNALS[rule].scores(stop_logits)


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


@dataclass
class Calibration:
    """A calibrated rule: what was asked, what was chosen, and what it gave on the calibration data."""

    rule: str
    param: float
    threshold: float
    target: dict
    calibration: dict = field(default_factory=dict)
    test: dict = field(default_factory=dict)
    #: how the rule was chosen among others (``calibrate --fastest``: each candidate's speed and test result)
    chosen_by: dict = field(default_factory=dict)

    def make_rule(self, policy=None, key=None):
        return make_signal(self.rule, policy, key).rule(self.threshold)

    def to_dict(self) -> dict:
        d = asdict(self)
        if not d["chosen_by"]:
            del d["chosen_by"]
        for k in ("param", "threshold"):
            d[k] = d[k] if math.isfinite(d[k]) else None  # strict JSON: never stop early
        return d

    @classmethod
    def from_dict(cls, d: dict, where: str = "calibration") -> "Calibration":
        """A calibration from its JSON form; a bad field raises ConfigError naming ``where`` and the field."""
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: expected a JSON object; got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known, key=str)
        missing = sorted({"rule", "threshold", "target"} - set(d))
        if unknown or missing:
            raise ConfigError(f"{where}: " + (f"unknown field(s) {', '.join(map(str, unknown))}" if unknown else
                                              f"missing field(s) {', '.join(missing)}"))
        d = dict(d)
        require(d["rule"] in SIGNALS, f"{where}: rule", f"must be one of {list(SIGNALS)}; got {d['rule']!r}")
        for k in ("threshold", "param"):
            v = d.get(k)
            if v is None:  # strict JSON's null: never stop early
                d[k] = math.inf
                continue
            require(isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v), f"{where}: {k}",
                    f"must be a number (or null: never stop early); got {v!r}")
            d[k] = float(v)
        if "param" not in d:
            d["param"] = SIGNALS[d["rule"]].to_param(d["threshold"])
        if math.isfinite(d["param"]):
            check_param(d["rule"], d["param"], f"{where}: param")
        for k in ("target", "calibration", "test", "chosen_by"):
            require(isinstance(d.get(k, {}), dict), f"{where}: {k}", f"must be a JSON object; got {d.get(k)!r}")
        return cls(**d)


def _candidates(scores: Tensor, max_candidates: int | None = None) -> Tensor:
    """Distinct thresholds worth trying, ascending: the running maxima (and +inf = full depth)."""
    vals = scores.float().cummax(dim=1).values.flatten().unique()
    vals = vals[vals > -math.inf]  # -inf marks steps where the rule is not asked: no threshold may stop there
    if max_candidates and vals.numel() > max_candidates:
        q = torch.linspace(0, 1, max_candidates, dtype=torch.float64)
        vals = torch.quantile(vals.double(), q).float().unique()
    return torch.cat([vals, vals.new_full((1,), math.inf)])


def check_budget(budget: float, flag: str = "--budget") -> None:
    if not (isinstance(budget, (int, float)) and math.isfinite(budget) and 0 < budget <= 1):
        raise ConfigError(f"{flag}: the budget is a fraction of full depth in (0, 1]; got {budget!r}")


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


def _check_scores(scores: Any, signal_name: str) -> None:
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


def _check_costs(costs: Any, steps: int) -> None:
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
    _check_scores(scores, signal_name)
    _check_costs(costs, scores.shape[1] + 1)
    if float(costs[0]) > budget + BUDGET_ROUNDING:
        raise ConfigError(f"--budget: {budget} is below the cost of the first step ({float(costs[0]):.3f}): "
                          "no rule can spend less")
    cand = _candidates(scores)
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
    _check_scores(scores, signal_name)
    _check_costs(costs, scores.shape[1] + 1)
    cand = _candidates(scores, max_candidates)
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


# ----------------------------------------------------------------------------- risk control (LTT)
def _log_binom_cdf(k: int, n: int, p: float) -> float:
    """log P(Binomial(n, p) <= k), summed in log space (float64)."""
    if k < 0:
        return -math.inf
    if k >= n or p <= 0:
        return 0.0
    if p >= 1:
        return -math.inf
    i = torch.arange(0, k + 1, dtype=torch.float64)
    logpmf = (torch.lgamma(torch.tensor(n + 1.0, dtype=torch.float64)) - torch.lgamma(i + 1) - torch.lgamma(n - i + 1)
              + i * math.log(p) + (n - i) * math.log1p(-p))
    return float(torch.logsumexp(logpmf, 0))


def hoeffding_bentkus_pvalue(risk_hat: float, n: int, epsilon: float) -> float:
    """Valid p-value for H0: E[loss] > epsilon, for losses in [0, 1] (Bates et al. 2021, Prop. 3)."""
    if risk_hat >= epsilon:
        return 1.0
    h = lambda a, b: a * math.log(a / b) + (1 - a) * math.log((1 - a) / (1 - b)) if 0 < a < 1 else (
        math.log(1 / (1 - b)) if a == 0 else math.log(1 / b))
    hoeffding = math.exp(-n * h(min(risk_hat, epsilon), epsilon)) if epsilon < 1 else 1.0
    bentkus = math.e * math.exp(_log_binom_cdf(math.ceil(n * risk_hat), n, epsilon))
    return min(1.0, hoeffding, bentkus)


def clt_pvalue(losses: Tensor, epsilon: float) -> float:
    """Asymptotic p-value for H0: E[loss] > epsilon from the one-sided normal approximation."""
    n = losses.numel()
    mean, std = float(losses.double().mean()), float(losses.double().std()) if n > 1 else 0.0
    if std == 0:
        return 0.0 if mean <= epsilon else 1.0
    z = (epsilon - mean) / (std / math.sqrt(n))
    return 0.5 * math.erfc(z / math.sqrt(2))


def check_risk(epsilon: float, delta: float) -> None:
    if not (isinstance(epsilon, (int, float)) and math.isfinite(epsilon) and epsilon >= 0):
        raise ConfigError(f"--epsilon: the allowed loss of quality must be a finite number >= 0; got {epsilon!r}")
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise ConfigError(f"--delta: the risk level must be in (0, 1); got {delta!r}")


def calibrate_risk(scores: Tensor, risk_losses: Tensor, epsilon: float, delta: float, signal_name: str,
                   costs: Tensor | None = None, loss_range: tuple[float, float] | None = None,
                   to_param=lambda x: x, max_candidates: int = 200) -> Calibration:
    """Learn-then-Test: the cheapest threshold whose risk is certified <= epsilon at level delta.

    Args:
        scores: (N, T-1) signal trace on calibration data.
        risk_losses: (N, T) per-sample excess loss of stopping at t (0 at full depth by construction,
            e.g. error_t - error_T); the risk of a rule is the mean at its stop times.
        epsilon: allowed risk. delta: the probability that the bound may fail.
        loss_range: known bounds (a, b) of the losses: Hoeffding-Bentkus p-values (finite-sample
            valid). None: the CLT p-value (asymptotically valid).
    Thresholds are tested in fixed sequence from the most conservative (full depth) down, stopping
    at the first that fails; fixed-sequence testing controls the family-wise error at delta.
    """
    check_risk(epsilon, delta)
    _check_scores(scores, signal_name)
    N, T = scores.shape[0], scores.shape[1] + 1
    if not isinstance(risk_losses, Tensor) or tuple(risk_losses.shape) != (N, T):
        shape = tuple(risk_losses.shape) if isinstance(risk_losses, Tensor) else type(risk_losses).__name__
        raise ValueError(f"risk_losses: expected ({N}, {T}), one loss per sample and step of the scores; got {shape}")
    if not torch.isfinite(risk_losses).all():
        raise ValueError(f"risk_losses: {int((~torch.isfinite(risk_losses)).sum())} NaN or infinite value(s); "
                         f"the risk of a rule is a mean of these losses and must be finite")
    if costs is not None:
        _check_costs(costs, T)
    if loss_range is not None:
        ok = (isinstance(loss_range, (tuple, list)) and len(loss_range) == 2
              and all(isinstance(v, (int, float)) and math.isfinite(v) for v in loss_range) and loss_range[0] < loss_range[1])
        if not ok:
            raise ValueError(f"loss_range: expected two finite numbers (a, b) with a < b; got {loss_range!r}")
    costs = costs if costs is not None else torch.arange(1, T + 1, dtype=torch.float32) / T
    cand = _candidates(scores, max_candidates).flip(0)  # +inf (full depth) first, then ever more aggressive
    chosen, tested = None, 0
    for thr in cand.tolist():
        stops = first_crossing(scores, thr)
        losses = risk_losses.gather(1, (stops - 1).unsqueeze(1).to(risk_losses.device)).squeeze(1).double()
        if loss_range is not None:
            a, b = loss_range
            p = hoeffding_bentkus_pvalue(float((losses.mean() - a) / (b - a)), N, (epsilon - a) / (b - a))
        else:
            p = clt_pvalue(losses, epsilon)
        tested += 1
        if p > delta:
            break
        chosen = (thr, float(losses.mean()), stops, p)
    if chosen is None:  # not even full depth certified (epsilon = 0 with noisy losses): never stop early
        thr, risk, stops, p = math.inf, 0.0, torch.full((N,), T), 0.0
    else:
        thr, risk, stops, p = chosen
    return Calibration(rule=signal_name, param=to_param(thr), threshold=thr,
                       target={"kind": "risk", "epsilon": float(epsilon), "delta": float(delta),
                               "p_value": "hoeffding-bentkus" if loss_range is not None else "clt"},
                       calibration={"risk": risk, "p_value": p, "thresholds_tested": tested,
                                    "mean_steps": float(stops.float().mean()),
                                    "mean_cost": float(costs[stops - 1].mean()), "samples": N})


# ----------------------------------------------------------------------------- persistence
def calibration_mismatch(path: Path) -> str | None:
    """Why ``path`` is not a calibration of ours (None: it is one, of this run format, field by field)."""
    try:
        read_calibration(path)
    except (OSError, UnicodeDecodeError, ValueError) as e:  # ConfigError is a ValueError
        return str(e) if isinstance(e, ConfigError) else "not valid JSON"
    return None


def check_calibration_replace(run_dir: str | Path) -> None:
    """Refuse, before any work, a calibration whose earlier one could not be kept (``calibration.previous.json``
    holds something not ours): :func:`save_calibration` never drops a calibration unseen."""
    from ..utils.outputs import check_previous_file

    check_previous_file(Path(run_dir) / CALIBRATION_FILE, calibration_mismatch, "calibration")


def save_calibration(cal: Calibration, run_dir: str | Path) -> Path:
    """Write ``cal`` as the run's ``calibration.json`` (atomic, with the run format); one it replaces is kept in
    ``calibration.previous.json`` first (an older one there only replaced if it is a calibration too)."""
    from ..utils.formats import RUN_FORMAT
    from ..utils.outputs import keep_previous_file
    from ..utils.report import write_json

    path = Path(run_dir) / CALIBRATION_FILE
    keep_previous_file(path, calibration_mismatch, "calibration")
    write_json({"format": RUN_FORMAT, **cal.to_dict()}, path)
    return path


def read_calibration(path: Path) -> Calibration:
    """A calibration file, checked: its run format first (a file of another one is not read field by field), then
    field by field."""
    from ..utils.formats import RUN_FORMAT, format_refusal

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:
        raise ConfigError(f"{path} is not a valid calibration file ({e}); calibrate again or delete it") from None
    if isinstance(data, dict):
        if data.get("format", 0) != RUN_FORMAT:
            raise ConfigError(format_refusal(str(path), data.get("format", 0)))
        data = {k: v for k, v in data.items() if k != "format"}
    try:
        return Calibration.from_dict(data, where=str(path))
    except ConfigError as e:
        raise ConfigError(f"{e}; calibrate again or delete the file") from None


def load_calibration(run_dir: str | Path) -> Calibration | None:
    """The run's ``calibration.json``, checked (:func:`read_calibration`; None if there is none)."""
    path = Path(run_dir) / CALIBRATION_FILE
    return read_calibration(path) if path.is_file() else None


def active_rule(inference: InferenceConfig, run_dir: str | Path | None, policy=None, key=None,
                generator: torch.Generator | None = None) -> tuple[Any, str]:
    """The rule a command uses: the run's calibrated rule if any (and allowed), else ``inference``'s.

    Returns (rule, description).
    """
    if not isinstance(inference, InferenceConfig):
        raise TypeError(f"inference: expected an InferenceConfig (e.g. InferenceConfig(rule='quantile', param=0.5)); "
                        f"got {inference!r}")
    cal = load_calibration(run_dir) if (run_dir is not None and inference.use_calibrated and not inference.sampled) else None
    if cal is not None:
        desc = f"calibrated {cal.rule} rule ({cal.target}), {cal.rule} parameter {cal.param:.4g}"
        return cal.make_rule(policy, key), desc
    desc = "sampled policy" if inference.sampled else f"{inference.rule} rule, parameter {inference.param:g}"
    return inference.make_rule(policy, generator, key), desc
