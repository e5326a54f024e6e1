"""The operating point ``reproduce`` deploys.

Every rule of the stop model is certified on validation to keep the baseline's full-depth quality and timed
beside the baseline (``in_time.md`` / ``in_time.json``); the fastest at the served batch size is deployed
(``calibration.json``), or the baseline itself (``deployment.json`` with the reason) where it is faster or
nothing reaches its quality. :func:`~learn2stop.core.deployment.load_deployment` reads that back for the commands
that serve inputs."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import torch

from ..utils.formats import RUN_FORMAT
from ..utils.report import write_json, write_text_atomic
from .calibration import calibrate_match
from .calibration_file import Calibration, load_calibration, save_calibration
from .risk_control import calibrate_risk
from .curves import (budget_costs)
from .trace import Trace, collect_trace
from .model import StoppingModel
from .rules import FixedDepth
from .signal_registry import SIGNALS, make_signal
from .signals import DepthSignal
from .calibrate import calibrate_each, time_rules, timing_passes
from .timing import SPEED_TIE_CAP, SPEED_TIE_FLOOR, fastest_certified, speed_tie
from .deployment import DEPLOYMENT_FILE
from .task import Run, StoppingApp, calibrated_rule, model_rules, stop_model_trace
from .train import load_stage



def deploy_calibration(app: StoppingApp, cfg: Any, run: Run, *, delta: float = 0.1) -> Calibration | None:
    """The operating point a user deploys: keep the baseline's quality, with a guarantee, as fast as it goes.

    The policy rule (``inference.rule``, or ``quantile``) is calibrated by Learn-then-Test on the validation
    split with epsilon = the stop model's lead over the baseline at full depth (:meth:`StoppingApp.quality_lead`),
    so that with probability at least 1 - delta its quality on new data is at least the baseline's full depth.
    Saved as the run's ``calibration.json`` (used by ``evaluate``), unless the run already has one (a user's
    own calibration wins). With no lead at full depth (an earlier exit may still be better than the last), the
    cheapest threshold that matches the baseline's full depth on validation, empirically, with no guarantee
    (target kind ``match``). None when no threshold reaches it: then the run deploys the baseline at full depth,
    recorded with the reason in ``deployment.json`` (:func:`~learn2stop.core.deployment.served_baseline`).

    Every other rule of the stop model (the other policy rules, the classical ones, a fixed depth) is calibrated for
    the same target too, and each is timed side by side with the baseline at full depth at batch 1, at
    ``inference.serve_batch`` and at the task's speed batch: ``in_time.json`` / ``in_time.md``
    (:func:`deployment_in_time`). What is deployed is what a user serving at ``serve_batch`` would pick: the fastest of
    them there (:func:`fastest_certified`: ties within the timing's own spread, :func:`speed_tie`, go to the least cost on
    validation), which
    may be a fixed depth (it then answers as the policy would, without a policy call), a classical rule, or the
    baseline itself when every certified rule runs slower than it. The saved calibration's ``target["instead_of"]``
    names the policy rule it replaced. With ``app.deploy_in_time`` off (nothing timed), a fixed depth is deployed
    where it costs no more on validation than the policy rule.
    """
    if load_calibration(run.run_dir) is not None or not app.baseline_stage:
        return None
    sm = load_stage(app, cfg, run.run_dir, app.stop_stage, run.device)
    if sm.policy is None:
        return None
    rule = app.policy_rule(cfg)
    val = stop_model_trace(app, cfg, sm, "val", run.device, with_classical=app.deploy_in_time)
    base = load_stage(app, cfg, run.run_dir, app.baseline_stage, run.device)
    base_val = collect_trace(base.model, app.eval_batches(cfg, "val", run.device), app.metric(cfg), run.device,
                             extras=app.trace_extras(cfg))
    lead = app.quality_lead(cfg, val, base_val)
    metric = app.metric(cfg)
    reference = f"{app.baseline_stage} at full depth"
    if lead > 0:
        losses, rng = app.risk_losses(cfg, val)
        how = f"epsilon = the stop model's lead {lead:.4g}, delta {delta:g}"
    else:  # no lead at full depth, yet an earlier exit may still match the baseline (a better middle exit)
        goal = metric(base_val.metric[:, -1], base_val.extras)
        how = f"no full-depth lead ({lead:.4g}) to certify: the cheapest threshold matching it on validation, no guarantee"

    def calibrate(r: str, scores: torch.Tensor, costs: torch.Tensor, to_param) -> Calibration | None:
        """One rule calibrated to keep the baseline's full-depth quality: certified at the lead, else matched."""
        if lead > 0:
            return calibrate_risk(scores, losses, lead, delta, r, costs=costs, loss_range=rng, to_param=to_param)
        return calibrate_match(scores, costs, lambda stops: metric(val.at(stops), val.extras), metric.better, goal, r,
                               to_param=to_param)

    signal = make_signal(rule, sm.policy)
    cal = calibrate(rule, val.signals[rule], budget_costs(val, app.budget_by), signal.to_param)
    policy_cal, tie = cal, None
    if app.deploy_in_time:  # every rule certified for the target, timed at the served batch: deploy the fastest
        cal, why, tie = _deploy_fastest(app, cfg, run, sm, base, val, calibrate, rule, how)
    else:  # untimed: a fixed depth certified at no more cost on validation does what the policy does, without it
        fixed = calibrate("fixed", val.signals["fixed"], budget_costs(val, app.budget_by, "fixed"), DepthSignal.to_param)
        why = ""
        if fixed is not None and (cal is None or fixed.calibration["mean_cost"] <= cal.calibration["mean_cost"]):
            cal = fixed
            why = (f"; the {rule} rule does not reach it" if policy_cal is None else
                   f"; the {rule} rule, certified at {100 * policy_cal.calibration['mean_cost']:.1f} %, costs no less "
                   f"and adds a policy call, so the fixed depth is deployed")
    if cal is not None and cal.rule != rule:
        cal.target["instead_of"] = ({"rule": rule, "reached": False} if policy_cal is None else
                                    {"rule": rule, "param": policy_cal.param,
                                     "mean_cost": policy_cal.calibration["mean_cost"]})
    if cal is None:
        reason = why or (f"no threshold of the stop model's {rule} rule, and no fixed depth, reaches {reference} on "
                         f"validation (full-depth lead {lead:.4g})")
        if run.ctx.is_main:
            write_json({"format": RUN_FORMAT, "stage": app.baseline_stage, "reason": reason,
                        **({} if tie is None else {"tie": tie})}, Path(run.run_dir) / DEPLOYMENT_FILE)
        run.log(f"deployed: {app.baseline_label} at full depth, as {reason}; the stop model keeps the configured "
                f"{app.inference(cfg).rule} rule")
        return None
    cal.target["reference"] = reference
    if tie is not None:
        cal.target["tie"] = tie
        cal.target["serve_batch"] = app.inference(cfg).serve_batch
    if run.ctx.is_main:
        save_calibration(cal, run.run_dir)
        (Path(run.run_dir) / DEPLOYMENT_FILE).unlink(missing_ok=True)
    run.log(f"deployed rule: {cal.rule} calibrated to keep {app.baseline_stage}'s full-depth quality ({how}): "
            f"{SIGNALS[cal.rule].param_name} = {cal.param:.4g}, {100 * cal.calibration['mean_cost']:.1f} % of the cost "
            f"on validation{why}")
    return cal


