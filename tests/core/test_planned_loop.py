"""The lean loop: rules asked only where they may stop, planning policies, and the frontier in time."""
import math

import pytest
import torch
from torch import nn

from conftest import ToyStepModel
from learn2stop.core import (FixedDepth, PolicyRule, QuantileSignal, SignalRule, StopAtTimes, StoppingModel,
                             ToleranceSignal, first_crossing, log_stop_time_distribution, run_with_early_exit,
                             signal_trace, unroll)
from learn2stop.core.distributions import stop_logits_from_distribution


class Planner(nn.Module):
    """A planning policy: at ``plan_step`` it returns the stop logits of every step at once."""

    def __init__(self, T, plan_step):
        super().__init__()
        self.T, self.plan_step, self.calls = T, plan_step, 0
        self.net = nn.Linear(5, T)

    def forward(self, y, x, t):
        assert t == self.plan_step
        self.calls += 1
        return stop_logits_from_distribution(torch.log_softmax(self.net(x), dim=1))


class CountingRule:
    """A per-step rule that records the steps it is asked at."""

    def __init__(self, first_step, stop_at):
        self.first_step, self.stop_at, self.asked = first_step, stop_at, []

    def __call__(self, view):
        self.asked.append(view.t)
        return torch.full((view.index.numel(),), view.t >= self.stop_at, dtype=torch.bool)


def test_stop_logits_from_distribution_inverts_q():
    log_q = torch.log_softmax(torch.randn(6, 9), dim=1)
    torch.testing.assert_close(log_stop_time_distribution(stop_logits_from_distribution(log_q)), log_q, atol=1e-5, rtol=0)


@pytest.mark.parametrize("batch", [1, 13])
def test_rule_is_asked_only_at_its_declared_steps(batch):
    model = ToyStepModel(num_steps=6)
    rule = CountingRule(first_step=3, stop_at=5)
    r = run_with_early_exit(model, torch.randn(batch, 3), rule)
    assert rule.asked == [3, 4, 5] and (r.stop_times == 5).all()
    fixed = CountingRule(first_step=10, stop_at=1)  # never asked before T: full depth, no decision at all
    assert (run_with_early_exit(model, torch.randn(batch, 3), fixed).stop_times == 6).all() and fixed.asked == []


@pytest.mark.parametrize("batch", [1, 2, 37])
def test_planned_stop_times_match_full_depth_outputs_and_skip_work(batch):
    torch.manual_seed(0)
    model = ToyStepModel(num_steps=5)
    y = torch.randn(batch, 3)
    times = torch.randint(1, 6, (batch,))
    full = unroll(model, y, keep_outputs=True)
    model.calls = 0
    r = run_with_early_exit(model, y, StopAtTimes(times))
    assert (r.stop_times == times).all()
    torch.testing.assert_close(r.outputs, torch.stack([full.step_outputs[t - 1][i] for i, t in enumerate(times.tolist())]))
    assert model.calls == int(times.sum())


def test_planning_policy_asked_once_and_rules_agree_online_and_offline():
    torch.manual_seed(1)
    T, s = 6, 3
    model, planner = ToyStepModel(num_steps=T), Planner(T, plan_step=s)
    y = torch.randn(40, 3)
    with torch.no_grad():
        full = unroll(model, y, policy=planner, keep_outputs=True)
        assert planner.calls == 1 and full.stop_logits.shape == (40, T - 1)
        assert (full.stop_logits[:, :s - 1] == -50.0).all()  # no stop before the plan step
        for alpha in (0.2, 0.5, 0.9):
            signal = QuantileSignal(planner)
            offline = first_crossing(signal_trace(signal, full.step_outputs, y), signal.from_param(alpha))
            planner.calls = 0
            online = run_with_early_exit(model, y, SignalRule.from_param(QuantileSignal(planner), alpha))
            assert planner.calls == 1
            assert (online.stop_times == offline).all() and (online.stop_times >= s).all()
            torch.testing.assert_close(online.outputs, torch.stack(
                [full.step_outputs[t - 1][i] for i, t in enumerate(offline.tolist())]))
        r = StoppingModel(model, planner)(y, threshold=0.5)  # PolicyRule plans too
        p = torch.sigmoid(full.stop_logits)
        expected = torch.cat([p > 0.5, torch.ones(40, 1, dtype=torch.bool)], 1).float().argmax(1) + 1
        assert (r.stop_times == expected).all()


