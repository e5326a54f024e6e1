"""Batch-1 serving of a sparse quick-size stop model, three ways in one process: eager torch under inference_mode
(the numpy fast path off), the numpy fast path (learn2stop.core.fastpath), and the exported ONNX Runtime runtime
(learn2stop.export + learn2stop.runtime). Prints microseconds per request and the ratios.

    OMP_NUM_THREADS=1 python benchmarks/serving_batch1.py --threads 1 --requests 300
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch

from learn2stop import StoppingModel, export_model
from learn2stop.core import InferenceConfig
from learn2stop.core.fastpath import torch_only
from learn2stop.runtime import load
from learn2stop.tasks.sparse import LISTA, ProblemConfig, make_matrix
from learn2stop.tasks.sparse.policy import SparseStopPolicy


def per_request(fn, xs, repeats: int) -> float:
    """The best over ``repeats`` passes of the mean seconds per request."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for x in xs:
            fn(x)
        best = min(best, (time.perf_counter() - start) / len(xs))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    A = make_matrix(ProblemConfig(m=125, n=250))  # the quick preset's problem, its 16 steps
    sm = StoppingModel(LISTA(A, 16), SparseStopPolicy(A, 16, "sketch", 32, (64, 64))).eval()
    rule = InferenceConfig(rule="quantile", param=0.5)
    xs = [torch.randn(1, 125) for _ in range(args.requests)]
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

        times = {"eager torch": per_request(eager, xs, args.repeats),
                 "numpy fast path": per_request(fast, xs, args.repeats),
                 "onnxruntime": per_request(runtime.run, arrays, args.repeats)}
    for name, t in times.items():
        print(f"{name:16s} {t * 1e6:9.1f} us/request")
    e, f, o = times["eager torch"], times["numpy fast path"], times["onnxruntime"]
    print(f"eager / fast path = {e / f:.2f}x   onnxruntime / fast path = {o / f:.2f}x   eager / onnxruntime = {e / o:.2f}x")


if __name__ == "__main__":
    main()
