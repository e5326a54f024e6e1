"""A stage's checkpoints and what they hand to the next run: the stage's name (its file), a writable folder, a
finished stage's selected weights, whether a checkpoint was made with this stage config, and the weight average a
checkpoint keeps."""
from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..utils.checkpoint import CheckpointError, load_checkpoint
from ..utils.config import to_dict
from .objectives import StageConfig


def check_stage_name(name: Any) -> None:
    """A stage name is a plain file name (``checkpoints/<name>.pt``): letters, digits, ``_ - .``, no path."""
    if not (isinstance(name, str) and re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}", name)):
        raise ValueError(f"stage name: must be a plain name of letters, digits, '_', '-' or '.' (it names "
                         f"checkpoints/<name>.pt), without a path; got {name!r}")


def check_writable(folder: Path) -> None:
    """Create and remove a file in ``folder``: a real test (os.access says yes to root on a read-only mount)."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".write-test.", suffix=".tmp", dir=folder)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise OSError(f"cannot write checkpoints to {folder} ({e.strerror or e}); make it writable or use another "
                      f"--run-dir (nothing was changed)") from None


def load_finished_stage(module: nn.Module, checkpoint_dir: str | Path, stage: str, map_location: Any = "cpu") -> dict:
    """Load the selected weights of a finished stage from ``<checkpoint_dir>/<stage>.pt`` into ``module``.

    Returns the stage's training summary. Raises CheckpointError, naming the file, if it is missing,
    corrupt, from an unfinished stage, or does not fit ``module``.
    """
    path = Path(checkpoint_dir) / f"{stage}.pt"
    ck = load_checkpoint(path, map_location=map_location)
    if not ck.get("completed"):
        raise CheckpointError(f"{path} is from an unfinished stage {stage!r}; run the train command again (it resumes)")
    try:
        module.load_state_dict(ck["weights"])
    except (KeyError, RuntimeError) as e:
        raise CheckpointError(f"{path} does not fit the configured model: {e}") from None
    return ck.get("summary", {})


def same_stage_config(stored: Any, cfg: StageConfig) -> bool:
    """Whether a checkpoint's stage config is ``cfg``'s (field for field: a checkpoint of another format is refused
    when it is loaded, so both sides have the same fields)."""
    return isinstance(stored, dict) and stored == to_dict(cfg)


class WeightAverage:
    """An exponential moving average of a stage's trained tensors: its parameters and float buffers.

    ``tensors`` are the live tensors by name (entries of the model's ``state_dict(keep_vars=True)``);
    :meth:`update` moves the average towards them (once per training step), :meth:`swap` exchanges the two
    in place (twice: back).
    """

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.names = [k for k, v in tensors.items() if v.is_floating_point()]
        self._live = [tensors[k].detach() for k in self.names]  # views of the model's storage
        self._avg = [v.clone() for v in self._live]

    @torch.no_grad()
    def update(self, decay: float) -> None:
        torch._foreach_lerp_(self._avg, self._live, 1.0 - decay)

    @torch.no_grad()
    def swap(self) -> None:
        kept = [v.clone() for v in self._live]
        torch._foreach_copy_(self._live, self._avg)
        torch._foreach_copy_(self._avg, kept)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in zip(self.names, self._avg)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if set(state) != set(self.names):
            raise CheckpointError("the checkpoint's weight average does not fit this model's trained tensors")
        torch._foreach_copy_(self._avg, [state[k] for k in self.names])
