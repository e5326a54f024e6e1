"""Risk control (Learn-then-Test, Angelopoulos et al. 2021, as used by CALM): the cheapest threshold whose risk is
certified at most epsilon; on new data drawn like the calibration data, the bound holds with probability at least
1 - delta."""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .calibration import candidate_thresholds, check_costs, check_risk, check_scores
from .calibration_file import Calibration
from .rules import first_crossing


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


def risk_p_value(losses: Tensor, epsilon: float, loss_range: tuple[float, float] | None = None) -> float:
    """The p-value of H0: E[loss] > epsilon from per-sample losses: Hoeffding-Bentkus for losses known to lie in
    ``loss_range`` (finite-sample valid), else the CLT's (asymptotically valid)."""
    if loss_range is None:
        return clt_pvalue(losses, epsilon)
    a, b = loss_range
    return hoeffding_bentkus_pvalue(float((losses.double().mean() - a) / (b - a)), losses.numel(), (epsilon - a) / (b - a))


def fixed_sequence(thresholds, losses_at, epsilon: float, delta: float,
                   loss_range: tuple[float, float] | None = None) -> tuple[tuple | None, int]:
    """Fixed-sequence testing (family-wise error at most delta): thresholds are tested in the given order, each
    rejected H0 (risk > epsilon) lets the next be tested, the first that fails ends the sequence.

    ``losses_at(thr) -> (losses (N,), stops (N,))`` gives the per-sample risk losses of the rule at a threshold and
    where it stops (computed from a trace, or measured by running the model with the rule: only the thresholds
    tested are asked). Returns ((thr, risk, stops, p) of the last certified threshold, or None; thresholds tested).
    """
    chosen, tested = None, 0
    for thr in thresholds:
        losses, stops = losses_at(thr)
        p = risk_p_value(losses, epsilon, loss_range)
        tested += 1
        if p > delta:
            break
        chosen = (thr, float(losses.double().mean()), stops, p)
    return chosen, tested


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
    check_scores(scores, signal_name)
    N, T = scores.shape[0], scores.shape[1] + 1
    if not isinstance(risk_losses, Tensor) or tuple(risk_losses.shape) != (N, T):
        shape = tuple(risk_losses.shape) if isinstance(risk_losses, Tensor) else type(risk_losses).__name__
        raise ValueError(f"risk_losses: expected ({N}, {T}), one loss per sample and step of the scores; got {shape}")
    if not torch.isfinite(risk_losses).all():
        raise ValueError(f"risk_losses: {int((~torch.isfinite(risk_losses)).sum())} NaN or infinite value(s); "
                         f"the risk of a rule is a mean of these losses and must be finite")
    if costs is not None:
        check_costs(costs, T)
    if loss_range is not None:
        ok = (isinstance(loss_range, (tuple, list)) and len(loss_range) == 2
              and all(isinstance(v, (int, float)) and math.isfinite(v) for v in loss_range) and loss_range[0] < loss_range[1])
        if not ok:
            raise ValueError(f"loss_range: expected two finite numbers (a, b) with a < b; got {loss_range!r}")
        low, high = float(risk_losses.min()), float(risk_losses.max())
        if low < loss_range[0] or high > loss_range[1]:
            raise ValueError(f"risk_losses: a loss of {low if low < loss_range[0] else high:g} lies outside the declared "
                             f"loss_range ({loss_range[0]:g}, {loss_range[1]:g}); the Hoeffding-Bentkus p-value holds for "
                             f"losses in that range only: declare the range the losses really have, or pass "
                             f"loss_range=None (the CLT p-value)")
    costs = costs if costs is not None else torch.arange(1, T + 1, dtype=torch.float32) / T

    def at(thr: float) -> tuple[Tensor, Tensor]:
        stops = first_crossing(scores, thr)
        return risk_losses.gather(1, (stops - 1).unsqueeze(1).to(risk_losses.device)).squeeze(1), stops

    cand = candidate_thresholds(scores, max_candidates).flip(0)  # +inf (full depth) first, then ever more aggressive
    return certify(cand.tolist(), at, epsilon, delta, signal_name, costs, loss_range, to_param)


def certify(thresholds, losses_at, epsilon: float, delta: float, signal_name: str, costs: Tensor,
            loss_range: tuple[float, float] | None = None, to_param=lambda x: x) -> Calibration:
    """The calibration record of :func:`fixed_sequence` over ``thresholds`` (the first must be +inf, full depth):
    the last certified threshold, or never stopping early, with full depth's own risk and p-value, where not even
    full depth is certified (its risk over a reference's is above epsilon). ``costs`` (T,) gives the mean cost."""
    chosen, tested = fixed_sequence(thresholds, losses_at, epsilon, delta, loss_range)
    if chosen is None:
        losses, stops = losses_at(math.inf)
        thr, risk, p = math.inf, float(losses.double().mean()), risk_p_value(losses, epsilon, loss_range)
    else:
        thr, risk, stops, p = chosen
    return Calibration(rule=signal_name, param=to_param(thr), threshold=thr,
                       target={"kind": "risk", "epsilon": float(epsilon), "delta": float(delta),
                               "p_value": "hoeffding-bentkus" if loss_range is not None else "clt"},
                       calibration={"risk": risk, "p_value": p, "thresholds_tested": tested,
                                    "mean_steps": float(stops.float().mean()),
                                    "mean_cost": float(costs[stops - 1].mean()), "samples": int(stops.numel())})
