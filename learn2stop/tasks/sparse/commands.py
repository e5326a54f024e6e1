"""Sparse recovery's evaluate command: ISTA and FISTA tuned on training problems, every trained model on the fixed
test set, Tables 1-2 and Figure 4 (bound to the task's app in :mod:`.app`)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from ...core.evaluate import evaluate_deployed
from ...core.loop import unroll
from ...core.task import StoppingApp, check_config
from ...core.trace import collect_trace
from ...core.train import load_stage
from ...utils.report import write_json
from ..base import RunContext, as_run
from .config import SparseConfig
from .data import SparseRecoveryTask, sample_problems
from .metric import db_ratio, nmse_from_errors
from .models import FISTA, ISTA
from .report import _curve, _figure4, _tables, _training_figure, training_curves


@torch.no_grad()
def tune_classical(cfg: SparseConfig, task: SparseRecoveryTask, algorithm: str, device, chunk: int = 8) -> dict[int, dict]:
    """Grid-search (L, rho) of ISTA or FISTA for every depth in ``cfg.classical.depths`` on
    training problems (never the test set). One batched unroll per chunk of grid points, with
    each sample carrying its own (L, rho), scores every depth at once.

    Returns {depth: {"L", "rho", "train_nmse"}}.
    """
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


def evaluate(app: StoppingApp, cfg: SparseConfig, run: RunContext | str | Path) -> dict:
    """Evaluate every trained model of ``app`` (the task's :data:`.app.APP`) and the tuned ISTA/FISTA on the fixed
    test set; write tables and plots.

    The stop models run real early exit with the deployed rule (the run's calibration if any,
    else ``inference``).
    """
    check_config(cfg)
    run = as_run(run)
    dev, task, metric = run.device, app.task(cfg), app.metric(cfg)
    test, batches, T = app.task(cfg).test, app.eval_batches(cfg, "test", dev), cfg.lista.num_steps
    results: dict[str, Any] = {"rows": {}, "depth": {}, "classical": {}}
    curves: dict[str, list[float]] = {}

    def per_step(model) -> torch.Tensor:  # (N, T) squared errors of every step
        return collect_trace(model, batches, metric, dev).metric

    def by_snr(times: torch.Tensor, mean: float | None = None) -> dict:  # mean stop step, overall and per SNR
        return {"mean": float(times.float().mean()) if mean is None else mean,
                **{f"{s:g}": float(times[test.snr == s].float().mean()) for s in cfg.problem.snrs}}

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

    errs = per_step(load_stage(app, cfg, run.run_dir, "baseline", dev).model)
    results["rows"][f"LISTA (T={T})"] = nmse_from_errors(errs[:, -1], test)
    curves["LISTA"] = _curve(errs, test)
    if cfg.equal_budget:
        errs_eq = per_step(load_stage(app, cfg, run.run_dir, "lista_equal", dev).model)
        results["rows"][f"LISTA (T={T}), equal budget"] = nmse_from_errors(errs_eq[:, -1], test)

    stop_models = {"Stage I+II": "stage2", "Stage I+II+III": "stage3" if cfg.run_stage3 else None,
                   "AEVB": "aevb" if cfg.run_aevb else None}
    q_main = errs_main = None
    for label, stage in stop_models.items():
        if stage is None:
            continue
        ev = evaluate_deployed(app, cfg, run, stage, generator=torch.Generator().manual_seed(cfg.seed),
                               configured=stage == "stage2", trace=stage == "stage2")
        results["rows"][label] = nmse_from_errors(ev.values, test)
        results["depth"][label] = by_snr(ev.stop_times)
        if stage == "stage2":
            results["rule"] = ev.desc
            results["rows"][f"LISTA-stop (T<={T})"] = results["rows"][label]
            results["depth"][f"LISTA-stop (T<={T})"] = results["depth"][label]
            if ev.configured is not None:  # the configured rule as a second operating point
                other = f"LISTA-stop, {cfg.inference.rule} {cfg.inference.param:g}"
                results["rows"][other] = nmse_from_errors(ev.configured["values"], test)
                results["depth"][other] = by_snr(ev.configured["stop_times"], ev.configured["mean_steps"])
            errs_main, q_main = ev.trace.metric, ev.q_phi()
            results["oracle_nmse"] = nmse_from_errors(errs_main.min(dim=1).values, test)  # needs x*: a bound
            results["min_step"] = int(ev.deployment.model.policy.min_step)

    results["training_curve"] = training_curves(cfg, run.run_dir, float(app.task(cfg).val.x.pow(2).sum(1).double().mean()))
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
