"""The MAML-stop policy: per task and step, a stop logit from features that need no query labels."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def squared_distance(pred: Tensor, estimate: Tensor) -> Tensor:
    """(B,) the mean squared distance of query predictions (B, Q, out) to an estimate of their targets, without
    gradients: the score of MAML's kept answer and what the stop logit reads."""
    return (pred.detach() - estimate.detach()).pow(2).flatten(1).mean(dim=1)


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


class PosteriorPredictive(nn.Module):
    """The mean of a task's query targets given its support: an attentive neural process on the raw inputs.

    Each support pair (x, y) is encoded; a query x reads the mean of the encodings and an attention over them (keys
    from the support x), with the log of the shot count, and a decoder gives its predicted target. Trained by
    regression on the query targets (:meth:`MAMLStopPolicy.auxiliary_loss`), it estimates E[y | x, support] under
    the task family: the Bayes stop is the step whose function is closest to it (the posterior variance is the same
    for every step), so the policy reads each step's squared distance to it.
    """

    def __init__(self, in_dim: int, out_dim: int, dim: int = 128, key_dim: int = 64):
        super().__init__()
        self.encode = nn.Sequential(nn.Linear(in_dim + out_dim, dim), nn.ReLU(), nn.Linear(dim, dim), nn.ReLU(),
                                    nn.Linear(dim, dim))
        self.key = nn.Sequential(nn.Linear(in_dim, key_dim), nn.ReLU(), nn.Linear(key_dim, key_dim))
        self.query = nn.Sequential(nn.Linear(in_dim, key_dim), nn.ReLU(), nn.Linear(key_dim, key_dim))
        self.decode = nn.Sequential(nn.Linear(key_dim + 2 * dim + 1, dim), nn.ReLU(), nn.Linear(dim, dim), nn.ReLU(),
                                    nn.Linear(dim, out_dim))
        self.scale = key_dim ** -0.5

    def forward(self, support_x: Tensor, support_y: Tensor, mask: Tensor, query_x: Tensor) -> Tensor:
        """support_x (B, S, *x), support_y (B, S, out), mask (B, S), query_x (B, Q, *x) -> (B, Q, out)."""
        sx, qx = support_x.flatten(2), query_x.flatten(2)
        h = self.encode(torch.cat([sx, support_y], dim=-1))  # (B, S, dim)
        m = mask[..., None]
        shots = m.sum(dim=1).clamp_min(1)  # (B, 1)
        mean = (h * m).sum(dim=1) / shots  # (B, dim)
        q = self.query(qx)  # (B, Q, key_dim)
        att = (q @ self.key(sx).transpose(1, 2)) * self.scale  # (B, Q, S)
        att = att.masked_fill(mask[:, None, :] == 0, float("-inf")).softmax(dim=-1)
        Q = qx.shape[1]
        z = torch.cat([q, mean[:, None].expand(-1, Q, -1), att @ h, torch.log(shots)[:, None].expand(-1, Q, -1)], dim=-1)
        return self.decode(z)


