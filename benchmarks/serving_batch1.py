"""Batch-1 serving of the sparse quick preset's stop model (LISTA-16 and its depth planner, the price rule), side by
side in one process: eager torch under inference_mode, and the exported ONNX Runtime runtime (learn2stop.export +
learn2stop.runtime), the library's one fast path for batch-1 CPU serving. Prints microseconds per request and the
ratio.

    OMP_NUM_THREADS=1 python benchmarks/serving_batch1.py --threads 1 --requests 300
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch

from learn2stop import export_model
from learn2stop.core import InferenceConfig
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
            with torch.inference_mode():
                return sm(x, inference=rule)

        times = per_request({"eager torch": eager, "onnxruntime": runtime.run},
                            {"eager torch": xs, "onnxruntime": arrays}, args.repeats)
    for name, t in times.items():
        print(f"{name:16s} {t * 1e6:9.1f} us/request")
    print(f"onnxruntime is {times['eager torch'] / times['onnxruntime']:.2f}x eager torch")


if __name__ == "__main__":
    main()
