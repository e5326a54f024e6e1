"""Stage objectives: from a batch to a scalar loss, for every stage of the paper's Algorithm 1.

Each objective is a plain function ``(stopping_model, inputs, target, loss_fn, cfg, generator)
-> (loss, metrics)`` registered under its name; :class:`StageObjective` wraps the chosen one in
an ``nn.Module`` so that DistributedDataParallel can wrap a whole training step.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor, nn

from ..utils.config import check_fields, non_negative, non_negative_int, one_of, positive, positive_int, require
from ..utils.registry import Registry
from . import losses as L
from .distributions import (exit_costs, log_cost_prior, log_depth_prior, log_oracle_distribution,
                            log_stop_time_distribution, sample_stop_time)
from .loop import run_with_early_exit
from .model import StoppingModel
from .protocols import member
from .rules import StopAtTimes

OBJECTIVES: Registry[Callable] = Registry("stage objective")

#: variants allowed per objective; the first is the default.
VARIANTS = {
    "deep_supervision": ("discounted", "last", "weighted"),
    "stage1": ("expected", "marginal", "sampled"),
    "stage2": ("forward_kl", "map", "reverse_kl"),
    "stage3": ("beta_vae",),
    "aevb": ("beta_vae",),
    "auxiliary": ("auxiliary",),
}
#: which parameters each objective trains.
TRAINS = {"deep_supervision": "model", "stage1": "model", "stage2": "policy", "stage3": "both", "aevb": "both",
          "auxiliary": "policy"}
#: what validation selects on by default ("last" step loss, "oracle" best-step loss, "policy" early-exit loss).
SELECTS = {"deep_supervision": "last", "stage1": "oracle", "stage2": "policy", "stage3": "policy", "aevb": "policy",
           "auxiliary": "none"}


@dataclass
class MethodConfig:
    """The method's settings, declared once and inherited by every stage that does not override them."""

    beta: float = 1.0
    """exploration coefficient of the oracle (Eq. 7) and of the beta-VAE objective."""
    prior: str = "uniform"
    """The depth prior p(t): uniform, or geometric (with prior_rate)."""
    prior_rate: float = 0.0
    """The geometric depth prior's rate."""
    price: float = 0.0
    """lambda, the price of computation: q*(t) proportional to exp(-(loss_t + lambda c_t) / beta), with c_t the model's
    normalised cumulative cost of stopping at t (c_T = 1; see ``exit_costs``)."""

    def __post_init__(self):
        check_fields(self, "method.")
        positive(self.beta, "method.beta")
        one_of(self.prior, ("uniform", "geometric"), "method.prior")
        non_negative(self.prior_rate, "method.prior_rate")
        non_negative(self.price, "method.price")


#: the StageConfig fields a stage inherits from :class:`MethodConfig` when left unset (None / "").
INHERITED = ("beta", "prior", "prior_rate", "price")


