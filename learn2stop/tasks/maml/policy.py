"""The MAML-stop policy: per task and step, a stop logit from features that need no query labels."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class DeepSet(nn.Module):
    """Permutation-invariant set embedding rho(mean_i softplus(phi(x_i))) over the unmasked elements."""

    def __init__(self, in_dim: int, dim: int = 64):
        super().__init__()
        self.phi = nn.Linear(in_dim, dim)
        self.rho = nn.Linear(dim, dim)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        """x (B, S, in_dim), mask (B, S) -> (B, dim)."""
        h = F.softplus(self.phi(x)) * mask[..., None]
        return self.rho(h.sum(dim=1) / mask.sum(dim=1, keepdim=True).clamp_min(1))


class MAMLStopPolicy(nn.Module):
    """Stop logit of task b at step t (paper App. B.2, release's design plus the shot count).

    Reads, all detached (the policy does not steer theta):
      - log(1 + support loss) after t steps and t / T;
      - log K, the task's shot count (known at test time; the imbalance the policy should react to);
      - DeepSets embeddings of the support features, of the query features, and of the support
        residuals softmax(logits) - onehot(y) (classification) or prediction - y (regression).
    -> Linear(3 * dim + 3, 128) -> ELU -> Linear(128, 1).

    Args:
        feat_dim: the learner's feature size D. out_dim: its output size (N classes, or 1).
        num_steps: T. classification: residual as softmax - onehot, else prediction - target.
    """

    def __init__(self, feat_dim: int, out_dim: int, num_steps: int, classification: bool = True, dim: int = 64,
                 hidden: int = 128):
        super().__init__()
        self.num_steps, self.out_dim, self.classification = num_steps, out_dim, classification
        self.support_set = DeepSet(feat_dim, dim)
        self.query_set = DeepSet(feat_dim, dim)
        self.residual_set = DeepSet(out_dim, dim)
        self.head = nn.Sequential(nn.Linear(3 * dim + 3, hidden), nn.ELU(), nn.Linear(hidden, 1))

    def forward(self, inputs: dict, output: dict, t: int) -> Tensor:
        if "support_feats" not in output:
            raise ValueError("the MAML-stop policy needs the learner's support features: build MAMLModel with policy_features=True")
        mask = inputs["support_mask"]  # (B, S)
        sp = output["support_pred"].detach()  # (B, S, out)
        if self.classification:
            residual = torch.softmax(sp, dim=-1) - F.one_hot(inputs["support_y"], self.out_dim).to(sp)
        else:
            residual = sp - inputs["support_y"]
        qf = output["query_feats"].detach()
        scalars = torch.stack([
            torch.log1p(output["support_loss"].detach()),
            torch.full_like(mask[:, 0], t / self.num_steps),
            torch.log(inputs["shots"].to(mask)) / math.log(10.0),
        ], dim=1)  # (B, 3)
        h = torch.cat([self.support_set(output["support_feats"].detach(), mask),
                       self.query_set(qf, qf.new_ones(qf.shape[:2])),
                       self.residual_set(residual, mask), scalars], dim=1)
        return self.head(h).squeeze(1)
