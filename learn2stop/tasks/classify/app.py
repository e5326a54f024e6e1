"""Early-exit image recognition (paper Sec. 5.4, Table 7): VGG-BN and ResNets with internal classifiers (--model.arch).

    learn2stop classify reproduce --preset quick        # CIFAR-10 subset of ../shared/data, vgg6-narrow
    learn2stop classify reproduce --preset quick --model.arch resnet20 --run-dir runs/classify-quick-resnet20
    learn2stop classify frontier --run-dir runs/classify-quick
    learn2stop classify predict --run-dir runs/classify-quick --predict.input photo.png

Trainings on one architecture: the network alone (last classifier only), SDN (internal classifiers
weighted by SDN's tau), and Stage I with the oracle (softmin of the cross-entropies, beta = 1,
optionally with a price on FLOPs), then the Stage II policy. Exit rules compared on the same
networks: confidence (SDN), entropy, patience (PABEE), the learned policy calibrated to budgets,
and the oracle exit (the first internal classifier that is right: a bound).
"""
from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from ...core import Metric, StageConfig, StoppingModel, derive_seed
from ...core.trace import collect_trace, evaluate_rule
from ...core.loop import run_with_early_exit
from ...core.task import Stage, StoppingApp, check_config, stop_model_trace
from ...core.deploy import deployed_model, deployed_rule, served_baseline
from ...core.train import load_stage
from ...core.rules import first_crossing, reads_at_stop_alone
from ...core.signal_registry import SIGNALS
from ...core.signals import ConfidenceSignal, EntropySignal, PatienceSignal
from ...core.calibration import calibrate_budget
from ...core.policies import ExitPolicy
from ...utils.config import ConfigError
from ...utils.report import markdown_table, write_json
from ...utils.images import list_image_files
from ...utils.outputs import check_output_file, json_output, writing
from ..base import TaskSpec, as_run, register_task, reproduce_pipeline, train_pipeline
from .config import PRESETS, SOURCES, ClassifyConfig  # noqa: F401  (the task's public names)
from .data import ImageDataError, load_image_file
from .models import build_network, initialise
from .task import ClassifyTask, Images, synthetic_set  # noqa: F401

PAPER_TABLE7 = {"VGG16": 58.60, "SDN training (best IC)": 77.78, "Stage I (oracle exit)": 83.26}


# ----------------------------------------------------------------------------- the pipeline
class ClassifyApp(StoppingApp):
    baseline_label = "the network alone"
    budget_by = "cost"  # budgets and the frontier's x-axis in FLOPs
    frontier_also = {"sdn": "sdn"}  # the confidence, entropy and patience rules on the SDN-trained network too
    speed_batch = 256
    # about 100 points are timed at two batch sizes: 48 images one by one and 256 at once, best of two passes
    # (the quick preset's frontier: about a minute on 2 cores)
    speed_samples = 48
    speed_batches = 1
    speed_passes = 2

    def images(self, cfg: ClassifyConfig) -> Images:
        return self.cached(f"images {(cfg.data, cfg.seed)!r}", lambda: Images(cfg))

    def network(self, cfg: ClassifyConfig):
        m, imgs = cfg.model, self.images(cfg)

        def build():  # tracing, placing exits and counting FLOPs once; every model is a copy
            try:  # exit_costs: cumulative FLOPs of exiting at t, the price's and the frontier's cost
                return build_network(
                    m.arch, len(imgs.classes), cfg.data.size, m.ic_positions or None, in_channels=imgs.train.image_shape[0],
                    fc_width=None if m.fc_width < 0 else m.fc_width, dropout=m.dropout, width=m.width or None)
            except ValueError as e:
                raise ConfigError(f"model ({m.arch} at data.size {cfg.data.size}): {e}") from None
        key = f"network {(m, cfg.data.size, len(imgs.classes), imgs.train.image_shape[0])!r}"
        return copy.deepcopy(self.cached(key, build))

    def build_models(self, cfg: ClassifyConfig, device) -> dict[str, StoppingModel]:
        torch.manual_seed(derive_seed(cfg.seed, "init") % 2**63)
        nets = {k: self.network(cfg) for k in ("baseline", "sdn", "stop")}
        for net in nets.values():
            initialise(net)  # fresh weights drawn under this seed, whenever the template was built
        n = nets["stop"]
        policy = ExitPolicy(n.num_classes, n.num_steps, hidden=cfg.model.policy_hidden)
        fmt = torch.contiguous_format
        if cfg.model.channels_last:
            fmt = torch.channels_last
            for name, mod in nets["stop"].named_modules():
                if isinstance(mod, nn.Conv2d) and mod.kernel_size == (1, 1) and max(mod.stride) > 1 and mod.in_channels < 8:
                    raise ConfigError(f"model.channels_last: {name} is a strided 1x1 convolution of {mod.in_channels} "
                                      f"input channels, whose NHWC backward corrupts memory in this PyTorch on CPU; "
                                      f"set --model.channels_last false or a wider network")
        return {k: StoppingModel(v.to(memory_format=fmt), policy if k == "stop" else None).to(device)
                for k, v in nets.items()}

    def training_task(self, cfg, key, sm):
        return ClassifyTask(self.images(cfg), cfg.data.augment, cfg.eval_batch, cfg.stop_loss, cfg.data.cutout)

    def stages(self, cfg: ClassifyConfig) -> list[Stage]:
        T = self.network(cfg).num_steps
        tau = np.interp(np.linspace(0, 1, T - 1), np.linspace(0, 1, len(cfg.sdn_tau)), cfg.sdn_tau).tolist()
        sdn = StageConfig(**{**cfg.sdn.__dict__, "step_weights": tuple(tau) + (1.0,)})
        out = [Stage("baseline", "baseline", cfg.baseline, describe="the network alone (last classifier)"),
               Stage("sdn", "sdn", sdn, init_from="baseline" if cfg.sdn_from == "baseline" else None,
                     describe=f"SDN: IC losses weighted {[round(t, 2) for t in tau]} + final"
                              + (", from the network alone" if cfg.sdn_from == "baseline" else "")),
               # Stage I fine-tunes the SDN network: trained from scratch on the oracle alone, each image's
               # loss concentrates on whichever exit already fits it, and the other exits decay (measured:
               # final classifier 9 %, oracle exit 98 % on VGG16 / CIFAR subset), which no label-free rule can use.
               Stage("stage1", "stop", cfg.stage1, init_from="sdn", describe="Stage I: oracle-weighted IC losses, from SDN"),
               Stage("stage2", "stop", cfg.stage2, describe="Stage II: the exit policy")]
        if cfg.stage3.iterations > 0:
            out.append(Stage("stage3", "stop", cfg.stage3, describe="Stage III"))
        return out

    def eval_batches(self, cfg, split, device):
        return self.images(cfg).batches(split, cfg.eval_batch, device)

    def metric(self, cfg) -> Metric:
        return Metric("accuracy (%)", lambda logits, y: (logits.argmax(1) == y).float(), lower_is_better=False,
                      aggregate=lambda v, ex: 100 * v.double().mean())

    def classical_signals(self, cfg):
        return {"confidence": ConfidenceSignal, "entropy": EntropySignal, "patience": PatienceSignal}

    def risk_losses(self, cfg, trace):
        """Wrong where full depth is right (CALM's consistency form), in [0, 1]: epsilon is in accuracy fraction."""
        return (trace.metric[:, -1:] - trace.metric).clamp_min(0), (0.0, 1.0)

    def quality_lead(self, cfg, stop, base):
        """The accuracy lead (fraction) at full depth. Not the default's mean of the clamped losses above, which
        counts only the images the stop model gets right and the baseline wrong; a risk <= this lead bounds
        the deployed accuracy below by the baseline's."""
        return float((stop.metric[:, -1] - base.metric[:, -1]).double().mean())

    def cost_unit(self, cfg, sm):
        return "flops", float(sm.model.exit_costs[-1])


