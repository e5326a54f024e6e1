"""Reproduce the paper's Tables 1 and 2 (sparse recovery) and print them beside the paper's numbers.

    python benchmarks/sparse_tables.py --preset fast       # the paper's problem, 22 min measured (--threads 1)
    python benchmarks/sparse_tables.py --preset paper-cpu  # Table 1's accuracy on 2 CPU cores (66 min measured)
    python benchmarks/sparse_tables.py --preset paper    # the paper's full schedule (days on CPU; GPU advised)

Presets (see learn2stop/tasks/sparse/app.py): ``paper`` = the paper's settings (100k/50k/40k iterations
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="fast", choices=list(PRESETS))
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    run_dir = args.run_dir or f"runs/bench-sparse-{args.preset}"
    t0 = time.perf_counter()
    results = reproduce(preset(args.preset), RunContext(run_dir))
    print(f"\nwall-clock for the whole pipeline: {time.perf_counter() - t0:.0f}s")
    print("tuned classical baselines:", json.dumps(results["classical"]))
    print("oracle (best step per sample, needs x*):", json.dumps(results.get("oracle_nmse")))
    curves = results.get("training_curve", {})
    if any(curves.values()):
        print("\nvalidation NMSE (dB) against training time (min): LISTA | LISTA-stop (full depth in Stage I, policy after)")
        for name in ("LISTA", "LISTA-stop"):
            pts = curves.get(name, [])
            print(f"  {name}: " + ", ".join(f"{t / 60:.0f}: {v:.2f}" for t, v in pts[::max(1, len(pts) // 12)] + pts[-1:]))


if __name__ == "__main__":
    main()
