"""The ``calibrate`` command: a rule's parameter set on the validation split for a budget or a certified quality
loss, scored on test and saved as the run's ``calibration.json``; with ``fastest``, every rule timed and the
fastest kept. Also the side-by-side timing of calibrated rules that ``deploy`` and ``frontier`` share."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import torch

from ..utils.config import ConfigError
from ..utils.outputs import previous_path
from .calibration import CalibrationTarget, calibrate_budget
from .calibration_file import CALIBRATION_FILE, Calibration, check_calibration_replace, save_calibration
from .risk_control import calibrate_risk
from .curves import (budget_costs, rule_costs)
from .timing import fastest_certified, speed_tie, speeds_side_by_side
from .trace import Trace
from .model import StoppingModel
from .trees import tree_leaves, tree_map, tree_select
from .rules import first_crossing
from .signal_registry import SIGNALS
from .task import (Run, StoppingApp, calibrated_rule, check_policy_rule, check_rule, model_rules,
                   require_trained, rule_signal, stop_model_trace)
from .train import load_stage



def calibrate_each(app: StoppingApp, cfg: Any, sm: StoppingModel, val: Trace, test: Trace, rules: list[str],
                    calibrate: Callable[[str, torch.Tensor, torch.Tensor, Callable], Calibration | None]
                    ) -> dict[str, Calibration]:
    """Each rule calibrated on the validation trace by ``calibrate(rule, scores, costs, to_param)`` and scored on the
    test trace (``Calibration.test``). ``costs`` are what the task's budget counts for the rule (``budget_costs``: a
    fixed depth reads no earlier exit, so by cost it costs the model's fixed-depth costs, the FLOPs of an early-exit
    network without the skipped exits). A rule that cannot reach the target (``calibrate`` gives None) is left out."""
    metric = app.metric(cfg)
    test_losses, _ = app.risk_losses(cfg, test)
    out: dict[str, Calibration] = {}
    for r in rules:
        cal = calibrate(r, val.signals[r], budget_costs(val, app.budget_by, r), rule_signal(app, cfg, sm, r).to_param)
        if cal is None:
            continue
        stops = first_crossing(test.signals[r], cal.threshold)
        cal.test = {"metric": metric(test.at(stops), test.extras),
                    "full_depth_metric": metric(test.metric[:, -1], test.extras),
                    "mean_steps": float(stops.float().mean()), "mean_cost": float(rule_costs(test, r)[stops - 1].mean()),
                    "risk": float(test_losses.gather(1, (stops - 1)[:, None]).mean()), "samples": int(stops.numel())}
        cal.calibration["metric"] = metric(val.at(first_crossing(val.signals[r], cal.threshold)), val.extras)
        out[r] = cal
    return out


def timing_passes(app: StoppingApp, size: int) -> int:
    """Round-robin timing passes at a batch size: a pass at batch 1 is short (``speed_samples`` requests) and jitters
    on a shared CPU, so it gets three times the task's ``speed_passes``."""
    return app.speed_passes * (3 if size == 1 else 1)


