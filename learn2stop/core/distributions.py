"""Stop-time distributions: the policy-induced q_phi, the oracle q*_theta and depth priors.

Everything works on a batch of per-step quantities laid out as (B, T) and stays in log
space, because q_phi(t) is a product of up to T probabilities.

Paper references (Chen et al., "Learning to Stop While Learning to Predict", ICML 2020):
Eq. 2 (stopping policy), Eq. 3 (variational stop-time distribution), Eq. 6-7 (oracle).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .protocols import member


def _check_steps(name: str, x: Tensor, min_steps: int = 1) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must have shape (B, T); got shape {tuple(x.shape)}")
    if x.shape[1] < min_steps:
        raise ValueError(f"{name} needs at least {min_steps} step(s) on dim 1; got shape {tuple(x.shape)}")
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} contains NaN or inf")


def _check_beta(beta: float) -> None:
    if not (isinstance(beta, (int, float)) and math.isfinite(beta) and beta > 0):
        raise ValueError(f"beta must be a finite number > 0; got {beta!r}")


def log_stop_time_distribution(stop_logits: Tensor) -> Tensor:
    """log q_phi(t) for t = 1..T from the policy's stop logits at t = 1..T-1 (paper Eq. 3).

    q_phi(t) = pi_t * prod_{tau<t} (1 - pi_tau) for t < T, and q_phi(T) = prod_{tau<T} (1 - pi_tau),
    with pi_t = sigmoid(stop_logits[:, t-1]). Computed with logsigmoid, so it is exact even when
    pi_t is within float precision of 0 or 1.

    Args:
        stop_logits: (B, T-1) logits of the stop probability; T-1 may be 0 (a single step).
    Returns:
        (B, T) log-probabilities; exp() of each row sums to 1.

    Example:
        >>> log_stop_time_distribution(torch.zeros(1, 2)).exp()
        tensor([[0.5000, 0.2500, 0.2500]])
    """
    _check_steps("stop_logits", stop_logits, min_steps=0)
    log_stop = F.logsigmoid(stop_logits)  # (B, T-1)  log pi_t
    log_continue = F.logsigmoid(-stop_logits)  # (B, T-1)  log (1 - pi_t)
    # log survival to step t: sum of log(1 - pi_tau) over tau < t, for t = 1..T
    zero = stop_logits.new_zeros(stop_logits.shape[0], 1)
    log_survival = torch.cat([zero, log_continue.cumsum(dim=1)], dim=1)  # (B, T)
    last = stop_logits.new_zeros(stop_logits.shape[0], 1)  # step T stops with probability 1
    return log_survival + torch.cat([log_stop, last], dim=1)


def stop_logits_from_distribution(log_q: Tensor) -> Tensor:
    """The inverse of :func:`log_stop_time_distribution`: the stop logits that induce a given q_phi.

    pi_t = q(t) / sum_{tau >= t} q(tau), so logit pi_t = log q(t) - log sum_{tau > t} q(tau). A policy
    that predicts the whole stop-time distribution at once (a *planning* policy) is turned into the
    sequential form every loss, rule and calibrator reads.

    Args:
        log_q: (B, T) log-probabilities (normalised or not: only their differences matter).
    Returns:
        (B, T-1) stop logits.

    Example:
        >>> stop_logits_from_distribution(torch.tensor([[0.5, 0.25, 0.25]]).log())
        tensor([[0., 0.]])
    """
    if log_q.dim() != 2 or log_q.shape[1] < 1:  # no finiteness pass: a planning policy calls this on the hot path
        raise ValueError(f"log_q must have shape (B, T); got shape {tuple(log_q.shape)}")
    tail = torch.logcumsumexp(log_q.flip(1), dim=1).flip(1)  # (B, T) log sum_{tau >= t} q(tau)
    return log_q[:, :-1] - tail[:, 1:]


def replanned_log_q(log_q1: Tensor, log_q2: Tensor, replan_step: int) -> Tensor:
    """log q_phi of a plan revised once: the first plan's q1 up to step s-1, and its mass from step s on
    spread by the second plan q2 (made at step s, from what the run has shown by then).

        q(t) = q1(t) for t < s,    q(t) = q1(>= s) * q2(t | >= s) for t >= s

    The forward KL of this q to q* splits into the first plan's terms before s (and its total mass from s on)
    and q*(>= s) times the KL of the oracle conditioned on t >= s to q2; Stage II fits the second plan by that
    last term (:func:`~learn2stop.core.losses.stage2_replan_forward_kl`) and the first plan by its own KL, whole,
    since its re-priced argmax decides who leaves before s.

    Args:
        log_q1: (B, T) log q of the first plan (normalised).
        log_q2: (B, T) log q of the second plan; only steps s..T are read (renormalised on them).
        replan_step: s, 1-based, in 2..T.
    Returns:
        (B, T) log-probabilities; exp() of each row sums to 1.

    Example:
        >>> q = replanned_log_q(torch.full((1, 4), 0.25).log(), torch.tensor([[0., 0., 1., 3.]]).log(), 3).exp()
        >>> [round(v, 4) for v in q[0].tolist()]
        [0.25, 0.25, 0.125, 0.375]
    """
    if log_q1.dim() != 2 or log_q1.shape != log_q2.shape:
        raise ValueError(f"log_q1 and log_q2 must have the same shape (B, T); got {tuple(log_q1.shape)} and "
                         f"{tuple(log_q2.shape)}")
    T = log_q1.shape[1]
    if isinstance(replan_step, bool) or not isinstance(replan_step, int) or not 2 <= replan_step <= T:
        raise ValueError(f"replan_step must be an integer in 2..{T}; got {replan_step!r}")
    k = replan_step - 1
    late = torch.logsumexp(log_q1[:, k:], dim=1, keepdim=True)  # (B, 1) log q1(>= s)
    return torch.cat([log_q1[:, :k], late + torch.log_softmax(log_q2[:, k:], dim=1)], dim=1)


def stop_time_distribution(stop_probs: Tensor) -> Tensor:
    """q_phi(t) from stop probabilities pi_1..pi_{T-1} in [0, 1] (paper Eq. 3), as a product.

    The direct form of Eq. 3, for readers and for policies that output probabilities.
    Training code should prefer :func:`log_stop_time_distribution` on logits.

    Args:
        stop_probs: (B, T-1) probabilities of stopping at steps 1..T-1.
    Returns:
        (B, T) probabilities that sum to 1 over dim 1.
    """
    _check_steps("stop_probs", stop_probs, min_steps=0)
    if ((stop_probs < 0) | (stop_probs > 1)).any():
        raise ValueError("stop_probs must lie in [0, 1]")
    ones = stop_probs.new_ones(stop_probs.shape[0], 1)
    survival = torch.cat([ones, torch.cumprod(1 - stop_probs, dim=1)], dim=1)  # (B, T)
    return survival * torch.cat([stop_probs, ones], dim=1)


def survival_log_probability(stop_logits: Tensor) -> Tensor:
    """log P(not stopped before t) for t = 1..T; shape (B, T). Used by the RL form of Stage II."""
    _check_steps("stop_logits", stop_logits, min_steps=0)
    zero = stop_logits.new_zeros(stop_logits.shape[0], 1)
    return torch.cat([zero, F.logsigmoid(-stop_logits).cumsum(dim=1)], dim=1)


def log_oracle_distribution(losses: Tensor, beta: float, log_prior: Tensor | None = None) -> Tensor:
    """log q*_theta(t | x, y) = log softmax_t(-loss_t / beta + log p(t)) (paper Eq. 6-7).

    The closed-form minimiser over the simplex of E_q[loss] - beta * H(q) (uniform prior) or,
    with a prior, the maximiser of the beta-VAE objective E_q[-loss] - beta KL(q || p).
    Gradients flow into ``losses`` (Stage I differentiates through the oracle).

    Args:
        losses: (B, T) per-step losses l(y, x_t), one row per sample.
        beta: exploration coefficient > 0.
        log_prior: optional (T,) or (B, T) log-prior over stop times (see :func:`log_depth_prior`).
    Returns:
        (B, T) log-probabilities.
    """
    _check_steps("losses", losses)
    _check_beta(beta)
    scores = oracle_scores(losses, beta)
    if log_prior is not None:
        scores = scores + _broadcast_prior(log_prior, losses)
    return torch.log_softmax(scores, dim=1)


#: floor of the shifted oracle scores -(l_t - min_s l_s) / beta: exp(-1e4) is 0 in every float format, so the
#: floor changes no probability, but a huge finite loss (a diverged step) cannot turn a score into -inf.
ORACLE_SCORE_FLOOR = -1e4


def oracle_scores(losses: Tensor, beta: float) -> Tensor:
    """-(l_t - min_s l_s) / beta, floored at :data:`ORACLE_SCORE_FLOOR`; shape (B, T), each row's best step 0.

    The same softmax as -l_t / beta (a constant shift per row), but finite for any finite loss: a loss
    of 1e30 at beta 0.01 would otherwise overflow to -inf and give NaN in the stage losses.
    """
    low = losses.detach().min(dim=1, keepdim=True).values  # (B, 1), a constant: the gradient is unchanged
    return (-(losses - low) / beta).clamp_min(ORACLE_SCORE_FLOOR)


def oracle_distribution(losses: Tensor, beta: float, log_prior: Tensor | None = None) -> Tensor:
    """q*_theta(t | x, y), the oracle stop-time distribution (paper Eq. 7); shape (B, T)."""
    return log_oracle_distribution(losses, beta, log_prior).exp()


def map_stop_time(losses: Tensor, log_prior: Tensor | None = None, beta: float = 1.0) -> Tensor:
    """The MAP target t_hat = argmax_t q*(t) as a 0-based index, shape (B,) (paper Sec. 4.5).

    Without a prior it is the step of smallest loss, whatever beta; ties go to the earliest step.
    """
    return log_oracle_distribution(losses, beta, log_prior).argmax(dim=1)


def entropy(log_q: Tensor) -> Tensor:
    """H(q) = -sum_t q(t) log q(t) per row of a (B, T) log-distribution; shape (B,).

    Zero-probability steps (log q = -inf) contribute 0, as the limit q log q -> 0 says.
    """
    q = log_q.exp()
    return -(q * torch.where(q > 0, log_q, torch.zeros_like(log_q))).sum(dim=1)


def sample_stop_time(log_q: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Draw one stop time per row of a (B, T) log-distribution; returns 0-based indices (B,)."""
    if log_q.dim() != 2:
        raise ValueError(f"log_q must have shape (B, T); got shape {tuple(log_q.shape)}")
    probs = log_q.detach().exp().float().cpu()  # CPU: generators are CPU generators here
    return torch.multinomial(probs, 1, generator=generator).squeeze(1).to(log_q.device)


