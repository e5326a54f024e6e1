"""LISTA-stop end to end: the pipeline and the train / evaluate / reproduce commands (the config and presets
are in :mod:`.config`, the tables and figures in :mod:`.report`).

Python API (the CLI calls exactly these)::

    from learn2stop.tasks.sparse import preset, reproduce
    results = reproduce(preset("quick"), "runs/sparse-quick")
    print(results["table1"])
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from ...core import Metric, StoppingModel, log_stop_time_distribution, stop_time_distribution
from ...core.distributions import replanned_log_q
from ...core.trace import collect_trace, evaluate_rule
from ...core.loop import unroll
from ...core.task import Stage, StoppingApp, check_config, stop_model_trace
from ...core.deploy import deployed_rule
from ...core.train import load_stage, min_step_hook
from ...core.signals import ToleranceSignal
from ...utils.config import to_dict
from ...utils.report import write_json
from ...utils.seeding import drawing_from
from ..base import RunContext, TaskSpec, as_run, register_task, reproduce_pipeline, train_pipeline
from .models import FISTA, ISTA, LISTA
from .policy import SparseDepthPlanner, SparseStopPolicy
from .config import PRESETS, SparseConfig, equal_budget_config, preset  # noqa: F401  (the task's public names)
from .problem import db_ratio, nmse_from_errors
from .report import PAPER_TABLE1, PAPER_TABLE2, _curve, _figure4, _tables, _training_figure, training_curves  # noqa: F401
from .task import SparseRecoveryTask


# ----------------------------------------------------------------------------- the pipeline


class SparseApp(StoppingApp):
    """LISTA-stop on the core pipeline: LISTA baseline, Stage I, II, optional III, AEVB."""

    baseline_label = "LISTA"

    def task(self, cfg: SparseConfig) -> SparseRecoveryTask:
        return self.cached(f"task {to_dict(cfg.problem)}", lambda: SparseRecoveryTask(cfg.problem))

    def build_models(self, cfg: SparseConfig, device) -> dict[str, StoppingModel]:
        task, L = self.task(cfg), cfg.lista
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
        return Metric("NMSE (dB)", SparseRecoveryTask.loss_fn, lower_is_better=True,
                      aggregate=lambda v, ex: db_ratio(v.double().sum(), ex["energy"].double().sum()))

    def trace_extras(self, cfg):
        return lambda y, x: {"energy": x.pow(2).sum(dim=1)}

    def classical_signals(self, cfg):
        return {"tolerance": ToleranceSignal}

    def risk_losses(self, cfg, trace):
        """Excess squared error over full depth, per unit of mean signal energy (NMSE in linear units)."""
        scale = trace.extras["energy"].double().mean().float()
        return (trace.metric - trace.metric[:, -1:]) / scale, None


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
def train(cfg: SparseConfig, run: RunContext | str | Path) -> dict:
    """Train LISTA (baseline), LISTA-stop (Stage I, II and optionally III) and AEVB; resumable."""
    return train_pipeline(APP, cfg, run)


@torch.no_grad()
def tune_classical(cfg: SparseConfig, task: SparseRecoveryTask, algorithm: str, device, chunk: int = 8) -> dict[int, dict]:
    """Grid-search (L, rho) of ISTA or FISTA for every depth in ``cfg.classical.depths`` on
    training problems (never the test set). One batched unroll per chunk of grid points, with
    each sample carrying its own (L, rho), scores every depth at once.

    Returns {depth: {"L", "rho", "train_nmse"}}.
    """
    from .problem import sample_problems

    data = sample_problems(task.A, cfg.problem, cfg.classical.tune_samples, torch.Generator().manual_seed(cfg.seed + 17))
    cls = {"ISTA": ISTA, "FISTA": FISTA}[algorithm]
    grid = [(L, rho) for L in cfg.classical.L_grid for rho in cfg.classical.rho_grid]
    depths = sorted(cfg.classical.depths)
    N, energy = len(data), data.x.pow(2).sum()
    scores = []  # (G, len(depths)) NMSE dB
    for i in range(0, len(grid), chunk):
        part = grid[i:i + chunk]
        L = torch.tensor([g[0] for g in part]).repeat_interleave(N)[:, None].to(device)
        rho = torch.tensor([g[1] for g in part]).repeat_interleave(N)[:, None].to(device)
        y, x = data.y.repeat(len(part), 1).to(device), data.x.repeat(len(part), 1).to(device)
        errs = unroll(cls(task.A, depths[-1], L, rho).to(device), y, target=x, loss_fn=SparseRecoveryTask.loss_fn).losses
        errs = errs.view(len(part), N, -1)[:, :, [d - 1 for d in depths]].sum(1).cpu()  # (chunk, depths)
        scores.append(torch.nan_to_num(db_ratio(errs, energy), nan=float("inf")))
    scores = torch.cat(scores)
    best = {}
    for j, d in enumerate(depths):
        k = int(scores[:, j].argmin())
        best[d] = {"L": grid[k][0], "rho": grid[k][1], "train_nmse": float(scores[k, j])}
    return best


def evaluate(cfg: SparseConfig, run: RunContext | str | Path) -> dict:
    """Evaluate every trained model and the tuned ISTA/FISTA on the fixed test set; write tables and plots.

    The stop models run real early exit with the deployed rule (the run's calibration if any,
    else ``inference``).
    """
    check_config(cfg)
    run = as_run(run)
    dev, task, metric = run.device, APP.task(cfg), APP.metric(cfg)
    test, batches, T = APP.task(cfg).test, APP.eval_batches(cfg, "test", dev), cfg.lista.num_steps
    results: dict[str, Any] = {"rows": {}, "depth": {}, "classical": {}}
    curves: dict[str, list[float]] = {}

    def per_step(model) -> torch.Tensor:  # (N, T) squared errors of every step
        return collect_trace(model, batches, metric, dev).metric

    t0 = time.perf_counter()
    for algo, cls in (("ISTA", ISTA), ("FISTA", FISTA)):
        tuned = tune_classical(cfg, task, algo, dev)
        for depth in cfg.classical.depths:
            errs = per_step(cls(task.A, depth, tuned[depth]["L"], tuned[depth]["rho"]).to(dev))
            results["classical"][f"{algo} (T={depth})"] = tuned[depth]
            results["rows"][f"{algo} (T={depth})"] = nmse_from_errors(errs[:, -1], test)
            if depth == max(cfg.classical.depths):
                curves[algo] = _curve(errs, test)
    run.log(f"classical baselines tuned and evaluated in {time.perf_counter() - t0:.1f}s")

    errs = per_step(load_stage(APP, cfg, run.run_dir, "baseline", dev).model)
    results["rows"][f"LISTA (T={T})"] = nmse_from_errors(errs[:, -1], test)
    curves["LISTA"] = _curve(errs, test)
    if cfg.equal_budget:
        errs_eq = per_step(load_stage(APP, cfg, run.run_dir, "lista_equal", dev).model)
        results["rows"][f"LISTA (T={T}), equal budget"] = nmse_from_errors(errs_eq[:, -1], test)

    stop_models = {"Stage I+II": "stage2", "Stage I+II+III": "stage3" if cfg.run_stage3 else None,
                   "AEVB": "aevb" if cfg.run_aevb else None}
    q_main = errs_main = None
    for label, stage in stop_models.items():
        if stage is None:
            continue
        sm = load_stage(APP, cfg, run.run_dir, stage, dev)
        rule, desc = deployed_rule(APP, cfg, run.run_dir if stage == "stage2" else None, sm,
                                   generator=torch.Generator().manual_seed(cfg.seed))
        r = evaluate_rule(sm.model, batches, lambda: rule, metric, dev, extras=APP.trace_extras(cfg), runner=run.runner)
        times = r["stop_times"]
        results["rows"][label] = nmse_from_errors(r["values"], test)
        results["depth"][label] = {"mean": float(times.float().mean()),
                                   **{f"{s:g}": float(times[test.snr == s].float().mean()) for s in cfg.problem.snrs}}
        if stage == "stage2":
            results["rule"] = desc
            results["rows"][f"LISTA-stop (T<={T})"] = results["rows"][label]
            results["depth"][f"LISTA-stop (T<={T})"] = results["depth"][label]
            inf = cfg.inference
            if desc.startswith("calibrated") and not inf.sampled:  # the configured rule as a second operating point
                other = f"LISTA-stop, {inf.rule} {inf.param:g}"
                r2 = evaluate_rule(sm.model, batches, lambda: inf.make_rule(sm.policy), metric, dev, runner=run.runner,
                                   extras=APP.trace_extras(cfg))
                results["rows"][other] = nmse_from_errors(r2["values"], test)
                results["depth"][other] = {"mean": r2["mean_steps"], **{f"{s:g}": float(r2["stop_times"][test.snr == s]
                                                                       .float().mean()) for s in cfg.problem.snrs}}
            trace = stop_model_trace(APP, cfg, sm, "test", dev, with_classical=False)
            errs_main = trace.metric
            if "threshold" in trace.signals:
                q_main = stop_time_distribution(trace.signals["threshold"].clamp_min(0))  # pi_t -> q_phi (-inf: not asked)
            else:  # a second plan: its q_phi is the two plans combined
                with torch.no_grad():
                    rolls = [sm.unroll(y) for y, _ in batches]
                    q_main = torch.cat([replanned_log_q(log_stop_time_distribution(r.stop_logits), r.replan_log_q,
                                                        sm.policy.replan_step).exp().cpu() for r in rolls])
            results["oracle_nmse"] = nmse_from_errors(errs_main.min(dim=1).values, test)  # needs x*: a bound
            results["min_step"] = int(sm.policy.min_step)

    results["training_curve"] = training_curves(cfg, run.run_dir, float(APP.task(cfg).val.x.pow(2).sum(1).double().mean()))
    table1, table2 = _tables(results, cfg)
    results["table1"], results["table2"] = table1, table2
    if run.ctx.is_main:
        (run.run_dir / "table1.md").write_text(table1 + "\n")
        (run.run_dir / "table2.md").write_text(table2 + "\n")
        write_json({k: v for k, v in results.items() if not k.startswith("table")}, run.run_dir / "results.json")
        _figure4(q_main, errs_main, test, curves, run.run_dir)
        _training_figure(results["training_curve"], run.run_dir)
        run.log(f"\nLISTA-stop (T<={T}) stops with the {results.get('rule')}")
        run.log("\nTable 1: NMSE (dB) on the test set; paper's value in parentheses\n" + table1)
        run.log("\nTable 2: training algorithms for LISTA-stop\n" + table2)
        for name, pts in results["training_curve"].items():
            if pts:
                run.log(f"training time of {name}: {pts[-1][0]:.0f} s to {pts[-1][1]:.2f} dB (validation)")
        run.log(f"\nwritten: {run.run_dir}/table1.md, table2.md, results.json, fig4_stop_distribution.png, "
                f"fig4_convergence.png, training_curve.png")
    return results



def reproduce(cfg: SparseConfig, run: RunContext | str | Path) -> dict:
    """Train everything (resuming what exists), deploy the calibrated default, then evaluate: Tables 1-2, Figure 4."""
    return reproduce_pipeline(APP, cfg, run, train, evaluate)


SPEC = register_task(TaskSpec(
    name="sparse",
    description="Sparse recovery: LISTA-stop vs LISTA, ISTA, FISTA (paper Sec. 5.1, Tables 1-2, Fig. 4)",
    config_class=SparseConfig,
    presets=PRESETS,
    commands={"train": train, "evaluate": evaluate, "reproduce": reproduce},
    app=APP,
))
