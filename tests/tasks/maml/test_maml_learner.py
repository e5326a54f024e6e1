"""Functional MAML (learner.py): the vmapped torch.func inner loop against hand-written references."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from learn2stop.core import StopAtTimes, run_with_early_exit, unroll
from learn2stop.tasks.maml.learner import MLP, NETWORKS, Conv4, MAMLModel, masked_batch_norm
from learn2stop.tasks.maml.samplers import SinusoidSampler


class LinearNet(nn.Module):
    """out = W x + b: small enough that the MAML gradients can be written out by hand."""

    def __init__(self, in_dim=3, out_dim=2):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.params = nn.ParameterDict({"w": nn.Parameter(torch.randn(out_dim, in_dim, generator=g, dtype=torch.float64)),
                                        "b": nn.Parameter(torch.randn(out_dim, generator=g, dtype=torch.float64))})
        self.adapted = ["w", "b"]
        self.feat_dim = in_dim

    @staticmethod
    def apply(p, x, mask):
        return x @ p["w"].T + p["b"], x


def regression_batch(B=3, S=5, Q=4, in_dim=3, out_dim=2, shots=(5, 2, 3)):
    g = torch.Generator().manual_seed(1)
    mask = torch.zeros(B, S, dtype=torch.float64)
    for b, k in enumerate(shots):
        mask[b, :k] = 1
    inputs = {"support_x": torch.randn(B, S, in_dim, generator=g, dtype=torch.float64),
              "support_y": torch.randn(B, S, out_dim, generator=g, dtype=torch.float64),
              "support_mask": mask, "query_x": torch.randn(B, Q, in_dim, generator=g, dtype=torch.float64),
              "shots": torch.tensor(shots)}
    return inputs, torch.randn(B, Q, out_dim, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("batching", ["vmap", "loop"])
def test_first_order_meta_gradient_equals_manual_formula(batching):
    """One inner step of a linear model, first order: every gradient written out by hand."""
    net, alpha = LinearNet(), 0.1
    model = MAMLModel(net, num_steps=1, inner_lr=alpha, first_order=True, loss="mse", task_batching=batching)
    inputs, target = regression_batch()
    loss = model.task_loss(unroll(model, inputs).outputs, target).mean()
    loss.backward()
    W, b = net.params["w"].detach(), net.params["b"].detach()
    gW, gb = torch.zeros_like(W), torch.zeros_like(b)
    B = target.shape[0]
    for i in range(B):
        k = int(inputs["shots"][i])
        X, Y = inputs["support_x"][i, :k], inputs["support_y"][i, :k]  # padding excluded by hand
        r = X @ W.T + b - Y  # (k, out)
        W1 = W - alpha * 2 / k * r.T @ X  # d/dW mean_i ||W x_i + b - y_i||^2
        b1 = b - alpha * 2 / k * r.sum(0)
        Xq, Yq = inputs["query_x"][i], target[i]
        rq = Xq @ W1.T + b1 - Yq
        gW += 2 / Xq.shape[0] * rq.T @ Xq / B  # first order: d L_query / d theta' used as d / d theta
        gb += 2 / Xq.shape[0] * rq.sum(0) / B
    torch.testing.assert_close(net.params["w"].grad, gW, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(net.params["b"].grad, gb, rtol=1e-10, atol=1e-12)


def _reference_conv4(p, x):
    """Conv4 with torch's own BatchNorm in training mode (batch statistics), no padding involved."""
    h = x
    for i in range(4):
        h = F.conv2d(h, p[f"conv{i}_weight"], p[f"conv{i}_bias"], padding=1)
        h = F.batch_norm(h, None, None, p[f"bn{i}_weight"], p[f"bn{i}_bias"], training=True, eps=1e-5)
        h = F.max_pool2d(F.relu(h), 2)
    return F.linear(h.flatten(1), p["head_weight"], p["head_bias"])


