"""Would a second plan close the gap to the tolerance rule? An offline probe on a trained sparse run.

    python benchmarks/sparse_replan_probe.py --run-dir runs/sparse-quick --replan-step 10 --features cheap
    python benchmarks/sparse_replan_probe.py --tiny        # a smoke run (the tests use it)

The deployed planner decides each sample's depth once, at its plan step s1 (step 5 of 16 on the quick problem),
from the state there. The tolerance rule looks at every step and sees convergence late; on the quick frontier
it stays 0.02-0.05 dB ahead of the planner at 70-90 % of the steps. This probe asks whether information from a
later step closes that: a second head, fitted here offline, re-plans at step s2 the samples whose first plan runs
past s2, from the state at s2 and the first plan's log q_phi. The combined rule at price p:

    t1 = argmax_{t >= s1} log q1(t) - p c_t;   stop at t1 if t1 <= s2, else at argmax_{t >= s2} log q2(t) - p c_t

Its stop time falls as the price rises (a sample leaves the second plan only for t1 <= s2 <= t2), so one price
sweep gives its curve, as it does for the deployed rule. The second head is fitted by forward KL to the Stage II
oracle q* (the run's beta and price) renormalised on the steps from s2, on fresh training problems, with the
first plan's log q as an input. Features at s2 (``--features``):

- ``full``: the planner's own eight statistics of x_s2 (two products with A, about 2/3 of a LISTA step);
- ``cheap``: no product with A: log ||x||_1, log ||x||_2 and the support fraction of x_s2, the log size and
  log relative size of its last move ||x_s2 - x_(s2-1)|| (the tolerance test's signal), log ||y||;
- ``cheap-nomove``: ``cheap`` without the last move.

(``cheap`` is the deployed second plan's input, ``learn2stop.tasks.sparse.policy._state_norms``. Until 2026-11-27 the
probe kept its own copy of it, with other small constants inside the logs: the docs' probe numbers of that date
and earlier came from the copy.)

``--no-first-plan`` leaves the first plan's log q out of the second head's input (a stateless second head);
``--replan-step`` equal to the plan step refits the first plan on the same information (what a better fit alone
gives).

Every curve is swept on the test set (like the frontier's ``policy_swept``); NMSE in dB, interpolated at a share
of the steps. Nothing here is timed: the probe says what a second plan buys on the step axis, not its price.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn as nn
from torch import Tensor

from learn2stop.core.distributions import log_cost_prior, log_oracle_distribution
from learn2stop.core.pipeline import load_stage
from learn2stop.tasks.sparse.app import APP
from learn2stop.tasks.sparse.config import SparseConfig
from learn2stop.tasks.sparse.policy import _state_norms
from learn2stop.tasks.sparse.problem import ProblemConfig, fixed_set, make_matrix, sample_problems
from learn2stop.utils.config import load_run_config


@torch.no_grad()
def rollout(model, planner, y: Tensor, x_true: Tensor, s2: int, features: str) -> dict[str, Tensor]:
    """Every state of the stop model on a batch; per-step squared errors, the first plan, the features at s2 and
    the tolerance signal ||x_t - x_(t-1)|| / ||x_t|| at t = 2..T."""
    T, s1 = model.num_steps, planner.plan_step
    x, xs = model.initial_state(y), []
    for t in range(1, T + 1):
        x = model.step(t, x, y)
        xs.append(x)
    xs = torch.stack(xs, dim=1)  # (B, T, n)
    f2 = (planner.extract(y, xs[:, s2 - 1]) if features == "full"
          else _state_norms(y, xs[:, s2 - 1], xs[:, s2 - 2] if features == "cheap" else None))
    return {"errors": (xs - x_true[:, None]).pow(2).sum(2), "log_q1": planner.plan_log_q(y, xs[:, s1 - 1], s1),
            "f2": f2, "tolerance": (xs[:, 1:] - xs[:, :-1]).norm(dim=2) / (xs[:, 1:].norm(dim=2) + 1e-12)}


def fit_second_plan(train: dict[str, Tensor], s2: int, beta: float, log_prior: Tensor, iterations: int, hidden: int,
                    generator: torch.Generator, first_plan: bool = True) -> nn.Module:
    """The second head: (features at s2, first plan's log q) -> log q2 over steps s2..T, by forward KL to q*."""
    T = train["errors"].shape[1]
    target = torch.log_softmax(log_oracle_distribution(train["errors"], beta, log_prior)[:, s2 - 1:], dim=1).exp()
    f = train["f2"]
    mean, std = f.mean(0), f.std(0) + 1e-6

    def features(data: dict[str, Tensor]) -> Tensor:
        x = (data["f2"] - mean) / std
        return torch.cat([x, data["log_q1"]], dim=1) if first_plan else x

    inputs = features(train)
    net = nn.Sequential(nn.Linear(inputs.shape[1], hidden), nn.ELU(), nn.Linear(hidden, hidden), nn.ELU(),
                        nn.Linear(hidden, T - s2 + 1))
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    for _ in range(iterations):
        i = torch.randint(0, inputs.shape[0], (min(512, inputs.shape[0]),), generator=generator)
        loss = -(target[i] * torch.log_softmax(net(inputs[i]), dim=1)).sum(1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    net.eval()

    def head(data: dict[str, Tensor]) -> Tensor:
        with torch.no_grad():
            return torch.log_softmax(net(features(data)), dim=1)
    return head


def interpolate(points: list[tuple[float, float]], steps: float) -> float | None:
    """The metric of a curve of (mean steps, metric) points at ``steps`` (None outside it)."""
    for (a, ma), (b, mb) in zip(points, points[1:]):
        if a <= steps <= b:
            return ma if b == a else ma + (steps - a) / (b - a) * (mb - ma)
    return None


def main(argv=None) -> dict[str, dict[float, float | None]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", help="a trained sparse run with a planning policy (stage2)")
    ap.add_argument("--tiny", action="store_true", help="a 6-step random model on a 20x40 problem (smoke run)")
    ap.add_argument("--replan-step", type=int, default=10)
    ap.add_argument("--features", choices=("full", "cheap", "cheap-nomove"), default="cheap")
    ap.add_argument("--no-first-plan", action="store_true", help="the second head without the first plan's log q")
    ap.add_argument("--train-problems", type=int, default=40_000)
    ap.add_argument("--iterations", type=int, default=3000)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if not args.tiny and not args.run_dir:
        ap.error("give --run-dir (a trained sparse run) or --tiny")
    torch.set_num_threads(args.threads)
    if args.tiny:
        from learn2stop.tasks.sparse.models import LISTA
        from learn2stop.tasks.sparse.policy import SparseDepthPlanner

        problem = ProblemConfig(m=20, n=40, test_per_snr=50, val_per_snr=10)
        A = make_matrix(problem)
        model, planner = LISTA(A, 6).eval(), SparseDepthPlanner(A, 6, hidden=(8,)).eval()
        planner.min_step = 2
        beta, price = 0.3, 0.5
        args.replan_step, args.train_problems, args.iterations, args.hidden = 4, 400, 20, 8
    else:
        run = Path(args.run_dir)
        cfg = load_run_config(SparseConfig, run)
        sm = load_stage(APP, cfg, run, "stage2")
        model, planner, problem = sm.model, sm.policy, cfg.problem
        if getattr(planner, "plan_step", None) is None:
            raise SystemExit(f"{run}: its policy is not a planning policy (policy.features {cfg.policy.features!r})")
        A = make_matrix(problem)
        beta, price = cfg.method.beta, cfg.method.price
    T, s1, s2 = model.num_steps, planner.plan_step, args.replan_step
    if not (s1 <= s2 < T and s2 >= 2):
        raise SystemExit(f"--replan-step must be at or after the plan step {s1}, from 2, and before the last step {T}; "
                         f"got {s2}")
    costs = torch.arange(1, T + 1) / T
    log_prior = log_cost_prior(costs, price, beta)
    g = torch.Generator().manual_seed(123)
    chunks = [sample_problems(A, problem, min(2000, args.train_problems), g)
              for _ in range(max(1, args.train_problems // 2000))]
    parts = [rollout(model, planner, b.y, b.x, s2, args.features) for b in chunks]
    train = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    head = fit_second_plan(train, s2, beta, log_prior, args.iterations, args.hidden, g, not args.no_first_plan)
    test_set = fixed_set(A, problem, problem.test_per_snr, problem.test_seed)
    test = rollout(model, planner, test_set.y, test_set.x, s2, args.features)
    log_q2 = head(test)
    energy = test_set.x.pow(2).sum()

    def nmse(stops: Tensor) -> float:
        return float(10 * torch.log10(test["errors"].gather(1, (stops - 1)[:, None]).sum() / energy))

    def first_plan(p: float) -> Tensor:
        return (test["log_q1"][:, s1 - 1:] - p * costs[s1 - 1:]).argmax(1) + s1

    def replanned(p: float) -> Tensor:
        t1 = first_plan(p)
        return torch.where(t1 <= s2, t1, (log_q2 - p * costs[s2 - 1:]).argmax(1) + s2)

    def tolerance(tol: float) -> Tensor:
        hit = torch.cat([test["tolerance"] <= tol, torch.ones(len(test_set), 1, dtype=torch.bool)], dim=1)
        return (hit.float().argmax(1) + 2).clamp(max=T)

    def curve(rule, params) -> list[tuple[float, float]]:
        return sorted({(float(s.float().mean()), nmse(s)) for s in map(rule, params)})

    prices, tols = torch.linspace(-2, 40, 800).tolist(), torch.logspace(-4, 0, 600).tolist()
    curves = {"policy (one plan)": curve(first_plan, prices),
              f"second plan at step {s2} ({args.features}{', no first plan' if args.no_first_plan else ''})":
                  curve(replanned, prices),
              "tolerance": curve(tolerance, tols),
              "fixed depth": [(t, nmse(torch.full((len(test_set),), t))) for t in range(1, T + 1)]}
    shares = (0.5, 0.6, 0.7, 0.8, 0.9)
    table = {name: {f: interpolate(pts, f * T) for f in shares} for name, pts in curves.items()}
    print(f"NMSE dB on {len(test_set)} test problems at a share of the {T} steps (first plan at step {s1}; second "
          f"head fitted on {len(train['errors'])} problems, {args.iterations} iterations)")
    print("| curve | " + " | ".join(f"{f:.0%}" for f in shares) + " |\n|---|" + "---|" * len(shares))
    for name, row in table.items():
        print(f"| {name} | " + " | ".join("-" if v is None else f"{v:.3f}" for v in row.values()) + " |")
    return table


if __name__ == "__main__":
    main()