@dataclass
class StageConfig:
    """One training stage: its objective and optimisation settings."""

    #: a variant belongs to its objective: a config layer that changes the objective alone takes its default variant
    follows: ClassVar[dict[str, str]] = {"variant": "objective"}

    objective: str = "stage1"
    """deep_supervision (baseline), stage1, stage2, stage3, aevb, or auxiliary (the policy's auxiliary loss alone, no
    rollout: e.g. MAML's posterior-mean estimate before Stage II)."""
    variant: str = ""
    """deep_supervision discounted|last|weighted; stage1 expected|marginal|sampled; stage2 forward_kl|map|reverse_kl; ""
    picks the first."""
    iterations: int = 1000
    """Optimiser steps of the stage (0 skips it)."""
    batch_size: int = 256
    """Training samples per step."""
    lr: float = 1e-3
    """Learning rate (the peak, with a schedule)."""
    weight_decay: float = 0.0
    """L2 weight decay (Adam's coupled form, or SGD's)."""
    lr_schedule: str = "constant"
    """constant, cosine (down to lr * lr_min_factor) or step (x0.1 at each fraction in lr_decay_at)."""
    lr_decay_at: tuple[float, ...] = ()
    """With lr_schedule step: the fractions of the run, in (0, 1), at which the rate drops tenfold."""
    lr_min_factor: float = 0.0
    """With lr_schedule cosine: the final rate as a fraction of lr, in [0, 1]."""
    warmup: int = 0
    """Steps of linear warm-up to lr (0: none)."""
    grad_clip: float = 0.0
    """Clip the gradient's global norm to this (0: no clipping)."""
    beta: float | None = None
    """This stage's method.beta; unset (none) inherits method.beta."""
    gamma: float = 1.0
    """deep_supervision discounted: step t's loss weighs gamma^(T-t), in (0, 1] (1: every step alike)."""
    prior: str = ""
    """This stage's method.prior; unset ("") inherits method.prior."""
    prior_rate: float | None = None
    """This stage's method.prior_rate; unset (none) inherits method.prior_rate."""
    price: float | None = None
    """This stage's method.price; unset (none) inherits method.price."""
    recompute: bool = False
    """sampled Stage I computes every step's loss without gradients, samples t ~ q*, then recomputes only steps 1..t
    with gradients (the memory-efficient scheme of App. B.2)."""
    step_weights: tuple[float, ...] = ()
    """deep_supervision "weighted": w_1..w_T (e.g. SDN's IC weights and 1 for the final output)."""
    eval_every: int = 100
    """Validate (and maybe keep the best weights) every this many steps."""
    checkpoint_every: int = 100
    """Write a resumable checkpoint every this many steps."""
    select: str = ""
    """validation criterion for keeping the best weights: last|oracle|policy|none; "" = objective's default."""
    optimizer: str = "adam"
    """"adam" (coupled L2 ``weight_decay``) or "sgd" (Nesterov momentum ``momentum``, L2 ``weight_decay``: the usual
    recipe of CIFAR ResNets and SDN's)."""
    momentum: float = 0.9
    """With optimizer sgd: the Nesterov momentum, in [0, 1)."""
    ema: float = 0.0
    """decay of an exponential moving average of the trained weights (and their float buffers, e.g. batch-norm
    statistics), 0 = off. Validation, selection and the stage's final weights are the average's; the decay ramps up
    as min(ema, (1 + i) / (10 + i)) so the first iterates do not dominate."""

    def __post_init__(self):
        check_fields(self)  # types first: no bool for an int, no NaN or inf, lists where lists belong
        one_of(self.objective, VARIANTS, "objective")
        if self.variant == "":
            self.variant = VARIANTS[self.objective][0]
        one_of(self.variant, VARIANTS[self.objective], "variant")
        non_negative_int(self.iterations, "iterations")
        positive_int(self.batch_size, "batch_size")
        positive(self.lr, "lr")
        non_negative(self.weight_decay, "weight_decay")
        one_of(self.lr_schedule, ("constant", "cosine", "step"), "lr_schedule")
        require(all(0 < f < 1 for f in self.lr_decay_at), "lr_decay_at", f"fractions of the run in (0, 1); got {self.lr_decay_at}")
        require(0 <= self.lr_min_factor <= 1, "lr_min_factor", f"must be in [0, 1]; got {self.lr_min_factor}")
        non_negative_int(self.warmup, "warmup")
        non_negative(self.grad_clip, "grad_clip")
        if self.beta is not None:
            positive(self.beta, "beta")
        require(0 < self.gamma <= 1, "gamma", f"must be in (0, 1]; got {self.gamma}")
        one_of(self.prior, ("", "uniform", "geometric"), "prior")
        if self.prior_rate is not None:
            non_negative(self.prior_rate, "prior_rate")
        if self.price is not None:
            non_negative(self.price, "price")
        positive_int(self.eval_every, "eval_every")
        positive_int(self.checkpoint_every, "checkpoint_every")
        require(all(isinstance(w, (int, float)) and math.isfinite(w) and w >= 0 for w in self.step_weights),
                "step_weights", f"must be finite numbers >= 0; got {self.step_weights}")
        if self.select == "":
            self.select = SELECTS[self.objective]
        one_of(self.select, ("last", "oracle", "policy", "none"), "select")
        one_of(self.optimizer, ("adam", "sgd"), "optimizer")
        require(0 <= self.momentum < 1, "momentum", f"must be in [0, 1); got {self.momentum}")
        require(0 <= self.ema < 1, "ema", f"must be in [0, 1) (0: no moving average); got {self.ema}")

    def make_optimizer(self, params: list) -> torch.optim.Optimizer:
        """The stage's optimiser over ``params`` (its learning rate is set per iteration by :meth:`lr_at`)."""
        if self.optimizer == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, nesterov=self.momentum > 0,
                                   weight_decay=self.weight_decay)
        return torch.optim.Adam(params, lr=self.lr, weight_decay=self.weight_decay)

    def ema_decay(self, iteration: int) -> float:
        """The moving average's decay after the 0-based ``iteration``'s step (0 when off)."""
        return min(self.ema, (1 + iteration) / (10 + iteration)) if self.ema > 0 else 0.0

    def inherit(self, method: "MethodConfig | None" = None) -> "StageConfig":
        """A copy with every unset method-level field taken from ``method`` (defaults if None)."""
        # deep supervision uses none of them (beta only for its logged diagnostics): it takes the defaults,
        # so a baseline's checkpoint stays valid whatever beta or price the stop model is trained with
        method = MethodConfig() if (method is None or self.objective == "deep_supervision") else method
        fill = {k: getattr(method, k) for k in INHERITED if getattr(self, k) in (None, "")}
        return dataclasses.replace(self, **fill) if fill else self

    @property
    def resolved(self) -> bool:
        return all(getattr(self, k) not in (None, "") for k in INHERITED)

    @property
    def trains(self) -> str:
        return TRAINS[self.objective]

    def lr_at(self, iteration: int) -> float:
        """Learning rate at a 0-based iteration: linear warm-up, then the schedule."""
        if self.warmup and iteration < self.warmup:
            return self.lr * (iteration + 1) / self.warmup
        frac = iteration / max(self.iterations, 1)
        if self.lr_schedule == "cosine":
            floor = self.lr * self.lr_min_factor
            return floor + 0.5 * (self.lr - floor) * (1 + math.cos(math.pi * frac))
        if self.lr_schedule == "step":
            return self.lr * 0.1 ** sum(frac >= f for f in self.lr_decay_at)
        return self.lr

    def log_prior(self, num_steps: int, device=None, costs: Tensor | None = None) -> Tensor | None:
        """The stage's log p(t): the depth prior plus the price on computation (None if both are flat)."""
        cfg = self.inherit() if not self.resolved else self
        out = None
        if cfg.prior == "geometric" and cfg.prior_rate > 0:
            out = log_depth_prior(num_steps, "geometric", cfg.prior_rate, device=device)
        if cfg.price > 0:
            c = (torch.arange(1, num_steps + 1, dtype=torch.float32) / num_steps) if costs is None else costs
            cost = log_cost_prior(c.to(device), cfg.price, cfg.beta)
            out = cost if out is None else torch.log_softmax(out + cost, dim=0)
        return out

    def model_log_prior(self, model: Any, device=None) -> Tensor | None:
        """:meth:`log_prior` with the step-wise model's own costs (``exit_costs``)."""
        return self.log_prior(model.num_steps, device, exit_costs(model))


