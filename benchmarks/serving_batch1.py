"""Batch-1 serving of the sparse quick preset's stop model (LISTA-16 and its depth planner, the price rule), three ways in one process: eager torch under inference_mode
(the numpy fast path off), the numpy fast path (learn2stop.core.fastpath), and the exported ONNX Runtime runtime
(learn2stop.export + learn2stop.runtime). Prints microseconds per request and the ratios.

    OMP_NUM_THREADS=1 python benchmarks/serving_batch1.py --threads 1 --requests 300
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch

from learn2stop import export_model
from learn2stop.core import InferenceConfig
from learn2stop.core.fastpath import torch_only
from learn2stop.runtime import load
from learn2stop.tasks.sparse import build_lista_stop, preset


def per_request(ways: dict, inputs: dict, repeats: int) -> dict[str, float]:
    """Each way's best over ``repeats`` round-robin passes of the mean seconds per request (round-robin, so that a
    change in the machine's load reaches every way alike)."""
    best = dict.fromkeys(ways, float("inf"))
    for _ in range(repeats):
        for name, fn in ways.items():
            xs = inputs[name]
            start = time.perf_counter()
            for x in xs:
                fn(x)
            best[name] = min(best[name], (time.perf_counter() - start) / len(xs))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rule", default="price", help="the served rule (price: the planner's numpy plan)")
    ap.add_argument("--param", type=float, default=-0.5, help="the rule's parameter")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = preset("quick")
    sm = build_lista_stop(cfg).eval()  # the preset's planner asks once per sample: its plan is what numpy runs
    rule = InferenceConfig(rule=args.rule, param=args.param)
    xs = [torch.randn(1, cfg.problem.m) for _ in range(args.requests)]
    with tempfile.TemporaryDirectory() as out:
        export_model(sm, xs[0], out, rule=rule)
        runtime = load(out, threads=args.threads)
        arrays = [x.numpy() for x in xs]

        def eager(x):
            with torch_only(), torch.inference_mode():
                return sm(x, inference=rule)

        def fast(x):
            with torch.inference_mode():
                return sm(x, inference=rule)

        ways = {"eager torch": eager, "numpy fast path": fast, "onnxruntime": runtime.run}
        times = per_request(ways, {"eager torch": xs, "numpy fast path": xs, "onnxruntime": arrays}, args.repeats)
    for name, t in times.items():
        print(f"{name:16s} {t * 1e6:9.1f} us/request")
    e, f, o = times["eager torch"], times["numpy fast path"], times["onnxruntime"]
    print(f"eager / fast path = {e / f:.2f}x   onnxruntime / fast path = {o / f:.2f}x   eager / onnxruntime = {e / o:.2f}x")


if __name__ == "__main__":
    main()