IN_TIME_FILE = "in_time"

def _deploy_fastest(app: StoppingApp, cfg: Any, run: Run, sm: StoppingModel, base: StoppingModel, val: Trace,
                    calibrate: Callable, rule: str, how: str) -> tuple[Calibration | None, str, float]:
    """Every rule of the stop model certified for the target, timed beside the baseline at full depth
    (:func:`deployment_in_time`), and the fastest at ``inference.serve_batch`` chosen (:func:`fastest_certified`):
    (its calibration, or None where the baseline is fastest or nothing reaches the target; the reason in words; the
    tie margin used, :func:`speed_tie`)."""
    serve = app.inference(cfg).serve_batch
    result, cals = deployment_in_time(app, cfg, run, sm, base, val, calibrate, rule, how, serve)
    size = result["serve_batch"]
    speeds = {row["rule"]: row.get("samples_per_s", {}).get(size) for row in result["rows"]}
    costs = {"baseline": 1.0, **{r: c.calibration["mean_cost"] for r, c in cals.items()}}
    tie = result["tie"]
    pick = fastest_certified(speeds, costs, tie)
    ref = speeds.get("baseline")
    if pick is None:  # nothing timed (a backend that runs none of them): the least cost on validation
        pick = min(cals, key=lambda r: cals[r].calibration["mean_cost"]) if cals else "baseline"
        why = f"; no rule was timed at batch {size}, so the least cost on validation is deployed" if cals else ""
    elif pick == "baseline":
        quickest = max(cals, key=lambda r: speeds.get(r) or 0.0, default=None)
        why = ("" if quickest is None else
               f"every rule of the stop model certified to keep its quality runs slower than {app.baseline_label} at "
               f"full depth at batch {size} (the fastest, {quickest}, at {(speeds.get(quickest) or 0.0) / ref:.2f}x)")
    else:
        rate = f", {speeds[pick] / ref:.2f}x {app.baseline_label} at full depth" if ref else ""
        why = (f"; the fastest certified at batch {size} ({speeds[pick]:,.0f} samples/s{rate}; ties within "
               f"{100 * tie:.1f} % (the timing's spread) go to the least cost)")
    _write_in_time(app, run, result, pick)
    return (None if pick == "baseline" else cals[pick]), why, tie


