"""MAML-stop's own command (``evaluate``; the core adds ``train``, ``reproduce``, ``calibrate``, ``frontier`` and
``export``) and the task's registration."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ...core.evaluate import evaluate_deployed
from ...core.rules import FixedDepth
from ...core.task import check_config
from ...core.trace import collect_trace, evaluate_rule
from ...core.train import load_stage
from ...utils.report import write_json
from ...utils.seeding import derive_seed
from ..base import RunContext, TaskSpec, as_run, register_task
from .app import APP
from .config import PRESETS, MAMLConfig
from .models import meta_learner, step_view
from .report import paper_reference, plot_stop_by_shot, results_markdown, stop_steps_by_shot, summarize


def evaluate(cfg: MAMLConfig, run: RunContext | str | Path) -> dict:
    """Both methods on the same ``eval.tasks`` test tasks: mean with 95% CI, stop step by shot count.

    MAML-stop really stops with the deployed rule (the run's calibration if any, else ``inference``).
    """
    check_config(cfg)
    run = as_run(run)
    dev, metric, T = run.device, APP.metric(cfg), cfg.model.inner_steps
    base = load_stage(APP, cfg, run.run_dir, "baseline", dev)
    batches = APP.eval_batches(cfg, "test", dev)
    shots = torch.cat([i["shots"].cpu() for i, _ in batches])
    scale = 1.0 if metric.lower_is_better else 100.0
    gen = torch.Generator().manual_seed(derive_seed(cfg.seed, "test-stop"))  # for the sampled rule
    ev = evaluate_deployed(APP, cfg, run, generator=gen, configured=True)
    stop, rule, desc, learned = ev.deployment.model, ev.rule, ev.desc, ev.result
    result: dict[str, Any] = {"metric": metric.name, "lower_is_better": metric.lower_is_better, "rule": desc}
    if cfg.eval.per_step:
        maml_steps = collect_trace(step_view(base, cfg), batches, metric, dev).metric  # (N, T) per-task metric
        own = meta_learner(stop)  # the meta-learner's own steps (not a kept answer): the table's rows
        stop_steps = collect_trace(own, batches, metric, dev).metric  # (N, T)
        val_steps = collect_trace(own, APP.eval_batches(cfg, "val", dev), metric, dev).metric
        result["per_step"] = {"maml": [summarize(maml_steps[:, t], scale)["mean"] for t in range(T)],
                              "maml_stop": [summarize(stop_steps[:, t], scale)["mean"] for t in range(T)]}
        maml_last = maml_steps[:, -1]
    else:
        maml_last = evaluate_rule(base.model, batches, FixedDepth, metric, dev)["values"]
    # the deployment ships a certified fixed depth where it costs no more than the learned stop (deploy_calibration)
    label = f"MAML-stop (fixed depth {rule.depth or T})" if isinstance(rule, FixedDepth) else "MAML-stop (learned stop)"
    rows = {f"MAML ({T} steps)": summarize(maml_last, scale), label: summarize(learned["values"], scale)}
    if ev.configured is not None:  # the configured rule as a second operating point
        inf, other = cfg.inference, ev.configured
        rows[f"MAML-stop ({inf.rule} {inf.param:g}, {other['mean_steps']:.2f} steps)"] = summarize(other["values"], scale)
    if cfg.eval.per_step:
        sign = 1.0 if metric.lower_is_better else -1.0
        d = int((sign * val_steps.mean(0)).argmin()) + 1  # the best fixed depth on validation
        rows[f"MAML-stop meta-learner, fixed {T} steps"] = summarize(stop_steps[:, -1], scale)
        rows[f"MAML-stop meta-learner, fixed {d} steps (best on validation)"] = summarize(stop_steps[:, d - 1], scale)
        rows["MAML-stop meta-learner, oracle step (uses query labels)"] = summarize(
            sign * (sign * stop_steps).min(dim=1).values, scale)
    n, by_shot = len(shots), stop_steps_by_shot(shots, learned["stop_times"])
    result.update({"tasks": n, "rows": rows, "mean_stop_step": learned["mean_steps"], "stop_by_shot": by_shot,
                   "inner_steps_computed": {"maml": n * T, "maml_stop": learned["steps_computed"]}})
    result["paper"] = paper_reference(cfg.data.source, cfg.data.n_way, cfg.data.k_min, cfg.data.k_max)
    title = f"{cfg.data.source}, {cfg.data.n_way}-way {cfg.data.k_min}-{cfg.data.k_max} shot, {n} test tasks"
    text = results_markdown(result, title, T)
    if run.ctx.is_main:
        (run.run_dir / "results.md").write_text(text)
        write_json(result, run.run_dir / "results.json")
        plot_stop_by_shot(by_shot, T, run.run_dir / "stop_by_shot.png")
        run.log(text)
    return result


SPEC = register_task(TaskSpec(
    name="maml",
    description="MAML-stop: meta-learning with a learned number of inner steps per task (Sec. 5.2)",
    config_class=MAMLConfig,
    presets=PRESETS,
    commands={"evaluate": evaluate},
    app=APP,
))
#: train MAML (baseline) and MAML-stop (Stage I, then II) with equal meta-iterations, resumable; reproduce: train,
#: deploy the calibrated default, evaluate both on the same test tasks. The core's commands on this app.
train, reproduce = SPEC.commands["train"], SPEC.commands["reproduce"]
