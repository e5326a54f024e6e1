"""Early exit's two loops side by side on a trained classify run: one host synchronisation per step (the default)
against device mode (``compact_every``: no synchronisation between compactions), at batch 1 and a large batch.

    python benchmarks/loop_modes.py --run-dir /tmp/runs/cq-v4 --device cuda --policy 0.302 --confidence 0.484
    python benchmarks/loop_modes.py --tiny                                     # a smoke run (the tests use it)

Rules: full depth, the policy's threshold rule and the confidence rule at the given thresholds (pick them from the
run's frontier.json: the points near half the FLOPs). Every mode must give the same stop times (checked); the
table prints samples/s (best of ``--repeats`` passes over the test images) and each mode's ratio to full depth.
"""
from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _classify_run import stop_model  # noqa: E402

from learn2stop.core.timing import measure_speed  # noqa: E402
from learn2stop.core.loop import run_with_early_exit
from learn2stop.core.rules import FixedDepth, SignalRule
from learn2stop.core.signal_registry import make_signal
from learn2stop.tasks.classify.app import APP  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", default="", help="a trained classify run")
    ap.add_argument("--data-path", default="", help="the CIFAR subset's folder (default: the run's)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--policy", type=float, default=0.5, help="the policy rule's threshold")
    ap.add_argument("--confidence", type=float, default=0.5, help="the confidence rule's threshold")
    ap.add_argument("--batches", default="1,256")
    ap.add_argument("--modes", default="sync,1,2,3", help="sync, or compact_every values")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="generated images and an untrained tiny VGG")
    args = ap.parse_args(argv)
    cfg, sm, images = stop_model(args.run_dir, "", args.data_path, args.device, args.tiny)
    rules = {"full depth": lambda: FixedDepth(),
             f"policy {args.policy:g}": lambda: SignalRule(make_signal("threshold", sm.policy), args.policy),
             f"confidence {args.confidence:g}": lambda: SignalRule(APP.classical_signals(cfg)["confidence"](),
                                                                  args.confidence)}
    modes = [None if m == "sync" else int(m) for m in args.modes.split(",")]
    where = torch.cuda.get_device_name() if images.is_cuda else f"{torch.get_num_threads()} CPU threads"
    print(f"samples/s of early exit per loop mode ({cfg.model.arch}, {images.shape[0]} test images, {where})\n")
    cols = [f"{'sync' if m is None else f'compact_every={m}'} @{b}" for b in args.batches.split(",") for m in modes]
    print("| rule | mean exit | " + " | ".join(cols) + " |\n|---|---|" + "---|" * len(cols))
    table: dict[str, dict[str, float]] = {}
    base: dict[str, float] = {}
    for name, factory in rules.items():
        with torch.inference_mode():
            ref = run_with_early_exit(sm.model, images, factory()).stop_times
            for m in modes[1:]:
                got = run_with_early_exit(sm.model, images, factory(), compact_every=m).stop_times
                if not torch.equal(got, ref):
                    raise AssertionError(f"{name}: compact_every={m} stops elsewhere than the synchronising loop")
        row = table.setdefault(name, {})
        for b in (int(v) for v in args.batches.split(",")):
            data = images[:min(48, images.shape[0])] if b == 1 else images
            for m in modes:
                runner = functools.partial(run_with_early_exit, compact_every=m)
                row[f"{'sync' if m is None else f'compact_every={m}'} @{b}"] = measure_speed(
                    sm.model, data, factory, b, repeats=args.repeats, runner=runner)
        if name == "full depth":
            base = row
        cells = [f"{row[c]:.0f} ({row[c] / base[c]:.2f}x)" for c in cols]
        print(f"| {name} | {ref.float().mean():.2f} | " + " | ".join(cells) + " |")
    return table


if __name__ == "__main__":
    main()
