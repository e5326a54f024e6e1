"""MAML-stop's posterior-mean input: an attentive neural process on the support, read by the stopping policy as each
step's distance to it, computed once per rollout and trained by its own regression loss in Stage II."""
import pytest
import torch

from learn2stop.core import StageConfig, StoppingModel, unroll
from learn2stop.core.objectives import StageObjective
from learn2stop.tasks.maml.config import preset
from learn2stop.tasks.maml.learner import MLP, MAMLModel
from learn2stop.tasks.maml.models import build
from learn2stop.tasks.maml.policy import MAMLStopPolicy, PosteriorPredictive
from learn2stop.tasks.maml.samplers import SinusoidSampler
from learn2stop.utils.config import ConfigError

from conftest import CountingPosterior


def sinusoids(n=6, seed=0, k_max=5):
    return SinusoidSampler(1, k_max, 7, noise=0.5).batch(None, n, torch.Generator().manual_seed(seed))


def small(T=4, posterior=True):
    torch.manual_seed(0)
    net = MLP(hidden=8)
    model = MAMLModel(net, T, 0.05, loss="mse", policy_features=True)
    policy = MAMLStopPolicy(net.feat_dim, 1, T, classification=False, dim=8, hidden=16, posterior=posterior, in_dim=1)
    return StoppingModel(model, policy)


def test_padding_support_elements_do_not_move_the_estimate():
    inputs, _ = sinusoids()
    net = PosteriorPredictive(1, 1)
    padded = {k: v.clone() for k, v in inputs.items()}
    padded["support_x"][inputs["support_mask"] == 0] = 50.0
    padded["support_y"][inputs["support_mask"] == 0] = -50.0
    a = net(inputs["support_x"], inputs["support_y"], inputs["support_mask"], inputs["query_x"])
    b = net(padded["support_x"], padded["support_y"], padded["support_mask"], padded["query_x"])
    assert a.shape == inputs["query_x"].shape and torch.allclose(a, b, atol=1e-6)


def test_the_estimate_is_computed_once_per_rollout_and_again_only_when_the_batch_changes():
    sm = small()
    sm.policy.posterior.__class__ = CountingPosterior
    inputs, target = sinusoids()
    CountingPosterior.calls = 0
    r = sm.unroll(inputs, target, sm.model.task_loss)
    assert r.stop_logits.shape == (6, 3) and CountingPosterior.calls == 1  # asked at steps 1..3, computed once
    assert sm.policy.auxiliary_loss(inputs, target) is not None and CountingPosterior.calls == 1  # the same rollout's
    out = unroll(sm.model, inputs, keep_outputs=True, model_grad=False).step_outputs[0]
    with torch.no_grad():
        CountingPosterior.calls = 0
        sm.policy(inputs, out, 1)
        assert CountingPosterior.calls == 0  # one computed with gradients serves a request without
    fresh = {k: v.clone() for k, v in inputs.items()}
    with torch.no_grad():
        sm.policy(fresh, out, 1)
        assert CountingPosterior.calls == 1  # new input tensors: computed again, without gradients
    assert sm.policy.auxiliary_loss(fresh, target).requires_grad and CountingPosterior.calls == 2  # wanted with them: again
    with torch.no_grad():
        CountingPosterior.calls = 0
        e = sm(inputs)  # real early exit: new input tensors only where rows stopped
    assert CountingPosterior.calls <= len(set(e.stop_times.tolist())) and e.stop_times.max() <= 4
    # the estimate for a row does not depend on the others, so recomputing it on fewer rows gives the same values
    with torch.no_grad():
        full = sm.policy.posterior_mean(inputs)
        rows = torch.tensor([4, 1])
        sub = {k: v[rows] for k, v in inputs.items()}
        torch.testing.assert_close(sm.policy.posterior_mean(sub), full[rows], atol=1e-6, rtol=1e-5)


def test_a_weight_change_recomputes_the_estimate():
    sm = small()
    inputs, target = sinusoids()
    a = sm.policy.posterior_mean(inputs).detach().clone()
    with torch.no_grad():
        for p in sm.policy.posterior.parameters():
            p.add_(0.1)
    assert not torch.allclose(sm.policy.posterior_mean(inputs), a)


def test_the_stop_logits_do_not_train_the_estimate_and_its_own_loss_does():
    sm = small()
    inputs, target = sinusoids()
    r = sm.unroll(inputs, target, sm.model.task_loss, model_grad=False)
    r.stop_logits.sum().backward()
    assert all(p.grad is None or not p.grad.any() for p in sm.policy.posterior.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in sm.policy.head.parameters())
    sm.policy.zero_grad()
    sm.policy.auxiliary_loss(inputs, target).backward()
    assert all(p.grad is not None for p in sm.policy.posterior.parameters())


def test_stage2_adds_the_auxiliary_loss_and_a_short_run_improves_the_estimate():
    sm = small(T=3)
    obj = StageObjective(sm, sm.model.task_loss, StageConfig(objective="stage2", variant="reverse_kl", beta=0.1))
    test_in, test_y = sinusoids(200, seed=99, k_max=5)
    with torch.no_grad():
        before = float(sm.policy.auxiliary_loss(test_in, test_y))
    opt = torch.optim.Adam(sm.policy.parameters(), 3e-3)
    g = torch.Generator().manual_seed(3)
    sampler = SinusoidSampler(1, 5, 7, noise=0.5)
    for _ in range(150):
        inputs, target = sampler.batch(None, 16, g)
        loss, metrics = obj(inputs, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert "aux_loss" in metrics and metrics["aux_loss"] > 0
    with torch.no_grad():
        after = float(sm.policy.auxiliary_loss(test_in, test_y))
    assert after < 0.8 * before  # from about the targets' variance (the zero function) down


def test_a_checkpoint_loads_only_into_the_policy_it_was_trained_as():
    """With or without the estimate is the run's configuration (``model.policy_posterior``): a checkpoint of the
    other kind is refused, not silently rebuilt."""
    inputs, _ = sinusoids()
    out = unroll(small().model, inputs, keep_outputs=True, model_grad=False).step_outputs[1]
    trained = small(posterior=True).policy
    loaded = small(posterior=True).policy
    loaded.load_state_dict(trained.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(loaded(inputs, out, 2), trained(inputs, out, 2))
    with pytest.raises(RuntimeError, match="posterior"):
        small(posterior=True).policy.load_state_dict(small(posterior=False).policy.state_dict())


def test_the_option_is_for_regression_and_named_when_misused():
    assert preset("quick").model.policy_posterior and not preset("paper").model.policy_posterior  # on for sinusoids
    off = preset("quick", model={"policy_posterior": False})
    assert build(preset("quick"), None)[1].policy.posterior is not None
    assert build(off, None)[1].policy.posterior is None
    with pytest.raises(ConfigError, match="policy_posterior"):
        preset("quick", model={"policy_posterior": "sometimes"})
    with pytest.raises(ConfigError, match="model.policy_posterior"):
        preset("paper", model={"policy_posterior": True})
    with pytest.raises(ValueError, match="regression"):
        MAMLStopPolicy(8, 5, 4, classification=True, posterior=True, in_dim=1)
    with pytest.raises(ConfigError, match="policy_inputs"):
        preset("quick", model={"policy_inputs": "sets"})
    assert build(preset("quick"), None)[1].policy.inputs == "scalars" and build(preset("paper"), None)[1].policy.inputs == "joint"
