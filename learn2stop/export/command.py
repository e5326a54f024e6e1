"""``learn2stop <task> export``: a trained run's stop model and deployed rule as an export folder."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..runtime.manifest import read_manifest
from ..utils.config import ConfigError
from ..utils.outputs import previous_path
from .folder import check_out_dir
from .graphs import export_stop_model


def export_command(app: Any, cfg: Any, run: Any, *, out: str | None, task: str = "custom") -> dict:
    """``learn2stop <task> export --run-dir R --out DIR``: the run's stop model and deployed rule as ONNX."""
    from ..core.deployment import load_deployment
    from ..core.task import require_trained

    if app.export_unsupported:
        raise ConfigError(f"export: {app.export_unsupported}")
    check_out_dir(out, "--out", run.run_dir)
    replacing = Path(out).is_dir() and any(Path(out).iterdir())
    require_trained(run.run_dir, app.stop_stage, "export")
    deployment = load_deployment(app, cfg, run.run_dir, stage=app.stop_stage, device="cpu")
    sm = deployment.model
    rule = deployment.calibration if deployment.calibration is not None else app.inference(cfg)
    inputs = app.eval_batches(cfg, "test", "cpu")[0][0]
    example = torch.utils._pytree.tree_map(lambda x: x[:2] if isinstance(x, Tensor) else x, inputs)
    path = export_stop_model(sm, rule, example, out, task=task, dynamic_dims=app.export_dynamic_dims,
                             extra={"run_dir": str(Path(run.run_dir).resolve()), "stage": app.stop_stage})
    manifest = read_manifest(path, verify=False)
    r = manifest["rule"]
    run.log(f"exported stage {app.stop_stage!r} of {run.run_dir} to {path}: {manifest['last_step']} step graphs, "
            f"rule {r['name']} (param {r['param']}, from {r['source']})"
            + (f"; the earlier export is kept in {previous_path(path)}" if replacing else ""))
    if deployment.reason:
        run.log(f"note: the run deploys {app.baseline_label} at full depth, not this stop model: {deployment.reason}")
    return manifest
