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
paper Eq. 2), or a planning policy that gives every step's stop logits at once; its optional members are declared
in :mod:`learn2stop.core.protocols`, and what a full unroll records of it is
:class:`~learn2stop.core.policy_calls.PolicyRecord`'s business, not the loop's.

A *stop rule* (:class:`~learn2stop.core.stop_rule.StopRule`) fills the stopping slot of
:func:`run_with_early_exit`: the loop asks it at its steps and shrinks the batch by the answer, which rows stop now
or a :class:`~learn2stop.core.stop_rule.Plan`. The slot is :mod:`learn2stop.core.stop_rule`, the rules
:mod:`learn2stop.core.rules`, the model's and the policy's calls :mod:`learn2stop.core.steps` and
:mod:`learn2stop.core.policy_calls`, the batch-tree helpers :mod:`learn2stop.core.trees`, and
:class:`~learn2stop.core.model.StoppingModel`, which users hold, on top.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Collection

import torch
from torch import Tensor, nn

from .policy_calls import PolicyRecord
from .shrinking_batch import ShrinkingBatch
from .steps import check_model_inputs, check_stepwise, first_call, take_step
from .stop_rule import Plan, RecordingProbs, StepView, StopRule, as_stop_rule
from .trees import batch_size, take_rows, tree_leaves, tree_map, tree_select, tree_zip_apply, tree_zip_map


# ----------------------------------------------------------------------------- the result