def test_tolerance_asked_from_step_two_matches_its_trace():
    torch.manual_seed(2)
    model = ToyStepModel(num_steps=6)
    y = torch.randn(25, 3)
    full = unroll(model, y, keep_outputs=True)
    trace = signal_trace(ToleranceSignal(), full.step_outputs, y)
    assert torch.isinf(trace[:, 0]).all()
    thr = float(trace[:, 2].median())
    online = run_with_early_exit(model, y, SignalRule(ToleranceSignal(), thr))
    assert (online.stop_times == first_crossing(trace, thr)).all()


def test_stop_at_times_refuses_bad_plans():
    with pytest.raises(ValueError, match="stop_times must be >= 1"):
        StopAtTimes(torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="integer"):
        StopAtTimes(torch.tensor([1.0, 2.5]))
    with pytest.raises(ValueError, match="entries for a batch"):
        run_with_early_exit(ToyStepModel(num_steps=3), torch.randn(4, 3), StopAtTimes(torch.tensor([1, 2])))
    with pytest.raises(ValueError, match="the model has 3 steps"):
        run_with_early_exit(ToyStepModel(num_steps=3), torch.randn(2, 3), StopAtTimes(torch.tensor([1, 7])))


def test_price_rule_is_argmax_of_repriced_plan_online_and_offline():
    from learn2stop.core.policy_signals import PriceSignal

    torch.manual_seed(3)
    T, s = 7, 2
    model, planner = ToyStepModel(num_steps=T), Planner(T, plan_step=s)
    with torch.no_grad():
        planner.net.weight.mul_(8)  # a spread of plans
        y = torch.randn(60, 3)
        full = unroll(model, y, policy=planner, keep_outputs=True)
    log_q = log_stop_time_distribution(full.stop_logits)
    c = torch.arange(1, T + 1) / T
    trace = signal_trace(PriceSignal(planner), full.step_outputs, y)
    depths = set()
    for price in (0.0, 0.5, 2.0, 8.0, 30.0):
        expected = (log_q - price * c).argmax(dim=1) + 1  # the re-priced plan's most likely step
        assert (first_crossing(trace, PriceSignal.from_param(price)) == expected).all()
        with torch.no_grad():
            online = run_with_early_exit(model, y, SignalRule.from_param(PriceSignal(planner), price))
        assert (online.stop_times == expected).all()
        depths.add(float(expected.float().mean()))
    assert len(depths) > 2  # the price moves the depth: one policy, many budgets


class DirectPlanner(Planner):
    """The same plans, also handed to the price rule as log q_phi (``plan_log_q``): no round trip via logits."""

    def plan_log_q(self, y, x, t):
        assert t == self.plan_step
        self.calls += 1
        return torch.log_softmax(self.net(x), dim=1)


@pytest.mark.parametrize("s", [1, 3])
def test_plan_log_q_stops_where_the_logits_round_trip_does(s):
    from learn2stop.core.policy_signals import PriceSignal

    torch.manual_seed(5)
    T = 8
    model, direct = ToyStepModel(num_steps=T), DirectPlanner(T, plan_step=s)
    via_logits = Planner(T, plan_step=s)
    via_logits.load_state_dict(direct.state_dict())
    with torch.no_grad():
        direct.net.weight.mul_(6), via_logits.net.weight.mul_(6)
        y = torch.randn(80, 3)
        for price in (0.0, 1.0, 5.0):
            a = run_with_early_exit(model, y, SignalRule.from_param(PriceSignal(direct), price))
            b = run_with_early_exit(model, y, SignalRule.from_param(PriceSignal(via_logits), price))
            assert torch.equal(a.stop_times, b.stop_times) and torch.equal(a.outputs, b.outputs)
    assert direct.calls == 3 and len(set(a.stop_times.tolist())) > 1  # once per rollout; the plans differ

    class BadShape(DirectPlanner):
        def plan_log_q(self, y, x, t):
            return torch.zeros(x.shape[0], T - 1)

    with pytest.raises(ValueError, match=r"plan_log_q \(plan_step=1\) must return log q_phi of steps 1..T"):
        run_with_early_exit(model, y, SignalRule.from_param(PriceSignal(BadShape(T, plan_step=1)), 1.0))