def stage_field(**kw: Any) -> Any:
    """A config's stage section: ``stage1: StageConfig = stage_field(objective="stage1", lr=1e-4)``."""
    return field(default_factory=lambda: StageConfig(**kw))


class NonFiniteError(FloatingPointError, ValueError):
    """A training quantity (per-step losses, stop logits, the loss or its gradient) is NaN or inf."""


def step_ranges(steps: list[int]) -> str:
    """[1, 2, 3, 7, 9, 10] -> "1-3, 7, 9-10" (1-based steps, sorted)."""
    parts, i = [], 0
    while i < len(steps):
        j = i
        while j + 1 < len(steps) and steps[j + 1] == steps[j] + 1:
            j += 1
        parts.append(str(steps[i]) if i == j else f"{steps[i]}-{steps[j]}")
        i = j + 1
    return ", ".join(parts)


def check_finite_steps(name: str, values: Tensor) -> None:
    """Refuse NaN / inf in per-step values (B, T'), naming the steps and how many samples hold them."""
    bad = ~torch.isfinite(values.detach())
    if bool(bad.any()):
        steps = (bad.any(dim=0).nonzero().flatten() + 1).tolist()
        kind = "NaN" if bool(torch.isnan(values.detach()).any()) else "inf"
        raise NonFiniteError(f"{name} at step{'s' if len(steps) > 1 else ''} {step_ranges(steps)} non-finite ({kind}) in "
                             f"{int(bad.any(dim=1).sum())} of {values.shape[0]} samples")


