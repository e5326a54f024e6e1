"""The rule registry, entry by entry, and the early-exit loop against a plain reference loop for every rule.

Every registered rule is constructible from its entry, calibration refuses exactly the parameters outside the
entry's range, every rule the runtime claims to run has a numpy rule that stops where the torch rule does, and
``run_with_early_exit`` gives the stop times, outputs and computed steps of a plain ``for t in range(T)`` loop that
never shrinks, sorts or plans ahead (on a row-wise model, so that a row's numbers do not depend on the rows around it).
"""
import math

import numpy as np
import pytest
import torch
from torch import nn

from learn2stop.core.calibration_file import Calibration
from learn2stop.core.inference import InferenceConfig
from learn2stop.core.stop_rule import StepView, as_stop_rule
from learn2stop.core.loop import run_with_early_exit, unroll
from learn2stop.core.rules import FixedDepth, StopAtTimes, first_crossing, signal_trace
from learn2stop.core.policy_signals import PolicyRule
from learn2stop.core.signals import ToleranceRule
from learn2stop.core.signal_registry import make_signal
from learn2stop.core.distributions import stop_logits_from_distribution
from learn2stop.runtime.registry import OFFERED_BY, get_rule, list_rules
from learn2stop.utils.config import ConfigError

T = 7
PARAMS = (-1.0, 0.0, 0.3, 1.0, 1.5, 2.0, 3.0, 100.0)


class Rowwise(nn.Module):
    """A step-wise model whose every operation is row-wise (no matmul across rows), logits of 5 classes; counts the
    rows it steps."""

    num_steps = T

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a, self.b = nn.Parameter(torch.randn(5, generator=g)), nn.Parameter(torch.randn(5, generator=g))
        self.rows = 0

    def initial_state(self, x):
        return x

    def step(self, t, state, x):
        self.rows += state.shape[0]
        return torch.tanh(self.a * state + self.b * x) + 0.05 * t

    def readout(self, t, state, x):
        return state * (1 + 0.3 * t)


class StepPolicy(nn.Module):
    """A per-step policy asked from step 2."""

    min_step = 2

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, generator=torch.Generator().manual_seed(1)))

    def forward(self, x, out, t):
        return 2 * (out * self.w).sum(1) + 0.4 * t - 1


class Planner(nn.Module):
    """A planning policy (plan at step 2), planning again at step 4 when ``replan``; row-wise throughout."""

    plan_step = 2

    def __init__(self, replan=False):
        super().__init__()
        g = torch.Generator().manual_seed(2)
        self.u, self.v = nn.Parameter(3 * torch.randn(T, generator=g)), nn.Parameter(torch.randn(T, generator=g))
        self.u2, self.v2 = nn.Parameter(3 * torch.randn(T, generator=g)), nn.Parameter(torch.randn(T, generator=g))
        self.replan_step = 4 if replan else None

    def plan_log_q(self, x, out, t):
        return torch.log_softmax(out[:, :1] * self.u + out[:, 1:2] * self.v, dim=1)

    def forward(self, x, out, t):
        return stop_logits_from_distribution(self.plan_log_q(x, out, t))

    def replan_log_q(self, x, out, previous, t):
        return torch.log_softmax((out - previous)[:, :1] * self.u2 + out[:, 1:2] * self.v2, dim=1)


