"""Numerical identities of the stage losses (paper Eq. 4-9, App. A): each as a function of (B, T) losses and
(B, T-1) stop logits, checked against the distributions they are written in."""
import math

import pytest
import torch

from learn2stop.core import losses as L
from learn2stop.core.distributions import entropy, log_oracle_distribution, log_stop_time_distribution, oracle_distribution
from test_distributions import float64  # noqa: F401  (autouse: these identities, too, in double precision)


def test_forward_kl_is_cross_entropy_minus_oracle_entropy(gen):
    logits, losses, beta = torch.randn(6, 4, generator=gen), torch.rand(6, 5, generator=gen), 0.3
    ce = L.stage2_cross_entropy(logits, losses, beta, reduction="none")
    kl = L.stage2_forward_kl(logits, losses, beta, reduction="none")
    h = entropy(log_oracle_distribution(losses, beta))
    torch.testing.assert_close(kl, ce - h)
    assert (kl >= -1e-12).all()


def test_reverse_kl_equals_max_entropy_rl_form(gen):
    logits, losses, beta = torch.randn(6, 8, generator=gen) * 2, torch.rand(6, 9, generator=gen), 0.2
    kl = L.stage2_reverse_kl(logits, losses, beta, reduction="none")
    rl = L.max_entropy_rl_objective(logits, losses, beta, reduction="none")
    log_z = torch.logsumexp(-losses / beta, 1)
    torch.testing.assert_close(kl, -rl + log_z)
    # and the gradients w.r.t. phi agree (up to sign), which is what Stage II optimises
    logits.requires_grad_(True)
    g_kl, = torch.autograd.grad(L.stage2_reverse_kl(logits, losses, beta), logits)
    g_rl, = torch.autograd.grad(-L.max_entropy_rl_objective(logits, losses, beta), logits)
    torch.testing.assert_close(g_kl, g_rl)


def test_lemma1_beta_vae_equals_joint_loss_plus_constant(gen):
    logits, losses, beta = torch.randn(5, 5, generator=gen), torch.rand(5, 6, generator=gen), 0.8
    torch.testing.assert_close(L.beta_vae_loss(logits, losses, beta, reduction="none"),
                               L.joint_loss(logits, losses, beta, reduction="none") + beta * math.log(6))


def test_map_loss_is_minus_log_q_at_best_step(gen):
    logits, losses = torch.randn(4, 3, generator=gen), torch.rand(4, 4, generator=gen)
    log_q = log_stop_time_distribution(logits)
    expect = -log_q[torch.arange(4), losses.argmin(1)]
    torch.testing.assert_close(L.stage2_map_loss(logits, losses, reduction="none"), expect)


def test_stage1_expected_gradient_flows_through_oracle(gen):
    losses = torch.rand(3, 5, generator=gen).requires_grad_(True)
    beta = 0.4
    g, = torch.autograd.grad(L.stage1_expected_loss(losses, beta, reduction="sum"), losses)
    q = oracle_distribution(losses.detach(), beta)
    mean = (q * losses.detach()).sum(1, keepdim=True)
    torch.testing.assert_close(g, q - q * (losses.detach() - mean) / beta)


def test_stage1_marginal_gradient_is_oracle_weighted(gen):
    losses = torch.rand(3, 5, generator=gen).requires_grad_(True)
    g, = torch.autograd.grad(L.stage1_marginal_loss(losses, 0.25, reduction="sum"), losses)
    torch.testing.assert_close(g, oracle_distribution(losses.detach(), 0.25))


def test_stage1_sampled_is_unbiased_for_marginal_gradient(gen):
    base = torch.tensor([[0.3, 0.1, 0.5, 0.2]])
    n = 40000
    losses = base.repeat(n, 1).requires_grad_(True)
    g, = torch.autograd.grad(L.stage1_sampled_loss(losses, 0.2, generator=gen, reduction="sum"), losses)
    estimate = g.mean(0)
    exact = oracle_distribution(base, 0.2)[0]
    assert torch.allclose(estimate, exact, atol=4 * (0.25 / n) ** 0.5)


def test_stage2_does_not_differentiate_losses(gen):
    losses = torch.rand(2, 4, generator=gen).requires_grad_(True)
    logits = torch.randn(2, 3, generator=gen).requires_grad_(True)
    for fn in (L.stage2_forward_kl, L.stage2_reverse_kl, L.stage2_cross_entropy):
        out = fn(logits, losses, 0.5)
        g_loss, g_logit = torch.autograd.grad(out, [losses, logits], allow_unused=True)
        assert g_loss is None and g_logit.abs().sum() > 0


def test_discounted_weights():
    w = L.discounted_weights(4, 0.5, normalize=False)
    torch.testing.assert_close(w, torch.tensor([0.125, 0.25, 0.5, 1.0], dtype=torch.float32))


@pytest.mark.parametrize("call, match", [
    (lambda: L.stage2_forward_kl(torch.rand(2, 3), torch.rand(2, 3), 1.0), "stop_logits must have shape"),
    (lambda: L.weighted_step_loss(torch.rand(2, 3), torch.ones(4)), "weights must have shape"),
])
def test_bad_input_gets_clear_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
