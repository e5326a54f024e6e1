"""The step loop: early exit really skips work and matches full-depth outputs; rules; errors."""
import pytest
import torch

from conftest import ToyPolicy, ToyStepModel, mse_loss
from learn2stop.core import (
    FixedDepth,
    PolicyRule,
    StopAtTimes,
    StoppingModel,
    ToleranceRule,
    log_stop_time_distribution,
    run_with_early_exit,
    threshold_stop_times,
    unroll,
)


def test_unroll_shapes(toy, gen):
    model, policy = toy
    y, x = torch.randn(7, 3, generator=gen), torch.randn(7, 5, generator=gen)
    r = unroll(model, y, target=x, loss_fn=mse_loss, policy=policy, keep_outputs=True)
    assert r.losses.shape == (7, 4) and r.stop_logits.shape == (7, 3)
    assert len(r.step_outputs) == 4 and r.outputs.shape == (7, 5)
    assert (r.stop_times == 4).all() and r.steps_computed == 28


def test_early_exit_matches_full_depth_and_skips_work(toy, gen):
    model, policy = toy
    y = torch.randn(31, 3, generator=gen)
    times = torch.randint(1, 5, (31,), generator=gen)
    full = unroll(model, y, keep_outputs=True)
    model.calls = 0
    r = run_with_early_exit(model, y, StopAtTimes(times))
    assert (r.stop_times == times).all()
    picked = torch.stack([full.step_outputs[t - 1][i] for i, t in enumerate(times.tolist())])
    torch.testing.assert_close(r.outputs, picked)
    assert model.calls == int(times.sum()) < 31 * 4  # rows actually computed = sum of stop times


def test_policy_threshold_rule_stops_at_first_confident_step(toy, gen):
    model, policy = toy
    with torch.no_grad():
        policy.net[-1].bias.fill_(0.3)
    y = torch.randn(50, 3, generator=gen)
    with torch.no_grad():
        full = unroll(model, y, policy=policy, keep_outputs=True)
        sm = StoppingModel(model, policy)
        r = sm(y, threshold=0.5, record_probs=True)
    p = torch.sigmoid(full.stop_logits)
    above = torch.cat([p > 0.5, torch.ones(50, 1, dtype=torch.bool)], 1)
    expected = above.float().argmax(1) + 1
    assert (r.stop_times == expected).all()
    assert (threshold_stop_times(full.stop_logits) == r.stop_times).all()
    assert 1 < r.stop_times.float().mean() < 4
    picked = torch.stack([full.step_outputs[t - 1][i] for i, t in enumerate(expected.tolist())])
    torch.testing.assert_close(r.outputs, picked)
    seen = r.extras["stop_probs"]
    mask = ~torch.isnan(seen)
    torch.testing.assert_close(seen[mask], p[mask])


def test_sampled_rule_follows_q_phi(toy, gen):
    model, policy = toy
    y = torch.randn(1, 3, generator=gen).repeat(4000, 1)
    with torch.no_grad():
        q = log_stop_time_distribution(unroll(model, y[:1], policy=policy).stop_logits).exp()[0]
        r = StoppingModel(model, policy)(y, mode="sample", generator=gen)
    freq = torch.bincount(r.stop_times - 1, minlength=4).float() / 4000
    assert torch.allclose(freq, q, atol=0.03)


def test_fixed_depth_and_tolerance(toy, gen):
    model, _ = toy
    y = torch.randn(9, 3, generator=gen)
    assert (run_with_early_exit(model, y, FixedDepth(2)).stop_times == 2).all()
    assert (run_with_early_exit(model, y, FixedDepth()).stop_times == 4).all()
    r = run_with_early_exit(model, y, ToleranceRule(1e9))
    assert (r.stop_times == 2).all()  # first step has no previous output to compare


