"""The language model's stages: the plain GPT (the baseline, full depth), deep supervision, Stage I and Stage II.

Every stage reads the per-token, per-exit cross-entropy losses (N, T) of a batch (N = batch x context tokens, one
row each, T exits): the baseline trains the last column, deep supervision a weighted sum of the columns, Stage I
sum_t q*(t) CE_t with the oracle q*(t) proportional to exp(-(CE_t + price c_t) / beta) held fixed (the core's
:func:`~learn2stop.core.distributions.oracle_distribution` under :func:`~learn2stop.core.distributions.log_cost_prior`,
c_t = layers / L), and Stage II the policy's stop-time distribution fitted to q* by forward KL with the backbone
frozen (:func:`~learn2stop.core.losses.stage2_forward_kl`), or, with ``method.stage2_target`` risk, its stop logits
regressed on the per-token risk of stopping that Learn-then-Test bounds, against the calibration reference
(:func:`risk_batch`). Deep supervision starts from the baseline's weights,
Stage I from deep supervision's (:data:`STARTS_FROM`). Each stage's result is one atomic checkpoint; a finished
stage is loaded, not run again.
"""
from __future__ import annotations

import copy
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from ...core.distributions import log_cost_prior, oracle_distribution
from ...core.losses import stage2_forward_kl, weighted_step_loss
from ...utils.checkpoint import load_checkpoint, save_checkpoint
from .config import LmConfig, LmStageConfig
from .data import sample_windows
from .models import GPT
from .policy import make_policy, policy_stop_logits

STAGES = ("baseline", "deep", "stage1", "stage2")

#: the backbone each fine-tuning stage starts from. Stage I starts from deep supervision's weights: the plain GPT's
#: early exits are untrained (several nats worse than its last), so from them q* puts all its mass on the last
#: exit and Stage I never trains the others
STARTS_FROM = {"deep": "baseline", "stage1": "deep"}

#: batches of training windows the learned propagation maps are fitted on, after each backbone's training
PROPAGATION_DRAWS = 2


def exit_states(gpt: GPT, x: Tensor) -> list[Tensor]:
    """The hidden states (B, T, C) of x (B, T) at the embedding and after every exit layer, at full depth."""
    h = gpt.embed(x)
    out, exits = [h], set(gpt.cfg.exit_layers)
    for layer, block in enumerate(gpt.blocks, start=1):
        h = block(h)
        if layer in exits:
            out.append(h)
    return out


def per_exit_losses(gpt: GPT, x: Tensor, y: Tensor, states: list[Tensor] | None = None) -> Tensor:
    """(B * T, E) cross-entropy of every token at every exit (E exits), one row per token."""
    states = exit_states(gpt, x) if states is None else states
    return exit_cross_entropy([gpt.head(h) for h in states[1:]], y)


def exit_cross_entropy(logits: list[Tensor], y: Tensor) -> Tensor:
    """(N, E) cross-entropy of the E exits' logits (..., V) each against targets y (...,), one row per token."""
    stacked = torch.stack(logits, -2)  # (..., E, V)
    E = stacked.shape[-2]
    ce = F.cross_entropy(stacked.flatten(0, -2), y.reshape(-1, 1).expand(-1, E).flatten(), reduction="none")
    return ce.view(-1, E)


def exit_cost_fractions(gpt: GPT) -> Tensor:
    """c_t = layers run to exit t / L, (E,)."""
    return torch.tensor(gpt.cfg.exit_layers, dtype=torch.float32) / gpt.cfg.n_layer


def oracle_q(cfg: LmConfig, gpt: GPT, losses: Tensor) -> Tensor:
    """q*(t) proportional to exp(-(CE_t + price c_t) / beta) for losses (N, E), detached: (N, E)."""
    prior = log_cost_prior(exit_cost_fractions(gpt), cfg.method.price, cfg.method.beta)
    return oracle_distribution(losses.detach(), cfg.method.beta, prior)


