"""DnCNN-stop on the core pipeline: the :class:`StoppingApp` and the train / evaluate / reproduce / denoise commands.

    learn2stop denoise reproduce --preset quick --threads 1      # ~12 min on one CPU core, no data needed
    learn2stop denoise frontier  --run-dir runs/denoise-quick --threads 1
    learn2stop denoise calibrate --run-dir runs/denoise-quick --epsilon 0.1 --delta 0.1 --threads 1
    learn2stop denoise denoise   --run-dir runs/denoise-quick --denoise.input noisy.png

The core runs the stages, calibration and the frontier (:mod:`learn2stop.core.train`, :mod:`~learn2stop.core.deploy`, :mod:`~learn2stop.core.frontier`); the config,
presets and data are in :mod:`.task`, the report in :mod:`.metrics`. Python API (the CLI calls these)::

    from learn2stop.tasks.denoise import preset, reproduce
    results = reproduce(preset("quick"), "runs/denoise-quick")
"""
from __future__ import annotations

import time
import warnings
from pathlib import Path

import torch

from ...core import FixedDepth, Metric, StoppingModel, derive_seed, run_with_early_exit
from ...utils.seeding import drawing_from
from ...core.trace import collect_trace, evaluate_rule
from ...core.task import Stage, StoppingApp, check_config
from ...core.deploy import deployed_model, deployed_rule
from ...core.train import load_stage, min_step_hook
from ...core.signals import ToleranceSignal
from ...utils.config import ConfigError, to_dict
from ...utils.outputs import check_output_file, json_output, writing
from ...utils.report import write_json
from ..base import RunContext, TaskSpec, as_run, register_task, reproduce_pipeline, train_pipeline
from .data import ImageDataError, add_noise, list_images, load_image, save_image
from .metrics import bm3d_scores, comparison_examples, comparison_figure, ms_per_image, psnr, summarise, table6
from .models import DeepSupervisedDnCNN
from .policy import DenoisePolicy
from .task import PRESETS, DenoiseAppConfig, DenoiseTask, NoisyImage, eval_samples, load_training_images
from .task import DataConfig, DenoiseCommandConfig, EvalConfig, ModelConfig  # noqa: F401  (the config's parts, re-exported)

# ----------------------------------------------------------------------------- the app


class DenoiseApp(StoppingApp):
    """DnCNN-stop: DnCNN baseline, exits warmed up on its frozen backbone, Stage I, II, optional III."""

    stop_stage = "stage2"
    baseline_stage = "heads"  # the frontier's baseline: DnCNN with exits on its frozen backbone
    baseline_label = "DnCNN (its exits warmed up on the frozen backbone)"
    budget_by = "cost"  # budgets in multiply-accumulates (the model's exit_costs), not in exits
    speed_batch = 8  # 8 test images at once (larger CPU batches of 128x128 images thrash the allocator)
    export_dynamic_dims = {"inputs": [2, 3]}  # export: images of any height and width
    speed_samples = 24  # the first 24 test samples (image-major: every sigma of the first images)

    def task(self, cfg: DenoiseAppConfig) -> DenoiseTask:
        d = cfg.data

        def make():
            train_imgs, val_imgs = load_training_images(cfg)
            return DenoiseTask(train_imgs, val_imgs, patch_size=d.patch_size, stride=d.stride, scales=d.scales,
                               sigma_max=d.sigma_max, sigma_set=d.sigma_set, val_patches=d.val_patches, seed=cfg.seed)
        return self.cached(f"task {to_dict(d)} {cfg.seed}", make)

    def eval_set(self, cfg: DenoiseAppConfig, split: str) -> list[NoisyImage]:
        """The evaluation samples of a split (see :func:`.task.eval_samples`), cached."""
        return self.cached(f"{split} {to_dict(cfg.data)} {to_dict(cfg.eval)} {cfg.seed}", lambda: eval_samples(cfg, split))

    def build_models(self, cfg: DenoiseAppConfig, device) -> dict[str, StoppingModel]:
        m = cfg.model
        with drawing_from(torch.Generator().manual_seed(derive_seed(cfg.seed, "init"))):  # not the caller's RNG
            net = lambda positions, **kw: DeepSupervisedDnCNN(m.depth, m.channels, positions, head_kernel=m.head_kernel, **kw)
            policy = DenoisePolicy(len(m.positions) + 1, m.policy_hidden)
            models = {"baseline": StoppingModel(net(())),
                      "heads": StoppingModel(net(m.positions, frozen_backbone=True)),
                      "stop": StoppingModel(net(m.positions, policy_macs=policy.macs_per_pixel()), policy)}
        return {k: v.to(device) for k, v in models.items()}

    def training_task(self, cfg, key, sm):
        return self.task(cfg)

    def stages(self, cfg: DenoiseAppConfig) -> list[Stage]:
        def copy_backbone(key):
            def hook(models, app, cfg, run):
                models[key].model.load_backbone(models["baseline"].model)
            return hook

        min_step = min_step_hook(lambda c: c.model.policy_min_mass, cap=True)

        heads = cfg.heads.iterations > 0
        stages = [Stage("baseline", "baseline", cfg.baseline, describe="DnCNN, last-layer loss"),
                  Stage("heads", "heads", cfg.heads, before=copy_backbone("heads"),
                        describe="exits on the frozen DnCNN, uniform deep supervision"),
                  Stage("stage1", "stop", cfg.stage1, init_from="heads" if heads else None,
                        before=None if heads else copy_backbone("stop"), describe="DnCNN-stop Stage I (price on MACs)"),
                  Stage("stage2", "stop", cfg.stage2, before=min_step, describe="DnCNN-stop Stage II (policy)")]
        if cfg.stage3.iterations > 0:
            stages.append(Stage("stage3", "stop", cfg.stage3, describe="Stage III (beta-VAE fine-tuning of both)"))
        return stages

    def eval_batches(self, cfg: DenoiseAppConfig, split: str, device):
        """One image per batch: test images may differ in size."""
        return [(s.noisy.to(device), s.clean.to(device)) for s in self.eval_set(cfg, split)]

    def metric(self, cfg) -> Metric:
        return Metric("PSNR (dB)", psnr, lower_is_better=False)

    def classical_signals(self, cfg):
        return {"tolerance": ToleranceSignal}

    def cost_unit(self, cfg, sm):
        return "macs_per_pixel", float(sm.model.exit_costs[-1])


