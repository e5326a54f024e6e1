"""Functional MAML on torch.func: Conv4 / MLP learners and MAML as a step-wise model.

The learners are pure functions of a parameter dict, ``net.apply(params, x, mask) -> (out, feats)``
for ONE task, so that ``torch.func.vmap`` runs a meta-batch of tasks with per-task fast weights
and ``torch.func.grad`` gives the inner-loop gradient. Second-order MAML back-propagates through
that gradient (torch.func transforms compose with autograd); first-order MAML detaches it.

:class:`MAMLModel` is the learner seen by the core loop: step t is (a block of) inner gradient
steps on the support set, the state is the per-task fast weights ``{name: (B, *shape)}`` and the
readout is the query prediction (plus label-free features for the stopping policy).

MAML-stop's kept answer and the builders of the two models are in :mod:`.models`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import grad, grad_and_value, vmap

from ...core.trees import tree_leaves, tree_map
from ...utils.registry import Registry
from .metric import masked_mean, per_example_loss, query_loss, query_metric

NETWORKS: Registry[type] = Registry("MAML network")



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

    #: a meta-batch on CPU tensors runs task by task: there a vmapped conv over the tasks is the slower (by 11 % at
    #: 5-way 1-shot up to 43 % at 20-way 5-shot, first order)
    cpu_batching = "loop"

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
            tensors, the network's ``cpu_batching`` on CPU tensors.
        inner_grad_clip: the most an inner step may move a task's fast weights, as a norm of its
            support gradient (all adapted tensors together): a larger gradient is scaled down to this
            norm, so T steps move the weights by at most ``T * inner_lr * inner_grad_clip`` and the
            inner loop cannot diverge whatever the meta-parameters. 0 turns the bound off.

    Inputs: the meta-batch tree of ``samplers.py``. Output at step t: a dict with ``pred`` (B, Q, out),
    and with ``policy_features``: ``support_pred`` (B, S, out), ``support_loss`` (B,),
    ``support_feats`` (B, S, D), ``query_feats`` (B, Q, D).
    """

    @property
    def outputs_are_logits(self) -> bool | None:
        """False on a regression (``loss="mse"``): its predictions are not class logits (protocols.MODEL_MEMBERS);
        None on a classification, whose output is a dict the class rules check by shape."""
        return False if self.loss == "mse" else None

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
        return "vmap" if inputs["support_x"].is_cuda else self.net.cpu_batching

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