def test_speed_samples_are_a_mix_of_a_grouped_test_set():
    from learn2stop.core.calibrate import shuffled

    groups = torch.arange(3).repeat_interleave(100)  # a test set grouped like sparse's SNRs
    mixed = shuffled({"x": groups[:, None].float(), "g": groups})
    assert sorted(mixed["g"].tolist()) == groups.tolist() and (mixed["x"][:, 0] == mixed["g"]).all()
    assert set(mixed["g"][:30].tolist()) == {0, 1, 2}  # the first samples, timed one by one, hold every group
    assert torch.equal(shuffled(groups), shuffled(groups))  # the same order every run


def test_the_own_cost_run_plans_and_never_stops_early():
    """The frontier times a policy's own cost with its main rule asked as at inference but never stopping early:
    the price rule at its ``asked_never`` threshold still plans, once per rollout, and runs every sample to T; at +inf it
    would skip the plan (and time nothing)."""
    from learn2stop.core.policy_signals import PriceSignal

    torch.manual_seed(6)
    T = 8
    model, direct = ToyStepModel(num_steps=T), DirectPlanner(T, plan_step=2)
    with torch.no_grad():
        direct.net.weight.mul_(6)
        y = torch.randn(50, 3)
        asked = run_with_early_exit(model, y, SignalRule.never_stopping(PriceSignal(direct)))
        assert direct.calls == 1 and (asked.stop_times == T).all()
        run_with_early_exit(model, y, SignalRule(PriceSignal(direct), math.inf))
        assert direct.calls == 1


def test_price_zero_is_the_map_stop_time_of_the_plan():
    """Fed one price the price-conditioned rule is the single-price plan's own choice: price 0 stops at
    q_phi's most likely step (the MAP target of Stage II)."""
    from learn2stop.core.policy_signals import PriceSignal

    torch.manual_seed(4)
    logits = stop_logits_from_distribution(torch.log_softmax(3 * torch.randn(200, 9), dim=1))
    times = first_crossing(PriceSignal.scores(logits), PriceSignal.from_param(0.0))
    assert (times == log_stop_time_distribution(logits).argmax(dim=1) + 1).all()


def test_stage2_fits_a_planning_policy_to_the_oracle(tmp_path):
    """Stage II trains a planner on the schedule it is used on (one call at its plan step) and brings
    its q_phi towards the oracle: the forward KL on validation falls."""
    from conftest import ToyTask, oracle_kl
    from learn2stop.core import StageConfig, StagedTrainer

    torch.manual_seed(5)
    T = 4
    model, planner = ToyStepModel(num_steps=T), Planner(T, plan_step=1)
    sm, task = StoppingModel(model, planner), ToyTask()
    StagedTrainer(sm, task, tmp_path, progress=False).fit(
        "stage1", StageConfig(objective="stage1", iterations=120, batch_size=32, lr=1e-2, beta=0.1, eval_every=60))

    before = oracle_kl(sm, task, 0.1)
    planner.calls = 0
    StagedTrainer(sm, task, tmp_path, progress=False).fit(
        "stage2", StageConfig(objective="stage2", iterations=80, batch_size=32, lr=3e-2, beta=0.1, eval_every=40))
    assert planner.calls >= 80  # one call per training rollout (and per validation batch), never per step
    assert oracle_kl(sm, task, 0.1) < 0.7 * before