def _summary(losses: Tensor, stop_logits: Tensor | None, beta: float) -> dict[str, float]:
    """Cheap per-batch diagnostics: last-step, best-step and (if a policy ran) expected loss and depth."""
    with torch.no_grad():
        m = {"loss_last": float(losses[:, -1].mean()), "loss_oracle": float(losses.min(dim=1).values.mean())}
        steps = torch.arange(1, losses.shape[1] + 1, device=losses.device, dtype=losses.dtype)
        q_star = log_oracle_distribution(losses, beta).exp()
        m["depth_oracle"] = float((q_star * steps).sum(dim=1).mean())
        if stop_logits is not None:
            q = log_stop_time_distribution(stop_logits).exp()
            m["loss_policy"] = float((q * losses).sum(dim=1).mean())
            m["depth_policy"] = float((q * steps).sum(dim=1).mean())
    return m


@OBJECTIVES.register("deep_supervision")
def deep_supervision(sm: StoppingModel, inputs, target, loss_fn, cfg: StageConfig, generator) -> tuple[Tensor, dict]:
    """Baseline: sum_t w_t l_t with w_t = gamma^(T-t) normalised (LISTA, Sec. 5.1), the last step only
    (a plain network), or given weights (SDN's internal-classifier weights)."""
    T = sm.num_steps
    if cfg.variant == "last":
        w = torch.zeros(T).index_fill_(0, torch.tensor([T - 1]), 1.0)
    elif cfg.variant == "weighted":
        if len(cfg.step_weights) != T or sum(cfg.step_weights) <= 0:
            raise ValueError(f"step_weights must hold {T} weights (one per step) with a positive sum; "
                             f"got {cfg.step_weights}")
        w = torch.tensor(cfg.step_weights, dtype=torch.float32)
    else:
        w = L.discounted_weights(T, cfg.gamma)
    # the steps of weight 0 are recorded (validation, logs) but not differentiated
    r = sm.unroll(inputs, target, loss_fn, use_policy=False, grad_steps=set((w.nonzero().flatten() + 1).tolist()))
    check_finite_steps("per-step losses", r.losses)
    return L.weighted_step_loss(r.losses, w.to(r.losses)), _summary(r.losses.detach(), None, cfg.beta)


@OBJECTIVES.register("stage1")
def stage1(sm: StoppingModel, inputs, target, loss_fn, cfg: StageConfig, generator) -> tuple[Tensor, dict]:
    """Stage I: fit theta with the oracle q*_theta (Eq. 8), exact, marginal, or sampled t ~ q*."""
    prior = cfg.model_log_prior(sm.model)
    if cfg.variant == "sampled" and cfg.recompute:
        with torch.no_grad():
            losses = sm.unroll(inputs, target, loss_fn, use_policy=False).losses
        check_finite_steps("per-step losses", losses)
        t_s = sample_stop_time(log_oracle_distribution(losses, cfg.beta, prior), generator) + 1
        # Recompute only steps 1..t_s with gradients; samples drop out of the batch after their t_s.
        r = run_with_early_exit(sm.model, inputs, StopAtTimes(t_s))
        return loss_fn(r.outputs, target).mean(), _summary(losses, None, cfg.beta)
    r = sm.unroll(inputs, target, loss_fn, use_policy=False)
    check_finite_steps("per-step losses", r.losses)
    if cfg.variant == "expected":
        loss = L.stage1_expected_loss(r.losses, cfg.beta, prior)
    elif cfg.variant == "marginal":
        loss = L.stage1_marginal_loss(r.losses, cfg.beta, prior)
    else:
        loss = L.stage1_sampled_loss(r.losses, cfg.beta, prior, generator)
    return loss, _summary(r.losses.detach(), None, cfg.beta)


@OBJECTIVES.register("stage2")
def stage2(sm: StoppingModel, inputs, target, loss_fn, cfg: StageConfig, generator) -> tuple[Tensor, dict]:
    """Stage II: theta frozen; fit pi_phi to the oracle by forward KL, MAP target or reverse KL."""
    _need_policy(sm)
    r = sm.unroll(inputs, target, loss_fn, model_grad=False)
    check_finite_steps("per-step losses", r.losses)
    check_finite_steps("stop logits", r.stop_logits)
    prior = cfg.model_log_prior(sm.model)
    if cfg.variant == "forward_kl":
        loss = L.stage2_forward_kl(r.stop_logits, r.losses, cfg.beta, prior)
    elif cfg.variant == "map":
        loss = L.stage2_map_loss(r.stop_logits, r.losses, prior)
    else:
        loss = L.stage2_reverse_kl(r.stop_logits, r.losses, cfg.beta, prior)
    if r.replan_log_q is not None:  # a second plan: fitted to the oracle of the steps it chooses among
        loss = loss + L.stage2_replan_forward_kl(r.replan_log_q, r.losses, cfg.beta, sm.policy.replan_step, prior)
    return _with_auxiliary(sm, inputs, target, loss, _summary(r.losses, r.stop_logits.detach(), cfg.beta))


