"""The checks that need a GPU, as one script for a short lease: early exit's speed at batch 256, and the presets the
CPU cannot afford.

    python benchmarks/device_check.py --out OUT --data DATA --vgg RUN --resnet RUN --sparse RUN --omniglot DIR --seconds 480
    python benchmarks/device_check.py --unpack FILES_AT --into runs/    # back here: the runs trained there

Each step runs as its own process with its own time limit, so a failing step costs only itself:

1. the test suite's CUDA cases (``pytest -m gpu``);
2. ``classify frontier --device cuda`` on trained quick runs (VGG and ResNet-20): every rule's accuracy and samples/s
   at batch 1 and 256 (all test images in batches of 256, best of 5 passes), with the speed at the network's accuracy;
3. ``benchmarks/exit_costs.py --device cuda``: each exit's share of time against its share of FLOPs;
4. ``sparse frontier --device cuda`` on a trained quick run (batch 1 and 1000);
5. ``classify reproduce --preset cifar --device cuda`` (VGG16-BN, a few CPU-hours; minutes on a GPU), in what time is
   left;
6. with ``--omniglot``, ``maml reproduce --preset omniglot5-1shot-cpu`` at the paper's order (second order) and
   Finn et al.'s meta-batch 32: Table 5's 5-way 1-shot as the CPU preset cannot afford it (its baseline and stop
   model come back packed as below);
7. ``sparse reproduce --preset paper-cpu --device cuda`` (the paper's problem: about 3 CPU-hours on 2 cores, minutes
   on a GPU), in what time is left. Its stop model and LISTA baseline come back to
   be timed where they are deployed: their finished checkpoints, without optimizer state, as ``OUT/<run>.ckpt.partN``
   (15 MiB parts: a lease returns at most 8 files of 16 MiB). ``--unpack`` rebuilds the run from them and
   ``results.tar.gz``, ready for ``learn2stop sparse frontier --preset paper-cpu --run-dir <into>/sparse-paper-cpu``.

``--skip`` leaves steps out by name or prefix (``--skip pytest,frontier,exit-costs,reproduce-sparse`` runs only the
cifar preset, ``--skip pytest,frontier,exit-costs,reproduce-cifar`` only the sparse one).

Run folders are copied into ``--work`` before use (a frontier writes into its run). ``OUT`` gets ``log.txt`` and
``results.tar.gz`` (each step's frontier.md / .json, tables, plots and logs; no checkpoints).
"""
from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from learn2stop.utils.checkpoint import load_checkpoint  # noqa: E402

#: the largest file a lease returns is 16 MiB
PART_BYTES = 15 * 2**20


