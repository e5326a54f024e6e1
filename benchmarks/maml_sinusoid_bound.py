"""What a stop rule could reach on the sinusoid MAML tasks: the learned policy against the Bayes stop and the oracles.

    python benchmarks/maml_sinusoid_bound.py --run-dir runs/maml-quick      # a trained sinusoid run (reproduce)
    python benchmarks/maml_sinusoid_bound.py --tiny                         # random weights, 20 tasks (the test)

A run with a learned posterior-mean estimate (``model.policy_posterior``, the quick preset's) adds the
rules that read it: the step nearest to it after all T steps, and early stopping that restores the best step so far.
Where the run answers with the kept step (``model.policy_posterior``) the policy's rows and curves read what it answers
(their step is the step run); the other rows read the meta-learner's own steps.

The MAML-stop table compares the policy with the *oracle step*, which picks each task's step on that task's own 20
query labels. This script says how much of that a rule that sees no query label could have, on the run's test tasks:

- each task's sinusoid is recovered exactly from its clean query points (y = a sin x + b cos x), and every inner step's
  **expected** query MSE is estimated on ``--query-points`` fresh points of it (``x ~ U[-5, 5]``), so rules are
  compared without the noise of 20 query points;
- the **Bayes stop**: the step of least posterior expected query MSE given the support alone, under the generator's
  own prior (amplitude ~ U[0.1, 5], phase ~ U[0, pi], support noise N(0, ``data.noise``^2)), on a
  ``--grid`` x ``--grid`` grid of sinusoids. No rule that sees only the support and the adapted learner does better
  in expectation at its mean depth; with a price per step it draws a curve of depth against quality;
- the oracle of the expected MSE (the least of each task's curve: a bound for any rule), and the table's oracle.

It prints the rows at each rule's own depth, then every curve at equal mean depth (the policy's quantile and
threshold rules swept, the Bayes stop priced, fixed depth), and the share of the gap from the best fixed depth to
each bound the policy closes.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from learn2stop.core.inference import policy_scores
from learn2stop.core.trace import collect_trace
from learn2stop.core.loop import unroll
from learn2stop.core.train import load_stage
from learn2stop.core.signal_registry import SIGNALS
from learn2stop.core.rules import first_crossing
from learn2stop.tasks.maml import APP, MAMLConfig, preset
from learn2stop.tasks.maml.models import meta_learner
from learn2stop.utils.config_files import load_run_config


def recovered_tasks(batches, points: int, generator: torch.Generator) -> tuple[list, float]:
    """Each batch with its query set replaced by ``points`` fresh points of the task's own sinusoid, recovered from its
    clean query targets by least squares; and the largest residual of that fit (a sinusoid fits its points exactly)."""
    out, worst = [], 0.0
    for inputs, target in batches:
        qx = inputs["query_x"]
        basis = torch.cat([torch.sin(qx), torch.cos(qx)], 2).double()  # (B, q, 2)
        coef = torch.linalg.lstsq(basis, target.double()).solution  # (B, 2, 1)
        worst = max(worst, float((basis @ coef - target.double()).abs().max()))
        nx = -5 + 10 * torch.rand(qx.shape[0], points, 1, generator=generator)
        ny = (torch.cat([torch.sin(nx), torch.cos(nx)], 2).double() @ coef).float()
        out.append(({**inputs, "query_x": nx}, ny))
    return out, worst


@torch.no_grad()
def posterior_mse(model, batches, noise: float, grid: int, x_points: int = 200) -> torch.Tensor:
    """(N, T) each task's posterior expected query MSE at every inner step given its support (uniform prior over the
    generator's amplitudes and phases on a grid; the query MSE as a mean over ``x_points`` evenly spaced x)."""
    amps = 0.1 + 4.9 * (torch.arange(grid).double() + 0.5) / grid
    phases = torch.pi * (torch.arange(grid).double() + 0.5) / grid
    amp, phase = (v.reshape(-1) for v in torch.meshgrid(amps, phases, indexing="ij"))
    xg = -5 + 10 * (torch.arange(x_points).double() + 0.5) / x_points
    truth = amp[:, None] * torch.sin(xg[None, :] - phase[:, None])  # (G, X)
    rows = []
    for inputs, _ in batches:
        B = inputs["query_x"].shape[0]
        on_grid = {**inputs, "query_x": xg.float()[None, :, None].expand(B, x_points, 1).contiguous()}
        steps = unroll(model, on_grid, keep_outputs=True, model_grad=False).step_outputs
        f = torch.stack([o["pred"][..., 0] for o in steps], 1).double()  # (B, T, X)
        sx, sy = inputs["support_x"][..., 0].double(), inputs["support_y"][..., 0].double()
        mask = inputs["support_mask"].double()
        fit = amp[None, :, None] * torch.sin(sx[:, None, :] - phase[None, :, None])  # (B, G, K)
        weight = torch.softmax(-(((sy[:, None, :] - fit) ** 2) * mask[:, None, :]).sum(2) / (2 * noise ** 2), 1)
        mse = (f ** 2).mean(2)[:, :, None] - 2 * torch.einsum("btx,gx->btg", f, truth) / x_points \
            + (truth ** 2).mean(1)[None, None, :]  # (B, T, G)
        rows.append((mse * weight[:, None, :]).sum(2))
    return torch.cat(rows)


