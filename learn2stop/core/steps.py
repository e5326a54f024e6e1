"""A step-wise model's calls, as the loops make them: the protocol check, one step, one readout, and the first
call, whose shape or dtype errors are reported in the user's terms.

What every loop shares (:mod:`learn2stop.core.loop`, :mod:`learn2stop.core.streaming`, :mod:`learn2stop.core.timing`).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from .trees import batch_size, check_batch_first, check_inputs, tree_leaves


def check_stepwise(model: Any) -> None:
    """Raise a TypeError naming what ``model`` lacks to be driven by the loop."""
    missing = [n for n in ("num_steps", "initial_state", "step", "readout") if not hasattr(model, n)]
    if missing:
        raise TypeError(f"{type(model).__name__} is not a step-wise model: it lacks {', '.join(missing)}")
    if not isinstance(model.num_steps, int) or model.num_steps < 1:
        raise ValueError(f"{type(model).__name__}.num_steps must be an integer >= 1; got {model.num_steps!r}")



def check_model_inputs(model: Any, inputs: Any) -> None:
    """Refuse inputs the loop cannot drive, once per rollout at the public entry points (never per step), with one
    message naming the problem: no tensor at all, a lone tensor without a batch dimension, leaves of different batch
    sizes or an empty batch, floating inputs of another dtype than the model's floating parameters, NaN or inf."""
    check_inputs(inputs)
    check_batch_first(inputs)
    batch_size(inputs)
    if isinstance(model, nn.Module):
        param = next((p for p in model.parameters() if p.is_floating_point()), None)
        wrong = sorted({str(x.dtype) for x in tree_leaves(inputs) if x.is_floating_point() and x.dtype != param.dtype}) \
            if param is not None else []
        if wrong:
            raise ValueError(f"inputs of dtype {', '.join(wrong)} do not match {type(model).__name__}'s parameters "
                             f"(dtype {param.dtype}): convert them first, e.g. x.to({param.dtype})")

def take_step(model: Any, t: int, state: Any, inputs: Any, readout_grad: bool = True, read: bool = True) -> tuple[Any, Any]:
    """(state, output) of step t (``read=False``: output None, not read out); the first step's shape or dtype
    errors are reported in the user's terms. ``readout_grad=False``: the output without gradients (the state
    keeps them)."""
    state = model.step(t, state, inputs) if t > 1 else first_call(lambda i: model.step(1, state, i), model, inputs)
    return state, read_out(model, t, state, inputs, readout_grad) if read else None


def read_out(model: Any, t: int, state: Any, inputs: Any, readout_grad: bool = True) -> Any:
    with torch.set_grad_enabled(readout_grad and torch.is_grad_enabled()):
        return model.readout(t, state, inputs) if t > 1 else first_call(lambda i: model.readout(1, state, i), model, inputs)


def first_call(fn: Callable, model: Any, inputs: Any) -> Any:
    """Run the model's first call, turning a shape or dtype mismatch deep inside it into one clear error."""
    try:
        return fn(inputs)
    except (RuntimeError, IndexError) as e:
        shapes = [tuple(x.shape) for x in tree_leaves(inputs)]
        dtypes = sorted({str(x.dtype) for x in tree_leaves(inputs)})
        hint = " (inputs are batch-first: a single sample needs a batch dimension, e.g. x[None])" \
            if any(len(sh) == 1 for sh in shapes) else ""
        raise ValueError(f"{type(model).__name__} cannot take inputs of shape {shapes[0] if len(shapes) == 1 else shapes} "
                         f"and dtype {', '.join(dtypes)}: {str(e).splitlines()[0]}{hint}") from None
