"""What the sparse depth planner costs, in LISTA steps, and what the deployed rule gains in time, side by side.

    python benchmarks/sparse_planner_cost.py --run-dir runs/sparse-quick --threads 1
    python benchmarks/sparse_planner_cost.py --run-dir runs/sparse-quick --run-dir runs/other --threads 1
    python benchmarks/sparse_planner_cost.py --tiny        # a smoke run (the tests use it)

On trained runs (each with its ``stage2`` planner and ``calibration.json``; the first run's ``baseline`` LISTA and
test problems, in a fixed random order) at batch 1 and at a large batch:

- each planner's parts against one LISTA step (step s+1 on the state of step s): its features, the first plan
  the price rule makes (features, MLP, argmax), and its second plan where it has one;
- whole rollouts: LISTA at full depth, the first run's stop model at a fixed depth (``--fixed``), and for each run
  the deployed price rule and the same rollout with its stop times given in advance (``StopAtTimes``: a free plan,
  what the loop's shrinking batch alone gives; the gap to the deployed rule is what planning costs in place), the
  same rollout with its plans replayed at the plan steps (the same sorts and gathers; the gap to the deployed rule is
  what computing the plans costs in place).

Runs compared must share the problem (the first run's test inputs feed every model). Each time is the best of
``--rounds`` round-robin passes (a drift in the machine's load hits every row alike).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from learn2stop.core.loop import run_with_early_exit
from learn2stop.core.stop_rule import StepView
from learn2stop.core.train import load_stage
from learn2stop.core.calibrate import shuffled
from learn2stop.core.rules import FixedDepth, SignalRule, StopAtTimes
from learn2stop.core.signal_registry import make_signal
from learn2stop.tasks.sparse.app import APP
from learn2stop.tasks.sparse.config import SparseConfig
from learn2stop.utils.config_files import load_run_config


def _timed(fn, inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def _tiny() -> tuple[list[tuple[str, object, float]], torch.nn.Module, torch.Tensor]:
    """Two 4-step random stop models (one plan, two plans) on a 20x40 problem."""
    from learn2stop.core.model import StoppingModel
    from learn2stop.tasks.sparse.models import LISTA
    from learn2stop.tasks.sparse.policy import SparseDepthPlanner

    g = torch.Generator().manual_seed(0)
    A = torch.randn(20, 40, generator=g) / 20 ** 0.5
    lista = LISTA(A, 4).eval()
    one = SparseDepthPlanner(A, 4, hidden=(8,)).eval()
    two = SparseDepthPlanner(A, 4, hidden=(8,), replan=True).eval()
    one.min_step, two.min_step, two.replan_step = 2, 1, 3
    runs = [("one plan", StoppingModel(lista, one).eval(), 0.5),
            ("two plans", StoppingModel(lista, two).eval(), 0.5)]
    return runs, LISTA(A, 4).eval(), torch.randn(64, 20, generator=g)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", action="append", help="a trained sparse run (reproduce or train); repeat to compare")
    ap.add_argument("--tiny", action="store_true", help="two 4-step random models on a 20x40 problem (smoke run)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=1000, help="the large batch")
    ap.add_argument("--samples", type=int, default=300, help="inputs timed one by one at batch 1")
    ap.add_argument("--fixed", type=int, default=14, help="the fixed depth timed beside the rule")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    if not args.tiny and not args.run_dir:
        ap.error("give --run-dir (a trained sparse run) or --tiny")
    torch.set_num_threads(args.threads)
    if args.tiny:
        runs, base, inputs = _tiny()
        args.batch, args.samples, args.fixed, args.rounds = 32, 8, 3, 1
    else:
        runs = []
        for i, path in enumerate(map(Path, args.run_dir)):
            cfg = load_run_config(SparseConfig, path)
            cal = json.loads((path / "calibration.json").read_text())
            if cal.get("rule") != "price":
                raise SystemExit(f"{path / 'calibration.json'}: the deployed rule is {cal.get('rule')!r}; this "
                                 "benchmark times the price rule of a planning policy")
            runs.append((f"{path.name} ({'two plans' if cfg.policy.replan_mass else 'one plan'})",
                         load_stage(APP, cfg, path, "stage2"), cal["threshold"]))
            if i == 0:
                base, inputs = load_stage(APP, cfg, path, "baseline").model, shuffled(APP.speed_inputs(cfg, None))
    first = runs[0][1].model
    T = first.num_steps
    rows: dict[int, dict[str, float]] = {}
    for bs, n in ((1, args.samples), (args.batch, (inputs.shape[0] // args.batch) * args.batch or inputs.shape[0])):
        data, y, inner = inputs[:n], inputs[:bs], 200 if bs == 1 else 20
        parts, rollouts, depths = {}, {f"LISTA-{T}, full depth": (base, lambda k: FixedDepth())}, {}
        rollouts[f"stop model, fixed {args.fixed} steps"] = (first, lambda k: FixedDepth(args.fixed))
        with torch.inference_mode():
            for name, stop, threshold in runs:
                planner, model = stop.policy, stop.model
                rule = (lambda p=planner, th=threshold: SignalRule(make_signal("price", p), th))  # noqa: E731
                views, x, previous = {}, model.initial_state(y), None
                for t in range(1, max(planner.plan_step, planner.replan_step or 0) + 1):
                    previous, x = x, model.step(t, x, y)
                    views[t] = StepView(t, T, y, x, previous, x, torch.arange(bs))
                s = planner.plan_step
                if not parts:
                    parts["one LISTA step"] = (lambda v=views[s], m=model, u=min(s + 1, T): m.step(u, v.state, y))
                parts[f"{name}: features"] = (lambda v=views[s], p=planner: p.extract(y, v.state))
                parts[f"{name}: first plan"] = (lambda v=views[s], r=rule(): r.plan(v))
                if planner.replan_step is not None:
                    parts[f"{name}: second plan"] = (lambda v=views[planner.replan_step], r=rule(): r.replan(v))
                recorder = _Recorder(rule(), data.shape[0])
                times = run_with_early_exit(model, data, recorder).stop_times
                depths[name] = float(times.float().mean())
                replayed = run_with_early_exit(model, data[:bs], _Replay(recorder, slice(0, bs))).stop_times
                if not torch.equal(replayed, times[:bs]):
                    raise SystemExit(f"{name}: the replayed plans stop elsewhere than the rule's (a benchmark bug)")
                rollouts[f"{name}: its plans replayed (the same sorts, no features or MLP)"] = (
                    model, lambda k, r=recorder: _Replay(r, slice(k * bs, (k + 1) * bs)))
                rollouts[f"{name}: deployed price rule"] = (model, lambda k, r=rule: r())
                rollouts[f"{name}: its stop times given (free plan)"] = (
                    model, lambda k, t=times: StopAtTimes(t[k * bs:(k + 1) * bs]))
            best: dict[str, float] = {}
            for r in range(args.rounds + 1):  # round-robin; the first pass warms up
                for name, fn in parts.items():
                    v = _timed(fn, inner)
                    best[name] = min(best.get(name, 1e9), v if r else 1e9)
                for name, (m, rule) in rollouts.items():  # seconds per sample
                    v = _rollouts(m, data, rule, bs)
                    best[name] = min(best.get(name, 1e9), v if r else 1e9)
        step, full = best["one LISTA step"], best[f"LISTA-{T}, full depth"]
        print(f"\nbatch {bs} (threads {args.threads}; rollouts over {n} problems; the rules' mean depths: "
              + ", ".join(f"{k} {v:.2f}" for k, v in depths.items()) + ")")
        print("| what | time | in LISTA steps | speed-up over full depth |\n|---|---|---|---|")
        for name, v in best.items():
            per = v if name in parts else v * bs  # rollouts: per batch, as the parts
            print(f"| {name} | {per * 1e3:.3f} ms | {per / step:.2f} | {'' if name in parts else f'{full / v:.3f}x'} |")
        rows[bs] = best
    return rows


class _Recorder:
    """A planning rule that keeps the plans it makes, by row (``view.index``)."""

    def __init__(self, rule, n: int):
        self.rule, self.plan_step, self.replan_step = rule, rule.plan_step, rule.replan_step
        self.first, self.second = torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)

    def plan(self, view):
        times = self.rule.plan(view)
        self.first[view.index] = times
        return times

    def replan(self, view):
        times = self.rule.replan(view)
        self.second[view.index] = times
        return times


class _Replay:
    """Plans recorded before, made again at the same steps: the loop's sorts and gathers without the plans' cost
    (the deployed rollout minus this is what computing the plans costs in place)."""

    def __init__(self, recorded: _Recorder, rows: slice):
        self.plan_step, self.replan_step = recorded.plan_step, recorded.replan_step
        self.first, self.second = recorded.first[rows], recorded.second[rows]

    def plan(self, view):
        return self.first[view.index]

    def replan(self, view):
        return self.second[view.index]


def _rollouts(model, data: torch.Tensor, rule, batch: int) -> float:
    """Seconds per sample of early exit over ``data`` in consecutive batches, the k-th with ``rule(k)``."""
    t0 = time.perf_counter()
    for k, i in enumerate(range(0, data.shape[0], batch)):
        run_with_early_exit(model, data[i:i + batch], rule(k))
    return (time.perf_counter() - t0) / data.shape[0]


if __name__ == "__main__":
    main()
