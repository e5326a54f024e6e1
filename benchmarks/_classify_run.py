"""What the classify timing scripts (exit_costs.py, loop_modes.py) time: a trained run's stop model, or the quick
preset's network with random weights (the time is the same), and the test images."""
from __future__ import annotations

from pathlib import Path

from learn2stop.core.train import load_stage
from learn2stop.tasks.classify import APP, PRESETS, ClassifyConfig
from learn2stop.utils.config import merge
from learn2stop.utils.config_files import resolve

TINY = {"data": {"kind": "synthetic", "size": 16, "synthetic_per_class": 8, "synthetic_classes": 3},
        "model": {"arch": "vgg6-narrow", "fc_width": 16}}


def stop_model(run_dir: str = "", arch: str = "", data_path: str = "", device: str = "cpu", tiny: bool = False):
    """(config, stop model in eval mode, test images on ``device``): from ``run_dir`` when given, else the quick
    preset (``arch`` for ``--model.arch``; ``tiny``: generated images and a tiny VGG)."""
    overrides = {"data": {"path": data_path}} if data_path else {}
    if run_dir:
        cfg = resolve(ClassifyConfig, {}, str(Path(run_dir) / "config.yaml"), overrides)
        sm = load_stage(APP, cfg, run_dir, APP.stop_stage, device)
    else:
        if arch:
            overrides = merge(overrides, {"model": {"arch": arch}})
        cfg = resolve(ClassifyConfig, merge(PRESETS["quick"], TINY) if tiny else PRESETS["quick"], None, overrides)
        sm = APP.build_models(cfg, device)["stop"].eval()
    return cfg, sm, APP.speed_inputs(cfg, device)
