"""Algorithm 1's training side: a task's stages in order, with their hand-offs, into one run directory; a finished
stage loaded by name; the between-stage hook that picks the policy's first step."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from ..utils.config import ConfigError
from ..utils.report import write_json
from .model import StoppingModel
from .objectives import MethodConfig, StageConfig
from .stage_checkpoints import load_finished_stage
from .trainer import StagedTrainer
from .task import Run, StoppingApp, check_config



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