APP = DenoiseApp()



# ----------------------------------------------------------------------------- commands
def train(cfg: DenoiseAppConfig, run: RunContext | str | Path) -> dict:
    """DnCNN baseline, exits warm-up, Stage I and Stage II (and optional Stage III) for DnCNN-stop; resumable."""
    check_config(cfg)  # a dict or a class: one clear TypeError, not an AttributeError in the data
    return train_pipeline(APP, cfg, run, f"denoise: {len(APP.task(cfg).bank)} distinct {cfg.data.patch_size}x"
                          f"{cfg.data.patch_size} training patches (x8 symmetries); "
                          f"{len(APP.eval_set(cfg, 'val')) // len(cfg.eval.sigmas)} validation images")


def evaluate(cfg: DenoiseAppConfig, run: RunContext | str | Path) -> dict:
    """PSNR per image and sigma of DnCNN, DnCNN-stop (real early exit, deployed rule) and BM3D: Table 6."""
    check_config(cfg)
    run = as_run(run)
    dev, metric, items = run.device, APP.metric(cfg), APP.eval_set(cfg, "test")
    batches = APP.eval_batches(cfg, "test", dev)
    sm = load_stage(APP, cfg, run.run_dir, APP.stop_stage, dev)
    rule, desc = deployed_rule(APP, cfg, run.run_dir, sm, generator=torch.Generator().manual_seed(cfg.seed))
    models = {"DnCNN": (load_stage(APP, cfg, run.run_dir, "baseline", dev).model, FixedDepth),
              "DnCNN-stop": (sm.model, lambda: rule)}
    if cfg.stage3.iterations > 0:
        s3 = load_stage(APP, cfg, run.run_dir, "stage3", dev)
        models["DnCNN-stop (III)"] = (s3.model, lambda: deployed_rule(APP, cfg, None, s3)[0])
    results = {name: evaluate_rule(model, batches, factory, metric, dev, runner=run.runner) for name, (model, factory) in models.items()}
    trace = collect_trace(sm.model, batches, metric, dev)  # every exit of every image: the last and the best
    timed = {**models, "DnCNN-stop full depth": (sm.model, FixedDepth)}
    timing = {b: ms_per_image(timed, [x for x, _ in batches], b, cfg.eval.timing_rounds) for b in (1, APP.speed_batch)}
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
    table = table6(summary, net.depth, note, timing, paper=bool(cfg.data.test_dir))
    out = {"rule": desc, "summary": summary, "ms_per_image": timing, "per_image": per_image, "bm3d": note, "table6": table}
    if run.ctx.is_main:
        write_json({k: v for k, v in out.items() if k != "table6"}, run.run_dir / "results.json")
        (run.run_dir / "table6.md").write_text(table + "\n")
        examples = comparison_examples(items, cfg.eval.figure_sigmas, models, with_bm3d=bool(bm3d))
        if examples:
            comparison_figure(examples, cfg.eval.crop, run.run_dir / "denoise_crops.png")
        run.log(f"\nDnCNN-stop stops with the {desc}\n\nTable 6: PSNR (dB) on the test images\n" + table)
    return out


def reproduce(cfg: DenoiseAppConfig, run: RunContext | str | Path) -> dict:
    """Train everything (resuming what exists), deploy the calibrated default, then evaluate (Table 6, the figure)."""
    return reproduce_pipeline(APP, cfg, run, train, evaluate)


def denoise_files(cfg: DenoiseAppConfig, run: RunContext | str | Path) -> dict:
    """Denoise an image file or every image of a folder with the deployed rule; write PNGs and depths."""
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
        sm, rule, desc = deployed_model(APP, cfg, run.run_dir, run.device)
    else:
        sm, rule, desc = load_stage(APP, cfg, run.run_dir, "baseline", run.device), FixedDepth(), "full depth"
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


COMMANDS = {"train": train, "evaluate": evaluate, "reproduce": reproduce, "denoise": denoise_files}

SPEC = register_task(TaskSpec(
    name="denoise",
    description="DnCNN-stop: blind Gaussian denoising, the policy picks the depth per image (Sec. 5.3)",
    config_class=DenoiseAppConfig,
    presets=PRESETS,
    commands=COMMANDS,
    app=APP,
))
