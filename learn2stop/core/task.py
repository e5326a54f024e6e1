"""What a task declares to the core (:class:`StoppingApp`: its models, stages, data, metric and rules), and the
helpers that read a task's rules off a trained stop model (which rules it has, the signal each reads)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from ..runtime.registry import get_rule, list_rules
from ..utils.config import ConfigError
from ..utils.distributed import DistContext
from .calibration_file import Calibration
from .inference import InferenceConfig, policy_rules
from .trace import Metric, Trace, collect_trace
from .model import StoppingModel
from .trees import tree_cat, tree_leaves
from .objectives import MethodConfig, StageConfig
from .signal_registry import SIGNALS, make_signal
from .signals import StopSignal



@dataclass
class Stage:
    """One step of the pipeline.

    name: the stage's checkpoint name (``checkpoints/<name>.pt``).
    model: which of the app's models it trains (a key of :meth:`StoppingApp.build_models`).
    config: its :class:`StageConfig` (method-level fields inherited when unset).
    init_from: before the stage starts, copy the weights of this model (``init_part``: "model" =
        the predictive model only, "all" = model and policy).
    before: hook ``(models, app, cfg, run) -> None`` run before the stage (e.g. choose the policy's first step).
    """

    name: str
    model: str
    config: StageConfig
    init_from: str | None = None
    init_part: str = "model"
    before: Callable | None = None
    describe: str = ""


class Run(Protocol):
    """What the core reads of a run: where it writes, on which device and process, how it reports, whether it
    resumes, the command's options beyond the config, and the backends it times and evaluates on (the CLI's
    :class:`~learn2stop.tasks.base.RunContext` is one; any object with these will do)."""

    run_dir: Path
    ctx: DistContext
    progress: bool
    resume: bool
    #: the command's options beyond the config (``--budget``, ``--fastest``, ``--no-speed``, ...)
    options: Any

    @property
    def device(self) -> Any: ...

    @property
    def runners(self) -> dict[str, Callable]:
        """Backend name -> early-exit runner, in the order asked (eager torch by default)."""
        ...

    @property
    def runner(self) -> Callable:
        """The runner ``evaluate`` uses: the first of :attr:`runners`."""
        ...

    def prepare(self, cfg: Any, command: str) -> None:
        """Check, lock and record the run directory for ``command`` (once per run, whoever asks first)."""
        ...

    def log(self, message: str) -> None: ...


class StoppingApp:
    """What a task supplies to the core pipeline. Override the methods marked *task*."""

    #: the stage whose weights make the deployed stopping model, and the baseline's stage.
    stop_stage = "stage2"
    baseline_stage = "baseline"
    #: the baseline in words, as a run that deploys it (:func:`served_baseline`) says what it serves
    baseline_label = "the baseline"
    #: frontier x-axis for budgets: "steps" or "cost" (the model's ``exit_costs``, e.g. FLOPs).
    budget_by = "steps"
    #: batch size of the frontier's large-batch speed.
    speed_batch = 1000
    #: samples timed one by one at batch 1.
    speed_samples = 200
    #: large batches timed per pass.
    speed_batches = 3
    #: round-robin passes over every point; each point keeps its best.
    speed_passes = 3
    #: other trainings whose classical rules the frontier also draws: {curve prefix: stage name}.
    frontier_also: dict = {}
    #: ``reproduce`` also calibrates every other rule to the deployed target and times each beside the baseline
    #: (:func:`deployment_in_time`).
    deploy_in_time: bool = True
    #: ``reproduce`` ends with the frontier (:func:`~learn2stop.core.frontier.frontier_command`).
    reproduce_frontier: bool = False
    #: why the task's stop model cannot be exported to ONNX, or "" (``export`` refuses with this reason)
    export_unsupported: str = ""
    #: input dims (beyond the batch) an export keeps dynamic: {input name: [dims]} (images of any size), or None
    export_dynamic_dims: dict | None = None

    #: most entries of :meth:`cached`.
    cache_size = 8

    def cached(self, key: str, make: Callable[[], Any]) -> Any:
        """The app's one memo for what is costly to build and depends on a few config fields (data sets,
        task samplers, fixed evaluation batches, traced networks): ``make()`` once per ``key`` (a string of
        those fields); the oldest of more than :attr:`cache_size` entries is dropped."""
        memo = self.__dict__.setdefault("_memo", {})
        if key not in memo:
            while len(memo) >= self.cache_size:
                memo.pop(next(iter(memo)))
            memo[key] = make()
        return memo[key]

    # ---------------------------------------------------------------- task

    def build_models(self, cfg: Any, device) -> dict[str, StoppingModel]:
        raise NotImplementedError

    def training_task(self, cfg: Any, key: str, sm: StoppingModel) -> Any:
        raise NotImplementedError

    def stages(self, cfg: Any) -> list[Stage]:
        raise NotImplementedError

    def eval_batches(self, cfg: Any, split: str, device) -> list[tuple[Any, Any]]:
        """Fixed (inputs, target) batches of ``split`` ("val" for selection and calibration, "test")."""
        raise NotImplementedError

    def metric(self, cfg: Any) -> Metric:
        raise NotImplementedError

    def classical_signals(self, cfg: Any) -> dict[str, Callable]:
        """name -> factory of a label-free classical stop signal (tolerance, confidence, ...)."""
        return {}

    def trace_extras(self, cfg: Any):
        """Optional ``(inputs, target) -> {name: (B,)}`` per-sample side data for the metric's aggregate."""
        return None

    def risk_losses(self, cfg: Any, trace: Trace) -> tuple[torch.Tensor, tuple[float, float] | None]:
        """Per-sample excess loss of stopping at t (N, T) for risk control, and its range if bounded.

        Default: how much worse the per-sample metric is than at full depth (metric units).
        """
        sign = 1.0 if self.metric(cfg).lower_is_better else -1.0
        return sign * (trace.metric - trace.metric[:, -1:]), None

    def quality_lead(self, cfg: Any, stop: Trace, base: Trace) -> float:
        """How much better the stop model is at full depth than the baseline, in :meth:`risk_losses` units:
        the epsilon of the deployed operating point (at least the baseline's quality). Default: the mean
        excess loss of the baseline's last step over the stop model's, as ``risk_losses`` measures it: right
        when those losses are linear in the metric. A task whose losses are clamped (classify's consistency
        form counts only drops) overrides it, or the mean would count only the stop model's wins."""
        pair = Trace(metric=torch.stack([base.metric[:, -1], stop.metric[:, -1]], dim=1), costs=stop.costs[-2:],
                     extras=stop.extras)
        return float(self.risk_losses(cfg, pair)[0][:, 0].double().mean())

    def speed_inputs(self, cfg: Any, device) -> Any:
        """The test inputs the frontier times, as one batch-first tree. Default: every test batch whose
        inputs have the most common shape (images of mixed sizes cannot share a batch)."""
        batches = [b[0] for b in self.eval_batches(cfg, "test", device)]
        key = lambda b: tuple(tuple(x.shape[1:]) for x in tree_leaves(b))
        shapes = [key(b) for b in batches]
        common = max(set(shapes), key=shapes.count)
        return tree_cat([b for b, k in zip(batches, shapes) if k == common])

    def training_note(self, cfg: Any) -> str:
        """A line ``train`` logs before the first stage (the data it trains on), or ""."""
        return ""

    def cost_unit(self, cfg: Any, sm: StoppingModel) -> tuple[str, float] | None:
        """(name, full-depth amount) of the model's cost, e.g. ("flops", FLOPs of exiting at T): every
        frontier point then also carries ``mean_<name>``."""
        return None

    # ---------------------------------------------------------------- shared settings
    def method(self, cfg: Any) -> MethodConfig:
        return getattr(cfg, "method", None) or MethodConfig()

    def inference(self, cfg: Any) -> InferenceConfig:
        return getattr(cfg, "inference", None) or InferenceConfig()

    def policy_rule(self, cfg: Any) -> str:
        """The policy rule that is deployed, calibrated and drawn as "policy": the configured one, or quantile
        when the configured rule is a classical one."""
        rule = self.inference(cfg).rule
        return rule if get_rule(rule).needs_policy else "quantile"

    def seed(self, cfg: Any) -> int:
        return int(getattr(cfg, "seed", 0))

