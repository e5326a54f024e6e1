"""The data the API's functions take: batches of (inputs, target) (a DataLoader, a list) or a sampling function
``sample(n, generator, device) -> (inputs, target)``; and the training task the trainer reads off them."""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from ..core.trees import tree_map
from ..utils.seeding import derive_seed

#: what a sampling function's validation set is made of when none is given: batches x rows
VALIDATION_BATCHES, VALIDATION_ROWS = 4, 256


def is_sampler(data: Any) -> bool:
    """A sampling function (callable, not itself a collection of batches)."""
    return callable(data) and not isinstance(data, Iterable)


def to_device(tree: Any, device: Any) -> Any:
    return tree if device is None else tree_map(lambda x: x.to(device), tree)


def as_batches(data: Any, what: str, device: Any = None, seed: int = 0) -> list[tuple[Any, Any]]:
    """``data`` as a fixed list of (inputs, target) on ``device``: a sampling function drawn
    :data:`VALIDATION_BATCHES` times (seeded from ``seed`` and ``what``), or the batches of a loader or list."""
    if is_sampler(data):
        gen = torch.Generator().manual_seed(derive_seed(seed, what))
        out = [data(VALIDATION_ROWS, gen, device) for _ in range(VALIDATION_BATCHES)]
    elif isinstance(data, Iterable) and not isinstance(data, (str, bytes, torch.Tensor)):
        out = [to_device(b, device) for b in data]
    else:
        raise TypeError(f"{what}: expected batches of (inputs, target) (a DataLoader or a list) or a sampling function "
                        f"sample(n, generator, device); got {type(data).__name__}")
    if not out:
        raise ValueError(f"{what}: no batches")
    for b in out:
        if not (isinstance(b, (tuple, list)) and len(b) == 2):
            raise ValueError(f"{what}: each batch must be a pair (inputs, target); got {type(b).__name__}"
                             + (f" of {len(b)}" if isinstance(b, (tuple, list)) else ""))
    return [tuple(b) for b in out]


def inputs_of(batches: list[tuple[Any, Any]]) -> Any:
    """The inputs of every batch, concatenated along the batch (what timing runs on)."""
    firsts = [b[0] for b in batches]
    return tree_map(lambda *xs: torch.cat(xs), *firsts) if len(firsts) > 1 else firsts[0]


class DataTask:
    """A :class:`~learn2stop.core.trainer.TrainingTask` from data and a loss.

    A sampling function gives the trainer batches of the stage's ``batch_size`` drawn with its seeded generator (a
    resumed stage sees the batches it would have seen); a loader gives its own batches, cycled, in its own order
    (its batch size is the loader's). Validation: the batches given, or, for a sampling function, a fixed draw.
    """

    def __init__(self, data: Any, loss_fn: Callable, validation: Any = None, stop_loss_fn: Callable | None = None,
                 seed: int = 0):
        if not callable(loss_fn):
            raise TypeError(f"loss_fn: expected a function (output, target) -> (B,) per-sample losses; "
                            f"got {type(loss_fn).__name__}")
        if validation is None and not is_sampler(data):
            raise ValueError("validation: give held-out batches (a DataLoader or a list of (inputs, target)) to select "
                             "each stage's weights on; only a sampling function draws its own")
        self.data, self.loss_fn, self.seed = data, loss_fn, seed
        if stop_loss_fn is not None:
            self.stop_loss_fn = stop_loss_fn
        self._validation = validation if validation is not None else data
        self._cycle = None if is_sampler(data) else _forever(data)
        self._cached: dict[str, list] = {}

    def sample_batch(self, batch_size: int, generator: torch.Generator, device: Any) -> tuple[Any, Any]:
        if self._cycle is None:
            return self.data(batch_size, generator, device)
        return tuple(to_device(next(self._cycle), device))

    def validation_batches(self, device: Any) -> list[tuple[Any, Any]]:
        key = str(device)
        if key not in self._cached:
            self._cached[key] = as_batches(self._validation, "validation", device, self.seed)
        return self._cached[key]


def _forever(loader: Iterable) -> Iterable:
    """A loader's batches epoch after epoch (a new pass each time: a shuffling loader reshuffles)."""
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ValueError("data: the loader yielded no batches")