@OBJECTIVES.register("stage3")
def stage3(sm: StoppingModel, inputs, target, loss_fn, cfg: StageConfig, generator) -> tuple[Tensor, dict]:
    """Stage III (and AEVB from scratch): theta and phi together on the beta-VAE objective (Eq. 5)."""
    _need_policy(sm)
    r = sm.unroll(inputs, target, loss_fn)
    check_finite_steps("per-step losses", r.losses)
    check_finite_steps("stop logits", r.stop_logits)
    loss = L.beta_vae_loss(r.stop_logits, r.losses, cfg.beta, cfg.model_log_prior(sm.model))
    return _with_auxiliary(sm, inputs, target, loss, _summary(r.losses.detach(), r.stop_logits.detach(), cfg.beta))


OBJECTIVES.register("aevb")(stage3)


@OBJECTIVES.register("auxiliary")
def auxiliary(sm: StoppingModel, inputs, target, loss_fn, cfg: StageConfig, generator) -> tuple[Tensor, dict]:
    """The policy's auxiliary loss alone (``policy.auxiliary_loss(inputs, target)``), with no rollout: a part of the
    policy that learns from the inputs and targets only (MAML's posterior-mean estimate) trained on as many batches
    as it needs, before Stage II fits the stop to the oracle."""
    _need_policy(sm)
    loss = _auxiliary_loss(sm, inputs, target)
    if loss is None:
        raise ValueError(f"objective 'auxiliary' trains the policy's auxiliary_loss, but {type(sm.policy).__name__} "
                         "has none (or returned None)")
    return loss, {"aux_loss": float(loss.detach())}


def _auxiliary_loss(sm: StoppingModel, inputs, target) -> Tensor | None:
    """``policy.auxiliary_loss(inputs, target)`` if the policy has one and it gives one (else None), checked finite:
    what a part of the policy learns from the targets besides the stop, e.g. MAML's posterior-mean estimate."""
    aux = member(sm.policy, "auxiliary_loss")
    loss = aux(inputs, target) if callable(aux) else None
    if loss is not None and not bool(torch.isfinite(loss.detach()).all()):
        raise NonFiniteError(f"the policy's auxiliary loss is non-finite ({float(loss.detach())})")
    return loss


def _with_auxiliary(sm: StoppingModel, inputs, target, loss: Tensor, metrics: dict) -> tuple[Tensor, dict]:
    """The loss plus the policy's own auxiliary loss (:func:`_auxiliary_loss`), if any, logged as ``aux_loss``."""
    extra = _auxiliary_loss(sm, inputs, target)
    if extra is None:
        return loss, metrics
    return loss + extra, {**metrics, "aux_loss": float(extra.detach())}


def _need_policy(sm: StoppingModel) -> None:
    if sm.policy is None:
        raise ValueError("this stage trains or uses a stopping policy, but the StoppingModel has none")


class StageObjective(nn.Module):
    """A training step's forward pass as a module: ``forward(inputs, target) -> (loss, metrics)``.

    Wrapping this module (not the bare model) in DistributedDataParallel lets the loop call the
    model's steps freely while DDP still synchronises the gradients of every trained parameter.
    """

    def __init__(self, stopping_model: StoppingModel, loss_fn: Callable[[Any, Any], Tensor], cfg: StageConfig):
        super().__init__()
        self.stopping_model = stopping_model
        self.loss_fn = loss_fn
        self.cfg = cfg if cfg.resolved else cfg.inherit()
        self._fn = OBJECTIVES.get(cfg.objective)

    def forward(self, inputs: Any, target: Any, generator: torch.Generator | None = None):
        return self._fn(self.stopping_model, inputs, target, self.loss_fn, self.cfg, generator)