def reference(model, x, rule):
    """A plain loop: every step on the whole batch, the rule asked on the rows still running (in input order)."""
    r = as_stop_rule(rule)
    B = x.shape[0]
    state, previous, planned = model.initial_state(x), None, None
    stop_times = torch.full((B,), T, dtype=torch.long)
    running = torch.ones(B, dtype=torch.bool)
    result = None

    def view(t, idx, out):
        return StepView(t, T, x[idx], None if out is None else out[idx], None if previous is None else previous[idx],
                        state[idx], idx)

    if r.plan_step == 0:
        planned = r.plan(view(0, torch.arange(B), None)).clamp(1, T)
    for t in range(1, T + 1):
        state = model.step(t, state, x)
        out = model.readout(t, state, x)
        result = torch.empty_like(out) if result is None else result
        idx = running.nonzero().squeeze(1)
        if t == T:
            result[idx] = out[idx]
            break
        if t == r.plan_step:
            planned = r.plan(view(t, idx, out)).clamp(t, T)
        if t == r.replan_step:
            late = idx[planned[idx] > t]
            if late.numel():
                planned[late] = r.replan(view(t, late, out)).clamp(t, T)
        if planned is not None:
            stop = planned[idx] == t
        elif t >= r.first_ask:
            stop = r(view(t, idx, out))
        else:
            stop = torch.zeros(idx.numel(), dtype=torch.bool)
        gone = idx[stop]
        result[gone], stop_times[gone], running[gone] = out[gone], t, False
        previous = out
        if not running.any():
            break
    return result, stop_times


def _thresholds(make, model, x):
    """Score thresholds halfway between the signal's scores on this batch (no tie with a score), and +inf."""
    with torch.no_grad():
        trace = signal_trace(make(), unroll(model, x, keep_outputs=True).step_outputs, x)
    values = trace[torch.isfinite(trace)].unique()
    picks = [int(q * (values.numel() - 1)) for q in (0.1, 0.5, 0.9)]
    return [float((values[i] + values[i + 1]) / 2) for i in picks] + [math.inf]


def _cases():
    """(id, rule factory, score thresholds or None) for every registered rule, with each kind of policy it takes."""
    cases = []
    for name in list_rules():
        entry = get_rule(name)
        policies = ([("planner", Planner()), ("replanner", Planner(replan=True))] if entry.plans else
                    [("step", StepPolicy()), ("planner", Planner())] if entry.needs_policy else [("none", None)])
        for pid, policy in policies:
            cases.append((f"{name}-{pid}", lambda name=name, policy=policy: make_signal(name, policy)))
    return cases


CASES = _cases()


@pytest.mark.parametrize("batch", [1, 23])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_rule_stops_as_a_plain_reference_loop(case, batch):
    _, signal = case
    torch.manual_seed(batch)
    model, x = Rowwise().eval(), torch.randn(max(batch, 23), 5)
    thresholds = _thresholds(signal, model, x)  # from the whole batch: a batch of one still crosses at each
    x = x[:batch]
    with torch.no_grad():
        for thr in thresholds:
            want_out, want_t = reference(model, x, signal().rule(thr))
            model.rows = 0
            got = run_with_early_exit(model, x, signal().rule(thr))
            assert torch.equal(got.stop_times, want_t), (case[0], thr)
            assert torch.equal(got.outputs, want_out), (case[0], thr)
            assert model.rows == got.steps_computed == int(want_t.sum()), (case[0], thr)


OTHER_RULES = {
    "stop-at-times": lambda: StopAtTimes(torch.tensor([3, 1, 7, 2, 5, 5, 4, 6, 1, 7, 2])),
    "fixed-3": lambda: FixedDepth(3),
    "full-depth": lambda: FixedDepth(),
    "tolerance-rule": lambda: ToleranceRule(0.9),
    "sampled-step": lambda: PolicyRule(StepPolicy(), mode="sample", generator=torch.Generator().manual_seed(3)),
    "sampled-planner": lambda: PolicyRule(Planner(), mode="sample", generator=torch.Generator().manual_seed(3)),
    "a-function": lambda: (lambda v: v.output[:, 0] > 0.9),
}


@pytest.mark.parametrize("name", sorted(OTHER_RULES))
def test_rules_beyond_a_signal_threshold_stop_as_the_reference_loop(name):
    torch.manual_seed(4)
    model, x = Rowwise().eval(), torch.randn(11, 5)
    with torch.no_grad():
        want_out, want_t = reference(model, x, OTHER_RULES[name]())
        model.rows = 0
        got = run_with_early_exit(model, x, OTHER_RULES[name]())
    assert torch.equal(got.stop_times, want_t) and torch.equal(got.outputs, want_out)
    assert model.rows == int(want_t.sum())
    assert name in ("full-depth",) or (want_t < T).any()  # the case stops something early


