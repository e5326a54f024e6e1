"""The one loop that drives a step-wise model and a stop rule.

A *step-wise model* is any object with

- ``num_steps``: T, the number of steps at which it can output (its "output channels");
- ``initial_state(inputs)``: the state x_0 from the input;
- ``step(t, state, inputs)``: the state x_t from x_{t-1}, for t = 1..T (a step may run several layers);
- ``readout(t, state, inputs)``: the prediction at step t (what the loss and the policy see).

Inputs, states and outputs are tensors or nested dict/list/tuple of tensors whose first dim is
the batch, so that the loop can drop samples that have stopped. Nothing needs to subclass
anything: wrap the model with :class:`StoppingModel` and a policy.

A *policy* is a module ``policy(inputs, output, t) -> (B,) stop logits`` (pi_t = sigmoid(logit),
paper Eq. 2). A policy may set ``min_step``: before that step it is not called at all (pi_t = 0),
which saves its cost where it would never stop. A *planning* policy sets ``plan_step`` instead: it is
called once, at that step, and returns the (B, T-1) stop logits of every step (its whole q_phi), so the
loop can sort the batch by planned depth once and run shrinking contiguous slices without deciding again. A *stop rule* fills the stopping slot of :func:`run_with_early_exit`: a fixed depth,
a tolerance on the change of the output, or the learned policy (thresholded or sampled) all fit.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import torch
from torch import Tensor, nn


# ----------------------------------------------------------------------------- batch trees
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


def tree_select(tree: Any, index: Tensor) -> Any:
    """Rows ``index`` (bool mask or long indices) of every batch-first tensor leaf."""
    return tree_map(lambda x: x[index] if x.dim() > 0 else x, tree)


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


def check_rule(rule: Any) -> None:
    """Refuse what cannot fill the stop-rule slot (a rule's name, None), saying what can."""
    if not (callable(rule) or callable(getattr(rule, "plan", None))):
        hint = (" (build it: InferenceConfig(rule=...).make_rule(policy), or a calibration's make_rule)"
                if isinstance(rule, str) else "")
        raise TypeError(f"rule must be a stop rule (a callable on a StepView, or a planning rule with plan()); "
                        f"got {type(rule).__name__} {rule!r}{hint}")


def first_ask(rule: Any) -> int:
    """The first step at which the loop consults a rule: its planning step, or its ``first_step``
    (a learned policy's ``min_step``, 2 for a tolerance test), else 1."""
    plan = getattr(rule, "plan_step", None)
    return int(plan) if plan is not None else int(getattr(rule, "first_step", 1))


# ----------------------------------------------------------------------------- protocols
@runtime_checkable
class StepwiseModel(Protocol):
    num_steps: int

    def initial_state(self, inputs: Any) -> Any: ...

    def step(self, t: int, state: Any, inputs: Any) -> Any: ...

    def readout(self, t: int, state: Any, inputs: Any) -> Any: ...


def check_stepwise(model: Any) -> None:
    """Raise a TypeError naming what ``model`` lacks to be driven by the loop."""
    missing = [n for n in ("num_steps", "initial_state", "step", "readout") if not hasattr(model, n)]
    if missing:
        raise TypeError(f"{type(model).__name__} is not a step-wise model: it lacks {', '.join(missing)}")
    if not isinstance(model.num_steps, int) or model.num_steps < 1:
        raise ValueError(f"{type(model).__name__}.num_steps must be an integer >= 1; got {model.num_steps!r}")


@dataclass
class StepView:
    """What a stop rule sees at step t, for the samples still running."""

    t: int
    num_steps: int
    inputs: Any
    output: Any
    previous_output: Any
    state: Any
    index: Tensor  # (B_active,) positions of these samples in the original batch


StopRule = Callable[[StepView], Tensor]


# ----------------------------------------------------------------------------- the result
@dataclass
class Rollout:
    """The uniform result of the loop, read by every trainer, metric and plot.

    Attributes:
        outputs: the prediction of each sample at its stop time (batch-first tree, input order).
        stop_times: (B,) 1-based step at which each sample stopped; T for a full-depth run.
        step_outputs: for a full unroll with ``keep_outputs``: T trees, the output at each step.
        losses: (B, T) per-step losses when a target and loss were given to a full unroll.
        stop_logits: (B, T-1) policy logits at steps 1..T-1 in a full unroll; None without policy.
    """

    outputs: Any
    stop_times: Tensor
    num_steps: int
    step_outputs: list[Any] | None = None
    losses: Tensor | None = None
    stop_logits: Tensor | None = None
    extras: dict = field(default_factory=dict)

    @property
    def steps_computed(self) -> int:
        """Sample-steps actually computed: sum of stop times (each step of each sample once)."""
        return int(self.stop_times.sum())

    @property
    def mean_depth(self) -> float:
        return float(self.stop_times.float().mean())


# ----------------------------------------------------------------------------- the loop
def unroll(
    model: Any,
    inputs: Any,
    *,
    target: Any = None,
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    policy: nn.Module | None = None,
    model_grad: bool = True,
    keep_outputs: bool = False,
) -> Rollout:
    """Run every step 1..T for the whole batch (training and analysis).

    Args:
        model: a step-wise model.
        inputs: batch-first tree.
        target, loss_fn: if both are given, ``loss_fn(output_t, target) -> (B,)`` is recorded at each step.
        policy: if given, its stop logits at steps 1..T-1 are recorded.
        model_grad: False runs the model under ``torch.no_grad`` (Stage II: theta frozen) while
            the policy, fed detached outputs, still gets gradients.
        keep_outputs: keep every step's output in ``step_outputs``.
    Returns:
        A :class:`Rollout` whose ``outputs`` are the outputs at step T.
    """
    check_stepwise(model)
    T = model.num_steps
    B = batch_size(inputs)
    losses, logits, outs = [], [], []
    plan_at = getattr(policy, "plan_step", None) if policy is not None else None
    planned = None
    with torch.set_grad_enabled(model_grad and torch.is_grad_enabled()):
        state = _first(model.initial_state, model, inputs)
    output = None
    for t in range(1, T + 1):
        with torch.set_grad_enabled(model_grad and torch.is_grad_enabled()):
            state, output = _step(model, t, state, inputs)
            if loss_fn is not None and target is not None:
                loss_t = loss_fn(output, target)
                if loss_t.shape != (B,):
                    raise ValueError(f"loss_fn must return one loss per sample, shape ({B},); got {tuple(loss_t.shape)}")
                losses.append(loss_t)
        if policy is not None and t < T and (plan_at is None or t == plan_at):
            seen = output if model_grad else tree_detach(output)
            if plan_at is None:
                logits.append(_policy_logits(policy, inputs, seen, t, B))
            else:
                planned = planned_logits(policy, inputs, seen, t, B, T)
        if keep_outputs:
            outs.append(output)
    device = tree_leaves(output)[0].device if tree_leaves(output) else None
    return Rollout(
        outputs=output,
        stop_times=torch.full((B,), T, dtype=torch.long, device=device),
        num_steps=T,
        step_outputs=outs if keep_outputs else None,
        losses=torch.stack(losses, dim=1) if losses else None,
        stop_logits=None if policy is None else planned if planned is not None else
        torch.stack(logits, dim=1) if logits else torch.full((B, T - 1), NEVER_STOP_LOGIT, device=device),
    )


def run_with_early_exit(model: Any, inputs: Any, rule: StopRule, *, record_probs: bool = False,
                        compact_every: int | None = None) -> Rollout:
    """Run the model step by step and drop each sample from the batch once ``rule`` says stop.

    A stopped sample costs no further steps: its output is written into the result at once and the
    state and inputs of the samples still running shrink, so later steps run on fewer rows. Step T
    always stops what is left. The rule is consulted only where it can stop:

    - a *planning* rule (``rule.plan_step = s`` and ``rule.plan(view) -> (B,)`` stop times) is asked
      once, at step s (0: before the first step). The batch is then sorted by planned depth, once, and
      every later step runs on a contiguous leading slice of it: no further decision, gather or host
      synchronisation (two at the planning step: the plan's finiteness and the counts);
    - a per-step rule (``rule(view) -> (B,) bool``) is called at the steps ``first_ask(rule)``..T-1,
      with one host synchronisation there (how many stopped) and none elsewhere.

    Inputs are not checked here (this is the hot path): :class:`StoppingModel` checks them once.

    Args:
        model: a step-wise model.
        inputs: batch-first tree.
        rule: see :mod:`learn2stop.core.rules` (fixed depth, given stop times, thresholds on a signal, a
            learned policy, thresholded or sampled).
        record_probs: also return, in ``extras["stop_probs"]``, the (B, T-1) stop probabilities the
            rule reported (NaN where a sample had already stopped); needs a per-step rule with ``last_probs``.
        compact_every: *device mode* for a per-step rule (see :func:`_run_device_mode`): no host
            synchronisation at the steps in between; stopped rows are dropped every this many steps.
    Returns:
        A :class:`Rollout`; ``outputs`` is in input order.
    """
    check_rule(rule)
    if compact_every is not None and getattr(rule, "plan_step", None) is None:
        if record_probs:
            raise ValueError("record_probs=True is not available in device mode (compact_every)")
        return _run_device_mode(model, inputs, rule, compact_every)
    check_stepwise(model)
    T = model.num_steps
    B = batch_size(inputs)
    plan_step = getattr(rule, "plan_step", None)
    first = first_ask(rule)
    state = _first(model.initial_state, model, inputs)
    device = tree_leaves(state)[0].device if tree_leaves(state) else tree_leaves(inputs)[0].device
    active = torch.arange(B, device=device)  # (B_active,) original rows of the running samples
    stop_times = torch.full((B,), T, dtype=torch.long, device=device)
    probs = torch.full((B, max(T - 1, 0)), float("nan"), device=device) if record_probs else None
    result = None  # preallocated on the first write: stopped rows go straight to their place
    remaining: list[int] | None = None  # planned mode: remaining[t] = rows still running after step t
    previous = None

    def finish(rows: slice | Tensor, output: Any, t: int) -> None:
        nonlocal result
        if result is None:
            result = tree_map(lambda x: x.new_empty((B, *x.shape[1:])) if x.dim() > 0 else x, output)
        idx = active[rows]
        tree_zip_apply(lambda dst, src: dst.index_copy_(0, idx, src[rows]), result, output)
        if t < T:
            stop_times[idx] = t

    def plan(t: int, output: Any) -> Any:
        """Ask a planning rule once; sort the running rows by planned depth (the output too, if any)."""
        nonlocal remaining, active, state, inputs
        n = active.numel()
        times = rule.plan(StepView(t, T, inputs, output, None, state, active)).clamp(max(t, 1), T)
        remaining = [0] * (T + 1)
        if n == 1:  # a single sample: its depth is all there is to know (one sync, nothing to sort)
            depth = int(times)
            remaining[t:depth] = [1] * (depth - t)
            return output
        times, order = torch.sort(times, descending=True, stable=True)
        # one host sync: how many rows are still running after each step t..T
        counts = torch.bincount(times, minlength=T + 1).flip(0).cumsum(0).flip(0)  # counts[s] = #(times >= s)
        remaining[t:] = counts[t + 1:].tolist() + [0]
        active, state, inputs = active[order], tree_select(state, order), tree_select(inputs, order)
        return None if output is None else tree_select(output, order)

    if plan_step == 0:
        plan(0, None)
    output = None
    for t in range(1, T + 1):
        if remaining is not None and remaining[t - 1] < active.numel():  # planned mode: keep the leading rows
            keep = slice(0, remaining[t - 1])
            active, state, inputs = active[keep], tree_select(state, keep), tree_select(inputs, keep)
        state, output = _step(model, t, state, inputs)
        if t == T:
            finish(slice(None), output, T)
            break
        if t == plan_step:
            output = plan(t, output)
        if remaining is not None:  # planned: the rows past the plan's count at t stop here, no decision
            n, left = active.numel(), remaining[t]
            if left < n:
                finish(slice(left, n), output, t)
                if left == 0:
                    break
            continue
        if t < first:
            previous = output
            continue
        stop = rule(StepView(t, T, inputs, output, previous, state, active))
        if stop.shape != (active.numel(),) or stop.dtype != torch.bool:
            raise ValueError(f"a stop rule must return a bool tensor of shape ({active.numel()},); "
                             f"got {stop.dtype} {tuple(stop.shape)}")
        if probs is not None:
            if plan_step is not None:
                raise ValueError("record_probs=True needs a per-step rule; this rule plans the depth")
            reported = getattr(rule, "last_probs", None)
            if reported is None:
                raise ValueError("record_probs=True needs a rule that reports stop probabilities (PolicyRule)")
            probs[active, t - 1] = reported.to(probs)
        n = active.numel()
        if n == 1:  # batch of one: a stop simply ends the loop
            if bool(stop):
                finish(slice(None), output, t)
                break
            previous = output
            continue
        # One host synchronisation (the count); rows are then moved with integer indices, which need
        # none: a stable sort puts the continuing rows first, in order, then the stopped ones.
        n_stop = int(stop.sum())
        if n_stop:
            order = torch.argsort(stop.to(torch.int8), stable=True)
            gone, keep = order[n - n_stop:], order[:n - n_stop]
            finish(gone, output, t)
            if n_stop == n:
                break
            active, state, inputs = active[keep], tree_select(state, keep), tree_select(inputs, keep)
            output = tree_select(output, keep)
        previous = output
    extras = {"stop_probs": probs} if probs is not None else {}
    return Rollout(outputs=result, stop_times=stop_times, num_steps=T, extras=extras)


def _run_device_mode(model: Any, inputs: Any, rule: StopRule, compact_every: int) -> Rollout:
    """Early exit without a host synchronisation at every step (for accelerators, where each sync stops the
    host from queueing kernels ahead).

    Between compactions the batch keeps its shape: a stopped row's output is held (``torch.where``) and the
    row keeps being computed (wasted work, bounded by ``compact_every`` steps). Every ``compact_every`` steps
    the count of stopped rows is read (the one sync) and, if any, they are written to the result and dropped.
    Fixed shapes between compactions let the step and the rule be captured (CUDA graphs, ``torch.compile``).
    Stop times and outputs equal the synchronising loop's.
    """
    if isinstance(compact_every, bool) or not isinstance(compact_every, int) or compact_every < 1:
        raise ValueError(f"compact_every must be an integer >= 1; got {compact_every!r}")
    check_stepwise(model)
    T = model.num_steps
    B = batch_size(inputs)
    first = first_ask(rule)
    state = _first(model.initial_state, model, inputs)
    device = tree_leaves(state)[0].device if tree_leaves(state) else tree_leaves(inputs)[0].device
    active = torch.arange(B, device=device)
    stop_times = torch.full((B,), T, dtype=torch.long, device=device)
    result, held, done, times = None, None, None, None  # held: (B_active, ...) outputs of stopped rows

    def flush(rows: Tensor | slice, out: Any) -> None:
        nonlocal result
        if result is None:
            result = tree_map(lambda x: x.new_empty((B, *x.shape[1:])) if x.dim() > 0 else x, out)
        idx = active[rows]
        tree_zip_apply(lambda dst, src: dst.index_copy_(0, idx, src[rows]), result, out)

    previous = None
    for t in range(1, T + 1):
        state, output = _step(model, t, state, inputs)
        if done is not None:  # rows already stopped keep the output of their stop step
            output = tree_zip_map(lambda h, o: torch.where(done.view(-1, *([1] * (o.dim() - 1))), h, o), held, output)
        if t == T:
            flush(slice(None), output)
            if times is not None:
                stop_times[active] = torch.where(done, times, stop_times[active])
            break
        if t >= first:
            stop = rule(StepView(t, T, inputs, output, previous, state, active))
            if done is None:
                done, times = torch.zeros_like(stop), torch.full_like(active, T)
            times = torch.where(stop & ~done, torch.full_like(times, t), times)
            done = done | stop
            held = output
        previous = output
        if done is not None and t % compact_every == 0:
            n_done = int(done.sum())  # the one host synchronisation of this stretch
            if n_done:
                gone, keep = done.nonzero().squeeze(1), (~done).nonzero().squeeze(1)
                flush(gone, output)
                stop_times[active[gone]] = times[gone]
                if n_done == active.numel():
                    break
                active, state, inputs = active[keep], tree_select(state, keep), tree_select(inputs, keep)
                output, times = tree_select(output, keep), times[keep]
                held, previous, done = output, output, done[keep]
    return Rollout(outputs=result, stop_times=stop_times, num_steps=T)


def _step(model: Any, t: int, state: Any, inputs: Any) -> tuple[Any, Any]:
    """(state, output) of step t; the first step's shape or dtype errors are reported in the user's terms."""
    if t > 1:
        state = model.step(t, state, inputs)
        return state, model.readout(t, state, inputs)
    state = _first(lambda i: model.step(1, state, i), model, inputs)
    return state, _first(lambda i: model.readout(1, state, i), model, inputs)


def _first(fn: Callable, model: Any, inputs: Any) -> Any:
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


#: logit used for steps a policy declares it never stops at (sigmoid(-50) ~ 2e-22).
NEVER_STOP_LOGIT = -50.0


def _policy_logits(policy: nn.Module, inputs: Any, output: Any, t: int, B: int) -> Tensor:
    """The policy's stop logits at step t; a policy with ``min_step`` is not even called before it."""
    if t < getattr(policy, "min_step", 1):
        leaf = tree_leaves(output)[0]
        return torch.full((B,), NEVER_STOP_LOGIT, device=leaf.device, dtype=leaf.dtype)
    logits = policy(inputs, output, t)
    if logits.shape != (B,):
        raise ValueError(f"a policy must return one stop logit per sample, shape ({B},); got {tuple(logits.shape)}")
    return logits


def planned_logits(policy: nn.Module, inputs: Any, output: Any, t: int, B: int, T: int) -> Tensor:
    """A planning policy's (B, T-1) stop logits for steps 1..T-1, from its one call at step t = ``plan_step``.

    Steps before t cannot stop any more (their logits are set to ``NEVER_STOP_LOGIT``), so the planned
    q_phi puts its mass on t..T, and every policy rule reads its stop time off these logits at once.
    """
    logits = policy(inputs, output, t)
    if logits.shape != (B, T - 1):
        raise ValueError(f"a planning policy (plan_step={t}) must return the stop logits of steps 1..T-1 at once, "
                         f"shape ({B}, {T - 1}); got {tuple(logits.shape)}")
    if not bool(torch.isfinite(logits[:, t - 1:]).all()):  # one call per rollout: the check is cheap here
        raise ValueError(f"the planning policy returned NaN or inf stop logits at its plan step {t}")
    if t > 1:
        logits = torch.cat([logits.new_full((B, t - 1), NEVER_STOP_LOGIT), logits[:, t - 1:]], dim=1)
    return logits


def threshold_stop_times(stop_logits: Tensor, threshold: float = 0.5) -> Tensor:
    """1-based stop times of the deterministic rule from a full rollout's (B, T-1) stop logits.

    The first t with pi_t > threshold, else T: exactly where :class:`PolicyRule` in threshold mode
    stops, so a full unroll can score early exit without running the model a second time.
    """
    B, Tm1 = stop_logits.shape
    above = torch.cat([torch.sigmoid(stop_logits) > threshold,
                       torch.ones(B, 1, dtype=torch.bool, device=stop_logits.device)], dim=1)
    return above.float().argmax(dim=1) + 1


# ----------------------------------------------------------------------------- stop rules
class FixedDepth:
    """Stop every sample at step ``depth`` (default: T, i.e. never early). Asked once, at that step."""

    def __init__(self, depth: int | None = None):
        if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1):
            raise ValueError(f"depth must be an integer >= 1; got {depth!r}")
        self.depth = depth
        self.first_step = depth if depth is not None else 1 << 30  # full depth: never asked

    def __call__(self, view: StepView) -> Tensor:
        stop = self.depth is not None and view.t >= self.depth
        return torch.full((view.index.numel(),), stop, dtype=torch.bool, device=view.index.device)


