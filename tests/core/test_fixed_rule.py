"""A fixed depth as a calibrated rule, and ``calibrate --fastest``: every rule calibrated for one target, the fastest
kept. What a user deploys when a fixed depth of the stop model beats every adaptive rule in time."""
import json
import math

import pytest
import torch

from learn2stop.core import (Calibration, FixedDepth, InferenceConfig, PolicySignal, SignalRule, calibrate_budget,
                             calibrate_risk, first_crossing, run_with_early_exit, signal_trace, unroll)
from learn2stop.core.signals import DepthSignal
from learn2stop.utils.config import ConfigError
from test_stopping_pays import sm  # noqa: F401 - the toy stopping model fixture


def test_the_depth_signal_stops_every_sample_where_a_fixed_depth_does(sm):
    y = torch.randn(9, 6, generator=torch.Generator().manual_seed(1))
    r = unroll(sm.model, y, keep_outputs=True, model_grad=False)
    trace = signal_trace(DepthSignal(), r.step_outputs, y)
    assert trace.shape == (9, 6) and (trace == torch.arange(1, 7).float()).all()
    for d in range(1, 8):
        assert (first_crossing(trace, float(d)) == d).all()
        rule = DepthSignal().rule(float(d))
        assert isinstance(rule, FixedDepth) and rule.depth == d  # asked once, read out at the depth alone
        with torch.no_grad():
            out = run_with_early_exit(sm.model, y, rule)
        assert (out.stop_times == d).all()
        torch.testing.assert_close(out.outputs, r.step_outputs[d - 1])
    assert DepthSignal().rule(math.inf).depth is None  # the calibrators' "never stop early"
    assert isinstance(PolicySignal(sm.policy).rule(0.5), SignalRule)
    with pytest.raises(ValueError, match="threshold must be a number"):
        DepthSignal().rule(float("nan"))


def test_a_fixed_depth_calibrates_like_every_rule():
    T = 5
    scores = torch.arange(1, T).float().expand(40, T - 1)
    costs = torch.arange(1, T + 1) / T
    cal = calibrate_budget(scores, costs, 0.6, "fixed")
    assert (cal.rule, cal.param) == ("fixed", 3.0) and cal.calibration["mean_cost"] == pytest.approx(0.6)
    assert cal.make_rule().depth == 3
    # risk: the shallowest depth whose loss over full depth is certified within epsilon
    gen = torch.Generator().manual_seed(0)
    losses = torch.tensor([0.9, 0.5, 0.05, 0.02, 0.0]) + 0.01 * torch.rand(400, T, generator=gen)
    cal = calibrate_risk(torch.arange(1, T).float().expand(400, T - 1), losses, 0.15, 0.1, "fixed", costs=costs,
                         loss_range=(0.0, 1.0))
    assert cal.param == 3.0 and cal.make_rule().depth == 3
    back = Calibration.from_dict(json.loads(json.dumps(cal.to_dict())))
    assert back.make_rule().depth == 3 and "chosen_by" not in cal.to_dict()  # only --fastest records a choice
    assert InferenceConfig(rule="fixed", param=4).make_rule().depth == 4
    with pytest.raises(ConfigError, match=r"inference.param: the fixed rule's parameter must be an integer >= 1"):
        InferenceConfig(rule="fixed", param=2.5)


def test_an_exported_fixed_calibration_ends_the_graphs_at_the_depth():
    from learn2stop.export.graphs import _schedule, rule_spec

    spec = rule_spec(Calibration("fixed", 3.0, 3.0, {"kind": "budget", "budget": 0.6}))
    assert (spec["name"], spec["param"], spec["never_stops_early"]) == ("fixed", 3, False)
    assert _schedule(spec, None, 7)["last"] == 3
    full = rule_spec(Calibration("fixed", math.inf, math.inf, {"kind": "budget", "budget": 1.0}))
    assert full["never_stops_early"] and _schedule(full, None, 7) == {"last": 7, "readout": [7], "policy": [],
                                                                      "plan": None, "replan": None}
    assert rule_spec(InferenceConfig(rule="fixed", param=2))["param"] == 2