def log_depth_prior(num_steps: int, kind: str = "uniform", rate: float = 0.0, device=None) -> Tensor:
    """Normalised log-prior over stop times t = 1..T; shape (T,).

    The paper uses a uniform prior and notes that a prior with less mass on deeper steps
    penalises depth (Sec. 3.4). ``kind``:
      - ``"uniform"``: p(t) = 1/T.
      - ``"geometric"``: p(t) proportional to exp(-rate * (t - 1)), normalised over 1..T
        (rate >= 0; rate = 0 is uniform). Sums to exactly 1 for every T.

    Example:
        >>> log_depth_prior(3, "geometric", rate=1.0).exp().sum().item()
        1.0
    """
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be an integer >= 1; got {num_steps!r}")
    t = torch.arange(num_steps, dtype=torch.float32, device=device)
    if kind == "uniform":
        scores = torch.zeros_like(t)
    elif kind == "geometric":
        if not (math.isfinite(rate) and rate >= 0):
            raise ValueError(f"geometric prior rate must be finite and >= 0; got {rate!r}")
        scores = -rate * t
    else:
        raise ValueError(f"unknown prior kind {kind!r}; choose 'uniform' or 'geometric'")
    return torch.log_softmax(scores, dim=0)


def exit_costs(model, device=None) -> Tensor:
    """Normalised cumulative cost c_t of stopping at step t = 1..T; shape (T,), c_T = 1.

    A step-wise model may declare ``exit_costs`` (any positive, non-decreasing sequence of length T,
    e.g. cumulative FLOPs or measured seconds); without it every step costs the same, c_t = t / T.
    Normalising by c_T makes a price on computation read as "loss one would give for the whole model".
    """
    T = model.num_steps
    raw = member(model, "exit_costs")
    if raw is None:
        costs = torch.arange(1, T + 1, dtype=torch.float32)
    else:
        costs = torch.as_tensor(raw, dtype=torch.float32).flatten().cpu()
        if costs.numel() != T:
            raise ValueError(f"{type(model).__name__}.exit_costs has {costs.numel()} entries; the model has {T} steps")
        if not torch.isfinite(costs).all() or (costs <= 0).any() or (costs.diff() < 0).any():
            raise ValueError(f"{type(model).__name__}.exit_costs must be positive and non-decreasing; got {costs.tolist()}")
    return (costs / costs[-1]).to(device)