class StopAtTimes:
    """Stop each sample at a given 1-based step (e.g. sampled from the oracle): a plan made before step 1.

    Args:
        stop_times: (B,) integer steps >= 1, one per sample of the batch it will be run on.
    """

    plan_step = 0

    def __init__(self, stop_times: Tensor):
        if not isinstance(stop_times, Tensor) or stop_times.dim() != 1 or stop_times.is_floating_point() \
                or stop_times.dtype == torch.bool:
            raise ValueError("stop_times must be a 1-D integer tensor of 1-based steps, one per sample; got "
                             + (f"{stop_times.dtype} of shape {tuple(stop_times.shape)}" if isinstance(stop_times, Tensor)
                                else type(stop_times).__name__))
        if stop_times.numel() and int(stop_times.min()) < 1:
            raise ValueError(f"stop_times must be >= 1 (1-based steps); got a minimum of {int(stop_times.min())}")
        self.stop_times = stop_times

    def plan(self, view: StepView) -> Tensor:
        if self.stop_times.shape[0] <= int(view.index.max()):
            raise ValueError(f"stop_times has {self.stop_times.shape[0]} entries for a batch of {view.index.numel()} samples")
        times = self.stop_times.to(view.index.device)[view.index]
        if int(times.max()) > view.num_steps:
            raise ValueError(f"stop_times go up to step {int(times.max())} but the model has {view.num_steps} steps")
        return times

    def __call__(self, view: StepView) -> Tensor:
        return self.plan(view) <= view.t


