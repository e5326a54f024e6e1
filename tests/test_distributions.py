"""Numerical identities of the stop-time distributions and stage losses (paper Eq. 3-9, App. A)."""
import math

import pytest
import torch

from learn2stop.core import losses as L
from learn2stop.core.distributions import (
    entropy,
    log_depth_prior,
    log_oracle_distribution,
    log_stop_time_distribution,
    map_stop_time,
    oracle_distribution,
    stop_time_distribution,
)



@pytest.fixture(autouse=True)
def float64():
    """Identities are checked in double precision; restored afterwards for other modules."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def eq3_by_hand(p):
    """q(t) = pi_t prod_{tau<t} (1 - pi_tau), q(T) = prod (1 - pi_tau): a plain double loop."""
    B, Tm1 = p.shape
    q = torch.zeros(B, Tm1 + 1)
    for b in range(B):
        surv = 1.0
        for t in range(Tm1):
            q[b, t] = p[b, t] * surv
            surv *= 1 - p[b, t]
        q[b, Tm1] = surv
    return q


@pytest.mark.parametrize("T", [1, 2, 7, 13])
def test_stop_time_distribution_sums_to_one_and_matches_eq3(T, gen):
    logits = torch.randn(5, T - 1, generator=gen) * 3
    q = log_stop_time_distribution(logits).exp()
    assert q.shape == (5, T)
    torch.testing.assert_close(q.sum(1), torch.ones(5))
    torch.testing.assert_close(q, eq3_by_hand(torch.sigmoid(logits)))
    torch.testing.assert_close(stop_time_distribution(torch.sigmoid(logits)), q)


def test_extreme_logits_stay_finite():
    logits = torch.tensor([[60.0, -60.0, 60.0], [-80.0, -80.0, -80.0]])
    log_q = log_stop_time_distribution(logits)
    assert torch.isfinite(log_q).all()
    torch.testing.assert_close(log_q.exp().sum(1), torch.ones(2))
    assert log_q.exp()[1, -1] > 0.999  # never stops -> all mass on T


def test_oracle_matches_closed_form(gen):
    losses = torch.rand(4, 6, generator=gen)
    beta = 0.37
    expected = torch.exp(-losses / beta) / torch.exp(-losses / beta).sum(1, keepdim=True)
    torch.testing.assert_close(oracle_distribution(losses, beta), expected)
    assert (map_stop_time(losses) == losses.argmin(1)).all()


def joint(q, losses, beta):
    return (q * losses).sum(1) - beta * entropy(q.log())


@pytest.mark.parametrize("beta", [0.05, 1.0, 3.0])
def test_oracle_minimises_joint_loss_over_simplex(beta, gen):
    losses = torch.rand(3, 7, generator=gen) * 2
    q_star = oracle_distribution(losses, beta)
    best = joint(q_star, losses, beta)
    for _ in range(200):
        # random perturbations inside the simplex, small and large
        eps = torch.rand(1, generator=gen).item()
        other = torch.softmax(torch.randn(3, 7, generator=gen) * 3, 1)
        q = (1 - eps) * q_star + eps * other
        assert (joint(q, losses, beta) >= best - 1e-12).all()


def test_oracle_with_prior_maximises_beta_vae(gen):
    losses = torch.rand(2, 5, generator=gen)
    beta = 0.5
    log_p = log_depth_prior(5, "geometric", rate=0.7)
    q_star = oracle_distribution(losses, beta, log_p)

    def neg_elbo(q):
        return (q * losses).sum(1) + beta * (q * (q.log() - log_p)).sum(1)

    best = neg_elbo(q_star)
    for _ in range(200):
        q = torch.softmax(q_star.log() + 0.3 * torch.randn(2, 5, generator=gen), 1)
        assert (neg_elbo(q) >= best - 1e-12).all()
    torch.testing.assert_close(L.beta_vae_loss(torch.zeros(2, 4), losses, beta, log_p, reduction="none"),
                               neg_elbo(log_stop_time_distribution(torch.zeros(2, 4)).exp()))


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


@pytest.mark.parametrize("T", [1, 2, 5, 10])
def test_depth_priors_are_normalised(T):
    for kind, rate in (("uniform", 0.0), ("geometric", 0.3), ("geometric", 2.0)):
        torch.testing.assert_close(log_depth_prior(T, kind, rate).exp().sum(), torch.tensor(1.0, dtype=torch.float32))
    p = log_depth_prior(T, "geometric", 0.5).exp()
    assert (p[1:] <= p[:-1]).all()  # less mass on deeper steps


def test_discounted_weights():
    w = L.discounted_weights(4, 0.5, normalize=False)
    torch.testing.assert_close(w, torch.tensor([0.125, 0.25, 0.5, 1.0], dtype=torch.float32))


@pytest.mark.parametrize("call, match", [
    (lambda: oracle_distribution(torch.rand(2, 3), 0.0), "beta must be"),
    (lambda: oracle_distribution(torch.rand(2, 3), -1.0), "beta must be"),
    (lambda: oracle_distribution(torch.tensor([[0.1, float("nan")]]), 1.0), "NaN or inf"),
    (lambda: oracle_distribution(torch.rand(3), 1.0), "shape \\(B, T\\)"),
    (lambda: L.stage2_forward_kl(torch.rand(2, 3), torch.rand(2, 3), 1.0), "stop_logits must have shape"),
    (lambda: log_depth_prior(0), "num_steps"),
    (lambda: log_depth_prior(3, "poisson"), "unknown prior"),
    (lambda: stop_time_distribution(torch.tensor([[1.5]])), "\\[0, 1\\]"),
    (lambda: L.weighted_step_loss(torch.rand(2, 3), torch.ones(4)), "weights must have shape"),
])
def test_bad_input_gets_clear_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
