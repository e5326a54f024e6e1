"""Train a :class:`~learn2stop.core.model.StoppingModel` from data by the paper's stages (Algorithm 1).

The stages run in the order given on one :class:`~learn2stop.core.trainer.StagedTrainer`; each leaves its selected
weights loaded, which is the hand-off to the next (Stage I's theta to Stage II, which trains phi on it).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from ..core.model import StoppingModel
from ..core.objectives import MethodConfig, StageConfig
from ..core.trainer import StagedTrainer, stage_loss_fn
from ..utils.distributed import DistContext
from .data import DataTask
from .guards import check_full_depth


def default_stages(iterations: int = 300, batch_size: int = 64, lr: float = 1e-2) -> dict[str, StageConfig]:
    """Stage I (theta with the oracle) then Stage II (phi imitates it, theta frozen): the paper's default pair."""
    return {"stage1": StageConfig(objective="stage1", iterations=iterations, batch_size=batch_size, lr=lr),
            "stage2": StageConfig(objective="stage2", iterations=iterations, batch_size=batch_size, lr=lr)}


@torch.no_grad()
def step_losses(sm: StoppingModel, batches: list, loss_fn: Callable) -> list[float]:
    """The mean loss at each step 1..T over ``batches`` (one full rollout each)."""
    total, n, was_training = None, 0, sm.training
    sm.eval()
    for inputs, target in batches:
        losses = sm.unroll(inputs, target, loss_fn, use_policy=False, model_grad=False).losses  # (B, T)
        total = losses.sum(0) if total is None else total + losses.sum(0)
        n += losses.shape[0]
    sm.train(was_training)
    return (total / n).tolist()


def train(sm: StoppingModel, data: Any, loss_fn: Callable, stages: dict[str, StageConfig] | None = None, *,
          run_dir: str | Path, validation: Any = None, method: MethodConfig | None = None,
          stop_loss_fn: Callable | None = None, seed: int = 0, device: Any = None, progress: bool = False,
          resume: bool = True) -> dict[str, dict]:
    """Train ``sm`` stage by stage; returns each stage's summary (iterations, best validation score, seconds).

    Args:
        data: a sampling function ``sample(n, generator, device) -> (inputs, target)`` or batches (a DataLoader).
        loss_fn: ``(output, target) -> (B,)`` per-sample loss l(y, x_t).
        stages: name -> :class:`StageConfig`, run in order (default :func:`default_stages`). Checkpoints go to
            ``<run_dir>/checkpoints/<name>.pt``; a finished stage is skipped when run again (``resume``).
        validation: held-out batches each stage selects its weights on (needed with a loader).
        method: the method-level settings (beta, prior, price) stages inherit where they leave them unset.
        stop_loss_fn: the loss Stage II's oracle weighs, if not ``loss_fn`` (a classifier's 0/1 error).
        device: where batches go (the model must already be there).
    Parameters the user froze (``requires_grad`` False) stay frozen. After a stage that trains the model, a full
    depth worse than an earlier step on validation warns (:class:`~learn2stop.api.guards.DegenerateDepthWarning`).
    """
    if not isinstance(sm, StoppingModel):
        raise TypeError(f"sm: expected a StoppingModel(model, policy); got {type(sm).__name__}")
    stages = default_stages() if stages is None else stages
    if not isinstance(stages, dict) or not stages or not all(isinstance(c, StageConfig) for c in stages.values()):
        raise TypeError("stages: expected {name: StageConfig, ...} in the order to run them, e.g. "
                        "{'stage1': StageConfig(objective='stage1'), 'stage2': StageConfig(objective='stage2')}")
    task = DataTask(data, loss_fn, validation, stop_loss_fn, seed)
    ctx = DistContext(device=torch.device(device)) if device is not None else None
    trainer = StagedTrainer(sm, task, run_dir, seed=seed, ctx=ctx, progress=progress, resume=resume)
    summaries = {}
    for name, cfg in stages.items():
        cfg = cfg.inherit(method) if not cfg.resolved else cfg
        summaries[name] = trainer.fit(name, cfg)
        if cfg.trains in ("model", "both") and sm.num_steps > 1:
            check_full_depth(step_losses(sm, task.validation_batches(trainer.ctx.device), stage_loss_fn(task, cfg)),
                             lambda a, b: a <= b, f"after stage {name!r}, the validation loss")
    return summaries
