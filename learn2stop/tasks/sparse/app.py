"""LISTA-stop end to end: config, presets, and the train / evaluate / reproduce commands.

Python API (the CLI calls exactly these)::

    from learn2stop.tasks.sparse import preset, reproduce
    results = reproduce(preset("quick"), "runs/sparse-quick")
    print(results["table1"])
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...core import (PolicyRule, StageConfig, StagedTrainer, StoppingModel, load_finished_stage, log_oracle_distribution,
                     log_stop_time_distribution, unroll)
from ...core.loop import run_with_early_exit
from ...utils.config import from_dict, merge, one_of, positive, require, to_dict
from ...utils.report import markdown_table, write_json
from ..base import RunContext, TaskSpec, register_task
from .models import FISTA, ISTA, LISTA
from .policy import SparseStopPolicy
from .problem import ProblemConfig, SparseBatch, nmse_by_snr
from .task import SparseRecoveryTask

PAPER_TABLE1 = {  # Table 1 of the paper: NMSE (dB) mixed / 20 / 30 / 40
    "FISTA (T=100)": (-18.96, -16.75, -20.46, -20.97),
    "ISTA (T=100)": (-14.66, -13.99, -14.99, -15.07),
    "ISTA (T=20)": (-9.17, -9.12, -9.24, -9.16),
    "FISTA (T=20)": (-11.12, -10.98, -11.19, -11.19),
    "LISTA (T=20)": (-17.53, -16.53, -18.07, -18.20),
    "LISTA-stop (T<=20)": (-22.41, -20.29, -23.90, -24.21),
}
PAPER_TABLE2 = {  # Table 2: training algorithms for LISTA-stop
    "AEVB": (-21.92, -19.92, -23.27, -23.58),
    "Stage I+II": (-22.41, -20.29, -23.90, -24.21),
    "Stage I+II+III": (-22.78, -20.59, -24.29, -24.73),
}


@dataclass
class LISTAConfig:
    num_steps: int = 20
    L: float = 3.0
    rho: float = 0.1
    shrinkage: str = "soft"

    def __post_init__(self):
        require(isinstance(self.num_steps, int) and self.num_steps >= 1, "num_steps", f"T must be an integer >= 1; got {self.num_steps!r}")
        positive(self.L, "L")
        require(self.rho >= 0, "rho", f"must be >= 0; got {self.rho}")
        one_of(self.shrinkage, ("soft", "smooth"), "shrinkage")


@dataclass
class PolicyConfig:
    """The stopping policy and how it is used at test time.

    min_mass: steps before the first one whose mean validation oracle mass q*(t) exceeds this
        become ``min_step`` (the policy is not evaluated there); 0 disables it.
    """

    features: str = "sketch"
    sketch_dim: int = 32
    hidden: tuple[int, ...] = (64, 64)
    min_mass: float = 0.001
    mode: str = "threshold"
    threshold: float = 0.5

    def __post_init__(self):
        one_of(self.features, ("sketch", "full"), "features")
        require(isinstance(self.sketch_dim, int) and self.sketch_dim >= 1, "sketch_dim", "must be an integer >= 1")
        require(0 <= self.min_mass < 1, "min_mass", f"must be in [0, 1); got {self.min_mass}")
        one_of(self.mode, ("threshold", "sample"), "mode")
        require(0 < self.threshold < 1, "threshold", f"must be in (0, 1); got {self.threshold}")


@dataclass
class ClassicalConfig:
    """Grid search of ISTA/FISTA's step size 1/L and l1 weight rho on training problems."""

    depths: tuple[int, ...] = (20, 100)
    L_grid: tuple[float, ...] = (2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 7.0)
    rho_grid: tuple[float, ...] = (0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.14, 0.2, 0.3)
    tune_samples: int = 1000

    def __post_init__(self):
        require(all(d >= 1 for d in self.depths), "depths", "must be >= 1")
        require(all(v > 0 for v in self.L_grid), "L_grid", "values must be > 0")
        require(all(v >= 0 for v in self.rho_grid), "rho_grid", "values must be >= 0")
        require(self.tune_samples >= 1, "tune_samples", "must be >= 1")


