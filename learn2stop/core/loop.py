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
which saves its cost where it would never stop. A *stop rule* fills the stopping slot of :func:`run_with_early_exit`: a fixed depth,
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
    check_inputs(inputs)
    T = model.num_steps
    B = batch_size(inputs)
    losses, logits, outs = [], [], []
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
        if policy is not None and t < T:
            seen = output if model_grad else tree_detach(output)
            logits.append(_policy_logits(policy, inputs, seen, t, B))
        if keep_outputs:
            outs.append(output)
    device = tree_leaves(output)[0].device if tree_leaves(output) else None
    return Rollout(
        outputs=output,
        stop_times=torch.full((B,), T, dtype=torch.long, device=device),
        num_steps=T,
        step_outputs=outs if keep_outputs else None,
        losses=torch.stack(losses, dim=1) if losses else None,
        stop_logits=(torch.stack(logits, dim=1) if logits else _empty_logits(B, device)) if policy is not None else None,
    )


def run_with_early_exit(model: Any, inputs: Any, rule: StopRule, *, record_probs: bool = False) -> Rollout:
    """Run the model step by step and drop each sample from the batch once ``rule`` says stop.

    A stopped sample costs no further steps: the state, the inputs and the active batch shrink,
    so later steps run on fewer rows. Step T always stops what is left.

    Args:
        model: a step-wise model.
        inputs: batch-first tree.
        rule: ``rule(StepView) -> (B_active,) bool``; see :class:`PolicyRule`, :class:`FixedDepth`,
            :class:`StopAtTimes`, :class:`ToleranceRule`.
        record_probs: also return, in ``extras["stop_probs"]``, the (B, T-1) stop probabilities the
            rule reported (NaN where a sample had already stopped); needs a rule with ``last_probs``.
    Returns:
        A :class:`Rollout`; ``outputs`` is in input order.
    """
    check_stepwise(model)
    check_inputs(inputs)
    T = model.num_steps
    B = batch_size(inputs)
    state = _first(model.initial_state, model, inputs)
    device = tree_leaves(state)[0].device if tree_leaves(state) else tree_leaves(inputs)[0].device
    active = torch.arange(B, device=device)
    stop_times = torch.full((B,), T, dtype=torch.long, device=device)
    probs = torch.full((B, max(T - 1, 0)), float("nan"), device=device) if record_probs else None
    done_index, done_outputs = [], []
    previous = None
    for t in range(1, T + 1):
        state, output = _step(model, t, state, inputs)
        if t == T:
            done_index.append(active)
            done_outputs.append(output)
            break
        stop = rule(StepView(t, T, inputs, output, previous, state, active))
        if stop.shape != (active.numel(),) or stop.dtype != torch.bool:
            raise ValueError(f"a stop rule must return a bool tensor of shape ({active.numel()},); "
                             f"got {stop.dtype} {tuple(stop.shape)}")
        if probs is not None:
            reported = getattr(rule, "last_probs", None)
            if reported is None:
                raise ValueError("record_probs=True needs a rule that reports stop probabilities (PolicyRule)")
            probs[active, t - 1] = reported.to(probs)
        # One host synchronisation per step (the count); rows are then moved with integer indices,
        # which need none: a stable sort puts the continuing rows first, in order, then the stopped ones.
        n_stop = int(stop.sum())
        if n_stop:
            order = torch.argsort(stop.to(torch.int8), stable=True)
            gone, keep = order[active.numel() - n_stop:], order[:active.numel() - n_stop]
            done_index.append(active[gone])
            done_outputs.append(tree_select(output, gone))
            stop_times[active[gone]] = t
            if n_stop == active.numel():
                break
            active, state, inputs = active[keep], tree_select(state, keep), tree_select(inputs, keep)
            output = tree_select(output, keep)
        previous = output
    order = torch.cat(done_index)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(B, device=device)
    outputs = tree_select(tree_cat(done_outputs), inverse)
    extras = {"stop_probs": probs} if probs is not None else {}
    return Rollout(outputs=outputs, stop_times=stop_times, num_steps=T, extras=extras)


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
    except RuntimeError as e:
        shapes = [tuple(x.shape) for x in tree_leaves(inputs)]
        dtypes = sorted({str(x.dtype) for x in tree_leaves(inputs)})
        raise ValueError(f"{type(model).__name__} cannot take inputs of shape {shapes[0] if len(shapes) == 1 else shapes} "
                         f"and dtype {', '.join(dtypes)}: {str(e).splitlines()[0]}") from None


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


