"""A streamed request at the door and its result (:class:`~learn2stop.core.streaming.StreamingRunner`).

:func:`check_request` refuses, with a ``ValueError`` naming the problem, inputs that hold NaN or inf, lack the batch
dimension or hold more than one sample, or differ in structure, per-sample shape, dtype or device from the stream's
first request (or from the model's declared ``input_shape`` / ``input_dtype``), and an ``arrived`` that is not a
finite time, not later than the runner's clock. :class:`Finished` is a request's result, a failed one's included.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import Tensor

from .protocols import member
from .trees import batch_size, check_batch_first, check_inputs


class RequestFailed(RuntimeError):
    """Raised when the output or stop step of a request that failed inside ``tick()`` is read; its ``__cause__`` is
    the request's own error (also :attr:`Finished.error`)."""


@dataclass
class Finished:
    """A request's result: its output (batch of one), 1-based stop step, and its arrival and finish times.

    A request that failed inside ``tick()`` (its model step or its rule raised, or its policy scored it NaN) is
    done too: ``error`` holds its exception and ``step`` the step it failed at, and reading ``output`` or
    ``stop_time`` raises :class:`RequestFailed` from that error, so that a failure is never read as a result.
    """

    value: Any  # the output; None for a failed request
    step: int  # the stop step, or the step at which the request failed
    arrived: float
    finished: float
    error: Exception | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def _check(self) -> None:
        if self.error is not None:
            raise RequestFailed(f"this request failed at step {self.step}: "
                                f"{type(self.error).__name__}: {self.error}") from self.error

    @property
    def output(self) -> Any:
        self._check()
        return self.value

    @property
    def stop_time(self) -> int:
        self._check()
        return self.step

    @property
    def latency(self) -> float:
        return self.finished - self.arrived


def _tree_items(tree: Any, path: str = "inputs") -> Iterator[tuple[str, Any]]:
    """(path, leaf) of every leaf of a tree, tensors and other values alike, e.g. ``inputs['support'][0]``."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _tree_items(v, f"{path}[{k!r}]")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _tree_items(v, f"{path}[{i}]")
    else:
        yield path, tree


def _describe(leaf: Any) -> tuple:
    """What must agree between the requests of one stream, per leaf: a tensor's per-sample shape, dtype and
    device (rows of different ones cannot share a step call); any other value's type and value (a batch of
    requests runs with the first one's)."""
    if isinstance(leaf, Tensor):
        return ("tensor", tuple(leaf.shape[1:]), leaf.dtype, leaf.device)
    return ("value", type(leaf).__name__, repr(leaf)[:80])


def _differences(spec: dict[str, tuple], want: dict[str, tuple], source: str) -> str | None:
    """The first way a request's leaves (``spec``) differ from ``want`` (the stream's first request, or the model's
    declared input), in words; None when they agree."""
    if spec.keys() != want.keys():
        return f"the request's inputs have the leaves {', '.join(sorted(spec))}; {source} has {', '.join(sorted(want))}"
    for path, (kind, *got) in spec.items():
        w_kind, *w = want[path]
        if kind != w_kind:
            return f"{path} is a {'tensor' if kind == 'tensor' else got[0]}, in {source} a " \
                   f"{'tensor' if w_kind == 'tensor' else w[0]}"
        if kind == "value":
            if got != w:
                return f"{path} is {got[1]}, in {source} {w[1]}"
            continue
        for name, g, e in zip(("per-sample shape", "dtype", "device"), got, w):
            if e is not None and g != e:
                return f"{path} has {name} {g}, {source} {e}"
    return None


def declared_input(model: Any) -> dict[str, tuple] | None:
    """The leaves of the input a model declares (its optional ``input_shape`` and ``input_dtype``), or None."""
    shape = member(model, "input_shape")
    if not isinstance(shape, tuple):
        return None
    dtype = member(model, "input_dtype")
    return {"inputs": ("tensor", tuple(shape), dtype if isinstance(dtype, torch.dtype) else None, None)}


def check_request(inputs: Any, arrived: Any, now: float, declared: dict[str, tuple] | None,
                  first: dict[str, tuple] | None, model_name: str) -> tuple[dict[str, tuple], float]:
    """The request's leaves and its arrival time (``now`` when None), or a ValueError naming what is wrong with it:
    checked against the model's ``declared`` input (:func:`declared_input`) and the stream's ``first`` request."""
    if arrived is not None:
        if isinstance(arrived, bool) or not isinstance(arrived, numbers.Real):
            raise ValueError(f"arrived must be a time in seconds on the runner's clock (a real number); "
                             f"got {type(arrived).__name__} {arrived!r}")
        arrived = float(arrived)
        if not math.isfinite(arrived):
            raise ValueError(f"arrived must be a finite time in seconds; got {arrived!r}")
    if arrived is None:
        arrived = now
    elif arrived > now:
        raise ValueError(f"arrived ({arrived!r}) is in the future of the runner's clock ({now!r}); a request is "
                         "submitted when it has arrived (the clock is time.perf_counter unless given)")
    try:
        check_inputs(inputs, "the request's inputs")
    except TypeError as e:  # one class for every refused request, so that a server catches one
        raise ValueError(str(e)) from None
    check_batch_first(inputs)
    scalars = [path for path, leaf in _tree_items(inputs) if isinstance(leaf, Tensor) and leaf.dim() == 0]
    if scalars:
        raise ValueError(f"{scalars[0]} is a 0-dim tensor: a request's tensors are batch-first, (1, ...)")
    if batch_size(inputs) != 1:
        raise ValueError(f"submit takes one request (batch size 1); got batch size {batch_size(inputs)}")
    spec = {path: _describe(leaf) for path, leaf in _tree_items(inputs)}
    for want, source in ((declared, f"the model's declared input ({model_name}.input_shape)"),
                         (first, "the stream's first request")):
        problem = None if want is None else _differences(spec, want, source)
        if problem:
            raise ValueError(f"submit refused a request unlike the stream's others: {problem}")
    return spec, arrived
