"""LISTA-stop end to end: the task's :class:`~learn2stop.core.task.StoppingApp`, its evaluate command and its
registration (the core adds train, reproduce, calibrate, frontier and export). The config and presets are in :mod:`.config`, the problems in :mod:`.data`, the NMSE in
:mod:`.metric`, the evaluation in :mod:`.commands`, the tables and figures in :mod:`.report`.

Python API (the CLI calls exactly these)::

    from learn2stop.tasks.sparse import preset, reproduce
    results = reproduce(preset("quick"), "runs/sparse-quick")
    print(results["table1"])
"""
from __future__ import annotations

from pathlib import Path

import torch

from ...core import Metric, StoppingModel
from ...core.task import Stage, StoppingApp
from ...core.train import min_step_hook
from ...core.signals import ToleranceSignal
from ...utils.config import to_dict
from ...utils.seeding import drawing_from
from ..base import RunContext, TaskSpec, as_run, register_task
from . import commands
from .config import PRESETS, SparseConfig, equal_budget_config
from .data import SparseRecoveryTask
from .metric import energy_extras, excess_nmse, nmse_metric
from .models import LISTA
from .policy import SparseDepthPlanner, SparseStopPolicy


# ----------------------------------------------------------------------------- the pipeline


class SparseApp(StoppingApp):
    """LISTA-stop on the core pipeline: LISTA baseline, Stage I, II, optional III, AEVB."""

    baseline_label = "LISTA"

    def task(self, cfg: SparseConfig) -> SparseRecoveryTask:
        return self.cached(f"task {to_dict(cfg.problem)}", lambda: SparseRecoveryTask(cfg.problem))

    def build_models(self, cfg: SparseConfig, device) -> dict[str, StoppingModel]:
        task = self.task(cfg)
        return build(cfg, task.A, device, torch.Generator().manual_seed(cfg.seed))

    def training_task(self, cfg, key, sm):
        return self.task(cfg)

    def stages(self, cfg: SparseConfig) -> list[Stage]:
        min_step = min_step_hook(lambda c: c.policy.min_mass, replan_mass=lambda c: c.policy.replan_mass)

        stages = [Stage("baseline", "baseline", cfg.baseline, describe="LISTA: sum_t gamma^(T-t) ||x_t - x*||^2"),
                  Stage("stage1", "stop", cfg.stage1, init_from="baseline" if cfg.stage1_init == "baseline" else None,
                        describe=f"LISTA-stop Stage I (from {cfg.stage1_init} weights)")]
        if cfg.equal_budget:
            stages.append(Stage("lista_equal", "baseline_equal", equal_budget_config(cfg), init_from="baseline",
                                describe="LISTA trained on for Stage I's iterations (equal budget)"))
        stages.append(Stage("stage2", "stop", cfg.stage2, before=min_step, describe="LISTA-stop Stage II (policy)"))
        if cfg.run_stage3:
            stages.append(Stage("stage3", "stage3", cfg.stage3, init_from="stop", init_part="all",
                                describe="Stage III (beta-VAE fine-tuning of both)"))
        if cfg.run_aevb:
            stages.append(Stage("aevb", "aevb", cfg.aevb, init_from="baseline" if cfg.aevb_init == "baseline" else None,
                                describe=f"AEVB: theta and phi jointly (from {cfg.aevb_init} weights)"))
        return stages

    def eval_batches(self, cfg: SparseConfig, split: str, device):
        data = self.task(cfg).test if split == "test" else self.task(cfg).val
        return [(data.y[i:i + cfg.eval_batch].to(device), data.x[i:i + cfg.eval_batch].to(device))
                for i in range(0, len(data), cfg.eval_batch)]

    def metric(self, cfg) -> Metric:
        return nmse_metric()

    def trace_extras(self, cfg):
        return energy_extras

    def classical_signals(self, cfg):
        return {"tolerance": ToleranceSignal}

    def risk_losses(self, cfg, trace):
        """Excess squared error over full depth, per unit of mean signal energy (NMSE in linear units)."""
        return excess_nmse(trace)


def build(cfg: SparseConfig, A: torch.Tensor, device, generator: torch.Generator) -> dict[str, StoppingModel]:
    """LISTA (its ISTA initialisation is deterministic) and each stage's model, the policies' weights drawn in
    turn from ``generator``."""
    L, p, out = cfg.lista, cfg.policy, {}
    with drawing_from(generator):
        for key in ("baseline", "stop", "stage3", "aevb") + (("baseline_equal",) if cfg.equal_budget else ()):
            lista = LISTA(A, L.num_steps, L.L, L.rho, L.shrinkage)
            policy = (None if key.startswith("baseline")
                      else SparseDepthPlanner(A, L.num_steps, p.hidden, replan=p.replan_mass > 0)
                      if p.features == "plan" else SparseStopPolicy(A, L.num_steps, p.features, p.sketch_dim, p.hidden, seed=cfg.seed))
            out[key] = StoppingModel(lista, policy).to(device)
    return out


APP = SparseApp()


def build_lista_stop(cfg: SparseConfig, task: SparseRecoveryTask | None = None, with_policy: bool = True) -> StoppingModel:
    """LISTA (ISTA-initialised) plus, optionally, its stopping policy, as one StoppingModel (on CPU)."""
    return APP.build_models(cfg, "cpu")["stop" if with_policy else "baseline"]


# ----------------------------------------------------------------------------- commands
def evaluate(cfg: SparseConfig, run: RunContext | str | Path) -> dict:
    """Evaluate every trained model and the tuned ISTA/FISTA on the fixed test set; write tables and plots.

    The stop models run real early exit with the deployed rule (the run's calibration if any, else ``inference``):
    :func:`.commands.evaluate` on this task's app.
    """
    return commands.evaluate(APP, cfg, as_run(run))


SPEC = register_task(TaskSpec(
    name="sparse",
    description="Sparse recovery: LISTA-stop vs LISTA, ISTA, FISTA (paper Sec. 5.1, Tables 1-2, Fig. 4)",
    config_class=SparseConfig,
    presets=PRESETS,
    commands={"evaluate": evaluate},
    app=APP,
))
#: train LISTA, LISTA-stop (Stage I, II, optionally III) and AEVB, resumable; reproduce: train, deploy the calibrated
#: default, evaluate (Tables 1-2, Figure 4). The core's commands (:mod:`learn2stop.core.commands`) on this app.
train, reproduce = SPEC.commands["train"], SPEC.commands["reproduce"]
