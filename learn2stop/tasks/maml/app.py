"""MAML-stop on the core pipeline: config, presets, data, metric, and the evaluate report.

``learn2stop maml reproduce --preset quick`` trains MAML and MAML-stop with equal meta-iterations on
task-imbalanced sinusoid regression (no data needed) and writes ``results.md``, ``results.json`` and
``stop_by_shot.png``; ``calibrate`` and ``frontier`` come from the core. Python API::

    from learn2stop.tasks.maml.app import APP, preset, reproduce
    results = reproduce(preset("quick"), "runs/maml-quick")
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ...core import InferenceConfig, MethodConfig, Metric, StageConfig, StoppingModel, ToleranceSignal
from ...core.trace import collect_trace, evaluate_rule
from ...core.objectives import stage_field
from ...core.rules import FixedDepth
from ...core.signals import PatienceSignal
from ...core.task import Stage, StoppingApp, check_config, signal_key
from ...core.deploy import deployed_rule
from ...core.train import load_stage
from ...utils.seeding import derive_seed
from ...utils.config import ints_at_least, preset_config, require, to_dict
from ...utils.report import write_json
from ..base import RunContext, TaskSpec, as_run, register_task, reproduce_pipeline, train_pipeline
from .losses import query_metric
from .models import ModelConfig, build, loss_kind, meta_learner, step_view
from .task import (Data, DataConfig, MetaLearningTask, fixed_batches, plot_stop_by_shot, results_markdown,
                   stop_steps_by_shot, summarize, to_device)


@dataclass
class EvalConfig:
    """Fixed task sets: ``tasks`` test tasks (the same for every method), ``val_tasks`` validation tasks
    (model selection and calibration), ``chunk`` tasks per forward. per_step: also run every step of
    both meta-learners (the fixed-depth and oracle rows); two more passes over the test tasks."""

    tasks: int = 600
    """Test tasks, the same for every method."""
    val_tasks: int = 100
    """Validation tasks (model selection and calibration)."""
    chunk: int = 20
    """Tasks per forward pass."""
    per_step: bool = True
    """Also run every step of both meta-learners (the fixed-depth and oracle rows): two more passes over the test tasks."""

    def __post_init__(self):
        ints_at_least(self, "tasks", "val_tasks", "chunk")


def _stage(**kw) -> Any:
    return stage_field(**{"batch_size": 10, "lr": 1e-3, "iterations": 60000, "eval_every": 500, "checkpoint_every": 500,
                          **kw})


@dataclass
class MAMLConfig:
    """MAML vs MAML-stop (paper Sec. 5.2). Defaults: Omniglot 20-way 1-5-shot, Table 4's setting."""

    #: only the test-time rule is read-only here: ``eval`` fixes the validation tasks training selects on
    reader_fields: ClassVar[tuple[str, ...]] = ("inference",)
    #: where the data lies: a reading command on a trained run may find it elsewhere (a moved folder, another machine)
    location_fields: ClassVar[tuple[str, ...]] = ("data.path", "data.split_file")

    seed: int = 0
    """Seed of training: initialisation and the training tasks."""
    data: DataConfig = field(default_factory=DataConfig)
    """Where the tasks come from, and the N-way K-shot setting."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The learner, its inner loop and the policy."""
    method: MethodConfig = field(default_factory=lambda: MethodConfig(beta=0.01))
    """beta (0.01 in the paper), depth prior and price on inner steps, inherited by every stage."""
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    """the test-time stop rule (replaced by ``calibration.json`` once a run is calibrated)."""
    maml: StageConfig = _stage(objective="deep_supervision")
    """the baseline, trained on the query loss after all T inner steps (stage ``baseline``)."""
    stage1: StageConfig = _stage(objective="stage1", variant="sampled", recompute=True)
    """MAML-stop's meta-learner (sampled Stage I with the no-grad pass and recompute, App. B.2)."""
    posterior: StageConfig = _stage(objective="auxiliary", iterations=6000, batch_size=64, lr_schedule="step",
                                    lr_decay_at=(0.7,), eval_every=3000, checkpoint_every=1000)
    """with ``model.policy_posterior``, the policy's posterior-mean estimate alone (objective ``auxiliary``: regression
    on the query targets, no inner loop) on fresh training tasks, between Stage I and Stage II; without it the stage
    is not run."""
    stage2: StageConfig = _stage(objective="stage2", variant="map", iterations=5000)
    """the stopping policy fitted to the oracle with theta frozen (the estimate as its stage left it)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """The fixed validation and test task sets."""

    def __post_init__(self):
        require(self.maml.objective == "deep_supervision", "maml.objective",
                f"the MAML baseline trains on the last step: must be deep_supervision; got {self.maml.objective!r}")
        require(self.stage1.objective == "stage1", "stage1.objective", f"must be stage1; got {self.stage1.objective!r}")
        require(self.posterior.objective == "auxiliary", "posterior.objective",
                f"the estimate trains alone: must be auxiliary; got {self.posterior.objective!r}")
        require(self.stage2.objective in ("stage2", "stage3"), "stage2.objective",
                f"must be stage2 (or stage3 to fine-tune both); got {self.stage2.objective!r}")
        require(self.model.inner_steps >= 2, "model.inner_steps", "a stopping policy needs T >= 2 steps")
        require(not self.model.policy_posterior or self.data.source == "sinusoid", "model.policy_posterior",
                f"the posterior-mean estimate is for regression (sinusoid) tasks; {self.data.source!r} is classification")
        want = "mlp" if self.data.source == "sinusoid" else "conv4"
        require(self.model.network == want, "model.network", f"{self.data.source} data needs the {want} network; "
                f"got {self.model.network!r}")


_ITERS = lambda n, b, every: {"iterations": n, "batch_size": b, "eval_every": every, "checkpoint_every": every}

PRESETS: dict[str, dict] = {
    # ~10 minutes on one CPU thread, no data: task-imbalanced sinusoid regression, 1-10 shots, noisy support.
    "quick": {
        "data": {"source": "sinusoid", "path": "", "n_way": 1, "k_min": 1, "k_max": 10, "query_per_class": 20,
                 "rotations": False, "noise": 1.0},
        # a stop answers with the step so far nearest a learned posterior-mean estimate (trained in its own stage);
        # the policy reads scalars alone (its distances to that estimate carry what the set embeddings did), the
        # support loss among them as the step's inner gradient computed it: an ask runs no support-set forward
        "model": {"network": "mlp", "hidden": 40, "inner_steps": 10, "inner_lr": 0.02, "policy_posterior": True,
                  "policy_inputs": "scalars"},
        "method": {"beta": 0.05, "price": 0.3},  # price: 10 inner steps cost 0.3 of query MSE
        "maml": {**_ITERS(3000, 25, 250), "lr": 1e-3},
        "stage1": {**_ITERS(3000, 25, 250), "lr": 1e-3},
        # reverse KL = E_q[loss] / beta - H(q): weights each task by what its stop step is worth
        "stage2": {**_ITERS(3000, 25, 250), "lr": 3e-3, "variant": "reverse_kl"},
        "eval": {"tasks": 600, "val_tasks": 1000, "chunk": 100},
    },
    # Table 4: Omniglot 20-way 1-5 shot (imbalanced), 10 inner steps, inner lr 0.1, meta-batch 10, outer lr 1e-3, beta 0.01.
    "paper": {},
    # The same setting from the standard PNG folders (path: a folder with images_background/ and images_evaluation/).
    "omniglot-folders": {"data": {"source": "omniglot_folders"}},
    # Table 5's vanilla setting: Omniglot 20-way 5-shot, fixed K.
    "omniglot-vanilla": {"data": {"k_min": 5, "k_max": 5}},
    # MiniImagenet 5-way 1-10 shot: 10 steps, inner lr 0.01, meta-batch 1, outer lr 1e-4, beta 0.01 (32 filters as in MAML).
    "miniimagenet": {
        "data": {"source": "miniimagenet", "path": "data/miniimagenet", "n_way": 5, "k_min": 1, "k_max": 10,
                 "query_per_class": 5, "rotations": False, "image_size": 84},
        "model": {"hidden": 32, "inner_lr": 0.01},
        "maml": {"batch_size": 1, "lr": 1e-4}, "stage1": {"batch_size": 1, "lr": 1e-4}, "stage2": {"batch_size": 1, "lr": 1e-4},
    },
}


def preset(name: str = "quick", **overrides: Any) -> MAMLConfig:
    """The config of a named preset, with optional nested overrides (dicts)."""
    return preset_config(MAMLConfig, PRESETS, name, "maml", **overrides)


# ----------------------------------------------------------------------------- the task for the core pipeline
class MAMLApp(StoppingApp):
    """MAML (baseline) and MAML-stop (Stage I, then Stage II) on the core pipeline."""

    baseline_label = "MAML"
    speed_batch = 100  # a natural large batch of tasks
    speed_samples = 50  # tasks timed one by one at batch 1 (each runs up to T inner loops)
    #: why ``export`` refuses this task (see :mod:`learn2stop.export` and the README's "Export and serve")
    export_unsupported = ("MAML's steps are inner gradient updates (torch.func.grad of the support loss); an ONNX "
                          "inference graph has no gradient operator, so the steps cannot run in ONNX Runtime")

    def data(self, cfg: MAMLConfig) -> Data:
        return self.cached(f"data {to_dict(cfg.data)}", lambda: Data(cfg.data))

    def build_models(self, cfg: MAMLConfig, device) -> dict[str, StoppingModel]:
        maml, stop = build(cfg, device)
        return {"baseline": maml, "stop": stop}

    def training_task(self, cfg: MAMLConfig, key: str, sm: StoppingModel) -> MetaLearningTask:
        data = self.data(cfg)
        return MetaLearningTask(sm.model, data.sampler, data.split["train"], None,
                                val_batches=self._fixed(cfg, "val"))

    def stages(self, cfg: MAMLConfig) -> list[Stage]:
        out = [Stage("baseline", "baseline", cfg.maml, describe="MAML: query loss after all T inner steps"),
               Stage("stage1", "stop", cfg.stage1, describe="MAML-stop Stage I (meta-learner, t ~ q*)")]
        if cfg.model.policy_posterior:
            out.append(Stage("posterior", "stop", cfg.posterior,
                             describe="MAML-stop's posterior-mean estimate (regression on query targets)"))
        answers = cfg.model.policy_posterior  # the estimate chooses the kept answer
        out.append(Stage("stage2", "stop", cfg.stage2, before=_stage2_hook if answers else None,
                         describe="MAML-stop Stage II (policy" + (", on the kept answers)" if answers else ")")))
        return out

    def _fixed(self, cfg: MAMLConfig, split: str) -> list:
        """Fixed CPU task batches of a split, drawn once with a seed of their own."""
        n = cfg.eval.tasks if split == "test" else cfg.eval.val_tasks
        data = self.data(cfg)

        def draw():
            g = torch.Generator().manual_seed(derive_seed(cfg.seed, split))
            return fixed_batches(data.sampler, data.split[split], n, g, cfg.eval.chunk)
        return self.cached(f"{split} tasks {to_dict(cfg.data)} {(n, cfg.eval.chunk, cfg.seed)}", draw)

    def eval_batches(self, cfg: MAMLConfig, split: str, device) -> list:
        return [(to_device(i, device), to_device(t, device)) for i, t in self._fixed(cfg, split)]

    def metric(self, cfg: MAMLConfig) -> Metric:
        kind = loss_kind(cfg)
        per_task = lambda output, target: query_metric(output, target, kind)
        if kind == "mse":
            return Metric("query MSE", per_task, lower_is_better=True)
        return Metric("accuracy (%)", per_task, lower_is_better=False, aggregate=lambda v, ex: 100 * v.double().mean())

    def classical_signals(self, cfg: MAMLConfig) -> dict:
        """The tolerance rule on the support loss: stop once an inner step changes it little. With a kept answer
        (``model.policy_posterior``) also patience on it: stop once the kept answer has not changed for k steps
        (early stopping that restores the best step)."""
        out = {"tolerance": lambda: ToleranceSignal(key=lambda out: out["support_loss"][:, None])}
        if cfg.model.policy_posterior:
            T = cfg.model.inner_steps
            out["patience"] = lambda: PatienceSignal(key=lambda o: F.one_hot(o["answer_step"], T + 1))
        return out

    def risk_losses(self, cfg: MAMLConfig, trace) -> tuple[torch.Tensor, tuple[float, float] | None]:
        losses, _ = super().risk_losses(cfg, trace)
        return losses, (None if loss_kind(cfg) == "mse" else (-1.0, 1.0))  # accuracy: fractions, bounded


APP = MAMLApp()


def _stage2_hook(models: dict, app: MAMLApp, cfg: MAMLConfig, run) -> None:
    """Stage II's hook with a posterior-mean estimate: it was trained in its own stage and stays as it is, and
    MAML-stop answers with the kept answer it chooses from here on."""
    sm = models["stop"]
    sm.policy.fit_estimate = False
    sm.model.answering = True



# ----------------------------------------------------------------------------- commands
def train(cfg: MAMLConfig, run: RunContext | str | Path) -> dict:
    """Train MAML (baseline) and MAML-stop (Stage I, then Stage II) with equal meta-iterations; resumable."""
    return train_pipeline(APP, cfg, run)


def evaluate(cfg: MAMLConfig, run: RunContext | str | Path) -> dict:
    """Both methods on the same ``eval.tasks`` test tasks: mean with 95% CI, stop step by shot count.

    MAML-stop really stops with the deployed rule (the run's calibration if any, else ``inference``).
    """
    check_config(cfg)
    run = as_run(run)
    dev, metric, T = run.device, APP.metric(cfg), cfg.model.inner_steps
    base = load_stage(APP, cfg, run.run_dir, "baseline", dev)
    stop = load_stage(APP, cfg, run.run_dir, APP.stop_stage, dev)
    batches = APP.eval_batches(cfg, "test", dev)
    shots = torch.cat([i["shots"].cpu() for i, _ in batches])
    scale = 1.0 if metric.lower_is_better else 100.0
    gen = torch.Generator().manual_seed(derive_seed(cfg.seed, "test-stop"))  # for the sampled rule
    rule, desc = deployed_rule(APP, cfg, run.run_dir, stop, generator=gen)
    learned = evaluate_rule(stop.model, batches, lambda: rule, metric, dev, runner=run.runner)
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
    if desc.startswith("calibrated") and not cfg.inference.sampled:  # the configured rule as a second operating point
        inf = cfg.inference
        key = signal_key(APP, cfg, inf.rule)
        other = evaluate_rule(stop.model, batches, lambda: inf.make_rule(stop.policy, gen, key), metric, dev,
                              runner=run.runner)
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
    title = f"{cfg.data.source}, {cfg.data.n_way}-way {cfg.data.k_min}-{cfg.data.k_max} shot, {n} test tasks"
    text = results_markdown(result, title, T)
    if run.ctx.is_main:
        (run.run_dir / "results.md").write_text(text)
        write_json(result, run.run_dir / "results.json")
        plot_stop_by_shot(by_shot, T, run.run_dir / "stop_by_shot.png")
        run.log(text)
    return result


def reproduce(cfg: MAMLConfig, run: RunContext | str | Path) -> dict:
    """Train both methods (resuming what exists), deploy the calibrated default, then evaluate them on the same
    test tasks."""
    return reproduce_pipeline(APP, cfg, run, train, evaluate)


SPEC = register_task(TaskSpec(
    name="maml",
    description="MAML-stop: meta-learning with a learned number of inner steps per task (Sec. 5.2)",
    config_class=MAMLConfig,
    presets=PRESETS,
    commands={"train": train, "evaluate": evaluate, "reproduce": reproduce},
    app=APP,
))
