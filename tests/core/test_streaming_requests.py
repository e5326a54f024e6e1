"""The streaming runner at its door and after it: a bad request is refused at submit with the runner unchanged; a
request that fails inside tick() fails alone, with its own error, and gives its slot back; random streams of good and
bad requests never leak a slot and give every good request its output and stop step run alone."""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from learn2stop.core.loop import run_with_early_exit
from learn2stop.core.policy_signals import PolicyRule, QuantileSignal
from learn2stop.core.rules import FixedDepth, SignalRule
from learn2stop.core.signals import ToleranceRule
from learn2stop.core.streaming import RequestFailed, StreamingRunner

from conftest import ToyPolicy, ToyStepModel, randomise

POISON, NAN_MARK = 99.0, -77.0  # a finite first feature the model cannot take at step 2 / the policy scores NaN


class Poisoned(nn.Module):
    """A step-wise model that raises at step ``at`` for any batch holding a row whose first input is ``POISON``:
    a request that passes the door and fails inside a tick (as a solver that diverges on one input)."""

    def __init__(self, model, at: int = 2):
        super().__init__()
        self.inner, self.at, self.num_steps = model, at, model.num_steps

    def initial_state(self, inputs):
        return self.inner.initial_state(inputs)

    def step(self, t, state, inputs):
        if t == self.at and bool((inputs[:, 0] == POISON).any()):
            raise ValueError(f"step {t} cannot take an input of {POISON}")
        return self.inner.step(t, state, inputs)

    def readout(self, t, state, inputs):
        return self.inner.readout(t, state, inputs)


class NaNForMarked(nn.Module):
    """A policy that returns NaN stop logits for rows whose first input is ``NAN_MARK`` (a broken policy head)."""

    def __init__(self, policy):
        super().__init__()
        self.inner = policy
        for name in ("min_step", "plan_step"):
            if hasattr(policy, name):
                setattr(self, name, getattr(policy, name))

    def forward(self, inputs, output, t):
        logits = self.inner(inputs, output, t)
        marked = inputs[:, 0] == NAN_MARK
        return logits.masked_fill(marked.view(-1, *([1] * (logits.dim() - 1))), float("nan"))


def _toy(num_steps=5):
    torch.manual_seed(0)
    model, policy = ToyStepModel(num_steps=num_steps), ToyPolicy(num_steps=num_steps)
    randomise(policy, 3, 2.0)
    policy.min_step = 3  # asked from step 3: a request the model fails at step 2 has not stopped before
    return model.eval(), policy.eval()


def _snapshot(runner):
    return (runner.in_flight, runner.free_slots, runner._next_id, dict(runner.finished), list(runner._rows),
            [list(q) for q in runner.queues], runner._first_spec)


def _check_slots(runner):
    assert runner.in_flight + runner.free_slots == runner.capacity
    assert runner._rows == [sum(len(c) for c in q) for q in runner.queues]
    held = [s for q in runner.queues for c in q for s in c.slots.tolist()]
    assert sorted(held + runner._free) == list(range(runner.capacity))  # every slot held once or free once


# ----------------------------------------------------------------------------- refused at the door
@pytest.mark.parametrize("bad,match", [
    (lambda x: x[:1] * float("nan"), "NaN or inf"), (lambda x: x[:1] / 0, "NaN or inf"),
    (lambda x: x[:1, :2], r"per-sample shape \(2,\), the stream's first request \(3,\)"),
    (lambda x: x[:1].double(), "dtype torch.float64, the stream's first request torch.float32"),
    (lambda x: x[:2], r"one request \(batch size 1\); got batch size 2"),
    (lambda x: x[0], "batch-first"), (lambda x: x[0, 0], "batch-first"),
    (lambda x: x[:1].tolist(), "must be a torch tensor"),
    (lambda x: {"y": x[:1]}, r"the leaves inputs\['y'\]; the stream's first request has inputs$"),
], ids=["nan", "inf", "shape", "dtype", "two-samples", "no-batch-dim", "scalar", "list", "tree"])
def test_a_bad_request_is_refused_at_submit_and_changes_nothing(bad, match):
    model, policy = _toy()
    runner = StreamingRunner(model, PolicyRule(policy, threshold=0.6), max_batch=4, capacity=5)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    runner.submit(x[:1]), runner.tick()
    before = _snapshot(runner)
    with pytest.raises(ValueError, match=match):
        runner.submit(bad(x))
    assert _snapshot(runner) == before
    runner.run_until_idle()
    assert runner.finished[0].ok and runner.free_slots == 5


