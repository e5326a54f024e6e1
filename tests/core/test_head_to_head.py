"""The learned rule against each other rule at its own cost, with paired bootstrap intervals (``frontier``)."""
import math

import pytest
import torch

from learn2stop.core import Metric, first_crossing
from learn2stop.core.frontier_report import head_to_head_markdown
from learn2stop.core.head_to_head import head_to_head, paired_difference, stops_at_cost
from learn2stop.core.trace import Trace

ERR = Metric("err", lambda o, t: o, lower_is_better=True)


def depth_scores(N, T):
    """The fixed-depth signal's trace: step t scores t."""
    return torch.arange(1, T, dtype=torch.float32).expand(N, T - 1).clone()


def test_a_cost_between_two_depths_is_met_by_a_seeded_mix_of_them():
    N, T = 10, 5
    steps = torch.arange(1, T + 1, dtype=torch.float32) / T
    stops = stops_at_cost(depth_scores(N, T), steps, 2.5 / T, torch.Generator().manual_seed(0))
    assert sorted(stops.tolist()) == [2] * 5 + [3] * 5  # half of them one step deeper: mean 2.5 steps exactly
    again = stops_at_cost(depth_scores(N, T), steps, 2.5 / T, torch.Generator().manual_seed(0))
    assert torch.equal(stops, again)
    # a depth's own cost is met by that depth alone; below the first step's cost, the cheapest threshold
    assert stops_at_cost(depth_scores(N, T), steps, 3 / T).tolist() == [3] * N
    assert stops_at_cost(depth_scores(N, T), steps, 0.01).tolist() == [1] * N


def test_a_random_rule_is_set_within_a_sample_of_any_cost():
    g = torch.Generator().manual_seed(1)
    N, T = 400, 8
    scores = torch.rand(N, T - 1, generator=g)
    costs = torch.tensor([0.05, 0.1, 0.2, 0.3, 0.5, 0.6, 0.8, 1.0])
    for cost in (0.12, 0.33, 0.5, 0.71):
        stops = stops_at_cost(scores, costs, cost, torch.Generator().manual_seed(0))
        assert float(costs[stops - 1].mean()) == pytest.approx(cost, abs=1.0 / N)


def test_paired_difference_is_exact_for_a_constant_lead_and_zero_for_the_same_rule():
    a = torch.rand(50, generator=torch.Generator().manual_seed(0))
    idx = torch.randint(50, (200, 50), generator=torch.Generator().manual_seed(0))
    same = paired_difference(ERR, a, a.clone(), {}, idx)
    assert same == {"diff": 0.0, "low": 0.0, "high": 0.0}
    lead = paired_difference(ERR, a - 0.25, a, {}, idx)  # 0.25 lower error on every sample: better by 0.25
    assert lead["diff"] == pytest.approx(0.25) and lead["low"] == pytest.approx(0.25) and lead["high"] == pytest.approx(0.25)


def test_the_paired_interval_matches_the_normal_one_for_a_mean():
    g = torch.Generator().manual_seed(2)
    N = 2000
    b = torch.randn(N, generator=g)
    a = b - 0.1 + 0.5 * torch.randn(N, generator=g)  # paired: the shared part cancels
    idx = torch.randint(N, (2000, N), generator=torch.Generator().manual_seed(0))
    out = paired_difference(ERR, a, b, {}, idx)
    d = (b - a).double()
    half = 1.96 * float(d.std()) / math.sqrt(N)
    assert out["diff"] == pytest.approx(float(d.mean()), abs=1e-6)
    assert out["high"] - out["low"] == pytest.approx(2 * half, rel=0.15)
    assert out["low"] > 0  # 0.1 lead with a standard error of about 0.011


def test_a_ratio_metric_resamples_its_extras_with_the_values():
    # NMSE-like: sum of errors over sum of energies; resampling the values without the energies would be wrong
    ratio = Metric("ratio", lambda o, t: o, aggregate=lambda v, ex: float(v.double().sum() / ex["energy"].double().sum()))
    energy = torch.tensor([1.0, 100.0])
    a, b = torch.tensor([0.5, 50.0]), torch.tensor([1.0, 100.0])  # a = b / 2 on every sample: ratio halves exactly
    idx = torch.randint(2, (100, 2), generator=torch.Generator().manual_seed(0))
    out = paired_difference(ratio, a, b, {"energy": energy}, idx)
    assert out["diff"] == pytest.approx(101 / 101 - 50.5 / 101)
    assert out["low"] == pytest.approx(0.5) and out["high"] == pytest.approx(0.5)


