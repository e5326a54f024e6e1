"""Early-exit recognition's own commands (``evaluate``: Table 7, ``predict``; the core adds ``train``,
``reproduce``, ``calibrate``, ``frontier`` and ``export``) and the task's registration."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ...core.calibration import calibrate_budget
from ...core.deployment import load_deployment
from ...core.evaluate import evaluate_deployed
from ...core.loop import run_with_early_exit
from ...core.signal_registry import SIGNALS
from ...core.rules import first_crossing, reads_at_stop_alone
from ...core.task import check_config, stop_model_trace
from ...core.trace import collect_trace
from ...core.train import load_stage
from ...utils.config import ConfigError
from ...utils.images import list_image_files
from ...utils.outputs import check_output_file, json_output, writing
from ...utils.report import write_json
from ..base import TaskSpec, as_run, register_task
from .app import APP
from .config import PRESETS, ClassifyConfig
from .data import ImageDataError, load_image_file
from .report import table7_markdown


@torch.no_grad()
def evaluate(cfg: ClassifyConfig, run) -> dict:
    """Table 7: every training's accuracy per exit, oracle exit, and the rules at equal FLOPs."""
    check_config(cfg)
    run = as_run(run)
    dev, metric = run.device, APP.metric(cfg)
    test = APP.eval_batches(cfg, "test", dev)
    rows, result = [], {"per_exit": {}}
    traces = {}
    for stage, label in (("baseline", "network alone"), ("sdn", "SDN training"), ("stage2", "Stage I (+ II policy)")):
        sm = load_stage(APP, cfg, run.run_dir, stage, dev)
        if stage == "stage2":
            tr = stop_model_trace(APP, cfg, sm, "test", dev)
        else:
            tr = collect_trace(sm.model, test, metric, dev,
                               signals={k: f for k, f in APP.classical_signals(cfg).items()})
        traces[stage] = (tr, sm)
        acc = (100 * tr.metric.mean(0)).tolist()
        result["per_exit"][label] = acc
        rows.append([label, acc[-1], max(acc), 1 + int(np.argmax(acc)), 100 * float(tr.metric.amax(1).mean())])
    full_flops = traces["baseline"][1].model.network_flops
    tr, sm = traces["stage2"]
    val = stop_model_trace(APP, cfg, sm, "val", dev)
    flops = torch.tensor(sm.model.exit_costs, dtype=torch.float64)
    rule_rows = []
    policy_rule = APP.policy_rule(cfg)
    for name, network in (("policy", "stage2"), ("confidence", "stage2"), ("confidence", "sdn"), ("entropy", "stage2"),
                          ("patience", "stage2")):
        trace = traces[network][0]
        key = policy_rule if name == "policy" else name
        vtrace = val if network == "stage2" else collect_trace(traces[network][1].model, APP.eval_batches(cfg, "val", dev),
                                                               metric, dev, signals={name: APP.classical_signals(cfg)[name]})
        cal = calibrate_budget(vtrace.signals[key], vtrace.costs, cfg.table_budget, key,
                               SIGNALS[key].to_param)
        stops = first_crossing(trace.signals[key], cal.threshold)
        label = f"policy ({policy_rule})" if name == "policy" else name
        rule_rows.append([f"{label} on {'Stage I' if network == 'stage2' else 'SDN'} network", cfg.table_budget,
                          metric(trace.at(stops)), float(flops[stops - 1].mean() / full_flops) * 100,
                          float(stops.float().mean())])
    ev = evaluate_deployed(APP, cfg, run)
    r, reason = ev.result, ev.deployment.reason
    stop_row = {"rule": ev.desc, "accuracy": r["metric"], "mean_steps": r["mean_steps"],
                "flops_fraction": r["mean_cost"] * sm.model.exit_costs[-1] / full_flops}  # the costs the rule runs
    if not reason:
        deployed = stop_row
    else:  # the operating point a user who keeps the network alone's accuracy ships: the network alone
        deployed = {"rule": f"{APP.baseline_label} at full depth, no early exit: {reason}", "accuracy": rows[0][1],
                    "mean_steps": None, "flops_fraction": 1.0, "stop_model": stop_row}
    result.update({"table": rows, "rules_at_equal_flops": rule_rows, "full_network_flops": full_flops,
                   "deployed": deployed})
    text = table7_markdown(result, cfg, len(tr.metric))
    if run.ctx.is_main:
        (run.run_dir / "table7.md").write_text(text)
        write_json(result, run.run_dir / "results.json")
    run.log(text)
    return result


def _flops_at(model, rule, stop_times: Tensor) -> Tensor:
    """(N,) FLOPs of each image's stop under ``rule``: ``exit_costs`` (every exit head up to its stop), or the
    network's segments and the stop's head alone where the rule reads no earlier exit (a fixed depth, full depth,
    a never-stopping threshold: the network's own FLOPs at T)."""
    costs = model.fixed_exit_costs if reads_at_stop_alone(rule, model.num_steps) else model.exit_costs
    return torch.tensor(costs, dtype=torch.float64)[stop_times.long().cpu() - 1]


@torch.no_grad()
def predict(cfg: ClassifyConfig, run) -> dict:
    """An image file or folder in: class, exit step and FLOPs spent per image out (``predictions.json``)."""
    run = as_run(run)
    src = Path(cfg.predict.input)
    if not cfg.predict.input or not src.exists():
        raise ConfigError(f"predict.input: give an image file or folder; got {cfg.predict.input!r}")
    files = list_image_files(src, recursive=True, error=ImageDataError) if src.is_dir() else [src]
    path = check_output_file(cfg.predict.output or run.run_dir / "predictions.json", "predict.output", inputs=files,
                             run_dirs=[run.run_dir], ours=json_output("rule", "predictions"))  # before any work
    imgs = APP.images(cfg)
    arrays = []
    for f in files:
        arr, notes = load_image_file(f, cfg.data.size, imgs.train.image_shape[0])
        for n in notes:
            run.log(f"note: {n}")
        arrays.append(arr)
    dep = load_deployment(APP, cfg, run.run_dir, device=run.device)  # the network alone where the run deploys it
    sm, rule, desc = dep.model, dep.online, dep.description
    r = run_with_early_exit(sm.model, imgs.prepare(torch.from_numpy(np.stack(arrays))).to(run.device), rule)
    flops = _flops_at(sm.model, rule, r.stop_times).tolist()
    out = [{"file": str(f), "class": imgs.classes[int(c)], "exit": int(t), "flops": int(fl)}
           for f, c, t, fl in zip(files, r.outputs.argmax(1).tolist(), r.stop_times.tolist(), flops)]
    if run.ctx.is_main:
        with writing("predict.output", path):
            write_json({"rule": desc, "predictions": out}, path)
    for o in out:
        run.log(f"{o['file']}: {o['class']} (exit {o['exit']}/{sm.num_steps}, {o['flops'] / 1e6:.2f} MFLOPs)")
    return {"predictions": out}


SPEC = register_task(TaskSpec(
    name="classify",
    description="Early-exit image recognition: VGG and ResNets with internal classifiers, SDN vs Stage I + policy (Sec. 5.4, Table 7)",
    config_class=ClassifyConfig,
    presets=PRESETS,
    commands={"evaluate": evaluate, "predict": predict},
    app=APP,
))
#: train every network, resumable; reproduce: train, deploy the rule calibrated to keep the network alone's accuracy
#: (when the stop model leads it at full depth), Table 7, then the frontier. The core's commands on this app.
train, reproduce = SPEC.commands["train"], SPEC.commands["reproduce"]
