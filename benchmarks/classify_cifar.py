"""Early-exit recognition at scale: Table 7 and the FLOP frontier for a classify preset, on any device.

    python benchmarks/classify_cifar.py --preset cifar                  # VGG16-BN on the CIFAR subset (CPU: hours)
    python benchmarks/classify_cifar.py --preset cifar --device cuda --iterations 3000 --data-path gpu_data
    python benchmarks/classify_cifar.py --preset quick --arch resnet20 --threads 2      # any --model.arch

Prints Table 7 (network alone, SDN, Stage I; rules at equal FLOPs) and the frontier summary: the
learned policy against the confidence, entropy and patience rules, with measured images/s at batch 1
and batch 256 side by side (the speed-ups of early exit over the network alone).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from learn2stop.core.frontier import frontier_command
from learn2stop.tasks.base import RunContext
from learn2stop.tasks.classify import APP, PRESETS, ClassifyConfig, evaluate, train
from learn2stop.utils.config import merge
from learn2stop.utils.config_files import resolve
from learn2stop.utils.distributed import DistContext


#: ``--tiny``: generated images, a tiny VGG, a few iterations per stage (a smoke run: the tests use it)
TINY = {"data": {"kind": "synthetic", "size": 16, "synthetic_per_class": 12, "synthetic_classes": 3},
        "model": {"arch": "vgg6-narrow", "fc_width": 16, "policy_hidden": 4}, "eval_batch": 32,
        **{s: {"iterations": 4, "batch_size": 8, "eval_every": 2, "checkpoint_every": 2, "warmup": 0}
           for s in ("baseline", "sdn", "stage1", "stage2")}}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="cifar", choices=sorted(PRESETS))
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--iterations", type=int, default=0, help="override every model stage's iterations")
    ap.add_argument("--data-path", default=None)
    ap.add_argument("--arch", default=None, help="override the preset's model.arch (vgg16, resnet20, resnet56, ...)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tiny", action="store_true", help="generated images and seconds of training (a smoke run)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    over: dict = merge({}, TINY) if args.tiny else {}
    if args.iterations:
        every = max(args.iterations // 5, 1)
        for s in ("baseline", "sdn"):
            over[s] = {"iterations": args.iterations, "eval_every": every, "checkpoint_every": every}
        over["stage1"] = {"iterations": max(args.iterations // 3, 1), "eval_every": every, "checkpoint_every": every}
        over["stage2"] = {"iterations": max(args.iterations // 4, 1), "eval_every": every, "checkpoint_every": every}
    if args.data_path:
        over["data"] = {"path": args.data_path}
    if args.arch:
        over["model"] = {"arch": args.arch}
    cfg = resolve(ClassifyConfig, merge(PRESETS[args.preset], over))
    run = RunContext(Path(args.run_dir or f"runs/bench-classify-{args.preset}" + (f"-{args.arch}" if args.arch else "")
                          + ("-tiny" if args.tiny else "")), ctx=DistContext(device=torch.device(args.device)), progress=False)
    t0 = time.perf_counter()
    train(cfg, run)
    t_train = time.perf_counter() - t0
    evaluate(cfg, run)
    fr = frontier_command(APP, cfg, run)
    print(f"\ntraining {t_train:.0f}s, total {time.perf_counter() - t0:.0f}s on {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else ""))
    full = fr["full_depth"]
    for name in ("policy", "confidence", "sdn_confidence"):
        for p in fr["curves"].get(name, []):
            print(f"{name:15s} budget/param {p.get('budget', p.get('param')):.3g}: acc {p['metric']:.2f} % at "
                  f"{100 * p['mean_cost']:.0f} % FLOPs; speed-up x{p['samples_per_s_batchN'] / full['samples_per_s_batchN']:.2f}"
                  f" @256, x{p['samples_per_s_batch1'] / full['samples_per_s_batch1']:.2f} @1")
    print("summary:", json.dumps(fr["summary_by_cost"] if "summary_by_cost" in fr else fr["summary"], default=str)[:600])
    return fr


if __name__ == "__main__":
    main()
