"""DnCNN vs DnCNN-stop vs BM3D on BSD68 (paper Table 6) and DnCNN-stop's accuracy-compute frontier,
on a budget that fits a few hours on 2 CPU cores.

    python benchmarks/denoise_bsd68.py --threads 2                              # ~3-4 h on 2 CPU cores
    python benchmarks/denoise_bsd68.py --budget tiny --run-dir /tmp/dn-tiny     # ~1 min: checks the pipeline

Reduction from the paper's schedule (App. B.3; the ``paper`` preset keeps it in full):

| what | paper | ``--budget cpu`` (default) |
|---|---|---|
| network | DnCNN 20 layers, 64 channels, 18 exits + final (19 outputs) | same; exits are one 1x1 conv |
| patches | 50x50, stride 10, scales 1/0.9/0.8/0.7, ~403k | 40x40, stride 10, same scales, all Train400 images |
| DnCNN pre-training | 50 epochs x 403k / 256 = 78.7k it., batch 256, lr 1e-3 (/10 at half) | 4000 it., batch 32, lr 1e-3 (/10 at 60 %) |
| exits warm-up (ours) | - | 500 it., batch 32, lr 5e-3, backbone frozen |
| Stage I | 78.7k it., batch 256, lr 1e-4, beta 0.1, no price | 2000 it., batch 32, lr 5e-4 cosine, beta 1, price 0.5 |
| Stage II | 100 epochs, lr 1e-3, MAP target | 1000 it., batch 32, lr 3e-3 cosine, forward KL |
| patches seen | ~20M + ~20M | 128k + 64k (about 0.5 % of the paper's) |

So the absolute PSNRs sit well below the paper's; what the run measures is the comparison of the
three methods on equal footing, the depth DnCNN-stop uses per noise level, the time per image, and
the frontier (fixed depth, the exits of the frozen DnCNN, the tolerance rule, the policy at budgets,
the oracle). After training it calibrates the stop rule on the validation images (mean PSNR loss
at most ``--epsilon`` dB against full depth, risk ``--delta``) and evaluates with that rule.
The frontier runs without wall-clock speeds: BSD68 mixes 481x321 and 321x481 images, which the
frontier's speed measurement cannot batch; Table 6 gives the time per image at batch 1.
Everything is done by the library; this script only sets the budget and prints the comparison.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from learn2stop.core.calibration import CalibrationTarget
from learn2stop.core.calibrate import calibrate_command
from learn2stop.core.frontier import frontier_command  # noqa: E402
from learn2stop.tasks.base import RunContext  # noqa: E402
from learn2stop.tasks.denoise.app import APP, evaluate, train  # noqa: E402
from learn2stop.tasks.denoise.config import PRESETS, DenoiseAppConfig  # noqa: E402
from learn2stop.tasks.denoise.report import PAPER_TABLE6  # noqa: E402
from learn2stop.utils.config import merge
from learn2stop.utils.config_files import resolve  # noqa: E402


def _stage(it, lr, batch=32, **kw):
    every = max(it // 10, 1)
    return {"iterations": it, "lr": lr, "batch_size": batch, "eval_every": every, "checkpoint_every": every, **kw}


BUDGETS = {
    "cpu": {
        "data": {"patch_size": 40, "val_patches": 256},
        "model": {"policy_min_mass": 0.05},
        "method": {"beta": 1.0, "price": 0.5},
        "baseline": _stage(4000, 1e-3, lr_schedule="step", lr_decay_at=[0.6]),
        "heads": _stage(500, 5e-3),
        "stage1": _stage(2000, 5e-4, lr_schedule="cosine", lr_min_factor=0.05),
        "stage2": _stage(1000, 3e-3, lr_schedule="cosine", lr_min_factor=0.05),
    },
    # a pipeline check on the real folders: tiny network, a few images, seconds per stage
    "tiny": {
        "data": {"patch_size": 40, "val_patches": 16, "max_train_images": 10, "max_test_images": 2, "scales": [1.0]},
        "model": {"depth": 5, "channels": 8, "policy_hidden": 4},
        "baseline": _stage(30, 1e-3, batch=8),
        "heads": _stage(10, 1e-3, batch=8),
        "stage1": _stage(10, 1e-4, batch=8),
        "stage2": _stage(10, 1e-3, batch=8),
        "eval": {"bm3d_max_images": 1, "crop": 64},
    },
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", choices=sorted(BUDGETS), default="cpu")
    ap.add_argument("--data-root", default=str(ROOT.parent / "shared" / "data" / "denoising"),
                    help="folder holding Train400/ and BSD68/")
    ap.add_argument("--run-dir", default="runs/denoise-bsd68")
    ap.add_argument("--test-images", type=int, default=None, help="evaluate on the first N BSD68 images only")
    ap.add_argument("--epsilon", type=float, default=0.1, help="allowed mean PSNR loss (dB) of the calibrated rule")
    ap.add_argument("--delta", type=float, default=0.1, help="risk level of the calibration")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--no-bm3d", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    data = Path(args.data_root)
    over = {"data": {"train_dir": str(data / "Train400"), "test_dir": str(data / "BSD68")}}
    if args.test_images:
        over["data"]["max_test_images"] = args.test_images
    if args.no_bm3d:
        over["eval"] = {"bm3d": False}
    cfg = resolve(DenoiseAppConfig, merge(merge(PRESETS["paper"], BUDGETS[args.budget]), over))
    run = RunContext(run_dir=Path(args.run_dir), progress=not args.no_progress)
    t0 = time.perf_counter()
    train(cfg, run)
    t_train = time.perf_counter() - t0
    frontier = frontier_command(APP, cfg, run, speed=False)
    cal = calibrate_command(APP, cfg, run, CalibrationTarget(epsilon=args.epsilon, delta=args.delta))
    out = evaluate(cfg, run)
    t_eval = time.perf_counter() - t0 - t_train
    print(f"\nbudget {args.budget}: training {t_train / 60:.1f} min, frontier, calibration and evaluation "
          f"{t_eval / 60:.1f} min (run directory {run.run_dir})")
    print("\nDnCNN-stop - DnCNN (dB), measured vs paper:")
    for s in out["summary"]:
        paper = ""
        if s["sigma"].isdigit() and int(s["sigma"]) in PAPER_TABLE6["sigmas"]:
            k = PAPER_TABLE6["sigmas"].index(int(s["sigma"]))
            paper = f" (paper {PAPER_TABLE6['DnCNN-stop'][k] - PAPER_TABLE6['DnCNN'][k]:+.2f})"
        print(f"  sigma {s['sigma']}: {s['psnr DnCNN-stop'] - s['psnr DnCNN']:+.2f}{paper}; "
              f"{s['stop_layers']:.1f} of {cfg.model.depth} layers, {100 * s['stop_cost']:.0f} % of the MACs")
    for batch, ms in out["ms_per_image"].items():
        print(f"ms per image at batch {batch}:", ", ".join(f"{k} {v:.0f}" for k, v in ms.items()))
    summary = {"budget": args.budget, "train_s": t_train, "eval_s": t_eval, "summary": out["summary"],
               "ms_per_image": out["ms_per_image"], "calibration": cal.to_dict(), "frontier": frontier["summary"]}
    (run.run_dir / "benchmark.json").write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
