"""MAML vs MAML-stop on Omniglot 20-way 1-5-shot, task-imbalanced (paper Table 4), plus peak memory.

    OMP_NUM_THREADS=2 python benchmarks/maml_omniglot.py                        # about an hour on 2 CPU cores
    python benchmarks/maml_omniglot.py --budget tiny --run-dir /tmp/maml-tiny   # ~1 min: checks the pipeline

After training and the Table 4 comparison it writes the accuracy-compute frontier of the run
(``frontier.md`` / ``.png`` / ``.json``, the core's ``frontier_command``): ``--frontier metric`` (default)
without wall-clock speeds, ``speed`` with them (batch 1 and batch 100 tasks per point: many minutes
for Conv4 on a CPU), ``none`` to skip it.

Reduction from the paper's schedule (App. B.2; the ``paper`` preset of ``learn2stop maml`` keeps it in full):

| what | paper | ``--budget hour`` (default) |
|---|---|---|
| learner | Conv4, 64 filters, second order | Conv4, 32 filters, first order |
| inner loop | 10 steps, lr 0.1 | same |
| MAML / Stage I meta-iterations | 60k, meta-batch 10, Adam 1e-3 | 150 each, meta-batch 4, Adam 1e-3 |
| Stage II (policy, MAP target) | trained jointly with Stage I | 60 iterations, meta-batch 4, theta frozen |
| validation | - | 20 tasks every 50 iterations |
| test | 600 tasks, 95% CI | 600 tasks, 95% CI, the same tasks for both methods |
| stop rule at test time | sampled from q_phi | the config's ``inference`` (``--rule``; the run's calibration if any) |

So the accuracies sit far below the paper's (a few hundred meta-iterations instead of 60k): the run
measures the comparison of the two methods on equal footing and the depth MAML-stop chooses per shot count.

Peak memory of one training step is measured at equal inner steps, with the paper's second-order
training, in two ways (see :mod:`learn2stop.tasks.maml.memory`): the bytes the autograd graph holds
when backward starts (deterministic), and the process's peak resident memory (``ru_maxrss`` minus the
resident size before the steps, in a fresh subprocess per method, so one method's high-water mark
cannot hide the other's; ``torch.cuda.max_memory_allocated`` on a GPU). MAML-stop's depth is random
(t ~ q*), so both take the maximum over a few meta-batches.

Everything is done by the library (:mod:`learn2stop.tasks.maml.app` and the core pipeline); this
script only sets the budget and prints the comparison.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from learn2stop.core.frontier import frontier_command  # noqa: E402
from learn2stop.tasks.base import RunContext  # noqa: E402
from learn2stop.tasks.maml import APP, PRESETS, MAMLConfig, reproduce  # noqa: E402
from learn2stop.tasks.maml.memory import graph_bytes, process_peak_bytes  # noqa: E402
from learn2stop.utils.config import merge, to_dict  # noqa: E402
from learn2stop.utils.config_files import resolve  # noqa: E402
from learn2stop.utils.distributed import DistContext  # noqa: E402
from learn2stop.utils.report import markdown_table  # noqa: E402

PAPER_TABLE4 = {"MAML": (97.96, 0.3), "MAML-stop": (98.45, 0.2)}  # Omniglot 20-way 1-5 shot, accuracy %


def _stage(it, batch=4, every=50):
    return {"iterations": it, "batch_size": batch, "eval_every": every, "checkpoint_every": every}


BUDGETS = {
    "hour": {
        "model": {"hidden": 32, "first_order": True},
        "maml": _stage(150), "stage1": _stage(150), "stage2": _stage(60, every=30),
        "eval": {"tasks": 600, "val_tasks": 20, "chunk": 20, "per_step": False},
    },
    # pipeline check on the real data: small learner, a few iterations and tasks
    "tiny": {
        "model": {"hidden": 8, "inner_steps": 3, "first_order": True},
        "maml": _stage(3, 2, 3), "stage1": _stage(3, 2, 3), "stage2": _stage(3, 2, 3),
        "eval": {"tasks": 20, "val_tasks": 4, "chunk": 10, "per_step": False},
    },
}
MEMORY_BATCH = {"hour": 4, "tiny": 2}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget", choices=sorted(BUDGETS), default="hour")
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "omniglot"), help="Omniglot .npz folder")
    p.add_argument("--run-dir", default="runs/maml-omniglot-bench")
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    p.add_argument("--memory-only", action="store_true", help="only measure peak memory (no training)")
    p.add_argument("--rule", choices=["quantile", "threshold", "sampled"], default="quantile",
                   help="the policy's test-time rule: the median of q_phi, pi_t >= 0.5, or stop with probability pi_t")
    p.add_argument("--frontier", choices=["none", "metric", "speed"], default="metric",
                   help="the accuracy-compute frontier after training: skip it, metric only, or with speeds")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)

    import torch

    rule = {"sampled": True} if args.rule == "sampled" else {"rule": args.rule, "param": 0.5}
    budget = merge(BUDGETS[args.budget], {"data": {"path": args.data}, "inference": rule})
    cfg = resolve(MAMLConfig, merge(PRESETS["paper"], budget))
    run = RunContext(run_dir=Path(args.run_dir), ctx=DistContext(device=torch.device(args.device)),
                     progress=not args.no_progress)
    if not args.memory_only:
        run.prepare(cfg)
        compare(cfg, run, args.budget)
        if args.frontier != "none":
            frontier_command(APP, cfg, run, speed=args.frontier == "speed")
    if not args.no_memory:
        memory(cfg, args.budget, args.device)
    return 0


def compare(cfg: MAMLConfig, run: RunContext, budget: str) -> None:
    t0 = time.perf_counter()
    result = reproduce(cfg, run)
    seconds = time.perf_counter() - t0
    rows = []
    for ours, paper in ((f"MAML ({cfg.model.inner_steps} steps)", "MAML"), ("MAML-stop (learned stop)", "MAML-stop")):
        r = result["rows"][ours]
        rows.append([paper, f"{r['mean']:.2f} +- {r['ci95']:.2f}", f"{PAPER_TABLE4[paper][0]:.2f} +- {PAPER_TABLE4[paper][1]:.1f}"])
    print(f"\nOmniglot 20-way 1-5 shot (imbalanced), {result['tasks']} test tasks, budget {budget!r}, "
          f"{seconds / 60:.1f} min for training and evaluation")
    print(markdown_table(["method", "accuracy % (ours, 95% CI)", "paper Table 4"], rows))
    print(f"MAML-stop stops with the {result['rule']}")
    print(f"mean stop step of MAML-stop: {result['mean_stop_step']:.2f} of {cfg.model.inner_steps}; by shot K: "
          + ", ".join(f"K={k}: {v['mean_stop']:.2f}" for k, v in result["stop_by_shot"].items()))


def memory(cfg: MAMLConfig, budget: str, device: str) -> None:
    batch = MEMORY_BATCH[budget]
    mem_cfg = resolve(MAMLConfig, merge(to_dict(cfg), {
        "model": {"first_order": False}, "maml": {"batch_size": batch},
        "stage1": {"batch_size": batch, "beta": cfg.method.beta}}))  # memory.py reads the stage's own beta
    graph = {m: graph_bytes(mem_cfg, m, repeats=3) for m in ("maml", "stop")}
    proc = {m: process_peak_bytes(mem_cfg, m, device=device, repeats=3) for m in ("maml", "stop")}
    mb = lambda b: b / 2**20
    print(f"\nPeak memory of one second-order training step, {cfg.model.inner_steps} inner steps, "
          f"{cfg.model.hidden} filters, meta-batch {batch} (max over 3 meta-batches):")
    print(markdown_table(["measure", "MAML (MiB)", "MAML-stop (MiB)", "ratio stop / MAML"], [
        ["autograd graph at backward", mb(graph["maml"]), mb(graph["stop"]), graph["stop"] / graph["maml"]],
        [f"process peak ({device})", mb(proc["maml"]), mb(proc["stop"]), proc["stop"] / max(proc["maml"], 1)],
    ]))


if __name__ == "__main__":
    sys.exit(main())
