"""The frontier's curves read off a trace: a budget curve extended below its cheapest budget, and each curve's speed
where it reaches a reference quality."""
import pytest
import torch
from torch import nn

from learn2stop.core import Metric
from learn2stop.core.curves import budget_curve, extend_below, fastest_at_quality, speed_at_quality
from learn2stop.core.frontier_report import _time_table
from learn2stop.core.signal_registry import make_signal
from learn2stop.core.trace import Trace


def test_speed_at_quality_interpolates_the_crossing():
    metric = Metric("err", lambda o, t: o, lower_is_better=True)
    ref = {"metric": 1.0, "samples_per_s_batch1": 100.0, "samples_per_s_batchN": 1000.0}
    curves = {
        # reaches 1.0 halfway between its two points: time per sample halfway between 1/200 and 1/100
        "fast": [{"mean_steps": 4, "metric": 1.2, "samples_per_s_batch1": 200.0, "samples_per_s_batchN": 4000.0},
                 {"mean_steps": 6, "metric": 0.8, "samples_per_s_batch1": 100.0, "samples_per_s_batchN": 1000.0}],
        "never": [{"mean_steps": 8, "metric": 1.5, "samples_per_s_batch1": 90.0, "samples_per_s_batchN": 900.0}],
    }
    out = speed_at_quality(curves, metric, ref)
    assert out["fast"]["reaches"] and out["fast"]["mean_steps"] == pytest.approx(5.0)
    assert out["fast"]["samples_per_s_batch1"] == pytest.approx(1 / (0.5 / 200 + 0.5 / 100))
    assert out["fast"]["speedup_batch1"] == pytest.approx(out["fast"]["samples_per_s_batch1"] / 100)
    assert out["fast"]["speedup_batchN"] == pytest.approx(1 / (0.5 / 4000 + 0.5 / 1000) / 1000)
    assert out["never"] == {"reaches": False, "best_metric": 1.5}


def test_speed_at_quality_flags_a_curve_already_better_at_its_cheapest_point():
    metric = Metric("err", lambda o, t: o, lower_is_better=True)
    ref = {"metric": 1.0, "samples_per_s_batch1": 100.0}
    out = speed_at_quality({"early": [{"mean_steps": 3, "metric": 0.7, "samples_per_s_batch1": 300.0}],
                            "tie": [{"mean_steps": 3, "metric": 1.0, "samples_per_s_batch1": 200.0}]}, metric, ref)
    assert out["early"]["lower_bound"] and out["early"]["speedup_batch1"] == pytest.approx(3.0)
    assert out["tie"]["reaches"] and not out["tie"]["lower_bound"]  # it reaches the target exactly there
    table = _time_table({"batch_n": 8}, out, {"name": "full depth", **ref}, "torch")
    assert "| early (cheapest point) | <= 3 | >= 3 |" in table and "| tie | 3" in table
    assert "Fastest there: at batch 1 early (>= 3x)." in table


def test_fastest_at_quality_picks_each_batch_sizes_fastest_curve_and_never_the_oracle():
    at = {"policy": {"reaches": True, "speedup_batch1": 1.2, "speedup_batchN": 2.0},
          "fixed_depth": {"reaches": True, "speedup_batch1": 1.5, "speedup_batchN": 1.1, "lower_bound": True},
          "tolerance": {"reaches": False, "best_metric": 3.0},
          "oracle": {"reaches": True, "speedup_batch1": 9.0, "speedup_batchN": 9.0}}
    out = fastest_at_quality(at)
    assert out == {"batch1": {"curve": "fixed_depth", "speedup": 1.5, "lower_bound": True},
                   "batchN": {"curve": "policy", "speedup": 2.0, "lower_bound": False}}
    assert fastest_at_quality({"tolerance": at["tolerance"]}) == {}


def test_a_budget_curve_better_than_the_reference_at_its_cheapest_budget_is_extended_below_it():
    # 8 steps, error 1.0 at step 1 and 0.0 from step 2 on; the policy's score says "stop" from step 2 on for every
    # sample but with a spread, so cheap budgets stop some samples at step 1
    g = torch.Generator().manual_seed(0)
    N, T = 400, 8
    metric_vals = torch.zeros(N, T)
    metric_vals[:, 0] = 1.0
    scores = torch.rand(N, T - 1, generator=g).sort(dim=1).values
    costs = torch.arange(1, T + 1) / T
    trace = Trace(metric=metric_vals, costs=costs, signals={"threshold": scores})
    metric = Metric("err", lambda o, t: o, lower_is_better=True)
    signal = make_signal("threshold", nn.Linear(1, 1))
    base = budget_curve(trace, metric, trace, "threshold", signal, [0.5, 1.0])
    assert min(p["metric"] for p in base) == 0.0  # better than a reference of 0.5 at its cheapest budget
    out = extend_below(base, trace, metric, trace, "threshold", signal, goal=0.5)
    cheapest = min(out, key=lambda p: p["mean_cost"])
    assert len(out) > len(base) and cheapest["budget"] < 0.5
    assert not metric.better(cheapest["metric"], 0.5)  # the crossing of the reference is now inside the curve
    assert [p["budget"] for p in out] == sorted(p["budget"] for p in out)
    assert extend_below(base, trace, metric, trace, "threshold", signal, goal=-1.0) == base  # never better: unchanged
