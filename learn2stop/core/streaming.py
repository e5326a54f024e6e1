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
checks it); only the batching differs.

A request is checked at the door: :meth:`~StreamingRunner.submit` refuses a bad one with a ``ValueError`` naming the
problem and nothing of the runner changed (:func:`~learn2stop.core.stream_requests.check_request`). What can only fail later fails alone: a step call that raises is run again on each half of its batch, down
to the request that raises, whose result carries the error (:class:`Finished`); the other requests of the tick go on,
and its slot comes back. A policy rule whose stop scores are NaN (:meth:`~learn2stop.core.stop_rule.StopRule.nan_rows`,
the quantile's included, or a reported ``last_probs``) fails the requests it scored.

``benchmarks/streaming.py`` measures throughput and latency under a steady arrival rate against batching at full
depth and batch-then-shrink.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from .steps import check_stepwise, read_out, take_step
from .stop_rule import StepView, as_stop_rule
from .stream_requests import Finished, RequestFailed, check_request, declared_input
from .trees import tree_cat, tree_leaves, tree_map, tree_select

__all__ = ["Finished", "RequestFailed", "StreamingRunner"]


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


def _rows_of(c: _Chunk, mask: Tensor, k: int) -> _Chunk | None:
    """The rows of ``c`` where ``mask`` holds, ``k`` of them (counted already: no host synchronisation here)."""
    return None if k == 0 else c if k == len(c) else c.take(mask.nonzero().squeeze(1))


class StreamingRunner:
    """Serve requests one by one with per-step queues (see the module's text).

    Args:
        model: a step-wise model. If it declares ``input_shape`` (the per-sample shape of its one input tensor) and
            ``input_dtype``, as :func:`~learn2stop.core.exits.attach_exits`'s networks do, requests are checked
            against them from the first one on.
        rule: a stop rule of the loop (one instance serves the whole stream). A rule that raises is expected to
            leave its memory as it was (the core's rules do), since the step is then run again on fewer requests.
        max_batch: most requests per step call.
        capacity: most requests in flight (each holds a slot of the rule's memory); ``submit`` refuses more.
        clock: the time in seconds, for arrivals, finishes and latencies (``time.perf_counter`` by default).

    Example:
        >>> runner = StreamingRunner(sm.model, rule, max_batch=64)        # doctest: +SKIP
        >>> rid = runner.submit(x[:1])            # any time; then, as often as the server can:
        >>> runner.tick()                          # one step for one queue's oldest requests
        >>> runner.finished[rid].output, runner.finished[rid].stop_time   # (raises if the request failed)
    """

    def __init__(self, model: Any, rule: Any, max_batch: int = 64, capacity: int = 4096,
                 clock: Callable[[], float] = time.perf_counter):
        check_stepwise(model)
        rule = as_stop_rule(rule)
        rule.check_model(model)
        for name, v in (("max_batch", max_batch), ("capacity", capacity)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {v!r}")
        if not callable(clock):
            raise TypeError(f"clock must be a function returning the time in seconds; got {clock!r}")
        self.model, self.rule, self.max_batch, self.capacity, self.clock = model, rule, max_batch, capacity, clock
        self.T = model.num_steps
        rule.check_steps(self.T)
        self.asks = rule.ask_steps(self.T)
        self.reads = rule.read_steps(self.T)  # as the loop; a planned request that stops elsewhere is read alone
        self.queues: list[deque[_Chunk]] = [deque() for _ in range(self.T)]  # queues[t]: ran t steps
        self._rows = [0] * self.T  # requests in each queue (kept as they come and go: a tick must not count them)
        self.finished: dict[int, Finished] = {}  # every request done: stopped, or failed (Finished.error)
        self._free = list(range(capacity - 1, -1, -1))
        self._next_id = 0
        self.steps_run = 0  # step calls that moved requests on
        self.rows_run = 0  # sample-steps computed for them
        self._declared = declared_input(model)  # what the model says it takes, if it says
        self._first_spec: dict[str, tuple] | None = None  # the stream's first request's leaves

    @property
    def in_flight(self) -> int:
        return sum(self._rows)

    @property
    def free_slots(self) -> int:
        """Slots a new request can take; ``in_flight + free_slots == capacity`` at every moment between calls."""
        return len(self._free)

    def _push(self, t: int, c: _Chunk, front: bool = False) -> None:
        (self.queues[t].appendleft if front else self.queues[t].append)(c)
        self._rows[t] += len(c)

    def submit(self, inputs: Any, arrived: float | None = None) -> int:
        """Queue one request (batch-first inputs of one sample); its id. ``arrived``: its arrival time on the
        runner's clock (now by default; not later than now), for the latency and the order of the queues.

        A bad request is refused with a ``ValueError`` naming the problem, the runner unchanged (see the module's
        text); a full stream with a ``RuntimeError`` (``tick()`` first)."""
        spec, arrived = check_request(inputs, arrived, self.clock(), self._declared, self._first_spec,
                                      type(self.model).__name__)
        if not self._free:
            raise RuntimeError(f"the stream holds {self.capacity} requests in flight (capacity); tick() first")
        if self._first_spec is None:
            self._first_spec = spec
        rid, self._next_id = self._next_id, self._next_id + 1
        slot = self._free.pop()
        device = tree_leaves(inputs)[0].device
        self._push(0, _Chunk([rid], torch.tensor([slot], device=device), inputs, arrived=[arrived]))
        return rid

    def tick(self) -> int:
        """Run one step for up to ``max_batch`` requests of one queue (one that fills a batch, else the
        oldest request's, and among several the one whose head arrived first); returns how many requests it
        finished, failed ones included (0 when every queue is empty). A request that fails does so alone."""
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
        with torch.no_grad():
            try:
                batch = _merge(picked)
            except Exception:  # states that cannot be batched (a model whose state's shape depends on the input)
                return sum(self._advance(c, t0 + 1) for c in picked)
            return self._advance(batch, t0 + 1)

    def run_until_idle(self) -> None:
        while self.tick() or self.in_flight:
            pass

    def _advance(self, c: _Chunk, t: int) -> int:
        """Run step t for the requests of ``c`` and move them on: finished, failed, or queued at t. A step that
        raises is run again on each half of ``c``, down to the request that raises, which fails with its error
        (what ran before the raise is discarded: ``_step_chunk`` changes nothing of the runner). Returns how many
        requests finished or failed."""
        try:
            done, going, bad = self._step_chunk(c, t)
        except Exception as e:
            if len(c) == 1:
                return self._fail(c, t, e)
            half = len(c) // 2
            return self._advance(c.take(slice(0, half)), t) + self._advance(c.take(slice(half, None)), t)
        self.steps_run += 1
        self.rows_run += len(c)
        n = 0
        if bad is not None:
            n += self._fail(bad, t, ValueError(f"the stop rule's policy scored this request NaN at step {t} "
                                               "(a NaN stop logit): it cannot decide when to stop"))
        if done is not None:
            n += self._finish(done, t)
        if going is not None:
            self._push(t, going)
        return n

    def _step_chunk(self, c: _Chunk, t: int) -> tuple[_Chunk | None, _Chunk | None, _Chunk | None]:
        """Step t of ``c`` and the rule's decision, changing nothing of the runner or of ``c``: the requests that
        stop here (read out), those that go on, and those the policy scored NaN (each None when empty)."""
        model, T, rule = self.model, self.T, self.rule
        planned, state = c.planned, c.state
        if t == 1:
            if 0 in self.asks:  # a plan made before the first step
                _, planned = rule.decide_rows(StepView(0, T, c.inputs, None, None, None, c.slots), None)
            state = model.initial_state(c.inputs)
        previous = c.output
        state, output = take_step(model, t, state, c.inputs, read=t in self.reads)
        c = _Chunk(c.ids, c.slots, c.inputs, state, output, planned, c.arrived)
        bad = None
        if t == T:
            stop = None  # all stop
        elif t in self.asks or planned is not None:
            before = rule.last_probs
            stop, c.planned = rule.decide_rows(StepView(t, T, c.inputs, output, previous, state, c.slots), planned)
            if not isinstance(stop, Tensor) or stop.shape != (len(c),) or stop.dtype != torch.bool:
                raise ValueError(f"a stop rule must return a bool tensor of shape ({len(c)},); got "
                                 + (f"{stop.dtype} {tuple(stop.shape)}" if isinstance(stop, Tensor) else repr(stop)))
            probs, nan = rule.last_probs, rule.nan_rows()  # NaN is no decision: a reported prob, a policy's score
            if probs is not before and isinstance(probs, Tensor) and probs.shape == stop.shape:
                nan = torch.isnan(probs) if not isinstance(nan, Tensor) else nan | torch.isnan(probs)
            bad = nan if c.planned is None and isinstance(nan, Tensor) and nan.shape == stop.shape else None
        else:
            return None, c, None
        if stop is None:
            return self._read(c, t), None, None
        counts = torch.stack([stop.sum(), bad.sum()]).tolist() if bad is not None else [int(stop.sum()), 0]
        n_stop, n_bad = counts  # one host synchronisation
        if n_bad:
            stop = stop & ~bad
            n_stop = int(stop.sum())
        n_go = len(c) - n_stop - n_bad
        done = _rows_of(c, stop, n_stop)
        going = _rows_of(c, ~stop if bad is None else ~stop & ~bad, n_go)
        return None if done is None else self._read(done, t), going, _rows_of(c, bad, n_bad) if n_bad else None

    def _read(self, c: _Chunk, t: int) -> _Chunk:
        """``c`` with its output at step t: planned requests are read out at their stop step only."""
        if c.output is None:
            c = _Chunk(c.ids, c.slots, c.inputs, c.state, read_out(self.model, t, c.state, c.inputs), c.planned,
                       c.arrived)
        return c

    def _finish(self, c: _Chunk, t: int) -> int:
        now = self.clock()
        for i, (rid, arrived) in enumerate(zip(c.ids, c.arrived)):
            self.finished[rid] = Finished(tree_map(lambda x, i=i: x[i:i + 1], c.output), t, arrived, now)
        self._free.extend(c.slots.tolist())
        return len(c)

    def _fail(self, c: _Chunk, t: int, error: Exception) -> int:
        now = self.clock()
        for rid, arrived in zip(c.ids, c.arrived):
            self.finished[rid] = Finished(None, t, arrived, now, error)
        self._free.extend(c.slots.tolist())
        return len(c)