def _empty_logits(B: int, device) -> Tensor:
    return torch.zeros(B, 0, device=device)


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
    """Stop every sample at step ``depth`` (default: T, i.e. never early)."""

    def __init__(self, depth: int | None = None):
        if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1):
            raise ValueError(f"depth must be an integer >= 1; got {depth!r}")
        self.depth = depth

    def __call__(self, view: StepView) -> Tensor:
        stop = self.depth is not None and view.t >= self.depth
        return torch.full((view.index.numel(),), stop, dtype=torch.bool, device=view.index.device)


class StopAtTimes:
    """Stop each sample at a given 1-based step (e.g. sampled from the oracle)."""

    def __init__(self, stop_times: Tensor):
        self.stop_times = stop_times

    def __call__(self, view: StepView) -> Tensor:
        return self.stop_times.to(view.index.device)[view.index] <= view.t


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

    Args:
        policy: ``policy(inputs, output, t) -> (B,)`` stop logits.
        mode: ``"threshold"`` (deterministic) or ``"sample"`` (stochastic, paper's q_phi).
        threshold: stop probability above which a sample stops in threshold mode.
        generator: random generator for sample mode.
    """

    def __init__(self, policy: nn.Module, mode: str = "threshold", threshold: float = 0.5,
                 generator: torch.Generator | None = None):
        if mode not in ("threshold", "sample"):
            raise ValueError(f"mode must be 'threshold' or 'sample'; got {mode!r}")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold < 1:
            raise ValueError(f"threshold must be a number in (0, 1); got {threshold!r}")
        self.policy, self.mode, self.threshold, self.generator = policy, mode, threshold, generator
        self.last_probs: Tensor | None = None

    def __call__(self, view: StepView) -> Tensor:
        p = torch.sigmoid(_policy_logits(self.policy, view.inputs, view.output, view.t, view.index.numel()))
        self.last_probs = p
        if self.mode == "threshold":
            return p > self.threshold
        u = torch.rand(p.shape, generator=self.generator, device="cpu").to(p.device)
        return u < p


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
        return unroll(self.model, inputs, target=target, loss_fn=loss_fn,
                      policy=self.policy if use_policy else None, model_grad=model_grad, keep_outputs=keep_outputs)

    def forward(self, inputs: Any, rule: StopRule | None = None, *, inference: Any = None,
                mode: str | None = None, threshold: float | None = None, generator: torch.Generator | None = None,
                record_probs: bool = False) -> Rollout:
        """Inference that really stops.

        The rule is, in order: ``rule`` (e.g. a calibrated one: ``calibration.make_rule(sm.policy)``);
        the policy with ``mode`` ("threshold" / "sample") and ``threshold`` if either is given; else
        ``inference`` (an :class:`~learn2stop.core.calibration.InferenceConfig`), by default the same
        rule the CLI and validation use (quantile, alpha 0.5). Without a policy: full depth.
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
        return run_with_early_exit(self.model, inputs, rule, record_probs=record_probs)

    def stop_distribution(self, inputs: Any) -> Tensor:
        """q_phi(t | x) for t = 1..T from a full rollout; shape (B, T)."""
        from .distributions import log_stop_time_distribution

        if self.policy is None:
            raise ValueError("this StoppingModel has no policy")
        return log_stop_time_distribution(self.unroll(inputs).stop_logits).exp()
