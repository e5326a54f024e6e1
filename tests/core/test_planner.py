"""The public planning policy: its stop logits induce exactly its plan, it is asked once per sample, Stage II moves
its plan toward the oracle, and it is saved and loaded with the model."""
import pytest
import torch
from torch import nn

from learn2stop import PlanMLPPolicy, StageConfig, StoppingModel, output_signals, train
from learn2stop.core.distributions import log_oracle_distribution, log_stop_time_distribution

D, T = 4, 6


class Halving(nn.Module):
    """x_t = x_{t-1} + (y - x_{t-1}) / 2: each step halves the error, so a sample of large scale needs more steps
    for the same loss; the first iterate (y / 2) shows the scale."""

    num_steps = T

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.full((T,), 0.5))

    def initial_state(self, y):
        return torch.zeros_like(y)

    def step(self, t, x, y):
        return x + self.a[t - 1] * (y - x)

    def readout(self, t, x, y):
        return x


def sample(n, generator, device):
    scale = torch.exp(3 * torch.rand(n, 1, generator=generator) - 1.5)  # scales from 0.2 to 4.5
    y = scale * torch.randn(n, D, generator=generator)
    return y, y


def mse(out, y):
    return (out - y).pow(2).mean(1)


def test_the_stop_logits_induce_the_plan_exactly():
    torch.manual_seed(0)
    policy = PlanMLPPolicy(T, 2).double().eval()
    y = torch.randn(5, D, dtype=torch.float64)
    logits = policy(y, y / 2, 1)
    assert logits.shape == (5, T - 1) and policy.plan_step == 1
    torch.testing.assert_close(log_stop_time_distribution(logits), policy.plan_log_q(y, y / 2, 1), atol=1e-12, rtol=0)
    torch.testing.assert_close(policy.plan_log_q(y, y / 2, 1).exp().sum(1), torch.ones(5, dtype=torch.float64))


def _kl_to_oracle(sm, y, beta):
    with torch.no_grad():
        losses = sm.unroll(y, target=y, loss_fn=mse, use_policy=False).losses  # (N, T)
        log_q_star = log_oracle_distribution(losses, beta)
        log_q = sm.policy.plan_log_q(y, sm.model.readout(1, sm.model.step(1, sm.model.initial_state(y), y), y), 1)
    return float((log_q_star.exp() * (log_q_star - log_q)).sum(1).mean())


def test_stage2_moves_the_plan_toward_the_oracle_and_it_plans_once(tmp_path):
    torch.manual_seed(0)
    sm = StoppingModel(Halving(), PlanMLPPolicy(T, 2, features=output_signals))
    y = sample(512, torch.Generator().manual_seed(1), None)[0]
    beta = 0.05
    before = _kl_to_oracle(sm.eval(), y, beta)
    stages = {"stage2": StageConfig(objective="stage2", beta=beta, iterations=150, batch_size=64, lr=1e-2,
                                    eval_every=150)}
    train(sm, sample, mse, stages, run_dir=tmp_path)
    after = _kl_to_oracle(sm.eval(), y, beta)
    assert after < 0.5 * before, (before, after)

    calls = []
    sm.policy.register_forward_hook(lambda *a: calls.append(1))
    with torch.inference_mode():
        out = sm.unroll(y[:8])
    assert len(calls) == 1, "a planner is asked once per batch, at its plan step"
    assert out.stop_logits.shape[1] == T - 1


def test_it_is_saved_and_loaded_with_the_model(tmp_path):
    torch.manual_seed(0)
    sm = StoppingModel(Halving(), PlanMLPPolicy(T, 2))
    sm.policy.norm.running_mean.fill_(0.3)
    sm.save_pretrained(tmp_path / "m")
    again = StoppingModel.from_pretrained(tmp_path / "m", Halving(), PlanMLPPolicy(T, 2))
    torch.testing.assert_close(again.policy.norm.running_mean, torch.full((2,), 0.3))
    assert again.policy.plan_step == 1


@pytest.mark.parametrize("kwargs, match", [({"num_steps": 1}, "at least 2"), ({"plan_step": 6}, "below num_steps"),
                                           ({"num_features": 0}, "num_features"), ({"features": 3}, "function")])
def test_bad_arguments_are_refused_by_name(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        PlanMLPPolicy(**{"num_steps": T, **kwargs})
