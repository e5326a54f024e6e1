"""The distributed context, decided by the launcher (torchrun) and passed down explicitly."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    """Rank, world size and device of this process; the single-process default is rank 0 of 1."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def all_reduce_mean(self, value: float) -> float:
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(t)
        return float(t) / self.world_size


def init_distributed(device: str = "auto") -> DistContext:
    """Join the process group torchrun set up (env RANK/WORLD_SIZE), or return a single-process context.

    ``device``: "auto" (CUDA if available, per local rank), "cpu" or "cuda". Only the CLI and
    launchers call this; library code receives the context.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda'; got {device!r}")
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but CUDA is not available")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistContext(device=torch.device("cuda" if use_cuda else "cpu"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(), device=dev)


def shutdown_distributed(ctx: DistContext) -> None:
    if ctx.enabled and dist.is_initialized():
        dist.destroy_process_group()