def synthetic_trace(N=600, T=6, seed=0):
    """Error falls with depth; each sample has a step after which it no longer falls (its best step). The "smart"
    signal knows that step; the "blind" one is noise."""
    g = torch.Generator().manual_seed(seed)
    best = torch.randint(1, T + 1, (N,), generator=g)
    t = torch.arange(1, T + 1)[None]
    err = (1.0 / torch.minimum(t, best[:, None])).float() + 0.01 * torch.rand(N, T, generator=g)
    smart = (t[:, :-1] >= best[:, None]).float() + 0.001 * t[:, :-1]
    blind = torch.rand(N, T - 1, generator=g)
    costs = torch.arange(1, T + 1, dtype=torch.float32) / T
    signals = {"smart": smart, "blind": blind, "copy": smart.clone(), "fixed": depth_scores(N, T)}
    return Trace(metric=err, costs=costs, signals=signals)


def test_head_to_head_finds_the_better_rule_and_ties_a_copy_of_itself():
    trace = synthetic_trace()
    thresholds = [0.5, 1.0]
    out = head_to_head(trace, ERR, "smart", thresholds, {r: (trace, r) for r in ("blind", "copy", "fixed")},
                       by="steps", resamples=300)
    assert out["samples"] == 600 and len(out["rows"]) == 2
    for row, thr in zip(out["rows"], thresholds):
        stops = first_crossing(trace.signals["smart"], thr)
        assert row["cost"] == pytest.approx(float(stops.float().mean()) / 6)
        assert row["metric"] == pytest.approx(float(trace.at(stops).mean()))
        for name in ("blind", "fixed"):
            cell = row["rules"][name]
            assert cell["cost"] == pytest.approx(row["cost"], abs=1.0 / 600)  # set to the policy's own cost
            assert cell["low"] > 0 and cell["diff"] == pytest.approx(cell["metric"] - row["metric"])
        assert row["rules"]["copy"]["diff"] == 0.0 and row["rules"]["copy"]["high"] == 0.0
    md = head_to_head_markdown(out, "err")
    assert "| steps % | policy err | blind | copy | fixed |" in md
    assert "ahead" in md and "tie" in md and "behind" not in md


def test_head_to_head_by_cost_prices_a_fixed_depth_at_the_fixed_depth_costs():
    trace = synthetic_trace()
    trace.costs = torch.tensor([0.2, 0.35, 0.5, 0.7, 0.85, 1.0])  # early-exit heads read on the way
    trace.fixed_costs = torch.tensor([0.1, 0.25, 0.45, 0.6, 0.8, 1.0])  # a fixed depth reads its exit alone
    out = head_to_head(trace, ERR, "smart", [0.5], {"fixed": (trace, "fixed")}, by="cost", resamples=50)
    row = out["rows"][0]
    stops = first_crossing(trace.signals["smart"], 0.5)
    assert row["cost"] == pytest.approx(float(trace.costs[stops - 1].mean()))
    fixed = row["rules"]["fixed"]
    assert fixed["cost"] == pytest.approx(row["cost"], abs=1.0 / 600)


def test_head_to_head_reads_another_networks_trace_of_the_same_samples():
    """A rival network (SDN's) is compared on its own trace: same samples, its own steps and costs. A signal the trace
    did not record, and a trace of other samples, are refused."""
    trace = synthetic_trace()
    other = synthetic_trace(seed=0)
    other.metric = other.metric + 1.0  # a network worse by 1 everywhere
    other.signals = {"fixed": other.signals["fixed"]}
    out = head_to_head(trace, ERR, "smart", [0.5], {"own_fixed": (trace, "fixed"), "other_fixed": (other, "fixed")},
                       by="steps", resamples=100)
    cells = out["rows"][0]["rules"]
    assert cells["other_fixed"]["diff"] == pytest.approx(cells["own_fixed"]["diff"] + 1.0, abs=1e-5)
    with pytest.raises(KeyError, match="no 'tolerance' signal"):
        head_to_head(trace, ERR, "smart", [0.5], {"x": (other, "tolerance")}, by="steps", resamples=10)
    with pytest.raises(ValueError, match="600"):
        head_to_head(trace, ERR, "smart", [0.5], {"x": (synthetic_trace(N=50), "fixed")}, by="steps", resamples=10)