def timing_slice(app: StoppingApp, inputs: Any, size: int) -> Any:
    """The part of the (shuffled) speed inputs timed at a batch size: ``speed_samples`` requests one by one at batch
    1, else up to ``speed_batches`` full batches. ``size`` is at most the number of inputs."""
    n_in = tree_leaves(inputs)[0].shape[0]
    count = min(app.speed_samples, n_in) if size == 1 else size * max(1, min(n_in // size, app.speed_batches))
    return tree_map(lambda x: x[:count], inputs)


def time_rules(app: StoppingApp, cfg: Any, run: Run, jobs: dict[str, tuple[Any, Callable[[], Any]]],
               sizes: tuple[int, ...]) -> tuple[dict[str, dict[int, float]], str, dict[int, int], dict[str, dict[int, float]]]:
    """Samples/s of each named ``(model, rule_factory)`` job at each batch size, side by side (round-robin passes,
    the best each: :func:`speeds_side_by_side`; :func:`timing_passes` of them) on the task's speed inputs, with the
    run's first backend (eager torch by default). Returns ({name: {size: samples/s}}, backend name, {asked size: size
    timed}, {name: {size: spread of its passes}} (:func:`~learn2stop.core.timing.pass_spread`)); a size is capped at
    the number of speed inputs, and a job the backend cannot run has no entry."""
    inputs = shuffled(app.speed_inputs(cfg, run.device))
    n_in = tree_leaves(inputs)[0].shape[0]
    bname, runner = next(iter(run.runners.items()))
    names = list(jobs)
    out: dict[str, dict[int, float]] = {n: {} for n in names}
    spread: dict[str, dict[int, float]] = {n: {} for n in names}
    timed: dict[int, int] = {}
    skip: set[int] = set()
    for asked in sizes:
        size = timed[asked] = min(asked, n_in)
        spreads: list = []
        got = speeds_side_by_side([jobs[n] for n in names], timing_slice(app, inputs, size), size,
                                  timing_passes(app, size), runner, skip=skip,
                                  log=lambda m: run.log(f"timing ({bname}): {m}"), spreads=spreads)
        for n, v, d in zip(names, got, spreads):
            if v is not None:
                out[n][size], spread[n][size] = v, d
    return {n: v for n, v in out.items() if v}, bname, timed, {n: v for n, v in spread.items() if v}


# ----------------------------------------------------------------------------- commands
def calibrate_command(app: StoppingApp, cfg: Any, run: Run, target: CalibrationTarget, *,
                      rule: str | None = None, fastest: bool = False, speed_batch: int | None = None) -> Calibration:
    """Calibrate a rule (default ``inference.rule``) on the validation split for ``target``; save and report it.

    ``fastest``: calibrate every rule of the task (the policy's, the classical ones, a fixed depth) for the same
    target, time each calibrated rule side by side at batch ``speed_batch`` (default the task's speed batch) on
    this machine, and save the fastest: the rule a user deploys when what stopping must buy is time. Each
    candidate's speed and test result are kept in the saved calibration's ``chosen_by``.
    """
    if not isinstance(target, CalibrationTarget):
        raise TypeError(f"target: expected a CalibrationTarget(budget=...) or CalibrationTarget(epsilon=..., delta=...); "
                        f"got {type(target).__name__}")
    if fastest and rule is not None:
        raise ConfigError("--rule: --fastest tries every rule of the task and keeps the fastest; give one or the other")
    if speed_batch is not None and (isinstance(speed_batch, bool) or not isinstance(speed_batch, int) or speed_batch < 1):
        raise ConfigError(f"--speed-batch: the batch size timed must be an integer >= 1; got {speed_batch!r}")
    if speed_batch is not None and not fastest:
        raise ConfigError("--speed-batch: only calibrate --fastest times rules; add --fastest or drop it")
    require_trained(run.run_dir, app.stop_stage, "calibrate")
    check_calibration_replace(run.run_dir)  # before any work: the calibration this replaces can be kept
    sm = load_stage(app, cfg, run.run_dir, app.stop_stage, run.device)
    if fastest:
        rules = model_rules(app, cfg, sm)
    else:
        rules = [rule or app.inference(cfg).rule]
        check_rule(app, cfg, rules[0], "--rule")
        if SIGNALS[rules[0]].needs_policy and sm.policy is None:
            raise ConfigError(f"--rule: the {rules[0]!r} rule needs a policy; stage {app.stop_stage!r} has none")
        check_policy_rule(rules[0], sm, "--rule")
    val = stop_model_trace(app, cfg, sm, "val", run.device)
    test = stop_model_trace(app, cfg, sm, "test", run.device)

    losses, rng = app.risk_losses(cfg, val) if target.budget is None else (None, None)

    def calibrate(r: str, scores: torch.Tensor, costs: torch.Tensor, to_param) -> Calibration:
        if target.budget is not None:
            return calibrate_budget(scores, costs, target.budget, r, to_param)
        return calibrate_risk(scores, losses, target.epsilon, target.risk_level, r, costs=costs, loss_range=rng,
                              to_param=to_param)

    cals = calibrate_each(app, cfg, sm, val, test, rules, calibrate)
    if fastest:
        cal = _fastest_calibration(app, cfg, run, sm, cals, speed_batch)
    else:
        cal = cals[rules[0]]
    path = Path(run.run_dir) / CALIBRATION_FILE
    replacing = path.is_file()
    if run.ctx.is_main:
        save_calibration(cal, run.run_dir)
    run.log(f"calibrated {cal.rule} rule: {SIGNALS[cal.rule].param_name} = {cal.param:.4g} for {cal.target}\n"
            f"  validation: {cal.calibration}\n  test: {cal.test}\n  saved to {path}"
            + (f"; the calibration it replaces is kept in {previous_path(path)}" if replacing else ""))
    return cal


def _fastest_calibration(app: StoppingApp, cfg: Any, run: Run, sm: StoppingModel, cals: dict[str, Calibration],
                         speed_batch: int | None) -> Calibration:
    """The calibrated rule that runs fastest at batch ``speed_batch`` (:func:`time_rules`), speeds within the timing
    noise (:func:`~learn2stop.core.timing.speed_tie` of the passes' spreads) tied and the tie going to the least
    validation cost (:func:`~learn2stop.core.timing.fastest_certified`); the others' speeds and test results
    recorded with it (``Calibration.chosen_by``)."""
    speeds, bname, sizes, spreads = time_rules(app, cfg, run, {r: (sm.model, lambda c=c: calibrated_rule(app, cfg, sm, c))
                                                               for r, c in cals.items()}, (speed_batch or app.speed_batch,))
    size = next(iter(sizes.values()))
    timed = {r: v[size] for r, v in speeds.items()}
    if not timed:
        raise ConfigError(f"calibrate --fastest: the {bname} backend runs none of the calibrated rules")
    tie = speed_tie([v.get(size) for v in spreads.values()])
    best = fastest_certified(timed, {r: c.calibration["mean_cost"] for r, c in cals.items()}, tie)
    cal = cals[best]
    cal.target = {**cal.target, "fastest_at_batch": size, "tie": tie}
    cal.chosen_by = {"batch_size": size, "backend": bname, "device": str(run.device or "cpu"),
                     "passes": timing_passes(app, size), "samples_per_s": timed, "tie": tie,
                     "candidates": {r: {"param": c.param if math.isfinite(c.param) else None, "test": c.test,
                                        "mean_cost": c.calibration["mean_cost"]}
                                    for r, c in cals.items()}}
    rows = "\n".join(f"  {r:<11} {f'{timed[r]:,.0f}' if r in timed else '-':>12} samples/s   test {c.test['metric']:.4g} "
                     f"at {c.test['mean_steps']:.2f} steps" + ("   <- deployed" if r == best else "") for r, c in cals.items())
    run.log(f"calibrate --fastest: every rule calibrated for the same target, timed at batch {size} ({bname}, "
            f"{timing_passes(app, size)} passes, the best each); speeds within {100 * tie:.1f} % of the fastest (the "
            f"passes' spread) are a tie, going to the least cost on validation:\n{rows}")
    return cal


def shuffled(inputs: Any, seed: int = 0) -> Any:
    """A batch-first tree in a fixed random order. The frontier times the first samples of its test inputs one by
    one; test sets come grouped (by SNR, noise level, class), and the first ones would be one group (measured on
    sparse: the first 200 are all SNR 20, which the learned rule runs 14.0 steps against 13.4 on the whole set)."""
    order = torch.randperm(tree_leaves(inputs)[0].shape[0], generator=torch.Generator().manual_seed(seed))
    return tree_select(inputs, order.to(tree_leaves(inputs)[0].device))