def _stage(**kw) -> Any:
    return field(default_factory=lambda: StageConfig(**kw))


@dataclass
class SparseConfig:
    """Everything a sparse-recovery run needs. Defaults are the paper preset."""

    seed: int = 0
    problem: ProblemConfig = field(default_factory=ProblemConfig)
    lista: LISTAConfig = field(default_factory=LISTAConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    classical: ClassicalConfig = field(default_factory=ClassicalConfig)
    baseline: StageConfig = _stage(objective="deep_supervision", gamma=1.0, iterations=100_000, batch_size=512,
                                   lr=1e-4, weight_decay=1e-4, eval_every=1000, checkpoint_every=1000)
    stage1: StageConfig = _stage(objective="stage1", variant="expected", beta=0.28, iterations=50_000, batch_size=1024,
                                 lr=1e-4, weight_decay=1e-4, eval_every=1000, checkpoint_every=1000)
    stage2: StageConfig = _stage(objective="stage2", variant="forward_kl", beta=0.28, iterations=40_000, batch_size=256,
                                 lr=1e-3, weight_decay=1e-4, eval_every=1000, checkpoint_every=1000)
    stage3: StageConfig = _stage(objective="stage3", beta=0.28, iterations=10_000, batch_size=1024,
                                 lr=1e-5, weight_decay=1e-4, eval_every=1000, checkpoint_every=1000)
    aevb: StageConfig = _stage(objective="aevb", beta=0.28, iterations=50_000, batch_size=1024,
                               lr=1e-4, weight_decay=1e-4, eval_every=1000, checkpoint_every=1000)
    stage1_init: str = "ista"
    run_stage3: bool = True
    run_aevb: bool = True
    eval_batch: int = 1000

    def __post_init__(self):
        require(self.eval_batch >= 1, "eval_batch", "must be >= 1")
        one_of(self.stage1_init, ("ista", "baseline"), "stage1_init")
        for name in ("baseline", "stage1", "stage2", "stage3", "aevb"):
            expected = {"baseline": "deep_supervision"}.get(name, name)
            got = getattr(self, name).objective
            require(got == expected, f"{name}.objective", f"must be {expected!r} for this stage; got {got!r}")


def _efficient_schedule(iterations: int, every: int, lr: float = 1e-3) -> dict:
    """Adam at a 10-20x higher rate with cosine decay, batch 256: far fewer iterations than the paper's
    constant 1e-4. Stage I fine-tunes the baseline's weights at half that rate; Stage III is a short,
    gentle fine-tuning (at 1e-4 it lost 0.2-0.5 dB: its q_phi-weighted loss pulls theta towards
    earlier steps that the deterministic policy rarely uses)."""
    common = {"batch_size": 256, "lr_schedule": "cosine", "lr_min_factor": 0.01, "eval_every": every, "checkpoint_every": every}
    model = {**common, "iterations": iterations, "lr": lr, "weight_decay": 0.0}
    return {
        "baseline": model, "aevb": model,
        "stage1": {**model, "lr": lr / 2},
        "stage2": {**common, "iterations": iterations, "lr": 3e-3},
        "stage3": {**common, "iterations": iterations // 4, "lr": lr / 100, "weight_decay": 0.0, "lr_schedule": "constant"},
    }


#: Presets are partial configs over the defaults above (the paper's settings).
PRESETS: dict[str, dict] = {
    "paper": {},
    # The paper's problem with an efficient schedule: the whole pipeline in about 30 min on 2 CPU cores.
    "fast": {"stage1_init": "baseline", **_efficient_schedule(1500, every=250)},
    # A smaller problem (m=125, n=250, T=16) so that everything, baselines included, runs in ~10 min.
    "quick": {
        "problem": {"m": 125, "n": 250, "test_per_snr": 1000, "val_per_snr": 300},
        "lista": {"num_steps": 16},
        "classical": {"tune_samples": 500},
        "stage1_init": "baseline",
        **_efficient_schedule(1500, every=250, lr=2e-3),
    },
}
# The release's variants of the paper settings (REFERENCE.md), for comparison.
PRESETS["release"] = merge(PRESETS["paper"], {
    "problem": {"matrix": "cond5"}, "lista": {"shrinkage": "smooth"},
    "stage1": {"variant": "marginal"}, "stage2": {"variant": "map"}, "policy": {"features": "full", "hidden": [256, 128, 16]},
})


def preset(name: str = "quick", **overrides: Any) -> SparseConfig:
    """The config of a named preset, with optional nested overrides (dicts)."""
    if name not in PRESETS:
        raise KeyError(f"unknown sparse preset {name!r}; available: {', '.join(PRESETS)}")
    return from_dict(SparseConfig, merge(merge(to_dict(SparseConfig()), PRESETS[name]), overrides))


# ----------------------------------------------------------------------------- building blocks
def build_lista_stop(cfg: SparseConfig, task: SparseRecoveryTask, with_policy: bool = True) -> StoppingModel:
    """LISTA (ISTA-initialised) plus, optionally, its stopping policy, as one StoppingModel."""
    torch.manual_seed(cfg.seed)  # the policy's initial weights
    lista = LISTA(task.A, cfg.lista.num_steps, cfg.lista.L, cfg.lista.rho, cfg.lista.shrinkage)
    policy = None
    if with_policy:
        p = cfg.policy
        policy = SparseStopPolicy(task.A, cfg.lista.num_steps, p.features, p.sketch_dim, p.hidden, seed=cfg.seed)
    return StoppingModel(lista, policy)


@torch.no_grad()
def choose_min_step(sm: StoppingModel, task: SparseRecoveryTask, beta: float, min_mass: float, device) -> int:
    """First step whose mean validation oracle mass exceeds ``min_mass`` (1 if min_mass = 0).

    Earlier steps are never the oracle's choice, so the policy is not evaluated there: an
    explicit, reported minimum depth (the release applies the same cut silently).
    """
    if min_mass <= 0:
        return 1
    sm.eval()
    mass = torch.zeros(sm.num_steps, device=device)
    n = 0
    for y, x in task.validation_batches(device):
        r = sm.unroll(y, x, task.loss_fn, use_policy=False)
        mass += log_oracle_distribution(r.losses, beta).exp().sum(0)
        n += y.shape[0]
    mass /= n
    above = (mass > min_mass).nonzero()
    return int(above[0]) + 1 if above.numel() else sm.num_steps


def _trainer(sm, task, run: RunContext, cfg: SparseConfig) -> StagedTrainer:
    return StagedTrainer(sm, task, run.run_dir, seed=cfg.seed, ctx=run.ctx, progress=run.progress, resume=run.resume)


def _as_run(run: RunContext | str | Path) -> RunContext:
    return run if isinstance(run, RunContext) else RunContext(Path(run))


# ----------------------------------------------------------------------------- commands
def train(cfg: SparseConfig, run: RunContext | str | Path) -> dict:
    """Train LISTA (baseline), LISTA-stop (Stage I, II and optionally III) and AEVB; resumable."""
    run = _as_run(run)
    run.prepare(cfg)
    task = SparseRecoveryTask(cfg.problem)
    dev = run.device
    summaries = {}

    baseline = build_lista_stop(cfg, task, with_policy=False).to(dev)
    run.log("[1/5] LISTA baseline: sum_t gamma^(T-t) ||x_t - x*||^2")
    summaries["baseline"] = _trainer(baseline, task, run, cfg).fit("baseline", cfg.baseline)

    sm = build_lista_stop(cfg, task).to(dev)
    if cfg.stage1_init == "baseline":
        # Uniform deep supervision is Stage I's beta -> infinity limit: starting from it anneals beta.
        sm.model.load_state_dict(baseline.model.state_dict())
    trainer = _trainer(sm, task, run, cfg)
    run.log(f"[2/5] LISTA-stop Stage I ({cfg.stage1.variant}, beta={cfg.stage1.beta}, from {cfg.stage1_init} weights)")
    summaries["stage1"] = trainer.fit("stage1", cfg.stage1)
    sm.policy.min_step = choose_min_step(sm, task, cfg.stage1.beta, cfg.policy.min_mass, dev)
    run.log(f"      policy evaluated from step {sm.policy.min_step} (oracle mass below {cfg.policy.min_mass} before it)")
    run.log(f"[3/5] LISTA-stop Stage II ({cfg.stage2.variant})")
    summaries["stage2"] = trainer.fit("stage2", cfg.stage2)

    if cfg.run_stage3:
        run.log("[4/5] LISTA-stop Stage III (beta-VAE fine-tuning of both)")
        sm3 = copy.deepcopy(sm)
        summaries["stage3"] = _trainer(sm3, task, run, cfg).fit("stage3", cfg.stage3)
    if cfg.run_aevb:
        run.log("[5/5] AEVB baseline: theta and phi jointly from the start")
        aevb = build_lista_stop(cfg, task).to(dev)
        summaries["aevb"] = _trainer(aevb, task, run, cfg).fit("aevb", cfg.aevb)
    if run.ctx.is_main:
        write_json(summaries, run.run_dir / "training_summary.json")
    return summaries


def _load_stage(cfg: SparseConfig, task: SparseRecoveryTask, run_dir: Path, stage: str, device) -> StoppingModel:
    sm = build_lista_stop(cfg, task, with_policy=stage != "baseline").to(device)
    load_finished_stage(sm, Path(run_dir) / "checkpoints", stage, map_location=device)
    return sm.eval()


@torch.no_grad()
def _predict_stop(sm: StoppingModel, data: SparseBatch, cfg: SparseConfig, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Early-exit estimates and stop times for a whole set, in chunks."""
    outs, times = [], []
    gen = torch.Generator().manual_seed(cfg.seed)
    for i in range(0, len(data), cfg.eval_batch):
        y = data.y[i:i + cfg.eval_batch].to(device)
        r = run_with_early_exit(sm.model, y, PolicyRule(sm.policy, cfg.policy.mode, cfg.policy.threshold, gen))
        outs.append(r.outputs.cpu())
        times.append(r.stop_times.cpu())
    return torch.cat(outs), torch.cat(times)


@torch.no_grad()
def _per_step(model, data: SparseBatch, cfg: SparseConfig, device, policy=None):
    """Every step's estimate error ||x_t - x*||^2 (N, T) and, with a policy, q_phi (N, T)."""
    errs, qs = [], []
    for i in range(0, len(data), cfg.eval_batch):
        y, x = data.y[i:i + cfg.eval_batch].to(device), data.x[i:i + cfg.eval_batch].to(device)
        r = unroll(model, y, target=x, loss_fn=SparseRecoveryTask.loss_fn, policy=policy)
        errs.append(r.losses.cpu())
        if policy is not None:
            qs.append(log_stop_time_distribution(r.stop_logits).exp().cpu())
    return torch.cat(errs), (torch.cat(qs) if qs else None)


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
        scores.append(torch.nan_to_num(10 * torch.log10(errs / energy), nan=float("inf")))
    scores = torch.cat(scores)
    best = {}
    for j, d in enumerate(depths):
        k = int(scores[:, j].argmin())
        best[d] = {"L": grid[k][0], "rho": grid[k][1], "train_nmse": float(scores[k, j])}
    return best


def evaluate(cfg: SparseConfig, run: RunContext | str | Path) -> dict:
    """Evaluate every trained model and the tuned ISTA/FISTA on the fixed test set; write tables and plots."""
    run = _as_run(run)
    dev = run.device
    task = SparseRecoveryTask(cfg.problem)
    test = task.test
    T = cfg.lista.num_steps
    results: dict[str, Any] = {"rows": {}, "depth": {}, "classical": {}}
    per_step_curves: dict[str, list[float]] = {}

    t0 = time.perf_counter()
    for algo in ("ISTA", "FISTA"):
        tuned = tune_classical(cfg, task, algo, dev)
        for depth in cfg.classical.depths:
            params = tuned[depth]
            model = {"ISTA": ISTA, "FISTA": FISTA}[algo](task.A, depth, params["L"], params["rho"]).to(dev)
            errs, _ = _per_step(model, test, cfg, dev)
            name = f"{algo} (T={depth})"
            results["classical"][name] = params
            results["rows"][name] = _nmse_from_errors(errs[:, -1], test)
            if depth == max(cfg.classical.depths):
                per_step_curves[algo] = _curve(errs, test)
    run.log(f"classical baselines tuned and evaluated in {time.perf_counter() - t0:.1f}s")

    base = _load_stage(cfg, task, run.run_dir, "baseline", dev)
    errs, _ = _per_step(base.model, test, cfg, dev)
    results["rows"][f"LISTA (T={T})"] = _nmse_from_errors(errs[:, -1], test)
    per_step_curves["LISTA"] = _curve(errs, test)

    stop_models = {"Stage I+II": "stage2"}
    if cfg.run_stage3:
        stop_models["Stage I+II+III"] = "stage3"
    if cfg.run_aevb:
        stop_models["AEVB"] = "aevb"
    q_main = errs_main = None
    for label, stage in stop_models.items():
        sm = _load_stage(cfg, task, run.run_dir, stage, dev)
        est, times = _predict_stop(sm, test, cfg, dev)
        results["rows"][label] = nmse_by_snr(est, test)
        results["depth"][label] = {"mean": float(times.float().mean()),
                                   **{f"{s:g}": float(times[test.snr == s].float().mean()) for s in cfg.problem.snrs}}
        if stage == "stage2":
            results["rows"][f"LISTA-stop (T<={T})"] = results["rows"][label]
            results["depth"][f"LISTA-stop (T<={T})"] = results["depth"][label]
            errs_main, q_main = _per_step(sm.model, test, cfg, dev, policy=sm.policy)
            results["oracle_nmse"] = _nmse_from_errors(errs_main.min(dim=1).values, test)  # needs x*: a bound
            results["min_step"] = int(sm.policy.min_step)

    table1, table2 = _tables(results, cfg)
    results["table1"], results["table2"] = table1, table2
    if run.ctx.is_main:
        (run.run_dir / "table1.md").write_text(table1 + "\n")
        (run.run_dir / "table2.md").write_text(table2 + "\n")
        write_json({k: v for k, v in results.items() if not k.startswith("table")}, run.run_dir / "results.json")
        _figure4(q_main, errs_main, test, per_step_curves, run.run_dir)
        run.log("\nTable 1: NMSE (dB) on the test set; paper's value in parentheses\n" + table1)
        run.log("\nTable 2: training algorithms for LISTA-stop\n" + table2)
        run.log(f"\nwritten: {run.run_dir}/table1.md, table2.md, results.json, fig4_stop_distribution.png, fig4_convergence.png")
    return results


def reproduce(cfg: SparseConfig, run: RunContext | str | Path) -> dict:
    """Train everything (resuming what exists), then evaluate: Tables 1-2 and Figure 4."""
    run = _as_run(run)
    t0 = time.perf_counter()
    train(cfg, run)
    results = evaluate(cfg, run)
    run.log(f"total wall-clock: {time.perf_counter() - t0:.0f}s")
    return results


# ----------------------------------------------------------------------------- helpers
def _nmse_from_errors(errs: torch.Tensor, data: SparseBatch) -> dict[str, float]:
    """NMSE (dB), mixed and per SNR, from per-sample squared errors (N,): the ratio of sums of App. B.1."""
    out = {"mixed": float(10 * torch.log10(errs.sum() / data.x.pow(2).sum()))}
    for s in data.snr.unique().tolist():
        m = data.snr == s
        out[f"{s:g}"] = float(10 * torch.log10(errs[m].sum() / data.x[m].pow(2).sum()))
    return out


def _curve(errs: torch.Tensor, data: SparseBatch) -> list[float]:
    """NMSE (dB) of every step over the whole set."""
    return (10 * torch.log10(errs.sum(0) / data.x.pow(2).sum())).tolist()


def _tables(results: dict, cfg: SparseConfig) -> tuple[str, str]:
    snrs = [f"{s:g}" for s in cfg.problem.snrs]
    headers = ["model", "mixed", *[f"SNR {s}" for s in snrs], "mean depth", "paper (mixed)"]

    def row(label, paper_key):
        r = results["rows"][label]
        paper = PAPER_TABLE1.get(paper_key) or PAPER_TABLE2.get(paper_key)
        depth = results["depth"].get(label, {}).get("mean")
        return [label, r["mixed"], *[r.get(s) for s in snrs], depth, paper[0] if paper else None]

    T = cfg.lista.num_steps
    deep_first = sorted(cfg.classical.depths, reverse=True)  # the paper's order: FISTA-100, ISTA-100, ISTA-20, FISTA-20
    order = [f"{a} (T={d})" for i, d in enumerate(deep_first) for a in (("FISTA", "ISTA") if i % 2 == 0 else ("ISTA", "FISTA"))]
    rows1 = [row(k, k) for k in order]
    rows1.append(row(f"LISTA (T={T})", "LISTA (T=20)"))
    rows1.append(row(f"LISTA-stop (T<={T})", "LISTA-stop (T<=20)"))
    rows2 = [row(k, k) for k in ("AEVB", "Stage I+II", "Stage I+II+III") if k in results["rows"]]
    return markdown_table(headers, rows1), markdown_table(headers, rows2)


def _figure4(q: torch.Tensor | None, errs: torch.Tensor | None, data: SparseBatch, curves: dict, out_dir: Path) -> None:
    """Figure 4: (a) mean stop-time distribution over the test set; (b) NMSE vs iteration."""
    from ...utils.report import new_figure, save_figure

    if q is None:
        return
    T = q.shape[1]
    fig, ax = new_figure(figsize=(5, 3.5))
    ax.bar(range(1, T + 1), q.mean(0).numpy(), color="tab:red")
    ax.set_xlabel("stop step t")
    ax.set_ylabel("mean q_phi(t) over test set")
    ax.set_title("LISTA-stop stop-time distribution")
    save_figure(fig, out_dir / "fig4_stop_distribution.png")

    fig, ax = new_figure(figsize=(5, 3.5))
    for name, style in (("ISTA", "tab:blue"), ("FISTA", "tab:green"), ("LISTA", "tab:orange")):
        if name in curves:
            c = curves[name]
            ax.plot(range(1, len(c) + 1), c, label=name, color=style)
    # LISTA-stop: q-weighted NMSE at each step where it puts mass (paper Fig. 4b)
    w = q.sum(0)
    mean_sq = data.x.pow(2).sum(1).mean()
    weighted = (q * errs).sum(0) / w.clamp_min(1e-12) / mean_sq
    mask = w / q.shape[0] > 1e-3
    steps = torch.arange(1, T + 1)[mask]
    ax.scatter(steps.numpy(), (10 * torch.log10(weighted[mask])).numpy(), color="tab:red", label="LISTA-stop (q-weighted)", zorder=3)
    ax.set_xscale("log")
    ax.set_xlabel("iteration")
    ax.set_ylabel("NMSE (dB)")
    ax.legend(loc="upper right", fontsize=8)
    save_figure(fig, out_dir / "fig4_convergence.png")


SPEC = register_task(TaskSpec(
    name="sparse",
    description="Sparse recovery: LISTA-stop vs LISTA, ISTA, FISTA (paper Sec. 5.1, Tables 1-2, Fig. 4)",
    config_class=SparseConfig,
    presets=PRESETS,
    commands={"train": train, "evaluate": evaluate, "reproduce": reproduce},
))
