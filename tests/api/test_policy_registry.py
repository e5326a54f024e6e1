"""The ready policies' registry: every entry is trained by Stage II on the same step-wise model, runs the model's
early exit, and comes back from one saved folder with the same stop times."""
import pytest
import torch

from learn2stop import PolicyRule, StageConfig, StoppingModel, create_policy, list_policies, output_signals, train
from test_api_guards import D, T, Descent, data, mse, sample

#: how each ready policy is built for the test's model (T steps, outputs of width D read as D class logits)
BUILD = {
    "step_mlp": {"num_steps": T, "num_features": 2, "features": output_signals},
    "exit": {"num_classes": D, "num_steps": T},
    "plan_mlp": {"num_steps": T, "num_features": 2, "features": output_signals},
}


def test_every_ready_policy_is_built_here():
    assert set(list_policies()) == set(BUILD)  # a new entry needs its line in BUILD, and so its check below
    with pytest.raises(KeyError, match=r"unknown policy 'mlp'; available: exit, plan_mlp, step_mlp"):
        create_policy("mlp")


@pytest.mark.parametrize("name", sorted(BUILD))
def test_every_ready_policy_trains_stops_and_saves(name, tmp_path):
    torch.manual_seed(0)
    sm = StoppingModel(Descent(), create_policy(name, **BUILD[name]))
    assert type(sm.policy).__name__ == {"step_mlp": "StepMLPPolicy", "exit": "ExitPolicy",
                                        "plan_mlp": "PlanMLPPolicy"}[name]
    before = [p.detach().clone() for p in sm.policy.parameters()]
    stages = {"stage2": StageConfig(objective="stage2", beta=0.1, iterations=20, batch_size=32, eval_every=20)}
    train(sm, sample, mse, stages, run_dir=tmp_path / "run", validation=data(64, seed=1))
    assert any(not torch.equal(a, b) for a, b in zip(before, sm.policy.parameters()))  # Stage II moved it
    y = data(64, seed=2)[0][0]
    with torch.inference_mode():
        out = sm(y, rule=PolicyRule(sm.policy, threshold=0.5))
    assert out.stop_times.shape == (64,) and bool(((out.stop_times >= 1) & (out.stop_times <= T)).all())
    folder = sm.save_pretrained(tmp_path / "saved")
    back = StoppingModel.from_pretrained(folder, Descent(), create_policy(name, **BUILD[name]))
    with torch.inference_mode():
        again = back(y, rule=PolicyRule(back.policy, threshold=0.5))
    assert torch.equal(again.stop_times, out.stop_times)
    torch.testing.assert_close(again.outputs, out.outputs)