def fixed_depth_costs(model, device=None) -> Tensor:
    """Normalised cost of stopping at t = 1..T when the model is read out at t alone (a fixed depth, a rule never
    asked early); shape (T,), on the scale of :func:`exit_costs` (divided by the raw ``exit_costs[-1]``, so the
    network alone at T is below 1 when the full ``exit_costs`` count every exit head). A model without
    ``fixed_exit_costs`` gives :func:`exit_costs`."""
    raw = member(model, "fixed_exit_costs")
    if raw is None:
        return exit_costs(model, device)
    if member(model, "exit_costs") is None:
        raise ValueError(f"{type(model).__name__} declares fixed_exit_costs without exit_costs, their scale")
    costs = torch.as_tensor(raw, dtype=torch.float32).flatten().cpu()
    if costs.numel() != model.num_steps:
        raise ValueError(f"{type(model).__name__}.fixed_exit_costs has {costs.numel()} entries; the model has "
                         f"{model.num_steps} steps")
    if not torch.isfinite(costs).all() or (costs <= 0).any():
        raise ValueError(f"{type(model).__name__}.fixed_exit_costs must be positive; got {costs.tolist()}")
    last = float(torch.as_tensor(model.exit_costs, dtype=torch.float32).flatten()[-1])
    return (costs / last).to(device)


def log_cost_prior(costs: Tensor, price: float, beta: float) -> Tensor:
    """The price on computation as a depth prior: log p(t) = log_softmax(-price * c_t / beta); shape (T,).

    q*(t) proportional to exp(-(loss_t + price * c_t) / beta) is exactly the oracle of Eq. 7 under this
    prior, so a step cost needs no new machinery: every stage that takes a prior takes it.
    """
    _check_beta(beta)
    if not (math.isfinite(price) and price >= 0):
        raise ValueError(f"price must be a finite number >= 0; got {price!r}")
    return torch.log_softmax(-price * costs.float() / beta, dim=0)


def _broadcast_prior(log_prior: Tensor, like: Tensor) -> Tensor:
    if log_prior.dim() == 1:
        log_prior = log_prior.unsqueeze(0)
    if log_prior.shape[-1] != like.shape[-1]:
        raise ValueError(
            f"log_prior has {log_prior.shape[-1]} steps but the losses have {like.shape[-1]}"
        )
    return log_prior.to(like)
