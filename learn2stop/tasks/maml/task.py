"""The meta-learning training task for the core trainer, and the 600-task evaluation."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ...core.loop import FixedDepth, PolicyRule, StoppingModel, run_with_early_exit, tree_map, unroll
from .models import MAMLModel, confidence_interval


def to_device(tree: Any, device) -> Any:
    return tree_map(lambda x: x.to(device), tree)


class MetaLearningTask:
    """Training task for :class:`~learn2stop.core.trainer.StagedTrainer`: meta-batches of tasks.

    Args:
        model: the :class:`MAMLModel` whose ``task_loss`` is the per-task query loss.
        sampler: a task sampler (``samplers.py``); ``train_data`` / ``val_data``: the datasets it draws from.
        val_tasks: number of fixed validation tasks; ``val_seed`` fixes them; ``chunk``: tasks per forward.
    """

    def __init__(self, model: MAMLModel, sampler, train_data, val_data, val_tasks: int = 100, val_seed: int = 0,
                 chunk: int = 20):
        self.model, self.sampler, self.train_data = model, sampler, train_data
        g = torch.Generator().manual_seed(val_seed)
        self._val = fixed_batches(sampler, val_data, val_tasks, g, chunk)

    def loss_fn(self, output: dict, target: Tensor) -> Tensor:
        return self.model.task_loss(output, target)

    def sample_batch(self, batch_size: int, generator: torch.Generator, device) -> tuple[dict, Tensor]:
        inputs, target = self.sampler.batch(self.train_data, batch_size, generator)
        return to_device(inputs, device), to_device(target, device)

    def validation_batches(self, device):
        return [(to_device(i, device), to_device(t, device)) for i, t in self._val]


def fixed_batches(sampler, data, num_tasks: int, generator: torch.Generator, chunk: int) -> list[tuple[dict, Tensor]]:
    """``num_tasks`` tasks drawn once with ``generator``, in meta-batches of at most ``chunk``."""
    out, left = [], num_tasks
    while left > 0:
        n = min(chunk, left)
        out.append(sampler.batch(data, n, generator))
        left -= n
    return out


@torch.no_grad()
def per_step_metrics(model: MAMLModel, batches, device) -> dict[str, Tensor]:
    """Every step's query metric and loss on fixed tasks (all T steps computed): (n_tasks, T) each."""
    metric, loss, shots = [], [], []
    for inputs, target in batches:
        inputs, target = to_device(inputs, device), to_device(target, device)
        r = unroll(model, inputs, keep_outputs=True)
        metric.append(torch.stack([model.task_metric(o, target) for o in r.step_outputs], dim=1).cpu())
        loss.append(torch.stack([model.task_loss(o, target) for o in r.step_outputs], dim=1).cpu())
        shots.append(inputs["shots"].cpu())
    return {"metric": torch.cat(metric), "loss": torch.cat(loss), "shots": torch.cat(shots)}


@torch.no_grad()
def early_exit_metrics(sm: StoppingModel, batches, device, threshold: float = 0.5, mode: str = "threshold",
                       seed: int = 0) -> dict[str, Tensor]:
    """The policy's early exit on fixed tasks: a stopped task gets no further inner updates.

    ``mode``: stop when pi_t > ``threshold``, or (``"sample"``) with probability pi_t drawn from a
    generator seeded with ``seed``. Without a policy every task runs all T steps (plain MAML)."""
    metric, stops, shots, steps = [], [], [], 0
    gen = torch.Generator().manual_seed(seed)
    for inputs, target in batches:
        inputs, target = to_device(inputs, device), to_device(target, device)
        rule = FixedDepth() if sm.policy is None else PolicyRule(sm.policy, mode, threshold, generator=gen)
        r = run_with_early_exit(sm.model, inputs, rule)
        metric.append(sm.model.task_metric(r.outputs, target).cpu())
        stops.append(r.stop_times.cpu())
        shots.append(inputs["shots"].cpu())
        steps += r.steps_computed
    return {"metric": torch.cat(metric), "stop_times": torch.cat(stops), "shots": torch.cat(shots),
            "steps_computed": steps}


def summarize(values: Tensor, scale: float = 1.0) -> dict[str, float]:
    mean, half = confidence_interval(values * scale)
    return {"mean": mean, "ci95": half}


def stop_steps_by_shot(shots: Tensor, stop_times: Tensor) -> dict[int, dict[str, float]]:
    """Mean stop step (and count) per shot count K."""
    out = {}
    for k in sorted(set(shots.tolist())):
        s = stop_times[shots == k].float()
        out[int(k)] = {"tasks": int(s.numel()), "mean_stop": float(s.mean()),
                       "hist": torch.bincount(stop_times[shots == k], minlength=int(stop_times.max()) + 1)[1:].tolist()}
    return out
