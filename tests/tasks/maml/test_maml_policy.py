"""The MAML-stop policy (policy.py): what it reads and needs from MAML's outputs, and its posterior-mean input (an
attentive neural process on the support, read by the stopping policy as each step's distance to it, computed once
per rollout and trained by its own regression loss in Stage II)."""
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


# ----------------------------------------------------------------------------- what the policy reads
def test_policy_runs_on_maml_outputs_and_needs_features():
    torch.manual_seed(0)
    net = MLP(hidden=8)
    model = MAMLModel(net, 3, 0.05, loss="mse", policy_features=True)
    policy = MAMLStopPolicy(net.feat_dim, 1, 3, classification=False)
    inputs, target = SinusoidSampler(1, 5, 6).batch(None, 4, torch.Generator().manual_seed(0))
    sm = StoppingModel(model, policy)
    r = sm.unroll(inputs, target, model.task_loss)
    assert r.stop_logits.shape == (4, 2) and torch.isfinite(r.stop_logits).all()
    e = sm(inputs)
    assert e.stop_times.min() >= 1 and e.stop_times.max() <= 3
    model.policy_features = False
    with pytest.raises(ValueError, match="policy_features"):
        sm.unroll(inputs, target, model.task_loss)


@pytest.mark.parametrize("classification", [False, True])
def test_the_joint_policy_reads_each_support_element_with_its_fit(classification):
    """The default policy embeds each support element's features with its target, prediction and residual: pairing
    the fits with other elements' features changes its logit. A masked (padding) element does not."""
    g = torch.Generator().manual_seed(0)
    B, S, Q, D, C = 3, 5, 4, 6, (4 if classification else 1)
    y = torch.randint(0, C, (B, S), generator=g) if classification else torch.randn(B, S, 1, generator=g)
    inputs = {"support_y": y, "support_mask": torch.tensor([[1.0] * 5, [1.0] * 5, [1, 1, 1, 0, 0]]), "shots": torch.tensor([5, 5, 3])}
    output = {"support_pred": torch.randn(B, S, C, generator=g), "support_feats": torch.randn(B, S, D, generator=g),
              "query_feats": torch.randn(B, Q, D, generator=g), "pred": torch.randn(B, Q, C, generator=g),
              "support_loss": torch.rand(B, generator=g)}
    torch.manual_seed(0)
    joint = MAMLStopPolicy(D, C, 4, classification)
    assert joint.inputs == "joint"
    shift = [1, 2, 0, 3, 4]  # the first three support elements' fits move to other elements' features
    moved = {**output, "support_pred": output["support_pred"][:, shift]}
    moved_inputs = {**inputs, "support_y": y[:, shift]}
    with torch.no_grad():
        a, b = joint(inputs, output, 2), joint(moved_inputs, moved, 2)
    assert a.shape == (B,) and not torch.allclose(a, b)
    padded = {**output, "support_feats": output["support_feats"].clone()}
    padded["support_feats"][2, 3:] = 100.0
    with torch.no_grad():
        torch.testing.assert_close(joint(inputs, padded, 2), joint(inputs, output, 2))
    for gone in ("both", "separate"):  # the release's separate sets are not built
        with pytest.raises(ValueError, match="inputs must be one of joint, scalars"):
            MAMLStopPolicy(D, C, 4, classification, inputs=gone)


def test_a_scalars_policy_reads_its_scalars_alone():
    """``inputs="scalars"`` (the quick preset's): no set embedding, so the support and query sets cannot move its logit,
    and only the support loss is needed from the readout; its checkpoint loads into a scalars policy, and a
    joint-built policy refuses it (the config says what a policy reads; a checkpoint does not rebuild it)."""
    g = torch.Generator().manual_seed(2)
    inputs = {"support_y": torch.randn(2, 3, 1, generator=g), "support_mask": torch.ones(2, 3), "shots": torch.tensor([3, 7])}
    output = {"support_pred": torch.randn(2, 3, 1, generator=g), "support_feats": torch.randn(2, 3, 8, generator=g),
              "query_feats": torch.randn(2, 5, 8, generator=g), "pred": torch.randn(2, 5, 1, generator=g),
              "support_loss": torch.rand(2, generator=g)}
    torch.manual_seed(0)
    scalars = MAMLStopPolicy(8, 1, 5, classification=False, inputs="scalars")
    assert scalars.support_set is None and scalars.head[0].in_features == 3
    assert not any(k.split(".")[0].endswith("_set") for k in scalars.state_dict())
    only_loss = {"support_loss": output["support_loss"], "pred": output["pred"]}
    moved = {**output, "support_feats": -output["support_feats"], "query_feats": output["query_feats"] * 3}
    with torch.no_grad():
        a = scalars(inputs, output, 2)
        torch.testing.assert_close(scalars(inputs, only_loss, 2), a)
        torch.testing.assert_close(scalars(inputs, moved, 2), a)
        assert not torch.allclose(scalars(inputs, {**output, "support_loss": output["support_loss"] + 1}, 2), a)
    loaded = MAMLStopPolicy(8, 1, 5, classification=False, inputs="scalars")
    loaded.load_state_dict(scalars.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(loaded(inputs, output, 2), a)
    with pytest.raises(RuntimeError, match="Missing key"):
        MAMLStopPolicy(8, 1, 5, classification=False).load_state_dict(scalars.state_dict())
    with pytest.raises(ValueError, match="support features"):
        MAMLStopPolicy(8, 1, 5, classification=False)(inputs, only_loss, 2)


def test_the_estimate_starts_from_the_same_weights_whatever_the_policy_reads():
    """The posterior-mean estimate (what MAML-stop's kept answer is chosen by) is built before the policy's own
    modules, so runs that differ only in ``inputs`` start it from the same draw and answer alike before Stage II."""
    made = {}
    for inputs in MAMLStopPolicy.INPUTS:
        torch.manual_seed(0)
        made[inputs] = MAMLStopPolicy(8, 1, 5, classification=False, inputs=inputs, posterior=True, in_dim=1)
    first = made["joint"].posterior.state_dict()
    for inputs, policy in made.items():
        got = policy.posterior.state_dict()
        assert got.keys() == first.keys()
        for k in first:
            torch.testing.assert_close(got[k], first[k], rtol=0, atol=0, msg=f"{inputs}: {k}")
    torch.manual_seed(1)
    other = MAMLStopPolicy(8, 1, 5, classification=False, inputs="joint", posterior=True, in_dim=1).posterior
    assert any(not torch.equal(v, first[k]) for k, v in other.state_dict().items())