class ToleranceRule:
    """Stop when the relative change ||out_t - out_{t-1}|| / ||out_t|| falls below ``tol``.

    The classical convergence test of iterative solvers; ``key`` picks a leaf of a dict output.
    """

    def __init__(self, tol: float, key: str | None = None):
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol > 0 or tol == float("inf"):
            raise ValueError(f"tol must be a finite number > 0; got {tol!r}")
        self.tol, self.key = tol, key

    def __call__(self, view: StepView) -> Tensor:
        out = view.output if self.key is None else view.output[self.key]
        if view.previous_output is None:
            return torch.zeros(out.shape[0], dtype=torch.bool, device=out.device)
        prev = view.previous_output if self.key is None else view.previous_output[self.key]
        diff = (out - prev).flatten(1).norm(dim=1)
        return diff <= self.tol * out.flatten(1).norm(dim=1).clamp_min(1e-12)


class PolicyRule:
    """Ask a learned policy at each step: stop if pi_t > threshold, or stop with probability pi_t.

    A planning policy (one with ``plan_step``) is asked once, at that step, and the same rule reads
    each sample's stop time off its planned stop logits.

    Args:
        policy: ``policy(inputs, output, t) -> (B,)`` stop logits (or (B, T-1) for a planning policy).
        mode: ``"threshold"`` (deterministic) or ``"sample"`` (stochastic, paper's q_phi).
        threshold: stop probability above which a sample stops in threshold mode.
        generator: random generator for sample mode (draws on its device; CPU by default).
    """

    def __init__(self, policy: nn.Module, mode: str = "threshold", threshold: float = 0.5,
                 generator: torch.Generator | None = None):
        if mode not in ("threshold", "sample"):
            raise ValueError(f"mode must be 'threshold' or 'sample'; got {mode!r}")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold < 1:
            raise ValueError(f"threshold must be a number in (0, 1); got {threshold!r}")
        self.policy, self.mode, self.threshold, self.generator = policy, mode, threshold, generator
        self.plan_step = getattr(policy, "plan_step", None)
        self.first_step = int(getattr(policy, "min_step", 1))
        self.last_probs: Tensor | None = None

    def plan(self, view: StepView) -> Tensor:
        from .distributions import log_stop_time_distribution, sample_stop_time

        logits = planned_logits(self.policy, view.inputs, view.output, view.t, view.index.numel(), view.num_steps)
        if self.mode == "threshold":
            return threshold_stop_times(logits, self.threshold)
        return sample_stop_time(log_stop_time_distribution(logits), self.generator) + 1

    def __call__(self, view: StepView) -> Tensor:
        p = torch.sigmoid(_policy_logits(self.policy, view.inputs, view.output, view.t, view.index.numel()))
        self.last_probs = p
        if self.mode == "threshold":
            return p > self.threshold
        gen_device = self.generator.device if self.generator is not None else p.device
        return torch.rand(p.shape, generator=self.generator, device=gen_device).to(p.device) < p


