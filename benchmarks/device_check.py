"""The checks that need a GPU, as one script for a short lease: early exit's speed at batch 256, and a preset the CPU
cannot afford.

    python benchmarks/device_check.py --out OUT --data DATA --vgg RUN --resnet RUN --sparse RUN --seconds 480

Each step runs as its own process with its own time limit, so a failing step costs only itself:

1. the test suite's CUDA cases (``pytest -m gpu``);
2. ``classify frontier --device cuda`` on trained quick runs (VGG and ResNet-20): every rule's accuracy and samples/s
   at batch 1 and 256 (all test images in batches of 256, best of 5 passes), with the speed at the network's accuracy;
3. ``benchmarks/exit_costs.py --device cuda``: each exit's share of time against its share of FLOPs;
4. ``sparse frontier --device cuda`` on a trained quick run (batch 1 and 1000);
5. ``classify reproduce --preset cifar --device cuda`` (VGG16-BN, a few CPU-hours; on an H200 its training took
   270 s and its frontier more than the 40 s then left), in what time is left.

``--skip`` leaves steps out by name or prefix (``--skip pytest,frontier,exit-costs`` runs only the cifar preset).

Run folders are copied into ``--work`` before use (a frontier writes into its run). ``OUT`` gets ``log.txt`` and
``results.tar.gz`` (each step's frontier.md / .json, tables, plots and logs; no checkpoints).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for log.txt and results.tar.gz")
    ap.add_argument("--data", required=True, help="the CIFAR-10 subset's folder")
    ap.add_argument("--vgg", default="", help="a finished classify quick run (VGG)")
    ap.add_argument("--resnet", default="", help="a finished classify quick run with --model.arch resnet20")
    ap.add_argument("--sparse", default="", help="a finished sparse quick run")
    ap.add_argument("--seconds", type=float, default=480.0, help="the whole script's time")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--work", default="/tmp/learn2stop-device-check", help="scratch folder for the runs")
    ap.add_argument("--skip", default="", help="comma-separated step names or prefixes to leave out (e.g. pytest,frontier)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "log.txt", "a")
    t_end = time.monotonic() + args.seconds
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1"}

    def say(msg: str) -> None:
        print(msg, flush=True)
        log.write(msg + "\n")
        log.flush()

    skip = [s for s in args.skip.split(",") if s]

    def step(name: str, cmd: list[str], limit: float) -> bool:
        if any(name.startswith(s) for s in skip):
            say(f"== {name}: skipped (--skip)")
            return False
        left = t_end - time.monotonic() - 5
        limit = min(limit, left)
        if limit < 20:
            say(f"== {name}: skipped, {left:.0f} s left")
            return False
        say(f"== {name} (at most {limit:.0f} s): {' '.join(cmd)}")
        t0 = time.monotonic()
        with open(work / f"{name}.log", "w") as f:
            try:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=limit, cwd=ROOT, env=env).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        text = (work / f"{name}.log").read_text(errors="replace")
        say(f"== {name}: rc {rc}, {time.monotonic() - t0:.0f} s; last lines:\n" + "\n".join(text.splitlines()[-25:]))
        return rc == 0

    def cli(task: str, *rest: str, patch: dict | None = None) -> list[str]:
        """``learn2stop <task> ...`` in a fresh process, with the task's app settings changed by ``patch``."""
        code = "import sys\n"
        if patch:
            code += f"from learn2stop.tasks.{task}.app import APP\n" + "".join(f"APP.{k} = {v!r}\n" for k, v in patch.items())
        code += "from learn2stop.cli import main\nsys.exit(main(sys.argv[1:]))\n"
        return [sys.executable, "-c", code, task, *rest, "--device", args.device, "--no-progress"]

    def copy(run: str, name: str) -> Path:
        dst = work / name
        shutil.copytree(run, dst, dirs_exist_ok=True)
        (dst / ".lock").unlink(missing_ok=True)
        return dst

    say(f"python {sys.version.split()[0]}")
    step("env", [sys.executable, "-c", "import torch; print(torch.__version__, torch.cuda.is_available(), "
                 "torch.cuda.get_device_name() if torch.cuda.is_available() else '')"], 60)
    step("pytest-gpu", [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-x", "-p", "no:cacheprovider", "tests"], 120)
    # every test image in batches of 256 (1,017: three full batches), best of five passes
    gpu_speed = {"speed_batches": 3, "speed_passes": 5}
    for name, run, extra in (("vgg", args.vgg, []), ("resnet20", args.resnet, ["--model.arch", "resnet20"])):
        if run:
            d = copy(run, f"classify-{name}")
            step(f"frontier-{name}", cli("classify", "frontier", "--run-dir", str(d), "--data.path", args.data, *extra,
                                         patch=gpu_speed), 120)
            step(f"exit-costs-{name}", [sys.executable, str(ROOT / "benchmarks" / "exit_costs.py"), "--run-dir", str(d),
                                        "--data-path", args.data, "--device", args.device, "--batches", "1,256,1017"], 60)
    if args.sparse:
        d = copy(args.sparse, "sparse-quick")
        step("frontier-sparse", cli("sparse", "frontier", "--preset", "quick", "--run-dir", str(d),
                                    patch={"speed_samples": 100}), 90)
    # reproduce ends with the frontier (every rule's speed at batch 1 and 256, as above)
    step("reproduce-cifar", cli("classify", "reproduce", "--preset", "cifar", "--run-dir", str(work / "classify-cifar"),
                                "--data.path", args.data, patch=gpu_speed), 10_000)
    with tarfile.open(out / "results.tar.gz", "w:gz") as tar:  # the small files: no checkpoints
        for p in sorted(work.rglob("*")):
            if p.is_file() and p.suffix in (".md", ".json", ".log", ".jsonl", ".yaml", ".png"):
                tar.add(p, arcname=str(p.relative_to(work)))
    say(f"done; {max(t_end - time.monotonic(), 0):.0f} s of the budget left")
    return 0


if __name__ == "__main__":
    sys.exit(main())
