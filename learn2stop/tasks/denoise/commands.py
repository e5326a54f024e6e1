"""DnCNN-stop's own commands: evaluate (Table 6, the crops figure) and denoise (image files in, denoised PNGs and
depths out), bound to the task's app in :mod:`.app`."""
from __future__ import annotations

import time
import warnings
from pathlib import Path

import torch

from ...core import FixedDepth, derive_seed, run_with_early_exit
from ...core.deployment import load_deployment
from ...core.evaluate import evaluate_deployed
from ...core.task import StoppingApp, check_config
from ...core.trace import evaluate_rule
from ...core.train import load_stage
from ...utils.config import ConfigError
from ...utils.outputs import check_output_file, json_output, writing
from ...utils.report import write_json
from ..base import RunContext, as_run
from .config import DenoiseAppConfig
from .data import add_noise
from .images import ImageDataError, list_images, load_image, save_image
from .metric import psnr
from .models import DeepSupervisedDnCNN
from .report import bm3d_scores, comparison_examples, comparison_figure, ms_per_image, summarise, table6


def evaluate(app: StoppingApp, cfg: DenoiseAppConfig, run: RunContext | str | Path) -> dict:
    """PSNR per image and sigma of DnCNN, DnCNN-stop (real early exit, deployed rule) and BM3D: Table 6, for ``app``
    (the task's :data:`.app.APP`)."""
    check_config(cfg)
    run = as_run(run)
    dev, metric, items = run.device, app.metric(cfg), app.eval_set(cfg, "test")
    batches = app.eval_batches(cfg, "test", dev)
    ev = evaluate_deployed(app, cfg, run, generator=torch.Generator().manual_seed(cfg.seed), trace=True)
    sm, rule, desc = ev.deployment.model, ev.rule, ev.desc
    models = {"DnCNN": (load_stage(app, cfg, run.run_dir, "baseline", dev).model, FixedDepth),
              "DnCNN-stop": (sm.model, lambda: rule)}
    results = {"DnCNN": evaluate_rule(models["DnCNN"][0], batches, FixedDepth, metric, dev, runner=run.runner),
               "DnCNN-stop": ev.result}
    if cfg.stage3.iterations > 0:
        s3 = evaluate_deployed(app, cfg, run, "stage3")
        models["DnCNN-stop (III)"] = (s3.deployment.model.model, lambda: s3.rule)
        results["DnCNN-stop (III)"] = s3.result
    trace = ev.trace  # every exit of every image: the last and the best
    timed = {**models, "DnCNN-stop full depth": (sm.model, FixedDepth)}
    timed_images = [x for x, _ in batches][:app.speed_samples]  # the samples the in-time tables time
    timing = {b: ms_per_image(timed, timed_images, b, cfg.eval.timing_rounds) for b in (1, app.speed_batch)}
    bm3d, note = bm3d_scores(items, cfg.eval.bm3d, cfg.eval.bm3d_max_images, run.log)
    net: DeepSupervisedDnCNN = sm.model
    per_image = []
    for i, s in enumerate(items):
        t = int(results["DnCNN-stop"]["stop_times"][i])
        row = {"image": s.name, "sigma": s.sigma, "psnr_noisy": float(psnr(s.noisy, s.clean)),
               **{f"psnr {k}": float(r["values"][i]) for k, r in results.items()},
               "stop_output": t, "stop_layers": net.layers_at(t), "stop_cost": float(trace.costs[t - 1]),
               "psnr_stop_last": float(trace.metric[i, -1]), "psnr_stop_oracle": float(trace.metric[i].max()),
               **bm3d.get(i, {})}
        per_image.append(row)
    summary = summarise(per_image, cfg.eval.sigmas)
    table = table6(summary, net.depth, note, timing, paper=bool(cfg.data.test_dir), timed=len(timed_images))
    out = {"rule": desc, "summary": summary, "ms_per_image": timing, "per_image": per_image, "bm3d": note, "table6": table}
    if run.ctx.is_main:
        write_json({k: v for k, v in out.items() if k != "table6"}, run.run_dir / "results.json")
        (run.run_dir / "table6.md").write_text(table + "\n")
        examples = comparison_examples(items, cfg.eval.figure_sigmas, models, with_bm3d=bool(bm3d))
        if examples:
            comparison_figure(examples, cfg.eval.crop, run.run_dir / "denoise_crops.png")
        run.log(f"\nDnCNN-stop stops with the {desc}\n\nTable 6: PSNR (dB) on the test images\n" + table)
    return out