def test_budget_calibration_never_stops_where_the_rule_is_not_asked():
    from learn2stop.core import calibrate_budget
    from learn2stop.utils.config import ConfigError

    torch.manual_seed(6)
    scores = torch.rand(100, 7).cumsum(dim=1)
    scores[:, :2] = -math.inf  # asked from step 3 (a plan step, or a tolerance test's step 2)
    costs = torch.arange(1, 9) / 8
    with pytest.raises(ConfigError, match="below the least this quantile rule can spend"):
        calibrate_budget(scores, costs, 0.3, "quantile")
    cal = calibrate_budget(scores, costs, 0.5, "quantile")
    assert (first_crossing(scores, cal.threshold) >= 3).all() and cal.calibration["mean_cost"] <= 0.5


@pytest.mark.parametrize("every", [1, 2, 3, 10])
def test_device_mode_matches_the_synchronising_loop(every):
    """No host sync between compactions, same stop times and outputs (per-step rules, stateful ones included)."""
    from conftest import ToyPolicy
    from learn2stop.core import PatienceSignal

    torch.manual_seed(7)
    T = 6
    model, policy = ToyStepModel(num_steps=T), ToyPolicy(num_steps=T)
    y = torch.randn(33, 3)
    full = unroll(model, y, keep_outputs=True)
    tol = float(signal_trace(ToleranceSignal(), full.step_outputs, y)[:, 2].median())
    rules = [lambda: SignalRule(ToleranceSignal(), tol), lambda: PolicyRule(policy, threshold=0.5),
             lambda: SignalRule(PatienceSignal(), 2.0), lambda: FixedDepth(3)]
    with torch.no_grad():
        for make in rules:
            sync = run_with_early_exit(model, y, make())
            dev = run_with_early_exit(model, y, make(), compact_every=every)
            assert (dev.stop_times == sync.stop_times).all()
            torch.testing.assert_close(dev.outputs, sync.outputs)
    with pytest.raises(ValueError, match="compact_every"):
        run_with_early_exit(model, y, FixedDepth(2), compact_every=0)


def test_the_loop_refuses_what_cannot_run_by_name():
    from conftest import ToyPolicy

    model = ToyStepModel(num_steps=4)
    sm = StoppingModel(model, ToyPolicy())
    for bad in ("quantile", None, 3):
        with pytest.raises(TypeError, match="rule must be a stop rule"):
            run_with_early_exit(model, torch.randn(2, 3), bad)
    with pytest.raises(TypeError, match="InferenceConfig"):
        sm(torch.randn(2, 3), rule="quantile")
    with pytest.raises(ValueError, match="target has batch size 3 but the inputs have 2"):
        sm.unroll(torch.randn(2, 3), torch.randn(3, 5), lambda o, t: (o - t).pow(2).sum(1))
    with pytest.raises(ValueError, match="batch dimension"):
        sm(torch.randn(3))

    class NaNPlanner(Planner):
        def forward(self, y, x, t):
            return torch.full((x.shape[0], self.T - 1), float("nan"))

    with pytest.raises(ValueError, match="NaN or inf stop logits at its plan step 2"):
        run_with_early_exit(model, torch.randn(2, 3), PolicyRule(NaNPlanner(4, plan_step=2)))


