"""Batch-first trees: the inputs, states and outputs of a step-wise model.

A tree is a tensor or a nested dict/list/tuple (named tuples too) of tensors whose first dimension is
the batch; the loop selects, writes and concatenates rows of every leaf at once.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor


def tree_map(fn: Callable[[Tensor], Any], tree: Any) -> Any:
    """Apply ``fn`` to every tensor leaf of a nested dict/list/tuple; other leaves pass through."""
    if isinstance(tree, Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: tree_map(fn, v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        mapped = [tree_map(fn, v) for v in tree]
        return type(tree)(*mapped) if hasattr(tree, "_fields") else type(tree)(mapped)
    return tree


def tree_leaves(tree: Any) -> list[Tensor]:
    """The tensor leaves of a nested dict/list/tuple, in order."""
    if isinstance(tree, Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [leaf for v in tree.values() for leaf in tree_leaves(v)]
    if isinstance(tree, (list, tuple)):
        return [leaf for v in tree for leaf in tree_leaves(v)]
    return []


def check_inputs(tree: Any, what: str = "inputs") -> None:
    """Refuse what the loop cannot drive, in the user's terms: no tensor at all (NumPy arrays, lists of
    numbers), or NaN / inf values (refused, with how many samples hold them)."""
    leaves = tree_leaves(tree)
    if not leaves:
        kind = type(tree).__module__ + "." + type(tree).__name__ if not isinstance(tree, (int, float)) else type(tree).__name__
        raise TypeError(f"{what} must be a torch tensor, or a dict/list/tuple of tensors, batch first; got {kind}"
                        + (" (convert it with torch.as_tensor)" if hasattr(tree, "__array__") or isinstance(tree, (list, tuple)) else ""))
    for leaf in leaves:
        if leaf.is_floating_point() or leaf.is_complex():
            bad = ~torch.isfinite(leaf)
            if bad.any():
                rows = int(bad.reshape(bad.shape[0], -1).any(1).sum()) if leaf.dim() > 0 else 1
                raise ValueError(f"{what} hold NaN or inf values in {rows} sample(s); clean or drop them first")


def batch_size(tree: Any) -> int:
    """The common first dimension of every tensor leaf; a clear error if they disagree."""
    sizes = {leaf.shape[0] for leaf in tree_leaves(tree) if leaf.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(f"inputs must be batch-first with one batch size; found batch sizes {sorted(sizes)}")
    size = sizes.pop()
    if size == 0:
        raise ValueError("inputs hold an empty batch (batch size 0)")
    return size


def take_rows(x: Tensor, index: Tensor | slice) -> Tensor:
    """Rows ``index`` (a slice, a bool mask or long indices) of a batch-first tensor: ``x[index]``, by
    ``index_select`` for indices on x's device. On a CPU advanced indexing took 4-5x as long for the early-exit
    loop's gathers (one thread: a (1000, 500) state 0.22 ms against 0.05; a (256, 32, 16, 16) one 0.90 against
    0.20), and the loop gathers its state and inputs at every plan and at every step where a sample stops.
    ``index_select`` returns a contiguous tensor, so a channels-last state (the classify networks) is gathered as
    its contiguous (B, H, W, C) view and keeps its layout (measured, one thread, 200 of (256, 32, 16, 16) rows:
    0.25 ms against 1.0 for ``x[index]``; made contiguous, it had slowed the next convolutions more than the
    gather saved). Any other layout takes ``x[index]``."""
    if isinstance(index, Tensor) and index.device == x.device and index.dim() == 1:
        if x.is_contiguous():
            perm = None
        elif x.dim() in (4, 5) and x.is_contiguous(memory_format=_LAST[x.dim()]):
            perm = (0, *range(2, x.dim()), 1)
        else:
            return x[index]
        if index.dtype == torch.bool and index.shape[0] == x.shape[0]:  # (another length: x[index]'s own error)
            index = index.nonzero().squeeze(1)
        if index.dtype == torch.long:
            if perm is None:
                return x.index_select(0, index)
            back = (0, x.dim() - 1, *range(1, x.dim() - 1))
            return x.permute(perm).index_select(0, index).permute(back)
    return x[index]


_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


def tree_select(tree: Any, index: Tensor | slice) -> Any:
    """Rows ``index`` (a slice, a bool mask or long indices) of every batch-first tensor leaf."""
    return tree_map(lambda x: take_rows(x, index) if x.dim() > 0 else x, tree)


def tree_cat(trees: list[Any]) -> Any:
    """Concatenate a list of structurally equal trees along the batch dim."""
    first = trees[0]
    if isinstance(first, Tensor):
        return torch.cat(trees, dim=0)
    if isinstance(first, dict):
        return {k: tree_cat([t[k] for t in trees]) for k in first}
    if isinstance(first, (list, tuple)):
        parts = [tree_cat([t[i] for t in trees]) for i in range(len(first))]
        return type(first)(*parts) if hasattr(first, "_fields") else type(first)(parts)
    return first


def tree_detach(tree: Any) -> Any:
    return tree_map(lambda x: x.detach(), tree)


def tree_zip_apply(fn: Callable[[Tensor, Tensor], Any], dst: Any, src: Any) -> None:
    """Call ``fn(d, s)`` on the paired batch-first tensor leaves of two structurally equal trees."""
    for d, s in zip(tree_leaves(dst), tree_leaves(src)):
        if d.dim() > 0:
            fn(d, s)


def tree_zip_map(fn: Callable[[Tensor, Tensor], Tensor], a: Any, b: Any) -> Any:
    """A tree of ``fn(x, y)`` over the paired tensor leaves of two structurally equal trees."""
    if isinstance(a, Tensor):
        return fn(a, b)
    if isinstance(a, dict):
        return {k: tree_zip_map(fn, a[k], b[k]) for k in a}
    if isinstance(a, (list, tuple)):
        parts = [tree_zip_map(fn, x, y) for x, y in zip(a, b)]
        return type(a)(*parts) if hasattr(a, "_fields") else type(a)(parts)
    return b


def check_batch_first(inputs: Any) -> None:
    """A lone tensor input must have a batch dimension and a feature dimension (B, ...): a 1-D tensor is
    almost always one sample whose batch dimension is missing."""
    if isinstance(inputs, Tensor) and inputs.dim() < 2:
        raise ValueError(f"inputs must be batch-first, shape (B, ...); got shape {tuple(inputs.shape)}: a single "
                         "sample needs a batch dimension, e.g. x[None]")