def deployment_in_time(app: StoppingApp, cfg: Any, run: Run, sm: StoppingModel, base: StoppingModel, val: Trace,
                       calibrate: Callable, main: str, how: str, serve_batch: int = 1) -> tuple[dict, dict]:
    """Every rule of the task calibrated on validation to keep the baseline's full-depth quality (``calibrate``, as
    :func:`deploy_calibration` does for the policy rule ``main``), scored on test, and timed side by side with the
    baseline at full depth at batch 1, at ``serve_batch`` and at the task's speed batch. Returns (the ``in_time``
    record, {rule: Calibration} of the rules that reach the target); a rule that no threshold brings to the
    baseline's quality on validation is listed as such. :func:`_write_in_time` marks the deployed row and writes
    ``in_time.json`` and ``in_time.md``."""
    metric = app.metric(cfg)
    test = stop_model_trace(app, cfg, sm, "test", run.device)
    base_test = collect_trace(base.model, app.eval_batches(cfg, "test", run.device), metric, run.device,
                              extras=app.trace_extras(cfg))
    rules = model_rules(app, cfg, sm, first=main)
    cals = calibrate_each(app, cfg, sm, val, test, rules, calibrate)
    jobs = {"baseline": (base.model, FixedDepth)}
    jobs.update({r: (sm.model, lambda c=c: calibrated_rule(app, cfg, sm, c)) for r, c in cals.items()})
    speeds, bname, sizes, spreads = time_rules(app, cfg, run, jobs,
                                               tuple(dict.fromkeys((1, serve_batch, app.speed_batch))))
    ref = speeds.get("baseline", {})
    rows = [{"rule": "baseline", "name": f"{app.baseline_label} at full depth",
             # full depth in the stop model's steps (MAML's baseline makes its ten updates as one output)
             "metric": metric(base_test.metric[:, -1], base_test.extras), "mean_steps": float(test.num_steps),
             "mean_cost": 1.0, "samples_per_s": speeds.get("baseline", {})}]
    for r in rules:
        c = cals.get(r)
        if c is None:
            rows.append({"rule": r, "name": r, "reached": False})
            continue
        param = SIGNALS[r].param_name + " " + (f"{c.param:.4g}" if math.isfinite(c.param) else "inf (full depth)")
        rows.append({"rule": r, "name": f"{r}, {param}", "reached": True,
                     "param": c.param if math.isfinite(c.param) else None, "metric": c.test["metric"],
                     "mean_steps": c.test["mean_steps"], "mean_cost": c.test["mean_cost"],
                     "val_mean_cost": c.calibration["mean_cost"], "samples_per_s": speeds.get(r, {})})
    for row in rows:
        row["speedup"] = {n: row["samples_per_s"][n] / ref[n] for n in row.get("samples_per_s", {}) if n in ref}
        if "samples_per_s" in row:
            row["spread"] = spreads.get(row["rule"], {})
    fastest = {}  # what deployment would pick with no tie: a rule at the baseline's full cost is not faster
    costs = {row["rule"]: row.get("mean_cost", 1.0) for row in rows}
    for n in sizes.values():
        got = {row["rule"]: row["samples_per_s"][n] for row in rows if n in row.get("samples_per_s", {})}
        if got:
            fastest[n] = fastest_certified(got, costs, 0.0)
    result = {"metric": metric.name, "reference": f"{app.baseline_label} at full depth", "calibration": how,
              "backend": bname, "device": str(run.device or "cpu"),
              "passes": {str(n): timing_passes(app, n) for n in sorted(set(sizes.values()))},
              "batch_sizes": sorted(set(sizes.values())), "serve_batch": sizes[serve_batch], "rows": rows,
              "tie": speed_tie([v.get(sizes[serve_batch]) for v in spreads.values()]),
              "fastest": {str(n): r for n, r in fastest.items()}}
    return result, cals


