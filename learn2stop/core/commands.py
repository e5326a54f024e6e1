"""The commands every task has, once: ``train``, ``reproduce``, ``calibrate`` and ``frontier``, each a function of
the task's :class:`~learn2stop.core.task.StoppingApp`, its config and the run (``export``, a layer above the core,
is :func:`learn2stop.export.export_command`). A task supplies its own ``evaluate`` (its tables) and any command of
its own; :func:`~learn2stop.tasks.base.register_task` binds these to the task for the CLI and the Python API."""
from __future__ import annotations

import time
from typing import Any, Callable

from .calibrate import calibrate_command
from .deploy import deploy_calibration
from .frontier import frontier_command
from .task import Run, StoppingApp, check_config
from .train import run_pipeline


def train(app: StoppingApp, cfg: Any, run: Run) -> dict:
    """Train the task's stages in order into the run directory, resuming what exists (Algorithm 1's training)."""
    check_config(cfg)
    run.prepare(cfg, "train")
    return _train(app, cfg, run)


def _train(app: StoppingApp, cfg: Any, run: Run) -> dict:
    note = app.training_note(cfg)
    if note:
        run.log(note)
    return run_pipeline(app, cfg, run)


def reproduce(app: StoppingApp, cfg: Any, run: Run, evaluate: Callable[[Any, Run], dict]) -> dict:
    """Train (resuming what exists), deploy the rule certified to keep the baseline's quality
    (:func:`~learn2stop.core.deploy.deploy_calibration`), ``evaluate`` with it (the task's tables), and, where the
    task asks (``app.reproduce_frontier``), the frontier; the total wall-clock is logged."""
    check_config(cfg)
    run.prepare(cfg, "reproduce")
    t0 = time.perf_counter()
    training = _train(app, cfg, run)
    deploy_calibration(app, cfg, run)
    out = {"training": training, **evaluate(cfg, run)}
    if app.reproduce_frontier:
        out["frontier"] = frontier_command(app, cfg, run)["summary"]
    run.log(f"total wall-clock: {time.perf_counter() - t0:.0f}s")
    return out


def calibrate(app: StoppingApp, cfg: Any, run: Run) -> Any:
    """Fit a stop rule to a target (``--budget``, or ``--epsilon`` and ``--delta``) on validation; ``--fastest``:
    every rule fitted and the fastest kept (:func:`~learn2stop.core.calibrate.calibrate_command`)."""
    o = run.options
    return calibrate_command(app, cfg, run, o.target, rule=o.rule, fastest=o.fastest, speed_batch=o.speed_batch)


def frontier(app: StoppingApp, cfg: Any, run: Run) -> dict:
    """Quality against mean steps and wall-clock time, every rule of the task side by side
    (:func:`~learn2stop.core.frontier.frontier_command`)."""
    return frontier_command(app, cfg, run, speed=not run.options.no_speed)