def test_calibrate_fastest_keeps_the_fastest_calibrated_rule(tmp_path, capsys):
    from learn2stop.cli import main
    from learn2stop.core.timing import SPEED_TIE_CAP, SPEED_TIE_FLOOR
    from conftest import TINY

    tiny = [*TINY, "--run_aevb", "false", "--run_stage3", "false"]
    run = tmp_path / "run"
    assert main(["sparse", "train", "--run-dir", str(run), "--no-progress", *tiny]) == 0
    capsys.readouterr()
    for bad, message in ((["--fastest", "--rule", "tolerance"], "--rule: --fastest tries every rule"),
                         (["--speed-batch", "8"], "--speed-batch: only calibrate --fastest"),
                         (["--fastest", "--speed-batch", "0"], "--speed-batch: the batch size timed must be")):
        assert main(["sparse", "calibrate", "--run-dir", str(run), "--budget", "0.6", *bad, *tiny]) == 2
        assert message in capsys.readouterr().err
    assert not (run / "calibration.json").exists()  # a refused command saves nothing
    assert main(["sparse", "calibrate", "--run-dir", str(run), "--budget", "0.6", "--fastest", "--speed-batch", "16",
                 *tiny]) == 0
    assert "<- deployed" in capsys.readouterr().out
    cal = json.loads((run / "calibration.json").read_text())
    chosen = cal["chosen_by"]
    assert set(chosen["candidates"]) == {"price", "tolerance", "fixed"}  # the quick policy plans twice: price alone
    assert chosen["batch_size"] == 16 and set(chosen["samples_per_s"]) == set(chosen["candidates"])
    assert all(v > 0 for v in chosen["samples_per_s"].values())
    # the fastest up to the passes' measured spread, the tie going to the least cost on validation
    speeds, tie = chosen["samples_per_s"], chosen["tie"]
    assert SPEED_TIE_FLOOR <= tie <= SPEED_TIE_CAP
    tied = [r for r, v in speeds.items() if v >= (1 - tie) * max(speeds.values())]
    assert cal["rule"] == min(tied, key=lambda r: chosen["candidates"][r]["mean_cost"])
    assert cal["target"] == {"kind": "budget", "budget": 0.6, "fastest_at_batch": 16, "tie": tie}
    for c in chosen["candidates"].values():  # every candidate met the same target, on the calibration data
        assert c["test"]["mean_steps"] >= 1 and math.isfinite(c["test"]["metric"])
    assert chosen["candidates"]["fixed"]["param"] == 3.0  # 3 steps of 5: the deepest within 60 %
    assert main(["sparse", "evaluate", "--run-dir", str(run), "--no-progress", *tiny]) == 0
    assert f"calibrated {cal['rule']} rule" in capsys.readouterr().out


def test_the_in_time_table_lists_a_rule_that_never_reaches_the_quality():
    from learn2stop.core.deploy import in_time_markdown

    result = {"metric": "accuracy (%)", "reference": "the network alone at full depth", "calibration": "matched",
              "deployed": "quantile", "backend": "torch", "device": "cpu", "passes": {"1": 9, "256": 3},
              "batch_sizes": [1, 256], "serve_batch": 1,
              "rows": [{"rule": "baseline", "name": "the network alone at full depth", "metric": 73.2, "mean_steps": 7.0,
                        "mean_cost": 1.0, "samples_per_s": {1: 100.0, 256: 1000.0}, "speedup": {1: 1.0, 256: 1.0}},
                       {"rule": "quantile", "name": "quantile (deployed)", "reached": False},
                       {"rule": "fixed", "name": "fixed, depth 6", "reached": True, "metric": 73.5, "mean_steps": 6.0,
                        "mean_cost": 0.8, "samples_per_s": {1: 120.0}, "speedup": {1: 1.2}}],
              "fastest": {"1": "fixed", "256": "baseline"}, "tie": 0.034}
    text = in_time_markdown(result)
    assert "| quantile (deployed) | not reached on validation |" in text
    assert "| fixed, depth 6 | 73.5 | 6.00 | 80.0 | 120 | 1.20× | - | - |" in text
    assert "batch 1: fixed, depth 6; batch 256: the network alone at full depth" in text
    assert "9 at batch 1, 3 at batch 256" in text
    assert "ties within 3.4 %" in text  # the tie used, as measured


