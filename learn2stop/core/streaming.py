"""Early exit for a stream of requests: freed rows are refilled at every step, not once per batch.

:func:`~learn2stop.core.loop.run_with_early_exit` shrinks a batch as its samples stop, so its last steps run
on a few rows while new requests wait for the whole batch to finish. :class:`StreamingRunner` keeps one
queue per step instead (as early-exit serving systems rebatch per layer): a request that has run t steps
waits in queue t; each :meth:`~StreamingRunner.tick` runs one step for up to ``max_batch`` requests of one
queue (a queue that fills a whole batch if any, else the queue of the oldest request), finishes the ones the rule stops and moves the others
on. New requests join queue 0 whenever they arrive, so a step's batch mixes requests that arrived at
different times, and the model's steps never run on padding. It works for any step-wise model (steps with
their own weights, as here, or shared ones) and any rule of the loop:

- a planning rule plans each request once, at its plan step, and the request stops at its planned step;
- a per-step rule is asked at its steps from ``rule.first_ask``; a rule with memory (quantile, patience)
  keeps it per *slot*: a request holds one of ``capacity`` slots while it runs (``StepView.index``).

Stop times and outputs equal :func:`~learn2stop.core.loop.run_with_early_exit`'s for every request (a test
checks it); only the batching differs. ``benchmarks/streaming.py`` measures throughput and latency under a
steady arrival rate against batching at full depth and batch-then-shrink.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .loop import StepView, _readout, _step, as_stop_rule, check_stepwise
from .trees import batch_size, tree_cat, tree_leaves, tree_map, tree_select


@dataclass
class _Chunk:
    """Requests that move through the steps together until the rule parts them."""

    ids: list[int]
    slots: Tensor  # (n,) long
    inputs: Any
    state: Any = None
    output: Any = None  # the output of the last step run (a tolerance rule compares with it)
    planned: Tensor | None = None  # (n,) planned stop steps, once a planning rule has planned
    arrived: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ids)

    def take(self, rows: Tensor | slice) -> "_Chunk":
        pick = (lambda x: tree_select(x, rows)) if isinstance(rows, Tensor) else (lambda x: tree_map(lambda v: v[rows], x))
        idx = rows.tolist() if isinstance(rows, Tensor) else list(range(len(self)))[rows]
        return _Chunk([self.ids[i] for i in idx], self.slots[rows], pick(self.inputs),
                      None if self.state is None else pick(self.state), None if self.output is None else pick(self.output),
                      None if self.planned is None else self.planned[rows], [self.arrived[i] for i in idx])


def _merge(chunks: list[_Chunk]) -> _Chunk:
    if len(chunks) == 1:
        return chunks[0]
    cat = (lambda key: None if getattr(chunks[0], key) is None else tree_cat([getattr(c, key) for c in chunks]))
    return _Chunk([i for c in chunks for i in c.ids], torch.cat([c.slots for c in chunks]), cat("inputs"), cat("state"),
                  cat("output"), None if chunks[0].planned is None else torch.cat([c.planned for c in chunks]),
                  [a for c in chunks for a in c.arrived])


@dataclass
class Finished:
    """A request's result: its output (batch of one), 1-based stop step, and its arrival and finish times."""

    output: Any
    stop_time: int
    arrived: float
    finished: float

    @property
    def latency(self) -> float:
        return self.finished - self.arrived


