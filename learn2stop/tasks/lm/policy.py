"""The per-token stopping policy of the language model (Stage II): a tiny MLP asked at every exit but the last.

It reads six numbers per token at exit t: the exit's top-1 probability, its top-1 minus top-2 margin, its entropy
(nats), the relative change of the hidden state since the exit before ||h - h_prev|| / ||h_prev||, their cosine,
and the step t / T. Its output is the stop logit at t; the stop-time distribution q_phi follows from the logits of
t = 1..T-1 as in the core (:func:`~learn2stop.core.distributions.log_stop_time_distribution`).

Cost per token and exit: the features take about 5 V + 6 C FLOPs (a softmax over V, two norms and a dot product
over C), the MLP 2 (6 H + H) + 2 H; with V = 65, C = 128, H = 16 about 1.3 kFLOPs, against a block's about
24 C^2 = 393 kFLOPs (its projections and MLP, attention aside): 0.3 %. The exit's own readout (final norm and the
shared LM head, 2 C V = 17 kFLOPs) is paid by every rule that reads the exit's logits, the policy, CALM's margin.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

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


class TokenExitPolicy(nn.Module):
    """features (..., 6) -> stop logit (...,): standardised features (statistics of the training tokens, fixed
    buffers), then Linear(6, H), tanh, Linear(H, 1)."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
            raise ValueError(f"policy hidden must be an integer >= 1; got {hidden!r}")
        self.net = nn.Sequential(nn.Linear(len(FEATURES), hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.register_buffer("mean", torch.zeros(len(FEATURES)))
        self.register_buffer("std", torch.ones(len(FEATURES)))

    @staticmethod
    def features(t: int, logits: Tensor, h: Tensor, h_prev: Tensor, num_steps: int) -> Tensor:
        return exit_features(t, logits, h, h_prev, num_steps)

    def fit_scale(self, feats: Tensor) -> None:
        """Set the standardisation from training features (N, ..., 6)."""
        flat = feats.reshape(-1, feats.shape[-1]).float()
        self.mean.copy_(flat.mean(0))
        self.std.copy_(flat.std(0).clamp_min(1e-4))

    def forward(self, feats: Tensor) -> Tensor:
        return self.net((feats - self.mean) / self.std).squeeze(-1)

    def flops(self, vocab: int, width: int) -> int:
        """FLOPs per token and exit: the features and the MLP (see the module's text)."""
        H = self.net[0].out_features
        return 5 * vocab + 6 * width + 2 * (len(FEATURES) * H + H) + 2 * H
