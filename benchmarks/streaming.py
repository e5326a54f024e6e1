"""Serving a stream of single requests under a steady arrival rate: throughput and median / p95 latency of
three servers of the same stop model, one after another in one process:

- ``full depth, batched``: whenever the server is free it takes every request that has arrived (up to
  ``--max-batch``) and runs all T steps;
- ``early exit, batch then shrink``: the same batches, run by ``run_with_early_exit`` with the deployed rule
  (the batch shrinks as its requests stop; newcomers wait for the whole batch);
- ``early exit, streaming``: :class:`~learn2stop.core.streaming.StreamingRunner` with the same rule (per-step
  queues, refilled as requests arrive and as others stop).

    python benchmarks/streaming.py --threads 1                      # random weights, the quick sizes
    python benchmarks/streaming.py --sparse-run runs/sparse-quick --classify-run runs/classify-quick
    python benchmarks/streaming.py --tasks maml --maml-run runs/maml-quick --max-batch 100   # tasks (dict inputs)
    python benchmarks/streaming.py --tiny                           # a smoke run (the tests use it)

Requests arrive at fixed intervals (``--loads``: fractions of the full-depth server's own throughput at
``--max-batch``, measured first), each is one test input; the clock is real (``time.perf_counter``), so time
it alone. Models and rules as in ``runtime_speed.py`` (a trained run's stop stage and deployed rule, or random
weights with a policy that stops part-way).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_speed import _rows, task_model, torch_rule  # noqa: E402

from learn2stop.core.loop import run_with_early_exit
from learn2stop.core.rules import FixedDepth
from learn2stop.core.streaming import StreamingRunner  # noqa: E402
from learn2stop.core.trees import batch_size, tree_map  # noqa: E402
from learn2stop.utils.report import markdown_table  # noqa: E402


TASKS = ("sparse", "classify", "maml", "denoise")


def batched_server(model, inputs, arrivals: np.ndarray, max_batch: int, make_rule) -> dict:
    """Take every arrived request (up to max_batch) whenever free; run the batch with the rule to the end."""
    n, done, start = len(arrivals), 0, time.perf_counter()
    latency, depth = np.zeros(n), np.zeros(n)
    while done < n:
        now = time.perf_counter() - start
        if arrivals[done] > now:
            time.sleep(arrivals[done] - now)
            continue
        k = min(int(np.searchsorted(arrivals, now, side="right")) - done, max_batch)
        r = run_with_early_exit(model, _rows(inputs, done, done + k), make_rule())
        latency[done:done + k] = time.perf_counter() - start - arrivals[done:done + k]
        depth[done:done + k] = r.stop_times.numpy()
        done += k
    return _summary(latency, depth, time.perf_counter() - start)


def streaming_server(model, inputs, arrivals: np.ndarray, max_batch: int, make_rule) -> dict:
    n, submitted, start = len(arrivals), 0, time.perf_counter()
    runner = StreamingRunner(model, make_rule(), max_batch=max_batch, capacity=max(4 * max_batch, 64) + n)
    ids = []
    while len(runner.finished) < n:
        now = time.perf_counter() - start
        while submitted < n and arrivals[submitted] <= now:
            ids.append(runner.submit(_rows(inputs, submitted, submitted + 1), arrived=start + arrivals[submitted]))
            submitted += 1
        if not runner.tick() and not runner.in_flight and submitted < n:
            time.sleep(max(arrivals[submitted] - (time.perf_counter() - start), 0))
    latency = np.array([runner.finished[i].latency for i in ids])
    depth = np.array([runner.finished[i].stop_time for i in ids], dtype=float)
    return _summary(latency, depth, max(f.finished for f in runner.finished.values()) - start)


def _summary(latency: np.ndarray, depth: np.ndarray, seconds: float) -> dict:
    return {"throughput": len(latency) / seconds, "p50_ms": 1e3 * float(np.median(latency)),
            "p95_ms": 1e3 * float(np.percentile(latency, 95)), "mean_depth": float(depth.mean())}


@torch.no_grad()
def measure(sm, rule, inputs, max_batch: int, loads: list[float], n: int) -> list[dict]:
    m = sm.model
    full = lambda: FixedDepth()  # noqa: E731
    early = lambda: torch_rule(sm, rule)  # noqa: E731
    # the full-depth server's own throughput: everything arrived at once
    inputs = _rows(inputs, 0, n)
    for make in (full, early):  # warm-up: first calls (MAML's torch.func transforms, allocations) are slow
        batched_server(m, _rows(inputs, 0, min(n, 2 * max_batch)), np.zeros(min(n, 2 * max_batch)), max_batch, make)
    capacity = batched_server(m, inputs, np.zeros(n), max_batch, full)["throughput"]
    rows = []
    for load in loads:
        arrivals = np.arange(n) / (load * capacity)
        for name, server, make in (("full depth, batched", batched_server, full),
                                   ("early exit, batch then shrink", batched_server, early),
                                   ("early exit, streaming", streaming_server, early)):
            r = server(m, inputs, arrivals, max_batch, make)
            rows.append({"load": load, "arrival_per_s": load * capacity, "server": name, **r})
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tasks", default="sparse,classify")
    ap.add_argument("--sparse-run", default=None, help="a trained sparse run directory (else random weights)")
    ap.add_argument("--classify-run", default=None, help="a trained classify run directory (else random weights)")
    ap.add_argument("--maml-run", default=None, help="a trained maml run directory (else random weights)")
    ap.add_argument("--denoise-run", default=None, help="a trained denoise run directory (else random weights)")
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--loads", default="0.5,0.9,1.2", help="arrival rates as fractions of the full-depth capacity")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--tiny", action="store_true", help="tiny sizes: a smoke run")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    if args.threads < 1 or args.max_batch < 1 or args.requests < 1:
        ap.error("--threads, --max-batch and --requests must be >= 1")
    try:
        loads = [float(v) for v in args.loads.split(",")]
    except ValueError:
        ap.error(f"--loads: comma-separated numbers; got {args.loads!r}")
    if not loads or any(not v > 0 for v in loads):
        ap.error(f"--loads: fractions > 0; got {args.loads!r}")
    torch.set_num_threads(args.threads)
    n = 24 if args.tiny else args.requests
    results = {}
    for task in [t for t in args.tasks.split(",") if t]:
        if task not in TASKS:
            ap.error(f"--tasks: unknown task {task!r}; choose from {', '.join(TASKS)}")
        sm, rule, inputs, source = task_model(task, getattr(args, f"{task}_run"), args.tiny, n)
        if batch_size(inputs) < n:  # the test inputs again, as often as it takes
            inputs = tree_map(lambda v, k=n // batch_size(inputs) + 1: v.repeat(k, *([1] * (v.dim() - 1))), inputs)
        max_batch = 4 if args.tiny else args.max_batch
        rows = measure(sm, rule, inputs, max_batch, loads, n)
        results[task] = {"source": source, "rows": rows}
        print(f"\n## {task} ({source}; {n} requests; max batch {max_batch}; {args.threads} thread(s))\n")
        print(markdown_table(["load", "arrivals / s", "server", "served / s", "p50 ms", "p95 ms", "mean depth"],
                             [[r["load"], r["arrival_per_s"], r["server"], r["throughput"], r["p50_ms"], r["p95_ms"],
                               r["mean_depth"]] for r in rows], digits=3))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
