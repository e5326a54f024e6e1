"""MAML-stop's step-wise models: MAML answering with the kept answer, and the builders of MAML and MAML-stop.

:class:`AnsweringMAML` wraps the learner of :mod:`.learner` so that a stop answers with the step s <= t nearest a
label-free estimate; :func:`build` turns a config into the two :class:`~learn2stop.core.model.StoppingModel` s
(MAML and MAML-stop from one initialisation).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ...core.model import StoppingModel
from ...utils.seeding import derive_seed, drawing_from
from .learner import NETWORKS, MAMLModel
from .metric import loss_kind
from .policy import MAMLStopPolicy, squared_distance

#: state keys of :class:`AnsweringMAML`'s kept answer (beside the fast weights)
ANSWER = "answer."


class AnsweringMAML(MAMLModel):
    """MAML whose answer after t steps is the query prediction of the step s <= t nearest a label-free estimate.

    Early stopping that restores the best step, as a step-wise model: ``estimate(inputs) -> (B, Q, out)`` estimates
    the query targets from the support alone (MAML-stop's: the policy's posterior-mean estimate,
    :meth:`~learn2stop.tasks.maml.policy.MAMLStopPolicy.posterior_mean`); every step scores its query prediction by
    its mean squared distance to it (:func:`~learn2stop.tasks.maml.policy.squared_distance`, lower is better) and the
    state keeps, per task, the best prediction so far. The estimate is computed once per rollout, in
    :meth:`initial_state`, and rides in the state: rows that stop leave with their slice of it, so early exit never
    computes it again for the rows still running. A rule that stops at step t answers with it, so every rule, trace, calibration
    and frontier of the core reads the kept answer unchanged (a patience rule on it is the classical "stop when the
    best has not changed for k steps").

    Off (plain MAML outputs) until ``answering`` is set, kept in the checkpoints: Stage I trains the meta-learner on
    its own steps, before the score is trained; MAML-stop turns it on for Stage II (``model.policy_posterior``).

    Output at step t when answering: ``pred`` the kept answer, ``step_pred`` this step's own prediction,
    ``step_score`` (B,) its score, ``answer_score`` (B,) the kept answer's score, ``answer_step`` (B,) the step it came
    from, and the policy features of this step.

    ``support_loss_from_step`` (with ``model.policy_inputs: scalars``, the quick preset's): when answering, the
    ``support_loss`` the policy reads is the one step t's inner gradient was taken of (of the weights before the step,
    computed anyway), carried in the state, and the readout runs no support-set forward; otherwise it is
    the support loss of step t's weights, a support-set forward at every step the policy reads. Only ``support_loss``
    is then read out of the support set, so the policy must read scalars alone.
    """

    def __init__(self, *args, estimate: Callable[[dict], Tensor], support_loss_from_step: bool = False, **kw):
        super().__init__(*args, **kw)
        self.estimate = estimate
        self.support_loss_from_step = support_loss_from_step
        self.answering = False

    def get_extra_state(self) -> dict:
        return {"answering": self.answering}

    def set_extra_state(self, state: dict) -> None:
        self.answering = bool(state["answering"])

    def plain(self) -> MAMLModel:
        """The meta-learner's own steps (no kept answer), on the same network."""
        return MAMLModel(self.net, self.num_steps, self.inner_lr, self.first_order, self.loss,
                         updates_per_step=self.updates_per_step, task_batching=self.task_batching,
                         inner_grad_clip=self.inner_grad_clip)

    @staticmethod
    def _fast(state: dict) -> dict:
        """The fast weights of a state (without the kept answer)."""
        return {k: v for k, v in state.items() if not k.startswith(ANSWER)}

    def initial_state(self, inputs: dict) -> dict:
        state = super().initial_state(inputs)
        if self.answering:  # once per rollout; the score reads it without gradients
            state[ANSWER + "estimate"] = self.estimate(inputs).detach()
        return state

    def step(self, t: int, state: dict, inputs: dict) -> dict:
        if self.answering and self.support_loss_from_step:  # the last update's loss comes with its gradient
            fast, before = self.updates(self._fast(state), inputs, with_loss=True)
        else:
            fast, before = self.updates(self._fast(state), inputs), None
        if not self.answering:
            return fast
        _, frozen = self._split()
        qx = inputs["query_x"]
        pred, qfeat = self._forward_tasks(fast, frozen, qx, qx.new_ones(qx.shape[:2]), inputs)
        estimate = state[ANSWER + "estimate"]  # made by initial_state, once per rollout
        score = squared_distance(pred, estimate)
        kept = {"pred": pred, "score": score, "step": torch.full_like(score, t, dtype=torch.long)}
        if ANSWER + "score" in state:  # a later step replaces the kept answer only where it scores strictly better
            better = score < state[ANSWER + "score"]
            kept = {k: torch.where(better.view(-1, *[1] * (v.dim() - 1)), v, state[ANSWER + k]) for k, v in kept.items()}
        new = {**fast, **{ANSWER + k: v for k, v in kept.items()}, ANSWER + "estimate": estimate,
               ANSWER + "now": pred, ANSWER + "now_score": score, ANSWER + "feats": qfeat}
        if before is not None:
            new[ANSWER + "support_loss"] = before
        return new

    def readout(self, t: int, state: dict, inputs: dict) -> dict:
        if ANSWER + "now" not in state:
            return super().readout(t, state, inputs)
        out = {"pred": state[ANSWER + "pred"], "step_pred": state[ANSWER + "now"], "query_feats": state[ANSWER + "feats"],
               "step_score": state[ANSWER + "now_score"], "answer_score": state[ANSWER + "score"],
               "answer_step": state[ANSWER + "step"]}
        if self.policy_features and ANSWER + "support_loss" in state:  # the step's own: no support-set forward
            out["support_loss"] = state[ANSWER + "support_loss"]
        elif self.policy_features:
            with torch.no_grad():
                out.update(self._support_features(self._fast(state), self._split()[1], inputs))
        return out


# ----------------------------------------------------------------------------- builders (cfg: a MAMLConfig)
def make_network(cfg):
    if cfg.model.network == "mlp":
        return NETWORKS.get("mlp")(in_dim=1, out_dim=1, hidden=cfg.model.hidden)
    channels = 3 if cfg.data.source == "miniimagenet" else 1
    return NETWORKS.get("conv4")(in_channels=channels, image_size=cfg.data.image_size, out_dim=cfg.data.n_way,
                                 hidden=cfg.model.hidden)


def build(cfg, device, generator: torch.Generator | None = None) -> tuple[StoppingModel, StoppingModel]:
    """The two models, same initialisation: MAML (one output after T updates) and MAML-stop (T outputs + policy).

    The initial weights are drawn from ``generator`` (default: seeded from ``cfg.seed``), not the global RNG.
    """
    loss, T, m = loss_kind(cfg), cfg.model.inner_steps, cfg.model
    if generator is None:
        generator = torch.Generator().manual_seed(derive_seed(cfg.seed, "init", ""))
    with drawing_from(generator):
        net = make_network(cfg)
        net_stop = make_network(cfg)
        net_stop.load_state_dict(net.state_dict())
        policy = MAMLStopPolicy(net_stop.feat_dim, 1 if loss == "mse" else cfg.data.n_way, T, classification=loss != "mse",
                                posterior=m.policy_posterior, in_dim=1 if loss == "mse" else None,
                                answer=m.policy_posterior, inputs=m.policy_inputs)
    clip = m.inner_grad_clip
    maml = StoppingModel(MAMLModel(net, 1, m.inner_lr, m.first_order, loss, updates_per_step=T, inner_grad_clip=clip))
    kind, kw = MAMLModel, {}
    if m.policy_posterior:  # the kept answer
        kind, kw = AnsweringMAML, {"estimate": policy.posterior_mean,
                                   "support_loss_from_step": m.policy_inputs == "scalars"}
    stop = StoppingModel(kind(net_stop, T, m.inner_lr, m.first_order, loss, policy_features=True,
                              inner_grad_clip=clip, **kw), policy)
    return maml.to(device), stop.to(device)


def meta_learner(stop: StoppingModel) -> MAMLModel:
    """MAML-stop's meta-learner on its own steps: the stop model's network without a kept answer."""
    m = stop.model
    return m.plain() if isinstance(m, AnsweringMAML) else m


def step_view(maml: StoppingModel, cfg) -> MAMLModel:
    """The MAML baseline's network seen step by step (T outputs), to report its metric per step."""
    m = maml.model
    return MAMLModel(m.net, cfg.model.inner_steps, m.inner_lr, m.first_order, m.loss, inner_grad_clip=m.inner_grad_clip)