def deep_weights(kind: str, E: int) -> Tensor:
    """Deep supervision's exit weights, summing to 1: uniform, or rising with depth (w_t proportional to t)."""
    w = torch.ones(E) if kind == "uniform" else torch.arange(1, E + 1, dtype=torch.float32)
    return w / w.sum()


def backbone_loss(stage: str, cfg: LmConfig, gpt: GPT, x: Tensor, y: Tensor) -> Tensor:
    """The training loss of a backbone stage on one batch."""
    if stage == "baseline":
        return F.cross_entropy(gpt(x).flatten(0, 1), y.flatten())
    losses = per_exit_losses(gpt, x, y)  # (N, E)
    if stage == "deep":
        return weighted_step_loss(losses, deep_weights(cfg.method.deep_weights, losses.shape[1]))
    stage1 = (oracle_q(cfg, gpt, losses) * losses).sum(1).mean()  # Stage I, q* held fixed
    return stage1 + cfg.method.full_depth_weight * losses[:, -1].mean()


@torch.no_grad()
def fit_propagation(gpt: GPT, idx: Tensor, ridge: float = 1e-3) -> dict[str, float]:
    """Fit ``gpt``'s learned propagation maps (``propagation="learned"``) on token windows idx (B, T) by ridge
    regression: the map of layer l takes the hidden state a token stops with at any exit before l to the state
    the token would enter block l with at full depth, over every (exit, token) pair, pairs equally weighted.
    Returns the relative squared error of that prediction, averaged over the layers, for the fitted maps and
    for ``copy`` (the identity) on the same tokens."""
    if gpt.propagate_maps is None:
        raise ValueError('fit_propagation: the model propagates by copy; propagation="learned" has maps to fit')
    h = gpt.embed(idx)
    states = [h.flatten(0, 1).double()]  # the residual stream after 0..L blocks, (N, C) each
    for block in gpt.blocks:
        h = block(h)
        states.append(h.flatten(0, 1).double())
    exits, C = gpt.cfg.exit_layers, gpt.cfg.n_embd
    fitted, copied = [], []
    for layer in range(2, gpt.cfg.n_layer + 1):
        sources = [k for k in exits if k < layer]
        if not sources:  # before the first exit: no token skips this layer, its map stays as it is
            continue
        x = torch.cat([states[k] for k in sources])  # (N_pairs, C) exit states before the layer
        y = states[layer - 1].repeat(len(x) // len(states[0]), 1)  # the state block ``layer`` reads
        x1 = torch.cat([x, x.new_ones(len(x), 1)], 1)
        gram = x1.T @ x1
        gram += ridge * gram.diagonal().mean() * torch.eye(C + 1, dtype=gram.dtype)
        w = torch.linalg.solve(gram, x1.T @ y)  # (C + 1, C)
        m = gpt.propagate_maps[layer - 2]
        m.weight.copy_(w[:C].T.to(m.weight))
        m.bias.copy_(w[C].to(m.bias))
        scale = (y - y.mean(0)).pow(2).sum()
        fitted.append(float((x1 @ w - y).pow(2).sum() / scale))
        copied.append(float((x - y).pow(2).sum() / scale))
    return {"fitted": sum(fitted) / len(fitted), "copy": sum(copied) / len(copied)}


def lr_at(s: LmStageConfig, it: int) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``lr * min_lr_ratio``."""
    if it < s.warmup:
        return s.lr * (it + 1) / s.warmup
    frac = (it - s.warmup) / max(1, s.iters - s.warmup)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def make_optimizer(params, s: LmStageConfig) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=s.lr, betas=(0.9, 0.99))


def fit(params, loss_fn, s: LmStageConfig, draw, log, name: str, every: int = 100) -> list[float]:
    """``s.iters`` AdamW steps of loss_fn(x, y) on batches from draw(); the running losses, every ``every`` steps."""
    opt, history, running = make_optimizer(params, s), [], None
    for it in range(s.iters):
        for group in opt.param_groups:
            group["lr"] = lr_at(s, it)
        x, y = draw()
        loss = loss_fn(x, y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"{name}: the loss is {float(loss)} at step {it}; lower {name}.lr")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
        opt.step()
        value = float(loss.detach())
        running = value if running is None else 0.95 * running + 0.05 * value
        if (it + 1) % every == 0 or it + 1 == s.iters:
            history.append(running)
            log(f"  {name} step {it + 1}/{s.iters}: loss {running:.4f}")
    return history


def policy_batch(gpt: GPT, x: Tensor, y: Tensor,
                 reads_logits: bool) -> tuple[list[Tensor], list[Tensor] | None, Tensor]:
    """What Stage II reads of the frozen backbone on a batch, one row per token (N = batch x context): the states
    [embedding, exit 1, .., exit E] (N, C) each, the exits' logits (N, V) each when the policy reads them, and the
    per-exit losses (N, E)."""
    with torch.no_grad():
        states = [h.flatten(0, 1) for h in exit_states(gpt, x)]
        logits = [gpt.head(h) for h in states[1:]]
    return states, logits if reads_logits else None, exit_cross_entropy(logits, y)


def stage2_loss(cfg: LmConfig, gpt: GPT, policy, states: list[Tensor], logits: list[Tensor] | None,
                losses: Tensor) -> Tensor:
    """Forward KL(q* || q_phi) per token, averaged: the policy's (N, E - 1) stop logits against q*."""
    prior = log_cost_prior(exit_cost_fractions(gpt), cfg.method.price, cfg.method.beta)
    return stage2_forward_kl(policy_stop_logits(policy, states, logits), losses, cfg.method.beta, prior)


def risk_batch(gpt: GPT, reference: GPT, x: Tensor, y: Tensor, risk: str,
               reads_logits: bool) -> tuple[list[Tensor], list[Tensor] | None, Tensor]:
    """What Stage II reads with ``method.stage2_target`` risk: :func:`policy_batch`'s states and logits, and the
    (N, E - 1) targets of stopping at exit t against ``reference``'s full depth, the per-token quantities whose mean
    Learn-then-Test bounds: with ``risk`` loss, the gain in nats (the reference's cross-entropy minus the exit's, the
    negated risk); with agreement, 1 where the exit's greedy token is the reference's."""
    states, logits, losses = policy_batch(gpt, x, y, True)
    with torch.no_grad():
        ref = logits[-1] if reference is gpt else reference(x).flatten(0, 1)  # (N, V) its full depth
        if risk == "loss":
            target = exit_cross_entropy([ref], y) - losses
        else:
            target = (torch.stack(logits, 1).argmax(-1) == ref.argmax(-1)[:, None]).float()
    return states, logits if reads_logits else None, target[:, :-1]


def stage2_risk_loss(policy, states: list[Tensor], logits: list[Tensor] | None, target: Tensor,
                     risk: str) -> Tensor:
    """The policy's (N, E - 1) stop logits fitted to :func:`risk_batch`'s targets: with ``risk`` loss a least-squares
    regression of the gain (the logit estimates the expected gain of stopping, so thresholding it stops the tokens
    of least expected loss first, the order that keeps a mean loss bound at the fewest layers; a 0/1 "loses
    nothing" label would rank a token that loses 0.001 nats with one that loses 3); with agreement a logistic
    regression of agreement (the expected 0/1 risk)."""
    s = policy_stop_logits(policy, states, logits)
    if risk == "loss":
        return F.mse_loss(s, target)
    return F.binary_cross_entropy_with_logits(s, target)


def stage2_objective(cfg: LmConfig, gpt: GPT, policy, reference: GPT):
    """Stage II's loss of a batch (x, y) under ``method.stage2_target``, ``reference`` the calibration's model."""
    if cfg.method.stage2_target == "risk":
        risk = cfg.calibration.risk
        return lambda x, y: stage2_risk_loss(policy, *risk_batch(gpt, reference, x, y, risk, policy.reads_logits),
                                             risk)
    return lambda x, y: stage2_loss(cfg, gpt, policy, *policy_batch(gpt, x, y, policy.reads_logits))


def new_policy(cfg: LmConfig, gpt: GPT):
    """The run's untrained stopping policy for backbone ``gpt``."""
    return make_policy(cfg.model.policy, gpt.cfg.n_embd, len(gpt.cfg.exit_layers), cfg.model.policy_hidden)


def checkpoint_path(run_dir: Path, stage: str) -> Path:
    return Path(run_dir) / "checkpoints" / f"{stage}.pt"


def train_stages(cfg: LmConfig, run_dir: Path, train_ids: Tensor, vocab_size: int, log=print,
                 evaluate=None) -> dict:
    """Run (or load) every stage in turn; returns {stage: summary} and leaves the models in ``models``.

    ``evaluate(stage, gpt, policy) -> dict`` (optional) is called when a stage finishes, its result stored in the
    stage's checkpoint (the validation loss of each stage, for the report)."""
    gcfg = cfg.model.gpt(vocab_size)
    models, summary = {}, {}
    for stage in STAGES:
        path = checkpoint_path(run_dir, stage)
        s = getattr(cfg, stage)
        if path.is_file():
            ck = load_checkpoint(path)
            models[stage] = _restore(stage, ck, gcfg, cfg, models)
            summary[stage] = ck["summary"]
            log(f"{stage}: loaded {path.name} (finished earlier)")
            continue
        torch.manual_seed(cfg.seed + STAGES.index(stage))
        draw = _drawer(train_ids, s.batch, gcfg.context, torch.Generator().manual_seed(cfg.seed * 1000 + STAGES.index(stage)))
        t0 = time.perf_counter()
        if stage == "stage2":
            gpt = models["stage1"][0]
            policy = new_policy(cfg, gpt)
            policy.fit_scale(*policy_batch(gpt, *draw(), True)[:2])
            reference = models["baseline"][0] if cfg.calibration.reference == "gpt" else gpt
            history = fit(policy.parameters(), stage2_objective(cfg, gpt, policy, reference), s, draw, log, stage)
            models[stage] = (gpt, policy)
        else:
            gpt = copy.deepcopy(models[STARTS_FROM[stage]][0]) if stage in STARTS_FROM else GPT(gcfg)
            gpt.train()
            history = fit(gpt.parameters(), lambda x, y: backbone_loss(stage, cfg, gpt, x, y), s, draw, log, stage)
            gpt.eval()
            if gpt.propagate_maps is not None:  # fitted to the backbone as trained (they take no gradient in it)
                err = fit_propagation(gpt, torch.cat([draw()[0] for _ in range(PROPAGATION_DRAWS)]))
                log(f"  {stage}: propagation maps fitted, relative error of a skipped layer's input "
                    f"{err['fitted']:.4f} (copy: {err['copy']:.4f})")
            models[stage] = (gpt, None)
        summary[stage] = {"iters": s.iters, "seconds": time.perf_counter() - t0, "train_loss": history,
                          **(evaluate(stage, *models[stage]) if evaluate else {})}
        gpt, policy = models[stage]
        payload = {"stage": stage, "summary": summary[stage], "gpt": gpt.state_dict() if stage != "stage2" else None,
                   "policy": policy.state_dict() if policy is not None else None}
        save_checkpoint(payload, path)
        log(f"{stage}: done in {summary[stage]['seconds']:.0f}s, saved {path.name}")
    return {"models": models, "summary": summary}


def _drawer(ids: Tensor, batch: int, context: int, gen: torch.Generator):
    return lambda: sample_windows(ids, batch, context, gen, what="training split")


def _restore(stage: str, ck: dict, gcfg, cfg: LmConfig, models: dict):
    """A finished stage's (gpt, policy) from its checkpoint (Stage II's backbone is Stage I's, loaded before it)."""
    if stage == "stage2":
        policy = new_policy(cfg, models["stage1"][0])
        policy.load_state_dict(ck["policy"])
        return models["stage1"][0], policy.eval()
    gpt = GPT(gcfg)
    gpt.load_state_dict(ck["gpt"])
    return gpt.eval(), None
