"""The per-token stopping policies of the language model (Stage II), asked at every exit but the last.

Both give the stop logit of each token at exit t from what the step already has, through one interface,
``stop_logits(t, logits, h, h_prev) -> (...,)``, and say whether they read the exit's logits (``reads_logits``): a
policy that does not is asked without the readout, which then runs only for the tokens that stop.

- :class:`HiddenStatePolicy` (``hidden``) reads the hidden state alone: LayerNorm(h) -> Linear(C, H) plus a bias per
  exit -> tanh -> Linear(H, 1). About 2 C H FLOPs (4 kFLOPs at C = 128, H = 16, 1 % of a block's 393 kFLOPs) and
  five small operations, with no readout at an exit where the token goes on.
- :class:`TokenExitPolicy` (``signals``) reads six numbers: the exit's top-1 probability, its top-1 minus top-2
  margin, its entropy, the relative change of the hidden state since the exit before ||h - h_prev|| / ||h_prev||,
  their cosine and t / T, through a 6 -> H -> 1 MLP. Its FLOPs are few (about 1.3 kFLOPs) but it needs the exit's
  readout (2 C V FLOPs) and about thirty small operations at every exit asked.

The stop-time distribution q_phi follows from the logits of t = 1..T-1 as in the core
(:func:`~learn2stop.core.distributions.log_stop_time_distribution`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import POLICIES

FEATURES = ("top1", "margin", "entropy", "change", "cosine", "step")


def exit_features(t: int, logits: Tensor, h: Tensor, h_prev: Tensor, num_steps: int) -> Tensor:
    """The (..., 6) features of :data:`FEATURES` at exit t from logits (..., V) and hidden states (..., C)."""
    logp = logits.float().log_softmax(-1)
    p = logp.exp()
    top = p.topk(2, dim=-1).values
    ent = -(p * logp).sum(-1)
    h, h_prev = h.float(), h_prev.float()
    change = (h - h_prev).norm(dim=-1) / h_prev.norm(dim=-1).clamp_min(1e-6)
    cos = F.cosine_similarity(h, h_prev, dim=-1)
    step = torch.full_like(ent, t / num_steps)
    return torch.stack([top[..., 0], top[..., 0] - top[..., 1], ent, change, cos, step], -1)


def _check_sizes(least: int = 1, **sizes) -> None:
    for name, v in sizes.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise ValueError(f"policy {name} must be an integer >= {least}; got {v!r}")


class HiddenStatePolicy(nn.Module):
    """Stop logit of hidden states h (..., C) at exit t from LayerNorm(h) (no affine): with ``hidden`` H >= 1,
    tanh(Linear(C, H) + b_t) -> Linear(H, 1), the first layer shared and a bias b_t per exit; with H = 0, a linear
    map of its own per exit, w_t . LayerNorm(h) + c_t (two operations: the cheapest decision at batch 1)."""

    reads_logits = False

    def __init__(self, width: int, num_steps: int, hidden: int = 16):
        super().__init__()
        _check_sizes(width=width, num_steps=num_steps)
        _check_sizes(0, hidden=hidden)
        self.num_steps, n = num_steps, max(num_steps - 1, 1)
        if hidden:
            self.first = nn.Linear(width, hidden)
            self.exit_bias = nn.Parameter(torch.zeros(n, hidden))  # (T - 1, H), one row per exit
            self.out = nn.Linear(hidden, 1)
        else:
            self.exit_weight = nn.Parameter(torch.zeros(n, width))  # (T - 1, C)
            self.exit_bias = nn.Parameter(torch.zeros(n))  # (T - 1,)
        self.hidden = hidden

    def fit_scale(self, states: list[Tensor], logits: list[Tensor] | None) -> None:
        """Nothing to fit: the LayerNorm standardises each state."""

    def _weights(self) -> tuple[Tensor, ...]:
        """The map's tensors, each exit's bias added in once: (w (T - 1, C), c (T - 1,)) with H = 0, else
        (W1 (H, C), b1 (T - 1, H), w2 (1, H), b2 (1,))."""
        if not self.hidden:
            return self.exit_weight, self.exit_bias
        return self.first.weight, self.first.bias + self.exit_bias, self.out.weight, self.out.bias

    @staticmethod
    def _logits(t: int, h: Tensor, weights: tuple[Tensor, ...]) -> Tensor:
        x = F.layer_norm(h.float(), h.shape[-1:])  # (..., C)
        if len(weights) == 2:
            w, c = weights
            return F.linear(x, w[t - 1:t], c[t - 1:t]).squeeze(-1)
        w1, b1, w2, b2 = weights
        return F.linear(torch.tanh(F.linear(x, w1, b1[t - 1])), w2, b2).squeeze(-1)  # (..., H) -> (...,)

    def stop_logits(self, t: int, logits: Tensor | None, h: Tensor, h_prev: Tensor) -> Tensor:
        return self._logits(t, h, self._weights())

    def stop_probability_fn(self):
        """A function of (t, logits, h, h_prev) giving :meth:`stop_logits`'s sigmoid from this policy's weights as
        they are now (detached, each exit's bias added once): the rule's decision at inference, with no module
        lookups per call."""
        weights = tuple(w.detach() for w in self._weights())
        return lambda t, logits, h, h_prev: torch.sigmoid(self._logits(t, h, weights))

    def flops(self, vocab: int, width: int) -> int:
        """FLOPs per token and exit asked: the LayerNorm and the map."""
        H = self.hidden
        return 5 * width + (2 * width * H + 4 * H if H else 2 * width)


class TokenExitPolicy(nn.Module):
    """features (..., 6) -> stop logit (...,): standardised features (statistics of the training tokens, fixed
    buffers), then Linear(6, H), tanh, Linear(H, 1)."""

    reads_logits = True

    def __init__(self, num_steps: int, hidden: int = 16):
        super().__init__()
        _check_sizes(num_steps=num_steps, hidden=hidden)
        self.num_steps = num_steps
        self.net = nn.Sequential(nn.Linear(len(FEATURES), hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.register_buffer("mean", torch.zeros(len(FEATURES)))
        self.register_buffer("std", torch.ones(len(FEATURES)))

    def fit_scale(self, states: list[Tensor], logits: list[Tensor] | None) -> None:
        """Set the standardisation from the exits' training states [embedding, exit 1, ..] and logits [exit 1, ..]."""
        feats = torch.stack([exit_features(t, logits[t - 1], states[t], states[t - 1], self.num_steps)
                             for t in range(1, len(states) - 1)], -2)
        flat = feats.reshape(-1, feats.shape[-1]).float()
        self.mean.copy_(flat.mean(0))
        self.std.copy_(flat.std(0).clamp_min(1e-4))

    def forward(self, feats: Tensor) -> Tensor:
        return self.net((feats - self.mean) / self.std).squeeze(-1)

    def stop_logits(self, t: int, logits: Tensor, h: Tensor, h_prev: Tensor) -> Tensor:
        return self(exit_features(t, logits, h, h_prev, self.num_steps))

    def stop_probability_fn(self):
        """A function of (t, logits, h, h_prev) giving :meth:`stop_logits`'s sigmoid (the rule's decision)."""
        return lambda t, logits, h, h_prev: torch.sigmoid(self.stop_logits(t, logits, h, h_prev))

    def flops(self, vocab: int, width: int) -> int:
        """FLOPs per token and exit asked: the features and the MLP (see the module's text)."""
        H = self.net[0].out_features
        return 5 * vocab + 6 * width + 2 * (len(FEATURES) * H + H) + 2 * H


def make_policy(kind: str, width: int, num_steps: int, hidden: int = 16) -> nn.Module:
    """The policy of config name ``kind`` (:data:`POLICIES`) for a model of width C and T exits."""
    if kind == "hidden":
        return HiddenStatePolicy(width, num_steps, hidden)
    if kind == "signals":
        return TokenExitPolicy(num_steps, hidden)
    raise ValueError(f"model.policy must be one of {', '.join(POLICIES)}; got {kind!r}")


def policy_stop_logits(policy: nn.Module, states: list[Tensor], logits: list[Tensor] | None) -> Tensor:
    """The policy's stop logits (..., T - 1) at exits 1..T-1 from the states [embedding, exit 1, .., exit T] and,
    for a policy that reads them, the exits' logits [exit 1, ..]."""
    return torch.stack([policy.stop_logits(t, logits[t - 1] if logits is not None else None, states[t], states[t - 1])
                        for t in range(1, len(states) - 1)], -1)