# ----------------------------------------------------------------------------- the wrapper
class StoppingModel(nn.Module):
    """A step-wise model together with its stopping policy: the object users train and deploy.

    Example:
        >>> sm = StoppingModel(model, policy)               # doctest: +SKIP
        >>> result = sm(inputs)                  # early exit with the default rule  # doctest: +SKIP
        >>> result.outputs, result.stop_times, result.steps_computed                   # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, policy: nn.Module | None = None):
        super().__init__()
        check_stepwise(model)
        self.model = model
        self.policy = policy

    @property
    def num_steps(self) -> int:
        return self.model.num_steps

    def unroll(self, inputs: Any, target: Any = None, loss_fn=None, *, use_policy: bool = True,
               model_grad: bool = True, keep_outputs: bool = False) -> Rollout:
        """Full-depth rollout recording per-step losses and stop logits (see :func:`unroll`)."""
        check_inputs(inputs)
        check_batch_first(inputs)
        if target is not None and batch_size(target) != batch_size(inputs):
            raise ValueError(f"target has batch size {batch_size(target)} but the inputs have {batch_size(inputs)}")
        return unroll(self.model, inputs, target=target, loss_fn=loss_fn,
                      policy=self.policy if use_policy else None, model_grad=model_grad, keep_outputs=keep_outputs)

    def forward(self, inputs: Any, rule: StopRule | None = None, *, inference: Any = None,
                mode: str | None = None, threshold: float | None = None, generator: torch.Generator | None = None,
                record_probs: bool = False, compact_every: int | None = None) -> Rollout:
        """Inference that really stops.

        The rule is, in order: ``rule`` (e.g. a calibrated one: ``calibration.make_rule(sm.policy)``);
        the policy with ``mode`` ("threshold" / "sample") and ``threshold`` if either is given; else
        ``inference`` (an :class:`~learn2stop.core.calibration.InferenceConfig`), by default the same
        rule the CLI and validation use (quantile, alpha 0.5). Without a policy: full depth. ``compact_every``:
        the device mode of :func:`run_with_early_exit` (no host synchronisation between compactions).
        """
        if rule is None:
            if self.policy is None:
                rule = FixedDepth()
            elif mode is not None or threshold is not None:
                rule = PolicyRule(self.policy, mode=mode or "threshold",
                                  threshold=0.5 if threshold is None else threshold, generator=generator)
            else:
                from .calibration import InferenceConfig

                rule = (inference or InferenceConfig()).make_rule(self.policy, generator)
        check_inputs(inputs)
        check_batch_first(inputs)
        check_rule(rule)
        return run_with_early_exit(self.model, inputs, rule, record_probs=record_probs, compact_every=compact_every)

    def stop_distribution(self, inputs: Any) -> Tensor:
        """q_phi(t | x) for t = 1..T from a full rollout; shape (B, T)."""
        from .distributions import log_stop_time_distribution

        if self.policy is None:
            raise ValueError("this StoppingModel has no policy")
        return log_stop_time_distribution(self.unroll(inputs).stop_logits).exp()