class StreamingRunner:
    """Serve requests one by one with per-step queues (see the module's text).

    Args:
        model: a step-wise model.
        rule: a stop rule of the loop (one instance serves the whole stream).
        max_batch: most requests per step call.
        capacity: most requests in flight (each holds a slot of the rule's memory); ``submit`` refuses more.

    Example:
        >>> runner = StreamingRunner(sm.model, rule, max_batch=64)        # doctest: +SKIP
        >>> rid = runner.submit(x[:1])            # any time; then, as often as the server can:
        >>> runner.tick()                          # one step for one queue's oldest requests
        >>> runner.finished[rid].output, runner.finished[rid].stop_time
    """

    def __init__(self, model: Any, rule: Any, max_batch: int = 64, capacity: int = 4096):
        check_stepwise(model)
        rule = as_stop_rule(rule)
        for name, v in (("max_batch", max_batch), ("capacity", capacity)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {v!r}")
        self.model, self.rule, self.max_batch, self.capacity = model, rule, max_batch, capacity
        self.T = model.num_steps
        self.plan_step = rule.plan_step
        self.replan_step = rule.replan_step if self.plan_step is not None else None
        self.first = rule.first_ask
        self.reads = rule.read_steps(self.T)  # as the loop; a planned request that stops elsewhere is read alone
        self.queues: list[deque[_Chunk]] = [deque() for _ in range(self.T)]  # queues[t]: ran t steps
        self._rows = [0] * self.T  # requests in each queue (kept as they come and go: a tick must not count them)
        self.finished: dict[int, Finished] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self._next_id = 0
        self.steps_run = 0  # step calls
        self.rows_run = 0  # sample-steps computed

    @property
    def in_flight(self) -> int:
        return sum(self._rows)

    def _push(self, t: int, c: _Chunk, front: bool = False) -> None:
        (self.queues[t].appendleft if front else self.queues[t].append)(c)
        self._rows[t] += len(c)

    def submit(self, inputs: Any, arrived: float | None = None) -> int:
        """Queue one request (batch-first inputs of one sample); its id. ``arrived``: its arrival time
        (``time.perf_counter()`` by default), for the latency."""
        if batch_size(inputs) != 1:
            raise ValueError(f"submit takes one request (batch size 1); got batch size {batch_size(inputs)}")
        if not self._free:
            raise RuntimeError(f"the stream holds {self.capacity} requests in flight (capacity); tick() first")
        rid, self._next_id = self._next_id, self._next_id + 1
        slot = self._free.pop()
        device = tree_leaves(inputs)[0].device
        self._push(0, _Chunk([rid], torch.tensor([slot], device=device), inputs,
                             arrived=[time.perf_counter() if arrived is None else arrived]))
        return rid

    def tick(self) -> int:
        """Run one step for up to ``max_batch`` requests of one queue (one that fills a batch, else the
        oldest request's, and among several the one whose head arrived first); returns how many requests it finished (0 when every queue is empty)."""
        waiting = [t for t in range(self.T) if self.queues[t]]
        if not waiting:
            return 0
        full = [t for t in waiting if self._rows[t] >= self.max_batch]
        # a full batch first (throughput); else the queue of the oldest request (its latency)
        t0 = min(full or waiting, key=lambda t: self.queues[t][0].arrived[0])
        q, picked, n = self.queues[t0], [], 0
        while q and n < self.max_batch:
            c = q.popleft()
            self._rows[t0] -= len(c)
            if n + len(c) > self.max_batch:
                self._push(t0, c.take(slice(self.max_batch - n, None)), front=True)
                c = c.take(slice(0, self.max_batch - n))
            picked.append(c)
            n += len(c)
        batch = _merge(picked)
        with torch.no_grad():
            return self._advance(batch, t0 + 1)

    def run_until_idle(self) -> None:
        while self.tick() or self.in_flight:
            pass

    def _advance(self, c: _Chunk, t: int) -> int:
        model, T = self.model, self.T
        if t == 1:
            if self.plan_step == 0:
                c.planned = self.rule.plan(StepView(0, T, c.inputs, None, None, None, c.slots)).clamp(1, T)
            c.state = model.initial_state(c.inputs)
        previous = c.output
        c.state, c.output = _step(model, t, c.state, c.inputs, read=t in self.reads)
        self.steps_run += 1
        self.rows_run += len(c)
        if t == T:
            return self._finish(c, T)
        if t == self.plan_step:
            c.planned = self.rule.plan(StepView(t, T, c.inputs, c.output, None, c.state, c.slots)).clamp(t, T)
        elif t == self.replan_step:  # the requests planned past this step are planned again, from the run so far
            late = c.planned > t
            if bool(late.any()):
                again = self.rule.replan(StepView(t, T, c.inputs, c.output, previous, c.state, c.slots)).clamp(t, T)
                c.planned = torch.where(late, again, c.planned)
        if c.planned is not None:
            stop = c.planned == t
        elif t >= self.first:
            stop = self.rule(StepView(t, T, c.inputs, c.output, previous, c.state, c.slots))
        else:
            self._push(t, c)
            return 0
        n_stop = int(stop.sum())
        if n_stop == len(c):
            return self._finish(c, t)
        if n_stop:
            self._finish(c.take(stop.nonzero().squeeze(1)), t)
            c = c.take((~stop).nonzero().squeeze(1))
        self._push(t, c)
        return n_stop

    def _finish(self, c: _Chunk, t: int) -> int:
        if c.output is None:  # planned requests are read out at their stop step only
            c.output = _readout(self.model, t, c.state, c.inputs)
        now = time.perf_counter()
        for i, (rid, arrived) in enumerate(zip(c.ids, c.arrived)):
            self.finished[rid] = Finished(tree_map(lambda x, i=i: x[i:i + 1], c.output), t, arrived, now)
        self._free.extend(c.slots.tolist())
        return len(c)
