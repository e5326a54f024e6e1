"""Guard-rails: a degenerate result warns, naming the fix, instead of passing quietly.

Each check is a plain function of numbers already measured, so it can be tested alone; the API's functions call
them where the numbers appear (after a stage that trains the model, after a certified calibration, after timing).
"""
from __future__ import annotations

import math
import warnings
from typing import Callable, Sequence


class StoppingWarning(UserWarning):
    """Base of learn2stop's warnings about a degenerate result."""


class DegenerateDepthWarning(StoppingWarning):
    """The full depth is worse than an earlier step: the training left the late steps wrecked."""


class CalibrationWarning(StoppingWarning):
    """A certified calibration that ends at never stopping early, or certifies against a reference that is worse
    than a fixed depth of the model."""


class RuleCostWarning(StoppingWarning):
    """A rule whose own cost exceeds what its saved steps buy, at the batch size it was timed at."""


#: how much better (relative to the scale of the values) an earlier step must be before the full depth counts as worse
RELATIVE_MARGIN = 1e-3
#: how much slower than full depth a rule must run before it counts as slower (timing noise on a shared machine)
SPEED_MARGIN = 0.03


def _gain(better: Callable[[float, float], bool], a: float, b: float) -> float:
    """How much better a is than b (>= 0 when a is at least as good)."""
    return abs(a - b) if better(a, b) else -abs(a - b)


def check_full_depth(per_step: Sequence[float], better: Callable[[float, float], bool], what: str,
                     stacklevel: int = 3) -> int | None:
    """Warn when the last of ``per_step`` (an aggregated loss or metric at steps 1..T) is worse than the best
    step by more than :data:`RELATIVE_MARGIN` of its size. Returns the best step (1-based) when it warned."""
    values = [float(v) for v in per_step]
    T = len(values)
    best = max(range(T), key=lambda i: (_gain(better, values[i], values[-1]), -i))
    lead = _gain(better, values[best], values[-1])
    if best == T - 1 or not math.isfinite(lead) or lead <= RELATIVE_MARGIN * max(abs(values[best]), abs(values[-1])):
        return None
    warnings.warn(f"{what}: the full depth (step {T}) scores {values[-1]:.4g}, worse than step {best + 1} "
                  f"({values[best]:.4g}): the late steps are wrecked (Stage I's oracle puts little weight on steps it "
                  f"rarely picks). Fix: a larger beta (every step weighted), a deep-supervision stage first "
                  f"(StageConfig(objective='deep_supervision')), or serve FixedDepth({best + 1})",
                  DegenerateDepthWarning, stacklevel=stacklevel)
    return best + 1


def check_certified(rule: str, mean_steps: float, num_steps: int, epsilon: float, stacklevel: int = 3) -> bool:
    """Warn when a certified calibration stops nothing early (mean steps T); True when it warned."""
    if mean_steps < num_steps - 1e-9:
        return False
    warnings.warn(f"calibrate: the {rule} rule certified for epsilon {epsilon:g} never stops early (every sample "
                  f"runs all {num_steps} steps): nothing is saved. Fix: a larger epsilon, more calibration samples, "
                  f"loss_range=(a, b) for finite-sample p-values, or, if an earlier step is better than the full "
                  f"depth, reference=<that step>", CalibrationWarning, stacklevel=stacklevel)
    return True


def check_reference(reference: str, ref_metric: float, fixed: Sequence[float], better: Callable[[float, float], bool],
                    epsilon: float, stacklevel: int = 3) -> int | None:
    """Warn when a fixed depth of the model is better than the reference by more than epsilon (and than
    :data:`RELATIVE_MARGIN` of its size): a quality loss certified against that reference permits a result worse
    than a plain fixed depth. Returns the best depth when it warned."""
    best = max(range(len(fixed)), key=lambda i: (_gain(better, fixed[i], ref_metric), -i))
    lead = _gain(better, fixed[best], ref_metric)
    if lead <= max(epsilon, RELATIVE_MARGIN * abs(ref_metric)):
        return None
    warnings.warn(f"calibrate: the reference ({reference}) scores {ref_metric:.4g}, worse than the model's fixed depth "
                  f"{best + 1} ({fixed[best]:.4g}) by more than epsilon {epsilon:g}: the certified rule may be worse "
                  f"than FixedDepth({best + 1}). Fix: reference={best + 1}, or retrain the late steps",
                  CalibrationWarning, stacklevel=stacklevel)
    return best + 1


def check_rule_cost(name: str, batch_size: int, rule_speed: float, full_speed: float, mean_steps: float,
                    num_steps: int, stacklevel: int = 3) -> bool:
    """Warn when a rule runs slower than full depth at a batch size (by more than :data:`SPEED_MARGIN`): its own cost
    (policy calls, readouts, batch compaction) exceeds what its saved steps buy. True when it warned."""
    if rule_speed >= full_speed * (1 - SPEED_MARGIN):
        return False
    warnings.warn(f"at batch {batch_size} the {name} rule runs {rule_speed:,.0f} samples/s against full depth's "
                  f"{full_speed:,.0f}: its own cost exceeds what its {num_steps - mean_steps:.2f} saved steps of "
                  f"{num_steps} buy. Fix: serve a fixed depth of that quality (calibrate(..., rule='fixed')), a larger "
                  f"batch, or a cheaper policy (min_step, fewer features)", RuleCostWarning, stacklevel=stacklevel)
    return True