def _write_in_time(app: StoppingApp, run: Run, result: dict, deployed: str) -> None:
    """Mark the deployed row of an ``in_time`` record and write ``in_time.json`` / ``in_time.md`` (and log it)."""
    result["deployed"] = deployed
    for row in result["rows"]:
        if row["rule"] == deployed:
            row["name"] = (f"{row['name']} (deployed)" if deployed == "baseline" else
                           row["name"].replace(deployed, f"{deployed} (deployed)", 1))
    text = in_time_markdown(result)
    if run.ctx.is_main:
        write_json(result, Path(run.run_dir) / f"{IN_TIME_FILE}.json")
        write_text_atomic(Path(run.run_dir) / f"{IN_TIME_FILE}.md", text + "\n")
    run.log(text)


def in_time_markdown(result: dict) -> str:
    """The ``in_time.md`` table: each rule at the baseline's quality, its steps and its speed against the baseline."""
    sizes = result["batch_sizes"]
    head = (f"## In time: every rule calibrated to keep the quality of {result['reference']}\n\n"
            f"Calibrated on validation ({result['calibration']}), scored on test; timed side by side in one process "
            f"({result['backend']}, {result['device']}; round-robin passes, the best each: "
            + ", ".join(f"{p} at batch {n}" for n, p in result['passes'].items()) + ").\n\n"
            f"| rule | {result['metric']} | mean steps | cost % | "
            + " | ".join(f"samples/s @{n} | × @{n}" for n in sizes) + " |\n|---|---|---|---|"
            + "---|---|" * len(sizes))
    lines = [head]
    for row in result["rows"]:
        if row.get("reached") is False:
            lines.append(f"| {row['name']} | not reached on validation | | |" + " | |" * len(sizes))
            continue
        cells = []
        for n in sizes:
            v, x = row["samples_per_s"].get(n), row["speedup"].get(n)
            cells += [f"{v:,.0f}" if v is not None else "-", f"{x:.2f}×" if x is not None else "-"]
        lines.append(f"| {row['name']} | {row['metric']:.4g} | {row['mean_steps']:.2f} | {100 * row['mean_cost']:.1f} | "
                     + " | ".join(cells) + " |")
    names = {row["rule"]: row["name"] for row in result["rows"]}
    lines.append("\nFastest at the baseline's quality: " + "; ".join(
        f"batch {n}: {names[r]}" for n, r in result["fastest"].items())
                 + f". Deployed: the fastest at the served batch ({result['serve_batch']}, `inference.serve_batch`), "
                   f"ties within {100 * result['tie']:.1f} % (the largest spread of a point's timing passes there, "
                   f"{100 * SPEED_TIE_FLOOR:.0f} to {100 * SPEED_TIE_CAP:.0f} %) going to the least cost on validation; no "
                   f"rule measured slower than the baseline, or running as many steps, is deployed over it.")
    return "\n".join(lines)