class DictModel(ToyStepModel):
    """Outputs and inputs as dicts: the loop handles any batch-first tree."""

    def initial_state(self, inputs):
        return super().initial_state(inputs["y"])

    def step(self, t, state, inputs):
        return super().step(t, state, inputs["y"])

    def readout(self, t, state, inputs):
        return {"x": state, "norm": state.norm(dim=1)}


def test_tree_inputs_and_outputs(gen):
    model = DictModel()
    y = {"y": torch.randn(6, 3, generator=gen), "tag": torch.arange(6)}
    times = torch.tensor([1, 4, 2, 2, 3, 1])
    r = run_with_early_exit(model, y, StopAtTimes(times))
    full = unroll(model, y, keep_outputs=True)
    for i, t in enumerate(times.tolist()):
        torch.testing.assert_close(r.outputs["x"][i], full.step_outputs[t - 1]["x"][i])
        torch.testing.assert_close(r.outputs["norm"][i], full.step_outputs[t - 1]["norm"][i])


def test_bad_models_and_rules(toy, gen):
    model, policy = toy
    with pytest.raises(TypeError, match="lacks num_steps, initial_state"):
        StoppingModel(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="one batch size"):
        unroll(DictModel(), {"y": torch.randn(3, 3), "z": torch.randn(4, 1)})
    with pytest.raises(ValueError, match="empty batch"):
        run_with_early_exit(model, torch.randn(0, 3), FixedDepth())
    with pytest.raises(ValueError, match="bool tensor"):
        run_with_early_exit(model, torch.randn(3, 3), lambda v: torch.zeros(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="one stop logit per sample"):
        unroll(model, torch.randn(3, 3), policy=lambda i, o, t: torch.zeros(3, 1))
    with pytest.raises(ValueError, match="one loss per sample"):
        unroll(model, torch.randn(3, 3), target=torch.randn(3, 5), loss_fn=lambda o, y: (o - y).pow(2))
    with pytest.raises(ValueError, match="threshold"):
        PolicyRule(policy, threshold=1.5)


def test_policy_min_step_is_never_called_before(toy, gen):
    model, policy = toy
    calls = []
    policy.register_forward_hook(lambda mod, args, out: calls.append(args[2]))
    policy.min_step = 3
    with torch.no_grad():
        policy.net[-1].bias.fill_(20.0)  # would stop at once if asked
        y = torch.randn(5, 3, generator=gen)
        r = StoppingModel(model, policy)(y)
        u = unroll(model, y, policy=policy)
    assert (r.stop_times == 3).all() and set(calls) == {3}
    q = log_stop_time_distribution(u.stop_logits).exp()
    assert q[:, :2].max() < 1e-12 and torch.allclose(q.sum(1), torch.ones(5))


def test_early_exit_and_sampled_stage1_on_each_device(device):
    """The loop, the rules and the recomputing Stage I objective keep every tensor on the model's device."""
    from conftest import ToyTask
    from learn2stop.core import StageConfig, StageObjective

    torch.manual_seed(0)
    sm = StoppingModel(ToyStepModel(), ToyPolicy()).to(device)
    task = ToyTask()
    y, x = task.sample_batch(12, torch.Generator().manual_seed(0), device)
    times = torch.tensor([1, 2, 3, 4] * 3, device=device)
    full = unroll(sm.model, y, keep_outputs=True)
    r = run_with_early_exit(sm.model, y, StopAtTimes(times))
    picked = torch.stack([full.step_outputs[t - 1][i] for i, t in enumerate(times.tolist())])
    torch.testing.assert_close(r.outputs, picked)
    assert r.outputs.device.type == device.type
    out = sm(y, mode="sample", generator=torch.Generator().manual_seed(1))
    assert out.stop_times.device.type == device.type
    cfg = StageConfig(objective="stage1", variant="sampled", recompute=True, beta=0.5)
    loss, _ = StageObjective(sm, task.loss_fn, cfg)(y, x, torch.Generator().manual_seed(2))
    loss.backward()
    assert loss.device.type == device.type and all(p.grad is not None for p in sm.model.parameters())
