"""Peak memory of one meta-training step, MAML vs MAML-stop, measured two ways.

1. :func:`graph_saved_bytes`: bytes of the distinct storages the autograd graph holds for the
   backward pass. All of them are alive when ``backward()`` starts, so this is the peak of the
   graph's memory, deterministic and device-independent; it is what second-order MAML's memory is
   made of.
2. :func:`process_peak_bytes`: the process-level peak, in a fresh subprocess per method (the OS
   high-water mark cannot be reset): ``ru_maxrss`` after the training steps minus the resident
   size just before them on CPU, ``torch.cuda.max_memory_allocated`` on a GPU. It includes
   allocator slack, transient buffers and the inner gradients' temporaries.

Run as a script, it prints method-level JSON: ``python -m learn2stop.tasks.maml.memory CONFIG.json METHOD DEVICE``.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from typing import Any, Callable

import torch

from ...core.objectives import StageObjective
from ...utils.seeding import derive_seed


def graph_saved_bytes(loss: torch.Tensor) -> int:
    """Bytes of the distinct storages that the autograd graph behind ``loss`` saved for backward.

    Walks the graph from ``loss.grad_fn`` and reads every node's ``_saved_*`` tensors. All of
    them are alive when ``backward()`` starts, so this is the peak of the graph's memory; branches
    freed during the forward pass (outputs looked at and dropped) are not in the graph any more.
    (Saved-tensor hooks would be simpler but torch.func.grad does not support them.)
    """
    seen, stack, storages = set(), [loss.grad_fn], {}
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            if not name.startswith("_saved_"):
                continue
            try:
                value = getattr(node, name)
            except RuntimeError:  # already freed or not unpackable: holds no memory
                continue
            for t in value if isinstance(value, (tuple, list)) else [value]:
                if isinstance(t, torch.Tensor):
                    s = t.untyped_storage()
                    storages[(s.data_ptr(), t.device.type)] = s.nbytes()
        stack.extend(fn for fn, _ in node.next_functions)
    return sum(storages.values())


def training_step(cfg, method: str, device, data=None) -> tuple[Callable[[int], torch.Tensor], Any]:
    """A closure running one meta-training step (forward and backward) of ``method`` (maml | stop)."""
    from .data import Data, MetaLearningTask
    from .models import build

    data = data or Data(cfg.data)
    maml, stop = build(cfg, device)
    sm, stage = (maml, cfg.maml) if method == "maml" else (stop, cfg.stage1.inherit(cfg.method))
    if method == "stop":
        sm.model.policy_features = False
    task = MetaLearningTask(sm.model, data.sampler, data.split["train"], data.split["val"], 1, 0, 1)
    objective = StageObjective(sm, task.loss_fn, stage)

    def run(i: int, backward: bool = True) -> torch.Tensor:
        g = torch.Generator().manual_seed(derive_seed(cfg.seed, "memory", i))
        inputs, target = task.sample_batch(stage.batch_size, g, device)
        loss, _ = objective(inputs, target, g)
        if backward:
            loss.backward()
        return loss

    return run, sm


def graph_bytes(cfg, method: str, repeats: int = 3, data=None) -> int:
    """Largest saved-for-backward bytes over ``repeats`` meta-batches (MAML-stop's depth is random)."""
    run, _ = training_step(cfg, method, "cpu", data)
    return max(graph_saved_bytes(run(i, backward=False)) for i in range(repeats))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _measure_here(cfg, method: str, device: str, repeats: int) -> dict:
    run, _ = training_step(cfg, method, device)
    dev = torch.device(device)
    with torch.no_grad():
        run(10_000, backward=False)  # warm-up: allocator, data and lazy inits outside the measurement
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    else:
        base = _rss_bytes()
    for i in range(repeats):
        run(i)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(dev) - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"method": method, "device": device, "peak_bytes": int(peak)}


def process_peak_bytes(cfg, method: str, device: str = "cpu", repeats: int = 3) -> int:
    """Peak extra memory of ``repeats`` training steps, measured in a fresh subprocess."""
    from ...utils.config import to_dict

    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    out = subprocess.run([sys.executable, "-m", "learn2stop.tasks.maml.memory", json.dumps(to_dict(cfg)), method,
                          device, str(repeats)], capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"memory measurement of {method} failed:\n{out.stderr[-2000:]}")
    return int(json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"])


if __name__ == "__main__":
    from ...utils.config import from_dict
    from .config import MAMLConfig

    torch.set_num_threads(1)
    config = from_dict(MAMLConfig, json.loads(sys.argv[1]))
    print(json.dumps(_measure_here(config, sys.argv[2], sys.argv[3], int(sys.argv[4]))))
