"""Functional MAML on torch.func: Conv4 / MLP learners and MAML as a step-wise model.

The learners are pure functions of a parameter dict, ``net.apply(params, x, mask) -> (out, feats)``
for ONE task, so that ``torch.func.vmap`` runs a meta-batch of tasks with per-task fast weights
and ``torch.func.grad`` gives the inner-loop gradient. Second-order MAML back-propagates through
that gradient (torch.func transforms compose with autograd); first-order MAML detaches it.

:class:`MAMLModel` is the learner seen by the core loop: step t is (a block of) inner gradient
steps on the support set, the state is the per-task fast weights ``{name: (B, *shape)}`` and the
readout is the query prediction (plus label-free features for the stopping policy).

:class:`ModelConfig` and the builders at the end (:func:`build`: MAML and MAML-stop from one
initialisation) turn a config into the two :class:`~learn2stop.core.model.StoppingModel` s.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import grad, grad_and_value, vmap

from ...core.model import StoppingModel
from ...core.trees import tree_leaves, tree_map
from ...utils.config import ints_at_least, non_negative, one_of, positive, require
from ...utils.registry import Registry
from ...utils.seeding import derive_seed, drawing_from
from .losses import masked_mean, per_example_loss, query_loss, query_metric
from .policy import MAMLStopPolicy, squared_distance

NETWORKS: Registry[type] = Registry("MAML network")
#: default bound on a task's inner gradient norm (ModelConfig.inner_grad_clip)
INNER_GRAD_CLIP = 10.0


def masked_batch_norm(x: Tensor, mask: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> Tensor:
    """BatchNorm with batch statistics over the examples where ``mask`` is 1 (padding ignored).

    Args: x (n, C, H, W); mask (n,) of 0/1; weight, bias (C,).
    Statistics come from two weighted reductions (E[x], E[x^2]) and the output from one
    multiply-add, so few full-size temporaries enter the (second-order) graph: on CPU this
    masked form is as fast as ``F.batch_norm``.
    """
    count = mask.sum().clamp_min(1) * (x.shape[2] * x.shape[3])
    mean = torch.einsum("n,nchw->c", mask, x) / count  # (C,)
    var = (torch.einsum("n,nchw->c", mask, x * x) / count - mean * mean).clamp_min(0)  # (C,)
    scale = weight * torch.rsqrt(var + eps)
    shift = bias - mean * scale
    return torch.addcmul(shift[None, :, None, None], x, scale[None, :, None, None])


@NETWORKS.register("conv4")
class Conv4(nn.Module):
    """4 x [3x3 conv (``hidden`` filters), BatchNorm on batch statistics, ReLU, 2x2 max-pool] + linear head.

    The paper's Omniglot/MiniImagenet learner (Finn et al., 2017). Inner loop adapts the conv and
    linear weights and biases; the BatchNorm affine parameters are meta-learned only.
    """

    def __init__(self, in_channels: int = 1, image_size: int = 28, out_dim: int = 5, hidden: int = 64):
        super().__init__()
        self.params = nn.ParameterDict()
        cin = in_channels
        for i in range(4):
            w = torch.empty(hidden, cin, 3, 3)
            nn.init.kaiming_normal_(w, nonlinearity="relu")
            self.params[f"conv{i}_weight"] = nn.Parameter(w)
            self.params[f"conv{i}_bias"] = nn.Parameter(torch.zeros(hidden))
            self.params[f"bn{i}_weight"] = nn.Parameter(torch.ones(hidden))
            self.params[f"bn{i}_bias"] = nn.Parameter(torch.zeros(hidden))
            cin = hidden
        side = image_size
        for _ in range(4):
            side //= 2
        if side < 1:
            raise ValueError(f"image_size {image_size} is too small for four 2x2 poolings")
        self.feat_dim = hidden * side * side
        head = torch.empty(out_dim, self.feat_dim)
        nn.init.xavier_uniform_(head)
        self.params["head_weight"] = nn.Parameter(head)
        self.params["head_bias"] = nn.Parameter(torch.zeros(out_dim))
        self.adapted = [k for k in self.params if not k.startswith("bn")]

    @staticmethod
    def apply(p: dict[str, Tensor], x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """One task: x (n, C, H, W), mask (n,) -> outputs (n, out_dim), features (n, feat_dim)."""
        h = x
        for i in range(4):
            h = F.conv2d(h, p[f"conv{i}_weight"], p[f"conv{i}_bias"], padding=1)
            h = masked_batch_norm(h, mask, p[f"bn{i}_weight"], p[f"bn{i}_bias"])
            h = F.max_pool2d(F.relu(h), 2)
        feats = h.flatten(1)
        return F.linear(feats, p["head_weight"], p["head_bias"]), feats


@NETWORKS.register("mlp")
class MLP(nn.Module):
    """in_dim -> hidden -> hidden -> out_dim with ReLU (the sinusoid learner of Finn et al., 2017)."""

    cpu_batching = "vmap"  # tiny per-task work: one vmapped call is ~8x faster than a loop

    def __init__(self, in_dim: int = 1, out_dim: int = 1, hidden: int = 40):
        super().__init__()
        self.params = nn.ParameterDict()
        dims = [in_dim, hidden, hidden, out_dim]
        for i in range(3):
            layer = nn.Linear(dims[i], dims[i + 1])
            self.params[f"fc{i}_weight"] = nn.Parameter(layer.weight.detach().clone())
            self.params[f"fc{i}_bias"] = nn.Parameter(layer.bias.detach().clone())
        self.feat_dim = hidden
        self.adapted = list(self.params)

    @staticmethod
    def apply(p: dict[str, Tensor], x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        h = F.relu(F.linear(x, p["fc0_weight"], p["fc0_bias"]))
        h = F.relu(F.linear(h, p["fc1_weight"], p["fc1_bias"]))
        return F.linear(h, p["fc2_weight"], p["fc2_bias"]), h


def _stack(outs: list):
    first = outs[0]
    if isinstance(first, Tensor):
        return torch.stack(outs)
    if isinstance(first, dict):
        return {k: _stack([o[k] for o in outs]) for k in first}
    return type(first)(_stack([o[i] for o in outs]) for i in range(len(first)))


def map_tasks(fn, in_dims: tuple, *args, mode: str = "vmap"):
    """``fn`` applied to each task (dim 0 of the args whose in_dim is 0), results stacked on dim 0.

    ``mode="vmap"`` uses ``torch.func.vmap`` (one batched call: best on GPUs); ``"loop"`` runs a
    Python loop over tasks, which is about 2x faster on CPU for Conv4, whose per-task conv weights
    vmap turns into grouped convolutions. Both give the same numbers.
    """
    if mode == "vmap":
        return vmap(fn, in_dims=in_dims)(*args)
    B = next(tree_leaves(a)[0].shape[0] for a, d in zip(args, in_dims) if d == 0)
    outs = [fn(*[tree_map(lambda x: x[b], a) if d == 0 else a for a, d in zip(args, in_dims)]) for b in range(B)]
    return _stack(outs)


def clip_task_gradients(grads: dict[str, Tensor], max_norm: float) -> dict[str, Tensor]:
    """Scale each task's gradient down to norm ``max_norm`` where it is larger (per task, over all tensors).

    Args: grads {name: (B, *shape)}, one row per task. Differentiable (second-order MAML sees the
    scaling); a zero gradient stays zero with a finite derivative.
    """
    sq = sum(g.flatten(1).pow(2).sum(dim=1) for g in grads.values())  # (B,)
    norm = sq.clamp_min(1e-30).sqrt()  # clamp: a finite derivative at a zero gradient
    scale = torch.where(norm > max_norm, max_norm / norm, torch.ones_like(norm))  # (B,)
    return {k: g * scale.view(-1, *[1] * (g.dim() - 1)) for k, g in grads.items()}


class MAMLModel(nn.Module):
    """MAML as a step-wise model: output t is the query prediction after ``t * updates_per_step`` updates.

    Args:
        net: a functional learner (:class:`Conv4`, :class:`MLP`) holding the meta-parameters theta.
        num_steps: T, the number of outputs the policy chooses among (paper: 10 inner steps).
        inner_lr: inner-loop learning rate alpha.
        first_order: detach the inner gradient (FOMAML); otherwise second order.
        loss: ``"cross_entropy"`` or ``"mse"``.
        updates_per_step: inner updates per output. Plain MAML with T updates is the same network
            with ``num_steps=1, updates_per_step=T`` (one output after all updates).
        policy_features: also compute the support-set features the stopping policy reads.
        task_batching: ``"vmap"``, ``"loop"`` (see :func:`map_tasks`) or ``"auto"``: vmap on GPU
            tensors, the network's ``cpu_batching`` on CPU tensors (Conv4: loop, MLP: vmap).
        inner_grad_clip: the most an inner step may move a task's fast weights, as a norm of its
            support gradient (all adapted tensors together): a larger gradient is scaled down to this
            norm, so T steps move the weights by at most ``T * inner_lr * inner_grad_clip`` and the
            inner loop cannot diverge whatever the meta-parameters. 0 turns the bound off.

    Inputs: the meta-batch tree of ``samplers.py``. Output at step t: a dict with ``pred`` (B, Q, out),
    and with ``policy_features``: ``support_pred`` (B, S, out), ``support_loss`` (B,),
    ``support_feats`` (B, S, D), ``query_feats`` (B, Q, D).
    """

    def __init__(self, net: nn.Module, num_steps: int, inner_lr: float, first_order: bool = False,
                 loss: str = "cross_entropy", updates_per_step: int = 1, policy_features: bool = False,
                 task_batching: str = "auto", inner_grad_clip: float = 0.0):
        super().__init__()
        if not (math.isfinite(inner_grad_clip) and inner_grad_clip >= 0):
            raise ValueError(f"inner_grad_clip must be a finite number >= 0 (0: no bound); got {inner_grad_clip!r}")
        self.inner_grad_clip = inner_grad_clip
        if loss not in ("cross_entropy", "mse"):
            raise ValueError(f"loss must be 'cross_entropy' or 'mse'; got {loss!r}")
        if task_batching not in ("auto", "vmap", "loop"):
            raise ValueError(f"task_batching must be 'auto', 'vmap' or 'loop'; got {task_batching!r}")
        self.task_batching = task_batching
        self.net = net
        self.num_steps = num_steps
        self.inner_lr = inner_lr
        self.first_order = first_order
        self.loss = loss
        self.updates_per_step = updates_per_step
        self.policy_features = policy_features

    # ------------------------------------------------------------------ pure per-task functions
    def _support_loss(self, fast: dict, frozen: dict, x: Tensor, y: Tensor, mask: Tensor) -> Tensor:
        out, _ = self.net.apply({**fast, **frozen}, x, mask)
        return masked_mean(per_example_loss(out, y, self.loss), mask)

    def _split(self) -> tuple[list[str], dict]:
        adapted = self.net.adapted
        frozen = {k: v for k, v in self.net.params.items() if k not in adapted}
        return adapted, frozen

    def inner_update(self, fast: dict, inputs: dict, with_loss: bool = False) -> dict | tuple[dict, Tensor]:
        """One SGD step on each task's support loss: theta'_b = theta_b - alpha * grad L_support,b. ``with_loss``: also
        the (B,) support loss L_support,b(theta_b) the gradient was taken of (detached), which the step computes anyway."""
        _, frozen = self._split()
        out = map_tasks((grad_and_value if with_loss else grad)(self._support_loss), (0, None, 0, 0, 0), fast, frozen,
                        inputs["support_x"], inputs["support_y"], inputs["support_mask"], mode=self._mode(inputs))
        g, loss = out if with_loss else (out, None)
        if self.first_order:
            g = {k: v.detach() for k, v in g.items()}
        if self.inner_grad_clip > 0:
            g = clip_task_gradients(g, self.inner_grad_clip)
        new = {k: fast[k] - self.inner_lr * g[k] for k in fast}
        return (new, loss.detach()) if with_loss else new

    def _mode(self, inputs: dict) -> str:
        if self.task_batching != "auto":
            return self.task_batching
        return "vmap" if inputs["support_x"].is_cuda else getattr(self.net, "cpu_batching", "vmap")

    # ------------------------------------------------------------------ step-wise protocol
    def initial_state(self, inputs: dict) -> dict:
        B = inputs["support_x"].shape[0]
        adapted, _ = self._split()
        return {k: self.net.params[k].unsqueeze(0).expand(B, *self.net.params[k].shape) for k in adapted}

    def step(self, t: int, state: dict, inputs: dict) -> dict:
        return self.updates(state, inputs)

    def updates(self, fast: dict, inputs: dict, with_loss: bool = False) -> dict | tuple[dict, Tensor]:
        """The ``updates_per_step`` inner updates of one step (``with_loss``: and the last one's support loss, as
        :meth:`inner_update` gives it)."""
        for _ in range(self.updates_per_step - 1):
            fast = self.inner_update(fast, inputs)
        return self.inner_update(fast, inputs, with_loss=True) if with_loss else self.inner_update(fast, inputs)

    def readout(self, t: int, state: dict, inputs: dict) -> dict:
        _, frozen = self._split()
        qx = inputs["query_x"]
        ones = qx.new_ones(qx.shape[:2])  # (B, Q): the query set is never padded
        pred, qfeat = self._forward_tasks(state, frozen, qx, ones, inputs)
        out = {"pred": pred, "query_feats": qfeat}
        if self.policy_features:
            with torch.no_grad():  # the policy reads these detached: keep them out of the graph (memory)
                out.update(self._support_features(state, frozen, inputs))
        return out

    def _forward_tasks(self, state: dict, frozen: dict, x: Tensor, mask: Tensor, inputs: dict) -> tuple[Tensor, Tensor]:
        """The learner on every task with its fast weights: (B, n, out), (B, n, D)."""
        return map_tasks(lambda fast, fr, xb, mb: self.net.apply({**fast, **fr}, xb, mb), (0, None, 0, 0),
                         state, frozen, x, mask, mode=self._mode(inputs))

    def _support_features(self, state: dict, frozen: dict, inputs: dict) -> dict:
        sm = inputs["support_mask"]
        sp, sfeat = self._forward_tasks(state, frozen, inputs["support_x"], sm, inputs)
        per = per_example_loss(sp.flatten(0, 1), inputs["support_y"].flatten(0, 1), self.loss).view(sm.shape)  # (B, S)
        return {"support_pred": sp, "support_loss": masked_mean(per, sm), "support_feats": sfeat}

    def task_loss(self, output: dict, target: Tensor) -> Tensor:
        """Mean query loss per task, shape (B,): the l(y, x_t) of the oracle."""
        return query_loss(output, target, self.loss)

    def task_metric(self, output: dict, target: Tensor) -> Tensor:
        """Per task: query accuracy (classification) or query MSE (regression); shape (B,)."""
        return query_metric(output, target, self.loss)


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


@dataclass
class ModelConfig:
    """The learner and its inner loop."""

    network: str = "conv4"
    """The learner's architecture (conv4 for images, an MLP for sinusoid)."""
    hidden: int = 64
    """Channels (conv4) or hidden width (MLP) of the learner."""
    inner_steps: int = 10
    """T: inner gradient steps (the policy picks among steps 1..T)."""
    inner_lr: float = 0.1
    """Step size of the inner loop."""
    first_order: bool = False
    """First-order MAML: no gradient through the inner steps' gradients."""
    inner_grad_clip: float = INNER_GRAD_CLIP
    """bound on each task's inner gradient norm (see :class:`MAMLModel`); it keeps the late inner steps from diverging
    when Stage I rarely trains them. 0 is the paper's unbounded step."""
    policy_posterior: bool = False
    """the stopping policy also reads each step's distance to a learned posterior-mean estimate of the query targets
    (:class:`~learn2stop.tasks.maml.policy.PosteriorPredictive`; regression only), trained alone in the ``posterior``
    stage and left as it is by Stage II; a stop then answers with the kept answer, the prediction of the step s <= t
    nearest that estimate (:class:`AnsweringMAML`, from Stage II on). Off by default (Omniglot, MiniImagenet); on in
    the quick (sinusoid) preset."""
    policy_inputs: str = "joint"
    """what the stopping policy reads besides its scalars (:class:`~learn2stop.tasks.maml.policy.MAMLStopPolicy`):
    ``"joint"`` (default) the DeepSets embeddings of the support and query sets, ``"scalars"`` none (the quick
    preset's: with the posterior-mean distances it loses at most 0.005 query MSE at 3-5 steps, and its call is about
    a sixth of the joint one's at 100 tasks: docs/maml.md). With ``policy_posterior`` and ``"scalars"`` the support
    loss the policy reads at step t is the one step t's inner gradient was taken of (the weights before the step),
    which costs nothing; otherwise that of step t's weights, a support-set forward at every step it reads."""

    def __post_init__(self):
        one_of(self.network, NETWORKS.names(), "network")
        one_of(self.policy_inputs, MAMLStopPolicy.INPUTS, "policy_inputs")
        require(isinstance(self.policy_posterior, bool), "policy_posterior", f"must be true or false; got {self.policy_posterior!r}")
        ints_at_least(self, "hidden", "inner_steps")
        positive(self.inner_lr, "inner_lr")
        non_negative(self.inner_grad_clip, "inner_grad_clip")


# ----------------------------------------------------------------------------- builders (cfg: a MAMLConfig)
def make_network(cfg):
    if cfg.model.network == "mlp":
        return NETWORKS.get("mlp")(in_dim=1, out_dim=1, hidden=cfg.model.hidden)
    channels = 3 if cfg.data.source == "miniimagenet" else 1
    return NETWORKS.get("conv4")(in_channels=channels, image_size=cfg.data.image_size, out_dim=cfg.data.n_way,
                                 hidden=cfg.model.hidden)


def loss_kind(cfg) -> str:
    return "mse" if cfg.data.source == "sinusoid" else "cross_entropy"


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