@dataclass
class Rollout:
    """The uniform result of the loop, read by every trainer, metric and plot.

    Attributes:
        outputs: the prediction of each sample at its stop time (batch-first tree, input order).
        stop_times: (B,) 1-based step at which each sample stopped; T for a full-depth run.
        step_outputs: for a full unroll with ``keep_outputs``: T trees, the output at each step.
        losses: (B, T) per-step losses when a target and loss were given to a full unroll.
        stop_logits: (B, T-1) policy logits at steps 1..T-1 in a full unroll; None without policy. For a
            policy that plans twice, those of its first plan.
        replan_log_q: (B, T) a re-planning policy's second plan in a full unroll (log q_phi of steps
            ``replan_step``..T given the run so far); None otherwise.
        replan_step: the step of that second plan; None without one.
    """

    outputs: Any
    stop_times: Tensor
    num_steps: int
    step_outputs: list[Any] | None = None
    losses: Tensor | None = None
    stop_logits: Tensor | None = None
    extras: dict = field(default_factory=dict)
    replan_log_q: Tensor | None = None
    replan_step: int | None = None

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
    grad_steps: Collection[int] | None = None,
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
        grad_steps: the steps whose outputs (readouts) keep gradients; the others' are computed under
            ``torch.no_grad`` (None = every step). A loss weighted only at the last step (a network alone
            trained with its exits attached) then skips the exits' backward: measured, 20 % of a VGG6
            iteration. The states themselves always keep their gradients.
    Returns:
        A :class:`Rollout` whose ``outputs`` are the outputs at step T.
    """
    check_stepwise(model)
    check_model_inputs(model, inputs)
    T = model.num_steps
    B = batch_size(inputs)
    losses, outs = [], []
    record = PolicyRecord(policy, B, T, model_grad) if policy is not None else None
    with torch.set_grad_enabled(model_grad and torch.is_grad_enabled()):
        state = first_call(model.initial_state, model, inputs)
    output = None
    for t in range(1, T + 1):
        with torch.set_grad_enabled(model_grad and torch.is_grad_enabled()):
            state, output = take_step(model, t, state, inputs, grad_steps is None or t in grad_steps)
            if loss_fn is not None and target is not None:
                loss_t = loss_fn(output, target)
                if loss_t.shape != (B,):
                    raise ValueError(f"loss_fn must return one loss per sample, shape ({B},); got {tuple(loss_t.shape)}")
                losses.append(loss_t)
        if record is not None:
            record.observe(t, inputs, output)
        if keep_outputs:
            outs.append(output)
    device = tree_leaves(output)[0].device if tree_leaves(output) else None
    return Rollout(
        outputs=output,
        stop_times=torch.full((B,), T, dtype=torch.long, device=device),
        num_steps=T,
        step_outputs=outs if keep_outputs else None,
        losses=torch.stack(losses, dim=1) if losses else None,
        stop_logits=None if record is None else record.stop_logits(device),
        replan_log_q=None if record is None else record.replanned,
        replan_step=None if record is None or record.replanned is None else record.replan_step,
    )


def run_with_early_exit(model: Any, inputs: Any, rule: StopRule | Callable[[StepView], Tensor], *,
                        record_probs: bool = False, compact_every: int | None = None) -> Rollout:
    """Run the model step by step and drop each sample from the batch once ``rule`` says stop.

    A stopped sample costs no further steps: its output is written into the result at once and the
    state and inputs of the samples still running shrink, so later steps run on fewer rows. Step T
    always stops what is left. The rule (a :class:`StopRule`) is asked only at its ``ask_steps`` and answers
    either which rows stop now (a per-step rule: one host synchronisation there, how many stopped, and none
    elsewhere), or a :class:`Plan` (a planning rule, at its plan and replan steps): the batch is sorted by planned
    depth and every later step runs on a contiguous leading slice of it, with no decision, gather or sync.

    The model is read out (``readout``: an exit head, a decoder) only where something reads it: where the rule
    is asked (and the step before, for its ``previous_output``), at a plan's steps, and at the steps where planned
    rows stop. So full depth costs the network alone plus the loop, not every exit head (the exported graphs
    skip them alike: :mod:`learn2stop.export`).

    Inputs are checked once, here, before the first step (:func:`~learn2stop.core.steps.check_model_inputs`), never
    inside the loop; a policy's NaN stop logits (which would never stop a sample) are refused once, at the end of the
    rollout (:meth:`~learn2stop.core.stop_rule.StopRule.nan_scores`: no work and no host sync at the steps).

    Args:
        model: a step-wise model.
        inputs: batch-first tree.
        rule: see :mod:`learn2stop.core.rules` (fixed depth, given stop times, thresholds on a signal, a
            learned policy, thresholded or sampled), or any callable on a :class:`StepView`.
        record_probs: also return, in ``extras["stop_probs"]``, the (B, T-1) stop probabilities the
            rule reported (NaN where a sample had already stopped); needs a per-step rule with ``last_probs``.
        compact_every: *device mode* for a per-step rule (see :func:`_run_device_mode`): no host
            synchronisation at the steps in between; stopped rows are dropped every this many steps.
    Returns:
        A :class:`Rollout`; ``outputs`` is in input order.
    """
    rule = as_stop_rule(rule)
    check_stepwise(model)
    check_model_inputs(model, inputs)
    rule.check_model(model)
    if compact_every is not None and rule.asks_every_step:
        if record_probs:
            raise ValueError("record_probs=True is not available in device mode (compact_every)")
        return _run_device_mode(model, inputs, rule, compact_every)
    T = model.num_steps
    rule.check_steps(T)
    run = ShrinkingBatch(model, inputs, T)
    if record_probs:
        rule = RecordingProbs(rule, run.B, T, run.active.device)
    asks, reads = rule.ask_steps(T), rule.read_steps(T)  # (and the model is read out where planned rows stop)
    running: list[int] | None = None  # after a plan: running[t] = rows still running after step t
    output = previous = None
    if 0 in asks:  # a plan made before the first step
        running, _ = run.follow(rule.decide(StepView(0, T, run.inputs, None, None, run.state, run.active)), None, 0)
    for t in range(1, T + 1):
        output = run.step(t, t in reads)
        if t == T:
            run.finish(slice(None), output, T)
            break
        if running is not None:  # after a plan: the rows past its count at t stop here, with no decision
            output, previous = run.keep_leading(running[t], output, t, previous)
        if t in asks and not run.done:
            answer = rule.decide(StepView(t, T, run.inputs, output, previous, run.state, run.active))
            if isinstance(answer, Plan):
                running, output = run.follow(answer, output, t)
            else:
                output = run.stop_rows(answer, output, t)
        if run.done:
            break
        previous = output if t + 1 in asks else None  # what the rule reads as previous_output next step
    refuse_nan_scores(rule)
    extras = {"stop_probs": rule.probs} if record_probs else {}
    return Rollout(outputs=run.result, stop_times=run.stop_times, num_steps=T, extras=extras)


def refuse_nan_scores(rule: StopRule) -> None:
    """Refuse, once at the end of a rollout, the NaN stop scores the rule saw (:meth:`StopRule.nan_scores`)."""
    nan = rule.nan_scores()
    if nan is not None:
        t, rows, n = nan
        raise ValueError(f"the stopping policy returned NaN stop logits at step {t} for {rows} of {n} running "
                         f"sample(s); a NaN stop probability never stops a sample (it would run to the last step): "
                         f"check the policy's weights and what it reads")


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
    first = rule.first_ask
    reads = rule.read_steps(T)
    state = first_call(model.initial_state, model, inputs)
    device = tree_leaves(state)[0].device if tree_leaves(state) else tree_leaves(inputs)[0].device
    active = torch.arange(B, device=device)
    stop_times = torch.full((B,), T, dtype=torch.long, device=device)
    result, held, done, times = None, None, None, None  # held: (B_active, ...) outputs of stopped rows

    def flush(rows: Tensor | slice, out: Any) -> None:
        nonlocal result
        if result is None:
            result = tree_map(lambda x: x.new_empty((B, *x.shape[1:])) if x.dim() > 0 else x, out)
        idx = active[rows]
        tree_zip_apply(lambda dst, src: dst.index_copy_(0, idx, take_rows(src, rows)), result, out)

    previous = None
    for t in range(1, T + 1):
        state, output = take_step(model, t, state, inputs, read=t in reads)
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
    refuse_nan_scores(rule)
    return Rollout(outputs=result, stop_times=stop_times, num_steps=T)
