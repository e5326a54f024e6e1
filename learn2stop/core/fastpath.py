"""Small batches at inference on a CPU: a policy's decision in numpy.

At batch 1 a policy of a few small layers is dozens of torch operations, and each pays its dispatch (a few
microseconds), so the decision can cost more than the step it is meant to save. Numpy's calls on such small
arrays cost a fraction of that. A policy keeps numpy copies of its weights here, made again whenever a tensor
they were copied from changes (its version counter, bumped by every in-place update and load, or its storage), and runs
its numpy form only where :func:`numpy_eligible` says so; elsewhere its torch form runs.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import Tensor, nn

#: the largest batch a policy decides in numpy; larger batches amortise torch's dispatch over their rows.
NUMPY_MAX_BATCH = 16
_enabled = True


@contextmanager
def torch_only() -> Iterator[None]:
    """Within it every policy decides in torch, at any batch (to compare the two forms, or to debug one)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


#: activations in numpy, by the name of their torch module's function (``h`` may be overwritten)
NUMPY_ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "relu": lambda h: np.maximum(h, 0, out=h), "elu": lambda h: np.where(h > 0, h, np.expm1(h))}


def numpy_eligible(module: nn.Module, *tensors: Tensor) -> bool:
    """Whether ``module`` may decide on ``tensors`` (batch-first, the first one's rows the batch) in numpy: at
    inference (eval mode, no gradients), on a CPU, in float32, at most :data:`NUMPY_MAX_BATCH` rows, and not while
    torch records a graph (ONNX export, ``torch.jit.trace``, ``torch.compile``, ``torch.export``), which would keep the numpy result
    as a constant."""
    if not _enabled or _tracing() or module.training or torch.is_grad_enabled() \
            or tensors[0].shape[0] > NUMPY_MAX_BATCH:  # (tracing first: it records the shape's comparison)
        return False
    for x in tensors:
        if x.dtype != torch.float32 or x.device.type != "cpu":
            return False
    return True


class NumpyCopies:
    """Numpy copies of a module's weights, by name, each made again when a tensor it was made from changes.

    ``get(name, sources, build)``: ``sources()`` lists the tensors a copy reads and ``build()`` makes it; they are
    called only when there is no copy yet or one of the listed tensors has changed since. None where the tensors
    keep no version (made under ``torch.inference_mode``): there is nothing to check a copy against, so the
    caller runs its torch form.
    """

    def __init__(self):
        self._made: dict[str, tuple[list[Tensor], tuple[int, ...], Any]] = {}

    def get(self, name: str, sources: Callable[[], list[Tensor]], build: Callable[[], Any]) -> Any:
        entry = self._made.get(name)
        try:
            if entry is None or entry[1] != _stamps(entry[0]):
                tensors = sources()
                entry = self._made[name] = (tensors, _stamps(tensors), build())
        except RuntimeError:
            return None
        return entry[2]

    def clear(self) -> None:
        """Forget every copy (a module whose layers were replaced by new ones must call it)."""
        self._made.clear()


@torch.no_grad()
def flush_denormals_(module: nn.Module) -> int:
    """Set every subnormal value of ``module``'s floating-point parameters and buffers to zero, in place; returns
    how many there were.

    Training leaves them in little-used weights (a policy's dead ReLU units under weight decay: 132 of the 4,096
    weights of a sparse planner's hidden layer in a ``paper-cpu`` run). A product with a subnormal operand takes a
    slow path on x86 CPUs, so such a (1000, 64) x (64, 64) layer ran 1.26 ms instead of 0.08 (2 threads; 2.47
    against 0.13 on one), and the plan that should cost a fifth of a LISTA step cost 0.7 of one.
    ``torch.set_flush_denormal`` is no fix: it sets the calling thread alone, not the threads of an intra-op
    pool. A subnormal weight (below 1.2e-38 in float32) times an activation of ordinary size adds nothing a
    float32 sum of such activations can hold, so the outputs stay as they were (checked bit for bit: the sparse quick
    and ``paper-cpu`` planners' plans and stop times, and README command 1's results); the trainer flushes each
    finished stage, and :func:`load_finished_stage
    <learn2stop.core.stage_checkpoints.load_finished_stage>` the checkpoints written before it did.
    """
    count = 0
    for t in (*module.parameters(), *module.buffers()):
        if t.is_floating_point():
            small = (t.abs() < torch.finfo(t.dtype).tiny) & (t != 0)
            n = int(small.sum())
            if n:
                t.masked_fill_(small, 0.0)
                count += n
    return count


def _stamps(tensors: list[Tensor]) -> tuple[tuple[int, int], ...]:
    """What changes when a tensor's values do: its version (every in-place update and load) and its storage's
    address (``param.data = t``, as ``vector_to_parameters`` does, keeps the version)."""
    return tuple((p._version, p.data_ptr()) for p in tensors)


def _tracing() -> bool:
    # the TorchScript-based ONNX exporter traces (jit); torch.onnx.is_in_onnx_export costs a microsecond, 30x these
    return torch.jit.is_tracing() or torch.compiler.is_compiling() or torch.compiler.is_exporting()
