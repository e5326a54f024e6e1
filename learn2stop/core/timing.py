"""Wall-clock speed of real early exit: samples per second of a rule, jobs measured side by side, and the
cumulative seconds of exiting at each step (a price on time instead of FLOPs)."""
from __future__ import annotations

import functools
import itertools
import math
import time
from typing import Any, Callable

import torch

from .loop import run_with_early_exit
from .protocols import member
from .steps import first_call, take_step
from .trees import tree_leaves, tree_map

#: a curve point's speeds: samples per second at batch 1 and at the large batch
SPEED_KEYS = ("samples_per_s_batch1", "samples_per_s_batchN")


class BackendError(ValueError):
    """A backend (runner) that cannot run this model or rule: the message names which and why."""


def measure_speed(model: Any, inputs: Any, rule_factory: Callable[[], Any], batch_size: int, repeats: int = 3,
                  max_seconds: float = 2.0, runner: Callable[..., Any] = run_with_early_exit,
                  warmup: bool = True) -> float:
    """Samples per second of real early exit with a rule, in batches of ``batch_size`` (wall clock).

    Runs over ``inputs`` (batch-first tree) chunk by chunk, after one warm-up chunk (which also compiles
    or exports, for such a ``runner``; ``warmup=False`` skips it when the caller has already run this
    model, rule and backend on these inputs), ``repeats`` times, and keeps the fastest pass (the least disturbed
    by other work on the machine). A pass stops early after ``max_seconds``. On CUDA the clock waits for
    the device. Runs under ``torch.inference_mode``. A runner that ``takes_all`` (the stream) gets every input
    in one call with ``max_batch=batch_size``: its throughput with at most that many rows per step call.
    """
    leaves = tree_leaves(inputs)
    n = leaves[0].shape[0]
    cuda = leaves[0].is_cuda
    if member(runner, "takes_all"):  # the warm-up: a short stream
        runner = functools.partial(runner, max_batch=batch_size)
        chunks, warm = [inputs], tree_map(lambda x: x[:2 * batch_size], inputs)
    else:
        chunks = [tree_map(lambda x: x[i:i + batch_size], inputs) for i in range(0, n, batch_size)]
        warm = chunks[0]
    best = 0.0
    with torch.inference_mode():  # as a deployment runs: no autograd bookkeeping, for every rule alike
        if warmup:
            runner(model, warm, rule_factory())
        for _ in range(repeats):
            if cuda:
                torch.cuda.synchronize()
            done, t0 = 0, time.perf_counter()
            for c in chunks:
                runner(model, c, rule_factory())
                done += tree_leaves(c)[0].shape[0]
                if time.perf_counter() - t0 > max_seconds:
                    break
            if cuda:
                torch.cuda.synchronize()
            best = max(best, done / max(time.perf_counter() - t0, 1e-9))
    return best


def speeds_side_by_side(jobs: list[tuple[Any, Callable[[], Any]]], inputs: Any, batch_size: int, passes: int,
                        runner: Callable[..., Any] = run_with_early_exit, skip: set[int] | None = None,
                        log: Callable[[str], None] | None = None,
                        spreads: list | None = None) -> list[float | None]:
    """Samples per second of each ``(model, rule_factory)`` job on ``inputs`` in batches of ``batch_size``, measured
    side by side: ``passes`` round-robin passes over the jobs, the best per job, so that a drift in the machine's
    load hits every job alike. Only the first pass warms up (and compiles or exports, for such a ``runner``).

    A job the backend cannot run (:class:`BackendError`) gets None, is added to ``skip`` (jobs listed there are not
    run: share one set across batch sizes) and is reported through ``log``.

    ``spreads``: a list that receives, per job, how much its passes disagree (:func:`pass_spread`; None for a job
    not run): the timing noise on this machine, that a choice between two speeds must not read as a difference.
    """
    skip = set() if skip is None else skip
    best: list[float | None] = [None] * len(jobs)
    seen: list[list[float]] = [[] for _ in jobs]
    for round_ in range(passes):
        for i, (model, factory) in enumerate(jobs):
            if i in skip:
                continue
            try:
                v = measure_speed(model, inputs, factory, batch_size, repeats=1, runner=runner, warmup=round_ == 0)
            except BackendError as e:
                skip.add(i)
                if log is not None:
                    log(f"{e}; that job has no speed on this backend")
                continue
            best[i] = max(best[i] or 0.0, v)
            seen[i].append(v)
    if spreads is not None:
        spreads[:] = [None if i in skip or not seen[i] else pass_spread(seen[i]) for i in range(len(jobs))]
    return [None if i in skip else b for i, b in enumerate(best)]