def test_a_request_unlike_the_first_is_refused_by_name_not_in_torch_cat():
    """(1, 5) among (1, 8) requests used to fail at tick() inside torch.cat, taking the tick's requests with it."""
    torch.manual_seed(0)
    model = ToyStepModel(dim=4, in_dim=8, num_steps=3)
    runner = StreamingRunner(model, FixedDepth(), max_batch=8)
    good = [runner.submit(torch.randn(1, 8)) for _ in range(3)]
    with pytest.raises(ValueError, match=r"inputs has per-sample shape \(5,\), the stream's first request \(8,\)"):
        runner.submit(torch.randn(1, 5))
    runner.run_until_idle()
    assert all(runner.finished[i].stop_time == 3 for i in good) and runner.free_slots == runner.capacity


def test_the_models_declared_input_is_checked_from_the_first_request():
    from learn2stop.tasks.classify.models import build_network

    torch.manual_seed(0)
    net = build_network("vgg6-narrow", 5, 16, fc_width=16).eval()  # input_shape (3, 16, 16), float32
    runner = StreamingRunner(net, FixedDepth(), max_batch=4)
    with pytest.raises(ValueError, match=r"per-sample shape \(3, 8, 8\), the model's declared input .*\(3, 16, 16\)"):
        runner.submit(torch.randn(1, 3, 8, 8))
    with pytest.raises(ValueError, match="dtype torch.float64, the model's declared input"):
        runner.submit(torch.randn(1, 3, 16, 16, dtype=torch.float64))
    assert runner._next_id == 0 and runner._first_spec is None
    runner.submit(torch.randn(1, 3, 16, 16))
    runner.run_until_idle()
    assert runner.finished[0].output.shape == (1, 5)


def test_a_tree_request_is_checked_leaf_by_leaf():
    def tree(n_query=4, k="query"):
        return {"support": torch.randn(1, 6, 2), k: torch.randn(1, n_query, 2)}

    model = ToyStepModel()
    runner = StreamingRunner(model, FixedDepth(), capacity=3)
    runner.submit(tree())
    with pytest.raises(ValueError, match=r"inputs\['query'\] has per-sample shape \(5, 2\), the stream's first "
                                         r"request \(4, 2\)"):
        runner.submit(tree(5))
    with pytest.raises(ValueError, match="the request's inputs have the leaves"):
        runner.submit(tree(k="queries"))
    with pytest.raises(ValueError, match=r"inputs\['support'\] is a 0-dim tensor"):
        runner.submit({"support": torch.tensor(1.0), "query": torch.randn(1, 4, 2)})


@pytest.mark.parametrize("arrived,match", [
    (float("nan"), "finite"), (math.inf, "finite"), ("soon", r"\(a real number\); got str 'soon'"),
    (True, r"\(a real number\); got bool"), (torch.tensor(1.0), r"\(a real number\); got Tensor"),
    (1e300, "in the future"),
])
def test_arrived_must_be_a_finite_time_not_later_than_the_clock(arrived, match):
    model, _ = _toy()
    runner = StreamingRunner(model, FixedDepth(2), clock=lambda: 100.0)
    with pytest.raises(ValueError, match=match):
        runner.submit(torch.randn(1, 3), arrived=arrived)
    assert _snapshot(runner)[:3] == (0, runner.capacity, 0)


def test_arrivals_in_the_past_give_their_latency_on_the_runners_clock():
    import numpy as np

    now = [10.0]
    model, _ = _toy()
    runner = StreamingRunner(model, FixedDepth(2), clock=lambda: now[0])
    a = runner.submit(torch.randn(1, 3), arrived=np.float32(7.5))
    b = runner.submit(torch.randn(1, 3), arrived=9)
    c = runner.submit(torch.randn(1, 3))  # now
    now[0] = 12.0
    runner.run_until_idle()
    assert [runner.finished[i].latency for i in (a, b, c)] == [4.5, 3.0, 2.0]