class ReadCounting(ToyStepModel):
    """A toy whose readout (an exit head, say) records the rows it reads out at each step."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.read: dict[int, int] = {}

    def readout(self, t, state, inputs):
        self.read[t] = self.read.get(t, 0) + state.shape[0]
        return state * 2  # not the state itself: a head


@pytest.mark.parametrize("device_mode", [False, True])
def test_the_model_is_read_out_only_where_something_reads_it(device_mode):
    """Full depth reads out at T alone; a fixed depth at its depth; a per-step rule from the step before its first
    ask (its previous output); a plan at its step and where planned rows stop. Outputs as full depth's."""
    torch.manual_seed(0)
    model, y = ReadCounting(num_steps=6), torch.randn(9, 3)
    full = unroll(model, y, keep_outputs=True)
    kw = {"compact_every": 2} if device_mode else {}

    def read(rule):
        model.read = {}
        r = run_with_early_exit(model, y, rule, **kw)
        torch.testing.assert_close(r.outputs, torch.stack([full.step_outputs[t - 1][i]
                                                           for i, t in enumerate(r.stop_times.tolist())]))
        return model.read, r.stop_times

    assert read(FixedDepth())[0] == {6: 9}
    assert read(FixedDepth(4))[0] == {4: 9}
    # device mode computes a stopped row on to the next compaction (step 6 here)
    assert read(CountingRule(first_step=3, stop_at=5))[0] == ({2: 9, 3: 9, 4: 9, 5: 9, 6: 9} if device_mode else
                                                               {2: 9, 3: 9, 4: 9, 5: 9})
    assert set(read(SignalRule(ToleranceSignal(), -1e-9))[0]) == set(range(1, 7))  # asked from step 2
    if not device_mode:
        times = torch.tensor([1, 3, 3, 6, 2, 6, 3, 5, 1])
        # the rows still running, at the steps where some of them stop (none stops at 4)
        assert read(StopAtTimes(times))[0] == {1: 9, 2: 7, 3: 6, 5: 3, 6: 2}
        got, stops = read(SignalRule(QuantileSignal(Planner(6, plan_step=2)), QuantileSignal.from_param(0.5)))
        assert got == {2: 9, **{t: int((stops >= t).sum()) for t in range(3, 7) if (stops == t).any()}}


def test_an_infinite_threshold_is_never_asked_and_never_stopping_is():
    """+inf, the calibrators' "never stop early", runs full depth with no signal computed and one readout (as the
    exported rule); ``never_stopping`` asks the signal at every step as at inference (the rule's own cost)."""
    torch.manual_seed(0)
    model, y = ReadCounting(num_steps=5), torch.randn(4, 3)
    planner = Planner(5, plan_step=2)
    for signal in (ToleranceSignal(), QuantileSignal(planner)):
        model.read, planner.calls = {}, 0
        r = run_with_early_exit(model, y, SignalRule(signal, math.inf))
        assert (r.stop_times == 5).all() and model.read == {5: 4} and planner.calls == 0
        model.read = {}
        r = run_with_early_exit(model, y, SignalRule.never_stopping(signal))
        assert (r.stop_times == 5).all() and len(model.read) > 1
    assert planner.calls == 1  # the planning signal, asked, planned once


class _BadPlan:
    """A planning rule whose plan is not (B,) integer stop steps."""

    plan_step = 2

    def __init__(self, times):
        self.times = times

    def __call__(self, view):
        raise AssertionError("a planning rule is not asked per step")

    def plan(self, view):
        return self.times(view.index.numel())


@pytest.mark.parametrize("times", [lambda n: torch.full((n,), 3.0), lambda n: torch.full((n + 1,), 3),
                                   lambda n: [3] * n])
def test_the_loop_and_the_stream_refuse_a_plan_that_is_not_integer_steps_per_row(times):
    from learn2stop.core.streaming import StreamingRunner

    model = ToyStepModel(num_steps=5)
    with pytest.raises(ValueError, match="a planning rule must return integer stop steps of shape"):
        run_with_early_exit(model, torch.randn(4, 3), _BadPlan(times))
    runner = StreamingRunner(model, _BadPlan(times), max_batch=4)
    ids = [runner.submit(torch.randn(1, 3)) for _ in range(3)]
    runner.run_until_idle()
    assert all("a planning rule must return integer stop steps" in str(runner.finished[i].error) for i in ids)


def test_a_plan_is_clamped_to_the_steps_left():
    model = ToyStepModel(num_steps=5)
    r = run_with_early_exit(model, torch.randn(4, 3), _BadPlan(lambda n: torch.tensor([0, 1, 4, 9])[:n]))
    assert r.stop_times.tolist() == [2, 2, 4, 5]  # planned at step 2: earlier steps are past, later than T is T
