"""What the sparse depth planner costs, in LISTA steps, and what the deployed rule gains in time, side by side.

    python benchmarks/sparse_planner_cost.py --run-dir runs/sparse-quick --threads 1
    python benchmarks/sparse_planner_cost.py --tiny        # a smoke run (the tests use it)

On a trained run (its ``stage2`` planner, ``baseline`` LISTA and ``calibration.json``) and its test problems in a
fixed random order, at batch 1 and at a large batch:

- the planner's parts against one LISTA step (step 6 on the state of step 5): its features (two products with A:
  about 2/3 of a step's multiply-adds), the whole plan the price rule makes (features, MLP, argmax), and the same
  plan with the support size counted as the 0-norm (the planner's form until e3e6552) for reference;
- whole rollouts: LISTA at full depth, the stop model at a fixed depth (``--fixed``), and the deployed price rule,
  once with each support count.

Each time is the best of ``--rounds`` round-robin passes (a drift in the machine's load hits every row alike).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from learn2stop.core.evaluation import measure_speed
from learn2stop.core.loop import StepView, run_with_early_exit
from learn2stop.core.pipeline import load_stage, shuffled
from learn2stop.core.rules import FixedDepth, SignalRule, make_signal
from learn2stop.tasks.sparse import policy as planner_module
from learn2stop.tasks.sparse.app import APP
from learn2stop.tasks.sparse.config import SparseConfig
from learn2stop.utils.config import from_dict, load_yaml


def zero_norm(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(x, 0, dim=1)


def _timed(fn, inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", help="a trained sparse run (reproduce or train)")
    ap.add_argument("--tiny", action="store_true", help="a 4-step random model on a 20x40 problem (smoke run)")
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
        from learn2stop.core.model import StoppingModel
        from learn2stop.tasks.sparse.models import LISTA
        from learn2stop.tasks.sparse.policy import SparseDepthPlanner

        g = torch.Generator().manual_seed(0)
        A = torch.randn(20, 40, generator=g) / 20 ** 0.5
        planner = SparseDepthPlanner(A, 4, hidden=(8,))
        planner.min_step = 2
        stop = StoppingModel(LISTA(A, 4), planner).eval()
        base, threshold, inputs = LISTA(A, 4).eval(), 0.5, torch.randn(64, 20, generator=g)
        args.batch, args.samples, args.fixed, args.rounds = 32, 8, 3, 1
    else:
        run = Path(args.run_dir)
        cfg = from_dict(SparseConfig, load_yaml(run / "config.yaml"))
        stop, base = load_stage(APP, cfg, run, "stage2"), load_stage(APP, cfg, run, "baseline").model
        cal = json.loads((run / "calibration.json").read_text())
        if cal.get("rule") != "price":
            raise SystemExit(f"{run / 'calibration.json'}: the deployed rule is {cal.get('rule')!r}; this benchmark "
                             "times the price rule of a planning policy")
        threshold, inputs = cal["threshold"], shuffled(APP.speed_inputs(cfg, None))
    planner, model, T = stop.policy, stop.model, stop.model.num_steps
    s = planner.plan_step
    supports = {"sign-sum (now)": planner_module.support_size, "0-norm (before)": zero_norm}
    price = lambda: SignalRule(make_signal("price", planner), threshold)  # noqa: E731
    rows: dict[str, dict[int, float]] = {}
    for bs, n in ((1, args.samples), (args.batch, (inputs.shape[0] // args.batch) * args.batch or inputs.shape[0])):
        data = inputs[:n]
        y = data[:bs]
        with torch.inference_mode():
            x = model.initial_state(y)
            for t in range(1, s + 1):
                x = model.step(t, x, y)
            view = StepView(s, T, y, x, None, x, torch.arange(y.shape[0]))
            inner = 200 if bs == 1 else 20
            parts = {"one LISTA step": lambda: model.step(min(s + 1, T), x, y)}
            for name, fn in supports.items():
                parts[f"planner features, support {name}"] = (lambda f=fn: _with_support(f, planner.extract, y, x))
                parts[f"the price rule's plan, support {name}"] = (lambda f=fn: _with_support(f, price().plan, view))
            now = planner_module.support_size
            runs = {f"LISTA-{T}, full depth": (base, lambda: FixedDepth(), now),
                    f"stop model, fixed {args.fixed} steps": (model, lambda: FixedDepth(args.fixed), now)}
            for name, fn in supports.items():
                runs[f"deployed price rule, support {name}"] = (model, price, fn)
            best: dict[str, float] = {}
            for r in range(args.rounds + 1):  # round-robin; the first pass warms up
                for name, fn in parts.items():
                    v = _timed(fn, inner)
                    best[name] = min(best.get(name, 1e9), v if r else 1e9)
                for name, (m, rule, sup) in runs.items():  # seconds per sample
                    v = 1 / _with_support(sup, lambda: measure_speed(m, data, rule, bs, repeats=1, max_seconds=60.0,
                                                                     warmup=r == 0))
                    best[name] = min(best.get(name, 1e9), v if r else 1e9)
            depth = float(run_with_early_exit(model, data, price()).stop_times.float().mean())
        step = best["one LISTA step"]
        print(f"\nbatch {bs} (threads {args.threads}; rollouts over {n} problems, the rule's mean depth {depth:.2f}):")
        print("| what | time | in LISTA steps | speed-up over full depth |\n|---|---|---|---|")
        full = best[f"LISTA-{T}, full depth"]
        for name, v in best.items():
            per = v if name in parts else v * bs  # rollouts: per batch, as the parts
            print(f"| {name} | {per * 1e3:.3f} ms | {per / step:.2f} | "
                  f"{'' if name in parts else f'{full / v:.3f}x'} |")
        rows[bs] = best
    return rows


def _with_support(fn, call, *a):
    """Run ``call`` with the planner's support count replaced by ``fn`` (restored after)."""
    saved = planner_module.support_size
    planner_module.support_size = fn
    try:
        return call(*a)
    finally:
        planner_module.support_size = saved


if __name__ == "__main__":
    main()