# ----------------------------------------------------------------------------- failing alone inside a tick
def test_a_request_the_model_raises_for_fails_alone_and_the_tick_finishes_the_others():
    """One request whose step raises among three good ones of the same tick: the three finish as run alone, the
    bad one carries its own error (raised when its output is read), and every slot comes back."""
    model, policy = _toy()
    poisoned = Poisoned(model, at=2)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(2))
    x[2, 0] = POISON
    rule = lambda: PolicyRule(policy, threshold=0.6)  # noqa: E731
    runner = StreamingRunner(poisoned, rule(), max_batch=4, capacity=4)
    ids = [runner.submit(x[i:i + 1]) for i in range(4)]
    runner.run_until_idle()
    assert runner.in_flight == 0 and runner.free_slots == 4 and sorted(runner.finished) == ids
    bad = runner.finished[ids[2]]
    assert not bad.ok and bad.step == 2 and "cannot take an input of 99" in str(bad.error)
    with pytest.raises(RequestFailed, match="failed at step 2: ValueError: step 2 cannot take") as info:
        bad.output
    assert info.value.__cause__ is bad.error
    with pytest.raises(RequestFailed):
        bad.stop_time
    for i in (0, 1, 3):
        alone = run_with_early_exit(model, x[i:i + 1], rule())
        assert runner.finished[ids[i]].stop_time == int(alone.stop_times)
        torch.testing.assert_close(runner.finished[ids[i]].output, alone.outputs)


@pytest.mark.parametrize("kind", ["per-step", "planned", "quantile"])
def test_a_policy_that_scores_a_request_nan_fails_that_request_not_runs_it_to_full_depth(tiny_lista, kind):
    """A NaN stop logit is no decision: a per-step policy's, a planning policy's (which the loop refuses for the
    whole batch) and a quantile rule's (whose NaN score the loop refuses, StopRule.nan_rows) fail the request they
    scored, alone."""
    model, policy, planner, x = tiny_lista
    x = x[:6].clone()
    x[3, 0] = NAN_MARK
    make = {"per-step": lambda p: PolicyRule(p, threshold=0.4), "planned": lambda p: PolicyRule(p, threshold=0.3),
            "quantile": lambda p: SignalRule(QuantileSignal(p), QuantileSignal.from_param(0.5))}[kind]
    used = planner if kind == "planned" else policy
    runner = StreamingRunner(model, make(NaNForMarked(used)), max_batch=6, capacity=6)
    ids = [runner.submit(x[i:i + 1]) for i in range(6)]
    runner.run_until_idle()
    assert runner.free_slots == 6 and len(runner.finished) == 6
    bad = runner.finished[ids[3]]
    assert not bad.ok and bad.step == (planner.plan_step if kind == "planned" else policy.min_step)
    assert "NaN" in str(bad.error)
    good = [i for i in range(6) if i != 3]
    ref = run_with_early_exit(model, x[good], make(used))
    assert sorted(set(ref.stop_times.tolist())) != [model.num_steps]  # the good requests stop at their own steps
    assert [runner.finished[ids[i]].stop_time for i in good] == ref.stop_times.tolist()
    torch.testing.assert_close(torch.cat([runner.finished[ids[i]].output for i in good]), ref.outputs)


# ----------------------------------------------------------------------------- properties of random streams
def _lista():
    """A 7-step LISTA and a depth planner that plans at step 3 (random weights, as conftest's ``tiny_lista``)."""
    from learn2stop.tasks.sparse.models import LISTA
    from learn2stop.tasks.sparse.policy import SparseDepthPlanner

    A = torch.randn(13, 27, generator=torch.Generator().manual_seed(0)) / 13 ** 0.5
    planner = SparseDepthPlanner(A, 7, hidden=(16,))
    randomise(planner, 2)
    planner.min_step = 3
    return LISTA(A, 7).eval(), planner.eval()