# ----------------------------------------------------------------------------- the entries themselves
@pytest.mark.parametrize("name", list_rules())
def test_every_entry_is_constructible_and_its_range_is_what_calibration_accepts(name):
    entry = get_rule(name)
    assert entry.offered_by in OFFERED_BY and entry.signal is not None and entry.signal.name == name
    assert entry.signal.param_name == entry.param_name and entry.signal.needs_policy == entry.needs_policy
    policy = Planner() if entry.plans else StepPolicy() if entry.needs_policy else None
    accepted = [p for p in PARAMS if entry.in_range(p)]
    assert accepted, name
    for p in PARAMS:
        if entry.in_range(p):
            rule = InferenceConfig(rule=name, param=p).make_rule(policy)
            assert callable(as_stop_rule(rule).decide)
            cal = Calibration.from_dict({"rule": name, "threshold": entry.signal.from_param(p), "param": p, "target": {}})
            assert cal.param == p
        else:
            with pytest.raises(ConfigError, match=rf"inference.param: the {name} rule's parameter must be"):
                InferenceConfig(rule=name, param=p)
            with pytest.raises(ConfigError, match=rf"param: the {name} rule's parameter must be"):
                Calibration.from_dict({"rule": name, "threshold": 0.0, "param": p, "target": {}})


def test_the_registry_lists_by_what_offers_a_rule_and_refuses_a_bad_entry():
    assert list_rules(offered_by="policy") == ["threshold", "quantile", "price"]
    assert list_rules(offered_by="classifier") == ["confidence", "entropy", "patience"]
    assert list_rules(plans=True) == ["price"] and "patience" not in list_rules(runtime=True)
    with pytest.raises(KeyError, match="unknown stop rule 'bogus'; available: confidence"):
        get_rule("bogus")
    from learn2stop.runtime.registry import RuleEntry, attach
    with pytest.raises(ValueError, match="offered_by must be one of"):
        RuleEntry("x", "x", "", lambda p: True, offered_by="everyone")
    with pytest.raises(KeyError, match="already has a signal"):
        attach("quantile", signal=type("Other", (), {}))


RUNTIME_CASES = [n for n in list_rules(runtime=True)]


@pytest.mark.parametrize("name", RUNTIME_CASES)
def test_every_rule_the_runtime_claims_it_runs_as_the_torch_rule(name):
    """The numpy rule, asked on a full rollout's outputs (or plan) at every step as the runtime asks it, stops each
    row where the torch rule's offline trace does."""
    from learn2stop.runtime.rules import make_rule

    entry = get_rule(name)
    assert entry.numpy_rule is not None, f"the registry says the runtime runs {name!r}, but no numpy rule is attached"
    if name == "fixed":  # the runtime ends the export at the depth: nobody is asked
        assert make_rule({"name": "fixed", "threshold": None}).threshold == np.inf
        return
    torch.manual_seed(5)
    model, x = Rowwise().eval(), torch.randn(31, 5)
    policy = Planner() if entry.plans else StepPolicy() if entry.needs_policy else None
    signal = make_signal(name, policy)
    with torch.no_grad():
        full = unroll(model, x, keep_outputs=True, policy=policy)
        trace = signal_trace(signal, full.step_outputs, x)
    for thr in _thresholds(lambda: make_signal(name, policy), model, x)[:3]:
        want = first_crossing(trace, thr).numpy()
        rule = make_rule({"name": name, "threshold": thr})
        if entry.plans:
            got = rule.plan_stop_steps(full.stop_logits.numpy(), policy.plan_step)
        else:
            rule.start(x.shape[0])
            got = np.full(x.shape[0], T)
            # the runtime asks a policy rule from its min_step, an output rule from step 1 (a tolerance test keeps
            # the previous output itself)
            for t in range(signal.first_step if entry.needs_policy else 1, T):
                logit = full.stop_logits[:, t - 1].numpy() if entry.needs_policy else None
                stop = rule.decide(t, full.step_outputs[t - 1].numpy(), logit)
                got = np.where((got == T) & stop, t, got)
        assert (got == want).all(), (name, thr)