class MAMLStopPolicy(nn.Module):
    """Stop logit of task b at step t (paper App. B.2, release's design plus the shot count).

    Reads, all detached (the policy does not steer theta):
      - log(1 + support loss) after t steps and t / T;
      - log K, the task's shot count (known at test time; the imbalance the policy should react to);
      - DeepSets embeddings of the support features, of the query set and of the support set's fit. ``inputs``:
        ``"joint"`` (default): each query element's features with its prediction, and each support element's
        features with its target, prediction and residual, together (so the policy sees *where* the fit is good or
        bad). The target and prediction are one-hot and softmax vectors (classification) or values (regression);
        the residual is prediction - target.
      - with ``posterior`` (regression): log of the mean squared distance of the step's query predictions to a
        learned estimate of the query targets' mean given the support (:class:`PosteriorPredictive`), computed once
        per rollout from the inputs alone (again only when the batch itself changes) and trained by its own
        regression loss (:meth:`auxiliary_loss`, in MAML-stop's ``posterior`` stage); the stop decision does not
        train it.
      - with ``answer`` (a kept answer, :class:`~learn2stop.tasks.maml.models.AnsweringMAML`): the log distance of the
        kept answer to the estimate and how many steps ago (/ T) it was made.
    -> Linear(3 * dim + 3 (+1) (+2), 128) -> ELU -> Linear(128, 1). ``inputs="scalars"``: the scalars alone, no set
    embedding -> Linear(3 (+1) (+2), 128) -> ELU -> Linear(128, 1).

    Why joint: each set element is read with its features, so the embedding sees how well the step fits each
    support point and where each query point lies (``benchmarks/maml_sinusoid_bound.py`` compares the policy with a
    stop that knows the task family).

    Why scalars (the quick preset's, with the kept answer): once the policy reads the distances to the posterior-mean
    estimate, the set embeddings add little and cost most of the call.

    Args:
        feat_dim: the learner's feature size D. out_dim: its output size (N classes, or 1).
        num_steps: T. classification: residual as softmax - onehot, else prediction - target.
        inputs: ``"joint"`` or ``"scalars"`` (above).
        posterior: read the distance to the posterior-mean estimate (regression only; ``in_dim``: the size of an
            input x). Off by default (``model.policy_posterior``).
        answer: also read the kept answer (needs ``posterior``; on with ``model.policy_posterior``).
    """

    INPUTS = ("joint", "scalars")

    def __init__(self, feat_dim: int, out_dim: int, num_steps: int, classification: bool = True, dim: int = 64,
                 hidden: int = 128, inputs: str = "joint", posterior: bool = False, in_dim: int | None = None,
                 answer: bool = False):
        super().__init__()
        if inputs not in self.INPUTS:
            raise ValueError(f"inputs must be one of {', '.join(self.INPUTS)}; got {inputs!r}")
        if posterior and (classification or not in_dim):
            raise ValueError("posterior: the distance to a posterior-mean estimate is for regression tasks and needs "
                             f"in_dim, the size of an input x; got classification={classification}, in_dim={in_dim!r}")
        self.num_steps, self.out_dim, self.classification = num_steps, out_dim, classification
        self.feat_dim, self.dim = feat_dim, dim
        if answer and not posterior:
            raise ValueError("answer: a kept answer is chosen by the posterior-mean estimate; set posterior=True")
        # the estimate first: its initial weights then do not depend on which of the policy's own modules ``inputs``
        # builds, so runs that differ in ``inputs`` start from the same estimate (and keep the same answers)
        self.posterior = PosteriorPredictive(in_dim, out_dim) if posterior else None
        self._build_sets(inputs)
        self.answer = answer
        #: whether :meth:`auxiliary_loss` trains the estimate (MAML-stop turns it off in Stage II once the estimate
        #: has had its own stage: on the quick preset Stage II's learning rate and batches undid part of it, its loss
        #: going from 0.47 back up to 1.23, then 0.52-0.93)
        self.fit_estimate = True
        self.hidden = hidden
        self.head = self._head()
        self._cached = None  # (support_x, query_x, support_y, weight versions, with gradients, mean): one rollout's

    def posterior_mean(self, inputs: dict) -> Tensor:
        """(B, Q, out) the estimate of the query targets' mean given the support, computed once per batch of inputs:
        a rollout asks at every step with the same input tensors (the loop hands on new ones only when rows
        stop), so it is kept until the inputs or a weight change, or until it is wanted with gradients and was
        computed without."""
        key = (inputs["support_x"], inputs["query_x"], inputs["support_y"],
               tuple(p._version for p in self.posterior.parameters()))
        grad, c = torch.is_grad_enabled(), self._cached
        if (c is None or any(a is not b for a, b in zip(c[:3], key[:3])) or c[3] != key[3]
                or (grad and not c[4])):
            mean = self.posterior(inputs["support_x"], inputs["support_y"], inputs["support_mask"], inputs["query_x"])
            self._cached = c = (*key, grad, mean)
        return c[5] if grad else c[5].detach()

    def prediction_distance(self, inputs: dict, pred: Tensor) -> Tensor:
        """(B,) the mean squared distance of query predictions (B, Q, out) to the posterior-mean estimate, without
        gradients: what the stop logit reads, the Bayes stop minimises over the steps, and MAML's kept answer
        (:class:`~learn2stop.tasks.maml.models.AnsweringMAML`) is chosen by."""
        return squared_distance(pred, self.posterior_mean(inputs))

    def posterior_distance(self, inputs: dict, output: dict) -> Tensor:
        """(B,) :meth:`prediction_distance` of a step's own query predictions: the model's ``step_score`` where it
        answers with a kept answer (it scored the step already, from the estimate in its state), else computed."""
        if "step_score" in output:
            return output["step_score"]
        return self.prediction_distance(inputs, output["pred"])

    def auxiliary_loss(self, inputs: dict, target: Tensor) -> Tensor | None:
        """The posterior-mean estimate's squared error on the query targets (None without one, or once
        ``fit_estimate`` is off): the ``auxiliary`` objective's loss, and a second term of Stage II / III while
        ``fit_estimate`` is on. It trains only :class:`PosteriorPredictive`; the stop logits read it detached."""
        if self.posterior is None or not self.fit_estimate:
            return None
        return F.mse_loss(self.posterior_mean(inputs), target)

    def _build_sets(self, inputs: str) -> None:
        self.inputs = inputs
        if inputs == "scalars":
            self.support_set = self.query_set = self.residual_set = None
            return
        self.support_set = DeepSet(self.feat_dim, self.dim)
        self.query_set = DeepSet(self.feat_dim + self.out_dim, self.dim)
        self.residual_set = DeepSet(self.feat_dim + 3 * self.out_dim, self.dim)

    def _head(self) -> nn.Module:
        """The MLP on the set embeddings (none with ``inputs="scalars"``) and the 3 (+1 posterior) (+2 answer) scalars."""
        n = (0 if self.inputs == "scalars" else 3 * self.dim) + 3 + int(self.posterior is not None) + 2 * int(self.answer)
        return nn.Sequential(nn.Linear(n, self.hidden), nn.ELU(), nn.Linear(self.hidden, 1))

    def forward(self, inputs: dict, output: dict, t: int | Tensor) -> Tensor:
        """(B,) stop logits at step ``t``: one step for the batch, or a (B,) tensor of each row's step (rows at different
        steps in one call, as a refilled batch holds them)."""
        if ("support_loss" if self.inputs == "scalars" else "support_feats") not in output:
            raise ValueError("the MAML-stop policy needs the learner's support features: build MAMLModel with policy_features=True")
        mask = inputs["support_mask"]  # (B, S)
        columns = [torch.log1p(output["support_loss"].detach()),
                   t.to(mask) / self.num_steps if isinstance(t, Tensor) else torch.full_like(mask[:, 0], t / self.num_steps),
                   torch.log(inputs["shots"].to(mask)) / math.log(10.0)]
        if self.posterior is not None:  # how far this step's function is from the estimated posterior mean
            now = self.posterior_distance(inputs, output)
            columns.append(torch.log(now + 1e-3))
        if self.answer:  # the kept answer: how far it is, and how many steps ago it was made (none kept: this step)
            kept = output.get("answer_score")
            columns.append(torch.log((now if kept is None else kept.to(now)) + 1e-3))
            columns.append(torch.zeros_like(now) if kept is None else
                           (t - output["answer_step"]).to(now) / self.num_steps)
        scalars = torch.stack(columns, dim=1)  # (B, 3 + posterior + 2 answer)
        if self.inputs == "scalars":
            return self.head(scalars).squeeze(1)
        return self.head(torch.cat([*self._embed_sets(inputs, output), scalars], dim=1)).squeeze(1)

    def _embed_sets(self, inputs: dict, output: dict) -> tuple[Tensor, Tensor, Tensor]:
        """The (B, dim) DeepSets embeddings of the support features, the query set and the support set's fit."""
        mask = inputs["support_mask"]
        sp = output["support_pred"].detach()  # (B, S, out)
        if self.classification:
            pred, target = torch.softmax(sp, dim=-1), F.one_hot(inputs["support_y"], self.out_dim).to(sp)
        else:
            pred, target = sp, inputs["support_y"]
        residual = pred - target
        sf, qf = output["support_feats"].detach(), output["query_feats"].detach()
        qp = output.get("step_pred", output["pred"]).detach()
        qf = torch.cat([qf, torch.softmax(qp, dim=-1) if self.classification else qp], dim=-1)
        residual = torch.cat([sf, target, pred, residual], dim=-1)
        return (self.support_set(sf, mask), self.query_set(qf, qf.new_ones(qf.shape[:2])),
                self.residual_set(residual, mask))
