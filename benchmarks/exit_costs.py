"""What an exit costs in time against what it costs in FLOPs, per exit, on this machine (classify networks).

    python benchmarks/exit_costs.py --arch resnet20 --threads 2                 # the quick preset's network
    python benchmarks/exit_costs.py --run-dir /tmp/runs/cq-r20 --threads 2      # a trained run's stop model
    python benchmarks/exit_costs.py --run-dir /tmp/runs/cq-r20 --device cuda    # the same on a GPU
    python benchmarks/exit_costs.py --tiny                                      # a smoke run (the tests use it)

Prints, for every exit t, the cumulative share of the network's FLOPs (the model's ``exit_costs``, what
budgets and the price count) and of its wall-clock time at each batch size (``measure_exit_costs``: the
fastest of ``--repeats`` rollouts per step, on the test images). Where time runs ahead of FLOPs, an early exit
saves less time than the FLOPs axis says, and a price on FLOPs over-rewards it; the time shares can be priced
instead (any increasing sequence may be ``exit_costs``).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _classify_run import stop_model  # noqa: E402

from learn2stop.core.timing import measure_exit_costs  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", default="", help="a trained classify run (its config, stop model and test images)")
    ap.add_argument("--arch", default="", help="without a run: the quick preset's config with this --model.arch")
    ap.add_argument("--data-path", default="", help="the CIFAR subset's folder (default: the preset's)")
    ap.add_argument("--batches", default="1,256", help="comma-separated batch sizes")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--tiny", action="store_true", help="generated images and a tiny VGG")
    ap.add_argument("--device", default="cpu", help="where to time it: cpu or cuda")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg, sm, images = stop_model(args.run_dir, args.arch, args.data_path, args.device, args.tiny)
    model = sm.model
    flops = torch.tensor(model.exit_costs, dtype=torch.float64)
    shares = {"FLOPs": (flops / flops[-1]).tolist()}
    for b in (int(v) for v in args.batches.split(",")):
        secs = measure_exit_costs(model, images[:b], repeats=args.repeats)
        shares[f"time @{b}"] = [s / secs[-1] for s in secs]
        shares[f"ms @{b}"] = [1e3 * s for s in secs]
    cols = list(shares)
    where = torch.cuda.get_device_name() if images.is_cuda else f"{torch.get_num_threads()} CPU threads"
    print(f"cumulative cost of exiting at each exit ({cfg.model.arch}, {images.shape[-1]}x{images.shape[-1]}, {where})\n")
    print("| exit | " + " | ".join(cols) + " |\n|---" * 1 + "|---" * len(cols) + "|")
    for t in range(len(flops)):
        print(f"| {t + 1} | " + " | ".join(f"{shares[c][t]:.3f}" if not c.startswith("ms") else f"{shares[c][t]:.2f}"
                                         for c in cols) + " |")
    return shares


if __name__ == "__main__":
    main()