APP = ClassifyApp()



# ----------------------------------------------------------------------------- commands
def train(cfg: ClassifyConfig, run) -> dict:
    check_config(cfg)  # a dict or a class: one clear TypeError, not an AttributeError deep in the loader
    imgs = APP.images(cfg)
    return train_pipeline(APP, cfg, run, f"classify: {len(imgs.train)} train / {len(imgs.val)} validation / "
                          f"{len(imgs.test)} test images, {len(imgs.classes)} classes, {cfg.data.size}x{cfg.data.size}")


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
    sm_rule, desc = deployed_rule(APP, cfg, run.run_dir, sm)
    r = evaluate_rule(sm.model, test, lambda: sm_rule, metric, dev, runner=run.runner)
    stop_row = {"rule": desc, "accuracy": r["metric"], "mean_steps": r["mean_steps"],
                "flops_fraction": r["mean_cost"] * sm.model.exit_costs[-1] / full_flops}  # the costs the rule runs
    reason = served_baseline(APP, cfg, run.run_dir)
    if reason is None:
        deployed, stop_line = stop_row, ""
    else:  # the operating point a user who keeps the network alone's accuracy ships: the network alone
        deployed = {"rule": f"{APP.baseline_label} at full depth, no early exit: {reason}", "accuracy": rows[0][1],
                    "mean_steps": None, "flops_fraction": 1.0, "stop_model": stop_row}
        stop_line = (f" The stop model with its configured rule ({cfg.inference.rule} {cfg.inference.param:g}): "
                     f"{stop_row['accuracy']:.2f} % at {100 * stop_row['flops_fraction']:.1f} %.")
    result.update({"table": rows, "rules_at_equal_flops": rule_rows, "full_network_flops": full_flops,
                   "deployed": deployed})
    table = markdown_table(["training", "final classifier %", "best single exit %", "best exit", "oracle exit %"], rows)
    rules = markdown_table(["rule", "budget (FLOPs share, validation)", "test accuracy %", "test FLOPs % of network",
                            "mean exit"], rule_rows)
    paper = ", ".join(f"{k} {v:.2f}" for k, v in PAPER_TABLE7.items())
    text = (f"# Table 7: early-exit recognition ({cfg.model.arch}, {cfg.data.kind}, {len(tr.metric)} test images)\n\n"
            f"{table}\n\nPaper (VGG16-BN, Tiny-ImageNet): {paper}.\n\n## Exit rules at equal FLOPs\n\n{rules}\n\n"
            f"Deployed ({deployed['rule']}): {deployed['accuracy']:.2f} % at {100 * deployed['flops_fraction']:.1f} % "
            f"of the network's FLOPs ({full_flops / 1e6:.1f} MFLOPs per image).{stop_line}\n")
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
    sm, rule, desc = deployed_model(APP, cfg, run.run_dir, run.device)  # the network alone where the run deploys it
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


def reproduce(cfg: ClassifyConfig, run) -> dict:
    """Train every network; deploy the rule calibrated to keep the network alone's accuracy (when the stop
    model leads it at full depth); Table 7, then the frontier."""
    return reproduce_pipeline(APP, cfg, run, train, evaluate, frontier=True)


SPEC = register_task(TaskSpec(
    name="classify",
    description="Early-exit image recognition: VGG and ResNets with internal classifiers, SDN vs Stage I + policy (Sec. 5.4, Table 7)",
    config_class=ClassifyConfig,
    presets=PRESETS,
    commands={"train": train, "evaluate": evaluate, "reproduce": reproduce, "predict": predict},
    app=APP,
))