def pack_checkpoints(run: Path, stages: list[str], dest: Path, part_bytes: int = PART_BYTES) -> list[Path]:
    """The finished ``stages`` of ``run`` as one tar without optimizer state, in parts of at most ``part_bytes``
    named ``<dest>.partN``. An unfinished or missing stage is left out (said in the returned names' absence)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for stage in stages:
            path = run / "checkpoints" / f"{stage}.pt"
            if not path.is_file() or not (ck := load_checkpoint(path)).get("completed"):
                continue
            ck.pop("optimizer", None)  # the weights are what a frontier needs; a resume here would retrain anyway
            data = io.BytesIO()
            torch.save(ck, data)
            info = tarfile.TarInfo(f"checkpoints/{stage}.pt")
            info.size = data.getbuffer().nbytes
            data.seek(0)
            tar.addfile(info, data)
    blob = buf.getvalue()
    parts = []
    for i, start in enumerate(range(0, len(blob), part_bytes)):
        parts.append(dest.with_name(f"{dest.name}.part{i}"))
        parts[-1].write_bytes(blob[start:start + part_bytes])
    return parts


def unpack(files_at: Path, into: Path) -> list[Path]:
    """Rebuild the runs of a device check under ``into``: the small files from ``results.tar.gz``, the packed
    checkpoints from ``<run>.ckpt.partN``. Returns the run folders that got checkpoints."""
    into.mkdir(parents=True, exist_ok=True)
    archive = files_at / "results.tar.gz"
    if archive.is_file():
        with tarfile.open(archive) as tar:
            tar.extractall(into, filter="data")
    runs = []
    for first in sorted(files_at.glob("*.ckpt.part0")):
        name = first.name[: -len(".ckpt.part0")]
        parts = sorted(files_at.glob(f"{name}.ckpt.part*"), key=lambda p: int(p.name.rsplit("part", 1)[1]))
        with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts))) as tar:
            tar.extractall(into / name, filter="data")
        runs.append(into / name)
    return runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="folder for log.txt and results.tar.gz")
    ap.add_argument("--data", help="the CIFAR-10 subset's folder")
    ap.add_argument("--vgg", default="", help="a finished classify quick run (VGG)")
    ap.add_argument("--resnet", default="", help="a finished classify quick run with --model.arch resnet20")
    ap.add_argument("--sparse", default="", help="a finished sparse quick run")
    ap.add_argument("--omniglot", default="", help="the Omniglot folder (background.npz, evaluation.npz, maml_split.txt)")
    ap.add_argument("--seconds", type=float, default=480.0, help="the whole script's time")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--work", default="/tmp/learn2stop-device-check", help="scratch folder for the runs")
    ap.add_argument("--skip", default="", help="comma-separated step names or prefixes to leave out (e.g. pytest,frontier)")
    ap.add_argument("--unpack", metavar="FILES_AT", help="rebuild the runs a device check brought back (with --into)")
    ap.add_argument("--into", default="runs", help="where --unpack puts the runs")
    args = ap.parse_args(argv)
    if args.unpack:
        for run in unpack(Path(args.unpack), Path(args.into)):
            print(f"{run}: {', '.join(sorted(p.name for p in (run / 'checkpoints').iterdir()))}")
        return 0
    if not (args.out and args.data):
        ap.error("--out and --data are required (unless --unpack)")
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
    if args.omniglot:
        maml = work / "maml-omniglot5-1shot-gpu"
        second_order = ["--model.first_order", "false", "--maml.batch_size", "32", "--stage1.batch_size", "32"]
        if step("reproduce-maml-omniglot5", cli("maml", "reproduce", "--preset", "omniglot5-1shot-cpu", "--run-dir",
                                                str(maml), "--data.path", args.omniglot, *second_order), 600) \
                or (maml / "checkpoints").is_dir():
            parts = pack_checkpoints(maml, ["baseline", "stage2"], out / "maml-omniglot5-1shot-gpu.ckpt")
            say(f"packed the finished baseline and stage2 of {maml.name} in {len(parts)} parts")
    # reproduce ends with the frontier (every rule's speed at batch 1 and 256, as above)
    step("reproduce-cifar", cli("classify", "reproduce", "--preset", "cifar", "--run-dir", str(work / "classify-cifar"),
                                "--data.path", args.data, patch=gpu_speed), 10_000)
    sparse_paper = work / "sparse-paper-cpu"
    if step("reproduce-sparse-paper", cli("sparse", "reproduce", "--preset", "paper-cpu", "--run-dir", str(sparse_paper)),
            10_000) or (sparse_paper / "checkpoints").is_dir():
        parts = pack_checkpoints(sparse_paper, ["baseline", "stage2"], out / "sparse-paper-cpu.ckpt")
        say(f"packed the finished baseline and stage2 of {sparse_paper.name} in {len(parts)} parts")
    with tarfile.open(out / "results.tar.gz", "w:gz") as tar:  # the small files: no checkpoints
        for p in sorted(work.rglob("*")):
            if p.is_file() and p.suffix in (".md", ".json", ".log", ".jsonl", ".yaml", ".png"):
                tar.add(p, arcname=str(p.relative_to(work)))
    say(f"done; {max(t_end - time.monotonic(), 0):.0f} s of the budget left")
    return 0


if __name__ == "__main__":
    sys.exit(main())
