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
      - DeepSets embeddings of the support features, of the query set and of the support set's fit. ``inputs``:
        ``"joint"`` (default): each query element's features with its prediction, and each support element's
        features with its target, prediction and residual, together (so the policy sees *where* the fit is good or
        bad); ``"separate"`` (the release's, and this library's until 2026-11-28): the query features alone and
        the residuals alone, each element without its features. The target and prediction are one-hot and softmax
        vectors (classification) or values (regression); the residual is prediction - target.
    -> Linear(3 * dim + 3, 128) -> ELU -> Linear(128, 1).

    Why joint: on the quick sinusoid preset, at 3 inner steps, the joint policy's quantile rule reaches 1.545 expected
    query MSE where the separate one reached 1.594, a fixed depth 1.687, and a stop that knows the task family (the
    least posterior expected query MSE of each step's function given the support) 1.385
    (``benchmarks/maml_sinusoid_bound.py``, docs/maml.md).

    Args:
        feat_dim: the learner's feature size D. out_dim: its output size (N classes, or 1).
        num_steps: T. classification: residual as softmax - onehot, else prediction - target.
        inputs: ``"joint"`` or ``"separate"`` (above); a checkpoint loads as the one it was trained as.
    """

    INPUTS = ("joint", "separate")

    def __init__(self, feat_dim: int, out_dim: int, num_steps: int, classification: bool = True, dim: int = 64,
                 hidden: int = 128, inputs: str = "joint"):
        super().__init__()
        if inputs not in self.INPUTS:
            raise ValueError(f"inputs must be one of {', '.join(self.INPUTS)}; got {inputs!r}")
        self.num_steps, self.out_dim, self.classification = num_steps, out_dim, classification
        self.feat_dim, self.dim = feat_dim, dim
        self.support_set = DeepSet(feat_dim, dim)
        self._build_sets(inputs)
        self.head = nn.Sequential(nn.Linear(3 * dim + 3, hidden), nn.ELU(), nn.Linear(hidden, 1))
        self.register_load_state_dict_pre_hook(self._match_checkpoint)

    def _build_sets(self, inputs: str) -> None:
        self.inputs = inputs
        joint = inputs == "joint"
        self.query_set = DeepSet(self.feat_dim + (self.out_dim if joint else 0), self.dim)
        self.residual_set = DeepSet(self.feat_dim + 3 * self.out_dim if joint else self.out_dim, self.dim)

    def forward(self, inputs: dict, output: dict, t: int) -> Tensor:
        if "support_feats" not in output:
            raise ValueError("the MAML-stop policy needs the learner's support features: build MAMLModel with policy_features=True")
        mask = inputs["support_mask"]  # (B, S)
        sp = output["support_pred"].detach()  # (B, S, out)
        if self.classification:
            pred, target = torch.softmax(sp, dim=-1), F.one_hot(inputs["support_y"], self.out_dim).to(sp)
        else:
            pred, target = sp, inputs["support_y"]
        residual = pred - target
        sf, qf = output["support_feats"].detach(), output["query_feats"].detach()
        if self.inputs == "joint":
            qp = output["pred"].detach()
            qf = torch.cat([qf, torch.softmax(qp, dim=-1) if self.classification else qp], dim=-1)
            residual = torch.cat([sf, target, pred, residual], dim=-1)
        scalars = torch.stack([
            torch.log1p(output["support_loss"].detach()),
            torch.full_like(mask[:, 0], t / self.num_steps),
            torch.log(inputs["shots"].to(mask)) / math.log(10.0),
        ], dim=1)  # (B, 3)
        h = torch.cat([self.support_set(sf, mask),
                       self.query_set(qf, qf.new_ones(qf.shape[:2])),
                       self.residual_set(residual, mask), scalars], dim=1)
        return self.head(h).squeeze(1)

    def _match_checkpoint(self, module, state_dict, prefix, *args) -> None:
        """Before the children load: rebuild the sets for the inputs a checkpoint was trained on, told by the shape of
        its support-fit set (a checkpoint of the separate policy reads out_dim values per element)."""
        w = state_dict.get(prefix + "residual_set.phi.weight")
        if w is None:
            return
        inputs = "separate" if w.shape[1] == self.out_dim else "joint"
        if inputs != self.inputs:
            like = self.head[0].weight  # the rebuilt sets take the module's device and dtype
            self._build_sets(inputs)
            self.to(like)
