"""What a trained run serves, as one record (:class:`Deployment`) read by one resolver (:func:`load_deployment`).

A run's operating point lies in two files: ``calibration.json`` (the calibrated rule: a user's ``calibrate``, or the
rule ``reproduce`` deployed) and ``deployment.json`` (written by ``reproduce`` when the baseline at full depth is
served instead, with the reason). The config's ``inference`` section says whether a calibration is used at all.
:func:`load_deployment` reads them once, checked, into a :class:`Deployment`: the model served, its online rule,
and how that rule was chosen. Every command that serves or evaluates a run asks it.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..utils.config import ConfigError
from ..utils.formats import RUN_FORMAT, format_refusal
from .calibration_file import CALIBRATION_FILE, Calibration, load_calibration
from .inference import active_rule
from .model import StoppingModel
from .rules import FixedDepth
from .signals import DepthSignal
from .task import StoppingApp, check_config, check_policy_rule, check_rule, signal_key
from .train import load_stage

DEPLOYMENT_FILE = "deployment.json"

#: how a deployed rule was chosen
KINDS = ("calibrated", "fastest", "configured", "baseline")


@dataclass
class Deployment:
    """A run's operating point: what is served and how it was chosen.

    ``stage``: the stage whose model is served (the stop stage, or the baseline's where the run serves it).
    ``rule`` / ``param``: the stop rule's name and parameter (``fixed`` at full depth for the baseline; ``sampled``
    for the paper's stochastic policy). ``kind``: ``calibrated`` (a calibration fitted to a target), ``fastest`` (a
    calibration chosen among the certified rules by speed), ``configured`` (the config's ``inference`` rule) or
    ``baseline``. ``target``: the calibration's target (budget, or epsilon and delta, and what it was kept against).
    ``reason``: why the baseline is served instead of the stop model ("" when it is not). ``serve_batch``: the batch
    size a speed choice was timed at; ``tie``: the speed margin counted as a tie there. ``description``: all of it
    in words. ``model`` / ``online``: the loaded model and its online rule.
    """

    stage: str
    rule: str
    param: float | None
    kind: str
    description: str
    target: dict = field(default_factory=dict)
    reason: str = ""
    serve_batch: int | None = None
    tie: float | None = None
    model: StoppingModel | None = field(default=None, repr=False)
    online: Any = field(default=None, repr=False)
    calibration: Calibration | None = field(default=None, repr=False)

    @property
    def calibrated(self) -> bool:
        """Whether the rule comes from the run's calibration (not the config's)."""
        return self.kind in ("calibrated", "fastest")

    @property
    def serves_baseline(self) -> bool:
        return self.kind == "baseline"


def served_baseline(app: StoppingApp, cfg: Any, run_dir) -> str | None:
    """Why the run deploys its baseline at full depth rather than the stop model, or None.

    ``reproduce`` records it in ``deployment.json`` when no rule of the stop model keeps the baseline's full-depth
    quality on validation, or every one that does runs slower: a user who must keep that quality ships the
    baseline. A calibration saved since (``calibrate``: a user's own operating point) and ``use_calibrated:
    false`` (the config's rule, asked for) both put the stop model back.
    """
    record = _baseline_record(app, cfg, run_dir)
    return None if record is None else record["reason"]


def _baseline_record(app: StoppingApp, cfg: Any, run_dir) -> dict | None:
    """``deployment.json``, checked, where it applies (see :func:`served_baseline`), else None."""
    inference = app.inference(cfg)
    if run_dir is None or not app.baseline_stage or not inference.use_calibrated or inference.sampled:
        return None
    path = Path(run_dir) / DEPLOYMENT_FILE
    if not path.is_file() or load_calibration(run_dir) is not None:
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format", 0) != RUN_FORMAT:
            raise ConfigError(format_refusal(str(path), data.get("format", 0)))
        stage, reason = data["stage"], data["reason"]
    except (ValueError, OSError, KeyError, TypeError, AttributeError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{path} is not a valid deployment record ({e!r}); run reproduce again or delete it") from None
    if stage != app.baseline_stage or not isinstance(reason, str):
        raise ConfigError(f"{path}: expected this task's baseline stage {app.baseline_stage!r} and a reason; got stage "
                          f"{stage!r}, reason {reason!r}; run reproduce again or delete the file")
    return data


def load_deployment(app: StoppingApp, cfg: Any, run_dir, *, stage: str | None = None, sm: StoppingModel | None = None,
                    device=None, generator=None) -> Deployment:
    """The run's :class:`Deployment`, with its model loaded and its online rule made.

    ``stage`` None: what the run serves: its baseline at full depth where ``deployment.json`` says so, else the stop
    model with its rule. A stage name: that stage's model with the rule it runs (the run's calibration is the stop
    stage's; any other stage, or ``run_dir`` None, runs the config's ``inference`` rule). ``sm``: the stage's model,
    already loaded. ``generator``: for the sampled policy.
    """
    check_config(cfg)
    record = _baseline_record(app, cfg, run_dir)
    if stage is None and record is not None:
        model = sm if sm is not None else load_stage(app, cfg, run_dir, app.baseline_stage, device)
        return Deployment(stage=app.baseline_stage, rule="fixed", param=None, kind="baseline",
                          description=f"{app.baseline_label} at full depth, no early exit: {record['reason']}",
                          reason=record["reason"], tie=record.get("tie"), model=model, online=FixedDepth())
    stage = stage or app.stop_stage
    if sm is None:
        sm = load_stage(app, cfg, run_dir, stage, device)
    rules_dir = run_dir if stage == app.stop_stage else None  # the calibration is the stop stage's
    inference = app.inference(cfg)
    check_rule(app, cfg, inference.rule, "inference.rule")
    cal = (load_calibration(rules_dir) if rules_dir is not None and inference.use_calibrated and not inference.sampled
           else None)
    where = f"{Path(rules_dir) / CALIBRATION_FILE}" if cal is not None else ""
    if cal is not None:
        check_rule(app, cfg, cal.rule, f"{where}: rule")
        check_policy_rule(cal.rule, sm, f"{where}: rule")
    elif not inference.sampled:
        check_policy_rule(inference.rule, sm, "inference.rule")
    name = cal.rule if cal is not None else inference.rule
    if name == "fixed":  # a depth past the model's steps would run them all and call it that depth
        depth = DepthSignal.depth(cal.threshold) if cal is not None else inference.param
        what = f"{where}: threshold" if cal is not None else "inference.param"
        if depth is not None and not 1 <= depth <= sm.num_steps:
            raise ConfigError(f"{what}: a fixed depth must be in 1..{sm.num_steps} (the model's steps); got {depth:g}")
    online, desc = active_rule(inference, cal, sm.policy, key=signal_key(app, cfg, name), generator=generator)
    if rules_dir is None:
        record = None  # a stage other than the stop stage: what the run serves is not its business
    if record is not None:
        desc += f" (the run deploys {app.baseline_label} at full depth instead: {record['reason']})"
    if cal is None:
        return Deployment(stage=stage, rule="sampled" if inference.sampled else inference.rule,
                          param=None if inference.sampled else float(inference.param), kind="configured",
                          description=desc, reason=record["reason"] if record else "", model=sm, online=online)
    target = dict(cal.target)
    chosen = "fastest_at_batch" in target or "tie" in target
    return Deployment(stage=stage, rule=cal.rule, param=cal.param if math.isfinite(cal.param) else None,
                      kind="fastest" if chosen else "calibrated", description=desc, target=target,
                      serve_batch=target.get("serve_batch", target.get("fastest_at_batch")), tie=target.get("tie"),
                      model=sm, online=online, calibration=cal)
