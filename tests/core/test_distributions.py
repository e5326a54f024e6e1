"""Numerical identities of the stop-time distributions, the oracle and the depth priors (paper Eq. 3, 7, 8, App. A)."""
import pytest
import torch

from learn2stop.core import losses as L
from learn2stop.core.distributions import (
    entropy,
    log_depth_prior,
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


@pytest.mark.parametrize("T", [1, 2, 5, 10])
def test_depth_priors_are_normalised(T):
    for kind, rate in (("uniform", 0.0), ("geometric", 0.3), ("geometric", 2.0)):
        torch.testing.assert_close(log_depth_prior(T, kind, rate).exp().sum(), torch.tensor(1.0, dtype=torch.float32))
    p = log_depth_prior(T, "geometric", 0.5).exp()
    assert (p[1:] <= p[:-1]).all()  # less mass on deeper steps


@pytest.mark.parametrize("call, match", [
    (lambda: oracle_distribution(torch.rand(2, 3), 0.0), "beta must be"),
    (lambda: oracle_distribution(torch.rand(2, 3), -1.0), "beta must be"),
    (lambda: oracle_distribution(torch.tensor([[0.1, float("nan")]]), 1.0), "NaN or inf"),
    (lambda: oracle_distribution(torch.rand(3), 1.0), "shape \\(B, T\\)"),
    (lambda: log_depth_prior(0), "num_steps"),
    (lambda: log_depth_prior(3, "poisson"), "unknown prior"),
    (lambda: stop_time_distribution(torch.tensor([[1.5]])), "\\[0, 1\\]"),
])
def test_bad_input_gets_clear_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
