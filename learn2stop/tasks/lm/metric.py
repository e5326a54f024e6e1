"""What the language model is scored by: per-token traces over exits, the risk of stopping early, Learn-then-Test
calibration of each rule, and real early-exit scoring of a split.

A trace runs the backbone at full depth on non-overlapping windows of a split and keeps, per token (N rows) and exit
(E columns): the cross-entropy, the greedy token, and the signals of every rule at exits 1..E-1 (margin,
saturation, fixed, and the policy's stop probability when there is one). Rules are calibrated on the validation
trace (what a rule would do with the exits alone, no propagated cache: a token's trace logits are those of a
context that ran at full depth); their test numbers are measured by real early exit (:func:`score_split`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ...core.risk_control import calibrate_risk
from .models import StepwiseGPT, score_with_exits
from .rules import make_rule, saturation, softmax_margin
from .train import exit_cost_fractions, exit_states, oracle_q

SIGNALS = ("policy", "margin", "saturation", "fixed")


def windows(ids: Tensor, context: int, max_windows: int = 0) -> tuple[Tensor, Tensor]:
    """Non-overlapping windows of ``context`` tokens and their next-token targets: x, y (W, context)."""
    W = (ids.numel() - 1) // context
    if W < 1:
        raise ValueError(f"the split ({ids.numel()} tokens) is shorter than the context + 1 ({context + 1})")
    W = min(W, max_windows) if max_windows else W
    x = ids[:W * context].view(W, context)
    return x, ids[1:W * context + 1].view(W, context)


@dataclass
class LmTrace:
    """Per token (N rows): losses (N, E), greedy tokens (N, E), targets (N,), signals name -> (N, E - 1)."""

    losses: Tensor
    greedy: Tensor
    targets: Tensor
    signals: dict

    def risk(self, kind: str, reference: "LmTrace | None" = None) -> Tensor:
        """(N, E) risk of stopping at each exit: the loss increase over full depth, or disagreement with its greedy
        token; full depth is the reference trace's (another model on the same tokens) when given, else this one's."""
        ref = self if reference is None else reference
        if ref.losses.shape[0] != self.losses.shape[0]:
            raise ValueError(f"the reference trace has {ref.losses.shape[0]} tokens, this one {self.losses.shape[0]}")
        if kind == "loss":
            return self.losses - ref.losses[:, -1:]
        return (self.greedy != ref.greedy[:, -1:]).float()


@torch.no_grad()
def trace_split(gpt, x: Tensor, y: Tensor, policy=None, batch: int = 32) -> LmTrace:
    """The trace of a backbone (and its policy) on windows x, y (W, T)."""
    losses, greedy, sig = [], [], {k: [] for k in SIGNALS}
    for i in range(0, x.shape[0], batch):
        xb, yb = x[i:i + batch], y[i:i + batch]
        states = exit_states(gpt, xb)
        E = len(states) - 1
        logits = [gpt.head(h) for h in states[1:]]  # E x (b, T, V)
        lp = torch.stack([lg.log_softmax(-1) for lg in logits], 2)  # (b, T, E, V)
        losses.append(-lp.gather(3, yb[:, :, None, None].expand(-1, -1, E, 1))[..., 0].flatten(0, 1))
        greedy.append(lp.argmax(-1).flatten(0, 1))
        for t in range(1, E):
            h, hp = states[t], states[t - 1]
            sig["margin"].append(softmax_margin(logits[t - 1]).flatten())
            sig["saturation"].append(saturation(h, hp).flatten())
            sig["fixed"].append(torch.full((h.shape[0] * h.shape[1],), float(t)))
            if policy is not None:
                sig["policy"].append(torch.sigmoid(policy.stop_logits(t, logits[t - 1], h, hp)).flatten())
    n_t = E - 1
    signals = {k: _columns(v, n_t) for k, v in sig.items() if v}
    return LmTrace(torch.cat(losses), torch.cat(greedy), y.flatten(), signals)


def _columns(chunks: list[Tensor], n_t: int) -> Tensor:
    """Chunks appended batch by batch, exit by exit, as one (N, n_t) tensor."""
    per_batch = [torch.stack(chunks[i:i + n_t], 1) for i in range(0, len(chunks), n_t)]
    return torch.cat(per_batch, 0)


def calibrate_rule(trace: LmTrace, rule: str, costs: Tensor, kind: str, epsilon: float, delta: float,
                   max_tokens: int = 0, reference: LmTrace | None = None):
    """The cheapest threshold of ``rule`` certified to risk <= epsilon at level delta on the trace's tokens
    (Learn-then-Test, :func:`~learn2stop.core.risk_control.calibrate_risk`), the risk over the reference's full
    depth (None: the trace's own)."""
    scores, risk = trace.signals[rule], trace.risk(kind, reference)
    if max_tokens and scores.shape[0] > max_tokens:
        pick = torch.randperm(scores.shape[0], generator=torch.Generator().manual_seed(0))[:max_tokens]
        scores, risk = scores[pick], risk[pick]
    core_name = {"fixed": "fixed", "margin": "confidence"}.get(rule, "threshold")  # the core's signal kinds
    cal = calibrate_risk(scores, risk, epsilon, delta, core_name, costs=costs,
                         loss_range=(0.0, 1.0) if kind == "agreement" else None)
    return replace(cal, rule=rule)


def oracle_exits(cfg, gpt, trace: LmTrace, shape) -> Tensor:
    """Each token's MAP exit under the oracle q* (labels needed: a bound), 1-based, (W, T)."""
    return (oracle_q(cfg, gpt, trace.losses).argmax(1) + 1).view(shape)


@torch.no_grad()
def score_split(gpt, x: Tensor, y: Tensor, rule, batch: int = 32, planned: Tensor | None = None) -> dict:
    """Real early exit on windows x, y (W, T): loss, perplexity, accuracy, mean exit layer, per-token losses."""
    view = StepwiseGPT(gpt)
    layers = torch.tensor(gpt.cfg.exit_layers)
    losses, correct, exit_layer = [], [], []
    for i in range(0, x.shape[0], batch):
        xb, yb = x[i:i + batch], y[i:i + batch]
        r = rule if planned is None else (lambda p: (lambda t, lg, h, hp: p == t))(planned[i:i + batch])
        logits, exits = score_with_exits(view, xb, r)
        lp = logits.log_softmax(-1)
        losses.append(-lp.gather(2, yb[..., None])[..., 0].flatten())
        correct.append((lp.argmax(-1) == yb).flatten())
        exit_layer.append(layers[exits - 1].flatten())
    losses, exit_layer = torch.cat(losses), torch.cat(exit_layer).float()
    loss = float(losses.mean())
    return {"loss": loss, "perplexity": math.exp(loss), "accuracy": float(torch.cat(correct).float().mean()),
            "mean_layers": float(exit_layer.mean()), "token_losses": losses, "exit_layers": exit_layer}


def rule_for(gpt, name: str, lam: float, policy=None):
    """The exit rule ``name`` at threshold ``lam`` for this backbone."""
    return make_rule(name, lam, policy)


def costs_of(gpt) -> Tensor:
    return exit_cost_fractions(gpt)