@pytest.mark.parametrize("first_order, batching", [(False, "vmap"), (True, "vmap"), (False, "loop")])
def test_conv4_meta_gradient_matches_per_task_autograd_reference(first_order, batching):
    """Vmapped torch.func MAML with padded supports == a per-task loop with torch.autograd (2 steps)."""
    torch.manual_seed(0)
    net = Conv4(in_channels=1, image_size=16, out_dim=3, hidden=4).double()
    alpha, steps = 0.3, 2
    model = MAMLModel(net, num_steps=steps, inner_lr=alpha, first_order=first_order, task_batching=batching)
    g = torch.Generator().manual_seed(2)
    shots = [2, 1]
    S = 3 * 2
    sx = torch.rand(2, S, 1, 16, 16, generator=g, dtype=torch.float64)
    sy = torch.arange(3).repeat_interleave(2).repeat(2, 1)
    mask = torch.zeros(2, S, dtype=torch.float64)
    for b, k in enumerate(shots):  # task 1 is 1-shot: its support sits first, padding after
        sy[b, : 3 * k] = torch.arange(3).repeat_interleave(k)
        mask[b, : 3 * k] = 1
    inputs = {"support_x": sx, "support_y": sy, "support_mask": mask,
              "query_x": torch.rand(2, 3, 1, 16, 16, generator=g, dtype=torch.float64), "shots": torch.tensor(shots)}
    target = torch.tensor([[0, 1, 2], [2, 0, 1]])
    r = unroll(model, inputs, target=target, loss_fn=model.task_loss)
    r.losses[:, -1].mean().backward()
    got = {k: v.grad.clone() for k, v in net.params.items()}

    ref = {k: v.detach().clone().requires_grad_(True) for k, v in net.params.items()}
    total = 0
    for b, k in enumerate(shots):
        n = 3 * k
        fast = dict(ref)
        for _ in range(steps):
            loss = F.cross_entropy(_reference_conv4(fast, sx[b, :n]), sy[b, :n])
            names = net.adapted
            grads = torch.autograd.grad(loss, [fast[m] for m in names], create_graph=not first_order)
            fast = {**fast, **{m: fast[m] - alpha * (gr.detach() if first_order else gr) for m, gr in zip(names, grads)}}
        total = total + F.cross_entropy(_reference_conv4(fast, inputs["query_x"][b]), target[b]) / 2
    total.backward()
    for k in got:
        torch.testing.assert_close(got[k], ref[k].grad, rtol=1e-7, atol=1e-9, msg=f"gradient of {k}")


def test_masked_batch_norm_ignores_padding():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 4, 5, generator=g)
    w, b = torch.rand(3, generator=g), torch.randn(3, generator=g)
    mask = torch.tensor([1, 1, 0, 1, 1, 0, 0.0])
    out = masked_batch_norm(x, mask, w, b)
    ref = F.batch_norm(x[mask.bool()], None, None, w, b, training=True)
    torch.testing.assert_close(out[mask.bool()], ref, rtol=1e-5, atol=1e-5)


def test_updates_per_step_groups_inner_steps():
    """Plain MAML with T updates (one output) == the T-th output of the step-wise view."""
    torch.manual_seed(0)
    net = MLP(hidden=8)
    inputs, target = SinusoidSampler(1, 5, 6).batch(None, 4, torch.Generator().manual_seed(0))
    one = MAMLModel(net, 1, 0.05, loss="mse", updates_per_step=4)
    four = MAMLModel(net, 4, 0.05, loss="mse")
    with torch.no_grad():
        torch.testing.assert_close(unroll(one, inputs).outputs["pred"], unroll(four, inputs).outputs["pred"])


def test_stopped_tasks_get_no_further_inner_updates():
    torch.manual_seed(0)
    net = MLP(hidden=8)
    model = MAMLModel(net, 5, 0.05, loss="mse", policy_features=True)
    rows = []
    orig = model.inner_update
    model.inner_update = lambda fast, inputs: (rows.append(inputs["support_x"].shape[0]), orig(fast, inputs))[1]
    inputs, target = SinusoidSampler(1, 5, 6).batch(None, 6, torch.Generator().manual_seed(0))
    times = torch.tensor([1, 5, 2, 2, 3, 1])
    with torch.no_grad():
        r = run_with_early_exit(model, inputs, StopAtTimes(times))
        full = unroll(model, inputs, keep_outputs=True)
    assert rows[:5] == [6, 4, 2, 1, 1]  # tasks drop out of the batch after their stop step
    assert r.steps_computed == int(times.sum())
    for b, t in enumerate(times.tolist()):
        torch.testing.assert_close(r.outputs["pred"][b], full.step_outputs[t - 1]["pred"][b])


@pytest.mark.parametrize("name", NETWORKS.names())
def test_every_registered_network_adapts(name):
    """Smoke test per registered learner: one inner step lowers the support loss of every task."""
    torch.manual_seed(0)
    net = NETWORKS.get(name)()
    x_shape = {"conv4": (1, 28, 28), "mlp": (1,)}[name]
    out_dim = net.params[[k for k in net.params if k.endswith("bias")][-1]].shape[0]
    g = torch.Generator().manual_seed(0)
    B, S = 2, 6
    y = torch.randint(0, out_dim, (B, S), generator=g) if name == "conv4" else torch.randn(B, S, 1, generator=g)
    inputs = {"support_x": torch.rand(B, S, *x_shape, generator=g), "support_y": y, "support_mask": torch.ones(B, S),
              "query_x": torch.rand(B, 3, *x_shape, generator=g), "shots": torch.full((B,), S)}
    model = MAMLModel(net, 1, 0.01, loss="cross_entropy" if name == "conv4" else "mse")
    with torch.no_grad():
        before = model._support_features(model.initial_state(inputs), model._split()[1], inputs)["support_loss"]
        after = model._support_features(model.step(1, model.initial_state(inputs), inputs), model._split()[1], inputs)["support_loss"]
    assert (after < before).all()