def task_rules(app: StoppingApp, cfg: Any) -> list[str]:
    """The stop rules of a task (read off the rule registry's ``offered_by``): the policy's (quantile, threshold,
    price), the classical signals the task names (its classifier rules among them), and those of every task (a
    fixed depth)."""
    return [*list_rules(offered_by="policy"), *app.classical_signals(cfg), *list_rules(offered_by="every task")]


def check_rule(app: StoppingApp, cfg: Any, rule: Any, field: str, task: str = "") -> None:
    """Refuse a rule the task does not have, naming ``field`` and listing the task's rules."""
    rules = task_rules(app, cfg)
    if rule in rules:
        return
    listing = f"rules of {'task ' + task if task else 'this task'}: {', '.join(rules)}"
    if rule in list_rules(offered_by="classifier"):
        raise ConfigError(f"{field}: the {rule!r} rule reads class probabilities, and this task's outputs have no "
                          f"classes; {listing}")
    if rule in SIGNALS:
        raise ConfigError(f"{field}: this task has no {rule!r} rule; {listing}")
    raise ConfigError(f"{field}: {rule!r} is not a stop rule; {listing}")


def check_policy_rule(rule: str, sm: StoppingModel, field: str) -> None:
    """A policy rule the trained stop model's policy supports (the price rule needs a planning policy)."""
    if rule in SIGNALS and get_rule(rule).needs_policy and sm.policy is not None and rule not in policy_rules(sm.policy):
        raise ConfigError(f"{field}: the {rule!r} rule reads a planned q_phi, and this run's policy does not plan "
                          f"(it has no plan_step); rules of this policy: {', '.join(policy_rules(sm.policy))}")