def seconds(fn: Callable[[], Any]) -> float:
    """Wall-clock seconds of one call of ``fn``, the GPU's queued work included when CUDA is in use."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def pass_spread(speeds: list[float]) -> float:
    """How far one job's timing passes disagree: the relative gap between its best pass and its median pass,
    ``(best - median) / best`` (0 for one pass, or passes that agree). The best is what is reported, the median
    what a typical pass gives: their gap is how much a reported speed owes to luck."""
    ordered = sorted(speeds)
    best, median = ordered[-1], ordered[(len(ordered) - 1) // 2]
    return (best - median) / best if best > 0 else 0.0


def measure_exit_costs(model: Any, inputs: Any, repeats: int = 5) -> list[float]:
    """Cumulative wall-clock seconds of exiting at steps 1..T, on this machine, for the batch ``inputs``.

    Each step's time is the fastest of ``repeats`` full rollouts (after one warm-up rollout), under
    ``torch.inference_mode``; on CUDA the clock waits for the device. A price on time instead of FLOPs:
    the result can be a model's ``exit_costs``. Measured on the 2-core CPU with the quick ResNet-20 at
    batch 256, the cumulative time of its exits ran 4-18 points of the whole above their FLOPs share (its
    early 32x32 blocks do fewer FLOPs per second than the late 8x8 ones), so FLOPs undercount what an early
    exit costs there (``benchmarks/exit_costs.py`` prints both).
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1; got {repeats!r}")
    cuda = tree_leaves(inputs)[0].is_cuda
    T = model.num_steps
    best = [math.inf] * T
    with torch.inference_mode():
        for rollout in range(repeats + 1):  # rollout 0 warms up
            state = first_call(model.initial_state, model, inputs)
            for t in range(1, T + 1):
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                state, _ = take_step(model, t, state, inputs)
                if cuda:
                    torch.cuda.synchronize()
                if rollout:
                    best[t - 1] = min(best[t - 1], time.perf_counter() - t0)
    return list(itertools.accumulate(best))


#: the least tie margin: speeds within this fraction of the fastest are a tie even when the passes agreed closely
SPEED_TIE_FLOOR = 0.02
#: the most a measured spread widens the tie: past it the timing says little (a loaded machine), and a tie that wide
#: would hand the choice to validation cost alone
SPEED_TIE_CAP = 0.10


def speed_tie(spreads: list[float | None], floor: float = SPEED_TIE_FLOOR, cap: float = SPEED_TIE_CAP) -> float:
    """The tie margin of a choice between speeds: the timing noise measured with them, the largest spread of the
    timed points' passes (:func:`~learn2stop.core.timing.pass_spread`), within ``floor`` .. ``cap``. Two speeds
    closer than a pass's own jitter on this machine are not told apart by a timing."""
    return min(cap, max([floor, *(v for v in spreads if v is not None)]))


def fastest_certified(speeds: dict[str, float], costs: dict[str, float | None],
                      tie: float = SPEED_TIE_FLOOR) -> str | None:
    """The candidate a user serving at one batch size deploys: the fastest (``speeds``: name -> samples/s), with the
    candidates within ``tie`` of it counted as tied (:func:`speed_tie`) and the tie going to the least validation
    cost (``costs``: name -> mean cost as a fraction of full depth, the baseline at full depth costing 1; None for a
    candidate whose speed does not follow from the steps it runs, such as self-speculative decoding's batched
    verification, which ranks as full depth in a tie), then to the baseline. A rule measured slower than the
    baseline is never chosen over it, nor one that runs as many steps (cost 1 or more): it adds early-exit machinery
    to the same computation, so a lead it shows is timing noise the passes' spread did not catch. None when nothing
    was timed."""
    timed = {n: v for n, v in speeds.items() if v is not None and n in costs}
    if not timed:
        return None
    full = costs.get("baseline", 1.0)
    cost = {n: full if costs[n] is None else costs[n] for n in timed}
    base = timed.get("baseline")
    if base is not None:  # only what can be faster than the baseline: fewer steps, and measured no slower
        timed = {n: v for n, v in timed.items()
                 if n == "baseline" or (v >= base and (costs[n] is None or costs[n] < full))}
    best = max(timed.values())
    near = [n for n, v in timed.items() if v >= (1 - tie) * best]
    return min(near, key=lambda n: (cost[n], n != "baseline", -timed[n]))
