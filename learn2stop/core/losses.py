"""The training objectives of every stage, as plain functions of per-step losses and stop logits.

Shapes: ``losses`` is (B, T), the loss l(y, x_t) of each sample at each step;
``stop_logits`` is (B, T-1), the policy's logits of pi_1..pi_{T-1}. Each function returns the
batch mean (``reduction="mean"``), the sum, or the per-sample values (``reduction="none"``).

Paper references (Chen et al., ICML 2020): Eq. 4 (joint loss), Eq. 5 (beta-VAE), Eq. 8 (Stage I),
Sec. 4.3 and Eq. 9 (Stage II, reverse and forward KL), Appendix A.2 (maximum-entropy RL form),
Sec. 4.5 (sampled Stage I, MAP Stage II).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .distributions import (
    _broadcast_prior,
    _check_beta,
    _check_steps,
    entropy,
    log_oracle_distribution,
    log_stop_time_distribution,
    map_stop_time,
    oracle_scores,
    sample_stop_time,
    survival_log_probability,
)

_REDUCTIONS = ("mean", "sum", "none")


def _reduce(x: Tensor, reduction: str) -> Tensor:
    if reduction == "mean":
        return x.mean()
    if reduction == "sum":
        return x.sum()
    if reduction == "none":
        return x
    raise ValueError(f"reduction must be one of {_REDUCTIONS}; got {reduction!r}")


def _check_pair(stop_logits: Tensor, losses: Tensor) -> None:
    _check_steps("losses", losses)
    _check_steps("stop_logits", stop_logits, min_steps=0)
    if stop_logits.shape != (losses.shape[0], losses.shape[1] - 1):
        raise ValueError(
            f"stop_logits must have shape (B, T-1) = {(losses.shape[0], losses.shape[1] - 1)} "
            f"for losses of shape {tuple(losses.shape)}; got {tuple(stop_logits.shape)}"
        )


# ----------------------------------------------------------------------------- baselines
def weighted_step_loss(losses: Tensor, weights: Tensor, reduction: str = "mean") -> Tensor:
    """sum_t w_t * l_t, the deep-supervision loss of the baselines.

    LISTA uses w_t = gamma^(T-t) (paper Sec. 5.1), SDN a ramp of internal-classifier weights,
    plain training w = (0, ..., 0, 1).

    Args:
        losses: (B, T). weights: (T,), non-negative.
    """
    _check_steps("losses", losses)
    if weights.shape != (losses.shape[1],):
        raise ValueError(f"weights must have shape ({losses.shape[1]},); got {tuple(weights.shape)}")
    return _reduce((losses * weights.to(losses)).sum(dim=1), reduction)


def discounted_weights(num_steps: int, gamma: float = 1.0, normalize: bool = True) -> Tensor:
    """w_t = gamma^(T-t) for t = 1..T (paper Sec. 5.1); normalised to sum 1 by default."""
    if not 0 < gamma <= 1:
        raise ValueError(f"gamma must be in (0, 1]; got {gamma!r}")
    w = gamma ** torch.arange(num_steps - 1, -1, -1, dtype=torch.float32)
    return w / w.sum() if normalize else w


# ----------------------------------------------------------------------------- Stage I
def stage1_expected_loss(
    losses: Tensor, beta: float, log_prior: Tensor | None = None, reduction: str = "mean"
) -> Tensor:
    """Stage I, exact: sum_t q*_theta(t) l_t with the gradient also through q*_theta (Eq. 8).

    Eq. 8 maximises sum_t q*(t) log p(y | t, x); with l = -log p this is the loss returned here.
    """
    log_q = log_oracle_distribution(losses, beta, log_prior)
    return _reduce((log_q.exp() * losses).sum(dim=1), reduction)


def stage1_marginal_loss(
    losses: Tensor, beta: float, log_prior: Tensor | None = None, reduction: str = "mean"
) -> Tensor:
    """Stage I as a marginal likelihood: -beta * log sum_t p(t) exp(-l_t / beta).

    Its gradient is sum_t q*(t) grad l_t (the oracle acts as fixed weights), the EM-style
    gradient that the sampled variant estimates without bias. With beta = 2 sigma^2 and a
    squared error this is the release's LISTA Stage I loss, up to a constant.
    """
    _check_steps("losses", losses)
    _check_beta(beta)
    # -beta log sum_t p(t) exp(-l_t / beta) = low - beta log sum_t p(t) exp(-(l_t - low) / beta), low = min_t l_t:
    # the shifted form stays finite for a huge finite loss (see oracle_scores).
    low = losses.detach().min(dim=1).values  # (B,), a constant shift: the gradient stays sum_t q*(t) grad l_t
    scores = oracle_scores(losses, beta)
    if log_prior is None:
        scores = scores - torch.log(torch.tensor(float(losses.shape[1])))
    else:
        scores = scores + _broadcast_prior(log_prior, losses)
    return _reduce(low - beta * torch.logsumexp(scores, dim=1), reduction)


def stage1_sampled_loss(
    losses: Tensor,
    beta: float,
    log_prior: Tensor | None = None,
    generator: torch.Generator | None = None,
    reduction: str = "mean",
) -> Tensor:
    """Stage I, sampled: l_{t_s} with t_s ~ q*_theta drawn without gradient (Sec. 4.5).

    E_{t_s}[grad l_{t_s}] = sum_t q*(t) grad l_t, the gradient of :func:`stage1_marginal_loss`.
    """
    t_s = sample_stop_time(log_oracle_distribution(losses.detach(), beta, log_prior), generator)
    return _reduce(losses.gather(1, t_s[:, None]).squeeze(1), reduction)


# ----------------------------------------------------------------------------- Stage II
def _stage2_logs(stop_logits: Tensor, losses: Tensor, beta: float, log_prior: Tensor | None) -> tuple[Tensor, Tensor]:
    """(log q*, log q_phi), the oracle computed from detached losses: theta is fixed in Stage II."""
    _check_pair(stop_logits, losses)
    return log_oracle_distribution(losses.detach(), beta, log_prior), log_stop_time_distribution(stop_logits)


def stage2_replan_forward_kl(
    replan_log_q: Tensor, losses: Tensor, beta: float, replan_step: int, log_prior: Tensor | None = None,
    reduction: str = "mean"
) -> Tensor:
    """q*(>= s) KL(q*(. | >= s) || q2): a second plan, made at step s for the samples still running, fitted to the
    oracle conditioned on stopping at s or later, weighted by the oracle's mass there. With the first plan's own
    forward KL it is the forward KL of the two plans combined (:func:`~learn2stop.core.distributions.replanned_log_q`)
    but for the first plan's shape after s, which the first plan keeps fitting (its re-priced argmax decides who
    leaves before s)."""
    if replan_log_q.shape != losses.shape:
        raise ValueError(f"replan_log_q must have the shape of the per-step losses {tuple(losses.shape)}; "
                         f"got {tuple(replan_log_q.shape)}")
    k = replan_step - 1
    log_p = log_oracle_distribution(losses.detach(), beta, log_prior)
    late = log_p[:, k:]
    cond_p, cond_q = torch.log_softmax(late, dim=1), torch.log_softmax(replan_log_q[:, k:], dim=1)
    return _reduce(torch.logsumexp(late, dim=1).exp() * (cond_p.exp() * (cond_p - cond_q)).sum(dim=1), reduction)


def stage2_cross_entropy(
    stop_logits: Tensor, losses: Tensor, beta: float, log_prior: Tensor | None = None, reduction: str = "mean"
) -> Tensor:
    """-sum_t q*(t) log q_phi(t), the cross-entropy form of the forward KL (Eq. 9)."""
    log_q_star, log_q = _stage2_logs(stop_logits, losses, beta, log_prior)
    return _reduce(-(log_q_star.exp() * log_q).sum(dim=1), reduction)


def stage2_forward_kl(
    stop_logits: Tensor, losses: Tensor, beta: float, log_prior: Tensor | None = None, reduction: str = "mean"
) -> Tensor:
    """KL(q*_theta || q_phi) with theta fixed (Eq. 9): cross-entropy minus H(q*)."""
    log_q_star, log_q = _stage2_logs(stop_logits, losses, beta, log_prior)
    return _reduce((log_q_star.exp() * (log_q_star - log_q)).sum(dim=1), reduction)


def stage2_map_loss(
    stop_logits: Tensor, losses: Tensor, log_prior: Tensor | None = None, reduction: str = "mean"
) -> Tensor:
    """-log q_phi(t_hat), t_hat = argmax_t q*(t): the MAP target of Sec. 4.5."""
    _check_pair(stop_logits, losses)
    t_hat = map_stop_time(losses.detach(), log_prior)
    log_q = log_stop_time_distribution(stop_logits)
    return _reduce(-log_q.gather(1, t_hat[:, None]).squeeze(1), reduction)


def stage2_reverse_kl(
    stop_logits: Tensor, losses: Tensor, beta: float, log_prior: Tensor | None = None, reduction: str = "mean"
) -> Tensor:
    """KL(q_phi || q*_theta) with theta fixed (Sec. 4.3), summed exactly over the T stop times."""
    log_q_star, log_q = _stage2_logs(stop_logits, losses, beta, log_prior)
    return _reduce((log_q.exp() * (log_q - log_q_star)).sum(dim=1), reduction)


def max_entropy_rl_objective(
    stop_logits: Tensor, losses: Tensor, beta: float, reduction: str = "mean"
) -> Tensor:
    """E_pi [ sum_t r(x_t, a_t) + H(pi_t) ], the maximum-entropy RL form of Stage II (App. A.2).

    The reward is r = -l_t / beta when the policy stops at t and 0 when it continues; H(pi_t)
    is the entropy of the Bernoulli stop decision at each step that is reached (no decision is
    taken at step T). The expectation over trajectories is computed exactly: step t is reached
    with the survival probability S_t, so the objective is
    sum_t q_phi(t) (-l_t / beta) + sum_{t<T} S_t H(pi_t).

    It satisfies KL(q_phi || q*) = -objective + log sum_t exp(-l_t / beta) for a uniform prior
    (the appendix writes the reward as -beta * l; dividing by beta is the scaling that makes
    the identity exact with q* = softmax(-l / beta)).
    """
    _check_pair(stop_logits, losses)
    _check_beta(beta)
    log_q = log_stop_time_distribution(stop_logits)
    reward = -(log_q.exp() * losses.detach()).sum(dim=1) / beta  # not q * (-l / beta): 0 * inf for a huge loss
    p = torch.sigmoid(stop_logits)
    step_entropy = -(p * torch.nn.functional.logsigmoid(stop_logits) + (1 - p) * torch.nn.functional.logsigmoid(-stop_logits))
    reached = survival_log_probability(stop_logits)[:, :-1].exp()  # (B, T-1)
    return _reduce(reward + (reached * step_entropy).sum(dim=1), reduction)


# ----------------------------------------------------------------------------- Stage III / AEVB
def joint_loss(stop_logits: Tensor, losses: Tensor, beta: float, reduction: str = "mean") -> Tensor:
    """E_{t~q_phi}[l_t] - beta * H(q_phi), the joint objective of Eq. 4 (gradients to theta and phi)."""
    _check_pair(stop_logits, losses)
    _check_beta(beta)
    log_q = log_stop_time_distribution(stop_logits)
    return _reduce((log_q.exp() * losses).sum(dim=1) - beta * entropy(log_q), reduction)


def beta_vae_loss(
    stop_logits: Tensor, losses: Tensor, beta: float, log_prior: Tensor | None = None, reduction: str = "mean"
) -> Tensor:
    """-J_beta-VAE = E_{q_phi}[l_t] + beta * KL(q_phi || p) (Eq. 5), for Stage III and AEVB.

    With the uniform prior it equals :func:`joint_loss` + beta * log T (Lemma 1). A prior with
    less mass on deep steps (:func:`~learn2stop.core.distributions.log_depth_prior`) penalises depth.
    """
    _check_pair(stop_logits, losses)
    _check_beta(beta)
    log_q = log_stop_time_distribution(stop_logits)
    if log_prior is None:
        log_p = torch.full_like(log_q, -torch.log(torch.tensor(float(losses.shape[1]))).item())
    else:
        log_p = _broadcast_prior(log_prior, losses).expand_as(log_q)
    q = log_q.exp()
    kl = (q * torch.where(q > 0, log_q - log_p, torch.zeros_like(log_q))).sum(dim=1)
    return _reduce((q * losses).sum(dim=1) + beta * kl, reduction)
