"""The paper's Algorithm 1 as a declarative pipeline, and the commands every task shares.

A task is a :class:`StoppingApp`: it builds its models, names its training stages, and supplies
its data, metric and report. The core runs the rest, the same way for every task:

- ``train``: the stages in order (baseline, Stage I, II, optional III, AEVB), with initialisation
  hand-offs (``init_from``) and between-stage hooks, resumable, into one run-directory layout:
  ``config.yaml``, ``metrics.jsonl``, ``checkpoints/<stage>.pt``, ``training_summary.json``;
- ``calibrate``: the stop rule's parameter for a budget or a risk level, saved as ``calibration.json``
  and used from then on by ``evaluate``, ``frontier``, the task's inference command and the API;
- ``frontier``: the accuracy-compute frontier (``frontier.md`` / ``.png`` / ``.json``).

:func:`load_stage` loads a finished stage by name (benchmarks import it).
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from ..runtime.registry import get_rule, list_rules
from ..utils.formats import RUN_FORMAT, format_refusal
from ..utils.config import ConfigError
from ..utils.distributed import DistContext
from ..utils.outputs import previous_path
from ..utils.report import write_json, write_text_atomic
from .calibration import (Calibration, InferenceConfig, active_rule, policy_rules, calibrate_budget, calibrate_match, calibrate_risk,
                          CALIBRATION_FILE, CalibrationTarget, check_calibration_replace, load_calibration,
                          save_calibration)
from .curves import (budget_costs, budget_curve, extend_below, fastest_at_quality, fixed_depth_curve, frontier_point,
                     frontier_summary, oracle_curve, rule_costs, speed_at_quality, sweep_curve)
from .frontier_report import frontier_markdown, frontier_plot, frontier_time_plot
from .head_to_head import head_to_head
from .timing import SPEED_KEYS, speeds_side_by_side
from .trace import Metric, Trace, collect_trace
from .loop import run_with_early_exit
from .model import StoppingModel
from .trees import tree_cat, tree_leaves, tree_map, tree_select
from .objectives import MethodConfig, StageConfig
from .rules import SIGNALS, DepthSignal, FixedDepth, SignalRule, StopSignal, first_crossing, make_signal
from .trainer import StagedTrainer, load_finished_stage


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
    """What the core reads of a run: where it writes, on which device and process, how it reports, and whether
    it resumes (the CLI's :class:`~learn2stop.tasks.base.RunContext` is one; any object with these will do)."""

    run_dir: Path
    ctx: DistContext
    progress: bool
    resume: bool

    @property
    def device(self) -> Any: ...

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


class MinStep:
    """Mixin for a policy module asked only from its ``min_step`` (see :func:`oracle_min_step`), which its
    checkpoint keeps: ``class MyPolicy(MinStep, nn.Module)``."""

    min_step: int = 1

    def get_extra_state(self) -> dict:
        return {"min_step": int(self.min_step)}

    def set_extra_state(self, state: dict) -> None:
        self.min_step = int(state["min_step"])


def min_step_hook(min_mass: Callable[[Any], float], cap: bool = False,
                  replan_mass: Callable[[Any], float] | None = None) -> Callable:
    """A stage's ``before`` hook that sets the stop model's ``policy.min_step`` by :func:`oracle_min_step` from
    the config's ``min_mass(cfg)`` (``cap``: at most T - 1, so that the policy is asked at least once), and, for a
    planning policy that can plan twice, its ``replan_step``: the first step before which the validation oracle
    holds ``replan_mass(cfg)`` of its mass (0: one plan), after the plan step and before T."""
    def hook(models, app, cfg, run: Run):
        sm = models["stop"]
        again = replan_mass(cfg) if replan_mass is not None else 0.0
        # one validation pass gives the oracle's mass for both steps
        mass = (oracle_step_mass(sm, app.training_task(cfg, "stop", sm), app.method(cfg), run.device)
                if min_mass(cfg) > 0 or again > 0 else None)
        sm.policy.min_step = oracle_min_step(sm, None, app.method(cfg), min_mass(cfg), run.device,
                                             last=sm.num_steps - 1 if cap else None, mass=mass)
        if sm.policy.min_step > 1:
            run.log(f"      policy asked from step {sm.policy.min_step} (oracle mass below {min_mass(cfg)} before it)")
        if again > 0:
            before = torch.cat([mass.new_zeros(1), mass.cumsum(0)[:-1]])  # before[t - 1]: the mass of steps < t
            late = [t for t in range(sm.policy.min_step + 1, sm.num_steps) if float(before[t - 1]) >= again]
            sm.policy.replan_step = late[0] if late else None
            run.log(f"      planned again at step {late[0]} (oracle mass {float(before[late[0] - 1]):.2f} before it)"
                    if late else f"      no second plan: no step after {sm.policy.min_step} and before "
                    f"{sm.num_steps} has oracle mass {again} before it")
    return hook


@torch.no_grad()
def oracle_min_step(sm: StoppingModel, task: Any, method: MethodConfig, min_mass: float, device, last: int | None = None,
                    mass: torch.Tensor | None = None) -> int:
    """First step whose mean validation oracle mass (with the method's prior and price; ``mass``: that of
    :func:`oracle_step_mass`, already computed) exceeds ``min_mass``.

    Earlier steps are (almost) never the oracle's choice, so a policy with ``min_step`` set to this is
    not even asked there: an explicit, reported minimum depth (the release applies the same cut silently).
    ``last`` caps the result (e.g. T - 1 so that the policy is asked at least once).
    """
    if min_mass <= 0:
        return 1
    mass = oracle_step_mass(sm, task, method, device) if mass is None else mass
    above = (mass > min_mass).nonzero()
    first = int(above[0]) + 1 if above.numel() else sm.num_steps
    return min(first, last) if last is not None else first


@torch.no_grad()
def oracle_step_mass(sm: StoppingModel, task: Any, method: MethodConfig, device) -> torch.Tensor:
    """(T,) the mean validation oracle mass q*(t) of each step, with the method's prior and price."""
    from .distributions import log_oracle_distribution

    sm.eval()
    prior = StageConfig(objective="stage2").inherit(method).model_log_prior(sm.model, device)
    mass, n = torch.zeros(sm.num_steps, device=device), 0
    for inputs, target in task.validation_batches(device):
        r = sm.unroll(inputs, target, task.loss_fn, use_policy=False)
        mass += log_oracle_distribution(r.losses, method.beta, prior).exp().sum(0)
        n += r.losses.shape[0]
    return mass / n


def _trainer(app: StoppingApp, cfg, run: Run, key: str, sm: StoppingModel) -> StagedTrainer:
    return StagedTrainer(sm, app.training_task(cfg, key, sm), run.run_dir, seed=app.seed(cfg), ctx=run.ctx,
                         progress=run.progress, resume=run.resume, inference=app.inference(cfg))


def run_pipeline(app: StoppingApp, cfg: Any, run: Run) -> dict[str, dict]:
    """Train every stage in order (resuming what exists); returns {stage: summary}."""
    models = app.build_models(cfg, run.device)
    method = app.method(cfg)
    stages = app.stages(cfg)  # a task leaves out what it does not train; a 0-iteration stage still hands weights on
    summaries: dict[str, dict] = {}
    for i, st in enumerate(stages, 1):
        sm = models[st.model]
        if st.init_from:
            src = models[st.init_from]
            if st.init_part == "all":
                sm.load_state_dict(src.state_dict())
            else:
                sm.model.load_state_dict(src.model.state_dict())
        if st.before is not None:
            st.before(models, app, cfg, run)
        scfg = st.config.inherit(method)
        run.log(f"[{i}/{len(stages)}] {st.name}: {st.describe or scfg.objective} "
                f"({scfg.variant}, beta={scfg.beta:g}, price={scfg.price:g})")
        summaries[st.name] = _trainer(app, cfg, run, st.model, sm).fit(st.name, scfg)
    if run.ctx.is_main:
        write_json(summaries, Path(run.run_dir) / "training_summary.json")
        for s in summaries.values():
            run.log(f"  {s['stage']}: {s['iterations']} iterations, best validation {s['select']} = "
                    f"{s['best_score']:.4g}, {s['seconds']:.0f} s")
    return summaries


def load_stage(app: StoppingApp, cfg: Any, run_dir: str | Path, stage: str, device=None) -> StoppingModel:
    """The model trained by a finished ``stage`` of a run, in eval mode (a clear error if it is missing)."""
    check_config(cfg)
    by_name = {s.name: s for s in app.stages(cfg)}
    if stage not in by_name:
        raise ConfigError(f"stage: {stage!r} is not a stage of this task; stages: {', '.join(by_name)}")
    models = app.build_models(cfg, device)
    sm = models[by_name[stage].model]
    load_finished_stage(sm, Path(run_dir) / "checkpoints", stage, map_location=device or "cpu")
    return sm.eval()


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


def _require_trained(run_dir: Path, stage: str, command: str) -> None:
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
    the rules built by name elsewhere (:func:`~learn2stop.core.calibration.active_rule`, ``InferenceConfig``)."""
    if SIGNALS[rule].needs_policy:
        return None
    return getattr(rule_signal(app, cfg, None, rule), "key", None)


def model_rules(app: StoppingApp, cfg: Any, sm: StoppingModel, first: str | None = None) -> list[str]:
    """Every rule the stop model can run: its policy's rules (none without a policy), the task's classical ones and
    a fixed depth; ``first`` (one of them) leads."""
    rules = [*(policy_rules(sm.policy) if sm.policy is not None else ()), *app.classical_signals(cfg), "fixed"]
    return rules if first is None else [first, *(r for r in rules if r != first)]


def _calibrate_each(app: StoppingApp, cfg: Any, sm: StoppingModel, val: Trace, test: Trace, rules: list[str],
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


def _passes(app: StoppingApp, size: int) -> int:
    """Round-robin timing passes at a batch size: a pass at batch 1 is short (``speed_samples`` requests) and jitters
    on a shared CPU, so it gets three times the task's ``speed_passes``."""
    return app.speed_passes * (3 if size == 1 else 1)


def _speed_data(app: StoppingApp, inputs: Any, size: int) -> Any:
    """The part of the (shuffled) speed inputs timed at a batch size: ``speed_samples`` requests one by one at batch
    1, else up to ``speed_batches`` full batches. ``size`` is at most the number of inputs."""
    n_in = tree_leaves(inputs)[0].shape[0]
    count = min(app.speed_samples, n_in) if size == 1 else size * max(1, min(n_in // size, app.speed_batches))
    return tree_map(lambda x: x[:count], inputs)


def _speeds(app: StoppingApp, cfg: Any, run: Run, jobs: dict[str, tuple[Any, Callable[[], Any]]],
            sizes: tuple[int, ...]) -> tuple[dict[str, dict[int, float]], str, dict[int, int]]:
    """Samples/s of each named ``(model, rule_factory)`` job at each batch size, side by side (round-robin passes,
    the best each: :func:`speeds_side_by_side`; :func:`_passes` of them) on the task's speed inputs, with the run's
    first backend (eager torch by default). Returns ({name: {size: samples/s}}, backend name, {asked size: size timed}); a size is capped at
    the number of speed inputs, and a job the backend cannot run has no entry."""
    inputs = shuffled(app.speed_inputs(cfg, run.device))
    n_in = tree_leaves(inputs)[0].shape[0]
    bname, runner = next(iter((getattr(run, "runners", None) or {"torch": run_with_early_exit}).items()))
    names = list(jobs)
    out: dict[str, dict[int, float]] = {n: {} for n in names}
    timed: dict[int, int] = {}
    skip: set[int] = set()
    for asked in sizes:
        size = timed[asked] = min(asked, n_in)
        got = speeds_side_by_side([jobs[n] for n in names], _speed_data(app, inputs, size), size, _passes(app, size), runner, skip=skip,
                                  log=lambda m: run.log(f"timing ({bname}): {m}"))
        for n, v in zip(names, got):
            if v is not None:
                out[n][size] = v
    return {n: v for n, v in out.items() if v}, bname, timed


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
    _require_trained(run.run_dir, app.stop_stage, "calibrate")
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

    cals = _calibrate_each(app, cfg, sm, val, test, rules, calibrate)
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
    """The calibrated rule that runs fastest at batch ``speed_batch`` (:func:`_speeds`); the others' speeds and test
    results recorded with it (``Calibration.chosen_by``)."""
    speeds, bname, sizes = _speeds(app, cfg, run, {r: (sm.model, lambda c=c: calibrated_rule(app, cfg, sm, c))
                                                   for r, c in cals.items()}, (speed_batch or app.speed_batch,))
    size = next(iter(sizes.values()))
    timed = {r: v[size] for r, v in speeds.items()}
    if not timed:
        raise ConfigError(f"calibrate --fastest: the {bname} backend runs none of the calibrated rules")
    best = max(timed, key=timed.get)
    cal = cals[best]
    cal.target = {**cal.target, "fastest_at_batch": size}
    cal.chosen_by = {"batch_size": size, "backend": bname, "device": str(run.device or "cpu"),
                     "passes": _passes(app, size), "samples_per_s": timed,
                     "candidates": {r: {"param": c.param if math.isfinite(c.param) else None, "test": c.test}
                                    for r, c in cals.items()}}
    rows = "\n".join(f"  {r:<11} {f'{timed[r]:,.0f}' if r in timed else '-':>12} samples/s   test {c.test['metric']:.4g} "
                     f"at {c.test['mean_steps']:.2f} steps" + ("   <- fastest" if r == best else "") for r, c in cals.items())
    run.log(f"calibrate --fastest: every rule calibrated for the same target, timed at batch {size} ({bname}, "
            f"{_passes(app, size)} passes, the best each):\n{rows}")
    return cal


def deploy_calibration(app: StoppingApp, cfg: Any, run: Run, *, delta: float = 0.1) -> Calibration | None:
    """The operating point a user deploys: keep the baseline's quality, with a guarantee, as fast as it goes.

    The policy rule (``inference.rule``, or ``quantile``) is calibrated by Learn-then-Test on the validation
    split with epsilon = the stop model's lead over the baseline at full depth (:meth:`StoppingApp.quality_lead`),
    so that with probability at least 1 - delta its quality on new data is at least the baseline's full depth.
    Saved as the run's ``calibration.json`` (used by ``evaluate``), unless the run already has one (a user's
    own calibration wins). With no lead at full depth (an earlier exit may still be better than the last), the
    cheapest threshold that matches the baseline's full depth on validation, empirically, with no guarantee
    (target kind ``match``). None when no threshold reaches it: then the run deploys the baseline at full depth,
    recorded with the reason in ``deployment.json`` (:func:`served_baseline`).

    Every other rule of the stop model (the other policy rules, the classical ones, a fixed depth) is calibrated for
    the same target too, and each is timed side by side with the baseline at full depth at batch 1, at
    ``inference.serve_batch`` and at the task's speed batch: ``in_time.json`` / ``in_time.md``
    (:func:`deployment_in_time`). What is deployed is what a user serving at ``serve_batch`` would pick: the fastest of
    them there (:func:`fastest_certified`: ties within :data:`SPEED_TIE` go to the least cost on validation), which
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
    policy_cal = cal
    if app.deploy_in_time:  # every rule certified for the target, timed at the served batch: deploy the fastest
        cal, why = _deploy_fastest(app, cfg, run, sm, base, val, calibrate, rule, how, policy_cal)
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
            write_json({"format": RUN_FORMAT, "stage": app.baseline_stage, "reason": reason},
                       Path(run.run_dir) / DEPLOYMENT_FILE)
        run.log(f"deployed: {app.baseline_label} at full depth, as {reason}; the stop model keeps the configured "
                f"{app.inference(cfg).rule} rule")
        return None
    cal.target["reference"] = reference
    if run.ctx.is_main:
        save_calibration(cal, run.run_dir)
        (Path(run.run_dir) / DEPLOYMENT_FILE).unlink(missing_ok=True)
    run.log(f"deployed rule: {cal.rule} calibrated to keep {app.baseline_stage}'s full-depth quality ({how}): "
            f"{SIGNALS[cal.rule].param_name} = {cal.param:.4g}, {100 * cal.calibration['mean_cost']:.1f} % of the cost "
            f"on validation{why}")
    return cal


IN_TIME_FILE = "in_time"

#: speeds within this fraction of the fastest are a tie (best-of-passes speeds of one job move by a few per cent
#: between runs on one machine); a tie goes to the candidate with the least cost on validation
SPEED_TIE = 0.05


def fastest_certified(speeds: dict[str, float], costs: dict[str, float], tie: float = SPEED_TIE) -> str | None:
    """The candidate a user serving at one batch size deploys: the fastest (``speeds``: name -> samples/s), with the
    candidates within ``tie`` of it counted as tied and the tie going to the least validation cost (``costs``: name
    -> mean cost as a fraction of full depth; the baseline at full depth costs 1). None when nothing was timed."""
    timed = {n: v for n, v in speeds.items() if v is not None and n in costs}
    if not timed:
        return None
    best = max(timed.values())
    near = [n for n, v in timed.items() if v >= (1 - tie) * best]
    return min(near, key=lambda n: (costs[n], -timed[n]))


def _deploy_fastest(app: StoppingApp, cfg: Any, run: Run, sm: StoppingModel, base: StoppingModel, val: Trace,
                    calibrate: Callable, rule: str, how: str, policy_cal: Calibration | None
                    ) -> tuple[Calibration | None, str]:
    """Every rule of the stop model certified for the target, timed beside the baseline at full depth
    (:func:`deployment_in_time`), and the fastest at ``inference.serve_batch`` chosen (:func:`fastest_certified`):
    (its calibration, or None where the baseline is fastest or nothing reaches the target; the reason in words)."""
    serve = app.inference(cfg).serve_batch
    result, cals = deployment_in_time(app, cfg, run, sm, base, val, calibrate, rule, how, serve)
    size = result["serve_batch"]
    speeds = {row["rule"]: row.get("samples_per_s", {}).get(size) for row in result["rows"]}
    costs = {"baseline": 1.0, **{r: c.calibration["mean_cost"] for r, c in cals.items()}}
    pick = fastest_certified(speeds, costs)
    ref = speeds.get("baseline")
    if pick is None:  # nothing timed (a backend that runs none of them): the least cost on validation
        pick = min(cals, key=lambda r: cals[r].calibration["mean_cost"]) if cals else "baseline"
        why = f"; no rule was timed at batch {size}, so the least cost on validation is deployed"
    elif pick == "baseline":
        quickest = max(cals, key=lambda r: speeds.get(r) or 0.0, default=None)
        why = ("" if quickest is None else
               f"every rule of the stop model certified to keep its quality runs slower than {app.baseline_label} at "
               f"full depth at batch {size} (the fastest, {quickest}, at {(speeds.get(quickest) or 0.0) / ref:.2f}x)")
    else:
        rate = f", {speeds[pick] / ref:.2f}x {app.baseline_label} at full depth" if ref else ""
        why = (f"; the fastest certified at batch {size} ({speeds[pick]:,.0f} samples/s{rate}; ties within "
               f"{100 * SPEED_TIE:.0f} % go to the least cost)")
    _write_in_time(app, run, result, pick)
    return (None if pick == "baseline" else cals[pick]), why


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
    cals = _calibrate_each(app, cfg, sm, val, test, rules, calibrate)
    jobs = {"baseline": (base.model, FixedDepth)}
    jobs.update({r: (sm.model, lambda c=c: calibrated_rule(app, cfg, sm, c)) for r, c in cals.items()})
    speeds, bname, sizes = _speeds(app, cfg, run, jobs, tuple(dict.fromkeys((1, serve_batch, app.speed_batch))))
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
    fastest = {}
    for n in sizes.values():
        got = {row["rule"]: row["samples_per_s"][n] for row in rows if n in row.get("samples_per_s", {})}
        if got:
            fastest[n] = max(got, key=got.get)
    result = {"metric": metric.name, "reference": f"{app.baseline_label} at full depth", "calibration": how,
              "backend": bname, "device": str(run.device or "cpu"),
              "passes": {str(n): _passes(app, n) for n in sorted(set(sizes.values()))},
              "batch_sizes": sorted(set(sizes.values())), "serve_batch": sizes[serve_batch], "rows": rows,
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
                   f"ties within {100 * SPEED_TIE:.0f} % going to the least cost on validation.")
    return "\n".join(lines)


def frontier_command(app: StoppingApp, cfg: Any, run: Run, *, budgets=(0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
                     speed: bool = True, runners: dict[str, Callable] | None = None) -> dict:
    """The accuracy-compute frontier of a trained run: ``frontier.json``, ``frontier.md``, ``frontier.png``.

    ``runners``: backend name -> runner (:mod:`learn2stop.backends`; default eager torch) whose speeds are
    measured side by side. The first gives each point's ``samples_per_s_*`` and the time plot; every one
    has its speeds in ``point["speeds"][name]`` and its "In time" table, all against the first backend's
    reference (e.g. ONNX Runtime's policy against eager LISTA). A point a backend cannot run has none.
    """
    runners = runners or {"torch": run_with_early_exit}
    _require_trained(run.run_dir, app.stop_stage, "frontier")
    dev = run.device
    metric = app.metric(cfg)
    sm = load_stage(app, cfg, run.run_dir, app.stop_stage, dev)
    t0 = time.perf_counter()
    test = stop_model_trace(app, cfg, sm, "test", dev)
    val = stop_model_trace(app, cfg, sm, "val", dev) if sm.policy is not None else None
    T = test.num_steps
    N = test.metric.shape[0]
    curves: dict[str, list[dict]] = {}
    how: dict[str, tuple[Callable[[dict], Callable], Any]] = {}  # curve -> (point -> rule factory, model to time)
    rivals: dict[str, tuple[Trace, str]] = {}  # the head-to-head's columns: the one-line rules of stopping networks

    def network(prefix: str, trace: Trace, model: Any) -> None:
        """A network's fixed depths, and the classical rules swept when its trace has their scores."""
        curves[f"{prefix}fixed_depth"] = fixed_depth_curve(trace, metric)
        if prefix != "baseline_":  # the baseline is the speed reference; its exits (if any) are not trained to stop
            rivals.update({prefix + name: (trace, name) for name in (*app.classical_signals(cfg), "fixed")
                           if name in trace.signals})
        how[f"{prefix}fixed_depth"] = (lambda p: (lambda: FixedDepth(p["depth"])), model)
        for name, factory in app.classical_signals(cfg).items():
            if name in trace.signals:
                curves[prefix + name] = sweep_curve(trace, metric, trace.signals[name], factory())
                how[prefix + name] = (lambda p, f=factory: (lambda: SignalRule(f(), p["threshold"])), model)

    network("", test, sm.model)
    base = None
    if app.baseline_stage and (Path(run.run_dir) / "checkpoints" / f"{app.baseline_stage}.pt").is_file():
        base = load_stage(app, cfg, run.run_dir, app.baseline_stage, dev)
        if base.num_steps > 1:
            network("baseline_", collect_trace(base.model, app.eval_batches(cfg, "test", dev), metric, dev,
                                               extras=app.trace_extras(cfg)), base.model)
    for prefix, stage in app.frontier_also.items():
        other = load_stage(app, cfg, run.run_dir, stage, dev)
        network(f"{prefix}_", collect_trace(other.model, app.eval_batches(cfg, "test", dev), metric, dev,
                                            signals={**app.classical_signals(cfg), "fixed": DepthSignal},
                                            extras=app.trace_extras(cfg)), other.model)
    main = None
    ref_pts = curves.get("baseline_fixed_depth")
    ref = max(ref_pts, key=lambda p: p["mean_steps"]) if ref_pts else None  # the speed reference (below), or full depth
    full = frontier_point(test, metric, torch.full((N,), T, dtype=torch.long), test.fixed_depth_costs)
    goal = (ref if ref is not None else full)["metric"]
    if sm.policy is not None:
        check_policy_rule(app.inference(cfg).rule, sm, "inference.rule")
        main = app.policy_rule(cfg)
        for rule in (main, *(r for r in policy_rules(sm.policy) if r != main)):
            name = "policy" if rule == main else f"policy_{rule}"
            signal = make_signal(rule, sm.policy)
            # cheaper budgets while the cheapest still beats the speed reference: where it reaches it is then measured
            curves[name] = extend_below(budget_curve(test, metric, val, rule, signal, budgets, app.budget_by), test,
                                        metric, val, rule, signal, goal, app.budget_by)
            how[name] = (lambda p, r=rule: (lambda: SignalRule(make_signal(r, sm.policy), p["threshold"])), sm.model)
        # The main rule swept over thresholds on the test trace, as the classical rules are: the like-for-like
        # comparison of the rules' rankings (the budget curve above is what calibration on validation deploys).
        curves["policy_swept"] = sweep_curve(test, metric, test.signals[main], make_signal(main, sm.policy))
        how["policy_swept"] = how["policy"]  # the same rule at other thresholds
    curves["oracle"] = oracle_curve(test, metric)
    run.log(f"frontier: traces of {N} test samples in {time.perf_counter() - t0:.1f}s; measuring speeds")
    overhead, bn = None, min(app.speed_batch, N)
    if speed:
        inputs = shuffled(app.speed_inputs(cfg, dev))
        n_in = tree_leaves(inputs)[0].shape[0]
        bn = min(app.speed_batch, n_in)
        one, big = _speed_data(app, inputs, 1), _speed_data(app, inputs, bn)
        jobs = [(full, lambda: FixedDepth(), sm.model)]
        asked: dict = {}
        if sm.policy is not None:  # the policy's own cost: its main rule asked as at inference, never stopping early
            jobs.append((asked, lambda: SignalRule.never_stopping(make_signal(main, sm.policy)), sm.model))
        jobs += [(p, how[name][0](p), how[name][1]) for name, pts in curves.items() if name in how for p in pts]
        for bname, runner in runners.items():
            unsupported: set[int] = set()
            for key, data, size in (("samples_per_s_batch1", one, 1), ("samples_per_s_batchN", big, bn)):
                got = speeds_side_by_side([(model, factory) for _, factory, model in jobs], data, size,
                                          _passes(app, size), runner, skip=unsupported,
                                          log=lambda m, b=bname: run.log(f"frontier ({b}): {m}"))
                for (point, _, _), v in zip(jobs, got):
                    if v is not None:
                        point.setdefault("speeds", {}).setdefault(bname, {})[key] = v
        first = next(iter(runners))
        for point, _, _ in jobs:
            point.update(point.get("speeds", {}).get(first, {}))
        if asked:
            overhead = {"batch1": full["samples_per_s_batch1"] / asked["samples_per_s_batch1"] - 1,
                        "batchN": full["samples_per_s_batchN"] / asked["samples_per_s_batchN"] - 1}
    unit = app.cost_unit(cfg, sm)
    if unit is not None:
        for p in [full] + [p for pts in curves.values() for p in pts]:
            p[f"mean_{unit[0]}"] = p["mean_cost"] * unit[1]
    result = {"metric": metric.name, "lower_is_better": metric.lower_is_better, "num_steps": T,
              "full_depth": full, "batch_n": bn, "device": str(dev or "cpu"), "backend": next(iter(runners)),
              "test_samples": N, "budget_by": app.budget_by, "curves": curves, "speed_passes": app.speed_passes,
              "speed_passes_batch1": _passes(app, 1),
              "policy_overhead": overhead}
    if speed:  # the number a user cares about: how much faster at the quality they have today
        ref = ref if ref is not None else full
        result["speed_reference"] = {"name": f"{app.baseline_stage} at full depth" if ref_pts else "full depth",
                                     "metric": ref["metric"], **{k: ref[k] for k in SPEED_KEYS if k in ref}}
        result["speed_at_quality"] = speed_at_quality(curves, metric, ref)
        result["fastest_at_quality"] = fastest_at_quality(result["speed_at_quality"])
        result["backends"] = list(runners)
        for bname in list(runners)[1:]:
            moved = {n: [{**{k: v for k, v in p.items() if k not in SPEED_KEYS}, **p.get("speeds", {}).get(bname, {})}
                         for p in pts] for n, pts in curves.items()}
            result.setdefault("speed_at_quality_by_backend", {})[bname] = speed_at_quality(moved, metric, ref)
    result["summary"] = frontier_summary(curves, metric, full, T)
    if sm.policy is not None and curves["policy"]:  # is the learned rule better than the one-line rules, or noise?
        result["head_to_head"] = head_to_head(test, metric, main, [p["threshold"] for p in curves["policy"]], rivals,
                                              app.budget_by)
    if app.budget_by == "cost":
        result["summary_by_cost"] = frontier_summary(curves, metric, full, T, x="mean_cost")
    if run.ctx.is_main:
        out = Path(run.run_dir)
        write_json(result, out / "frontier.json")
        write_text_atomic(out / "frontier.md", frontier_markdown(result) + "\n")
        frontier_plot(result, out / "frontier.png", x="mean_cost" if app.budget_by == "cost" else "mean_steps")
        if speed:
            frontier_time_plot(result, out / "frontier_time.png")
        run.log(frontier_markdown(result))
    return result


def shuffled(inputs: Any, seed: int = 0) -> Any:
    """A batch-first tree in a fixed random order. The frontier times the first samples of its test inputs one by
    one; test sets come grouped (by SNR, noise level, class), and the first ones would be one group (measured on
    sparse: the first 200 are all SNR 20, which the learned rule runs 14.0 steps against 13.4 on the whole set)."""
    order = torch.randperm(tree_leaves(inputs)[0].shape[0], generator=torch.Generator().manual_seed(seed))
    return tree_select(inputs, order.to(tree_leaves(inputs)[0].device))


DEPLOYMENT_FILE = "deployment.json"


def served_baseline(app: StoppingApp, cfg: Any, run_dir) -> str | None:
    """Why the run deploys its baseline at full depth rather than the stop model, or None.

    ``reproduce`` (:func:`deploy_calibration`) records it in ``deployment.json`` when no threshold of the stop
    model reaches the baseline's full-depth quality on validation: a user who must keep that quality ships the
    baseline. A calibration saved since (``calibrate``: a user's own operating point) and ``use_calibrated:
    false`` (the config's rule, asked for) both put the stop model back.
    """
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
    return reason


def deployed_model(app: StoppingApp, cfg: Any, run_dir, device=None, generator=None) -> tuple[StoppingModel, Any, str]:
    """What a trained run serves, (model, rule, description): its baseline at full depth where the run deploys it
    (:func:`served_baseline`), else the stop model with :func:`deployed_rule`. For the commands that serve inputs."""
    reason = served_baseline(app, cfg, run_dir)
    if reason is not None:
        return (load_stage(app, cfg, run_dir, app.baseline_stage, device), FixedDepth(),
                f"{app.baseline_label} at full depth, no early exit: {reason}")
    sm = load_stage(app, cfg, run_dir, app.stop_stage, device)
    return (sm, *deployed_rule(app, cfg, run_dir, sm, generator=generator))


def deployed_rule(app: StoppingApp, cfg: Any, run_dir, sm: StoppingModel, generator=None):
    """The rule a trained run uses at inference: its calibration if any, else the config's (rule, description).
    When the run deploys its baseline (:func:`served_baseline`) this is the stop model's rule, and the description
    says so."""
    check_config(cfg)
    inference = app.inference(cfg)
    check_rule(app, cfg, inference.rule, "inference.rule")
    cal = load_calibration(run_dir) if run_dir is not None and inference.use_calibrated and not inference.sampled else None
    if cal is not None:
        check_rule(app, cfg, cal.rule, f"{Path(run_dir) / 'calibration.json'}: rule")
        check_policy_rule(cal.rule, sm, f"{Path(run_dir) / 'calibration.json'}: rule")
    elif not inference.sampled:
        check_policy_rule(inference.rule, sm, "inference.rule")
    name = cal.rule if cal is not None else inference.rule
    rule, desc = active_rule(app.inference(cfg), run_dir, sm.policy, key=signal_key(app, cfg, name), generator=generator)
    reason = served_baseline(app, cfg, run_dir)
    if reason is not None:
        desc += f" (the run deploys {app.baseline_label} at full depth instead: {reason})"
    return rule, desc