def check_config(cfg: Any, where: str = "cfg") -> None:
    """A task's config dataclass instance (from its ``preset()`` or ``resolve``), not a dict or a class."""
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        raise TypeError(f"{where}: expected the task's config dataclass (e.g. preset('quick') of the task's app "
                        f"module); got {type(cfg).__name__ if not isinstance(cfg, type) else cfg}")


def require_trained(run_dir: Path, stage: str, command: str) -> None:
    path = Path(run_dir) / "checkpoints" / f"{stage}.pt"
    if not path.is_file():
        raise ConfigError(f"--run-dir: {run_dir} has no finished stage {stage!r} ({path} is missing); "
                          f"run the 'train' command before '{command}'")


def stop_model_trace(app: StoppingApp, cfg, sm: StoppingModel, split: str, device, with_classical: bool = True) -> Trace:
    """The stop model's trace on a split: per-step metrics, both policy rules' scores and classical signals."""
    rules = model_rules(app, cfg, sm) if with_classical else [*(policy_rules(sm.policy) if sm.policy is not None else ()),
                                                             "fixed"]
    signals = {r: (lambda r=r: rule_signal(app, cfg, sm, r)) for r in rules}
    return collect_trace(sm.model, app.eval_batches(cfg, split, device), app.metric(cfg), device, signals=signals,
                         extras=app.trace_extras(cfg))


def rule_signal(app: StoppingApp, cfg: Any, sm: StoppingModel, rule: str) -> StopSignal:
    """The stop signal of one of the task's rules: a policy rule's on the stop model's policy, a classical one as the
    task builds it (which part of the output it reads), a fixed depth's."""
    if SIGNALS[rule].needs_policy:
        return make_signal(rule, sm.policy)
    factory = app.classical_signals(cfg).get(rule)
    return factory() if factory is not None else make_signal(rule)


def calibrated_rule(app: StoppingApp, cfg: Any, sm: StoppingModel, cal: Calibration) -> Any:
    """A calibration's online rule, on the signal the task's traces scored (:func:`rule_signal`: MAML's tolerance
    reads the support loss, not the first output leaf)."""
    return rule_signal(app, cfg, sm, cal.rule).rule(cal.threshold)


def signal_key(app: StoppingApp, cfg: Any, rule: str) -> Any:
    """The part of the output a rule reads as the task builds it (:func:`rule_signal`; None: the default part), for
    the rules built by name elsewhere (:func:`~learn2stop.core.inference.active_rule`, ``InferenceConfig``)."""
    if SIGNALS[rule].needs_policy:
        return None
    return getattr(rule_signal(app, cfg, None, rule), "key", None)


def model_rules(app: StoppingApp, cfg: Any, sm: StoppingModel, first: str | None = None) -> list[str]:
    """Every rule the stop model can run: its policy's rules (none without a policy), the task's classical ones and
    a fixed depth; ``first`` (one of them) leads."""
    rules = [*(policy_rules(sm.policy) if sm.policy is not None else ()), *app.classical_signals(cfg), "fixed"]
    return rules if first is None else [first, *(r for r in rules if r != first)]
