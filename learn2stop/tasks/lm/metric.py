"""What the language model is scored by: per-token traces over exits, the risk of stopping early, Learn-then-Test
calibration of each rule, and real early-exit scoring of a split.

A trace runs the backbone at full depth on non-overlapping windows of a split and keeps, per token (N rows) and exit
(E columns): the cross-entropy, the greedy token, and the signals of every rule at exits 1..E-1 (margin,
saturation, fixed, and the policy's stop probability when there is one): what a rule would do with the exits
alone, every earlier token having run at full depth. The trace gives each rule its candidate thresholds and the
sweeps of the frontier and the head-to-head table; a threshold is certified on what is deployed, real early exit on
the validation split (:class:`MeasuredRisk`, :func:`score_split`: a stopped token's later layers propagated, so
later tokens attend to them), where the trace's risk would understate the deployed model's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ...core.calibration import candidate_thresholds, cost_spaced_thresholds
from ...core.calibration_file import Calibration
from ...core.risk_control import certify
from ...core.rules import first_crossing
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


class MeasuredRisk:
    """Per-token risk of a rule at a threshold measured by real early exit of ``gpt`` on windows x, y (what the
    deployed model does), over the reference trace's full depth; each (rule, threshold) is scored once."""

    def __init__(self, gpt, x: Tensor, y: Tensor, policy, reference: LmTrace, kind: str):
        if reference.losses.shape[0] != x.numel():
            raise ValueError(f"the reference trace has {reference.losses.shape[0]} tokens, the windows {x.numel()}")
        self.gpt, self.x, self.y, self.policy, self.reference, self.kind = gpt, x, y, policy, reference, kind
        self._scored: dict = {}

    def __call__(self, rule: str, thr: float) -> tuple[Tensor, Tensor]:
        """(N,) risk and (N,) 1-based exit steps of ``rule`` at threshold ``thr``."""
        key = (rule, thr) if math.isfinite(thr) else ("full", thr)  # full depth is the same for every rule
        if key not in self._scored:
            out = score_split(self.gpt, self.x, self.y, make_rule(*key, self.policy))
            ref = self.reference
            risk = (out["token_losses"] - ref.losses[:, -1] if self.kind == "loss"
                    else (out["greedy"] != ref.greedy[:, -1]).float())
            self._scored[key] = (risk, out["exit_steps"])
        return self._scored[key]


def calibrate_rule(trace: LmTrace, rule: str, costs: Tensor, kind: str, epsilon: float, delta: float,
                   max_tokens: int = 0, reference: LmTrace | None = None, measured: MeasuredRisk | None = None,
                   candidates: int = 200):
    """The cheapest threshold of ``rule`` certified to risk <= epsilon at level delta (Learn-then-Test's fixed
    sequence from full depth down, :func:`~learn2stop.core.risk_control.certify`), over at most ``candidates``
    thresholds drawn from the trace's signal. The risk is over the reference's full depth (None: the trace's own);
    it is the trace's, or with ``measured`` the real early exit's on the same tokens (the trace's order), where
    each threshold tested is a pass over the split: then the thresholds are spaced by the mean depth they give on
    the trace, fine near full depth (:func:`~learn2stop.core.calibration.cost_spaced_thresholds`)."""
    scores = trace.signals[rule]
    pick = None
    if max_tokens and scores.shape[0] > max_tokens:
        pick = torch.randperm(scores.shape[0], generator=torch.Generator().manual_seed(0))[:max_tokens]
        scores = scores[pick]
    if measured is None:
        risk = trace.risk(kind, reference)
        risk = risk if pick is None else risk[pick]

        def losses_at(thr: float) -> tuple[Tensor, Tensor]:
            stops = first_crossing(scores, thr)
            return risk.gather(1, (stops - 1)[:, None])[:, 0], stops
    else:
        def losses_at(thr: float) -> tuple[Tensor, Tensor]:
            r, stops = measured(rule, thr)
            return (r, stops) if pick is None else (r[pick], stops[pick])
    thresholds = (candidate_thresholds(scores, candidates).flip(0) if measured is None  # +inf (full depth) first
                  else cost_spaced_thresholds(scores, costs, candidates)).tolist()
    return certify(thresholds, losses_at, epsilon, delta, rule, costs,
                   loss_range=(0.0, 1.0) if kind == "agreement" else None)


def budget_rule(trace: LmTrace, rule: str, costs: Tensor, budget: float, measured: MeasuredRisk,
                candidates: int = 200):
    """The least aggressive threshold of ``rule`` whose real early exit on the measured split costs at most
    ``budget`` of full depth (thresholds spaced by the trace's mean cost, from full depth down: the first that
    meets the budget keeps the most quality; where the real early exit runs deeper than the trace and none does, the
    most aggressive, its ``mean_cost`` above the budget); its validation risk is reported, not bounded."""
    scores = trace.signals[rule]
    tested, thr, risk, stops = 0, math.inf, None, None
    for thr in cost_spaced_thresholds(scores, costs, candidates).tolist():
        risk, stops = measured(rule, thr)
        tested += 1
        if float(costs[stops - 1].mean()) <= budget:
            break
    return Calibration(rule=rule, param=thr, threshold=thr, target={"kind": "budget", "budget": float(budget)},
                       calibration={"risk": float(risk.double().mean()), "thresholds_tested": tested,
                                    "mean_steps": float(stops.float().mean()),
                                    "mean_cost": float(costs[stops - 1].mean()), "samples": int(stops.numel())})


def oracle_exits(cfg, gpt, trace: LmTrace, shape) -> Tensor:
    """Each token's MAP exit under the oracle q* (labels needed: a bound), 1-based, (W, T)."""
    return (oracle_q(cfg, gpt, trace.losses).argmax(1) + 1).view(shape)


@torch.no_grad()
def score_split(gpt, x: Tensor, y: Tensor, rule, batch: int = 32, planned: Tensor | None = None) -> dict:
    """Real early exit on windows x, y (W, T): loss, perplexity, accuracy, mean exit layer; per token (in the
    trace's order) the loss, greedy token, exit step and exit layer."""
    view = StepwiseGPT(gpt)
    layers = torch.tensor(gpt.cfg.exit_layers)
    losses, greedy, exit_steps = [], [], []
    for i in range(0, x.shape[0], batch):
        xb, yb = x[i:i + batch], y[i:i + batch]
        r = rule if planned is None else (lambda p: (lambda t, lg, h, hp: p == t))(planned[i:i + batch])
        logits, exits = score_with_exits(view, xb, r)
        lp = logits.log_softmax(-1)
        losses.append(-lp.gather(2, yb[..., None])[..., 0].flatten())
        greedy.append(lp.argmax(-1).flatten())
        exit_steps.append(exits.flatten())
    losses, greedy, exit_steps = torch.cat(losses), torch.cat(greedy), torch.cat(exit_steps)
    loss, exit_layer = float(losses.mean()), layers[exit_steps - 1].float()
    return {"loss": loss, "perplexity": math.exp(loss), "accuracy": float((greedy == y.flatten()).float().mean()),
            "mean_layers": float(exit_layer.mean()), "token_losses": losses, "greedy": greedy,
            "exit_steps": exit_steps, "exit_layers": exit_layer}


def rule_for(gpt, name: str, lam: float, policy=None):
    """The exit rule ``name`` at threshold ``lam`` for this backbone."""
    return make_rule(name, lam, policy)


def costs_of(gpt) -> Tensor:
    return exit_cost_fractions(gpt)
