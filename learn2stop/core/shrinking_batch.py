"""The rows still running of one early-exit rollout (:func:`~learn2stop.core.loop.run_with_early_exit`): their
state, inputs and original positions, shrunk as rows stop, and the result the stopped rows are written into."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .steps import first_call, read_out, take_step
from .stop_rule import Plan
from .trees import batch_size, take_rows, tree_leaves, tree_map, tree_select, tree_zip_apply


class ShrinkingBatch:
    """The rows still running of one early-exit rollout (their state, inputs and original positions), and the
    result the stopped rows are written into, in input order."""

    def __init__(self, model: Any, inputs: Any, T: int):
        self.model, self.inputs, self.T = model, inputs, T
        self.B = batch_size(inputs)
        self.state = first_call(model.initial_state, model, inputs)
        leaves = tree_leaves(self.state)
        device = leaves[0].device if leaves else tree_leaves(inputs)[0].device
        self.active = torch.arange(self.B, device=device)  # (B_active,) original rows of the running samples
        self.stop_times = torch.full((self.B,), T, dtype=torch.long, device=device)
        self.result = None  # preallocated on the first write: stopped rows go straight to their place
        self.done = False  # every row has stopped

    def step(self, t: int, read: bool) -> Any:
        self.state, output = take_step(self.model, t, self.state, self.inputs, read=read)
        return output

    def finish(self, rows: slice | Tensor, output: Any, t: int) -> Any:
        """Write the running rows ``rows`` at their stop step t; ``output`` None (planned: a step the plan does not
        read): the running rows are read out here first, all of them, so that each row's output is the value it had
        when every step was read out (a batched readout can round a row otherwise with other rows around it: sampled
        Stage I trains through this). Returns the output."""
        if output is None:
            output = read_out(self.model, t, self.state, self.inputs)
        if self.result is None:
            self.result = tree_map(lambda x: x.new_empty((self.B, *x.shape[1:])) if x.dim() > 0 else x, output)
        idx = self.active[rows]
        tree_zip_apply(lambda dst, src: dst.index_copy_(0, idx, take_rows(src, rows)), self.result, output)
        if t < self.T:
            self.stop_times[idx] = t
        return output

    def _select(self, rows: slice | Tensor, *trees: Any) -> list[Any]:
        """Keep the running rows ``rows`` (a slice, or integer positions); ``trees`` follow them."""
        self.active, self.state, self.inputs = self.active[rows], tree_select(self.state, rows), tree_select(self.inputs, rows)
        return [None if x is None else tree_select(x, rows) for x in trees]

    def keep_leading(self, k: int, output: Any, t: int, previous: Any) -> tuple[Any, Any]:
        """After a plan: the rows past the first k (the shallowest planned) stop at t; the first k go on."""
        n = self.active.numel()
        if k < n:
            output = self.finish(slice(k, n), output, t)
            self.done = k == 0
            output, previous = self._select(slice(0, k), output, previous)
        return output, previous

    def follow(self, plan: Plan, output: Any, t: int) -> tuple[list[int], Any]:
        """Sort the running rows (and the output) as ``plan`` orders them, then stop those it stops at t; the plan's
        counts, and the output of the rows going on."""
        if plan.order is not None:
            same = output is self.state  # a readout that is the state itself (LISTA's x_t): one gather, not two
            self._select(plan.order)
            output = None if output is None else self.state if same else tree_select(output, plan.order)
        output, _ = self.keep_leading(plan.running[t], output, t, None)
        return plan.running, output

    def stop_rows(self, stop: Tensor, output: Any, t: int) -> Any:
        """A per-step rule's (B_active,) bool answer: write the rows that stop at t, keep the others (in order)."""
        n = self.active.numel()
        if stop.shape != (n,) or stop.dtype != torch.bool:
            raise ValueError(f"a stop rule must return a bool tensor of shape ({n},); got {stop.dtype} {tuple(stop.shape)}")
        if n == 1:  # batch of one: a stop simply ends the loop
            if bool(stop):
                self.finish(slice(None), output, t)
                self.done = True
            return output
        # One host synchronisation (the count); rows are then moved with integer indices, which need
        # none: a stable sort puts the continuing rows first, in order, then the stopped ones.
        n_stop = int(stop.sum())
        if n_stop:
            order = torch.argsort(stop.to(torch.int8), stable=True)
            self.finish(order[n - n_stop:], output, t)
            self.done = n_stop == n
            if not self.done:
                output, = self._select(order[:n - n_stop], output)
        return output
