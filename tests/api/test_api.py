"""The model-level API's other paths: training from a DataLoader, several rules calibrated and the fastest kept,
the frontier in time, and bad arguments refused by name."""
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from learn2stop import StageConfig, StepMLPPolicy, StoppingModel, calibrate, frontier, output_signals, train
from test_api_guards import T, Descent, data, mse, sample


def make_sm():
    torch.manual_seed(0)
    return StoppingModel(Descent(), StepMLPPolicy(T, 2, features=output_signals))


def test_training_from_a_data_loader_improves_the_policy_and_needs_validation(tmp_path):
    y = sample(512, torch.Generator().manual_seed(0), None)[0]
    loader = DataLoader(TensorDataset(y, y), batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
    sm = make_sm()
    with pytest.raises(ValueError, match="validation: give held-out batches"):
        train(sm, loader, mse, run_dir=tmp_path / "a")
    before = [p.detach().clone() for p in sm.policy.parameters()]
    summaries = train(sm, loader, mse, {"stage2": StageConfig(objective="stage2", beta=0.1, iterations=30, eval_every=30)},
                      validation=data(128, seed=5), run_dir=tmp_path / "b")
    assert summaries["stage2"]["iterations"] == 30 and (tmp_path / "b" / "checkpoints" / "stage2.pt").is_file()
    assert any(not torch.equal(a, b) for a, b in zip(before, sm.policy.parameters()))


def test_several_rules_are_calibrated_and_the_fastest_kept():
    sm = make_sm()
    cal = calibrate(sm, data(), mse, budget=0.5, rule=["quantile", "fixed"], speed_batch=4, speed_passes=1)
    assert set(cal.chosen_by["samples_per_s"]) == {"quantile", "fixed"}
    assert cal.rule == max(cal.chosen_by["samples_per_s"], key=cal.chosen_by["samples_per_s"].get)
    assert cal.target["fastest_at_batch"] == 4 and sm.calibration is cal


def test_the_frontier_in_time_has_every_point_timed_and_prints_the_in_time_table():
    sm = make_sm()
    f = frontier(sm, data(64, seed=2), mse, calibration_data=data(64), batch_size=8, passes=1, speed_samples=8,
                 budgets=(0.5, 1.0))
    assert all(p["samples_per_s_batch1"] > 0 and p["samples_per_s_batchN"] > 0
               for name, pts in f["curves"].items() if name != "oracle" for p in pts)
    assert "In time" in str(f) and f["fastest_at_quality"]
    # the frontier command's own implementation: the swept policy, the head-to-head table, the policy's own cost
    assert f["curves"]["policy_swept"] and "head_to_head" in f and set(f["policy_overhead"]) == {"batch1", "batchN"}


@pytest.mark.parametrize("call, match", [
    (lambda sm: calibrate(sm, data(), mse), "give exactly one target"),
    (lambda sm: calibrate(sm, data(), mse, budget=0.5, rule="nope"), "rule: unknown stop rule 'nope'"),
    (lambda sm: calibrate(sm, data(), mse, epsilon=0.1, reference=99), "reference: a fixed depth must be in 1..6"),
    (lambda sm: calibrate(sm, [torch.zeros(3)], mse, budget=0.5), "data: each batch must be a pair"),
    (lambda sm: train(sm, sample, mse, {"s": "stage1"}, run_dir="unused"), "stages: expected"),
])
def test_bad_arguments_are_refused_by_name(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call(make_sm())


def test_a_baseline_model_as_the_reference():
    import warnings

    from learn2stop import CalibrationWarning

    sm = make_sm()
    with pytest.warns(CalibrationWarning, match=r"reference \(baseline Descent at full depth\)"):
        calibrate(sm, data(), mse, epsilon=0.01, reference=StoppingModel(Descent(junk=3.0)))  # a wrecked baseline
    with warnings.catch_warnings():
        warnings.simplefilter("error", CalibrationWarning)
        cal = calibrate(sm, data(), mse, epsilon=0.05, reference=StoppingModel(Descent()))  # the same network
    assert cal.calibration["risk"] <= 0.05 and cal.calibration["mean_steps"] < T
