"""Wall-clock speed of real early exit: one warm-up only when asked, and each exit's cumulative seconds."""
import pytest
import torch
from torch import nn

from learn2stop.core import ConfidenceSignal, SignalRule, run_with_early_exit
from learn2stop.core.distributions import exit_costs
from learn2stop.core.timing import measure_exit_costs, measure_speed
from test_stopping_pays import Toy


def test_measure_speed_warms_up_once_and_only_when_asked():
    model, x = Toy(), torch.randn(10, 6)
    seen = []

    def runner(m, inputs, rule):  # the eager loop, recording each chunk it is given
        seen.append(inputs.shape[0])
        return run_with_early_exit(m, inputs, rule)

    v = measure_speed(model, x, lambda: SignalRule(ConfidenceSignal(), 0.9), 4, repeats=2, runner=runner)
    assert v > 0 and seen == [4] + [4, 4, 2] * 2  # one warm-up chunk, then every chunk per pass
    seen.clear()
    measure_speed(model, x, lambda: SignalRule(ConfidenceSignal(), 0.9), 4, repeats=1, runner=runner, warmup=False)
    assert seen == [4, 4, 2]


def test_measure_exit_costs_are_cumulative_seconds_per_step_and_serve_as_exit_costs():
    import time as _time

    class Slow(nn.Module):  # step t sleeps t ms: cumulative costs about 1, 3, 6, 10 ms
        num_steps = 4

        def __init__(self):
            super().__init__()
            self.calls = []

        def initial_state(self, inputs):
            return inputs

        def step(self, t, state, inputs):
            self.calls.append(t)
            _time.sleep(0.001 * t)
            return state + 1

        def readout(self, t, state, inputs):
            return state

    m = Slow()
    costs = measure_exit_costs(m, torch.zeros(3, 2), repeats=2)
    assert m.calls == [1, 2, 3, 4] * 3  # one warm-up rollout, then ``repeats``
    steps = [costs[0]] + [b - a for a, b in zip(costs, costs[1:])]
    for t, s in enumerate(steps, 1):
        assert 0.001 * t <= s < 0.001 * t + 0.05  # each step's own time, not a running total's
    m.exit_costs = costs
    assert exit_costs(m).tolist() == pytest.approx([c / costs[-1] for c in costs])  # usable as the model's costs
    with pytest.raises(ValueError, match="repeats"):
        measure_exit_costs(m, torch.zeros(3, 2), repeats=0)