@torch.no_grad()
def posterior_distance(model, policy, batches) -> torch.Tensor:
    """(N, T) each step's mean squared distance, on the task's query inputs, to the policy's learned posterior-mean
    estimate (``model.policy_posterior``): what a rule without the query labels can read."""
    rows = []
    for inputs, _ in batches:
        steps = unroll(model, inputs, keep_outputs=True, model_grad=False).step_outputs
        rows.append(torch.stack([policy.posterior_distance(inputs, o) for o in steps], 1))
    return torch.cat(rows)


def keep_best(distance: torch.Tensor, patience: int, margin: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Early stopping that restores the best step: run until the distance has not fallen by ``margin`` (relative)
    below its best for ``patience`` steps, then answer with the best step so far. ((N,) answered step, (N,) steps run.)"""
    N, T = distance.shape
    answered, ran = torch.empty(N, dtype=torch.long), torch.empty(N, dtype=torch.long)
    for i, row in enumerate(distance.tolist()):
        best, at, since = math.inf, 1, 0
        for t, v in enumerate(row, start=1):
            if v < best * (1 - margin):
                best, at, since = v, t, 0
            else:
                since += 1
            if since >= patience or t == T:
                answered[i], ran[i] = at, t
                break
    return answered, ran


def _at(values: torch.Tensor, times: torch.Tensor) -> float:
    return float(values.gather(1, (times - 1)[:, None]).mean())


def _interp(curve: list[tuple[float, float]], x: float) -> float | None:
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x0 <= x <= x1 and x1 > x0:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return None


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", help="a trained MAML run on the sinusoid tasks")
    ap.add_argument("--tiny", action="store_true", help="the quick preset's models with random weights, 20 tasks")
    ap.add_argument("--query-points", type=int, default=2000, help="fresh query points per task (expected MSE)")
    ap.add_argument("--grid", type=int, default=120, help="amplitudes x phases of the Bayes stop's grid")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if not args.tiny and not args.run_dir:
        ap.error("give --run-dir (a trained sinusoid MAML run) or --tiny")
    torch.set_num_threads(args.threads)
    if args.tiny:
        cfg = preset("quick", eval={"tasks": 20, "val_tasks": 20, "chunk": 10}, model={"policy_posterior": True})
        sm = APP.build_models(cfg, None)["stop"].eval()
        args.query_points, args.grid = 200, 20
    else:
        cfg = load_run_config(MAMLConfig, Path(args.run_dir))
        sm = load_stage(APP, cfg, args.run_dir, APP.stop_stage)
    if cfg.data.source != "sinusoid" or cfg.data.noise <= 0:
        raise SystemExit(f"this bound needs sinusoid tasks with support noise; the run has {cfg.data.source!r}, "
                         f"noise {cfg.data.noise}")
    metric, batches, val = APP.metric(cfg), APP.eval_batches(cfg, "test", None), APP.eval_batches(cfg, "val", None)
    big, worst = recovered_tasks(batches, args.query_points, torch.Generator().manual_seed(123))
    own = meta_learner(sm)  # the meta-learner's own steps; sm.model answers with a kept step (model.policy_posterior)
    observed = collect_trace(own, batches, metric).metric  # (N, T): each task's own 20 query points
    expected = collect_trace(own, big, metric).metric  # (N, T): the task's expected query MSE
    answers = own is not sm.model and sm.model.answering
    # what the stop model answers at each step: the meta-learner's step, or the kept one
    said = (collect_trace(sm.model, batches, metric).metric, collect_trace(sm.model, big, metric).metric) if answers \
        else (observed, expected)
    posterior = posterior_mse(own, batches, cfg.data.noise, args.grid)
    T = expected.shape[1]
    depth = int(collect_trace(own, val, metric).metric.mean(0).argmin()) + 1  # the best fixed depth on validation
    with torch.no_grad():
        logits = torch.cat([unroll(sm.model, i, policy=sm.policy, model_grad=False).stop_logits for i, _ in batches])
    steps = torch.arange(1, T + 1).double()

    def row(times: torch.Tensor, answered: bool = False) -> tuple[float, float, float]:
        o, e = said if answered else (observed, expected)
        return _at(o, times), _at(e, times), float(times.float().mean())

    fixed = torch.full((expected.shape[0],), depth)
    alpha = SIGNALS["quantile"].from_param(0.5)  # the score threshold of the 0.5-quantile (the score is -log survival)
    policy_name = "policy, quantile 0.5" + (" (answers with the kept step; mean step = steps run)" if answers else "")
    rows = {policy_name: row(first_crossing(policy_scores(logits, "quantile"), alpha), answered=True),
            f"fixed {depth} (best on validation)": row(fixed),
            "Bayes stop (support only)": row(posterior.argmin(1) + 1),
            "oracle on the 20 query labels (the table's)": row(observed.argmin(1) + 1),
            "oracle on the expected MSE (any rule)": row(expected.argmin(1) + 1)}
    distance = posterior_distance(own, sm.policy, batches) if getattr(sm.policy, "posterior", None) else None
    if distance is not None:  # rules on the learned posterior-mean estimate (model.policy_posterior: true)
        rows["nearest step to the posterior estimate, after all T steps"] = row(distance.argmin(1) + 1)
        for patience, margin in ((2, 0.05), (3, 0.0)):
            answered, ran = keep_best(distance, patience, margin)
            rows[f"best step so far by the posterior estimate, patience {patience}, margin {margin:g} "
                 f"({float(ran.float().mean()):.2f} steps run)"] = row(answered)
    print(f"{len(expected)} test tasks; sinusoids recovered from their query points (largest residual {worst:.1e}); "
          f"expected MSE on {args.query_points} fresh points each; Bayes grid {args.grid} x {args.grid}\n")
    print(f"| rule | query MSE, the task's 20 points | expected query MSE | mean step |\n|---|---|---|---|")
    for name, (a, b, s) in rows.items():
        print(f"| {name} | {a:.3f} | {b:.3f} | {s:.2f} |")

    def swept(scores: torch.Tensor) -> list[tuple[float, float]]:
        """Thresholds at 400 quantiles of the scores' own values (each rule's whole range of depths); the metric of
        what the stop model answers at the stop step."""
        levels = torch.quantile(scores.flatten().double(), torch.linspace(0, 1, 400, dtype=torch.double))
        pts = [first_crossing(scores, float(c)) for c in levels]
        return sorted((float(t.float().mean()), _at(said[1], t)) for t in pts)

    curves = {"policy, quantile": swept(policy_scores(logits, "quantile")),
              "policy, threshold": swept(policy_scores(logits, "threshold")),
              "Bayes stop, priced": sorted(
                  (float(t.float().mean()), _at(expected, t)) for t in
                  ((posterior + p * steps).argmin(1) + 1 for p in torch.logspace(-4, 1, 300))),
              "fixed depth": [(d, float(expected[:, d - 1].mean())) for d in range(1, T + 1)]}
    if distance is not None:
        curves["posterior estimate, priced (after all T steps)"] = sorted(
            (float(t.float().mean()), _at(expected, t)) for t in
            ((distance + p * steps.float()).argmin(1) + 1 for p in torch.logspace(-4, 1, 300)))
    at = [1.5, 2.0, 2.5, 3.0, 4.0, 5.0]
    print("\nExpected query MSE at equal mean depth (steps):\n\n| curve | " + " | ".join(f"{x:g}" for x in at) + " |\n|---|"
          + "---|" * len(at))
    table = {}
    for name, c in curves.items():
        table[name] = [_interp(c, x) for x in at]
        print(f"| {name} | " + " | ".join("-" if v is None else f"{v:.3f}" for v in table[name]) + " |")
    f, p = rows[f"fixed {depth} (best on validation)"], rows[policy_name]
    closed = {}
    for name, i in (("oracle on the 20 query labels (the table's)", 0), ("oracle on the expected MSE (any rule)", 1),
                    ("Bayes stop (support only)", 1)):
        gap = f[i] - rows[name][i]
        closed[name] = (f[i] - p[i]) / gap if gap > 0 else None
        print(f"gap from fixed {depth} to {name}, closed by the policy's quantile 0.5: "
              + ("-" if closed[name] is None else f"{closed[name]:.1%}"))
    return {"rows": rows, "at": at, "curves": table, "closed": closed, "largest_residual": worst}


if __name__ == "__main__":
    main()
