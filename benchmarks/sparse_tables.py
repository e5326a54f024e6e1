"""Reproduce the paper's Tables 1 and 2 (sparse recovery) and print them beside the paper's numbers.

    python benchmarks/sparse_tables.py --preset fast       # the paper's problem, 22 min measured (--threads 1)
    python benchmarks/sparse_tables.py --preset paper-cpu  # Table 1's accuracy on 2 CPU cores (66 min measured)
    python benchmarks/sparse_tables.py --preset paper    # the paper's full schedule (days on CPU; GPU advised)

Presets (see learn2stop/tasks/sparse/config.py): ``paper`` = the paper's settings (100k/50k/40k iterations
at lr 1e-4); ``paper-cpu`` = the same problem with 12k LISTA iterations, a sharp Stage I (beta 0.05)
and LISTA trained on for the same budget ("equal budget" row); ``fast`` = the same problem (m=250, n=500, T=20, SNR 20/30/40, 3000 test samples) with
1500 iterations per stage at lr 1e-3 and a cosine schedule: the documented reduction that fits the
2-core budget. The run resumes from its checkpoints if interrupted.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from learn2stop.tasks.base import RunContext
from learn2stop.tasks.sparse import PRESETS, preset, reproduce


#: ``--tiny``: a 13x27 problem, 5 steps, a dozen iterations per stage (a smoke run: the tests use it)
TINY = {"problem": {"m": 13, "n": 27, "sparsity": 0.2, "test_per_snr": 30, "val_per_snr": 20},
        "lista": {"num_steps": 5}, "classical": {"depths": [5, 10], "L_grid": [3, 5], "rho_grid": [0.05, 0.1],
                                                 "tune_samples": 50},
        "policy": {"sketch_dim": 4}, "run_aevb": False, "run_stage3": False,
        **{s: {"iterations": 12, "batch_size": 32, "eval_every": 6, "checkpoint_every": 6}
           for s in ("baseline", "stage1", "stage2", "stage3", "aevb")}}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="fast", choices=list(PRESETS))
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--tiny", action="store_true", help="the preset shrunk to seconds (a smoke run)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    run_dir = args.run_dir or f"runs/bench-sparse-{args.preset}" + ("-tiny" if args.tiny else "")
    t0 = time.perf_counter()
    cfg = preset(args.preset, **(TINY if args.tiny else {}))
    results = reproduce(cfg, RunContext(run_dir, progress=not args.tiny))
    print(f"\nwall-clock for the whole pipeline: {time.perf_counter() - t0:.0f}s")
    print("tuned classical baselines:", json.dumps(results["classical"]))
    print("oracle (best step per sample, needs x*):", json.dumps(results.get("oracle_nmse")))
    curves = results.get("training_curve", {})
    if any(curves.values()):
        print("\nvalidation NMSE (dB) against training time (min): LISTA | LISTA-stop (full depth in Stage I, policy after)")
        for name in ("LISTA", "LISTA-stop"):
            pts = curves.get(name, [])
            print(f"  {name}: " + ", ".join(f"{t / 60:.0f}: {v:.2f}" for t, v in pts[::max(1, len(pts) // 12)] + pts[-1:]))
    return results


if __name__ == "__main__":
    main()
