"""DnCNN vs DnCNN-stop vs BM3D on BSD68 (paper Table 6), on a budget that fits a few hours on 2 CPU cores.

    OMP_NUM_THREADS=2 python benchmarks/denoise_bsd68.py                       # ~3-4 h on 2 CPU cores
    python benchmarks/denoise_bsd68.py --budget tiny --run-dir /tmp/dn-tiny    # ~1 min: checks the pipeline

Reduction from the paper's schedule (App. B.3; the ``paper`` preset keeps it in full):

| what | paper | ``--budget cpu`` (default) |
|---|---|---|
| network | DnCNN 20 layers, 64 channels, 18 heads + final (19 outputs) | same |
| patches | 50x50, stride 10, scales 1/0.9/0.8/0.7, ~403k | 40x40, stride 10, same scales, all Train400 images |
| DnCNN pre-training | 50 epochs x 403k / 256 = 78.7k it., batch 256, lr 1e-3 (/10 at half) | 4000 it., batch 32, lr 1e-3 (/10 at 60 %) |
| heads warm-up (ours) | - | 500 it., batch 32, lr 1e-3, backbone frozen |
| Stage I | 78.7k it., batch 256, lr 1e-4, beta 0.1 | 2000 it., batch 32, lr 1e-4, beta 0.1 |
| Stage II | 100 epochs, lr 1e-3, MAP target | 1000 it., batch 32, lr 1e-3, MAP target |
| patches seen | ~20M + ~20M | 128k + 64k (about 0.5 % of the paper's) |

So the absolute PSNRs sit well below the paper's; what the run measures is the comparison of the
three methods on equal footing, the depth DnCNN-stop uses per noise level, and the time per image.
Everything is done by the library (:mod:`learn2stop.tasks.denoise.app`); this script only sets the
budget and prints the comparison.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from learn2stop.tasks.base import RunContext  # noqa: E402
from learn2stop.tasks.denoise.app import PAPER_TABLE6, PRESETS, DenoiseAppConfig, evaluate, train  # noqa: E402
from learn2stop.utils.config import merge, resolve  # noqa: E402


def _stage(it, lr, batch=32, **kw):
    every = max(it // 10, 1)
    return {"iterations": it, "lr": lr, "batch_size": batch, "eval_every": every, "checkpoint_every": every, **kw}


BUDGETS = {
    "cpu": {
        "data": {"patch_size": 40, "val_patches": 256},
        "dncnn": _stage(4000, 1e-3, lr_schedule="step", lr_decay_at=[0.6]),
        "heads": _stage(500, 1e-3),
        "stage1": _stage(2000, 1e-4),
        "stage2": _stage(1000, 1e-3),
        "eval": {"diagnostics": False},
    },
    # a pipeline check on the real folders: tiny network, a few images, seconds per stage
    "tiny": {
        "data": {"patch_size": 40, "val_patches": 16, "max_train_images": 10, "max_test_images": 2, "scales": [1.0]},
        "model": {"depth": 5, "channels": 8, "policy_channels": 4},
        "dncnn": _stage(30, 1e-3, batch=8),
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
    ap.add_argument("--no-bm3d", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    data = Path(args.data_root)
    over = {"data": {"train_dir": str(data / "Train400"), "test_dir": str(data / "BSD68")}}
    if args.test_images:
        over["data"]["max_test_images"] = args.test_images
    if args.no_bm3d:
        over["eval"] = {"bm3d": False}
    cfg = resolve(DenoiseAppConfig, merge(merge(PRESETS["paper"], BUDGETS[args.budget]), over))
    run = RunContext(run_dir=Path(args.run_dir), progress=not args.no_progress)
    run.prepare(cfg)
    t0 = time.perf_counter()
    train(cfg, run)
    t_train = time.perf_counter() - t0
    out = evaluate(cfg, run)
    t_eval = time.perf_counter() - t0 - t_train
    print(f"\nbudget {args.budget}: training {t_train / 60:.1f} min, evaluation {t_eval / 60:.1f} min "
          f"(run directory {run.run_dir})")
    print("\nDnCNN-stop - DnCNN (dB), measured vs paper:")
    for s in out["summary"]:
        k = PAPER_TABLE6["sigmas"].index(int(s["sigma"]))
        paper_gap = PAPER_TABLE6["DnCNN-stop"][k] - PAPER_TABLE6["DnCNN"][k]
        print(f"  sigma {s['sigma']:g}: {s['DnCNN-stop'] - s['DnCNN']:+.2f} (paper {paper_gap:+.2f}); "
              f"depth {s['depth_layers']:.1f} layers; per image {s['sec_stop']:.2f} s stop, {s['sec_dncnn']:.2f} s DnCNN"
              + (f", {s['sec_bm3d']:.2f} s BM3D" if s["sec_bm3d"] is not None else ""))
    (run.run_dir / "benchmark.json").write_text(json.dumps({"budget": args.budget, "train_s": t_train,
                                                             "eval_s": t_eval, "summary": out["summary"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