def denoise_files(app: StoppingApp, cfg: DenoiseAppConfig, run: RunContext | str | Path) -> dict:
    """Denoise an image file or every image of a folder with the deployed rule of ``app`` (the task's
    :data:`.app.APP`); write PNGs and depths."""
    run = as_run(run)
    c = cfg.denoise
    if not c.input:
        raise ConfigError("denoise.input: give an image file or folder (--denoise.input PATH)")
    src = Path(c.input)
    if not src.exists():
        raise ImageDataError(f"input not found: {src}")
    files = list_images(src) if src.is_dir() else [src]
    out_dir = Path(c.output) if c.output else run.run_dir / "denoised"
    _check_outputs(files, out_dir, c.add_sigma > 0, run.run_dir)  # before any work: no input or run record overwritten
    if c.model == "stop":  # what the run deploys: DnCNN-stop and its rule, or its baseline where the run deploys that
        dep = load_deployment(app, cfg, run.run_dir, device=run.device)
        sm, rule, desc = dep.model, dep.online, dep.description
    else:
        sm, rule, desc = load_stage(app, cfg, run.run_dir, "baseline", run.device), FixedDepth(), "full depth"
    run.log(f"denoise: {c.model} model, {desc}")
    net, records, images = sm.model, [], []
    for path in files:  # every input read and checked before any output is written
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            images.append(load_image(path))
        for w in caught:
            run.log(f"  note: {w.message}")
    for k, (path, img) in enumerate(zip(files, images)):
        x = torch.from_numpy(img)[None, None]
        if c.add_sigma > 0:
            x = add_noise(x, c.add_sigma, torch.Generator().manual_seed(derive_seed(cfg.seed, "denoise", k)))
            with writing("denoise.output", out_dir / f"{path.stem}_noisy.png"):
                save_image(x[0, 0], out_dir / f"{path.stem}_noisy.png")
        t0 = time.perf_counter()
        with torch.no_grad():
            r = run_with_early_exit(net, x.to(run.device), rule)
        sec, t = time.perf_counter() - t0, int(r.stop_times[0])
        dst = out_dir / f"{path.stem}_denoised.png"
        with writing("denoise.output", dst):
            save_image(r.outputs[0, 0].clamp(0, 1), dst)
        records.append({"input": str(path), "output": str(dst), "model": c.model, "stop_output": t,
                        "layers": net.layers_at(t), "of_layers": net.depth, "seconds": round(sec, 4)})
        run.log(f"  {path.name} -> {dst}  ({net.layers_at(t)} of {net.depth} layers, {sec * 1000:.0f} ms)")
    if run.ctx.is_main:
        with writing("denoise.output", out_dir / "depths.json"):
            write_json(records, out_dir / "depths.json")
    return {"images": records}


def _check_outputs(files: list[Path], out_dir: Path, noisy: bool, run_dir: Path) -> None:
    """Every file the denoise command writes into ``out_dir``, checked before any work: none is an input (two
    inputs with one stem would also write one file), a run record, or, for ``depths.json``, anything but an
    earlier one (:mod:`learn2stop.utils.outputs`)."""
    writes: dict[Path, Path] = {}
    for f in files:
        for name in (f"{f.stem}_denoised.png", *([f"{f.stem}_noisy.png"] if noisy else [])):
            dst = check_output_file(out_dir / name, "denoise.output", inputs=files, run_dirs=[run_dir])
            if dst in writes:
                raise ConfigError(f"denoise.input: {writes[dst]} and {f} would both be written to {dst}; "
                                  "rename one of them")
            writes[dst] = f
    check_output_file(out_dir / "depths.json", "denoise.output", inputs=files, run_dirs=[run_dir],
                      ours=json_output("input", "output", "stop_output", rows=True))
