"""The API's guard-rails: each degenerate result warns with a named Warning that says the fix, and a healthy one
does not. Also the one-folder save's refusals."""
import json
import math
import time
import warnings

import pytest
import torch
from torch import nn

from learn2stop import (CalibrationWarning, DegenerateDepthWarning, FixedDepth, RuleCostWarning, StageConfig,
                        StepMLPPolicy, StoppingModel, StoppingWarning, benchmark, calibrate, output_signals, train)
from learn2stop.api.guards import check_full_depth
from learn2stop.utils.config import ConfigError

D, T = 4, 6


class Descent(nn.Module):
    """x_t = x_{t-1} + a (y - x_{t-1}): every step halves the distance to y (readout x_t); ``junk`` is added to the
    last step's readout alone, a frozen full depth that no training reaches (the late steps wrecked)."""

    def __init__(self, junk: float = 0.0, delay: float = 0.0):
        super().__init__()
        self.num_steps = T
        self.a = nn.Parameter(torch.full((T,), 0.5))
        self.junk, self.delay = junk, delay

    def initial_state(self, y):
        return torch.zeros_like(y)

    def step(self, t, x, y):
        if self.delay:
            time.sleep(self.delay)  # an expensive step
        return x + self.a[t - 1] * (y - x)

    def readout(self, t, x, y):
        return x + self.junk if t == T else x


def sample(n, generator, device):
    y = torch.randn(n, D, generator=generator)
    return y.to(device), y.to(device)


def mse(out, y):
    return (out - y).pow(2).mean(1)


def data(n=256, seed=0):
    return [sample(n, torch.Generator().manual_seed(seed), None)]


def no_stopping_warnings(record):
    return [str(w.message) for w in record if issubclass(w.category, StoppingWarning)]


def test_full_depth_worse_than_an_earlier_step_warns_and_names_the_fix():
    with pytest.warns(DegenerateDepthWarning, match=r"step 2 .*FixedDepth\(2\)"):
        assert check_full_depth([1.0, 0.064, 4.41], lambda a, b: a <= b, "loss") == 2
    with pytest.warns(DegenerateDepthWarning):  # higher is better (accuracy)
        check_full_depth([0.5, 0.9, 0.6], lambda a, b: a >= b, "accuracy")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_full_depth([1.0, 0.5, 0.4], lambda a, b: a <= b, "loss") is None
        assert check_full_depth([1.0, 0.5, 0.5 + 1e-6], lambda a, b: a <= b, "loss") is None  # within the margin


@pytest.mark.parametrize("junk", [0.0, 3.0])
def test_training_that_leaves_the_full_depth_wrecked_warns(tmp_path, junk):
    torch.manual_seed(0)
    sm = StoppingModel(Descent(junk), StepMLPPolicy(T, 2, features=output_signals))
    stages = {"stage1": StageConfig(objective="stage1", beta=0.1, iterations=20, batch_size=32, eval_every=20)}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        train(sm, sample, mse, stages, run_dir=tmp_path)
    said = no_stopping_warnings(record)
    if junk:
        assert len(said) == 1 and "after stage 'stage1'" in said[0] and "beta" in said[0], said
    else:
        assert said == []


def test_a_certified_calibration_that_never_stops_early_warns():
    sm = StoppingModel(Descent(), StepMLPPolicy(T, 2, features=output_signals))
    with pytest.warns(CalibrationWarning, match="never stops early.*larger epsilon"):
        cal = calibrate(sm, data(), mse, epsilon=0.0)  # every earlier step is strictly worse: nothing certified
    assert cal.threshold == math.inf
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cal = calibrate(sm, data(), mse, epsilon=10.0, delta=0.1)
    assert no_stopping_warnings(record) == [] and cal.calibration["mean_steps"] < T


def test_a_reference_worse_than_a_fixed_depth_warns():
    wrecked = StoppingModel(Descent(junk=3.0), StepMLPPolicy(T, 2, features=output_signals))
    with pytest.warns(CalibrationWarning, match=r"reference \(full depth\).*fixed depth 5.*reference=5"):
        calibrate(wrecked, data(), mse, epsilon=0.01)
    healthy = StoppingModel(Descent(), StepMLPPolicy(T, 2, features=output_signals))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        calibrate(healthy, data(), mse, epsilon=0.01)
    assert not [m for m in no_stopping_warnings(record) if "reference" in m]


class SlowNeverStopping(nn.Module):
    """A policy that costs 2 ms a call and never stops: all cost, no saving."""

    def forward(self, y, x, t):
        time.sleep(0.002)
        return torch.full((y.shape[0],), -20.0)


def test_a_rule_that_costs_more_than_it_saves_warns_at_that_batch_size():
    sm = StoppingModel(Descent(), SlowNeverStopping())
    y = data(8)[0][0]
    with pytest.warns(RuleCostWarning, match="at batch 1 the default rule.*fixed depth"):
        out = benchmark(sm, y, batch_sizes=(1,), passes=1)
    assert out["speedup"]["default"][1] < 1 and out["mean_steps"]["default"] == T
    slow_steps = StoppingModel(Descent(delay=0.001))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = benchmark(slow_steps, y, {"two steps": FixedDepth(2)}, batch_sizes=(1,), passes=1)
    assert no_stopping_warnings(record) == [] and out["speedup"]["two steps"][1] > 1


def test_a_saved_folder_of_another_version_is_refused_in_one_line(tmp_path):
    sm = StoppingModel(Descent(), StepMLPPolicy(T, 2, features=output_signals))
    folder = sm.save_pretrained(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "format_version": 99}))
    with pytest.raises(ConfigError, match="format version 99") as e:
        StoppingModel.from_pretrained(folder, model=Descent(), policy=StepMLPPolicy(T, 2, features=output_signals))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="with a policy"):
        StoppingModel.from_pretrained(sm.save_pretrained(tmp_path / "n"), model=Descent())
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a saved StoppingModel"):
        sm.save_pretrained(tmp_path / "other")
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"