_MODEL, _POLICY = _toy(num_steps=5)
_LISTA, _PLANNER = _lista()
_POOL = torch.randn(16, 3, generator=torch.Generator().manual_seed(5))  # the good requests' inputs
_LISTA_POOL = torch.randn(16, 13, generator=torch.Generator().manual_seed(6))
RULES = {  # name: (model, the good requests' inputs, the rule, whether its policy's NaN is seen)
    "threshold": (_MODEL, _POOL, lambda: PolicyRule(NaNForMarked(_POLICY), threshold=0.6), True),
    "quantile-memory": (_MODEL, _POOL, lambda: SignalRule(QuantileSignal(NaNForMarked(_POLICY)),
                                                          QuantileSignal.from_param(0.5)), True),
    "fixed3": (_MODEL, _POOL, lambda: FixedDepth(3), False),
    "tolerance": (_MODEL, _POOL, lambda: ToleranceRule(0.3), False),
    "planned": (_LISTA, _LISTA_POOL, lambda: PolicyRule(NaNForMarked(_PLANNER), threshold=0.3), True),
}

BAD = {  # refused at the door: (inputs from a good row, arrived)
    "nan": lambda x: (x * float("nan"), None), "inf": lambda x: (x + math.inf, None),
    "shape": lambda x: (x[:, :2], None), "dtype": lambda x: (x.double(), None),
    "two": lambda x: (x.repeat(2, 1), None), "no-batch": lambda x: (x[0], None),
    "arrived-nan": lambda x: (x, float("nan")), "arrived-str": lambda x: (x, "soon"),
    "arrived-bool": lambda x: (x, False), "arrived-future": lambda x: (x, 1e300),
}
ops = st.lists(st.one_of(
    st.tuples(st.just("good"), st.integers(0, len(_POOL) - 1)),
    st.tuples(st.just("bad"), st.sampled_from(sorted(BAD))),
    st.tuples(st.just("poison"), st.integers(0, len(_POOL) - 1)),
    st.tuples(st.just("nan-policy"), st.integers(0, len(_POOL) - 1)),
    st.tuples(st.just("tick"), st.integers(1, 4)),
), min_size=1, max_size=40)


@pytest.mark.parametrize("rule_name", sorted(RULES))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seq=ops, max_batch=st.integers(1, 5), capacity=st.integers(1, 7))
def test_random_streams_never_leak_a_slot_and_serve_every_good_request_as_alone(rule_name, seq, max_batch, capacity):
    model, pool, make_rule, nan_counts = RULES[rule_name]
    runner = StreamingRunner(Poisoned(model, at=2), make_rule(), max_batch=max_batch, capacity=capacity)
    want: dict[int, object] = {}  # id -> pool row (a good request) or the kind of failure
    for op, arg in seq:
        if op == "tick":
            for _ in range(arg):
                runner.tick()
                _check_slots(runner)
            continue
        if op == "bad":
            if arg in ("shape", "dtype") and not want:
                continue  # unlike nothing yet: the first request sets the stream's shape and dtype
            inputs, arrived = BAD[arg](pool[:1])
            before = _snapshot(runner)
            with pytest.raises(ValueError):
                runner.submit(inputs, arrived=arrived)
            assert _snapshot(runner) == before
            continue
        x = pool[arg:arg + 1].clone()
        if op == "poison":
            x[0, 0] = POISON
        elif op == "nan-policy":
            x[0, 0] = NAN_MARK
        if runner.free_slots == 0:
            before = _snapshot(runner)
            with pytest.raises(RuntimeError, match="capacity"):
                runner.submit(x)
            assert _snapshot(runner) == before
            continue
        fails = op == "poison" or (op == "nan-policy" and nan_counts)
        want[runner.submit(x)] = op if fails else x  # a marked input is a good one to a rule that reports no probs
        _check_slots(runner)
    runner.run_until_idle()
    _check_slots(runner)
    assert runner.in_flight == 0 and runner.free_slots == capacity and sorted(runner.finished) == sorted(want)
    for rid, what in want.items():
        got = runner.finished[rid]
        if what == "poison":
            assert "cannot take an input of 99" in str(got.error) and got.step == 2
        elif what == "nan-policy":
            assert "NaN" in str(got.error) and got.step == 3  # where the policy is first asked
        else:
            assert got.ok, f"good request {rid} failed: {got.error!r}"
            alone = run_with_early_exit(model, what, make_rule())
            assert got.stop_time == int(alone.stop_times)
            torch.testing.assert_close(got.output, alone.outputs)
