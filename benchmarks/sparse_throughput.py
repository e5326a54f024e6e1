"""Inference throughput of LISTA-stop (policy included, early exit) vs LISTA on the same test set.

    python benchmarks/sparse_throughput.py --run-dir runs/bench-sparse-fast --preset fast

Needs a finished run (``learn2stop sparse train`` or ``benchmarks/sparse_tables.py``) for the
baseline and the Stage I+II checkpoints. Both models are timed side by side in this one process,
at batch size 1 and 1000, on the fixed test set; the table gives samples/s, the ratio, and
each model's NMSE (dB) and mean depth.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from learn2stop.core import FixedDepth, PolicyRule, run_with_early_exit
from learn2stop.tasks.sparse import SparseRecoveryTask, nmse_db, preset
from learn2stop.tasks.sparse.app import _load_stage
from learn2stop.utils.report import markdown_table


@torch.no_grad()
def timed(fn, batches, repeats: int) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Median seconds over ``repeats`` passes of fn over all batches, with the last pass's outputs."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = [fn(b) for b in batches]
        times.append(time.perf_counter() - t0)
    est = torch.cat([o.outputs for o in outs])
    depth = torch.cat([o.stop_times for o in outs])
    return statistics.median(times), est, depth


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--preset", default="fast")
    ap.add_argument("--single-samples", type=int, default=300, help="samples timed one by one at batch size 1")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = preset(args.preset)
    task = SparseRecoveryTask(cfg.problem)
    test = task.test
    from pathlib import Path

    base = _load_stage(cfg, task, Path(args.run_dir), "baseline", "cpu")
    stop = _load_stage(cfg, task, Path(args.run_dir), "stage2", "cpu")
    models = {
        f"LISTA (T={cfg.lista.num_steps})": lambda y: run_with_early_exit(base.model, y, FixedDepth()),
        f"LISTA-stop (T<={cfg.lista.num_steps})": lambda y: run_with_early_exit(
            stop.model, y, PolicyRule(stop.policy, threshold=cfg.policy.threshold)),
    }
    rows, speed = [], {}
    for bs in (1, 1000):
        n = args.single_samples if bs == 1 else len(test)
        # interleave the two SNR-sorted blocks so a prefix covers every SNR
        order = torch.arange(len(test)).view(len(cfg.problem.snrs), -1).T.reshape(-1)[:n]
        ys = test.y[order]
        batches = [ys[i:i + bs] for i in range(0, n, bs)]
        for name, fn in models.items():
            secs, est, depth = timed(fn, batches, args.repeats)
            speed[(name, bs)] = n / secs
            rows.append([name, bs, n / secs, nmse_db(est, test.x[order]), float(depth.float().mean())])
    names = list(models)
    table = markdown_table(["model", "batch", "samples/s", "NMSE (dB)", "mean depth"], rows)
    print(table)
    for bs in (1, 1000):
        print(f"throughput ratio LISTA-stop / LISTA at batch {bs}: {speed[(names[1], bs)] / speed[(names[0], bs)]:.2f}x")
    print(f"(torch threads: {torch.get_num_threads()}; policy features: {cfg.policy.features}, evaluated from step {stop.policy.min_step})")


if __name__ == "__main__":
    main()