def test_the_deployment_is_the_fastest_certified_rule_with_ties_to_the_least_cost():
    from learn2stop.core.timing import SPEED_TIE_FLOOR as SPEED_TIE, fastest_certified

    costs = {"baseline": 1.0, "price": 0.62, "fixed": 0.75, "tolerance": 0.70}
    # a clear winner is deployed whatever its cost
    assert fastest_certified({"baseline": 100.0, "price": 90.0, "fixed": 130.0, "tolerance": 80.0}, costs) == "fixed"
    # within the timing noise of the fastest, the tie goes to the fewest steps on validation
    near = 130.0 * (1 - SPEED_TIE / 2)
    assert fastest_certified({"baseline": 100.0, "price": near, "fixed": 130.0}, costs) == "price"
    assert fastest_certified({"baseline": 100.0, "price": 130.0 * (1 - 2 * SPEED_TIE), "fixed": 130.0}, costs) == "fixed"
    # a stop model whose every certified rule is slower than the baseline deploys the baseline
    assert fastest_certified({"baseline": 200.0, "price": 150.0, "fixed": 160.0}, costs) == "baseline"
    # rules not timed (None), or without a calibration (no cost), are not candidates
    assert fastest_certified({"baseline": 100.0, "price": None, "unknown": 999.0}, costs) == "baseline"
    assert fastest_certified({}, costs) is None
    # a full-depth rule of the stop model runs the baseline's steps: measured faster, within the noise or beyond it,
    # it is still the baseline's computation plus the rule's, so the baseline is deployed
    full = {"baseline": 1.0, "fixed": 1.0}
    assert fastest_certified({"baseline": 100.0, "fixed": 100.0 * (1 + SPEED_TIE / 2)}, full) == "baseline"
    assert fastest_certified({"baseline": 100.0, "fixed": 113.0}, full) == "baseline"
    # and a full-cost rule measured fastest does not widen the tie that a cheaper rule is judged in
    costs3 = {"baseline": 1.0, "full": 1.0, "price": 0.7}
    assert fastest_certified({"baseline": 100.0, "full": 140.0, "price": 120.0}, costs3) == "price"
    # a candidate whose speed does not follow from its steps (no cost) may beat the baseline; in a tie it counts as
    # full depth
    spec = {"baseline": 1.0, "speculative": None, "price": 0.7}
    assert fastest_certified({"baseline": 100.0, "speculative": 125.0, "price": 110.0}, spec) == "speculative"
    assert fastest_certified({"baseline": 100.0, "speculative": 125.0, "price": 124.0}, spec) == "price"
    # without a timed baseline, the fastest of the rest
    assert fastest_certified({"fixed": 130.0, "price": 90.0}, costs) == "fixed"


def test_the_tie_margin_is_the_timing_spread_so_a_noisy_table_ties_and_a_tight_one_does_not():
    from learn2stop.core.timing import SPEED_TIE_CAP, SPEED_TIE_FLOOR, fastest_certified, speed_tie
    from learn2stop.core.timing import pass_spread

    # one job's passes: the best against the (lower) median pass
    assert pass_spread([100.0, 90.0, 80.0]) == pytest.approx(0.1)
    assert pass_spread([100.0, 100.0, 100.0]) == 0.0 and pass_spread([50.0]) == 0.0
    assert pass_spread([100.0, 60.0, 70.0, 99.0]) == pytest.approx(0.3)  # four passes: the lower middle, 70
    costs = {"baseline": 1.0, "fixed": 0.8, "price": 0.6}
    speeds = {"baseline": 100.0, "fixed": 130.0, "price": 122.0}  # price 6.2 % below fixed
    noisy = speed_tie([pass_spread([130.0, 118.0, 112.0]), pass_spread([122.0, 121.0, 110.0]), None])
    assert noisy == pytest.approx(12.0 / 130.0)
    assert fastest_certified(speeds, costs, noisy) == "price"  # within the noise: the fewer steps
    tight = speed_tie([pass_spread([130.0, 129.5, 129.0]), pass_spread([122.0, 121.8, 121.5])])
    assert tight == SPEED_TIE_FLOOR  # passes that agree leave the floor
    assert fastest_certified(speeds, costs, tight) == "fixed"  # a real difference: the faster
    # a loaded machine's wide spread is capped, and a rule measured slower than the baseline never wins a tie
    assert speed_tie([0.39]) == SPEED_TIE_CAP
    assert fastest_certified({"baseline": 790.0, "entropy": 760.0}, {"baseline": 1.0, "entropy": 0.93}, 0.39) == "baseline"
